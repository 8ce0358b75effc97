"""A tuned mix of llama.cpp tensor types against llama.cpp's own Q4_K_M at the same file size.

Measured in one run, on the default model, each checkpoint evaluated the same way (the recipe's
suite, in-process de-quantized KLD and llama-perplexity's KLD against the base's F16 file):
  1. `gguf-q4_k_m` quantized and evaluated (llama.cpp's hand-made mix; on this model most of its
     tensors fall back from K-quants to Q5_0 / Q8_0, rows of 576 not being multiples of 256)
  2. `quantbench tune --engine llamacpp --max-size-mb <Q4_K_M's file size>` (one candidate: the
     allocation of llama.cpp types per tensor with the least predicted KLD at that size; `--schemes`
     to choose the types: the default model was de-quantized from a Q4_1 GGUF, see --help)
Both without a bench stage (speed is bench/llamacpp_speed.py's). Printed: each checkpoint's size,
bits per weight, quality/kld_mean and quality_engine/kld_mean with their intervals, then the
ratios tuned / Q4_K_M (goal of issue 27: quality_engine/kld_mean <= 0.70x, intervals apart, at a
size at most 1 % above Q4_K_M's: the tune may spend less when more bits buy nothing). The last line
is a JSON object.

    .venv/bin/python bench/gguf_tune.py [--suite default] [--experiment gguf-tune]

About 25 minutes on an AVX2-only 2-core machine (llama.cpp built beforehand: make llamacpp).
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

import yaml

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("quality/kld_mean", "quality_engine/kld_mean", "quality/top1_agreement", "quality_engine/same_top_p")


def quantbench(*args: str, env: dict) -> dict:
    done = subprocess.run([sys.executable, "-m", "quantbench", *args, "--json"], env=env, cwd=ROOT, text=True,
                          stdout=subprocess.PIPE)
    if done.returncode not in (0, 1):
        sys.exit(f"quantbench {' '.join(args)} failed (exit {done.returncode})")
    return json.loads(done.stdout.strip().splitlines()[-1])


def without_bench(name: str, suite: str, folder: Path, imatrix: bool | None = None) -> Path:
    doc = yaml.safe_load((ROOT / "recipes" / f"{name}.yaml").read_text())
    doc.pop("bench", None)
    doc["evaluate"] = {"suite": suite}
    if imatrix is not None:
        doc["quantize"]["imatrix"] = imatrix
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", default="default")
    parser.add_argument("--experiment", default="gguf-tune")
    parser.add_argument("--schemes", nargs="+", default=None, metavar="TYPE",
                        help="the types the tune chooses from (default: tune's, which include Q4_1). The "
                        "default model was de-quantized from a Q4_1 GGUF: its weights sit on Q4_1's grid, so Q4_1 "
                        "re-quantizes them almost losslessly; leave it out to measure a model that never was quantized")
    parser.add_argument("--imatrix", action="store_true",
                        help="the tuned candidate with an importance matrix too, as gguf-q4_k_m has one (the "
                        "sensitivity then rounds every type through llama-quantize with the same matrix)")
    parser.add_argument("--reference", metavar="RUN_ID", help="a finished gguf-q4_k_m run to compare with (not re-made)")
    args = parser.parse_args()
    env = {**os.environ, "MLFLOW_EXPERIMENT_NAME": args.experiment}

    from quantbench.core import hardware

    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if args.reference:
            from quantbench.tracking import Tracker

            ref = dict(Tracker(args.experiment).existing(args.reference).data.metrics)
        else:
            ref = quantbench("quantize", str(without_bench("gguf-q4_k_m", args.suite, folder)), env=env)["metrics"]
        size = ref["model/size_mb"]
        tuned = quantbench("tune", "--policy", "experimental", "--engine", "llamacpp", "--from",
                           str(without_bench("gguf-q4_0", args.suite, folder, args.imatrix or None)), "--max-size-mb", f"{size:.4f}",
                           "--budget-runs", "1", *(["--schemes", *args.schemes] if args.schemes else []), env=env)
    [cand] = tuned["candidates"]
    if cand["run_id"] is None:
        sys.exit(f"the tuned candidate was not measured: {cand['reason']}")
    mix = cand["metrics"]

    def row(name: str, m: dict) -> dict:
        out = {"name": name, "size_mb": m["model/size_mb"], "bits_per_weight": m.get("model/bits_per_weight")}
        for k in KEYS:
            out[k] = m.get(k)
            out[k + ".ci"] = [m.get(k + ".ci_low"), m.get(k + ".ci_high")]
        return out

    rows = [row("gguf-q4_k_m", ref), row(cand["name"], mix)]
    print(f"{'checkpoint':28s} {'MiB':>7s} {'bits/w':>7s} {'KLD (hf)':>22s} {'KLD (llama.cpp)':>22s}")
    for r in rows:
        cells = [f"{r[k]:.4f} [{r[k + '.ci'][0]:.4f}, {r[k + '.ci'][1]:.4f}]" for k in KEYS[:2]]
        print(f"{r['name'][:28]:28s} {r['size_mb']:7.2f} {r['bits_per_weight']:7.3f} {cells[0]:>22s} {cells[1]:>22s}")
    ratios = {k: mix[k] / ref[k] for k in KEYS[:2] if mix.get(k) and ref.get(k)}
    apart = {k: mix[k + ".ci_high"] < ref[k + ".ci_low"] for k in KEYS[:2] if k + ".ci_high" in mix}
    size_ratio = mix["model/size_mb"] / size
    for k, v in ratios.items():
        print(f"{k}: tuned / Q4_K_M = {v:.3f} (goal <= 0.70), intervals apart: {apart.get(k)}")
    print(f"size: tuned / Q4_K_M = {size_ratio:.4f} (goal: at most 1.01); predicted KLD {cand['predicted_kld']:.4g}")
    print(json.dumps({"cpu": hardware.cpu().describe(), "suite": args.suite, "schemes": args.schemes, "imatrix": args.imatrix, "rows": rows,
                      "ratios": ratios,
                      "intervals_apart": apart, "size_ratio": size_ratio, "counts": cand["counts"],
                      "goal_met": bool(ratios.get(KEYS[1], 9) <= 0.70 and apart.get(KEYS[1]) and size_ratio <= 1.01),
                      "wall_s": round(time.monotonic() - started)}))


if __name__ == "__main__":
    main()
