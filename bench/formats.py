"""The floating-point formats against the integer ones on the default model: each recipe quantized
and scored with one suite in this run (the base scored once), then its stored bits per weight, KLD
with its 95 % interval, top-1 agreement, perplexity over the base's and produce time, and its KLD as a ratio
of AWQ W4A16's (the baseline, measured in the same run). Goal (issue: the formats people ship now):
NVFP4A16 within 1.3x AWQ W4A16's KLD at <= 4.6 bits per weight.

    python bench/formats.py [--suite cpu-smoke] [--recipes awq-int4,gptq-nvfp4a16,...] [--work DIR]

Runs `quantbench quantize RECIPE --set evaluate.suite=SUITE --json` in a store of its own under
--work (default: a temporary directory). The CPU class is printed first; the last line is a JSON
object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from quantbench.core import hardware  # noqa: E402

BASELINE = "awq-int4"
RECIPES = [BASELINE, "gptq-w4a16", "gptq-nvfp4a16", "awq-nvfp4a16", "gptq-mxfp4a16", "gptq-w4afp8", "gguf-mxfp4", "gguf-q4_0",
           "nvfp4", "fp8-dynamic", "fp8-block", "mxfp8"]  # fmt: skip
GOAL = {"recipe": "gptq-nvfp4a16", "kld_ratio": 1.3, "bits": 4.6}


def run(recipe: str, suite: str, work: Path) -> dict:
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{work}/mlflow.db", "MLFLOW_EXPERIMENT_NAME": "formats"}
    start = time.monotonic()
    cmd = [sys.executable, "-m", "quantbench", "quantize", str(REPO / "recipes" / f"{recipe}.yaml"),
           "--outputs", str(work / "outputs"), "--set", f"evaluate.suite={suite}", "--json"]  # fmt: skip
    log = work / "logs" / f"{recipe}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as err:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    wall = time.monotonic() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = log.read_text().strip().splitlines()[-3:]
        return {"recipe": recipe, "ok": False, "wall_s": wall, "error": " | ".join(tail)}
    m = json.loads(lines[-1])["metrics"]
    return {
        "recipe": recipe,
        "ok": True,
        "wall_s": wall,
        "produce_s": m.get("stage/produce/wall_s"),
        "bits": m.get("model/bits_per_weight"),
        "kld": m.get("quality/kld_mean"),
        "kld_low": m.get("quality/kld_mean.ci_low"),
        "kld_high": m.get("quality/kld_mean.ci_high"),
        "top1": m.get("quality/top1_agreement"),
        # the candidate's perplexity over the base's on the suite's text (recovery is base / candidate)
        "ppl_ratio": 1 / m["recovery/quality/ppl"] if m.get("recovery/quality/ppl") else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", default="cpu-smoke", help="the evaluation suite (default: cpu-smoke)")
    parser.add_argument(
        "--recipes", default=",".join(RECIPES), help=f"comma-separated; {BASELINE} first is the baseline"
    )
    parser.add_argument("--work", type=Path, help="where the store and checkpoints go (default: a temporary dir)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="formats-"))
    work.mkdir(parents=True, exist_ok=True)
    recipes = args.recipes.split(",")
    print(f"# formats on {hardware.device_line()}; suite {args.suite}; work {work}", flush=True)
    rows = []
    for recipe in recipes:
        row = run(recipe, args.suite, work)
        rows.append(row)
        if row["ok"]:
            print(
                f"{recipe:16} {row['bits']:5.2f} bits/w  KLD {row['kld']:.4f} [{row['kld_low']:.4f}, "
                f"{row['kld_high']:.4f}]  top-1 {row['top1']:.3f}  ppl x{row['ppl_ratio']:.3f}  "
                f"produce {row['produce_s']:.0f} s",
                flush=True,
            )
        else:
            print(f"{recipe:16} FAILED after {row['wall_s']:.0f} s: {row['error']}", flush=True)
    base = next((r for r in rows if r["recipe"] == BASELINE and r["ok"]), None)
    for row in rows:
        row["kld_vs_baseline"] = row["kld"] / base["kld"] if base and row["ok"] and base["kld"] else None
    if base:
        print(f"KLD as a ratio of {BASELINE}'s ({base['kld']:.4f}), at bits per weight:")
        for row in rows:
            if row["kld_vs_baseline"] is not None:
                print(f"  {row['recipe']:16} {row['kld_vs_baseline']:5.2f}x at {row['bits']:.2f}")
    goal = next((r for r in rows if r["recipe"] == GOAL["recipe"] and r.get("kld_vs_baseline")), None)
    # None: the goal's recipe (or the baseline) was not among those run
    met = goal["kld_vs_baseline"] <= GOAL["kld_ratio"] and goal["bits"] <= GOAL["bits"] if goal else None
    print(
        json.dumps(
            {
                "machine": hardware.device_line(),
                "suite": args.suite,
                "baseline": BASELINE,
                "goal": {**GOAL, "met": met},
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
