"""Bit allocation: one scheme per unit (a layer, or the layers vLLM fuses) that minimises the
predicted KLD (the sum of each unit's measured sensitivity) under a size budget.

This is a multiple-choice knapsack, solved exactly up to the budget's resolution by dynamic
programming over the budget above the cheapest choice: every unit's extra cost is rounded *up*
to a bucket of `budget / RESOLUTION` bits, so a solution never exceeds the budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from quantbench.core.errors import UserError
from quantbench.recipe import schemes

RESOLUTION = 4000  # budget buckets of the dynamic programme


@dataclass
class Problem:
    """Per unit, the schemes that fit it with their stored bits and predicted KLD."""

    units: list[str]
    params: list[int]
    options: list[list[tuple[str, float, float]]]  # [unit] -> [(scheme, bits, kld)]
    fixed_bytes: float = 0.0  # the rest of the checkpoint (embeddings, norms): for size budgets

    @property
    def total_params(self) -> int:
        return sum(self.params)

    def bounds(self) -> tuple[float, float]:
        """Bits of the cheapest allocation and of the one with the least predicted KLD."""
        cheapest = sum(min(o[1] for o in opts) for opts in self.options)
        best = sum(min(opts, key=lambda o: (o[2], o[1]))[1] for opts in self.options)
        return cheapest, best

    def bits_for_size(self, size_mb: float) -> float:
        return size_mb * 2**20 * 8 - self.fixed_bytes * 8


@dataclass
class Allocation:
    choice: dict[str, str]  # unit -> scheme
    bits: float  # total stored bits of the quantizable layers
    predicted_kld: float
    bits_per_weight: float
    size_mb: float  # predicted checkpoint size

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for scheme in self.choice.values():
            out[scheme] = out.get(scheme, 0) + 1
        return out


def problem(
    sens, scheme_names: list[str], dtype_bits: int, fixed_bytes: float, unquantized: set[str] = frozenset()
) -> Problem:
    """The allocation problem of a sensitivity result over `scheme_names`; UserError naming every
    unit that no scheme fits. Units with a layer in `unquantized` (the recipe ignores it) stay BF16."""
    index = {name: sens.schemes.index(name) for name in scheme_names}
    options, stuck = [], []
    for unit, row in zip(sens.units, sens.kld):
        opts = []
        if unquantized.intersection(unit.layers):
            options.append([("BF16", unit.bits(schemes.get("BF16"), dtype_bits), 0.0)])
            continue
        for name in scheme_names:
            scheme = schemes.get(name)
            bits = unit.bits(scheme, dtype_bits)
            if bits is not None and row[index[name]] is not None:
                opts.append((name, bits, max(float(row[index[name]]), 0.0)))
        if not opts:
            stuck.append(unit)
        options.append(opts)
    if stuck:
        groups = {s: schemes.get(s).group_size for s in scheme_names}
        widths = sorted({u.in_features for u in stuck})
        raise UserError(
            f"--schemes: no scheme of {', '.join(scheme_names)} fits {len(stuck)} layer(s) of this model "
            f"(input widths {', '.join(map(str, widths))}, e.g. {stuck[0].layers[0]}); group sizes "
            f"{', '.join(f'{s}: {g}' for s, g in groups.items() if g)} do not divide them. Add a scheme that "
            "fits (W4A16-G32, a per-channel scheme such as W8A8, or BF16)"
        )
    return Problem([u.name for u in sens.units], [u.params for u in sens.units], options, fixed_bytes)


def solve(p: Problem, budget_bits: float, resolution: int = RESOLUTION) -> Allocation:
    """The allocation with the least predicted KLD whose stored bits are at most `budget_bits`."""
    cheapest = [min(opts, key=lambda o: o[1]) for opts in p.options]
    floor = sum(o[1] for o in cheapest)
    if budget_bits < floor - 1e-6:
        raise ValueError("budget below the cheapest allocation")
    extra = budget_bits - floor
    step = extra / resolution if extra > 0 else 1.0
    size = resolution + 1 if extra > 0 else 1
    best = np.zeros(size)  # least KLD with at most k buckets spent, over the units so far
    picks = np.zeros((len(p.options), size), dtype=np.int16)
    for u, opts in enumerate(p.options):
        low = cheapest[u][1]
        new = np.full(size, np.inf)
        pick = np.zeros(size, dtype=np.int16)
        for i, (_, bits, kld) in enumerate(opts):
            cost = 0 if bits <= low + 1e-9 else math.ceil((bits - low) / step - 1e-9)
            if cost >= size:
                continue
            shifted = np.full(size, np.inf)
            shifted[cost:] = best[: size - cost] + kld
            better = shifted < new - 1e-15
            new = np.where(better, shifted, new)
            pick = np.where(better, i, pick)
        best, picks[u] = new, pick
    k = int(np.argmin(best))  # the least KLD over every spend (a larger spend never helps if it is not less)
    choice = {}
    spent_bits = 0.0
    total_kld = 0.0
    for u in range(len(p.options) - 1, -1, -1):
        name, bits, kld = p.options[u][picks[u][k]]
        choice[p.units[u]] = name
        spent_bits += bits
        total_kld += kld
        low = cheapest[u][1]
        k -= 0 if bits <= low + 1e-9 else math.ceil((bits - low) / step - 1e-9)
    choice = {unit: choice[unit] for unit in p.units}
    return Allocation(
        choice, spent_bits, total_kld, spent_bits / p.total_params, (p.fixed_bytes + spent_bits / 8) / 2**20
    )


def for_bits(p: Problem, bits_per_weight: float) -> Allocation:
    """`--bits B`: at most B stored bits per quantizable weight on average."""
    cheapest, _ = p.bounds()
    if bits_per_weight * p.total_params < cheapest - 1e-6:
        raise UserError(
            f"--bits {bits_per_weight:g}: below {cheapest / p.total_params:.3f}, what the cheapest scheme "
            "that fits each layer needs (scales included); give a larger budget or a cheaper scheme"
        )
    return solve(p, bits_per_weight * p.total_params)


def for_size(p: Problem, size_mb: float) -> Allocation:
    """`--max-size-mb M`: a checkpoint of at most M MiB (the unquantized rest included)."""
    cheapest, _ = p.bounds()
    smallest = (p.fixed_bytes + cheapest / 8) / 2**20
    if size_mb < smallest - 1e-9:
        raise UserError(
            f"--max-size-mb {size_mb:g}: below {smallest:.1f} MiB, the smallest checkpoint the schemes "
            f"allow ({p.fixed_bytes / 2**20:.1f} MiB of it are embeddings and norms, never quantized here)"
        )
    return solve(p, p.bits_for_size(size_mb))
