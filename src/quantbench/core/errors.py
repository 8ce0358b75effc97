"""Errors the user can fix. The CLI prints them without a traceback and exits 2."""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable
from pathlib import Path


class UserError(Exception):
    """Bad input: a recipe, a path, a name. Raised before anything is written."""

    exit_code = 2

    def __init__(self, problems: str | list[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' Did you mean 'x'? Available: a, b, c' — the tail of an unknown-name message."""
    choices = sorted(choices)
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.5)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return f"{hint} Available: {', '.join(choices)}"


def check_creatable_dir(path: Path, hint: str = "") -> None:
    """UserError unless `path` is a directory or can be made one: the nearest part of it that
    exists must be a directory this process may write in (`out/x` where `out` is a file cannot)."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"{existing}: exists and is not a directory" + (f"; {hint}" if hint else ""))
    if existing != path and not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{existing}: not writable, so {path} cannot be created" + (f"; {hint}" if hint else ""))
