"""What the evaluate stage costs, measured in one run on the default model.

1. Quality pass vs a plain forward pass over the same held-out tokens, on one candidate
   (FP8-dynamic of the default model, made here): tokens/s of each, interleaved A B A B, and the
   ratio (goal: quality pass <= 1.15x the plain forward time).
2. Evaluating a candidate when the baseline run must be scored first ("from scratch") vs when it
   is reused from MLflow ("cached baseline"), through `quantbench evaluate`.

    python bench/eval_throughput.py [--reps 3] [--suite cpu-smoke]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--suite", default="cpu-smoke", help="suite for part 2 (suites/NAME.yaml)")
    parser.add_argument("--tokens", type=int, default=4096, help="held-out tokens for part 1")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="qb-evalbench-") as tmp:
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp}/mlflow.db"
        os.chdir(REPO)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from quantbench.core.measures import compare, reference
        from quantbench.jobs import existing, pipeline
        from quantbench.sources import data, models

        made = pipeline.quantize("fp8-dynamic", overrides=("evaluate=null",), outputs=Path(tmp) / "outputs", experiment="bench")
        base = models.resolve("builtin:smollm2-135m-instruct")
        tokenizer = AutoTokenizer.from_pretrained(base.path)
        ids = tokenizer(data.python_docs("evaluation"))["input_ids"][: args.tokens]
        base_model = AutoModelForCausalLM.from_pretrained(base.path, dtype="auto")
        candidate = AutoModelForCausalLM.from_pretrained(made.checkpoint)
        ref = reference(base_model, ids, 512)
        windows = torch.tensor(ids[: len(ids) // 512 * 512]).view(-1, 1, 512)
        positions = windows.numel() - len(windows)

        def plain() -> None:
            with torch.inference_mode():
                for w in windows:
                    candidate(input_ids=w)

        def quality() -> None:
            compare(candidate, ids, 512, ref)

        times: dict[str, list[float]] = {"plain forward": [], "quality pass": []}
        for _ in range(args.reps):
            for name, fn in (("plain forward", plain), ("quality pass", quality)):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        print(f"\n1. {positions} held-out positions, FP8-dynamic candidate, median of {args.reps} (interleaved)")
        for name, values in times.items():
            med = statistics.median(values)
            print(f"   {name:14s} {med:7.2f} s  {positions / med:8.0f} tok/s  (min {min(values):.2f}, max {max(values):.2f})")
        ratio = statistics.median(times["quality pass"]) / statistics.median(times["plain forward"])
        print(f"   quality pass / plain forward = {ratio:.3f} (goal <= 1.15: {'met' if ratio <= 1.15 else 'NOT met'})")

        del base_model
        t0 = time.perf_counter()
        first = existing.evaluate(made.run_id, suite=args.suite, experiment="bench")
        scratch = time.perf_counter() - t0
        t0 = time.perf_counter()
        second = existing.evaluate(made.run_id, suite=args.suite, experiment="bench")
        cached = time.perf_counter() - t0
        assert not first.evaluation.baseline_reused and second.evaluation.baseline_reused
        print(f"\n2. evaluate with suite {args.suite}")
        print(f"   baseline + candidate from scratch {scratch:7.1f} s")
        print(f"   candidate, baseline reused        {cached:7.1f} s   ratio {cached / scratch:.3f}")


if __name__ == "__main__":
    main()
