"""What a stage of a job cost: wall time, peak memory of the process tree, disk written and the
temporary disk it needed on the way. The size ladder (bench/scale.py) and the memory planner's
check read these figures from every run (`stage/<name>/...` metrics).

Peak memory is the resident set of this process and every descendant (a converter, llama-quantize,
a server) summed, sampled every 0.2 s: what the kernel counts when it decides to kill a job. Disk
written is the growth of the directories a stage writes into (its staging directory, its work
directory); temporary disk is the peak size of what it made under the temporary directory and in
those directories, above what stayed. The peak's file-backed part (pages of files the processes
map, e.g. a safetensors checkpoint read lazily) is recorded beside it: the kernel can drop those
pages under pressure instead of killing, but a stage that still reads them then re-reads them from
disk at every pass (what a thrashing job looks like).
"""

from __future__ import annotations

import ctypes
import gc
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

MB = 2**20


def tree_size(path: Path) -> int:
    """Bytes of the files under `path` (a file: its size; missing: 0); files that vanish while
    walked are skipped."""
    if not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


@dataclass
class StageCost:
    name: str
    wall_s: float
    peak_rss_mb: float
    disk_mb: float  # what the stage left in its directories
    temp_disk_mb: float  # the peak of what it held on disk meanwhile beyond that
    peak_file_mb: float = 0.0  # of peak_rss_mb, the pages mapped from files (at that sample)

    def metrics(self) -> dict[str, float]:
        prefix = f"stage/{self.name}/"
        return {
            prefix + "wall_s": self.wall_s,
            prefix + "peak_rss_mb": self.peak_rss_mb,
            prefix + "disk_mb": self.disk_mb,
            prefix + "temp_disk_mb": self.temp_disk_mb,
            prefix + "peak_file_mb": self.peak_file_mb,
        }


class StageMeter:
    """`with StageMeter("produce", [staging, workdir]) as meter: ...` then `meter.cost`."""

    def __init__(self, name: str, directories: list[Path] | tuple[Path, ...] = (), every_s: float = 0.2):
        self.name = name
        self.directories = [Path(d) for d in directories]
        self.every_s = every_s
        self.cost: StageCost | None = None
        self._stop = threading.Event()
        self._peak_rss = self._peak_file = 0
        self._peak_disk = 0
        self._thread = threading.Thread(target=self._loop, name=f"meter-{name}", daemon=True)

    def __enter__(self) -> StageMeter:
        self._me = psutil.Process()
        self._tmp = Path(tempfile.gettempdir())
        self._tmp_before = set(self._tmp_entries())
        self._disk_before = sum(tree_size(d) for d in self.directories)
        self._start = time.perf_counter()
        self._sample(disk=True)
        self._thread.start()
        return self

    def _tmp_entries(self) -> list[str]:
        try:
            return os.listdir(self._tmp)
        except OSError:
            return []

    def _new_tmp_size(self) -> int:
        return sum(tree_size(self._tmp / name) for name in self._tmp_entries() if name not in self._tmp_before)

    def _loop(self) -> None:
        ticks = 0
        while not self._stop.wait(self.every_s):
            ticks += 1
            self._sample(disk=ticks % 5 == 0)  # walking directories costs more: once a second

    def _sample(self, disk: bool) -> None:
        try:
            processes = [self._me, *self._me.children(recursive=True)]
        except psutil.Error:
            processes = [self._me]
        rss = file = 0
        for proc in processes:
            try:
                info = proc.memory_info()
            except psutil.Error:  # ended between the listing and the reading
                continue
            rss += info.rss
            file += getattr(info, "shared", 0)  # Linux: RssFile + RssShmem
        if rss > self._peak_rss:
            self._peak_rss, self._peak_file = rss, file
        if disk:
            held = sum(tree_size(d) for d in self.directories) - self._disk_before + self._new_tmp_size()
            self._peak_disk = max(self._peak_disk, held)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample(disk=True)
        written = max(0, sum(tree_size(d) for d in self.directories) - self._disk_before)
        self.cost = StageCost(
            self.name,
            time.perf_counter() - self._start,
            self._peak_rss / MB,
            written / MB,
            max(0, self._peak_disk - written) / MB,
            self._peak_file / MB,
        )


def release_freed_memory() -> None:
    """Collect Python's garbage, then hand the C heap's free pages back to the system (glibc's
    malloc_trim): tensors below glibc's mmap threshold (which grows to 32 MiB as large blocks are
    freed) live in its arenas, and without a trim a calibrating method's freed activations stay in
    the process's resident memory through every later stage. No-op where the C library has no trim."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
