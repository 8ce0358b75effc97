"""Processes: Ctrl-C and SIGTERM as an interrupt that a short block may hold back, a free loopback
port, stopping a process group (SIGTERM, a grace period, then SIGKILL; the group killed even if its
leader left; or the whole tree of descendants), a process's peak memory while a block runs, and a
lock file that keeps a second driver out."""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import threading
from contextlib import contextmanager
from pathlib import Path

import psutil

from quantbench.core.errors import UserError

_held: list[int] | None = None  # signals that arrived while interrupts were held
_received: list[int] = []  # every signal `interrupt` handled in this process


def interrupt(signum, frame) -> None:
    """The handler for SIGINT and SIGTERM in a command that owns runs: KeyboardInterrupt, so the
    run is marked KILLED and staging removed; inside `interrupts_held()`, noted for later."""
    _received.append(signum)
    if _held is not None:
        _held.append(signum)
        return
    raise KeyboardInterrupt(f"signal {signum}")


def signal_received() -> int | None:
    """The first SIGINT or SIGTERM `interrupt` handled in this process, if any. Its KeyboardInterrupt
    can be lost: Python runs a handler wherever the main thread is, and one that lands in a finalizer
    the garbage collector runs (a `__del__`, a weakref callback) is printed as "Exception ignored" and
    dropped; a job held on gc.collect() ran its run to FINISHED that way. Checked where a run ends
    and between stages (`raise_if_signalled`)."""
    return _received[0] if _received else None


def forget_signals() -> None:
    """A new command in this process (the CLI's run_stage; a test): earlier signals no longer count."""
    _received.clear()


def raise_if_signalled() -> None:
    """KeyboardInterrupt if a signal came whose KeyboardInterrupt did not end the command."""
    if _received:
        raise KeyboardInterrupt(f"signal {_received[0]}")


def interrupted(exc: BaseException | None) -> bool:
    """Whether an exception ends a run because the command was interrupted: a KeyboardInterrupt, or
    an exception a library raised while handling one (it is in the chain: `raise ... from`, or an
    error raised in an `except` or `finally` block the interrupt went through)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


@contextmanager
def interrupts_held():
    """A block that an interrupt must not cut in half (an MLflow run being created, or its status
    written): Ctrl-C and SIGTERM that arrive meanwhile are collected in the list this yields, for
    the caller to act on after the block. Only the main thread (where handlers run) holds them,
    and only where `interrupt` is the handler; inside another such block, the outer one collects."""
    global _held
    if _held is not None or threading.current_thread() is not threading.main_thread():
        yield []
        return
    _held = []
    try:
        yield _held
    finally:
        _held = None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop the process group led by `proc` (started with start_new_session=True); reaped either way."""
    _term_then_kill(proc, grace_s)
    proc.wait()


def _term_then_kill(proc: subprocess.Popen, grace_s: float, between=lambda: None) -> None:
    """SIGTERM to the group, `grace_s` for its leader to end, `between()`, then SIGKILL to whatever
    is left of the group (the leader after its grace, or children it left behind)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    between()
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def stop_tree(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """stop_group, and every descendant of `proc` too, even one that left its group (a server
    started in a session of its own): those seen before SIGTERM and before SIGKILL are killed."""

    def descendants() -> list:
        try:
            return psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            return []

    tree = descendants()
    _term_then_kill(proc, grace_s, between=lambda: tree.extend(descendants()))
    for child in tree:  # psutil checks the start time: a reused pid is not touched
        try:
            child.kill()
        except psutil.Error:
            pass
    proc.wait()


class PeakRSS:
    """Peak resident memory of a process (this one by default) while the block runs, sampled
    every 10 ms; with `tree` (sampled every 100 ms), of the process and all its descendants together (a server that runs
    its model in child processes, as vLLM does)."""

    def __init__(self, pid: int | None = None, tree: bool = False):
        self.pid = pid
        self.tree = tree

    def __enter__(self):
        self._proc = psutil.Process(self.pid)
        self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.1 if self.tree else 0.01):  # a tree walk costs more
            try:
                self.peak = max(self.peak, self._rss())
            except psutil.Error:  # the process ended; the caller sees why
                return

    def _rss(self) -> int:
        total = self._proc.memory_info().rss
        if self.tree:
            for child in self._proc.children(recursive=True):
                try:
                    total += child.memory_info().rss
                except psutil.Error:  # a child that just ended
                    pass
        return total

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


class Lock:
    """An exclusive lock (flock) on a file that holds its holder's pid, from `hold_lock` until
    `close` (or the end of a `with` block): a finished or interrupted command removes the file, so
    it leaves no lock behind; a killed one (SIGKILL) leaves the file, unlocked, for the next holder."""

    def __init__(self, path: Path, handle):
        self.path, self._handle = path, handle

    def close(self) -> None:
        if self._handle is None:
            return
        try:
            # removed while still held: a process that opened the file meanwhile gets the lock only
            # after this, finds the path no longer names its file, and locks the path anew (hold_lock)
            self.path.unlink(missing_ok=True)
        finally:
            self._handle.close()  # releases the lock
            self._handle = None

    def __enter__(self) -> Lock:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def hold_lock(directory: Path, what: str, hint: str = "wait for it") -> Lock:
    """An exclusive lock on `directory`/lock holding this process's pid, until the returned Lock
    is closed; UserError naming the holder when another process has it."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "lock"
    while True:
        handle = open(path, "a+")  # not "w": that would erase the holder's pid before the check
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "?"
            handle.close()
            raise UserError(f"{what} is already running (pid {holder}, lock {path}); {hint}") from None
        try:
            held = os.stat(path)
        except FileNotFoundError:
            held = None
        mine = os.fstat(handle.fileno())
        if held is not None and (held.st_dev, held.st_ino) == (mine.st_dev, mine.st_ino):
            break
        handle.close()  # the file its last holder removed on release: lock the one at the path now
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return Lock(path, handle)
