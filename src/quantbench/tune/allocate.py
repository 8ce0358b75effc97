"""Bit allocation: one scheme per unit (a layer, or the layers vLLM fuses) that minimises the
predicted KLD (the sum of each unit's measured sensitivity) under a size budget, or under a
budget of predicted decode time (a latency tune: cost.py's table gives each option its ms).

This is a multiple-choice knapsack, solved exactly up to the budget's resolution by dynamic
programming over the budget above the cheapest choice: every unit's extra cost is rounded *up*
to a bucket of `budget / RESOLUTION` bits, so a solution never exceeds the budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
    # a latency problem: the budget is predicted decode ms/token (base_ms + each unit's ms for its
    # scheme, from a measured cost table), not bits
    unit_ms: list[dict[str, float]] | None = None
    base_ms: float = 0.0

    @property
    def total_params(self) -> int:
        return sum(self.params)

    @property
    def by_ms(self) -> bool:
        return self.unit_ms is not None

    def weight(self, u: int, option: tuple[str, float, float]) -> float:
        """What an option spends of the budget: its bits, or in a latency problem its ms."""
        return self.unit_ms[u][option[0]] if self.unit_ms is not None else option[1]

    def bounds(self) -> tuple[float, float]:
        """The budget (bits, or ms) of the cheapest allocation and of the one with the least
        predicted KLD (the cheaper of equal ones)."""
        cheapest = sum(min(self.weight(u, o) for o in opts) for u, opts in enumerate(self.options))
        best = sum(
            self.weight(u, min(opts, key=lambda o: (o[2], self.weight(u, o)))) for u, opts in enumerate(self.options)
        )
        return cheapest + self.base_ms, best + self.base_ms

    def bits_for_size(self, size_mb: float) -> float:
        return size_mb * 2**20 * 8 - self.fixed_bytes * 8


@dataclass
class Allocation:
    choice: dict[str, str]  # unit -> scheme
    bits: float  # total stored bits of the quantizable layers
    predicted_kld: float
    bits_per_weight: float
    size_mb: float  # predicted checkpoint size
    predicted_ms: float | None = None  # predicted decode ms/token (a latency problem)

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
            options.append([("BF16", unit.bits(schemes.any_scheme("BF16"), dtype_bits), 0.0)])
            continue
        for name in scheme_names:
            scheme = schemes.any_scheme(name)
            bits = unit.bits(scheme, dtype_bits)
            if bits is not None and row[index[name]] is not None:
                opts.append((name, bits, max(float(row[index[name]]), 0.0)))
        if not opts:
            stuck.append(unit)
        options.append(opts)
    check_fits({u.layers[0]: u.in_features for u in stuck}, scheme_names)
    return Problem([u.name for u in sens.units], [u.params for u in sens.units], options, fixed_bytes)


def solve(p: Problem, budget_bits: float, resolution: int = RESOLUTION) -> Allocation:
    """The allocation with the least predicted KLD whose stored bits (in a latency problem:
    predicted decode ms) are at most `budget_bits`."""
    import numpy as np

    weighted = [[(o[0], p.weight(u, o), o[2]) for o in opts] for u, opts in enumerate(p.options)]
    budget = budget_bits - p.base_ms
    cheapest = [min(opts, key=lambda o: o[1]) for opts in weighted]
    floor = sum(o[1] for o in cheapest)
    if budget < floor - 1e-6:
        raise ValueError("budget below the cheapest allocation")
    extra = budget - floor
    step = extra / resolution if extra > 0 else 1.0
    size = resolution + 1 if extra > 0 else 1
    best = np.zeros(size)  # least KLD with at most k buckets spent, over the units so far
    picks = np.zeros((len(p.options), size), dtype=np.int16)
    for u, opts in enumerate(weighted):
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
    spent_bits = spent = 0.0
    total_kld = 0.0
    for u in range(len(p.options) - 1, -1, -1):
        name, bits, kld = p.options[u][picks[u][k]]
        weight = weighted[u][picks[u][k]][1]
        choice[p.units[u]] = name
        spent_bits += bits
        spent += weight
        total_kld += kld
        low = cheapest[u][1]
        k -= 0 if weight <= low + 1e-9 else math.ceil((weight - low) / step - 1e-9)
    choice = {unit: choice[unit] for unit in p.units}
    return Allocation(
        choice,
        spent_bits,
        total_kld,
        spent_bits / p.total_params,
        (p.fixed_bytes + spent_bits / 8) / 2**20,
        p.base_ms + spent if p.by_ms else None,
    )


def check_fits(stuck: dict[str, int], scheme_names: list[str], model: str = "this model") -> None:
    """UserError naming the layers (name -> input width) no scheme of `scheme_names` fits, if any
    (checked before a tune measures anything, and again on its allocation problem)."""
    if not stuck:
        return
    widths = sorted(set(stuck.values()))
    groups = ", ".join(
        f"{x} needs a multiple of {schemes.any_scheme(x).group_size}"
        for x in scheme_names
        if schemes.any_scheme(x).group_size
    )
    gguf = any(isinstance(schemes.any_scheme(x), schemes.GgufType) for x in scheme_names)
    fitting = (
        "Q4_0 ... Q8_0, IQ4_NL (blocks of 32) or F16"
        if gguf
        else "W4A16-G32, a per-channel scheme (W8A8, W8A16, FP8) or BF16"
    )
    raise UserError(
        f"--schemes: no scheme of {', '.join(scheme_names)} fits {len(stuck)} layer(s) of {model} "
        f"(input widths {', '.join(map(str, widths))}, e.g. {next(iter(stuck))}; {groups}). Add one "
        f"that fits: {fitting}"
    )


def check_bits(
    bits_per_weight: float, cheapest_bits: float, params: int, names: list[str], costliest_bits: float | None = None
) -> None:
    """`--bits B` against the fewest stored bits schemes `names` allow on these `params` weights
    (checked before a tune measures anything, and again on its allocation problem), and against
    the most (`costliest_bits`): a budget above it buys nothing and names a size no mix has."""
    if bits_per_weight * params < cheapest_bits - 1e-6:
        raise UserError(
            f"--bits {bits_per_weight:g}: below {cheapest_bits / params:.3f}, what the cheapest of "
            f"{', '.join(names)} takes on every layer (scales included); raise it or add a cheaper scheme"
        )
    if costliest_bits is not None and bits_per_weight * params > costliest_bits + 1e-6:
        raise UserError(
            f"--bits {bits_per_weight:g}: above {costliest_bits / params:.3f}, what the costliest of "
            f"{', '.join(names)} takes on every layer (scales included); lower it or add a costlier scheme"
        )


def check_size(size_mb: float, cheapest_bits: float, fixed_bytes: float, names: list[str]) -> None:
    """`--max-size-mb M` against the smallest checkpoint schemes `names` allow (the rest included)."""
    smallest = (fixed_bytes + cheapest_bits / 8) / 2**20
    if size_mb < smallest - 1e-9:
        raise UserError(
            f"--max-size-mb {size_mb:g}: below {smallest:.1f} MiB, the smallest checkpoint "
            f"{', '.join(names)} allow ({fixed_bytes / 2**20:.1f} MiB of it embeddings and norms, "
            "which a tune does not choose)"
        )


def _names(p: Problem) -> list[str]:
    return list(dict.fromkeys(name for opts in p.options for name, _, _ in opts))


def for_bits(p: Problem, bits_per_weight: float) -> Allocation:
    """`--bits B`: at most B stored bits per quantizable weight on average."""
    check_bits(bits_per_weight, p.bounds()[0], p.total_params, _names(p))
    return solve(p, bits_per_weight * p.total_params)


def for_size(p: Problem, size_mb: float) -> Allocation:
    """`--max-size-mb M`: a checkpoint of at most M MiB (the unquantized rest included)."""
    check_size(size_mb, p.bounds()[0], p.fixed_bytes, _names(p))
    return solve(p, p.bits_for_size(size_mb))
