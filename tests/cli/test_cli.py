import json
import subprocess
import sys
from pathlib import Path

from quantbench.cli import main
from tests.helpers import write_recipe

REPO = Path(__file__).resolve().parents[2]


def test_help_teaches_and_imports_no_engine():
    code = (
        "import sys, contextlib, io\n"
        "from quantbench.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    try: main(['--help'])\n"
        "    except SystemExit: pass\n"
        "assert 'quantize' in out.getvalue() and 'exit codes' in out.getvalue(), out.getvalue()\n"
        # every command's module and the job modules are imported: what they compute with is imported when it runs
        "assert 'quantbench.jobs.pipeline' in sys.modules and 'quantbench.tune.measure' in sys.modules\n"
        "heavy = ('llmcompressor', 'compressed_tensors', 'mlflow', 'torch', 'transformers', 'bitsandbytes', "
        "'gptqmodel', 'vllm', 'lm_eval', 'datasets', 'numpy', 'ray')\n"
        "heavy = [m for m in heavy if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_validate_reports_every_file_and_exits_2(workdir, capsys):
    write_recipe(workdir, "good", "quantize: {method: fp8}\n")
    write_recipe(workdir, "bad", "quantize:\n  method: gptq\n  grup_size: 64\n  scheme: W3A16\n")
    code = main(["validate", "--no-model", "--json"])
    out, err = capsys.readouterr()
    assert code == 2
    assert "ok: recipes/good.yaml" in out
    assert "error: recipes/bad.yaml: quantize.grup_size (line 3)" in err
    assert "error: recipes/bad.yaml: quantize.scheme (line 4)" in err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["ok"] is False and len(summary["problems"]["recipes/bad.yaml"]) == 2


def test_validate_checks_group_size_against_the_model(workdir, tiny_model_dir, capsys):
    write_recipe(workdir, "g64", f"model: {{source: {tiny_model_dir}}}\nquantize:\n  method: gptq\n  group_size: 64\n")
    assert main(["validate", "recipes/g64.yaml"]) == 2
    err = capsys.readouterr().err
    assert "quantize.group_size (line 4): 64 does not divide the input width" in err
    assert "width 96" in err and "Group sizes that fit every layer: 32, 16" in err


def test_recipes_lists_shipped_recipes(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    assert main(["recipes", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    by_name = {r["name"]: r for r in rows}
    assert {"method": "awq", "scheme": "W4A16"}.items() <= by_name["awq-int4"].items()
    assert by_name["autoround-w4a16"]["method"] == "autoround" and by_name["spinquant-w4a16"]["method"] == "spinquant"


def test_ui_refuses_a_non_loopback_host_unless_told_and_says_how_to_expose_it(workdir, capsys):
    for host in ("0.0.0.0", "::", "192.168.1.10", "mlflow.example.org"):
        assert main(["ui", "--host", host]) == 2  # no server started (the fast tier's guard would fail it)
        err = capsys.readouterr().err
        assert f"error: --host {host}: not a loopback address, and the MLflow UI has no login of its own" in err
        assert "a reverse proxy with auth and TLS" in err and "docs/gate.md" in err and "--expose-unauthenticated" in err
    assert sorted(p.name for p in workdir.iterdir()) == ["recipes"]  # nothing written


def test_validate_reports_schema_and_model_problems_together(workdir, tiny_model_dir, capsys):
    # a schema error, a calibration file that does not exist, a group size the widths do not take
    write_recipe(workdir, "three", f"model: {{source: {tiny_model_dir}}}\ncheck: {{window: 0}}\n"
                 "calibration: {source: missing.txt}\nquantize: {method: gptq, group_size: 64}\n")
    assert main(["validate", "recipes/three.yaml"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(err) == 3, err
    assert err[0].startswith("error: recipes/three.yaml: check.window (line 2): Input should be greater than 0")
    assert "error: recipes/three.yaml: quantize.group_size (line 4): 64 does not divide" in err[1]
    assert err[2].startswith("error: recipes/three.yaml: calibration.source: 'missing.txt' does not exist")


def test_validate_runs_the_checks_quantize_runs_before_loading_the_model(workdir, tiny_model_dir, capsys):
    import shutil

    truncated = workdir / "truncated"
    shutil.copytree(tiny_model_dir, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100_000])
    write_recipe(workdir, "huge", f"model: {{source: {tiny_model_dir}}}\ncalibration: {{samples: 100000, seq_len: 64}}\n"
                 "quantize: {method: gptq, group_size: 32}\n")
    write_recipe(workdir, "cut", f"model: {{source: {truncated}}}\nquantize: {{method: fp8}}\n")
    assert main(["validate", "recipes/huge.yaml", "recipes/cut.yaml"]) == 2
    err = capsys.readouterr().err
    assert "error: recipes/huge.yaml: calibration.samples: asked for 100000 samples of 64 tokens but the text holds only" in err
    assert f"error: recipes/cut.yaml: model.source: {weights} is truncated: its header describes" in err
    for name in ("huge", "cut"):  # what validate refuses, quantize refuses in the same words
        assert main(["quantize", name]) == 2
        assert err.split(f"recipes/{name}.yaml: ", 1)[1].splitlines()[0] in capsys.readouterr().err
