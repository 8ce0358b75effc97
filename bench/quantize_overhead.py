"""What quantbench costs on top of llm-compressor, measured in one run.

The same GPTQ W4A16 recipe on the default model, two ways, each in a fresh process, interleaved
(A B A B ...) so machine drift hits both:
  direct     load bf16 -> llmcompressor.oneshot -> save_pretrained(save_compressed=True)
  quantbench `quantbench quantize` with the same settings (input checks, base perplexity,
             oneshot, save, reload check, MLflow)
Printed: the oneshot time inside each (goal: quantbench / direct <= 1.05), the whole wall time of
each (the difference is the price of quantbench's checks and tracking), and each process's
peak RSS.

    python bench/quantize_overhead.py [--reps 2] [--samples 16] [--seq-len 256]

`--quantizers`: every quantizer instead, each shipped recipe of a quantizer (calibration trimmed to
--samples x --seq-len, evaluation off) quantized by `quantbench quantize` in its own process,
round-robin over --reps: quantize wall time and peak RSS, the reload check's perplexity ratio and
the checkpoint size, and each recipe's quantize time as a ratio of fp8-dynamic's (no calibration,
a round-to-nearest pass) measured in the same run.

    python bench/quantize_overhead.py --quantizers [--reps 1] [--samples 16] [--seq-len 256]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child_direct(samples: int, seq_len: int, out: Path) -> dict:
    started = time.perf_counter()
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantbench.quantize.llmcompressor import weight_only_scheme
    from quantbench.sources import data, models

    base = models.resolve("builtin:smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(base.path)
    model = AutoModelForCausalLM.from_pretrained(base.path, dtype=torch.bfloat16)
    ids = tokenizer(data.python_docs("calibration"))["input_ids"]
    rows = data.calibration_windows(ids, samples, seq_len, 0, field="bench")
    dataset = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * seq_len for _ in rows]})
    recipe = [GPTQModifier(config_groups={"group_0": weight_only_scheme(4, 64, True)}, ignore=["lm_head"])]
    t0 = time.perf_counter()
    oneshot(model=model, recipe=recipe, dataset=dataset, num_calibration_samples=samples, max_seq_length=seq_len)
    oneshot_s = time.perf_counter() - t0
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)
    return {"oneshot_s": oneshot_s, "wall_s": time.perf_counter() - started}


def child_quantbench(samples: int, seq_len: int, out: Path) -> dict:
    started = time.perf_counter()
    from quantbench.jobs.pipeline import quantize

    result = quantize(
        str(REPO / "recipes" / "gptq-w4a16.yaml"),
        overrides=(f"calibration.samples={samples}", f"calibration.seq_len={seq_len}"),
        outputs=out,
        experiment="bench-quantize-overhead",
    )
    return {"oneshot_s": result.metrics["quantize/wall_s"], "wall_s": time.perf_counter() - started}


# one shipped recipe per quantizer / scheme family
BACKEND_RECIPES = ["fp8-dynamic", "gptq-w4a16", "awq-int4", "w8a8-int8", "fp8-dynamic-kv8", "bnb-int8", "bnb-nf4",
                   "gptqmodel-gptq-int4", "gptqmodel-awq-int4"]


def child_recipe(recipe: str, samples: int, seq_len: int, out: Path) -> dict:
    from quantbench.jobs.pipeline import quantize

    result = quantize(str(REPO / "recipes" / f"{recipe}.yaml"), outputs=out, experiment="bench-quantizers",
                      overrides=(f"calibration.samples={samples}", f"calibration.seq_len={seq_len}", "evaluate=null"))
    m = result.metrics
    return {"quantize_s": m["quantize/wall_s"], "rss_mb": m["quantize/peak_rss_mb"], "ppl_ratio": m["check/ppl_ratio"],
            "size_mb": m["model/size_mb"]}


def quantizers(args) -> None:
    results: dict[str, list[dict]] = {r: [] for r in BACKEND_RECIPES}
    with tempfile.TemporaryDirectory(prefix="qb-bench-") as tmp:
        for rep in range(args.reps):
            for recipe in BACKEND_RECIPES:
                r = spawn(f"recipe:{recipe}", args, Path(tmp))
                results[recipe].append(r)
                print(f"rep {rep + 1}/{args.reps} {recipe:16s} quantize {r['quantize_s']:7.1f} s  peak RSS "
                      f"{r['rss_mb']:6.0f} MB  ppl x{r['ppl_ratio']:.3f}  {r['size_mb']:6.1f} MB", flush=True)
    base = statistics.median(r["quantize_s"] for r in results["fp8-dynamic"])
    print(f"\nquantize stage per quantizer, {args.samples} x {args.seq_len} calibration tokens, median of {args.reps}")
    print(f"{'recipe':18s}{'quantize s':>11s}{'x fp8':>8s}{'peak RSS MB':>13s}{'ppl ratio':>11s}{'size MB':>9s}")
    for recipe, rs in results.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(f"{recipe:18s}{med['quantize_s']:11.1f}{med['quantize_s'] / base:8.1f}{med['rss_mb']:13.0f}"
              f"{med['ppl_ratio']:11.3f}{med['size_mb']:9.1f}")


def spawn(kind: str, args, scratch: Path) -> dict:
    out = scratch / f"{kind.replace(':', '-')}-{time.monotonic_ns()}"
    cmd = [sys.executable, __file__, "--child", kind, "--samples", str(args.samples), "--seq-len", str(args.seq_len), "--out", str(out)]
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{scratch / 'mlflow.db'}"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=scratch)
    if proc.returncode != 0:
        sys.exit(f"{kind} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--quantizers", action="store_true", help="every quantizer's quantize stage instead")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        if args.child.startswith("recipe:"):
            result = child_recipe(args.child.removeprefix("recipe:"), args.samples, args.seq_len, args.out)
        else:
            fn = child_direct if args.child == "direct" else child_quantbench
            result = fn(args.samples, args.seq_len, args.out)
        result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(result))
        return
    if args.quantizers:
        quantizers(args)
        return

    results: dict[str, list[dict]] = {"direct": [], "quantbench": []}
    with tempfile.TemporaryDirectory(prefix="qb-bench-") as tmp:
        for rep in range(args.reps):
            for kind in ("direct", "quantbench"):
                r = spawn(kind, args, Path(tmp))
                results[kind].append(r)
                print(f"rep {rep + 1}/{args.reps} {kind:10s} oneshot {r['oneshot_s']:7.1f} s  "
                      f"wall {r['wall_s']:7.1f} s  peak RSS {r['peak_rss_mb']:7.0f} MB", flush=True)

    def med(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in results[kind])

    print(f"\nGPTQ W4A16 g64, {args.samples} x {args.seq_len} calibration tokens, median of {args.reps}")
    print(f"{'':22s}{'direct':>10s}{'quantbench':>12s}{'ratio':>8s}")
    for key, label in (("oneshot_s", "oneshot (s)"), ("wall_s", "whole process (s)"), ("peak_rss_mb", "peak RSS (MB)")):
        d, q = med("direct", key), med("quantbench", key)
        print(f"{label:22s}{d:10.1f}{q:12.1f}{q / d:8.3f}")
    ratio = med("quantbench", "oneshot_s") / med("direct", "oneshot_s")
    print(f"\noneshot time ratio quantbench/direct = {ratio:.3f} (goal <= 1.05: {'met' if ratio <= 1.05 else 'NOT met'})")
    print("the whole-process difference is quantbench's base perplexity, reload check and MLflow logging")


if __name__ == "__main__":
    main()
