"""`quantbench sweep` on the tiny model with real child processes and a real MLflow store: the
matrix, resume without redoing, timeouts, a crash then a retry, the sweep killed mid-job, bad
sweep files, and two sweeps at once."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

from quantbench.cli import main
from quantbench.tracking import owner_alive
from tests.helpers import last_json, runs, tiny_recipe, write_recipe

SLOW = pytest.mark.slow  # child quantize processes, timeouts, kills (every test here but reading sweep files)


def write_sweep(workdir: Path, name: str, body: dict) -> str:
    (workdir / "sweeps").mkdir(exist_ok=True)
    (workdir / "sweeps" / f"{name}.yaml").write_text(yaml.safe_dump(body))
    return name


def state(workdir: Path, name: str) -> dict:
    return json.loads((workdir / "outputs" / "sweeps" / name / "state.json").read_text())



def sweep_children() -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "quantbench" in cmd and "quantize" in cmd and any(str(part).startswith("recipes/") for part in cmd):
            found.append(proc)
    return found


@pytest.fixture
def recipes(workdir, tiny_model_dir):
    write_recipe(workdir, "fp8", tiny_recipe(tiny_model_dir, "method: fp8\n"))
    write_recipe(workdir, "gptq", tiny_recipe(tiny_model_dir, "method: gptq\ngroup_size: 32\n"))
    yield
    assert sweep_children() == [], "a sweep job process was left behind"


@SLOW
def test_matrix_runs_then_resume_skips_what_is_done(workdir, recipes, capsys):
    name = write_sweep(workdir, "grid", {"recipes": ["fp8"], "matrix": {"base": "gptq", "overrides": {"calibration.samples": [4, 6]}},
                                         "retries": 0})
    assert main(["sweep", name, "--json"]) == 0
    out = capsys.readouterr()
    summary = last_json(out.out)
    assert summary["counts"] == {"finished": 3, "skipped": 0, "failed": 0}
    jobs = {j["id"]: j for j in summary["jobs"]}
    assert set(jobs) == {"fp8", "gptq[samples=4]", "gptq[samples=6]"}
    assert "start  gptq[samples=4]" in out.err and "done   fp8" in out.err  # one line per job start and end
    for job in jobs.values():
        assert job["status"] == "finished" and len(job["attempts"]) == 1 and Path(job["attempts"][0]["log"]).is_file()
    by_id = {r.info.run_id: r for r in runs()}
    children = [r for r in by_id.values() if r.data.tags.get("quantbench.role") == "candidate"]
    assert len(children) == 3 and all(r.info.status == "FINISHED" for r in children)
    assert {r.data.tags["quantbench.recipe_sha"] for r in children} == {j["sha"] for j in jobs.values()}
    assert {r.data.params["calibration.samples"] for r in children} == {"4", "6"}
    parent = by_id[summary["parent_run"]]
    assert parent.info.status == "FINISHED" and parent.data.tags["quantbench.role"] == "sweep"
    assert all(r.data.tags["mlflow.parentRunId"] == parent.info.run_id for r in children)
    assert parent.data.metrics["sweep/finished"] == 3
    assert Path(summary["compare"], "compare.md").is_file()
    assert "gptq[samples=6]" in out.out  # the summary table

    # re-run: nothing is done twice
    assert main(["sweep", name, "--json"]) == 0
    again = last_json(capsys.readouterr().out)
    assert all(j["status"] == "finished" for j in again["jobs"]) and again["parent_run"] == summary["parent_run"]
    assert len([r for r in runs() if r.data.tags.get("quantbench.role") == "candidate"]) == 3
    # --force: everything again
    write_sweep(workdir, "one", {"recipes": ["fp8"], "retries": 0})
    assert main(["sweep", "one", "--json"]) == 0
    assert last_json(capsys.readouterr().out)["jobs"][0]["status"] == "skipped"  # fp8 already FINISHED, found by sha
    assert main(["sweep", "one", "--force", "--json"]) == 0
    assert last_json(capsys.readouterr().out)["jobs"][0]["status"] == "finished"
    fp8_runs = [r for r in runs() if r.data.tags.get("quantbench.recipe") == "fp8" and r.data.tags.get("quantbench.role") == "candidate"]
    assert len(fp8_runs) == 2


@SLOW
def test_timeout_kills_retries_then_fails(workdir, recipes, capsys):
    name = write_sweep(workdir, "slow", {"recipes": ["fp8"], "timeout_s": 1, "retries": 1, "backoff_s": 0})
    started = time.monotonic()
    assert main(["sweep", name, "--json"]) == 1
    summary = last_json(capsys.readouterr().out)
    [job] = summary["jobs"]
    assert job["status"] == "failed" and job["reason"] == "timeout after 1 s"
    assert [a["reason"] for a in job["attempts"]] == ["timeout after 1 s"] * 2
    assert time.monotonic() - started < 60
    assert all(r.info.status != "RUNNING" for r in runs())


@SLOW
def test_a_crash_then_success_on_retry(workdir, recipes, tiny_model_dir, capsys, tmp_path):
    import shutil

    broken = tmp_path / "model"
    shutil.copytree(tiny_model_dir, broken)
    good = (broken / "model.safetensors").read_bytes()
    # whole safetensors that do not fit the config: the first attempt crashes loading them
    from safetensors.torch import load_file, save_file

    tensors = load_file(broken / "model.safetensors")
    save_file({k: v[:-1].clone() for k, v in tensors.items()}, broken / "model.safetensors", metadata={"format": "pt"})
    # the base is loaded in prepare (the job's base perplexity), before any run starts: it crashes there
    write_recipe(workdir, "flaky", tiny_recipe(broken, "method: fp8\n") + "  base_ppl_bound: false\n")
    name = write_sweep(workdir, "flaky", {"recipes": ["flaky"], "retries": 2, "backoff_s": 2})

    def repair() -> None:  # after the first attempt has failed, the file is whole again
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            path = workdir / "outputs" / "sweeps" / "flaky" / "state.json"
            try:  # the state file may be mid-write or not list the job yet
                attempts = next(iter(json.loads(path.read_text())["jobs"].values()))["attempts"]
            except (OSError, ValueError, KeyError, StopIteration):
                attempts = None
            if attempts and attempts[0]["ended"]:
                (broken / "model.safetensors").write_bytes(good)
                return
            time.sleep(0.1)

    fixer = threading.Thread(target=repair)
    fixer.start()
    code = main(["sweep", name, "--json"])
    fixer.join()
    summary = last_json(capsys.readouterr().out)
    assert code == 0
    [job] = summary["jobs"]
    assert job["status"] == "finished" and len(job["attempts"]) == 2
    assert job["attempts"][0]["reason"].startswith("exit 1")
    first_log = workdir / "outputs" / "sweeps" / "flaky" / "logs" / "flaky.attempt1.log"
    assert "quantize failed" in first_log.read_text()  # the crash is recorded, not lost
    # refused before its run began: MLflow holds the retry's run alone, nothing left RUNNING
    statuses = sorted(r.info.status for r in runs() if r.data.tags.get("quantbench.role") == "candidate")
    assert statuses == ["FINISHED"]


@SLOW
def test_sweep_killed_mid_job_resumes_and_reaps_the_stale_run(workdir, recipes, tiny_model_dir, capsys):
    from tests.conftest import TINY_SUITE

    # gptq evaluates as well: RUNNING for seconds, not the 1-2 s of the quantize stage alone
    (workdir / "suites").mkdir()
    (workdir / "suites" / "tiny.yaml").write_text(TINY_SUITE)
    write_recipe(workdir, "gptq", tiny_recipe(tiny_model_dir, "method: gptq\ngroup_size: 32\n") + "evaluate:\n  suite: tiny\n")
    name = write_sweep(workdir, "killed", {"recipes": ["fp8", "gptq"], "retries": 0})
    sweep = subprocess.Popen([sys.executable, "-m", "quantbench", "sweep", name], cwd=workdir, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # wait until the second job has created its MLflow run, then kill the node: sweep and job at once
    deadline, victim = time.monotonic() + 180, None
    while time.monotonic() < deadline and victim is None:
        time.sleep(0.2)
        for run in runs():
            if run.data.tags.get("quantbench.recipe") == "gptq" and run.info.status == "RUNNING":
                victim = run
    assert victim is not None, "the second job never started"
    os.kill(sweep.pid, signal.SIGKILL)
    owner = victim.data.tags["quantbench.owner"]
    os.killpg(int(owner.split()[1]), signal.SIGKILL)
    sweep.wait()
    for proc in sweep_children():
        proc.wait(30)
    # a killed job that frees a large heap stays "running" for a while; the resume below must meet a
    # dead owner (a live one is a different case: the sweep kills it, another message)
    deadline = time.monotonic() + 30
    while owner_alive(owner) is not False and time.monotonic() < deadline:
        time.sleep(0.1)
    assert state(workdir, name)["jobs"][victim.data.tags["quantbench.recipe_sha"]]["status"] == "running"

    assert main(["sweep", name, "--json"]) == 0
    summary = last_json(capsys.readouterr().out)
    assert {j["id"]: j["status"] for j in summary["jobs"]} == {"fp8": "finished", "gptq": "finished"}
    candidates = [r for r in runs() if r.data.tags.get("quantbench.role") == "candidate"]
    assert all(r.info.status != "RUNNING" for r in runs())
    stale = next(r for r in candidates if r.info.run_id == victim.info.run_id)
    assert stale.info.status == "FAILED" and "died without ending it" in stale.data.tags["quantbench.error"]
    finished = [r.data.tags["quantbench.recipe_sha"] for r in candidates if r.info.status == "FINISHED"]
    assert len(finished) == len(set(finished)) == 2  # one FINISHED run per recipe sha, none twice


@SLOW
def test_bad_sweep_files_report_every_problem(workdir, recipes, capsys):
    name = write_sweep(workdir, "bad", {"recipes": ["fp8", "fp9"], "matrix": {"base": "gptq", "overrides": {"quantize.grup_size": [32]}},
                                        "set": ["calibration.samples=4"]})
    assert main(["sweep", name]) == 2
    err = capsys.readouterr().err
    assert "sweeps/bad.yaml: job fp9 (line 8): unknown recipe 'fp9'" in err and "Did you mean 'fp8'?" in err
    assert "sweeps/bad.yaml: job gptq[grup_size=32] (line 4): recipes/gptq.yaml: quantize.grup_size" in err
    assert "Did you mean 'group_size'?" in err
    write_sweep(workdir, "keys", {"recipes": ["fp8"], "retry": 3})
    assert main(["sweep", "keys"]) == 2
    assert "sweeps/keys.yaml: retry (line 3): unknown key 'retry'. Did you mean 'retries'?" in capsys.readouterr().err
    write_sweep(workdir, "dup", {"recipes": ["fp8", "recipes/fp8.yaml"]})
    assert main(["sweep", "dup"]) == 2
    assert "is the same recipe as job fp8" in capsys.readouterr().err
    assert main(["sweep", "nope"]) == 2
    assert "unknown sweep 'nope'" in capsys.readouterr().err
    assert runs() == [] and not (workdir / "outputs").exists()



def test_a_sweep_file_is_checked_like_a_recipe_every_problem_with_its_line(workdir, recipes, capsys):
    """Schema errors do not hide the jobs' checks, and each problem has its line: a job's problem the
    line of what made it (its recipes: entry, the matrix override or set: item it names)."""
    (workdir / "sweeps").mkdir()
    (workdir / "sweeps" / "bad.yaml").write_text(
        "recipes:\n"
        "  - fp8\n"
        "  - fp9\n"                           # line 3: no such recipe
        "matrix:\n"
        "  base: gptq\n"
        "  overrides:\n"
        "    quantize.grup_size: [32]\n"      # line 7: no such key in the recipe
        "retry: 3\n"                          # line 8: no such key in a sweep
        "timeout_s: 0\n")                     # line 9: out of range
    assert main(["sweep", "bad"]) == 2
    err = capsys.readouterr().err
    where = "error: sweeps/bad.yaml"
    for expected in (
        f"{where}: retry (line 8): unknown key 'retry'. Did you mean 'retries'? Available: ",
        f"{where}: timeout_s (line 9): Input should be greater than 0 (got 0)",
        f"{where}: job fp9 (line 3): unknown recipe 'fp9' (no recipes/fp9.yaml). Did you mean 'fp8'?",
        f"{where}: job gptq[grup_size=32] (line 7): recipes/gptq.yaml: quantize.grup_size (--set quantize.grup_size=32): "
        "unknown key 'grup_size'. Did you mean 'group_size'?",
    ):
        assert expected in err, err
    assert runs() == [] and not (workdir / "outputs").exists()

@SLOW
def test_two_sweeps_at_once(workdir, recipes, capsys):
    """A sweep that another process is running is refused; another sweep runs beside it. The first
    is held where it is (its lock taken here, as a running sweep holds it) rather than raced: on a
    loaded machine a real first sweep could finish before the second one starts."""
    from quantbench.core.processes import hold_lock

    write_sweep(workdir, "a", {"recipes": ["fp8"], "retries": 0})
    write_sweep(workdir, "b", {"recipes": ["gptq"], "retries": 0})
    cmd = [sys.executable, "-m", "quantbench", "sweep"]
    held = hold_lock(workdir / "outputs" / "sweeps" / "a", "this sweep")
    try:
        same = subprocess.run([*cmd, "a"], cwd=workdir, capture_output=True, text=True)  # refused
        other = subprocess.run([*cmd, "b"], cwd=workdir, capture_output=True, text=True)  # runs beside it
    finally:
        held.close()
    assert same.returncode == 2 and "this sweep is already running" in same.stderr
    assert f"(pid {os.getpid()}," in same.stderr  # the holder named
    assert other.returncode == 0, other.stderr[-2000:]
    first = subprocess.run([*cmd, "a"], cwd=workdir, capture_output=True, text=True)  # released: it runs
    assert first.returncode == 0, first.stderr[-2000:]
    candidates = [r for r in runs() if r.data.tags.get("quantbench.role") == "candidate"]
    assert sorted(r.data.tags["quantbench.recipe"] for r in candidates) == ["fp8", "gptq"]
    assert all(r.info.status == "FINISHED" for r in runs())


@SLOW
def test_shipped_sweeps_validate(monkeypatch):
    from quantbench.jobs.sweep import load_sweep

    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(repo)
    monkeypatch.delenv("QUANTBENCH_RECIPES", raising=False)
    for path in (repo / "sweeps").glob("*.yaml"):
        assert path.read_text().startswith(f"# Run: make sweep SWEEP={path.stem}\n")
        _, _, jobs = load_sweep(path.stem)
        assert jobs
