"""Whether the machine was quiet enough to time something on it.

A speed measurement on a shared machine measures the other processes too: a bench beside two other
jobs decoded at a tenth of its quiet speed, and its speedup's 95 % interval was [0.035, 42.5].
`BusyWatch` samples, while a measurement runs, how much of the machine's CPU time went to processes
outside this one's tree (the servers it started are in the tree), the time the hypervisor stole,
and the load average; `Busy.judge` adds the measurement's own spread (its repetitions' interval)
and says, in one line, whether and why the figures cannot be trusted.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, replace

import psutil

# Other processes' share of the machine's CPU time above which a timing is not of this code alone:
# a quarter of the machine is half a core on two cores, a whole one on four.
OTHERS_LIMIT = 0.25
STEAL_LIMIT = 0.10  # CPU time the hypervisor gave to other machines
# A speedup's 95 % interval wider than this ratio (high / low) says the repetitions disagreed more
# than a quiet machine makes them: measured 1.05-1.3 on quiet 2-core machines for the shipped profiles.
SPREAD_LIMIT = 2.0


@dataclass
class Busy:
    others_share: float  # other processes' share of all CPU time during the measurement
    steal_share: float
    load_avg: float  # 1-minute load average at the end
    cpus: int
    seconds: float
    ours_s: float = 0.0  # CPU seconds of this process and its children (servers) meanwhile
    spread: float | None = None  # the speedup interval's high / low, when judged
    why: str = ""  # empty: quiet

    @property
    def busy(self) -> bool:
        return bool(self.why)

    def judge(self, interval: tuple[float, float] | None) -> Busy:
        """This measurement judged with `interval` (its main speedup's 95 % interval), if any."""
        reasons = []
        if self.others_share >= OTHERS_LIMIT:
            reasons.append(
                f"other processes used {self.others_share:.0%} of its CPU time (load average {self.load_avg:.1f} "
                f"on {self.cpus} CPUs)"
            )
        if self.steal_share >= STEAL_LIMIT:
            reasons.append(f"the hypervisor took {self.steal_share:.0%} of its CPU time")
        spread = None
        if interval is not None and interval[0] > 0:
            spread = interval[1] / interval[0]
            if spread > SPREAD_LIMIT:
                reasons.append(
                    f"the repetitions disagreed: the speedup's 95 % interval [{interval[0]:.3g}, {interval[1]:.3g}] "
                    f"spans {spread:.1f}x (a quiet machine: under {SPREAD_LIMIT:g}x)"
                )
        return replace(self, spread=spread, why="; ".join(reasons))

    def metrics(self, prefix: str = "bench/") -> dict[str, float]:
        out = {
            prefix + "others_cpu_share": self.others_share,
            prefix + "steal_share": self.steal_share,
            prefix + "load_avg": self.load_avg,
        }
        if self.spread is not None:
            out[prefix + "speedup_spread"] = self.spread
        return out


class BusyWatch:
    """`with BusyWatch() as watch: ...; watch.result` — the machine's CPU time during the block,
    split into this process tree's, other processes', idle and stolen (sampled every `every_s`:
    a child that ends keeps the CPU time it was last seen with)."""

    def __init__(self, every_s: float = 0.5):
        self.every_s = every_s
        self.result: Busy | None = None
        self._ours: dict[tuple[int, float], float] = {}  # (pid, create time) -> CPU seconds, last seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_loop, name="busy-watch", daemon=True)

    def __enter__(self) -> BusyWatch:
        self._me = psutil.Process()
        self._start_times = psutil.cpu_times()
        self._start = time.monotonic()
        self._sample()
        self._start_ours = sum(self._ours.values())
        self._thread.start()
        return self

    def _sample_loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    def _sample(self) -> None:
        try:
            processes = [self._me, *self._me.children(recursive=True)]
        except psutil.Error:
            return
        for proc in processes:
            try:
                times = proc.cpu_times()
                self._ours[(proc.pid, proc.create_time())] = times.user + times.system
            except psutil.Error:  # ended between the listing and the reading
                pass

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        end = psutil.cpu_times()
        cpus = psutil.cpu_count() or 1

        def delta(name: str) -> float:
            return max(0.0, getattr(end, name, 0.0) - getattr(self._start_times, name, 0.0))

        total = sum(delta(name) for name in end._fields if name not in ("guest", "guest_nice"))  # guests: in user
        busy = total - delta("idle") - delta("iowait") - delta("steal")
        ours = sum(self._ours.values()) - self._start_ours
        others = max(0.0, busy - ours)
        self.result = Busy(
            others_share=others / total if total else 0.0,
            steal_share=delta("steal") / total if total else 0.0,
            load_avg=os.getloadavg()[0],
            cpus=cpus,
            seconds=time.monotonic() - self._start,
            ours_s=ours,
        )
