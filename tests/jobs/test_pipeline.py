"""The whole quantize job on a tiny Llama: every method, the checkpoint on disk, the MLflow run,
and every kind of bad input."""

import json
import os
import re
from pathlib import Path

import pytest

from quantbench.cli import main
from tests.helpers import assert_sketched, last_json, runs, tiny_recipe, write_recipe

METHODS = {
    # name: (quantize section, expected compressed-tensors format, weight bits, group size)
    "gptq-w4": ("method: gptq\nscheme: W4A16\ngroup_size: 32\n", "pack-quantized", 4, 32),
    "gptq-w8": ("method: gptq\nscheme: W8A16\ngroup_size: null\n", "pack-quantized", 8, None),
    "awq": ("method: awq\ngroup_size: 32\nn_grid: 4\n", "pack-quantized", 4, 32),
    "fp8": ("method: fp8\n", "float-quantized", 8, None),
    "smoothquant": ("method: smoothquant\n", "int-quantized", 8, None),
}


def quantize(args, capsys):
    code = main(["quantize", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("name", METHODS)
def test_quantize_writes_a_reloadable_checkpoint_and_one_finished_run(name, workdir, tiny_model_dir, capsys):
    section, fmt, bits, group = METHODS[name]
    write_recipe(workdir, name, tiny_recipe(tiny_model_dir, section))
    code, out, err = quantize([name, "--json"], capsys)
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    ckpt = Path(result["checkpoint"])
    assert ckpt == Path("outputs") / name / result["run_id"]
    assert sorted(p.name for p in (workdir / "outputs" / name).iterdir()) == sorted([result["run_id"], result["run_id"] + ".log"])

    qcfg = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "compressed-tensors" and qcfg["format"] == fmt
    weights = qcfg["config_groups"]["group_0"]["weights"]
    assert weights["num_bits"] == bits and weights["group_size"] == group
    assert qcfg["ignore"] == ["lm_head"]
    assert_sketched(workdir / "recipes" / f"{name}.yaml", qcfg)
    card = (ckpt / "README.md").read_text()
    assert card.startswith("---\nlicense: mit\n") and result["run_id"] in card

    [run] = runs()
    assert run.info.run_id == result["run_id"] and run.info.status == "FINISHED"
    metrics = run.data.metrics
    for key in ("quantize/wall_s", "quantize/peak_rss_mb", "model/size_mb", "model/compression_ratio",
                "check/base_ppl", "check/reload_ppl", "check/ppl_ratio"):
        assert key in metrics and metrics[key] > 0, key
    assert metrics == pytest.approx(result["metrics"])
    # the reload check measured something real: a random 512-token model is near-uniform
    assert 300 < metrics["check/base_ppl"] < 900 and metrics["check/ppl_ratio"] < 1.2
    tags = run.data.tags
    assert tags["quantbench.recipe"] == name and tags["quantbench.method"] == section.split()[1]
    assert tags["quantbench.format"] == "compressed-tensors" and tags["quantbench.license"] == "mit"
    assert len(tags["quantbench.recipe_sha"]) == 64 and "quantbench.git_sha" in tags
    assert "quantbench.version.llmcompressor" in tags and "quantbench.cpu" in tags
    assert run.data.params["calibration.samples"] == "4"

    from mlflow.tracking import MlflowClient

    artifacts = {a.path for a in MlflowClient(os.environ["MLFLOW_TRACKING_URI"]).list_artifacts(run.info.run_id)}
    assert {"resolved_recipe.json", "README.md", f"{result['run_id']}.log"} <= artifacts
    log = (workdir / "outputs" / name / f"{result['run_id']}.log").read_text()
    assert "reloading the saved checkpoint" in log and "Compression lifecycle finalized" in log  # ours and llm-compressor's


def test_weights_that_are_not_quantized_are_saved_in_bf16(workdir, tiny_model_dir, capsys):
    from safetensors import safe_open

    write_recipe(workdir, "bf16", tiny_recipe(tiny_model_dir, METHODS["gptq-w4"][0]).replace("dtype: float32", "dtype: bfloat16"))
    code, out, err = quantize(["bf16", "--json"], capsys)
    assert code == 0, err
    ckpt = Path(json.loads(out.strip().splitlines()[-1])["checkpoint"])
    with safe_open(ckpt / "model.safetensors", "pt") as f:
        dtypes = {name: str(f.get_slice(name).get_dtype()) for name in f.keys()}
    assert dtypes["model.embed_tokens.weight"] == "BF16" and dtypes["model.norm.weight"] == "BF16"
    assert dtypes["model.layers.0.mlp.down_proj.weight_packed"] == "I32"


# ---------------------------------------------------------------------------------------------
# Bad input: one clear message naming file and field, exit 2, nothing written, no run


def bad_cases(model_dir: Path, tmp: Path):
    ok = "quantize:\n  method: gptq\n  group_size: 32\n"
    empty = tmp / "empty.txt"
    empty.write_text("")
    return {
        "yaml-syntax": (f"model: {{source: {model_dir}}}\nquantize:\n  method: [gptq\n", "line 4, column 1: YAML syntax error"),
        "unknown-key": (f"model: {{source: {model_dir}, dtyp: float32}}\n{ok}", "model.dtyp (line 1): unknown key 'dtyp'"),
        "wrong-type": (f"model: {{source: {model_dir}}}\ncalibration: {{samples: lots}}\n{ok}", "calibration.samples (line 2)"),
        "unknown-method": (f"model: {{source: {model_dir}}}\nquantize:\n  method: hqq\n", "quantize.method (line 3): unknown method 'hqq'"),
        "unknown-scheme": (f"model: {{source: {model_dir}}}\nquantize:\n  method: awq\n  scheme: W3A16\n", "quantize.scheme (line 4): unknown value 'W3A16'"),
        "group-size": (f"model: {{source: {model_dir}}}\nquantize:\n  method: gptq\n  group_size: 64\n", "quantize.group_size (line 4): 64 does not divide the input width"),
        "missing-model": (f"model: {{source: {tmp / 'no-such-model'}}}\n{ok}", "model.source: '"),
        "hub-offline": (f"model: {{source: 'hub:HuggingFaceTB/SmolLM2-135M'}}\n{ok}", "needs the Hugging Face hub"),
        "empty-calibration": (f"model: {{source: {model_dir}}}\ncalibration: {{source: {empty}}}\n{ok}", "calibration.source: '"),
    }


@pytest.mark.parametrize("case", ["unknown-recipe", "yaml-syntax", "unknown-key", "wrong-type", "unknown-method",
                                  "unknown-scheme", "group-size", "missing-model", "hub-offline", "empty-calibration"])
def test_bad_input_exits_2_and_writes_nothing(case, workdir, tiny_model_dir, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    earlier = workdir / "outputs" / case / "earlier-run" / "keep.txt"
    earlier.parent.mkdir(parents=True)
    earlier.write_text("earlier result")
    if case == "unknown-recipe":
        write_recipe(workdir, "awq-int4", "quantize: {method: awq}\n")
        code, out, err = quantize(["awq-in4"], capsys)
        expected = "unknown recipe 'awq-in4' (no recipes/awq-in4.yaml). Did you mean 'awq-int4'?"
    else:
        body, expected = bad_cases(tiny_model_dir, workdir)[case]
        write_recipe(workdir, case, body)
        code, out, err = quantize([case], capsys)
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and expected in lines[0], err
    if case != "unknown-recipe":
        assert lines[0].startswith(f"error: recipes/{case}.yaml: ")
    assert [p.name for p in (workdir / "outputs").iterdir()] == [case]
    assert [p.name for p in (workdir / "outputs" / case).iterdir()] == ["earlier-run"]
    assert earlier.read_text() == "earlier result"
    assert runs() == []


def test_a_failure_after_the_run_started_marks_it_failed_and_leaves_no_checkpoint(workdir, tiny_model_dir, capsys, monkeypatch):
    """A fault while saving (a full disk, here injected into the engine's save): the run ends FAILED
    with the error, no checkpoint and no staging directory remain, the log is kept."""
    from quantbench.quantize.llmcompressor import LLMCompressorQuantizer

    def full_disk(self, model, tokenizer, dest, dtype):
        (dest / "model.safetensors").write_bytes(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(LLMCompressorQuantizer, "save", full_disk)
    write_recipe(workdir, "blocked", tiny_recipe(tiny_model_dir, METHODS["fp8"][0]))
    code, out, err = quantize(["blocked"], capsys)
    assert code == 1
    [run] = runs()
    assert run.info.status == "FAILED" and "No space left on device" in run.data.tags["quantbench.error"]
    log = workdir / "outputs" / "blocked" / f"{run.info.run_id}.log"
    assert [p.name for p in log.parent.iterdir()] == [log.name]
    # the terminal: the reason in one line and where the traceback is; the traceback: in the log
    assert "Traceback" not in err
    assert f"quantize failed: OSError: [Errno 28] No space left on device (traceback in {log.relative_to(workdir)})" in err
    assert "Traceback" in log.read_text() and "in full_disk" in log.read_text()
    monkeypatch.setenv("QUANTBENCH_DEBUG", "1")  # --debug: the traceback on the terminal too
    code, out, err = quantize(["blocked"], capsys)
    assert code == 1 and "Traceback" in err and "in full_disk" in err


def test_reload_check_rejects_a_checkpoint_that_reloads_broken(workdir, tiny_model_dir):
    """Save a model whose weights were damaged after quantization: the check must refuse it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantbench.core.measures import perplexity
    from quantbench.jobs.prepare import prepare
    from quantbench.quality.check import CheckpointCheckFailed, reload_check

    write_recipe(workdir, "fp8", tiny_recipe(tiny_model_dir, METHODS["fp8"][0]))
    job = prepare("fp8")
    spec = job.loaded.recipe.check
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    base_ppl = perplexity(model, job.check_ids, 64)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(40.0)  # a broken save: logits blow up
    broken = workdir / "broken"
    model.save_pretrained(broken)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(broken)
    with pytest.raises(CheckpointCheckFailed, match="max_ppl_ratio"):
        reload_check(broken, spec, job.check_ids, base_ppl)
    # and the unbroken model passes the same check
    good = workdir / "good"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(good)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(good)
    assert reload_check(good, spec, job.check_ids, base_ppl).metrics["check/ppl_ratio"] == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("section", ["method: fp8\nkv_cache: fp8\n", "method: gptq\ngroup_size: 32\nkv_cache: fp8\n"])
def test_fp8_kv_cache_combines_with_the_weight_scheme(section, workdir, tiny_model_dir, capsys):
    """kv_cache: fp8 adds calibrated per-tensor K/V scales to the checkpoint (vLLM's FP8 KV cache)."""
    from safetensors import safe_open

    write_recipe(workdir, "kv", tiny_recipe(tiny_model_dir, section))
    code, out, err = quantize(["kv", "--json"], capsys)
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    ckpt = Path(result["checkpoint"])
    qcfg = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    kv = qcfg["kv_cache_scheme"]
    assert kv["num_bits"] == 8 and kv["type"] == "float" and kv["strategy"] == "tensor" and kv["dynamic"] is False
    assert_sketched(workdir / "recipes" / "kv.yaml", qcfg)
    with safe_open(ckpt / "model.safetensors", "pt") as f:
        scales = {k: f.get_tensor(k).item() for k in f.keys() if k.endswith(("k_scale", "v_scale"))}
    assert len(scales) == 2 * 2 and all(0 < v < 1 for v in scales.values())  # 2 layers x (k, v), calibrated
    assert json.loads((ckpt / "quantbench.json").read_text())["kv_cache"] == "fp8"
    card = (ckpt / "README.md").read_text()
    assert "KV cache: FP8" in card and "--kv-cache-dtype fp8" in card
    [run] = runs()
    assert run.data.tags["quantbench.kv_cache"] == "fp8" and "vLLM" in run.data.tags["quantbench.loaders"]
    assert run.data.params["calibration.samples"] == "4" and result["metrics"]["check/ppl_ratio"] < 1.2


# ---------------------------------------------------------------------------------------------
# Faults found by probing (issue: trust the inputs and the store)


def test_broken_model_sources_exit_2_before_any_run(workdir, tiny_model_dir, capsys, tmp_path_factory, monkeypatch):
    from tests.sources.test_models import CASES, broken_sources

    monkeypatch.setenv("QUANTBENCH_CACHE", str(workdir / "cache"))
    sources = broken_sources(tiny_model_dir, tmp_path_factory.mktemp("broken"))
    sources["recipe-injection"] = ("recipe:x' or 1=1", "no FINISHED run of the recipe 'x' or 1=1'")
    for case in [*CASES, "recipe-injection"]:
        source, expected = sources[case]
        write_recipe(workdir, case, f"model: {{source: \"{source}\"}}\nquantize: {{method: fp8}}\n")
        code, out, err = quantize([case], capsys)
        lines = [line for line in err.splitlines() if line.startswith("error: ")]
        assert code == 2 and len(lines) == 1 and expected in lines[0], (case, err)
        assert lines[0].startswith(f"error: recipes/{case}.yaml: model.source: ")
        assert "Traceback" not in err
    assert runs() == [] and not (workdir / "outputs").exists()


def test_outputs_that_cannot_hold_the_checkpoint_are_bad_input(workdir, tiny_model_dir, capsys):
    write_recipe(workdir, "blocked", tiny_recipe(tiny_model_dir, METHODS["fp8"][0]))
    (workdir / "outputs").mkdir()
    (workdir / "outputs" / "blocked").write_text("a file where the recipe's output dir should go")
    code, out, err = quantize(["blocked"], capsys)
    assert code == 2 and "outputs/blocked: exists and is not a directory" in err
    assert (workdir / "outputs" / "blocked").read_text().startswith("a file")
    (workdir / "elsewhere").write_text("a file")
    code, out, err = quantize(["blocked", "--outputs", "elsewhere"], capsys)
    assert code == 2 and "elsewhere: exists and is not a directory" in err
    # a directory that cannot be created under a file: refused in prepare, not a FAILED run
    code, out, err = quantize(["blocked", "--outputs", "elsewhere/sub"], capsys)
    assert code == 2 and "error: elsewhere: exists and is not a directory; outputs go to elsewhere/sub/blocked/" in err
    assert "Traceback" not in err
    # a recipe file whose name is not a plain name (`...yaml` has the stem `..`) writes nothing
    (workdir / "...yaml").write_text(tiny_recipe(tiny_model_dir, METHODS["fp8"][0]))
    code, out, err = quantize(["...yaml"], capsys)
    assert code == 2 and "the file name '..' cannot name an output directory" in err
    assert sorted(p.name for p in workdir.iterdir()) == ["...yaml", "elsewhere", "outputs", "recipes"]
    assert runs() == []


def watch(proc, path: Path, text: str, timeout: float = 240) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the job ended (exit {proc.returncode}) before '{text}' appeared")
        for file in path.glob("*.log") if path.is_dir() else []:
            if text in file.read_text(errors="replace"):
                return
        time.sleep(0.1)
    raise AssertionError(f"'{text}' never appeared under {path}")


@pytest.mark.slow  # a child quantize process, signalled mid-job
def test_sigterm_during_evaluate_leaves_no_checkpoint_and_exit_130(workdir, tiny_model_dir):
    """An interrupted follow-on stage ends the whole job: run KILLED, exit 130, no checkpoint (it is
    renamed into place only when every stage finished), the log kept."""
    import signal
    import subprocess
    import sys

    (workdir / "suites").mkdir()
    (workdir / "suites" / "tiny.yaml").write_text("tokens: 640\nwindow: 64\ntask_limit: 6\ntask_batch_size: 4\n")
    write_recipe(workdir, "ev", tiny_recipe(tiny_model_dir, METHODS["fp8"][0]) + "evaluate:\n  suite: tiny\n")
    proc = subprocess.Popen([sys.executable, "-m", "quantbench", "quantize", "ev"], cwd=workdir, env=dict(os.environ),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watch(proc, workdir / "outputs" / "ev", "[3/3] evaluate")
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, output
    candidate = [r for r in runs() if r.data.tags.get("quantbench.role") == "candidate"]
    assert [r.info.status for r in candidate] == ["KILLED"]
    assert [p.name for p in (workdir / "outputs" / "ev").iterdir()] == [f"{candidate[0].info.run_id}.log"]


@pytest.mark.slow  # a child quantize process, signalled mid-job
def test_sigkill_mid_job_is_reaped_and_the_recipe_runs_again(workdir, tiny_model_dir, capsys):
    import signal
    import subprocess
    import sys
    import time

    write_recipe(workdir, "k", tiny_recipe(tiny_model_dir, METHODS["gptq-w4"][0]))
    proc = subprocess.Popen([sys.executable, "-m", "quantbench", "quantize", "k"], cwd=workdir, env=dict(os.environ),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    watch(proc, workdir / "outputs" / "k", "[1/2] produce")  # the staging dir is made right after this line
    deadline = time.monotonic() + 60
    while not any(p.name.endswith(".partial") for p in (workdir / "outputs" / "k").iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    [stale] = runs()
    assert stale.info.status == "RUNNING" and any(p.name.endswith(".partial") for p in (workdir / "outputs" / "k").iterdir())
    code, out, err = quantize(["k", "--json"], capsys)  # the next command reaps, then runs the recipe again
    assert code == 0, err
    by_status = {r.info.status: r for r in runs()}
    assert set(by_status) == {"FAILED", "FINISHED"} and "died without ending it" in by_status["FAILED"].data.tags["quantbench.error"]
    assert not any(p.name.endswith(".partial") for p in (workdir / "outputs" / "k").iterdir())


@pytest.mark.parametrize("asks_for_bos", [False, True])
def test_every_window_starts_as_the_tokenizer_encodes(asks_for_bos, workdir, tiny_model_dir, tiny_bos_model_dir,
                                                      monkeypatch, caplog):
    """A tokenizer that asks for BOS: calibration, reload-check and quality windows are all <s> + the
    next window - 1 tokens, of the same length, and the suite fingerprint is another. One that does
    not (SmolLM2's): the very ids and windows of before BOS framing."""
    import logging
    import random

    from transformers import AutoTokenizer

    from quantbench.jobs.prepare import prepare
    from quantbench.quality import stage
    from quantbench.quality.suite import load_suite
    from quantbench.sources import data
    from tests.conftest import TINY_SUITE

    monkeypatch.setenv("QUANTBENCH_CACHE", str(workdir / "cache"))
    (workdir / "suites").mkdir()
    (workdir / "suites" / "tiny.yaml").write_text(TINY_SUITE)
    model_dir = tiny_bos_model_dir if asks_for_bos else tiny_model_dir
    write_recipe(workdir, "g", tiny_recipe(model_dir, "method: gptq\ngroup_size: 32\n") + "evaluate:\n  suite: tiny\n")
    with caplog.at_level(logging.INFO, logger="quantbench"):
        job = prepare("g")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    plan = job.evaluation
    cal_text, eval_text = data.python_docs("calibration"), data.python_docs("evaluation")
    assert len(job.check_ids) == 512 and len(plan.token_ids) == 640 and len(plan.ood_ids) == 640
    assert [len(w) for w in job.calibration] == [64] * 4
    [line] = [r.getMessage() for r in caplog.records if "the check used the windows" in r.getMessage()]
    if asks_for_bos:
        assert all(w[0] == 1 for w in job.calibration)
        for ids in (job.check_ids, plan.token_ids, plan.ood_ids):
            assert ids[::64] == [1] * (len(ids) // 64) and 1 not in [t for k, t in enumerate(ids) if k % 64]
        assert plan.bos == 1 and plan.bos_tag == "<s> (id 1)"
        plain = stage.prepare(load_suite("tiny"), AutoTokenizer.from_pretrained(tiny_model_dir))
        assert plan.fingerprint != plain.fingerprint  # a baseline scored without BOS is not reused
        assert "the check used the windows with BOS (its tokenizer adds one)" in line
    else:
        ids = tokenizer(cal_text)["input_ids"]  # the windows as they were cut before BOS framing
        starts = sorted(random.Random(0).sample(range(len(ids) // 64), 4))
        assert job.calibration == [ids[i * 64 : (i + 1) * 64] for i in starts]
        assert job.check_ids == tokenizer(eval_text)["input_ids"][:512]
        assert plan.token_ids == tokenizer(eval_text)["input_ids"][:640] and plan.bos is None and plan.bos_tag == "none"
        assert "the check used the windows without BOS (its tokenizer adds none)" in line
    assert re.search(r"on its first windows \d[\d.]* with BOS, \d[\d.]* without", line), line  # both, either way


def test_a_schema_error_does_not_hide_the_model_checks(workdir, tiny_model_dir, capsys):
    write_recipe(workdir, "three", f"model: {{source: {tiny_model_dir}}}\ncalibration: {{seed: x, source: missing.txt}}\n"
                 "quantize: {method: gptq, group_size: 64}\nbench: {profile: nosuch}\n")
    code, out, err = quantize(["three"], capsys)
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(lines) == 3, err
    assert lines[0].startswith("error: recipes/three.yaml: calibration.seed (line 2): Input should be a valid integer")
    assert "quantize.group_size (line 3): 64 does not divide the input width" in lines[1]
    assert "bench.profile: unknown profile 'nosuch'" in lines[2]
    assert runs() == [] and not (workdir / "outputs").exists()


def test_the_base_size_is_its_saved_dtype_whatever_this_cpu_computes_in(workdir, tiny_model_dir, capsys):
    """model/base_size_mb (and so the compression ratio) is the base in the recipe's dtype: a
    bfloat16 recipe computed in float32 (as on an AVX2-only CPU) does not look twice as compressed."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    params = sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())
    write_recipe(workdir, "q", tiny_recipe(tiny_model_dir, "method: fp8\n").replace("dtype: float32", "dtype: bfloat16"))
    sizes = {}
    for compute in ("float32", "bfloat16"):
        assert main(["quantize", "q", "--json", "--set", f"model.compute_dtype={compute}"]) == 0
        sizes[compute] = last_json(capsys.readouterr().out)["metrics"]["model/base_size_mb"]
    assert sizes["float32"] == sizes["bfloat16"] == pytest.approx(params * 2 / 2**20, rel=1e-3)


def test_a_base_that_is_itself_quantized_is_said_tagged_and_marked_in_compare(workdir, tmp_path, capsys):
    """A GGUF below 16 bits given as the base (issue: a Q4_K_M file's own Q4_K_M scored KLD 0.0009
    against it, true against the de-quantized file and misleading against the model the user means):
    said at the start, tagged on the run, marked in compare; a float GGUF is none of that."""
    from quantbench.jobs.prepare import base_tags, candidate_type
    from quantbench.recipe import load_recipe
    from quantbench.release import compare
    from quantbench.sources import models
    from tests import gguf_files as gg

    vocab = gg.gpt2_bpe_vocab(400, add_bos=False)
    quantized = gg.write_tiny_gguf(tmp_path / "q8.gguf", vocab, q8_0=True)
    plain = gg.write_tiny_gguf(tmp_path / "f32.gguf", vocab, seed=1)
    for name, source in (("given-q8", quantized), ("given-f32", plain)):
        write_recipe(workdir, name, tiny_recipe(source, "method: fp8\n"))
        code, out, err = quantize([name], capsys)
        assert code == 0, err
        said = f"the base model {source} is itself quantized (GGUF Q8_0, de-quantized to float here)"
        assert (said in err) == (name == "given-q8")
    tags = {r.data.tags["quantbench.recipe"]: r.data.tags for r in runs()}
    assert tags["given-q8"]["quantbench.base_quantized"] == "GGUF Q8_0"
    assert tags["given-f32"]["quantbench.base_quantized"] == "none"
    assert "quantbench.same_type_as_base" not in tags["given-q8"]  # FP8 is not its base's type
    result = compare.run(outputs=workdir / "outputs")
    text = compare.terminal(result.comparison)
    assert "given-q8 †" in text and "given-f32 †" not in text
    assert "† the base model is itself quantized (GGUF Q8_0, de-quantized to float)" in text
    # a GGUF recipe of the base's own type is named as such (llama.cpp itself runs in the slow tier)
    write_recipe(workdir, "own-type", tiny_recipe(quantized, "method: gguf\ntype: Q8_0\n"))
    q = load_recipe(workdir / "recipes" / "own-type.yaml").recipe.quantize
    assert candidate_type(q) == "GGUF Q8_0"
    assert base_tags(models.resolve(str(quantized)), candidate_type(q)) == {
        "quantbench.base_quantized": "GGUF Q8_0", "quantbench.same_type_as_base": "true"}
    assert compare.base_mark({**base_tags(models.resolve(str(quantized)), "GGUF Q8_0")}) == " ‡"


def test_an_unknown_profile_or_suite_is_said_beside_a_bad_target(workdir, capsys):
    """bench and evaluate check their settings and their target together: both problems at once,
    not the second only once the first is fixed."""
    assert main(["bench", "no-such-dir", "--profile", "nope"]) == 2
    err = capsys.readouterr().err
    assert "error: --profile: unknown profile 'nope'" in err
    assert "error: 'no-such-dir' is neither a checkpoint directory, a .gguf file nor an MLflow run id" in err
    assert main(["evaluate", "no-such-dir", "--suite", "nope"]) == 2
    err = capsys.readouterr().err
    assert "error: --suite: unknown suite 'nope'" in err
    assert "error: 'no-such-dir' is neither a checkpoint directory, a .gguf file nor an MLflow run id" in err
    assert runs() == []
