"""Running quantize jobs: each attempt a `quantbench quantize` process with a log file, a wall-clock
timeout, and bounded retries with back-off. The engine under `quantbench sweep` (and `tune`):

    runner = Runner(LocalExecutor(), Limits(timeout_s=3600, retries=1, backoff_s=30, concurrency=2),
                    tracker=tracker, experiment="quantbench", outputs=Path("outputs"),
                    logs=Path("outputs/sweeps/NAME/logs"), parent=parent_run_id, on_change=save_state)
    runner.run(jobs)                         # every job to its end
    # or, one at a time as results come in:  runner.submit(job); ended = runner.wait()

A `Job` names a recipe file, its overrides, the tags its runs carry and the resources it asks of a
Ray node. The runner records every attempt in `job.attempts`, sets `job.status`, `run_id`,
`metrics` and `reason`, and calls `on_change` after every change, so the caller can write its state
(the sweep's state.json) and resume from it.

Where an attempt runs is the executor's business:
- `LocalExecutor`: a child process of this one, in its own process group, that gets SIGTERM when
  this process dies (PR_SET_PDEATHSIG); a timeout kills the group (SIGTERM, then SIGKILL).
- `RayExecutor` (ray_executor.py): a child process of a Ray actor on the node Ray places it, with
  the job's resources; the node kills its process tree on timeout, and the log comes back here.

Bad input (exit 2) is not retried, nor a job no node can host; anything else is retried after
backoff_s * 2**(n-1). An attempt that failed while its MLflow run is still RUNNING (its process
killed, its node lost) has that run marked FAILED with the attempt's reason; an attempt lost with
its node whose run did FINISH counts as finished, so a job never finishes twice.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from tqdm import tqdm

from quantbench.core.logs import terminal
from quantbench.core.processes import stop_group
from quantbench.tracking import ENV_PARENT, ENV_TAGS, TAG, Tracker

log = logging.getLogger(__name__)

KILL_GRACE_S = 20.0  # after SIGTERM, how long an attempt has to end its run before SIGKILL
ATTEMPT = TAG + "attempt"  # a unique id per attempt, on the attempt's run: finds it if its node is lost


@dataclass
class Job:
    """One quantize job and its history."""

    id: str
    recipe_path: str
    overrides: list[str]
    sha: str
    status: str = "pending"  # pending | running | finished | failed | skipped
    attempts: list[dict] = field(
        default_factory=list
    )  # {n, attempt, started, ended, exit, reason, run_id, log, node, host, pid}
    run_id: str | None = None
    reason: str = ""
    wall_s: float = 0.0
    metrics: dict = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)  # extra tags on its runs (quantbench.sweep, ...)
    resources: dict = field(default_factory=dict)  # asked of a Ray node: num_cpus, num_gpus, memory_gb


HISTORY = ("status", "attempts", "run_id", "reason", "wall_s", "metrics")  # what resuming keeps of a saved job


@dataclass(frozen=True)
class Limits:
    timeout_s: float  # wall clock of one attempt, from the moment its process starts
    retries: int  # attempts after the first
    backoff_s: float  # wait before retry n: backoff_s * 2**(n-1)
    concurrency: int  # attempts in flight at once


@dataclass
class Ended:
    """How an attempt ended."""

    code: int | None  # exit status (negative: killed by that signal); None: no exit status (lost, never started)
    reason: str = ""  # why it ended early: a timeout, a lost node, no node can host it
    retry: bool = True  # False: another attempt cannot do better
    elapsed_s: float | None = None  # how long its process ran, where the executor knows it


class Handle(Protocol):
    node: str | None  # where it runs, once known
    host: str | None
    pid: int | None


class Executor(Protocol):
    """Where attempts run. `start` returns at once; `poll` never blocks for long."""

    name: str

    def start(self, job: Job, argv: list[str], env: dict[str, str], log_path: Path, timeout_s: float) -> Handle:
        """Start `python -m quantbench *argv` with `env` added, its output into `log_path`."""

    def poll(self, handle: Handle) -> Ended | None:
        """None while the attempt runs; how it ended once it did (a timeout included)."""

    def stop(self, handle: Handle) -> None:
        """Kill the attempt's whole process tree now (the driver is interrupted)."""

    def describe(self) -> dict:
        """Where the attempts ran, for the summary."""

    def check_store(self, tracker: Tracker) -> None:
        """UserError if the attempts cannot reach `tracker`'s store and artifacts."""

    def close(self) -> None: ...


# ---------------------------------------------------------------------------------------------
# Local: a child process of this one


def die_with_parent() -> None:
    """In a child: its own session, and SIGTERM when the process that started it dies, whatever
    killed that (Linux prctl)."""
    os.setsid()
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class _LocalAttempt:
    proc: subprocess.Popen
    started: float
    timeout_s: float
    node: str | None = None
    host: str | None = None
    pid: int | None = None


class LocalExecutor:
    """Each attempt a child process of this one (today's sweep); resources are not looked at."""

    name = "local"

    def start(self, job: Job, argv: list[str], env: dict[str, str], log_path: Path, timeout_s: float) -> _LocalAttempt:
        cmd = [sys.executable, "-m", "quantbench", *argv]
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env}, preexec_fn=die_with_parent
            )
        return _LocalAttempt(proc, time.monotonic(), timeout_s, pid=proc.pid)

    def poll(self, handle: _LocalAttempt) -> Ended | None:
        if handle.proc.poll() is not None:
            return Ended(handle.proc.returncode)
        if time.monotonic() - handle.started <= handle.timeout_s:
            return None
        stop_group(handle.proc, KILL_GRACE_S)
        return Ended(handle.proc.returncode, f"timeout after {handle.timeout_s:g} s")

    def stop(self, handle: _LocalAttempt) -> None:
        stop_group(handle.proc, KILL_GRACE_S)

    def describe(self) -> dict:
        return {"name": self.name}

    def check_store(self, tracker: Tracker) -> None:
        pass  # a child process here reaches the store this process uses

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------
# The loop: start what fits, watch what runs, retry what failed


@dataclass
class _Running:
    job: Job
    handle: Handle
    started: float


class Runner:
    def __init__(
        self,
        executor: Executor,
        limits: Limits,
        *,
        tracker: Tracker,
        experiment: str,
        outputs: Path,
        logs: Path,
        parent: str | None = None,
        on_change: Callable[[], None] = lambda: None,
        say: Callable[[str], None] | None = None,
        label: str = "sweep",
    ):
        self.executor, self.limits, self.tracker = executor, limits, tracker
        self.experiment, self.outputs, self.logs, self.parent = experiment, outputs, logs, parent
        self.on_change, self.say, self.label = on_change, say or _say, label
        self.queue: list[Job] = []
        self.running: list[_Running] = []
        self.ready_at: dict[str, float] = {}
        self.tries: dict[str, int] = {}  # attempts in this invocation: each re-run gets a fresh budget

    def submit(self, job: Job) -> None:
        self.queue.append(job)
        self.ready_at[job.sha] = 0.0
        self.tries[job.sha] = 0

    @property
    def active(self) -> bool:
        return bool(self.queue or self.running)

    def run(self, jobs: list[Job], on_end: Callable[[Job], None] = lambda job: None) -> None:
        """Every job to its end (finished or failed); on Ctrl-C or SIGTERM, every attempt in flight
        is killed and its job left pending, then the interrupt goes on."""
        for job in jobs:
            self.submit(job)
        while self.active:
            for job in self.wait():
                on_end(job)

    def wait(self) -> list[Job]:
        """Start what may start, until at least one job has ended (finished, or failed its last
        try); the jobs that ended. [] when nothing is left to run."""
        try:
            while self.active:
                ended = self.step()
                if ended:
                    return ended
                time.sleep(0.2)
            return []
        except BaseException:
            self.interrupt()
            raise

    def step(self) -> list[Job]:
        now = time.monotonic()
        while self.queue and len(self.running) < self.limits.concurrency:
            job = next((j for j in self.queue if self.ready_at[j.sha] <= now), None)
            if job is None:
                break
            self.queue.remove(job)
            self._start(job)
        ended = []
        for attempt in list(self.running):
            outcome = self.executor.poll(attempt.handle)
            if outcome is not None:
                self.running.remove(attempt)
                if self._settle(attempt, outcome):
                    ended.append(attempt.job)
                self.on_change()
        return ended

    def interrupt(self) -> None:
        for attempt in self.running:  # Ctrl-C or SIGTERM: no orphan jobs
            self.executor.stop(attempt.handle)
            attempt.job.status = "pending"
            attempt.job.attempts[-1].update(
                ended=time.time(), reason=f"the {self.label} was interrupted", **_where(attempt.handle)
            )
            # a job told to stop ends its run KILLED itself; one that could not within the grace (busy in
            # native code) was killed, and its run is ended here rather than left RUNNING
            run = self._run_of(attempt.job.attempts[-1]["attempt"])
            if run is not None and run.info.status == "RUNNING":
                why = f"the {self.label} was interrupted; its job did not end the run within the grace and was killed"
                self.tracker.fail_run(run.info.run_id, why, status="KILLED")
                log.warning("%s: run %s ended KILLED: %s", self.label, run.info.run_id, why)
        self.running.clear()
        self.on_change()

    def _start(self, job: Job) -> None:
        self.tries[job.sha] += 1
        n = len(job.attempts) + 1
        attempt_id = uuid.uuid4().hex
        log_path = self.logs / f"{safe_name(job.id)}.attempt{n}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = ["quantize", job.recipe_path, "--json", "--experiment", self.experiment, "--outputs", str(self.outputs)]
        for item in job.overrides:
            argv += ["--set", item]
        tags = {**job.tags, ATTEMPT: attempt_id}
        env = {ENV_TAGS: json.dumps(tags), **({ENV_PARENT: self.parent} if self.parent else {})}
        handle = self.executor.start(job, argv, env, log_path, self.limits.timeout_s)
        job.status = "running"
        job.attempts.append(
            {
                "n": n,
                "attempt": attempt_id,
                "started": time.time(),
                "ended": None,
                "exit": None,
                "reason": "",
                "run_id": None,
                "log": str(log_path),
            }
        )
        self.on_change()
        self.say(f"start  {job.id} (try {self.tries[job.sha]}/{self.limits.retries + 1}) log: {log_path}")
        self.running.append(_Running(job, handle, time.monotonic()))

    def _settle(self, attempt: _Running, outcome: Ended) -> bool:
        """Record how the attempt ended; True when its job is done (finished, or failed for good)."""
        job, record, handle = attempt.job, attempt.job.attempts[-1], attempt.handle
        elapsed = outcome.elapsed_s if outcome.elapsed_s is not None else time.monotonic() - attempt.started
        job.wall_s += elapsed
        log_path = Path(record["log"])
        result = job_result(log_path) if outcome.code == 0 else None
        record.update(ended=time.time(), exit=outcome.code, run_id=(result or {}).get("run_id"), **_where(handle))
        where = f" on node {handle.node[:12]}" if handle.node else ""
        if outcome.code == 0 and result:
            job.status, job.run_id, job.metrics, job.reason = "finished", result["run_id"], result["metrics"], ""
            self.say(f"done   {job.id} in {elapsed:.0f} s: run {job.run_id}{where}")
            return True
        code = outcome.code
        reason = outcome.reason or (
            f"bad input (exit 2): {log_tail(log_path)}"
            if code == 2
            else f"exit {code}: {log_tail(log_path)}"
            if code and code > 0
            else f"killed by signal {-code}"
            if code
            else "no result in the log"
        )
        record["reason"] = reason
        run = self._run_of(record["attempt"])
        if run is not None:
            record["run_id"] = run.info.run_id
            if run.info.status == "FINISHED" and code is None:  # its node was lost after the job finished
                job.status, job.run_id, job.reason = "finished", run.info.run_id, ""
                job.metrics = dict(run.data.metrics)
                self.say(f"done   {job.id}: run {job.run_id} FINISHED before its node was lost ({reason})")
                return True
            if run.info.status == "RUNNING":  # nobody is left to end it
                self.tracker.fail_run(run.info.run_id, f"{self.label} attempt {record['n']} of job {job.id}: {reason}")
        retry = code != 2 and outcome.retry and self.tries[job.sha] <= self.limits.retries
        if retry:
            delay = self.limits.backoff_s * 2 ** (self.tries[job.sha] - 1)
            self.ready_at[job.sha] = time.monotonic() + delay
            self.queue.append(job)
            job.status = "pending"
            self.say(f"retry  {job.id} in {delay:.0f} s: {reason}")
            return False
        job.status, job.reason = "failed", reason
        tries = self.tries[job.sha]
        self.say(f"FAILED {job.id} after {tries} tr{'y' if tries == 1 else 'ies'}: {reason}")
        return True

    def _run_of(self, attempt_id: str):
        """The MLflow run an attempt started, if it got that far."""
        try:
            found = self.tracker.search({ATTEMPT: attempt_id}, status=None)
        except Exception as exc:  # the store unreachable now: the attempt's reason stands on its own
            log.warning("could not look up the run of attempt %s: %s", attempt_id, exc)
            return None
        return found[0] if found else None


def _where(handle: Handle) -> dict:
    """Where an attempt ran, as far as its executor knows: Ray node id, host, pid of its process."""
    return {k: v for k, v in (("node", handle.node), ("host", handle.host), ("pid", handle.pid)) if v}


def _say(line: str) -> None:
    tqdm.write(f"{time.strftime('%H:%M:%S')} {line}", file=terminal())


def safe_name(job_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.=," else "_" for c in job_id)


def job_result(log_path: Path) -> dict | None:
    """The JSON summary `quantbench quantize --json` printed as its last line."""
    for line in reversed(log_path.read_text(errors="replace").strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def log_tail(log_path: Path) -> str:
    lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (errors or lines or ["(empty log)"])[-1][-300:]
