"""What `quantbench sweep` costs over running the same jobs by hand, measured in one run.

N small jobs (fp8-dynamic on the default model, evaluation off, each a distinct recipe through
`--set calibration.seed=i`), two ways, against the same fresh store, alternating which goes first:
  by hand  `quantbench quantize fp8-dynamic --set ...` N times, one after another
  sweep    `quantbench sweep` of the same N jobs, concurrency 1
Printed: total wall time of each and sweep / by hand (goal <= 1.05); then the resume: a sweep of
the first N/2 jobs, then the sweep of all N again, whose wall time is compared with running the
other N/2 by hand (the difference is what resuming costs: reading state, finding the done jobs in
MLflow, the summary and compare).

    python bench/sweep_overhead.py [--jobs 4]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
QUANTBENCH = [sys.executable, "-m", "quantbench"]


def overrides(i: int) -> list[str]:
    return [f"calibration.seed={i}", "evaluate=null", "check.ppl_tokens=1024"]


def by_hand(indices, cwd: Path, env: dict) -> float:
    started = time.perf_counter()
    for i in indices:
        cmd = [*QUANTBENCH, "quantize", str(REPO / "recipes" / "fp8-dynamic.yaml")]
        for item in overrides(i):
            cmd += ["--set", item]
        subprocess.run(cmd, cwd=cwd, env=env, check=True, capture_output=True)
    return time.perf_counter() - started


def sweep(name: str, indices, cwd: Path, env: dict) -> float:
    (cwd / "sweeps").mkdir(exist_ok=True)
    # one matrix axis per job index would be a product; list the jobs as a matrix over the seed
    body = {"matrix": {"base": str(REPO / "recipes" / "fp8-dynamic.yaml"),
                       "overrides": {"calibration.seed": list(indices)}},
            "set": ["evaluate=null", "check.ppl_tokens=1024"], "retries": 0}
    (cwd / "sweeps" / f"{name}.yaml").write_text(yaml.safe_dump(body))
    started = time.perf_counter()
    subprocess.run([*QUANTBENCH, "sweep", name], cwd=cwd, env=env, check=True, capture_output=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=4)
    args = parser.parse_args()
    n = args.jobs
    with tempfile.TemporaryDirectory(prefix="qb-sweep-bench-") as tmp:
        root = Path(tmp)
        env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}", "PYTHONWARNINGS": "ignore"}
        # two experiments so that neither way finds the other's FINISHED runs
        hand_env = {**env, "MLFLOW_EXPERIMENT_NAME": "by-hand"}
        sweep_env = {**env, "MLFLOW_EXPERIMENT_NAME": "sweep"}
        hand_s, sweep_s = [], []
        for order in ("hand-first", "sweep-first"):  # alternate which goes first, so drift hits both
            hand_env_o = {**hand_env, "MLFLOW_EXPERIMENT_NAME": f"by-hand-{order}"}
            sweep_env_o = {**sweep_env, "MLFLOW_EXPERIMENT_NAME": f"sweep-{order}"}
            if order == "hand-first":
                hand_s.append(by_hand(range(n), root, hand_env_o))
                sweep_s.append(sweep(f"all-{order}", range(n), root, sweep_env_o))
            else:
                sweep_s.append(sweep(f"all-{order}", range(n), root, sweep_env_o))
                hand_s.append(by_hand(range(n), root, hand_env_o))
            print(f"{order}: by hand {hand_s[-1]:7.1f} s, sweep {sweep_s[-1]:7.1f} s", flush=True)
        hand = sum(hand_s) / len(hand_s)
        swept = sum(sweep_s) / len(sweep_s)
        print(f"\n{n} jobs (fp8-dynamic on the default model), concurrency 1, mean of both orders")
        print(f"by hand {hand:7.1f} s   sweep {swept:7.1f} s   sweep / by hand = {swept / hand:.3f} "
              f"(goal <= 1.05: {'met' if swept / hand <= 1.05 else 'NOT met'})")

        half = n // 2
        resume_env = {**sweep_env, "MLFLOW_EXPERIMENT_NAME": "resume"}
        sweep("half", range(half), root, resume_env)
        (root / "sweeps" / "half.yaml").unlink()
        resumed = sweep("half-then-all", range(n), root, resume_env)
        rest = by_hand(range(half, n), root, {**hand_env, "MLFLOW_EXPERIMENT_NAME": "rest"})
        print(f"resume: a sweep of {n} jobs with {half} already FINISHED took {resumed:.1f} s; the other {n - half} "
              f"by hand {rest:.1f} s; resuming costs {resumed - rest:+.1f} s ({resumed / rest:.3f}x)")


if __name__ == "__main__":
    main()
