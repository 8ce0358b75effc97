"""Decode speed of the default model on this machine, each path read against the physical limit.

For the base model (fp32 and bf16) and for each quantized checkpoint given, through plain
transformers generate (quantbench's `hf` engine), and for the shipped Q4_1 GGUF through
llama.cpp (in a child process, `--llama-python` naming an interpreter that has llama-cpp-python): decode tokens/s (batch 1, greedy), interleaved over
repetitions, next to the memory-bandwidth bound: a decode step reads every weight once, so
tok/s <= measured bandwidth / bytes of weights. The bandwidth is measured here, in this run.

    python bench/decode_speed.py [CHECKPOINT_DIR ...] [--reps 3] [--tokens 64] [--llama-python PY]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path


def bandwidth_gbs(size_mb: int = 256, reps: int = 5) -> float:
    """Read+write bandwidth of a large tensor copy (what a weight-streaming decode is bound by)."""
    import torch

    a = torch.ones(size_mb * 2**20 // 4)
    b = torch.empty_like(a)
    b.copy_(a)
    best = min(_timed(lambda: b.copy_(a)) for _ in range(reps))
    return 2 * a.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def weight_bytes(model) -> int:
    seen = {}
    for t in list(model.parameters()) + list(model.buffers()):
        seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def child_llama(gguf: str, prompt: str, tokens: int) -> float:
    import os

    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_ctx=512, n_threads=os.cpu_count(), verbose=False)
    times = []
    for chunk in llm.create_completion(prompt, max_tokens=tokens, temperature=0, stream=True):
        if chunk["choices"][0]["text"]:
            times.append(time.perf_counter())
    return (len(times) - 1) / (times[-1] - times[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", nargs="*", type=Path, help="quantized checkpoint dirs (outputs/<recipe>/<run id>)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--llama-python", help="a Python with llama-cpp-python installed (default: this one)")
    parser.add_argument("--child-llama", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_llama:
        print(child_llama(args.child_llama, sys.stdin.read(), args.tokens))
        return

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantbench.sources import data, models
    from quantbench.sources.checkpoint import weights_size_mb
    from quantbench.speed.measure import Profile, measure

    base = models.resolve("builtin:smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(base.path)
    ids = tokenizer(data.python_docs("evaluation"))["input_ids"]
    profile = Profile(prompt_tokens=[64], output_tokens=args.tokens, concurrency=[1])
    prompt_sets = {64: [ids[i * 64 : (i + 1) * 64] for i in range(args.reps)]}

    paths: dict[str, tuple] = {}  # name -> (decode function(rep) -> tok/s, bytes per token)
    for name, source, dtype in [("base fp32 (hf)", base.path, torch.float32), ("base bf16 (hf)", base.path, torch.bfloat16)] + [
        (f"{c.parent.name} (hf)", c, "auto") for c in args.checkpoints
    ]:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
        stored = weights_size_mb(Path(source)) * 2**20 if dtype == "auto" else weight_bytes(model)
        paths[name] = (lambda rep, m=model: measure(m, prompt_sets, profile, rep)["p64/decode_tok_s"], stored)

    gguf = models._builtin_gguf("smollm2-135m-instruct", "bench")
    llama_python = args.llama_python or sys.executable

    def llama_decode(rep: int) -> float:
        """llama.cpp in a child process: a build for the wrong CPU dies with SIGILL, not us."""
        prompt = tokenizer.decode(prompt_sets[64][rep])
        proc = subprocess.run([llama_python, __file__, "--child-llama", str(gguf), "--tokens", str(args.tokens)],
                              input=prompt, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"llama.cpp child exited with {proc.returncode}: {proc.stderr[-300:]}")
        return float(proc.stdout.strip().splitlines()[-1])

    try:
        llama_decode(0)
    except RuntimeError as exc:
        print(f"llama.cpp path skipped ({llama_python}): {exc}")
    else:
        paths["Q4_1 GGUF (llama.cpp)"] = (llama_decode, gguf.stat().st_size)

    gbs = bandwidth_gbs()
    results: dict[str, list[float]] = {name: [] for name in paths}
    for rep in range(args.reps):
        for name, (fn, _) in paths.items():  # interleaved
            results[name].append(fn(rep))
    fp32 = statistics.median(results["base fp32 (hf)"])
    print(f"\nmemory bandwidth (copy, read+write): {gbs:.1f} GB/s; {torch.get_num_threads()} threads; "
          f"batch 1, {args.tokens} new tokens, median of {args.reps}")
    print(f"{'path':34s} {'weights MB':>10s} {'tok/s':>8s} {'bound tok/s':>12s} {'% of bound':>10s} {'vs fp32':>8s}")
    for name, (_, nbytes) in paths.items():
        tok_s = statistics.median(results[name])
        bound = gbs * 1e9 / nbytes
        print(f"{name:34s} {nbytes / 2**20:10.1f} {tok_s:8.1f} {bound:12.1f} {100 * tok_s / bound:9.0f}% {tok_s / fp32:8.2f}")


if __name__ == "__main__":
    main()
