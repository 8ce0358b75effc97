"""Files written whole or not at all, content hashes of settings, and the pages of a mapped file
handed back to the kernel: small things several modules need the same way."""

from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def canonical_sha(value: Any, *, compact: bool = False) -> str:
    """SHA-256 (hex) of `value` as JSON with sorted keys: equal settings, equal hash, whatever their
    order. `compact`: without spaces after separators (the recipe's sha); the default keeps the
    hashes stores already hold (suite, policy, sensitivity and check caches)."""
    separators = (",", ":") if compact else None
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=separators).encode()).hexdigest()


def file_sha(path: Path) -> str:
    """SHA-256 (hex) of a file's bytes, read in blocks (hashlib.file_digest)."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def atomic_write(path: Path, text: str) -> None:
    """Write `text` to `path` so that a reader (or a crash) sees the old file or the new one,
    never half of it: a sibling temporary file of this process's own, then a rename over the old
    one (two processes writing the same file at once each rename a whole file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_if_changed(path: Path, text: str) -> None:
    """`atomic_write`, skipped when `path` already holds `text`: a file that other processes may be
    reading at that moment (shared caches) is never rewritten under them, nor its mtime moved."""
    try:
        if path.read_text() == text:
            return
    except (FileNotFoundError, UnicodeDecodeError):
        pass
    atomic_write(path, text)


MADV_DONTNEED = 4  # Linux's madvise(2)


def mapped_files(suffix: str) -> list[tuple[int, int]]:
    """The address ranges of this process's mappings of files whose names end with `suffix` (Linux's
    /proc/self/maps; [] elsewhere)."""
    try:
        text = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    return _ranges(text, lambda name: name.endswith(suffix))


def _ranges(maps: str, named: Callable[[str], bool]) -> list[tuple[int, int]]:
    """The address ranges of the mappings in /proc/self/maps's text `maps` whose file `named` accepts."""
    ranges = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and named(fields[5]):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def drop_file_pages(address: int, nbytes: int, mapped: list[tuple[int, int]]) -> bool:
    """Hand back to the kernel the whole pages of [address, address + nbytes) where that range lies in
    one of the file mappings `mapped` (`mapped_files`): a clean page of a private file mapping is read
    from the file again if ever touched, so whatever still views it sees the file's bytes. Anonymous
    memory is never touched (it would read back as zeros). True if pages were handed back."""
    if not any(start <= address and address + nbytes <= end for start, end in mapped):
        return False
    page = mmap.PAGESIZE
    first, last = -(-address // page) * page, (address + nbytes) // page * page
    if last <= first:
        return False
    return _HELD.madvise(first, last - first, MADV_DONTNEED) == 0


def _clean_mappings(names: set[str]) -> list[tuple[int, int]]:
    """The address ranges of this process's mappings of the files `names` (resolved paths) that hold
    pages but none written (/proc/self/smaps: Rss above 0, Anonymous 0 kB; [] elsewhere than Linux)."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return []
    found, current, rss = [], None, 0
    for line in lines:
        fields = line.split(maxsplit=5)  # a header's sixth field: the file's path, spaces and all
        if not fields:
            continue
        if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line
            current, rss = None, 0
            if len(fields) == 6 and fields[5] in names:
                start, end = fields[0].split("-")
                current = (int(start, 16), int(end, 16))
        elif current is not None and fields[0] == "Rss:":
            rss = int(fields[1])
        elif current is not None and fields[0] == "Anonymous:" and rss and int(fields[1]) == 0:
            found.append(current)
    return found


# libc called without letting the GIL go (ctypes.CDLL lets it go for every call)
_HELD = ctypes.PyDLL(None)
_HELD.read.argtypes, _HELD.read.restype = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_ssize_t
_HELD.madvise.argtypes, _HELD.madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
_HANDING = threading.Lock()


def _mapped_now(names: set[str]) -> set[tuple[int, int]]:
    """The address ranges that map the files `names` (resolved paths) now: /proc/self/maps, read
    without letting the GIL go."""
    fd = _HELD.open(b"/proc/self/maps", os.O_RDONLY)
    if fd < 0:
        return set()
    chunks, buffer = [], ctypes.create_string_buffer(1 << 16)
    try:
        while (count := _HELD.read(fd, buffer, len(buffer))) > 0:
            chunks.append(buffer.raw[:count])
    finally:
        _HELD.close(fd)
    return set(_ranges(b"".join(chunks).decode(errors="replace"), names.__contains__))


def hand_back_now(files: list[Path]) -> None:
    """Once, what pages_handed_back does every period: this process's pages of `files`, in each
    mapping of them none of whose pages was written, handed back to the kernel.
    The look (/proc/self/smaps, slow) and the hand-back are apart: another thread may meanwhile unmap
    a mapping and have its addresses taken by anonymous memory, which MADV_DONTNEED would zero (the
    1B rung's Q8_0 reload check died of SIGSEGV as the GGUF reader let its mapping go and the model's
    tensors were allocated). So each range is looked up again in /proc/self/maps and handed back
    with the switch interval stretched and the GIL held throughout: a thread that unmaps it then
    waits for the GIL before it can allocate anything."""
    names = {str(f.resolve()) for f in files}
    looked = _clean_mappings(names)
    if not looked:
        return
    with _HANDING:  # one thread at a time, or one could restore the other's stretched interval for good
        interval = sys.getswitchinterval()
        sys.setswitchinterval(60.0)
        try:
            mapped = _mapped_now(names)
            for start, end in looked:
                if (start, end) in mapped:
                    _HELD.madvise(start, end - start, MADV_DONTNEED)
        finally:
            sys.setswitchinterval(interval)


@contextmanager
def pages_handed_back(files: list[Path], period_s: float = 0.25) -> Iterator[None]:
    """While the block runs, every `period_s` the pages this process has of `files` are handed back
    to the kernel, in each mapping of them none of whose pages was written (a written page of a
    private mapping would be lost: such a mapping is left alone). A page read again comes back
    from the page cache, the file's bytes. For a checkpoint de-quantized as it loads: the pages of
    its stored weights leave the resident set once read, instead of staying beside the
    de-quantized copy until the files are closed. Nothing in the block may write to `files'`
    mappings (a write between a look and a hand-back would be lost). MADV_PAGEOUT, which keeps
    written pages, would also drop the clean ones from the page cache: at 8B the data-free produce
    then read its base from disk again, 144 s instead of 71 (82 handed back). The cost is mostly
    the look, which walks every mapping of the process (/proc/self/smaps): at 8B a check took 130 s
    instead of 94, 121 s with a look a second; but a second lets 1B's produce read 2 GiB of its base
    meanwhile (AVX512-BF16, 2 cores)."""
    stop = threading.Event()

    def hand_back() -> None:
        while not stop.wait(period_s):
            hand_back_now(files)

    thread = threading.Thread(target=hand_back, name="quantbench-pages-handed-back", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
