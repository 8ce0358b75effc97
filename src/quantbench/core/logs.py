"""One log file per run: our own log lines and llm-compressor's (it logs through loguru).

llm-compressor resets loguru's sinks when it is imported, so backends import it before a run's
log file is opened (the backend registry imports the backend module while preparing)."""

from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager
from pathlib import Path

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
    """A handler on whatever sys.stderr is when a record is written, not when it was made: a
    caller that swaps stderr (a test's capture, a redirect) never leaves it writing to a closed file,
    which would lose the very error being reported."""

    @property  # type: ignore[override]
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def configure_console(verbose: bool = False) -> None:
    root = logging.getLogger()
    if not any(getattr(h, "_quantbench_console", False) for h in root.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        handler._quantbench_console = True  # type: ignore[attr-defined]  # a marker, found again by getattr above
        root.addHandler(handler)
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
        from loguru import logger as loguru_logger

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
        root.removeHandler(handler)
        handler.close()
        if sink_id is not None:
            from loguru import logger as loguru_logger

            try:
                loguru_logger.remove(sink_id)
            except ValueError:  # a library reset loguru's sinks meanwhile
                pass
