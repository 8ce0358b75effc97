"""The console and one log file per run: our own log lines and every library's (logging, loguru,
and what they write to stdout and stderr).

The terminal shows quantbench's lines and progress bars; other libraries' INFO and WARNING records,
their progress bars, prints and C++ warnings go to the run's log file only (`quiet`), and the few
of their warnings that matter to the user are said once in quantbench's words (`translate`).
`--verbose` shows everything on the terminal, as the libraries write it.

llm-compressor resets loguru's sinks when it is imported, so quantizers import it before a run's
log file is opened (the quantizer registry imports the quantizer module while preparing)."""

from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _Once(logging.Filter):
    """Let a message that starts with `prefix` through the first time only."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix, self.seen = prefix, False

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith(self.prefix):
            return True
        seen, self.seen = self.seen, True
        return not seen


class _Drop(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


class _Stderr(logging.StreamHandler):
    """A handler on the terminal as it is when a record is written (terminal()), not when it was
    made: a caller that swaps stderr (a test's capture, a redirect) never leaves it writing to a
    closed file, which would lose the very error being reported."""

    @property  # type: ignore[override]
    def stream(self):
        return terminal()

    @stream.setter
    def stream(self, _value) -> None:
        pass


DETAIL = "quantbench.detail"  # a logger whose lines go to the run's log file, not the terminal (-v shows them)
LIBRARIES = "libraries"  # the logger that carries what libraries wrote to stdout and stderr into the log file


class _Console(logging.Filter):
    """What the terminal shows: quantbench's own records, and anyone's at ERROR or above. Other
    libraries' INFO and WARNING (lm-eval's "Building contexts ...", transformers' deprecations) go
    to the run's log file only; those that match a translation are said once in our words."""

    verbose = False

    def filter(self, record: logging.LogRecord) -> bool:
        if self.verbose:
            return True
        ours = record.name == "quantbench" or record.name.startswith("quantbench.")
        if ours:
            return not record.name.startswith(DETAIL)
        if record.levelno < logging.ERROR:
            say_translated(record.getMessage())
            return False
        return True


_console_filter = _Console()


def configure_console(verbose: bool = False) -> None:
    root = logging.getLogger()
    if not any(getattr(h, "_quantbench_console", False) for h in root.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        handler.addFilter(_console_filter)
        handler._quantbench_console = True  # type: ignore[attr-defined]  # a marker, found again by getattr above
        root.addHandler(handler)
    _console_filter.verbose = verbose
    root.setLevel(logging.INFO)
    logging.getLogger("quantbench").setLevel(logging.DEBUG if verbose else logging.INFO)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per streamed request otherwise
    # bitsandbytes INT8 warns on every forward of a bf16 model that it computes in fp16
    bnb = logging.getLogger("bitsandbytes.autograd._functions")
    if not any(isinstance(f, _Once) for f in bnb.filters):
        bnb.addFilter(_Once("MatMul8bitLt: inputs will be cast"))
    # bitsandbytes' CPU backend tries to fetch an optional kernel from the hub at import and warns
    # when it can't; quantbench runs offline by design and bitsandbytes falls back to its own.
    ops = logging.getLogger("bitsandbytes.backends.cpu.ops")
    if not any(isinstance(f, _Drop) for f in ops.filters):
        ops.addFilter(_Drop("Failed to load CPU gemm_4bit_forward from kernels-community"))
    # torchao (imported by llm-compressor) tries its CUDA-only kernel libraries and Triton at import
    # and warns on a machine without them, in every job's first lines
    for name, text in (("torchao", "Failed to load "), ("torchao.kernel.intmm", "Warning: Detected no triton")):
        quiet = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in quiet.filters):
            quiet.addFilter(_Drop(text))


# ---------------------------------------------------------------------------------------------
# What libraries write: to the log file, and said once in our words where it matters

_translations: list[tuple[re.Pattern[str], str]] = []
_said: set[str] = set()


def translate(pattern: str, message: str) -> None:
    """A library's line that matters to the user (a fallback, a skipped layer mapping, a dtype the
    CPU emulates): when a line of its output or a record of its logger matches `pattern` (a regular
    expression), quantbench says `message` once per process, formatted with the match's groups
    ({0}, {1}, ...). The library's own line stays in the log file. The module that calls the
    library declares what matters in it."""
    compiled = re.compile(pattern)
    if all(c.pattern != compiled.pattern for c, _ in _translations):
        _translations.append((compiled, message))


_relays: list[tuple[re.Pattern[str], str, str]] = []


def relay(pattern: str, desc: str, unit: str) -> None:
    """A library's own progress bar that stands for a long stage (llm-compressor's layers, lm-eval's
    requests): while quiet, its text (matched by `pattern`, whose two groups are the steps done and
    the total) moves a progress bar of ours, `desc`, on the terminal; the library's bar itself goes to
    the log. One bar of ours, not one line per layer."""
    compiled = re.compile(pattern)
    if all(c.pattern != compiled.pattern for c, _, _ in _relays):
        _relays.append((compiled, desc, unit))


def say_translated(line: str) -> None:
    """Say a library's line in our words when it matches a translation, once per message."""
    for pattern, message in _translations:
        found = pattern.search(line)
        if found is None:
            continue
        text = message.format(*found.groups())
        if text not in _said:
            _said.add(text)
            logging.getLogger("quantbench").warning("%s", text)


def library_sink(message: str) -> None:
    """A console sink for a library that logs through loguru (llm-compressor): while quiet, its
    line is only translated (the run's log file has it from its own sink); otherwise it goes to
    stderr as the library would write it."""
    if _terminal is not None:
        say_translated(str(message))
    else:
        sys.stderr.write(message)


_terminal: TextIO | None = None  # the terminal while quiet() holds file descriptors 1 and 2
_tail: _Tail | None = None


def terminal() -> TextIO:
    """Where quantbench's own lines and progress bars go: the terminal, also while quiet() sends
    everything else written to stdout and stderr to the log."""
    return _terminal or sys.stderr


class _Tail:
    """Reads what is written into the file that stands in for stdout and stderr, line by line, into
    the log (logger LIBRARIES: the run's log file when one is open, never the terminal). A poller
    thread reads every 0.2 s; log_file drains it before it closes a run's log, so none is lost there.
    A file, not a pipe: a process started meanwhile that outlives the command (a Ray node) inherits
    the descriptor and may write to it later; into a file that is harmless, into a closed pipe it is
    an error in that process."""

    def __init__(self, fd: int):
        self.fd, self.offset, self.partial = fd, 0, b""
        self.bar: Any = None  # our bar relaying a library's (relay), and its description
        self.bar_desc = ""
        self.relayed: tuple | None = None  # the last state relayed: a bar's text is seen again on every poll
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._poll, name="quantbench-output-tail", daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while not self.stopped.wait(0.2):
            self.drain()

    def drain(self, final: bool = False) -> None:
        with self.lock:
            size = os.fstat(self.fd).st_size
            while self.offset < size:
                chunk = os.pread(self.fd, min(size - self.offset, 1 << 20), self.offset)
                if not chunk:
                    break
                self.offset += len(chunk)
                *lines, self.partial = (self.partial + chunk).split(b"\n")
                for line in lines:
                    self._forward(line)
                if self.partial:  # a bar redrawing itself has no newline yet: its latest state moves ours
                    self._relay(_last_state(self.partial))
            if final and self.partial:
                self._forward(self.partial)
                self.partial = b""

    def _forward(self, raw: bytes) -> None:
        line = _last_state(raw).rstrip()
        if line.strip():
            self._relay(line)
            logging.getLogger(LIBRARIES).info("%s", line)

    def _relay(self, line: str) -> None:
        for pattern, desc, unit in _relays:
            found = pattern.search(line)
            if found is None:
                continue
            done, total = (int(g) for g in found.groups()[:2])
            if self.relayed == (desc, done, total):
                return
            self.relayed = (desc, done, total)
            if self.bar is None or self.bar_desc != desc or self.bar.total != total or done < self.bar.n:
                self.close_bar()
                # position 0: the library's own bars (drawn into the log) must not push ours down a line
                self.bar = tqdm(total=total, desc=desc, unit=unit, leave=False, file=terminal(), position=0)
                self.bar_desc = desc
            bar = self.bar
            bar.update(max(0, done - bar.n))
            if bar.n >= total:
                self.close_bar()
            return

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()
        self.drain(final=True)
        self.close_bar()


def _last_state(raw: bytes) -> str:
    """A progress bar redraws itself with \r: its last state is the line."""
    return raw.decode("utf-8", "replace").rsplit("\r", 1)[-1]


def _writes_to_fd(stream, fd: int) -> bool:
    try:
        return os.path.sameopenfile(stream.fileno(), fd)
    except (AttributeError, OSError, ValueError):  # a stream with no file descriptor (a test's capture)
        return False


@contextmanager
def quiet():
    """While a command's stage runs, what is written to file descriptors 1 and 2 (libraries'
    progress bars, prints, warnings, torch's C++ and glog lines, child processes') goes to the log
    instead of the terminal; quantbench's lines and bars still reach the terminal (terminal()).
    Nothing changes with --verbose, when already quiet, or where stderr is not a file descriptor
    (a test's capture: the test reads everything, as before)."""
    global _terminal, _tail
    if _console_filter.verbose or _terminal is not None or not _writes_to_fd(sys.stderr, 2):
        yield
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    console = os.fdopen(os.dup(2), "w", buffering=1, encoding=sys.stderr.encoding, errors="backslashreplace")
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    stand_in = tempfile.TemporaryFile(prefix="quantbench-output-")
    for fd in (1, 2):
        os.dup2(stand_in.fileno(), fd)
    _terminal, _tail = console, _Tail(stand_in.fileno())
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        tail, _tail = _tail, None
        tail.stop()
        _terminal = None
        console.close()
        stand_in.close()


def drain_output() -> None:
    """Forward what libraries wrote so far into the log now (before a run's log file closes)."""
    if _tail is not None:
        _tail.drain()


def debugging() -> bool:
    """--debug or QUANTBENCH_DEBUG=1: a failure's traceback on the terminal too, not only in the log."""
    return os.environ.get("QUANTBENCH_DEBUG", "").lower() in ("1", "true", "yes")


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception as one line: its type and the first line of its message, cut to `limit`."""
    text = (str(exc).strip().splitlines() or [""])[0]
    text = text if len(text) <= limit else text[:limit] + "…"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def log_path_of(exc: BaseException) -> Path | None:
    """The log file that holds `exc`'s traceback (a run's log, see log_file), if any."""
    return getattr(exc, LOG_ATTRIBUTE, None)


LOG_ATTRIBUTE = "_quantbench_log"


@contextmanager
def log_file(path: Path):
    """Copy every log record (ours and loguru's) into `path` while the block runs. An exception
    that escapes the block has its traceback written there (the terminal gets one line: the CLI
    finds the file again with log_path_of)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(FORMAT))
    root = logging.getLogger()
    root.addHandler(handler)
    sink_id = None
    try:
        from loguru import logger as loguru_logger  # lazy: optional (llm-compressor's), ~0.05 s kept off --help

        sink_id = loguru_logger.add(str(path), level="INFO", enqueue=False)
    except ImportError:
        pass
    try:
        yield path
    except Exception as exc:
        record = logging.getLogger("quantbench").makeRecord(
            "quantbench", logging.ERROR, __file__, 0, "failed: %s", (one_line(exc),), sys.exc_info()
        )
        handler.handle(record)  # the file only: the console says it in one line
        if log_path_of(exc) is None:
            setattr(exc, LOG_ATTRIBUTE, path)
        raise
    finally:
        drain_output()  # what libraries wrote up to here belongs in this file
        root.removeHandler(handler)
        handler.close()
        if sink_id is not None:
            from loguru import logger as loguru_logger

            try:
                loguru_logger.remove(sink_id)
            except ValueError:  # a library reset loguru's sinks meanwhile
                pass
