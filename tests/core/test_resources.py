"""What a stage costs (core/resources.py): the peak memory of the process tree with its file-backed
part, the disk a stage leaves, and the C heap handed back between stages."""

import ctypes
import mmap
import sys

import psutil
import pytest

from quantbench.core.resources import StageMeter, release_freed_memory

MiB = 2**20


def test_a_stage_counts_its_children_and_the_files_they_map(tmp_path):
    import subprocess

    data = tmp_path / "weights.bin"
    data.write_bytes(b"\1" * (96 * MiB))
    out = tmp_path / "out"
    out.mkdir()
    # a child that maps the file, touches every page, writes 8 MiB and holds all that a while
    child = (
        "import mmap, sys, time\n"
        f"f = open({str(data)!r}, 'rb'); m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)\n"
        "total = sum(m[i] for i in range(0, len(m), 4096))\n"
        f"open({str(out / 'ckpt')!r}, 'wb').write(b'x' * {8 * MiB})\n"
        "time.sleep(1.5)\n"
    )
    with StageMeter("produce", [out], every_s=0.05) as meter:
        subprocess.run([sys.executable, "-c", child], check=True)
    cost = meter.cost
    assert cost.name == "produce"
    assert cost.peak_file_mb >= 90  # the child's mapped file, all of it touched
    assert cost.peak_rss_mb >= cost.peak_file_mb
    assert cost.disk_mb == pytest.approx(8, abs=0.01)
    metrics = cost.metrics()
    assert metrics["stage/produce/peak_file_mb"] == cost.peak_file_mb
    assert set(metrics) == {f"stage/produce/{k}" for k in ("wall_s", "peak_rss_mb", "disk_mb", "temp_disk_mb",
                                                            "peak_file_mb")}  # fmt: skip


def test_this_process_mapping_a_file_is_file_backed(tmp_path):
    data = tmp_path / "weights.bin"
    data.write_bytes(b"\2" * (64 * MiB))
    with open(data, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        with StageMeter("check", every_s=0.05) as meter:
            assert sum(m[i] for i in range(0, len(m), 4096)) == 2 * (64 * MiB // 4096)
    assert meter.cost.peak_file_mb >= 60


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_freed_heap_goes_back_to_the_system():
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    me = psutil.Process()
    # 256 MiB in 64 KiB blocks (below glibc's mmap threshold: they live in its heap), every page
    # written; every 16th block kept, so the freed ones are holes the heap cannot shrink past
    size, count = 64 * 1024, 4096
    blocks = [libc.malloc(size) for _ in range(count)]
    for b in blocks:
        ctypes.memset(b, 1, size)
    for i, b in enumerate(blocks):
        if i % 16:
            libc.free(b)
    held = me.memory_info().rss
    release_freed_memory()
    after = me.memory_info().rss
    for b in blocks[::16]:
        libc.free(b)
    freed = size * count * 15 // 16
    assert held - after > freed // 2, f"rss {held / MiB:.0f} MiB before the trim, {after / MiB:.0f} after"
