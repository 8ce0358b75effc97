"""The plain-text tables commands print (sweep, tune, gate, evaluate, bench): tabulate's columns."""

from __future__ import annotations

from tabulate import tabulate


def table(headers: list[str], rows: list[list[str]], align: str) -> str:
    """Columns aligned by tabulate: `align` has one letter per column, l(eft) or r(ight). Cells are
    printed as the caller formatted them (tabulate does not re-parse numbers)."""
    colalign = ["right" if a == "r" else "left" for a in align]
    return tabulate(rows, headers=headers, tablefmt="simple", colalign=colalign, disable_numparse=True)
