"""Errors the user can fix. The CLI prints them without a traceback and exits 2."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


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
