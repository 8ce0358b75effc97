"""Float32 compute from 16-bit storage, one module at a time.

A model saved in bfloat16 and computed in float32 (a reference pass, a CPU without native bfloat16)
used to be loaded in float32: twice its size in memory (an 8B model: 27.5 GiB against 13.8). Here it
stays in its stored dtype; each module with weights of its own is cast to float32 just before it
runs and its stored tensors are put back just after, so at most one module's weights are held in
float32 at a time. bfloat16 and float16 widen to float32 exactly, the stored tensors are never
written, and the results are those of a float32 copy of the same weights.
"""

from __future__ import annotations

import time
from contextlib import contextmanager


@contextmanager
def float32_compute(model):
    """While the block runs, `model` computes in float32 module by module (a no-op for a model that
    is float32 already). Inference only: parameters are swapped in place, not tracked by autograd."""
    import torch

    low = {torch.bfloat16, torch.float16}
    owners = [m for m in model.modules() if any(p.dtype in low for p in m.parameters(recurse=False))]
    if not owners:
        yield model
        return
    stored: dict[int, dict[str, torch.Tensor]] = {}

    def widen(module, args):
        kept = stored.setdefault(id(module), {})
        for name, param in module.named_parameters(recurse=False):
            if param.dtype in low:
                kept[name] = param.data
                param.data = param.data.float()

    def narrow(module, args, output):
        # the stored tensor itself goes back: no cast, no new 16-bit copy each pass
        for name, data in stored.pop(id(module), {}).items():
            getattr(module, name).data = data

    handles = []
    for module in owners:
        handles.append(module.register_forward_pre_hook(widen))
        handles.append(module.register_forward_hook(narrow))
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()
        for module in owners:  # a forward that raised left its module wide: narrowed back here
            narrow(module, (), None)


def slowdown(dtype: str, width: int, tokens: int, repeats: int = 5) -> float:
    """How many times longer a layer's pass takes computed in float32 from `dtype` storage (as above:
    the weight widened, then a float32 matmul) than computed in `dtype` itself, measured here on a
    `width`-square weight and `tokens` rows (best of `repeats`); 1.0 for float32. What it is depends
    on the CPU: native bfloat16 makes the 16-bit pass several times faster; where bfloat16 is
    emulated, float32 is the faster one (below 1)."""
    import torch

    if dtype == "float32":
        return 1.0
    low = getattr(torch, dtype)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(width, width, generator=generator).to(low)
    x = torch.randn(tokens, width, generator=generator)

    with torch.no_grad():
        wide = best_time(lambda: torch.nn.functional.linear(x, weight.float()), repeats)
        x_low = x.to(low)
        narrow = best_time(lambda: torch.nn.functional.linear(x_low, weight), repeats)
    return wide / narrow if narrow > 0 else 1.0


def best_time(step, repeats: int) -> float:
    """The shortest of `repeats` timed calls of `step` (seconds), after one untimed call (warm-up:
    first-call dispatch and allocation)."""
    step()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return min(times)
