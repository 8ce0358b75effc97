"""Files written whole or not at all, and content hashes of settings: the two small things many
modules need the same way."""

from __future__ import annotations

import hashlib
import json
import os
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
