"""`quantbench noise` on the tiny model with a real MLflow store, lm-eval and the in-process bench:
the base model against itself gives the floor (zero KLD, no flips, speedups around 1 with their
intervals); a calibrated recipe at two seeds gives its seed-to-seed spread; the same recipe at the
same seed gives the same weights; compare shows the noise run as a row."""

from pathlib import Path

import pytest

from quantbench.cli import main
from tests.helpers import last_json, runs, tiny_recipe, write_recipe

SUITE = "tokens: 640\nwindow: 64\ntasks: [qb_pydoc_lastword, qb_pydoc_continuation]\ntask_limit: 6\ntask_batch_size: 4\n"
PROFILE = "prompt_tokens: [16]\noutput_tokens: 4\nconcurrency: [1]\nrepetitions: 3\nwarmup: 0\nbase_dtype: float32\n"


@pytest.fixture
def settings(workdir):
    for kind, text in (("suites", SUITE), ("profiles", PROFILE)):
        (workdir / kind).mkdir()
        (workdir / kind / "tiny.yaml").write_text(text)


@pytest.mark.slow  # three jobs and two benches: ~14 s (the fast tier stays under 3 minutes on 2 cores)
def test_noise_floor_seed_spread_and_reproducible_weights(workdir, tiny_model_dir, settings, capsys):
    write_recipe(workdir, "gptq", tiny_recipe(tiny_model_dir, "method: gptq\ngroup_size: 32\n") + "evaluate:\n  suite: tiny\n")
    assert main(["quantize", "gptq", "--set", "evaluate=null", "--json"]) == 0  # seed 0, for its weights
    first = last_json(capsys.readouterr().out)

    assert main(["noise", str(tiny_model_dir), "--suite", "tiny", "--profile", "tiny", "--recipe", "gptq", "--engine", "hf", "--json"]) == 0
    out = capsys.readouterr().out
    noise = last_json(out)
    by_id = {r.info.run_id: r for r in runs()}
    run = by_id[noise["run_id"]]
    assert run.info.status == "FINISHED" and run.data.tags["quantbench.role"] == "noise"
    assert run.data.tags["quantbench.noise_recipe"] == "gptq"
    assert run.data.tags["quantbench.base_fingerprint"] == by_id[first["run_id"]].data.tags["quantbench.base_fingerprint"]
    m = run.data.metrics
    # the base against itself, re-saved in its own dtype (float32): the evaluation's own floor is exact
    assert m["quality/kld_mean"] == pytest.approx(0, abs=1e-6) and m["quality_ood/kld_mean"] == pytest.approx(0, abs=1e-6)
    assert m["quality/top1_agreement"] == 1.0 and m["quality/flips_pct"] == 0.0 and m["quality/flips_p_value"] == 1.0
    assert m["recovery/quality/ppl"] == pytest.approx(1.0, abs=1e-6)
    assert m["recovery/quality/ppl.ci_low"] == pytest.approx(1.0, abs=1e-6) == m["recovery/quality/ppl.ci_high"]
    # speed against itself, 3 paired repetitions: an interval for every speedup (4 tokens on a tiny
    # model take milliseconds, so their values are noise; that they are there is the point)
    assert 0 < m["speedup/decode_tok_s.ci_low"] < m["speedup/decode_tok_s.ci_high"]
    assert {k.removesuffix(".ci_low") for k in m if k.startswith("speedup/") and k.endswith(".ci_low")} == {
        k for k in m if k.startswith("speedup/") and ".ci_" not in k and not k.endswith("_p95")}

    # the recipe at its seed (0) and the next: two candidate runs of this noise run
    seeds = {r["seed"]: r for r in noise["recipe_runs"]}
    assert set(seeds) == {0, 1}
    for r in seeds.values():
        assert by_id[r["run_id"]].data.tags["quantbench.noise_run"] == noise["run_id"]
    assert m["noise_seed/quality/kld_mean"] == pytest.approx(
        abs(seeds[0]["metrics"]["quality/kld_mean"] - seeds[1]["metrics"]["quality/kld_mean"]))
    assert m["noise_seed/quality/kld_mean"] > 0 and "noise_seed/quality/positions" not in m
    assert "calibration seed to seed" in out
    # the same recipe at the same seed: the same weights, tensor for tensor
    sha = by_id[first["run_id"]].data.tags["quantbench.weights_sha"]
    assert len(sha) == 64 and seeds[0]["weights_sha"] == sha != seeds[1]["weights_sha"]
    assert by_id[seeds[0]["run_id"]].data.tags["quantbench.weights_sha"] == sha
    assert seeds[0]["metrics"]["check/reload_ppl"] == first["metrics"]["check/reload_ppl"]
    assert "seed 0; torch.use_deterministic_algorithms" in by_id[first["run_id"]].data.tags["quantbench.deterministic"]

    assert main(["compare", "--json"]) == 0
    shown = last_json(capsys.readouterr().out)
    assert [n["run_id"] for n in shown["noise"]] == [noise["run_id"]]
    assert noise["run_id"] not in {c["run_id"] for c in shown["candidates"]}
    assert not list((workdir / "outputs" / "noise").rglob("*.safetensors"))  # the re-saved copy is gone


def test_bad_input_writes_nothing(workdir, tiny_model_dir, settings, capsys):
    write_recipe(workdir, "fp8", tiny_recipe(tiny_model_dir, "method: fp8\n"))
    assert main(["noise", str(tiny_model_dir), "--suite", "tiny", "--profile", "tiny", "--recipe", "fp8", "--engine", "hf"]) == 2
    assert "does not calibrate, so its calibration seed changes nothing" in capsys.readouterr().err
    assert main(["noise", str(tiny_model_dir), "--suite", "tiyn"]) == 2
    assert "unknown suite 'tiyn'" in capsys.readouterr().err
    assert runs() == [] and not Path("outputs").exists()
