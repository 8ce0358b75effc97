"""`quantbench evaluate` and the recipe's evaluate: section on the tiny model, with real lm-eval
runs on the offline suite and a real MLflow store."""

import json
import os
from pathlib import Path

import pytest

from quantbench.cli import main
from tests.helpers import last_json, runs, tiny_recipe, verdict_rows, write_recipe

TINY_SUITE = """\
tokens: 640
window: 64
tasks: [qb_pydoc_lastword, qb_pydoc_continuation]
task_limit: 6
task_batch_size: 4
"""
GPTQ = "method: gptq\ngroup_size: 32\n"


@pytest.fixture
def suite(workdir):
    (workdir / "suites").mkdir()
    (workdir / "suites" / "tiny.yaml").write_text(TINY_SUITE)
    return "tiny"



def by_role(role):
    return [r for r in runs() if r.data.tags.get("quantbench.role") == role]


def test_a_bfloat16_saved_base_is_scored_in_float32(workdir, tiny_model_dir, suite, capsys):
    """A base saved in bfloat16 (a distilled student, quantized further) was loaded as saved: its
    bfloat16 logits could not be rebuilt from its hidden states in float32, and the baseline failed
    ("post-processes its logits after the output head"). Its reference is computed in float32,
    as the default base's always was."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    student = workdir / "student-bf16"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).save_pretrained(student)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(student)
    assert json.loads((student / "config.json").read_text())["dtype"] == "bfloat16"
    write_recipe(workdir, "s", tiny_recipe(student, "method: fp8\n") + f"evaluate:\n  suite: {suite}\n")
    assert main(["quantize", "s", "--json"]) == 0, capsys.readouterr().err[-2000:]
    [baseline] = by_role("baseline")
    [candidate] = by_role("candidate")
    assert baseline.info.status == "FINISHED" and 1 < baseline.data.metrics["quality/ppl"]
    assert 0 < candidate.data.metrics["quality/kld_mean"] < 1


def test_quantize_evaluates_the_reloaded_checkpoint_and_reuses_the_baseline(workdir, tiny_model_dir, suite, capsys):
    write_recipe(workdir, "a", tiny_recipe(tiny_model_dir, GPTQ) + f"evaluate:\n  suite: {suite}\n")
    write_recipe(workdir, "b", tiny_recipe(tiny_model_dir, "method: fp8\n") + f"evaluate:\n  suite: {suite}\n")
    assert main(["quantize", "a", "--json"]) == 0
    first = last_json(capsys.readouterr().out)
    assert main(["quantize", "b", "--json"]) == 0
    second = last_json(capsys.readouterr().out)

    [baseline] = by_role("baseline")  # scored once, reused by the second candidate
    candidates = {r.info.run_id: r for r in by_role("candidate")}
    assert set(candidates) == {first["run_id"], second["run_id"]}
    for run in candidates.values():
        assert run.info.status == "FINISHED"
        assert run.data.tags["quantbench.baseline_run"] == baseline.info.run_id
        assert run.data.tags["quantbench.suite"] == "tiny"
        assert run.data.tags["quantbench.bos"] == "none"  # its tokenizer adds no BOS: windows are the text itself
    assert baseline.data.tags["quantbench.suite_sha"] == candidates[first["run_id"]].data.tags["quantbench.suite_sha"]
    assert baseline.data.tags["quantbench.base_fingerprint"] == candidates[first["run_id"]].data.tags["quantbench.base_fingerprint"]

    m = candidates[first["run_id"]].data.metrics
    for key in ("quality/ppl", "quality/kld_mean", "quality/kld_p90", "quality/kld_p99", "quality/kld_max",
                "quality/top1_agreement", "quality/flips_pct", "task/qb_pydoc_lastword/acc",
                "task/qb_pydoc_continuation/acc", "recovery/quality/ppl", "recovery/task/qb_pydoc_lastword/perplexity"):
        assert key in m, key
    assert m["quality/positions"] == 10 * 63
    assert 0 < m["quality/kld_mean"] <= m["quality/kld_p99"] <= m["quality/kld_max"]
    assert 0 < m["quality/top1_agreement"] <= 1
    # recovery: the share of the base's score kept, above 1 better (for perplexity: base / candidate)
    assert m["recovery/quality/ppl"] == pytest.approx(baseline.data.metrics["quality/ppl"] / m["quality/ppl"])
    assert m["recovery/task/qb_pydoc_lastword/perplexity"] == pytest.approx(
        baseline.data.metrics["task/qb_pydoc_lastword/perplexity"] / m["task/qb_pydoc_lastword/perplexity"])
    from quantbench.quality.stage import (
        recovery,  # higher-is-better metrics: candidate / base; a zero base has none
    )
    assert recovery({"task/t/acc": 0.3, "quality/kld_mean": 0.1}, {"task/t/acc": 0.6, "quality/kld_mean": 0.0}) == {
        "recovery/task/t/acc": 0.5}
    assert recovery({"task/t/acc": 0.3}, {"task/t/acc": 0.0}) == {}
    assert m["quality/flips_items"] == 12  # 6 items of each task, compared item by item
    assert m["quality/flips_pct"] == pytest.approx(m["quality/flips_right_to_wrong_pct"] + m["quality/flips_wrong_to_right_pct"])

    from mlflow.tracking import MlflowClient

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    report = json.loads(Path(client.download_artifacts(first["run_id"], "evaluation.json", str(workdir))).read_text())
    assert report["baseline_run"] == baseline.info.run_id and report["baseline_reused"] is False
    assert report["bos"] == "none" and report["bos_id"] is None
    assert set(report["samples"]) == {"qb_pydoc_lastword", "qb_pydoc_continuation"}
    assert len(report["samples"]["qb_pydoc_lastword"]) == 6 and len(report["kld_per_position"]) == 630
    card = (Path(first["checkpoint"]) / "README.md").read_text()
    assert "| `quality/kld_mean` |" in card and "| `check/reload_ppl` |" in card
    assert f"| `quality/kld_mean` | {m['quality/kld_mean']:.4g} [{m['quality/kld_mean.ci_low']:.4g}, " in card
    assert ".ci_low` |" not in card  # the interval sits beside its metric, not in a row of its own
    assert {a.path for a in client.list_artifacts(baseline.info.run_id, "baseline")} == {
        "baseline/reference.safetensors", "baseline/reference_ood.safetensors", "baseline/task_samples.json"}

    # out of domain: the same quality pass over the suite's ood_text, under its own names
    assert m["quality_ood/positions"] == 10 * 63 and 0 < m["quality_ood/kld_mean"] <= m["quality_ood/kld_max"]
    assert m["recovery/quality_ood/ppl"] == pytest.approx(baseline.data.metrics["quality_ood/ppl"] / m["quality_ood/ppl"])
    # intervals: 10 windows are enough for the quality pass, 6 items a task are not (said so, none logged)
    for key in ("quality/ppl", "quality/kld_mean", "quality/kld_p99", "quality/top1_agreement", "recovery/quality/ppl",
                "quality_ood/kld_mean", "recovery/quality_ood/ppl", "quality/flips_pct"):
        assert m[key + ".ci_low"] <= m[key] <= m[key + ".ci_high"], key
    assert not [k for k in m if k.startswith(("task/", "recovery/task/")) and ".ci_" in k]
    assert "quality/kld_max.ci_low" not in m and 0 < m["quality/flips_p_value"] <= 1
    assert report["intervals"]["windows"] == 10 and report["intervals"]["resamples"] == 2000
    assert "task/qb_pydoc_lastword/*: 6 items, too few for an interval (at least 10)" in report["intervals"]["not_computed"]
    assert set(report["item_values"]["qb_pydoc_lastword"]["0"]) == {"acc", "perplexity"}


def test_the_base_against_itself_loses_nothing(workdir, tiny_model_dir, suite, capsys):
    """The control every policy must pass: the base scored as its own candidate agrees with itself
    to float32 rounding (KLD ~4e-7 mean, ~2e-6 at p99 on the tiny model), so nothing is lost and
    nothing flips."""
    assert main(["evaluate", str(tiny_model_dir), "--base", str(tiny_model_dir), "--suite", suite, "--json"]) == 0
    m = last_json(capsys.readouterr().out)["metrics"]
    assert m["quality/kld_mean"] == pytest.approx(0, abs=1e-5) and m["quality/kld_p99"] == pytest.approx(0, abs=1e-5)
    assert m["quality/top1_agreement"] == 1 and m["quality/flips_pct"] == 0
    assert m["recovery/quality/ppl"] == pytest.approx(1, rel=1e-6)
    tasks = [m[k] for k in m if k.startswith("recovery/task/") and not k.endswith(("ci_low", "ci_high"))]
    assert len(tasks) >= 2 and tasks == pytest.approx([1.0] * len(tasks))


def test_evaluate_by_run_id_and_by_directory(workdir, tiny_model_dir, suite, capsys):
    write_recipe(workdir, "a", tiny_recipe(tiny_model_dir, GPTQ))
    assert main(["quantize", "a", "--json"]) == 0
    made = last_json(capsys.readouterr().out)
    assert main(["evaluate", made["run_id"], "--suite", suite, "--json"]) == 0
    out = capsys.readouterr().out
    by_id = last_json(out)
    assert by_id["run_id"] == made["run_id"] and by_id["baseline_reused"] is False
    rows = verdict_rows(out)  # the screen ends with the run's verdict, not every metric
    assert rows["KLD vs base, mean"][0] == f"{by_id['metrics']['quality/kld_mean']:.4g}"
    assert "perplexity ratio (cand/base)" in rows and rows["speed vs base"][0] == "not measured"
    assert "quality_ood/kld_p99" not in out.split("{", 1)[0]  # the full list is in the log file and --json
    # the same checkpoint by directory: logs into the same run, baseline reused, same numbers; with
    # the suite's windows cut into position buckets (the baseline serves every bucketing)
    (workdir / "suites" / "tiny-pos.yaml").write_text(TINY_SUITE + "position_buckets: [0, 16, 32, 64]\n")
    assert main(["evaluate", made["checkpoint"], "--suite", "tiny-pos", "--json"]) == 0
    by_dir = last_json(capsys.readouterr().out)
    assert by_dir["run_id"] == made["run_id"] and by_dir["baseline_reused"] is True
    m = by_dir["metrics"]
    assert m["quality/kld_mean"] == pytest.approx(by_id["metrics"]["quality/kld_mean"], rel=1e-6)
    assert m["quality/flips_pct"] == by_id["metrics"]["quality/flips_pct"]
    # windows of 64 score 63 positions: buckets of 16, 16 and 31, whose weighted mean is the whole's
    buckets = {":pos0-15": 16, ":pos16-31": 16, ":pos32-62": 31}
    for metric in ("kld_mean", "top1_agreement"):
        whole = sum(m[f"quality/{metric}{b}"] * n for b, n in buckets.items()) / 63
        assert whole == pytest.approx(m[f"quality/{metric}"], rel=1e-9)
        for b in buckets:  # 10 windows: each bucket has its interval
            assert m[f"quality/{metric}{b}.ci_low"] <= m[f"quality/{metric}{b}"] <= m[f"quality/{metric}{b}.ci_high"]
    assert "quality_ood/kld_mean:pos32-62" in m
    [run] = by_role("candidate")
    assert run.info.status == "FINISHED" and run.data.metrics["quality/kld_mean"] > 0
    assert len(by_role("baseline")) == 1


# ---------------------------------------------------------------------------------------------
# Bad input: a clear message, exit 2, no run created or left RUNNING


def evaluate_error(args, capsys) -> str:
    assert main(["evaluate", *args]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert lines, err
    return "\n".join(lines)


def test_unknown_task_lists_close_matches(workdir, tiny_model_dir, suite, capsys):
    (workdir / "suites" / "bad.yaml").write_text("tasks: [qb_pydoc_lastwrd, hellaswg]\n")
    err = evaluate_error([str(tiny_model_dir), "--base", str(tiny_model_dir), "--suite", "bad"], capsys)
    assert "unknown task 'qb_pydoc_lastwrd'. Did you mean 'qb_pydoc_lastword'?" in err
    assert "unknown task 'hellaswg'. Did you mean 'hellaswag'?" in err
    assert runs() == []


def test_task_needing_the_hub_offline_names_the_offline_suite(workdir, tiny_model_dir, suite, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (workdir / "suites" / "hub.yaml").write_text("tasks: [lambada_openai]\n")
    err = evaluate_error([str(tiny_model_dir), "--base", str(tiny_model_dir), "--suite", "hub"], capsys)
    assert "'lambada_openai' needs its data from the Hugging Face hub" in err and "offline" in err
    assert "qb_pydoc_lastword, qb_pydoc_continuation" in err
    assert runs() == []


def test_not_a_model_dir_and_unknown_run(workdir, tmp_path, suite, capsys):
    assert "is not a model directory (no config.json)" in evaluate_error([str(tmp_path), "--suite", suite], capsys)
    assert "does not exist" in evaluate_error(["0123456789abcdef0123456789abcdef", "--suite", suite], capsys)
    assert "neither a checkpoint directory, a .gguf file nor an MLflow run id" in evaluate_error(["nonsense", "--suite", suite], capsys)
    assert "unknown suite 'tiyn' (no suites/tiyn.yaml). Did you mean 'tiny'?" in evaluate_error([str(tmp_path), "--suite", "tiyn"], capsys)


def test_run_without_checkpoint(workdir, suite, capsys):
    from quantbench.tracking import Tracker

    with Tracker().start_run("no-checkpoint", {"quantbench.role": "candidate", "quantbench.base_model": "x"}) as run:
        pass
    assert f"MLflow run '{run.run_id}' has no checkpoint" in evaluate_error([run.run_id, "--suite", suite], capsys)


def test_a_model_whose_tokenizer_asks_for_bos_is_scored_with_it_and_says_so(workdir, tiny_bos_model_dir, suite, capsys):
    """Same window length and positions as without BOS; the run, its baseline and evaluation.json say <s>."""
    from mlflow.tracking import MlflowClient

    write_recipe(workdir, "b", tiny_recipe(tiny_bos_model_dir, "method: fp8\n") + f"evaluate:\n  suite: {suite}\n")
    assert main(["quantize", "b", "--json"]) == 0
    result = last_json(capsys.readouterr().out)
    [baseline], [candidate] = by_role("baseline"), by_role("candidate")
    assert candidate.data.tags["quantbench.bos"] == baseline.data.tags["quantbench.bos"] == "<s> (id 1)"
    m = candidate.data.metrics
    assert m["quality/positions"] == 10 * 63 and baseline.data.metrics["quality/positions"] == 10 * 63
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    report = json.loads(Path(client.download_artifacts(result["run_id"], "evaluation.json", str(workdir))).read_text())
    assert report["bos"] == "<s> (id 1)" and report["bos_id"] == 1


def test_text_shorter_than_one_window(workdir, tiny_model_dir, suite, capsys):
    (workdir / "short.txt").write_text("Only a few words here.")
    (workdir / "suites" / "short.yaml").write_text(f"text: {workdir / 'short.txt'}\nwindow: 64\n")
    err = evaluate_error([str(tiny_model_dir), "--base", str(tiny_model_dir), "--suite", "short"], capsys)
    assert "suites/short.yaml: text: the evaluation text has" in err and "shorter than one window (window=64)" in err
    assert runs() == []


def test_a_format_whose_package_is_missing_names_it(workdir, tiny_model_dir, suite, capsys, tmp_path, monkeypatch):
    import shutil
    import sys

    monkeypatch.setitem(sys.modules, "gptqmodel", None)  # how a missing package looks to Python's import system
    ckpt = tmp_path / "gptq"
    shutil.copytree(tiny_model_dir, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (ckpt / "config.json").write_text(json.dumps(config))
    err = evaluate_error([str(ckpt), "--base", str(tiny_model_dir), "--suite", suite], capsys)
    assert "is a gptq checkpoint; loading it needs the package 'gptqmodel'" in err


def test_a_reused_baseline_keeps_its_reference_mapped_from_disk(workdir, tiny_model_dir, suite, monkeypatch):
    """A baseline read from the store keeps its reference mapped from the downloaded file, read only
    by the evaluation, after that file's directory is gone. Under /tmp, which may be memory (tmpfs),
    its pages would take RAM from produce on: it is downloaded under the cache, on disk."""
    import torch
    from transformers import AutoTokenizer

    from quantbench.quality import stage
    from quantbench.quality.suite import load_suite
    from quantbench.sources import models
    from quantbench.tracking import Tracker

    cache = workdir / "cache"
    monkeypatch.setenv("QUANTBENCH_CACHE", str(cache))
    plan = stage.prepare(load_suite(suite), AutoTokenizer.from_pretrained(tiny_model_dir))
    base, tracker = models.resolve(str(tiny_model_dir)), Tracker(reap=False)
    scored = stage.get_baseline(tracker, base, plan)
    reused = stage.get_baseline(tracker, base, plan)
    assert not scored.reused and reused.reused and reused.run_id == scored.run_id
    assert torch.equal(reused.reference.head_weight, scored.reference.head_weight)
    address = reused.reference.head_weight.data_ptr()
    backing = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start <= address < end:
            backing.append(fields[5] if len(fields) == 6 else "[anonymous]")
    [mapped] = backing
    assert mapped.startswith(str(cache / "tmp") + "/") and mapped.endswith("reference.safetensors (deleted)"), mapped
