"""A tune's candidates run as `quantbench quantize` jobs (the one call site: an executor that runs
them elsewhere slots in here)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from quantbench.jobs.executor import Job, Limits, Runner
from quantbench.recipe import load_recipe
from quantbench.tracking import Tracker

CANDIDATE_TIMEOUT_S = 6 * 3600  # one candidate's quantize + evaluate + bench, at most


@dataclass
class QuantizeJob:
    name: str
    recipe: Path
    log: Path
    tags: dict[str, str]


@dataclass
class JobOutcome:
    job: QuantizeJob
    exit_code: int | None
    result: dict | None  # the child's --json summary
    wall_s: float
    reason: str = ""


def run_quantize_jobs(
    jobs: list[QuantizeJob], *, executor, tracker: Tracker, outputs: Path, parent: str | None, concurrency: int = 1
) -> list[JobOutcome]:
    """Run `quantbench quantize RECIPE --json` for each job through the sweep's attempt loop
    (`executor.Runner`), up to `concurrency` at once: here as a child process, or on a Ray node
    (`executor`), each child's run carrying `job.tags` and the parent run id, its output into
    `job.log`'s directory. One attempt each (a candidate that fails is a measured outcome, not
    retried). Ctrl-C or SIGTERM stops every attempt in flight (its run ends KILLED) and propagates."""
    if not jobs:
        return []
    tasks = []
    for job in jobs:
        job.log.parent.mkdir(parents=True, exist_ok=True)
        tasks.append(
            Job(job.name, str(job.recipe), [], job.name, tags=job.tags, resources=load_recipe(job.recipe).resources())
        )
    runner = Runner(
        executor,
        Limits(timeout_s=CANDIDATE_TIMEOUT_S, retries=0, backoff_s=0, concurrency=concurrency),
        tracker=tracker,
        experiment=tracker.experiment,
        outputs=outputs,
        logs=jobs[0].log.parent,
        parent=parent,
        label="tune",
    )
    runner.run(tasks)
    outcomes = []
    for job, task in zip(jobs, tasks):
        attempt = task.attempts[-1]
        Path(attempt["log"]).replace(job.log)  # the candidate's log where the tune's state names it
        result = {"run_id": task.run_id, "metrics": task.metrics} if task.status == "finished" else None
        outcomes.append(JobOutcome(job, attempt.get("exit"), result, task.wall_s, task.reason))
    return outcomes
