"""Content hashes of settings and whole-or-nothing writes (quantbench.core.files)."""

import hashlib
import json

from quantbench.core.files import atomic_write, canonical_sha, write_if_changed


def test_equal_settings_hash_equal_and_stores_keep_their_hashes():
    a = {"window": 512, "tokens": 16384, "tasks": ["x", "y"], "nested": {"b": 1, "a": 2}}
    b = {"nested": {"a": 2, "b": 1}, "tasks": ["x", "y"], "tokens": 16384, "window": 512}
    assert canonical_sha(a) == canonical_sha(b) != canonical_sha({**a, "window": 256})
    # the formulas the suite, policy, sensitivity and recipe hashes were made with: unchanged values
    assert canonical_sha(a) == hashlib.sha256(json.dumps(a, sort_keys=True).encode()).hexdigest()
    assert canonical_sha(a, compact=True) == hashlib.sha256(
        json.dumps(a, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def test_an_atomic_write_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "state.json"
    path.write_text("old")
    atomic_write(path, "new")
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_writers_in_two_processes_each_replace_the_whole_file(tmp_path):
    """Two processes rewriting one shared file at once: every read sees one writer's whole text."""
    import multiprocessing

    path = tmp_path / "shared.jsonl"
    texts = ["a" * 200_000, "b" * 300_000]
    path.write_text(texts[0])
    ctx = multiprocessing.get_context("spawn")
    writers = [ctx.Process(target=_rewrite, args=(path, t, 400)) for t in texts]
    for w in writers:
        w.start()
    seen = set()
    while any(w.is_alive() for w in writers):
        seen.add(path.read_text())
    assert [w.exitcode for w in writers] == [0, 0]
    assert seen <= set(texts) and [p.name for p in tmp_path.iterdir()] == ["shared.jsonl"]


def _rewrite(path, text, times):
    for _ in range(times):
        atomic_write(path, text)


def test_an_unchanged_file_is_not_rewritten(tmp_path):
    path = tmp_path / "task.yaml"
    write_if_changed(path, "same")
    stamp = (path.stat().st_ino, path.stat().st_mtime_ns)
    write_if_changed(path, "same")
    assert (path.stat().st_ino, path.stat().st_mtime_ns) == stamp
    write_if_changed(path, "other")
    assert path.read_text() == "other" and path.stat().st_ino != stamp[0]


def test_a_file_hash_is_sha256_of_its_bytes(tmp_path):
    path = tmp_path / "w.bin"
    path.write_bytes(b"\x00\x01" * 3_000_000)  # over one read block
    from quantbench.core.files import file_sha

    assert file_sha(path) == hashlib.sha256(path.read_bytes()).hexdigest()


def _rss_file_kb() -> int:
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(status["RssFile"].split()[0])


def test_the_pages_of_a_mapped_file_are_handed_back_and_read_again_unchanged(tmp_path):
    """A private mapping's clean pages handed back to the kernel leave the resident set and read back
    from the file as they were; a range that is not in one of the named mappings (anonymous memory,
    which would read back as zeros) is left alone."""
    import ctypes
    import mmap
    import os

    from quantbench.core.files import drop_file_pages, mapped_files

    path = tmp_path / "weights.safetensors"
    data = os.urandom(32 * 2**20)
    path.write_bytes(data)
    with open(path, "r+b") as handle:
        view = mmap.mmap(handle.fileno(), 0, flags=mmap.MAP_PRIVATE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    try:
        assert view[:] == data  # every page read: resident
        mapped = mapped_files(".safetensors")
        assert any(start <= address < end for start, end in mapped)
        resident = _rss_file_kb()
        assert drop_file_pages(address, len(data), mapped)
        assert resident - _rss_file_kb() > 30 * 1024  # ~32 MiB left the resident set
        assert view[:] == data  # read from the file again
        anonymous = bytearray(data[: 2**20])
        anon_address = ctypes.addressof(ctypes.c_char.from_buffer(anonymous))
        assert not drop_file_pages(anon_address, len(anonymous), mapped) and bytes(anonymous) == data[: 2**20]
    finally:
        view.close()


def _mapping_rss_kb(path) -> int:
    """Resident kB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            inside = len(fields) == 6 and fields[5] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


def test_a_checkpoint_read_once_has_its_pages_handed_back_while_one_written_keeps_them(tmp_path):
    """pages_handed_back: the pages of a mapping read whole leave the resident set while the block
    runs and read back as the file's bytes (hand_back_now: once); a mapping with a page written (a
    private copy, which handing back would lose) keeps its pages and its write."""
    import mmap
    import os
    import time

    from quantbench.core.files import hand_back_now, pages_handed_back

    read, written = tmp_path / "model.safetensors", tmp_path / "other.safetensors"
    data = os.urandom(16 * 2**20)
    read.write_bytes(data)
    written.write_bytes(data)
    views = []
    for path in (read, written):
        with open(path, "r+b") as handle:
            views.append(mmap.mmap(handle.fileno(), 0, flags=mmap.MAP_PRIVATE))
    clean, dirty = views
    try:
        dirty[0] = data[0] ^ 0xFF  # one page of the other copied on write
        with pages_handed_back([read, written], period_s=0.02):
            assert clean[:] == data and dirty[1:] == data[1:]  # every page of both read: resident
            deadline = time.monotonic() + 10
            while _mapping_rss_kb(read) > 1024 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert _mapping_rss_kb(read) <= 1024  # of 16 MiB read
            assert _mapping_rss_kb(written) > 15 * 1024  # left alone
        assert clean[:] == data  # read from the file again
        assert _mapping_rss_kb(read) > 15 * 1024
        hand_back_now([read, written])  # once, at once: before a data-free produce
        assert _mapping_rss_kb(read) <= 1024 and _mapping_rss_kb(written) > 15 * 1024
        assert dirty[0] == data[0] ^ 0xFF and dirty[1:] == data[1:]
        assert written.read_bytes() == data  # a private mapping: the file never changed
    finally:
        clean.close()
        dirty.close()


def test_a_mapping_let_go_after_the_look_is_not_handed_back_over_the_memory_that_took_its_place(
    tmp_path, monkeypatch
):
    """The look (/proc/self/smaps) and the hand-back are apart. A mapping another thread lets go in
    between may have its addresses taken by anonymous memory, which MADV_DONTNEED would zero: the
    1B rung's Q8_0 reload check died of SIGSEGV as the GGUF reader let its mapping go and the model's
    tensors were allocated. Here the look is taken, the mapping let go and anonymous memory mapped
    at its very addresses: the hand-back leaves that memory as it was."""
    import ctypes
    import mmap
    import os
    import sys

    from quantbench.core import files

    path = tmp_path / "model.gguf"
    size = 8 * 2**20
    path.write_bytes(os.urandom(size))
    with open(path, "rb") as handle:
        view = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    assert len(view[:]) == size  # every page read: resident
    names = {str(path.resolve())}
    looked = files._clean_mappings(names)
    assert looked == [(address, address + size)]
    view.close()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mmap.restype = ctypes.c_void_p
    fixed = 0x10  # MAP_FIXED
    anonymous = libc.mmap(address, size, mmap.PROT_READ | mmap.PROT_WRITE,
                          mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | fixed, -1, 0)  # fmt: skip
    assert anonymous == address, ctypes.get_errno()
    try:
        ctypes.memset(address, 1, size)
        monkeypatch.setattr(files, "_clean_mappings", lambda _: looked)  # the look from before
        interval = sys.getswitchinterval()
        files.hand_back_now([path])
        assert ctypes.string_at(address, size) == b"\x01" * size
        assert sys.getswitchinterval() == interval  # stretched only while it hands back
    finally:
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.munmap(address, size)
