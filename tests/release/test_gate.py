"""`quantbench gate` on real runs made by the tests (tiny model, quantize + evaluate + bench), with
a real MLflow store and Model Registry: verdicts, the boundary, alias moves, reports, bad input."""

import json
import math
import os
from pathlib import Path

import pytest
import yaml

from quantbench.cli import main


def client():
    from mlflow.tracking import MlflowClient

    return MlflowClient(os.environ["MLFLOW_TRACKING_URI"])


def write_policy(workdir: Path, name: str, policy: dict) -> str:
    (workdir / "policies").mkdir(exist_ok=True)
    (workdir / "policies" / f"{name}.yaml").write_text(yaml.safe_dump(policy))
    return name


def gate(run_id: str, policy: str, capsys) -> tuple[int, dict | None, str]:
    code = main(["gate", run_id, "--policy", policy, "--json"])
    out = capsys.readouterr()
    lines = out.out.strip().splitlines()
    report = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None
    return code, report, out.out + out.err


def metric(run_id: str, key: str) -> float:
    return client().get_run(run_id).data.metrics[key]


def test_boundary_pass_registers_and_fail_moves_nothing(workdir, scored_runs, capsys):
    run_id = scored_runs["gptq"]
    kld = metric(run_id, "quality/kld_mean")
    speedup = metric(run_id, "speedup/decode_tok_s")
    model = "tiny-boundary"
    at = {"stages": ["quantize", "evaluate", "bench"], "max": {"quality/kld_mean": kld},
          "min": {"speedup/decode_tok_s": speedup}, "licenses": ["MIT"], "registry": {"model": model},
          "speed_engine": "any"}  # the session's runs are benched in-process (hf)
    # exactly at both thresholds (raw values, YAML round-trips the float): pass
    code, report, out = gate(run_id, write_policy(workdir, "at", at), capsys)
    assert code == 0 and report["passed"], out
    assert {c["check"] for c in report["checks"]} >= {"stage bench", "licence", "quality/kld_mean", "speedup/decode_tok_s"}
    kld_check = next(c for c in report["checks"] if c["check"] == "quality/kld_mean")
    assert kld_check["value"] == kld and kld_check["passed"]
    assert report["registered"]["model"] == model and report["registered"]["previous"] is None
    version = client().get_model_version_by_alias(model, "champion")
    assert version.run_id == run_id and version.source == f"runs:/{run_id}/checkpoint"
    assert version.tags["quantbench.gate.at"] and version.tags["quantbench.gate.policy_sha"] == report["policy_sha"]
    assert client().list_artifacts(run_id, "checkpoint")  # the checkpoint travels with the run

    # one ulp stricter on KLD: fail, exit 1, no alias moved, the failed report still recorded
    stricter = {**at, "max": {"quality/kld_mean": math.nextafter(kld, 0)}}
    code, report, out = gate(run_id, write_policy(workdir, "stricter", stricter), capsys)
    assert code == 1 and not report["passed"] and report["registered"] is None
    assert "FAIL" in out and "nothing registered" in out
    failed = [c["check"] for c in report["checks"] if not c["passed"]]
    assert failed == ["quality/kld_mean"]
    assert client().get_model_version_by_alias(model, "champion").version == version.version
    tags = client().get_run(run_id).data.tags
    assert tags["quantbench.gate.stricter"] == "fail" and tags["quantbench.gate.at"] == "pass"
    reports = [a.path for a in client().list_artifacts(run_id, "gate")]
    assert any(p.startswith("gate/stricter-") and p.endswith(".json") for p in reports)
    assert any(p.startswith("gate/at-") and p.endswith(".md") for p in reports)


def test_alias_moves_on_pass_and_the_previous_version_stays_reachable(workdir, scored_runs, capsys, tmp_path):
    import mlflow

    model = "tiny-promotion"
    loose = {"stages": ["quantize", "evaluate"], "max": {"quality/kld_mean": 100.0}, "registry": {"model": model}}
    policy = write_policy(workdir, "loose", loose)
    assert gate(scored_runs["gptq"], policy, capsys)[0] == 0
    first = client().get_model_version_by_alias(model, "champion")
    # a failing candidate moves nothing
    strict = write_policy(workdir, "strict", {**loose, "max": {"quality/kld_mean": 0.0}})
    assert gate(scored_runs["fp8"], strict, capsys)[0] == 1
    assert client().get_model_version_by_alias(model, "champion").version == first.version
    # a passing one becomes champion; the replaced version keeps 'previous'
    code, report, _ = gate(scored_runs["fp8"], policy, capsys)
    assert code == 0 and report["registered"]["previous"] == first.version
    champion = client().get_model_version_by_alias(model, "champion")
    previous = client().get_model_version_by_alias(model, "previous")
    assert champion.run_id == scored_runs["fp8"] and previous.version == first.version
    local = Path(mlflow.artifacts.download_artifacts(f"models:/{model}@previous", dst_path=str(tmp_path / "prev"),
                                                     tracking_uri=os.environ["MLFLOW_TRACKING_URI"]))
    assert (local / "config.json").is_file() and json.loads((local / "quantbench.json").read_text())["run_id"] == scored_runs["gptq"]
    # re-gating the champion does not register it twice
    assert gate(scored_runs["fp8"], policy, capsys)[0] == 0
    assert len(client().search_model_versions(f"name = '{model}'")) == 2


def test_missing_stage_and_licence_fail_without_crashing(workdir, scored_runs, capsys):
    policy = write_policy(workdir, "needs-bench", {"stages": ["quantize", "evaluate", "bench"], "licenses": ["apache-2.0"],
                                                   "min": {"speedup/decode_tok_s": 0.1}, "registry": {"model": "tiny-x"}})
    code, report, out = gate(scored_runs["fp8"], policy, capsys)  # fp8 was never benched; the tiny model is MIT
    assert code == 1
    failed = {c["check"]: c for c in report["checks"] if not c["passed"]}
    assert set(failed) == {"stage bench", "licence", "speedup/decode_tok_s"}
    assert failed["licence"]["value"] == "mit" and "make bench" in failed["stage bench"]["note"]
    assert failed["speedup/decode_tok_s"]["note"] == "not logged in this run"
    assert "FAIL" in out and "Traceback" not in out
    assert client().search_registered_models("name = 'tiny-x'") == []


def test_shipped_policies_load_and_the_release_gate_reads_the_real_run(workdir, scored_runs, capsys):
    repo = Path(__file__).resolve().parents[2]
    (workdir / "policies").mkdir()
    for path in (repo / "policies").glob("*.yaml"):
        (workdir / "policies" / path.name).write_text(path.read_text())
        assert path.read_text().startswith(f"# Gate: make gate RUN=<run id> POLICY={path.stem}\n")
    assert {p.stem for p in (repo / "policies").glob("*.yaml")} == {"release", "experimental"}
    # release holds task recoveries and the speedup by their intervals: 6 items a task and one bench
    # repetition have none, which is bad input (exit 2), not a verdict
    code, report, out = gate(scored_runs["gptq"], "release", capsys)
    assert code == 2 and report is None and "without an interval" in out
    # experimental needs what 10 windows and 12 items give: every check decided on an interval's end
    code, report, out = gate(scored_runs["gptq"], "experimental", capsys)
    assert code in (0, 1) and report["policy"] == "experimental"  # a random tiny model: the verdict is what it is
    assert len(report["checks"]) == 1 + 2 + 1 + 2 + 1 + 1  # status, stages, recovery, max, min, checkpoint
    for c in report["checks"]:
        metric = "/" in c["check"]
        assert isinstance(c["value"], (float, str)) and (c["ci_low"] is not None) == metric, c
        assert c["on"] == ("ci_high" if c["check"] in ("recovery/quality/ppl", "quality/top1_agreement") else
                           "ci_low" if metric else "value")


@pytest.mark.parametrize(
    "policy, expected",
    [
        ({"max": {"quality/kld_mena": 0.1}}, "max.quality/kld_mena: unknown metric 'quality/kld_mena'. Close matches: quality/kld_mean"),
        ({"min": {"quality/kld_mean": 0.1}}, "min.quality/kld_mean: lower is better for this metric, so its limit belongs under max:"),
        ({"recovery": {"quality/kld_mean": 0.9}}, "recovery.quality/kld_mean: unknown metric 'recovery/quality/kld_mean'"),
        ({"recovery": {"task/qb_pydoc_lastwrod/acc": 0.9}}, "Close matches: recovery/task/qb_pydoc_lastword/acc"),
        ({"maximum": {"quality/kld_mean": 0.1}}, "maximum: Extra inputs are not permitted"),
        ({"stages": ["quantise"]}, "stages.0: Input should be 'quantize', 'evaluate' or 'bench'"),
        ({"registry": {"model": "{base}-x"}}, "registry.model: unknown placeholder(s) ['base']"),
        ({"max": {"quality/kld_max": {"value": 1.0, "on": "ci_high"}}},
         "max.quality/kld_max: on: ci_high, but quality/kld_max has no interval"),
        ({"min": {"speed/decode_tok_s": {"value": 1.0, "on": "ci_low"}}},
         "min.speed/decode_tok_s: on: ci_low, but speed/decode_tok_s has no interval"),
        ({"min": {"speedup/ttft_ms_p95": {"value": 1.0, "on": "ci_low"}}},
         "min.speedup/ttft_ms_p95: on: ci_low, but speedup/ttft_ms_p95 has no interval"),
        ({"max": {"quality/kld_mean.ci_high": 0.1}},
         "max.quality/kld_mean.ci_high: name the metric and the interval's end with on:, e.g. quality/kld_mean: "
         "{value: 0.1, on: ci_high}"),
        ({"max": {"quality/kld_mean": {"value": 0.1, "on": "ci_hi"}}}, "max.quality/kld_mean.Bound.on: Input should be"),
    ],
)
def test_bad_policies_name_the_file_and_field(workdir, scored_runs, capsys, policy, expected):
    write_policy(workdir, "bad", policy)
    assert main(["gate", scored_runs["gptq"], "--policy", "bad"]) == 2
    err = capsys.readouterr().err
    assert f"policies/bad.yaml: {expected}" in err or (expected.startswith("Close") and expected in err), err



@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "sub/release"])
def test_a_policy_that_is_neither_a_name_nor_a_yaml_file_says_what_a_policy_is(workdir, capsys, name):
    """Not a directory's contents guessed at (`../../etc/` holds no policy files): what --policy takes."""
    write_policy(workdir, "release", {"max": {"quality/kld_mean": 1.0}})
    assert main(["gate", "0" * 32, "--policy", name]) == 2
    assert capsys.readouterr().err == (
        f"error: --policy: '{name}' is neither a policy's name (a file in policies/: release) nor a path to a .yaml "
        "file\n"
    )

def test_unknown_run_unknown_policy_and_a_baseline_run(workdir, scored_runs, capsys):
    write_policy(workdir, "ok", {"max": {"quality/kld_mean": 1.0}})
    assert main(["gate", "0" * 32, "--policy", "ok"]) == 2
    assert f"MLflow run '{'0' * 32}' does not exist" in capsys.readouterr().err
    assert main(["gate", "not-a-run", "--policy", "ok"]) == 2
    assert "not an MLflow run id" in capsys.readouterr().err
    assert main(["gate", scored_runs["gptq"], "--policy", "oj"]) == 2
    assert "unknown policy 'oj'" in capsys.readouterr().err
    baseline = client().get_run(scored_runs["gptq"]).data.tags["quantbench.baseline_run"]
    assert main(["gate", baseline, "--policy", "ok"]) == 2
    assert "is a baseline run" in capsys.readouterr().err


def test_checks_on_an_interval_end_at_the_boundary(workdir, scored_runs, capsys):
    """A bound on an interval's end: exactly at the limit passes, one ulp past fails; every check
    reports value, interval and threshold; the plain form keeps holding the value."""
    run_id = scored_runs["gptq"]
    high = metric(run_id, "quality/kld_mean.ci_high")
    low = metric(run_id, "recovery/quality/ppl.ci_low")
    assert metric(run_id, "quality/kld_mean.ci_low") < metric(run_id, "quality/kld_mean") < high
    at = {"stages": ["quantize", "evaluate"], "registry": {"model": "tiny-interval"},
          "max": {"quality/kld_mean": {"value": high, "on": "ci_high"}, "quality/flips_pct": 100.0},
          "recovery": {"quality/ppl": {"value": low, "on": "ci_low"}}}
    code, report, out = gate(run_id, write_policy(workdir, "ci-at", at), capsys)
    assert code == 0 and report["passed"], out
    checks = {c["check"]: c for c in report["checks"]}
    kld = checks["quality/kld_mean"]
    assert kld["on"] == "ci_high" and kld["ci_high"] == high and kld["value"] == metric(run_id, "quality/kld_mean")
    assert kld["threshold"] == f"ci_high <= {high}"
    assert checks["quality/flips_pct"]["on"] == "value" and checks["quality/flips_pct"]["ci_low"] is not None
    assert checks["run status"]["ci_low"] is None
    assert "95% interval" in out and f"[{metric(run_id, 'quality/kld_mean.ci_low'):.4g}, {high:.4g}]" in out
    for section, key, nudged in (("max", "quality/kld_mean", math.nextafter(high, 0)),
                                 ("recovery", "quality/ppl", math.nextafter(low, 2))):
        past = {**at, section: {**at[section], key: {"value": nudged, "on": at[section][key]["on"]}}}
        code, report, _ = gate(run_id, write_policy(workdir, "ci-past", past), capsys)
        assert code == 1 and [c["check"] for c in report["checks"] if not c["passed"]] == [
            key if section == "max" else f"recovery/{key}"]
    # the plain form holds the value: a limit between the value and the upper end passes
    plain = {**at, "max": {"quality/kld_mean": (metric(run_id, "quality/kld_mean") + high) / 2}}
    assert gate(run_id, write_policy(workdir, "plain", plain), capsys)[0] == 0


@pytest.mark.parametrize("limits, named", [
    ({"recovery": {"task/qb_pydoc_lastword/perplexity": {"value": 0.5, "on": "ci_low"}}},
     "recovery/task/qb_pydoc_lastword/perplexity"),
    ({"min": {"speedup/decode_tok_s": {"value": 0.5, "on": "ci_low"}}}, "speedup/decode_tok_s"),
])
def test_an_interval_the_run_did_not_log_is_bad_input(workdir, scored_runs, capsys, limits, named):
    """6 items a task and 1 bench repetition give no interval: gating on one is exit 2, nothing written."""
    run_id = scored_runs["gptq"]
    before = {a.path for a in client().list_artifacts(run_id, "gate")}
    policy = write_policy(workdir, "needs-ci", {"stages": ["quantize"], **limits})
    assert main(["gate", run_id, "--policy", policy]) == 2
    err = capsys.readouterr().err
    assert f"policies/needs-ci.yaml: {named}: the policy holds an end of its interval to the limit" in err
    assert f"logged {named} without an interval" in err
    assert {a.path for a in client().list_artifacts(run_id, "gate")} == before
    assert "quantbench.gate.needs-ci" not in client().get_run(run_id).data.tags


def test_bad_input_against_a_store_that_does_not_exist_creates_none(workdir, capsys, monkeypatch, tmp_path):
    write_policy(workdir, "ok", {"max": {"quality/kld_mean": 1.0}})
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{fresh / 'mlflow.db'}")
    assert main(["gate", "0" * 32, "--policy", "ok"]) == 2
    assert f"MLflow run '{'0' * 32}' does not exist at the tracking store" in capsys.readouterr().err
    assert list(fresh.iterdir()) == []  # no database, no lock file
    assert sorted(p.name for p in workdir.iterdir()) == ["fresh", "policies", "recipes"]  # no mlruns/ either
