"""`quantbench sweep sweeps/NAME.yaml [--ray [ADDRESS]]`: many quantize jobs, each in its own process,
that lose nothing and do nothing twice.

- Jobs: shipped recipes by name and/or a matrix of overrides over a base recipe; every job is
  validated before any runs (all errors at once), and identified by its resolved recipe's sha.
- Each attempt is a `quantbench quantize` process with a log file, a wall-clock timeout (its
  process tree is killed: SIGTERM, then SIGKILL) and bounded retries with back-off; bad input
  (exit 2) is not retried (executor.py). Without --ray the attempts are child processes of the
  sweep, which get SIGTERM if the sweep dies (PR_SET_PDEATHSIG); with --ray each runs on the node of
  a Ray cluster that Ray places it on, with the resources the recipe or sweep asks for
  (ray_executor.py), and its log comes back here.
- State (`outputs/sweeps/NAME/state.json`, rewritten atomically after every change) records each
  job's attempts, runs and result. Re-running the sweep resumes: jobs whose recipe sha already has
  a FINISHED run are skipped (unless --force), RUNNING runs left by a dead sweep are marked FAILED,
  and the rest run. A lock file keeps two processes from running the same sweep at once.
- At the end: a summary table, a parent MLflow run grouping the jobs' runs (`mlflow.parentRunId`),
  and the compare output for them.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path

from pydantic import Field, PositiveInt
from tqdm import tqdm

from quantbench.core import tables
from quantbench.core.errors import UserError, did_you_mean
from quantbench.core.files import atomic_write
from quantbench.core.logs import terminal
from quantbench.core.processes import hold_lock
from quantbench.jobs import ray_executor
from quantbench.jobs.executor import HISTORY, Executor, Job, Limits, Runner
from quantbench.recipe import (
    CheckedFile,
    ResourcesSpec,
    check_file,
    load_recipe,
    resolve_recipe_path,
)
from quantbench.recipe.common import Strict
from quantbench.release import compare
from quantbench.tracking import TAG, Tracker

log = logging.getLogger(__name__)

__all__ = ["Job", "Sweep", "load_sweep", "run"]


class Matrix(Strict):
    base: str  # a recipe name or path
    overrides: dict[str, list] = Field(default_factory=dict)  # field path -> values; the grid is their product


class Sweep(Strict):
    """A sweep file (sweeps/NAME.yaml)."""

    description: str = ""
    recipes: list[str] = Field(default_factory=list)
    matrix: Matrix | None = None
    set: list[str] = Field(default_factory=list)  # KEY=VALUE overrides applied to every job
    timeout_s: PositiveInt = 3600
    retries: int = Field(1, ge=0, le=10)  # attempts after the first
    backoff_s: float = Field(30.0, ge=0)  # wait before retry n: backoff_s * 2**(n-1)
    concurrency: PositiveInt = 1  # attempts in flight at once (with --ray: handed to Ray at once)
    experiment: str | None = None
    # --ray: what each job asks of a node where its recipe's resources: does not say
    resources: ResourcesSpec | None = None
    # --ray: how long a job may wait when no node of the cluster has the resources it asks for
    placement_timeout_s: PositiveInt = 600


# ---------------------------------------------------------------------------------------------
# Loading: every problem at once


def sweeps_dir() -> Path:
    return Path("sweeps")


def load_sweep(name_or_path: str) -> tuple[Path, Sweep, list[Job]]:
    """The sweep file and its jobs. Every problem at once, each with its line, as a recipe's: the
    schema's and every job's (its recipe's, with the overrides the sweep applies); a schema problem
    hides none of the jobs' (they are made from the rest of the file)."""
    path = Path(name_or_path) if name_or_path.endswith((".yaml", ".yml")) else sweeps_dir() / f"{name_or_path}.yaml"
    if not path.is_file():
        available = sorted(p.stem for p in sweeps_dir().glob("*.yaml"))
        raise UserError(f"unknown sweep '{name_or_path}' (no {path})." + did_you_mean(path.stem, available))
    checked = check_file(path, Sweep)
    problems = list(checked.problems)
    jobs: list[Job] = []
    if checked.settings is not None:
        jobs, found = _jobs(checked.settings, checked)
        problems += found
    if problems or checked.settings is None:
        raise UserError(problems)
    return path, checked.settings, jobs


def _jobs(sweep: Sweep, checked: CheckedFile) -> tuple[list[Job], list[str]]:
    """Every job of the sweep, validated, and their problems: `job ID (line N): ...`, the line of
    what made it (its recipes: entry, or the matrix override or set: item a problem names)."""
    path = checked.path
    specs: list[tuple[str, str, list[str], tuple]] = []  # (job id, recipe name or path, overrides, where in the file)
    for i, name in enumerate(sweep.recipes):
        specs.append((Path(name).stem, name, list(sweep.set), ("recipes", i)))
    if sweep.matrix is not None:
        keys = list(sweep.matrix.overrides)
        for values in itertools.product(*(sweep.matrix.overrides[k] for k in keys)):
            items = [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in zip(keys, values)]
            label = ",".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in zip(keys, values))
            base = sweep.matrix.base
            specs.append((f"{Path(base).stem}[{label}]", base, [*sweep.set, *items], ("matrix", "base")))
    invalid = {loc[0] for loc in checked.invalid if loc}
    if not specs:
        # recipes: or matrix: with a problem of its own (said) may be what held the jobs
        said = invalid & {"recipes", "matrix"}
        return [], ([] if said else [f"{path}: no jobs: give recipes: and/or matrix:"])

    def line_of(problem: str, origin: tuple) -> int | None:
        for key in sweep.matrix.overrides if sweep.matrix is not None and origin[0] == "matrix" else ():
            if f"--set {key}=" in problem:
                return checked.line("matrix", "overrides", key)
        for i, item in enumerate(sweep.set):
            if f"--set {item}" in problem:
                return checked.line("set", i)
        return checked.line(*origin)

    def job(job_id: str, line: int | None) -> str:
        return f"{path}: job {job_id}" + (f" (line {line})" if line else "")

    problems: list[str] = []
    jobs: list[Job] = []
    seen: dict[str, str] = {}
    for job_id, recipe, overrides, origin in specs:
        try:
            loaded = load_recipe(resolve_recipe_path(recipe), tuple(overrides))
        except UserError as exc:
            problems += [f"{job(job_id, line_of(p, origin))}: {p}" for p in exc.problems]
            continue
        if loaded.sha in seen:
            problems.append(
                f"{job(job_id, checked.line(*origin))} is the same recipe as job {seen[loaded.sha]} "
                f"(sha {loaded.sha[:12]})"
            )
            continue
        seen[loaded.sha] = job_id
        jobs.append(
            Job(
                job_id,
                str(loaded.path),
                overrides,
                loaded.sha,
                tags={TAG + "sweep": path.stem, TAG + "sweep_job": job_id},
                resources=loaded.resources(sweep.resources),
            )
        )
    return jobs, problems


# ---------------------------------------------------------------------------------------------
# State on disk


class State:
    """The sweep's durable record; every change is written to a temp file and renamed into place."""

    def __init__(self, directory: Path, name: str):
        self.path = directory / "state.json"
        self.data: dict = {"sweep": name, "parent_run": None, "jobs": {}}
        if self.path.exists():
            self.data = json.loads(self.path.read_text())

    def job(self, job: Job) -> Job:
        """The job with its recorded history (attempts, runs, result), if this sha has one."""
        saved = self.data["jobs"].get(job.sha)
        return replace(job, **{k: saved[k] for k in HISTORY if k in saved}) if saved else job

    def save(self, jobs: list[Job] | None = None) -> None:
        if jobs is not None:
            self.data["jobs"] = {j.sha: asdict(j) for j in jobs}
        atomic_write(self.path, json.dumps(self.data, indent=2))


def _lock(directory: Path):
    return hold_lock(directory, "this sweep", "wait for it, or run another sweep")


# ---------------------------------------------------------------------------------------------
# The verb


def run(
    name_or_path: str,
    *,
    force: bool = False,
    outputs: Path = Path("outputs"),
    experiment: str | None = None,
    ray: str | None = None,
) -> dict:
    """`ray`: None runs the jobs here; an address (or "" for a running cluster, else a local Ray
    started for the sweep) runs each attempt on a Ray cluster."""
    path, sweep, jobs = load_sweep(name_or_path)
    name = path.stem
    experiment = experiment or sweep.experiment
    executor = _executor(ray, sweep)  # before anything is written: a bad address leaves nothing behind
    try:
        tracker = Tracker(experiment)
        if ray is not None:
            executor.check_store(tracker)
        directory = outputs / "sweeps" / name
        directory.mkdir(parents=True, exist_ok=True)
        lock = _lock(directory)
        try:
            state = State(directory, name)
            jobs = [state.job(j) for j in jobs]
            _reap_stale_runs(tracker, name)
            parent = _parent_run(tracker, state, name, sweep)
            for job in jobs:  # resume: what is done stays done, the rest runs (again)
                if job.status == "running":  # its attempt died with the previous sweep
                    job.attempts[-1].update(ended=time.time(), reason="the sweep died during this attempt")
                done = tracker.find_runs({TAG + "recipe_sha": job.sha})
                if done and not force:
                    if job.status != "finished":
                        job.status, job.run_id, job.reason = "skipped", done[0], f"already FINISHED in run {done[0]}"
                else:
                    job.status, job.reason = "pending", ""
            state.save(jobs)
            todo = [j for j in jobs if j.status == "pending"]
            log.info(
                "sweep %s: %d jobs, %d to run, %d done before (%s)",
                name,
                len(jobs),
                len(todo),
                len(jobs) - len(todo),
                executor.name,
            )
            limits = Limits(sweep.timeout_s, sweep.retries, sweep.backoff_s, sweep.concurrency)
            runner = Runner(
                executor,
                limits,
                tracker=tracker,
                experiment=tracker.experiment,
                outputs=outputs,
                logs=directory / "logs",
                parent=parent,
                on_change=lambda: state.save(jobs),
                say=tqdm_write,
            )
            bar = tqdm(total=len(todo), desc=f"sweep {name}", unit="job", file=terminal())
            threading.Thread(target=_preload, name="preload", daemon=True).start()
            try:
                runner.run(todo, on_end=lambda job: bar.update(1))
            except BaseException:  # Ctrl-C / SIGTERM: the jobs were stopped; the parent run says so
                tracker.fail_run(parent, "the sweep was interrupted; re-run it to resume", status="KILLED")
                raise
            finally:
                bar.close()
            summary = _finish(tracker, state, jobs, parent, directory, name, executor.describe())
        finally:
            lock.close()
    finally:
        executor.close()
    return summary


def _executor(ray: str | None, sweep: Sweep) -> Executor:
    return ray_executor.make(ray, sweep.placement_timeout_s)


def _preload() -> None:
    """Import what the summary's plot needs (matplotlib: ~0.5 s) while the first job runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401


def tqdm_write(line: str) -> None:
    tqdm.write(f"{time.strftime('%H:%M:%S')} {line}", file=terminal())


def _reap_stale_runs(tracker: Tracker, name: str) -> None:
    """RUNNING runs of this sweep left by a sweep that died: FAILED. Opening the store already
    marked those whose process is gone; a job process still alive is a leftover of the dead sweep
    (the lock says no sweep owns it): it is killed first."""
    for run_id in tracker.fail_orphans({TAG + "sweep": name, TAG + "role": "candidate"}, "sweep"):
        log.warning("sweep %s: run %s was left RUNNING by a dead sweep; marked FAILED", name, run_id)


def _parent_run(tracker: Tracker, state: State, name: str, sweep: Sweep) -> str:
    parent = state.data.get("parent_run")
    if parent and tracker.existing(parent) is not None:
        return parent
    run = tracker.start_run(
        f"sweep · {name}",
        {TAG + "role": "sweep", TAG + "sweep": name, "mlflow.note.content": sweep.description or f"sweep {name}"},
    )
    state.data["parent_run"] = run.run_id
    state.save()
    return run.run_id


def _finish(
    tracker: Tracker, state: State, jobs: list[Job], parent: str, directory: Path, name: str, where: dict
) -> dict:
    rows = []
    for j in jobs:
        m = j.metrics
        cell = lambda k, f: format(m[k], f) if k in m else "—"  # noqa: E731
        rows.append(
            [
                j.id,
                j.status,
                str(len(j.attempts)),
                f"{j.wall_s:.0f}",
                cell("model/size_mb", ".1f"),
                cell("check/ppl_ratio", ".3f"),
                cell("quality/kld_mean", ".4f"),
                cell("speedup/decode_tok_s", ".2f"),
                j.run_id or j.reason,
            ]
        )
    headers = ["job", "status", "tries", "wall s", "size MB", "ppl ×", "KLD", "decode ×", "run / reason"]
    table = tables.table(headers, rows, "llrrrrrrl")
    counts = {s: sum(j.status == s for j in jobs) for s in ("finished", "skipped", "failed")}
    summary = {
        "sweep": name,
        "parent_run": parent,
        "counts": counts,
        "state": str(state.path),
        "executor": where,
        "jobs": [asdict(j) for j in jobs],
        "table": table,
    }
    run = tracker.resume_run(parent)
    with run:
        run.log_dict(summary, "sweep.json")
        run.log_text(table + "\n", "sweep.txt")
        run.log_metrics({f"sweep/{k}": v for k, v in counts.items()})
        run.set_tags({TAG + "sweep_runs": ",".join(j.run_id for j in jobs if j.run_id)})
    finished = [j.run_id for j in jobs if j.run_id and j.status in ("finished", "skipped")]
    if finished:
        try:
            summary["compare"] = str(
                compare.run(experiment=tracker.experiment, run_ids=finished, outputs=directory.parent.parent).outputs
            )
        except UserError as exc:
            log.warning("sweep %s: no comparison: %s", name, "; ".join(exc.problems))
    return summary
