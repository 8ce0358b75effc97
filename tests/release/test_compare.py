"""`quantbench compare`: the Pareto frontier on a hand-made set of runs in a real MLflow store, and
the outputs (Markdown, HTML, PNG, JSON, summary run) on the real runs the tests made."""

import json
import os
from pathlib import Path

from quantbench.cli import main
from quantbench.tracking import Tracker
from tests.helpers import last_json

# name: (quality/kld_mean, speedup/decode_tok_s, recovery/quality/ppl)
HAND_MADE = {
    "a-best-quality": (0.05, 0.8, 0.99),
    "b-balanced": (0.10, 1.5, 0.95),
    "c-beaten-by-b": (0.12, 1.2, 0.94),
    "d-tie-quality-slower": (0.05, 0.7, 0.99),
    "e-fastest": (0.20, 2.0, 0.90),
}


def make_runs(status_extra: bool = True) -> dict[str, str]:
    tracker = Tracker()
    ids = {}
    for name, (kld, speedup, recovery) in HAND_MADE.items():
        with tracker.start_run(name, {"quantbench.role": "candidate", "quantbench.recipe": name,
                                      "quantbench.method": "gptq", "quantbench.scheme": "W4A16"}) as run:
            run.log_metrics({"quality/kld_mean": kld, "speedup/decode_tok_s": speedup, "recovery/quality/ppl": recovery,
                             "model/size_mb": 100.0, "model/bits_per_weight": 4.25})
        ids[name] = run.run_id
    if status_extra:
        with tracker.start_run("not-benched", {"quantbench.role": "candidate", "quantbench.recipe": "not-benched"}) as run:
            run.log_metrics({"quality/kld_mean": 0.01})
        ids["not-benched"] = run.run_id
        with tracker.start_run("baseline", {"quantbench.role": "baseline"}) as run:  # never a candidate
            run.log_metrics({"quality/kld_mean": 0.0, "speedup/decode_tok_s": 9.0})
        try:
            with tracker.start_run("failed", {"quantbench.role": "candidate"}) as run:
                run.log_metrics({"quality/kld_mean": 0.0, "speedup/decode_tok_s": 9.0})
                raise RuntimeError("died")
        except RuntimeError:
            pass
    return ids



def test_frontier_on_hand_made_runs(workdir, capsys):
    ids = make_runs()
    assert main(["compare", "--json"]) == 0
    out = capsys.readouterr().out
    result = last_json(out)
    by_recipe = {c["recipe"]: c for c in result["candidates"]}
    assert set(by_recipe) == set(HAND_MADE) | {"not-benched"}  # no baseline, no FAILED run
    assert {r for r, c in by_recipe.items() if c["frontier"]} == {"a-best-quality", "b-balanced", "e-fastest"}
    assert result["quality"] == "quality/kld_mean" and result["speed"] == "speedup/decode_tok_s"
    assert [c["recipe"] for c in result["candidates"][:3]] == ["a-best-quality", "b-balanced", "e-fastest"]
    assert result["candidates"][-1]["recipe"] == "not-benched"  # unscored last, listed anyway
    md = (Path(result["outputs"]) / "compare.md").read_text().splitlines()
    header = next(line for line in md if line.startswith("| "))
    row = next(line for line in md if "a-best-quality" in line)
    assert row.split("|")[header.split("|").index(" bits/w ")].strip() == "4.25"

    out_dir = Path(result["outputs"])
    md = (out_dir / "compare.md").read_text()
    assert md.count("| ★ |") == 3 and "| — |" in md  # not-benched has no speedup
    assert "<tr class='frontier'>" in (out_dir / "compare.html").read_text()
    assert (out_dir / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out_dir / "compare.json").read_text())["frontier"] == result["frontier"]
    assert "★" in out and "Pareto frontier on quality/kld_mean (lower is better)" in out

    from mlflow.tracking import MlflowClient

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    summary = client.get_run(result["run_id"])
    assert summary.data.tags["quantbench.role"] == "summary"
    assert set(summary.data.tags["quantbench.compared_runs"].split(",")) == {ids[k] for k in by_recipe}
    assert {a.path for a in client.list_artifacts(result["run_id"], "compare")} == {
        f"compare/compare.{ext}" for ext in ("md", "html", "png", "json")}
    assert summary.data.metrics["compare/frontier"] == 3

    # a second compare does not count the summary run as a candidate
    assert main(["compare", "--json"]) == 0
    assert len(last_json(capsys.readouterr().out)["candidates"]) == 6


def test_direction_comes_from_the_metric(workdir, capsys):
    ids = make_runs(status_extra=False)
    # recovery: higher is better; d ties a on quality and is slower, c is beaten by b on both
    assert main(["compare", "--quality", "recovery/quality/ppl", "--runs", *ids.values(), "--json"]) == 0
    result = last_json(capsys.readouterr().out)
    assert {c["recipe"] for c in result["candidates"] if c["frontier"]} == {"a-best-quality", "b-balanced", "e-fastest"}
    # speed axis where lower is better: the slowest TTFT-free axis flips the frontier
    assert main(["compare", "--speed", "model/size_mb", "--runs", ids["a-best-quality"], ids["e-fastest"], "--json"]) == 0
    result = last_json(capsys.readouterr().out)  # equal sizes: the better-quality one dominates
    assert [c["recipe"] for c in result["candidates"] if c["frontier"]] == ["a-best-quality"]


def test_real_runs_and_the_unbenched_fallback(workdir, scored_runs, capsys, caplog):
    assert main(["compare", "--experiment", scored_runs["experiment"], "--json"]) == 0
    result = last_json(capsys.readouterr().out)
    by_id = {c["run_id"]: c for c in result["candidates"]}
    assert {scored_runs["gptq"], scored_runs["fp8"]} <= set(by_id)
    assert result["speed"] == "speedup/decode_tok_s"  # the gptq run was benched
    assert by_id[scored_runs["gptq"]]["frontier"] and not by_id[scored_runs["fp8"]]["frontier"]
    assert by_id[scored_runs["gptq"]]["metrics"]["quality/kld_mean"] > 0
    # only unbenched runs: the speed axis falls back to the compression ratio, with a warning
    assert main(["compare", "--runs", scored_runs["fp8"], "--json"]) == 0
    out = capsys.readouterr()
    assert last_json(out.out)["speed"] == "model/compression_ratio"
    assert "no candidate has speedup/decode_tok_s yet" in caplog.text


def test_bad_input(workdir, capsys):
    assert main(["compare"]) == 2
    assert "no finished candidate runs in experiment" in capsys.readouterr().err
    make_runs(status_extra=False)
    assert main(["compare", "--quality", "quality/kld_mena"]) == 2
    assert "--quality: unknown metric 'quality/kld_mena'. Close matches: quality/kld_mean" in capsys.readouterr().err
    assert main(["compare", "--speed", "quality/positions"]) == 2
    assert "context value" in capsys.readouterr().err
    assert main(["compare", "--runs", "f" * 32]) == 2
    assert "--runs:" in capsys.readouterr().err


def test_a_run_that_did_not_finish_is_refused_and_nothing_is_written(workdir, capsys):
    ids = make_runs()
    summaries = len(Tracker().search({"quantbench.role": "summary"}, status=None))
    [failed] = [r.info.run_id for r in Tracker().search({"quantbench.role": "candidate"}, status="FAILED")]
    [baseline] = Tracker().find_runs({"quantbench.role": "baseline"})
    assert main(["compare", "--runs", failed]) == 2
    assert "is FAILED, not FINISHED" in capsys.readouterr().err
    assert main(["compare", "--runs", ids["b-balanced"], failed, baseline]) == 2
    err = capsys.readouterr().err
    assert f"error: --runs: '{failed}' (failed) is FAILED, not FINISHED (RuntimeError: died); its numbers are partial" in err
    assert f"error: --runs: '{baseline}' is a baseline run, not a candidate" in err
    assert len(Tracker().search({"quantbench.role": "summary"}, status=None)) == summaries
    assert not (workdir / "outputs").exists()
    # an outputs dir that cannot be created is refused before the summary run too
    (workdir / "afile").write_text("x")
    assert main(["compare", "--runs", ids["b-balanced"], "--outputs", "afile/sub"]) == 2
    assert "error: afile: exists and is not a directory" in capsys.readouterr().err
    assert len(Tracker().search({"quantbench.role": "summary"}, status=None)) == summaries


def test_intervals_mark_what_cannot_be_told_apart_and_the_noise_floor_is_a_row(workdir, capsys):
    """x and y differ on KLD by less than either's interval; x and z likewise on speed. The noise
    run of their base model is a row (≈) and a band, never a candidate or on the frontier."""
    tracker = Tracker()
    fingerprint = "f" * 64
    # name: (kld, its interval, speedup, its interval)
    made = {"x": (0.100, (0.090, 0.112), 1.50, (1.40, 1.60)), "y": (0.105, (0.095, 0.115), 1.20, (1.15, 1.25)),
            "z": (0.300, (0.280, 0.320), 1.52, (1.45, 1.58))}
    ids = {}
    for name, (kld, kld_ci, speed, speed_ci) in made.items():
        with tracker.start_run(name, {"quantbench.role": "candidate", "quantbench.recipe": name,
                                      "quantbench.base_fingerprint": fingerprint}) as run:
            run.log_metrics({"quality/kld_mean": kld, "quality/kld_mean.ci_low": kld_ci[0], "quality/kld_mean.ci_high": kld_ci[1],
                             "speedup/decode_tok_s": speed, "speedup/decode_tok_s.ci_low": speed_ci[0],
                             "speedup/decode_tok_s.ci_high": speed_ci[1]})
        ids[name] = run.run_id
    with tracker.start_run("noise", {"quantbench.role": "noise", "quantbench.base_fingerprint": fingerprint,
                                     "quantbench.suite": "tiny"}) as run:
        run.log_metrics({"quality/kld_mean": 0.0, "quality/kld_mean.ci_low": 0.0, "quality/kld_mean.ci_high": 0.0,
                         "speedup/decode_tok_s": 1.0, "speedup/decode_tok_s.ci_low": 0.96, "speedup/decode_tok_s.ci_high": 1.04})
    noise_id = run.run_id
    with tracker.start_run("other-noise", {"quantbench.role": "noise", "quantbench.base_fingerprint": "0" * 64}):
        pass  # another base model's: not shown

    assert main(["compare", "--json"]) == 0
    out = capsys.readouterr().out
    result = last_json(out)
    pairs = {m: {frozenset(p) for p in found} for m, found in result["not_distinguishable"].items()}
    assert pairs == {"quality/kld_mean": {frozenset((ids["x"], ids["y"]))},
                     "speedup/decode_tok_s": {frozenset((ids["x"], ids["z"]))}}
    assert [n["run_id"] for n in result["noise"]] == [noise_id]
    assert {c["run_id"] for c in result["candidates"]} == set(ids.values())  # the noise run is no candidate
    assert "not distinguishable on quality/kld_mean (each value inside the other's 95% interval): x ~ y" in out
    assert "≈ noise floor: the base model against itself" in out
    md = (Path(result["outputs"]) / "compare.md").read_text()
    assert "| ≈ | " + noise_id[:8] + " | noise floor (tiny) |" in md and "not distinguishable on speedup/decode_tok_s" in md
    assert (Path(result["outputs"]) / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
