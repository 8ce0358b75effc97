"""A tune's state on disk (state.json in its directory: the parent run and the candidates so far,
what a re-run resumes from) and the lock that keeps a second run of the same tune out."""

from __future__ import annotations

import json
from pathlib import Path

from quantbench.core.files import atomic_write
from quantbench.core.processes import hold_lock


def read_state(directory: Path) -> dict:
    path = directory / "state.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def write_state(directory: Path, state: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write(directory / "state.json", json.dumps(state, indent=2, default=str))


def tune_lock(directory: Path):
    return hold_lock(directory, "this tune")
