"""Rate sweeps to saturation and goodput under SLOs (profile `sweep:` and `slo:`): the rates set from
the warm-up, over-saturation detected while a level runs, each request and each level against the
SLOs, the SLO rate; bad profiles refused before anything runs. The slow test sweeps two real
servers of known capacity (tests/engines/echo_server.py with parallel slots)."""

import json
import re
import shutil
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.artifacts import download_artifacts

from quantbench import engines
from quantbench.cli import main
from quantbench.engines import ServerSettings
from quantbench.engines.server import Stream
from quantbench.speed.measure import Profile, SweepRates, bench_pair, sweep_rates
from quantbench.speed.serving import level_holds, meets_slo, oversaturated, refine_slo_rate, slo_bracket, slo_rate
from tests.engines.test_registry import EchoServer, echo_command, echo_servers
from tests.helpers import last_json, runs


def stream(ttft_ms: float, gaps_ms: list[float] = (), e2e_ms: float | None = None) -> Stream:
    times = [ttft_ms / 1000]
    for gap in gaps_ms:
        times.append(times[-1] + gap / 1000)
    return Stream(ttft_ms / 1000, (e2e_ms or times[-1] * 1000) / 1000, times, [1] * len(times), False)


def test_the_rates_climb_evenly_from_the_synchronous_rate_to_past_the_throughput_rate():
    # from 5 (excluded) to a quarter above 40 (included)
    assert sweep_rates(5.0, 40.0, 3) == [20.0, 35.0, 50.0]
    assert sweep_rates(40.0, 5.0, 3) == [20.0, 35.0, 50.0]
    assert sweep_rates(1.234, 9.87, 2) == [6.79, 12.3]  # 3 significant figures: the level's name r6.79


def test_a_level_is_oversaturated_when_its_ttft_keeps_rising_with_requests_waiting():
    # requests of 100 ms from first token to last: half a generation is 50 ms
    def finished(ttft_ms: float) -> Stream:
        return stream(ttft_ms, [50, 50])

    steady = [finished(30)] * 8 + [None] * 4
    assert not oversaturated(steady)
    rising = [finished(30), finished(35), finished(40), finished(120), finished(200), finished(260)] + [None] * 4
    assert oversaturated(rising)
    # the same rise with too few requests waiting, or too few finished, is not yet a verdict
    assert not oversaturated(rising[:6] + [None] * 3)
    assert not oversaturated(rising[:5] + [None] * 5)
    # a rise within twice the start plus half a generation is a busy server keeping up
    assert not oversaturated([finished(30)] * 3 + [finished(100)] * 3 + [None] * 4)
    # ... and what counts as a rise grows with the generation: the same TTFTs for long requests
    long_ones = [stream(t, [400, 400]) for t in (30, 35, 40, 120, 200, 260)] + [None] * 4
    assert not oversaturated(long_ones)


def test_each_request_and_each_level_against_the_slos():
    slo = {"ttft_ms_p95": 100, "itl_ms_p50": 20}
    fast, slow_start, slow_tokens = stream(50, [10, 10, 10]), stream(150, [10, 10]), stream(50, [30, 30, 10])
    assert meets_slo(fast, slo) and not meets_slo(slow_start, slo) and not meets_slo(slow_tokens, slo)
    assert meets_slo(stream(50, [10], e2e_ms=900), slo) and not meets_slo(stream(50, [10], e2e_ms=900), {"e2e_ms_p99": 500})
    # over a level: the 95th percentile of 20 TTFTs is the 19th; one slow request of 20 holds it
    assert level_holds([fast] * 19 + [slow_start], {"ttft_ms_p95": 100})
    assert not level_holds([fast] * 18 + [slow_start] * 2, {"ttft_ms_p95": 100})
    # ITL over all the level's gaps
    assert level_holds([fast, slow_tokens], {"itl_ms_p50": 20}) and not level_holds([slow_tokens], {"itl_ms_p50": 20})


def test_the_slo_rate_climbs_until_the_first_level_that_did_not_hold():
    levels = {"c1/requests_s": 4.0, "c1/slo_held": 1.0, "r8/slo_held": 1.0, "r12/slo_held": 0.0, "r16/slo_held": 1.0,
              "c16/requests_s": 20.0, "c16/slo_held": 1.0}
    assert slo_rate(levels, [16.0, 8.0, 12.0], 16) == 8.0  # r16 held, but above a rate that did not
    # in order of rate: a synchronous run faster than the swept rates comes after them
    assert slo_rate({**levels, "c1/requests_s": 10.0}, [8.0, 12.0, 16.0], 16) == 10.0
    assert slo_rate({**levels, "r12/slo_held": 1.0}, [8.0, 12.0, 16.0], 16) == 20.0  # all held: the throughput run's rate
    assert slo_rate({**levels, "c1/slo_held": 0.0}, [8.0, 12.0, 16.0], 16) == 0.0
    # the synchronous run comes first whatever its rate: Poisson arrivals at 8/s may miss where one
    # request at a time (at 10/s) held; 0 would say that even one at a time missed (measured so once)
    assert slo_bracket({**levels, "c1/requests_s": 10.0, "r8/slo_held": 0.0}, [8.0, 12.0, 16.0], 16) == (10.0, 8.0)
    assert slo_bracket(levels, [16.0, 8.0, 12.0], 16) == (8.0, 12.0)  # and the first rate above it that missed
    assert slo_bracket({**levels, "r12/slo_held": 1.0}, [8.0, 12.0, 16.0], 16) == (20.0, None)


def test_refining_bisects_the_bracket_toward_the_rate_where_the_slos_stop_holding():
    tried = []

    def holds(rate):  # a server that holds its SLOs up to 9.37 requests/s
        tried.append(rate)
        return rate <= 9.37

    assert refine_slo_rate(8.0, 12.0, 3, holds) == (9.0, 9.5)  # 10 missed, 9 held, 9.5 missed: a bracket of 0.5
    assert tried == [10.0, 9.0, 9.5]
    # a bracket narrower than 2 % of its top is not cut (run-to-run noise is larger), nor one too
    # narrow for a new rate at 3 significant figures
    tried.clear()
    assert refine_slo_rate(9.37, 9.38, 4, holds) == (9.37, 9.38) and tried == []
    assert refine_slo_rate(6.06, 6.14, 2, holds) == (6.06, 6.14) and tried == []
    assert refine_slo_rate(8.0, 8.4, 4, holds) == (8.3, 8.4) and tried == [8.2, 8.3]  # then 8.3-8.4 is too narrow


def test_the_warm_up_sets_the_rates_both_models_are_swept_at():
    """bench_pair sets the shared rates after the warm-up, from the slower synchronous and past the
    faster throughput rate; every measured repetition of both models sees the same rates."""
    profile = Profile(prompt_tokens=[16], concurrency=[2], repetitions=3, warmup=1,
                      sweep={"rates": 3, "requests": 8}, slo={"ttft_ms_p95": 100})
    sweep = SweepRates()
    seen: list[tuple[str, int, list[float]]] = []

    def measurer(name: str, sync: float, all_at_once: float):
        def run(prompt_sets, rep):
            seen.append((name, rep, list(sweep.rates)))
            return {"p16/ttft_ms": 10.0, "p16/e2e_ms": 30.0, "p16/prefill_tok_s": 100.0,
                    "c1/requests_s": sync, "c8/requests_s": all_at_once, "max_rate_rps": all_at_once,
                    **({"slo_rate_rps": sync} if sweep.rates else {})}
        return run

    result = bench_pair({"candidate": measurer("candidate", 10.0, 40.0), "base": measurer("base", 5.0, 20.0)},
                        list(range(200)), profile, sweep)
    assert sweep.rates == [20.0, 35.0, 50.0]  # from the base's 5 to past the candidate's 40 requests/s
    assert seen[:2] == [("candidate", 0, []), ("base", 0, [])]  # the warm-up: no rates yet
    assert all(rates == [20.0, 35.0, 50.0] for _, rep, rates in seen[2:]) and len(seen) == 8
    m = result.metrics
    assert m["speed/max_rate_rps"] == 40.0 and m["base_speed/max_rate_rps"] == 20.0
    assert m["speedup/slo_rate_rps"] == 2.0 and m["speedup/slo_rate_rps.ci_low"] == pytest.approx(2.0)


@pytest.mark.parametrize("text, message", [
    ("sweep: {rates: 1}\n", "sweep.rates: Input should be greater than or equal to 2"),
    ("sweep: {rates: 3}\nwarmup: 0\n", "sweep: Value error, a sweep needs warmup of at least 1"),
    ("slo: {ttft_ms_p95: 500, tpot_ms_p95: 50}\n", "slo: Value error, unknown SLO 'tpot_ms_p95'"),
    ("slo: {tpot_ms_p95: 50}\n", "Did you mean itl_ms_p95? (time per output token is the inter-token latency here)"),
    ("slo: {ttft_ms_p100: 500}\n", "slo: Value error, unknown SLO 'ttft_ms_p100': an SLO is ttft_ms_p<P>"),
    ("slo: {tfft_ms_p95: 500}\n", "slo: Value error, unknown SLO 'tfft_ms_p95'"),
    ("slo: {ttft_ms_p95: -1}\n", "slo.ttft_ms_p95: Input should be greater than 0"),
    ("sweep: {rates: 3, refine: 2}\n", "sweep.refine: 2 bisects toward the highest rate that holds the SLOs, and the "
                                       "profile has none"),
    ("sweep: {rates: 3, refine: 9}\nslo: {ttft_ms_p95: 500}\n", "sweep.refine: Input should be less than or equal to 6"),
])
def test_bad_sweeps_and_slos_are_refused_before_anything_runs(text, message, workdir, tiny_model_dir, capsys):
    (workdir / "profiles").mkdir()
    (workdir / "profiles" / "bad.yaml").write_text("prompt_tokens: [16]\noutput_tokens: 4\n" + text)
    assert main(["bench", str(tiny_model_dir), "--base", str(tiny_model_dir), "--profile", "bad"]) == 2
    err = capsys.readouterr().err
    assert "profiles/bad.yaml: " in err and message in err, err
    assert runs() == []


def test_a_sweep_in_process_is_refused(workdir, tiny_model_dir, capsys):
    (workdir / "profiles").mkdir()
    (workdir / "profiles" / "sweep.yaml").write_text("prompt_tokens: [16]\noutput_tokens: 4\nsweep: {rates: 2}\n")
    assert main(["bench", str(tiny_model_dir), "--base", str(tiny_model_dir), "--profile", "sweep", "--engine", "hf"]) == 2
    assert "--profile: a sweep needs a server (open-loop arrivals)" in capsys.readouterr().err
    assert runs() == []


GAP_MS = {"fast": 20, "base": 40}  # per model: the echo server's pause before each token


class SlotEcho(EchoServer):
    """The echo server with 2 parallel slots: with 4 tokens a request, the candidate ("fast",
    20 ms a token) serves up to 25 requests/s, the base (40 ms a token) 12.5."""

    name = "slotecho"

    def server_command(self, checkpoint, port, settings: ServerSettings, tmp):
        gap = GAP_MS["fast" if checkpoint.name == "fast" else "base"]
        return echo_command(checkpoint, port, gap, "--slots", "2")




def the_faster_model_and_a_sweep(workdir: Path, tiny_model_dir: Path, *, repetitions: int, rates: int,
                                 requests: int, refine: int = 0) -> Path:
    """The tiny model copied as "fast" (SlotEcho serves it faster) and profiles/slo.yaml: a sweep
    with evenly spaced arrivals and a 100 ms TTFT SLO."""
    fast = workdir / "fast"
    shutil.copytree(tiny_model_dir, fast)
    (workdir / "profiles").mkdir()
    (workdir / "profiles" / "slo.yaml").write_text(
        f"prompt_tokens: [16]\noutput_tokens: 4\nconcurrency: [2]\nrepetitions: {repetitions}\nwarmup: 1\n"
        f"sweep: {{rates: {rates}, requests: {requests}, arrivals: constant, refine: {refine}}}\n"
        "slo: {ttft_ms_p95: 100}\n"
    )
    return fast


@pytest.fixture
def slot_echo():
    engines.register("slotecho", f"{__name__}:SlotEcho")
    yield engines.get("slotecho")
    engines.unregister("slotecho")


@pytest.mark.slow  # two real servers swept at 5 levels, 4 times each: ~1 min
def test_a_sweep_finds_each_servers_slo_rate_and_stops_a_level_the_server_cannot_keep_up_with(
    slot_echo, workdir, tiny_model_dir, capsys
):
    fast = the_faster_model_and_a_sweep(workdir, tiny_model_dir, repetitions=3, rates=3, requests=24, refine=2)
    assert main(["bench", str(fast), "--base", str(tiny_model_dir), "--profile", "slo", "--engine", "slotecho",
                 "--json"]) == 0
    out, err = capsys.readouterr()
    m = last_json(out)["metrics"]
    # refine: up to 2 more levels per repetition and model inside the bracket (the highest level that
    # held, the next that missed; none where that is under 2 % wide); both models miss at their top
    # levels, so both are refined
    steps = re.findall(r"sweep \((\S+), repetition (\d)\): SLO rate between (\S+) and (\S+) /s; step \d/2 at (\S+) /s", err)
    assert {model for model, *_ in steps} == {"fast", tiny_model_dir.name}
    assert {int(rep) for _, rep, *_ in steps} <= {1, 2, 3} and len(steps) <= 2 * 3 * 2
    assert all(float(hold) < float(rate) < float(miss) for _, _, hold, miss, rate in steps)
    [run] = runs()
    report = json.loads(Path(download_artifacts(run_id=run.info.run_id, artifact_path="bench.json")).read_text())
    rates = report["sweep_rates"]
    # 3 rates evenly from the base's synchronous rate (1 request at a time: under 6.25/s) to a
    # quarter past the candidate's throughput run (24 at once on 2 slots: under 25/s), set from the
    # warm-up's runs (so compared here with the rates alone: the measured runs differ a little)
    assert len(rates) == 3 and rates[1] - rates[0] == pytest.approx(rates[2] - rates[1], abs=0.15)
    assert rates[0] > m["base_speed/c1/requests_s"] * 0.8 and rates[2] > 2 * m["base_speed/max_rate_rps"]
    for prefix in ("speed/", "base_speed/"):
        for level in ["c1", "c2", "c24"] + [f"r{r:g}" for r in rates]:
            assert 0 <= m[f"{prefix}{level}/slo_pct"] <= 100
            assert m[f"{prefix}{level}/goodput_rps"] <= m[f"{prefix}{level}/requests_s"] + 1e-9
    # the base cannot keep up with the top rate (about 2.5x its 12.5/s): the level stopped early
    # (its 24 arrivals take ~0.8 s; by 0.48 s the base has finished 6 with 9 waiting and their
    # TTFT rising), and the requests never sent missed the SLO
    top = f"r{rates[2]:g}"
    assert m[f"base_speed/{top}/saturated"] == 1 and m[f"base_speed/{top}/slo_pct"] < 100
    assert m[f"base_speed/{top}/slo_held"] == 0
    # one request at a time holds a 100 ms TTFT on both; the candidate holds it at higher rates:
    # its lowest swept rate (half its capacity) at least, where the base's every-request-at-once run
    # (at ~12/s, below that rate) already misses it
    assert m["base_speed/c1/slo_held"] == 1 and m["speed/c1/slo_held"] == 1
    assert m["speed/slo_rate_rps"] >= rates[0]
    assert m["base_speed/slo_rate_rps"] < rates[0]
    # (equal repetitions collapse the interval onto the value: equal up to rounding)
    assert m["speedup/slo_rate_rps"] > 2 and m["speedup/slo_rate_rps.ci_low"] <= m["speedup/slo_rate_rps"] * (1 + 1e-12)
    assert m["speed/max_rate_rps"] > m["base_speed/max_rate_rps"]
    artifacts = {f.path for f in MlflowClient().list_artifacts(run.info.run_id)}
    assert {"bench_slo.png", "bench_load.png", "bench.json"} <= artifacts
    assert echo_servers() == []


def test_a_policy_gates_on_the_slo_rate_and_its_interval():
    """The release policy's commented SLO example, switched on: the pessimistic end of
    speedup/slo_rate_rps and the candidate's own SLO rate."""
    import yaml

    from quantbench.release.gate import Policy, evaluate_policy

    policy = yaml.safe_load((Path(__file__).resolve().parents[2] / "policies" / "release.yaml").read_text())
    policy["min"] = {"speedup/slo_rate_rps": {"value": 1.0, "on": "ci_low"}, "speed/slo_rate_rps": 2.0}
    policy = Policy.model_validate({**policy, "recovery": {}, "max": {}, "stages": ["bench"]})
    tags = {"quantbench.bench_server": "llamacpp", "quantbench.license": "mit"}
    measured = {"speed/ttft_ms_p50": 10.0, "speed/slo_rate_rps": 6.0, "speedup/slo_rate_rps": 1.5,
                "speedup/slo_rate_rps.ci_low": 1.1, "speedup/slo_rate_rps.ci_high": 2.0}
    checks = {c.check: c for c in evaluate_policy(policy, "FINISHED", tags, measured)}
    assert checks["speedup/slo_rate_rps"].passed and checks["speed/slo_rate_rps"].passed
    noisy = {**measured, "speedup/slo_rate_rps.ci_low": 0.9}  # faster on the median, not shown to be
    assert not {c.check: c for c in evaluate_policy(policy, "FINISHED", tags, noisy)}["speedup/slo_rate_rps"].passed
    slow = {**measured, "speed/slo_rate_rps": 1.5}
    assert not {c.check: c for c in evaluate_policy(policy, "FINISHED", tags, slow)}["speed/slo_rate_rps"].passed


def test_a_prefix_workload_needs_an_engine_that_turns_its_cache_off_per_request(echo_engine, workdir, tiny_model_dir,
                                                                                 capsys):
    (workdir / "profiles").mkdir()
    (workdir / "profiles" / "prefix.yaml").write_text("prompt_tokens: [16]\noutput_tokens: 4\nprefix: {tokens: 64}\n")
    bench = ["bench", str(tiny_model_dir), "--base", str(tiny_model_dir), "--profile", "prefix"]
    assert main([*bench, "--engine", "echo"]) == 2
    assert ("--profile: prefix: echo server does not turn its prefix cache on and off per request; vLLM and "
            "llama.cpp's server turn their prefix caches off per request") in capsys.readouterr().err
    assert main([*bench, "--engine", "hf"]) == 2
    assert "a prefix workload needs a server with a prefix cache" in capsys.readouterr().err
    (workdir / "profiles" / "prefix.yaml").write_text("prompt_tokens: [16]\nprefix: {tokens: 64, prompts: 1}\n")
    assert main([*bench, "--engine", "echo"]) == 2
    assert "profiles/prefix.yaml: prefix.prompts: Input should be greater than or equal to 2" in capsys.readouterr().err
    assert runs() == [] and echo_servers() == []


@pytest.mark.slow  # two real servers, one of them SIGKILLed mid-sweep
def test_a_server_that_falls_over_mid_sweep_keeps_the_levels_measured_and_fails_the_run(
    slot_echo, workdir, tiny_model_dir, capsys
):
    import os
    import signal
    import threading
    import time

    fast = the_faster_model_and_a_sweep(workdir, tiny_model_dir, repetitions=1, rates=2, requests=8)

    def kill_the_candidate_mid_repetition() -> None:
        # the warm-up sends the candidate 21 requests (1 single, 4 at c2, 8 at c1, 8 at c8, no rates yet);
        # the measured repetition 1 + 4 more, then its synchronous run: killed 4 requests into that
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for proc in echo_servers():
                if f"{fast}" in proc.info["cmdline"]:
                    log = Path(os.readlink(f"/proc/{proc.pid}/fd/1"))
                    if log.read_text().count("POST /v1/completions") >= 30:
                        os.kill(proc.pid, signal.SIGKILL)
                        return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_the_candidate_mid_repetition)
    killer.start()
    code = main(["bench", str(fast), "--base", str(tiny_model_dir), "--profile", "slo", "--engine", "slotecho"])
    killer.join()
    assert code == 1
    [run] = runs()
    assert run.info.status == "FAILED" and run.data.tags["quantbench.bench_partial"] == "true"
    report = json.loads(Path(download_artifacts(run_id=run.info.run_id, artifact_path="bench.json")).read_text())
    assert report["partial"] is True and "EndpointError" in report["error"]
    # the unfinished repetition's levels measured before the server fell over are kept, and marked so
    unfinished = report["unfinished"]
    assert unfinished["model"] == "candidate" and unfinished["repetition"] == 1 and unfinished["warmup"] is False
    assert unfinished["measured"]["c2/requests_s"] > 0 and "p16/ttft_ms" in unfinished["measured"]
    assert "c8/requests_s" not in unfinished["measured"]
    assert echo_servers() == []  # the base's server stopped too
