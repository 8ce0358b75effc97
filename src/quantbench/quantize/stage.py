"""The produce stage: a quantizer writes the checkpoint into the staging directory; what it cost
(wall time, peak memory of this process and its children) is measured around it.

The same recipe at the same seed must give the same checkpoint (docs/intervals.md,
"Reproducible checkpoints"): for the produce step only, every random generator a quantizer might
draw from is seeded with the recipe's seed and torch is asked for deterministic algorithms
(warning, not failing, where an operation has none); the previous state is restored after.
Results still depend on the thread count (CPU reductions are split by threads) and on library
versions, so both are recorded with the run.
"""

from __future__ import annotations

import logging
import os
import random
import resource
import time
from contextlib import contextmanager

from quantbench.quantize import Inputs, Produced, Quantizer

log = logging.getLogger(__name__)


@contextmanager
def deterministic(seed: int):
    """Seed Python's, numpy's and torch's generators and enable torch's deterministic algorithms
    (warn_only) for the duration; yields what was pinned, for the run's tags."""
    import numpy as np
    import torch

    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    modes = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what cuBLAS needs to be deterministic
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield f"seed {seed}; torch.use_deterministic_algorithms (warn_only); {torch.get_num_threads()} torch threads"
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])
        torch.use_deterministic_algorithms(modes[0], warn_only=modes[1])
        if cublas is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


def produce(quantizer: Quantizer, inputs: Inputs) -> Produced:
    spec = inputs.loaded.recipe.quantize
    log.info(
        "%s %s with %s into %s",
        "training" if quantizer.trains else "quantizing",
        f"{spec.method} {spec.scheme}",
        quantizer.library,
        inputs.staging,
    )
    started = time.perf_counter()
    with deterministic(inputs.loaded.recipe.calibration.seed) as pinned:
        produced = quantizer.produce(inputs)
    produced.pinned = pinned
    wall_s = time.perf_counter() - started
    peak_rss_mb = (
        max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) / 1024
    )
    produced.metrics.update({"quantize/wall_s": wall_s, "quantize/peak_rss_mb": peak_rss_mb})
    return produced
