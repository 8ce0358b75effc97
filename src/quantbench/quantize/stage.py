"""The produce stage: an engine writes the checkpoint into the staging directory; what it cost
(wall time, peak memory of this process and its children) is measured around it."""

from __future__ import annotations

import logging
import resource
import time

from quantbench.quantize import Backend, Inputs, Produced

log = logging.getLogger(__name__)


def produce(backend: Backend, inputs: Inputs) -> Produced:
    spec = inputs.loaded.recipe.quantize
    log.info("%s %s with %s into %s", "training" if backend.trains else "quantizing", f"{spec.method} {spec.scheme}",
             backend.engine, inputs.staging)
    started = time.perf_counter()
    produced = backend.produce(inputs)
    wall_s = time.perf_counter() - started
    peak_rss_mb = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) / 1024
    produced.metrics.update({"quantize/wall_s": wall_s, "quantize/peak_rss_mb": peak_rss_mb})
    return produced
