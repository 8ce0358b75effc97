"""How long the produce step will take here, said before it starts.

A few forward passes of the base model over calibration windows are timed on this machine, in the
dtype the job computes in (so an emulated bfloat16 shows up as the slow matmul it is), and scaled
by how many such passes the method makes. The pass counts are a model of each algorithm's work
(AWQ's fitted to a measured run, below); every run logs its estimate beside its measured
`quantize/wall_s`, so drift is visible in MLflow.

Methods whose cost does not grow with data (RTN, FP8, bitsandbytes: seconds on the default model)
get no estimate.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

TIMED_WINDOWS = 3  # forward passes timed, after one warm-up pass; the fastest counts

# Forward-pass equivalents (one pass = the whole model over one calibration window) per window and
# per unit of the method's own knob. A per-layer library (llm-compressor's sequential pipeline) runs
# each layer on every window to calibrate and again to pass the quantized output on; AWQ adds, per
# grid point, the forward of the modules each scale feeds. AWQ's pair is fitted to the default
# model's measured produce time (docs/results.md, "Any CPU: compute dtype, produce-time estimates,
# budgets"); the others are the
# work each algorithm does, not yet fitted: compare quantize/estimate_s with quantize/wall_s.
AWQ_BASE, AWQ_PER_GRID = 6.0, 2.2  # per window: calibration passes + each grid point of the scale search
GPTQ_PASSES = 4.0  # per window: calibration, Hessian accumulation, the quantized output passed on
# The solve (each Linear layer's columns rounded in turn against its Hessian) does not scale with the
# data but with the layer's widths: seconds per decoder layer at the default model's widths (3.54 M
# weights a layer), grown as weights-per-layer to the power GPTQ_SOLVE_EXPONENT. Both fitted on the
# AVX512-BF16 class, 2 cores: the default model's solve ~2 s a layer (gptq-nvfp4a16's 150 s produce
# less its 73 s of passes, over 30 layers, less NVFP4's ~1.3x slower rounding), the 3B ladder rung's
# 27 s a layer (101 M weights; its 893 s produce less 135 s of passes, over 28 layers), where 0.5 s
# a layer at any width had said 2.5 min.
GPTQ_SOLVE_S = 2.0
GPTQ_SOLVE_WEIGHTS = 3.54e6
GPTQ_SOLVE_EXPONENT = 0.78
# GPTQModel (the GPTQ and AWQ formats) runs in a child process: its imports, its own load of the
# model, packing and saving cost about a minute before and after the passes (the default model,
# AVX2-only 2-core CPU: produce 109 s against 45 s of passes predicted)
GPTQMODEL_FIXED_S = 60.0
AUTOROUND_PER_ITER = 3.0  # per window of a tuning step: forward + backward through a block, over every block
# per window of a batch: the teacher's forward, the half-size student's forward and backward, and
# the KL over the 49k-token vocabulary at every position; fitted on the AVX2 class (float32): 8.3 s a
# step of 4 x 256 tokens against forward passes of 0.568 s (2.5, the matmuls alone, said 5.7 s)
DISTILL_PER_STEP = 3.7


@dataclass(frozen=True)
class Estimate:
    seconds: float
    basis: str  # how it was reached, for the log and the run
    per_pass_s: float = 0.0  # the timed forward pass it was scaled from

    def minutes(self) -> float:
        return self.seconds / 60

    def over(self, budget_minutes: float | None) -> bool:
        return budget_minutes is not None and self.minutes() > budget_minutes


def forward_seconds(model, windows: list[list[int]]) -> float:
    """Seconds of one forward pass over one window: the fastest of up to TIMED_WINDOWS windows
    after a warm-up pass (a single window: its one pass is all there is). The fastest, because
    another process on the same cores only ever slows a pass down (the median of two was the slower
    one: a contended pass once made a 17-minute AWQ job's estimate 75 minutes)."""
    import torch

    times = []
    with torch.no_grad():
        for window in windows[: TIMED_WINDOWS + 1]:
            started = time.perf_counter()
            model(torch.tensor([window]))
            times.append(time.perf_counter() - started)
    timed = times[1:] or times  # the first pass warms up
    return min(timed)


def passes(
    quantize, windows: int, layers: int, layer_weights: float = GPTQ_SOLVE_WEIGHTS
) -> tuple[float, float, str] | None:
    """(forward-pass equivalents, fixed seconds, how) for a method, or None where the cost does not
    grow with data. `layer_weights`: the quantized weights of one decoder layer (GPTQ's solve grows
    with them)."""
    method = quantize.method
    if method == "awq":
        n = windows * (AWQ_BASE + AWQ_PER_GRID * quantize.n_grid)
        child = GPTQMODEL_FIXED_S if getattr(quantize, "format", None) == "awq" else 0.0
        how = f"{windows} windows x ({AWQ_BASE:g} + {AWQ_PER_GRID:g} x n_grid {quantize.n_grid})"
        return n, child, how + (f" + {child:g} s of GPTQModel's child process" if child else "")
    if method in ("gptq", "smoothquant") or (method == "spinquant" and quantize.quantizer == "gptq"):
        child = GPTQMODEL_FIXED_S if getattr(quantize, "format", None) == "gptq" else 0.0
        solve = GPTQ_SOLVE_S * (layer_weights / GPTQ_SOLVE_WEIGHTS) ** GPTQ_SOLVE_EXPONENT
        return (
            windows * GPTQ_PASSES,
            layers * solve + child,
            f"{windows} windows x {GPTQ_PASSES:g} + {layers} layers x {solve:.3g} s of solve"
            + (f" + {child:g} s of GPTQModel's child process" if child else ""),
        )
    if method == "autoround":  # each tuning step of a block runs one batch of windows, not all of them
        batch = min(windows, quantize.batch_size)
        n = batch * AUTOROUND_PER_ITER * quantize.iters
        return n, 0.0, f"batch {batch} x {AUTOROUND_PER_ITER:g} x iters {quantize.iters}"
    if method == "distill":
        n = quantize.steps * quantize.batch_size * DISTILL_PER_STEP
        return n, 0.0, f"{quantize.steps} steps x batch {quantize.batch_size} x {DISTILL_PER_STEP:g}"
    return None


def estimate(
    quantize, model, windows: list[list[int]], layers: int, dtype: str, layer_weights: float = GPTQ_SOLVE_WEIGHTS
) -> Estimate:
    """The produce step's expected wall time for `quantize` (a recipe's section, of a method whose
    time grows with data: `passes` is not None) on `model`, loaded in the job's compute dtype `dtype`."""
    work = passes(quantize, len(windows), layers, layer_weights)
    if work is None:
        raise ValueError(f"{quantize.method}: its time does not grow with data; nothing to estimate")
    count, fixed, how = work
    per_pass = forward_seconds(model, windows)
    seconds = count * per_pass + fixed
    return Estimate(seconds, f"{how} forward passes of {per_pass:.3f} s ({len(windows[0])} tokens, {dtype})", per_pass)
