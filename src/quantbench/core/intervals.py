"""Confidence intervals for comparisons against the base model (docs/intervals.md).

- Quality (`quality/*`, `quality_ood/*`, `task/*`, `recovery/*`): a paired percentile bootstrap
  over the units a metric is made of. The quality pass's units are its token windows, resampled
  whole (a block bootstrap: positions inside a window are not independent); a task's units are
  its items. Paired: one resample draws the same windows (items) for the candidate and for the
  base model, so a ratio's interval carries only the noise of the difference.
- Answer flips: McNemar's exact test on right->wrong against wrong->right.
- Speed (`speedup/*`): the interleaved A/B repetitions are pairs; the interval is Student's t on
  the log of the per-repetition ratios (a geometric-mean ratio), exponentiated.

Too few units for an interval: none is computed and the caller says so; nothing is invented.
Every interval here is 95 % (two-sided).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

CONFIDENCE = 0.95
MIN_UNITS = 10  # fewer windows or items than this: no bootstrap interval (its coverage falls well short)
MIN_REPETITIONS = 3  # fewer paired repetitions than this: no speed interval
LOW, HIGH = ".ci_low", ".ci_high"
_CHUNK = 4_000_000  # resamples x values per step of a bootstrap quantile (bounds its memory)


@dataclass(frozen=True)
class Bootstrap:
    """How a suite's intervals are drawn: `resamples` resamples with a fixed `seed`."""

    resamples: int
    seed: int

    def counts(self, units: int) -> torch.Tensor:
        """[resamples, units] float64: how often each unit is drawn in each resample (sum = units)."""
        import torch  # lazy: torch takes over a second to import, and most importers of this module never draw

        generator = torch.Generator().manual_seed(self.seed)
        drawn = torch.randint(units, (self.resamples, units), generator=generator)
        counts = torch.zeros(self.resamples, units, dtype=torch.float64)
        return counts.scatter_add_(1, drawn, torch.ones_like(drawn, dtype=torch.float64))


def enough(units: int) -> bool:
    return units >= MIN_UNITS


def tail(units: int) -> float:
    """The share of bootstrap draws left out below (and above) the interval for `units` units.

    The plain percentile interval (2.5 % each side) is too narrow with few units: measured on
    windows whose truth is known (tests/core/test_intervals.py), 16 windows held the truth in 89 % of
    draws, not 95 %. The expanded percentile interval (Hesterberg, "What teachers should know
    about the bootstrap", 2015) widens it as Student's t and the n/(n-1) variance correction do for
    a mean: tail = Phi(sqrt(n/(n-1)) * t_{n-1}(2.5 %)); 1.4 % for 16 units, -> 2.5 % for many."""
    from scipy.stats import norm, t

    return float(norm.cdf(math.sqrt(units / (units - 1)) * t.ppf((1 - CONFIDENCE) / 2, units - 1)))


def bounds(name: str, draws: torch.Tensor, units: int) -> dict[str, float]:
    """`<name>.ci_low`, `<name>.ci_high`: the expanded percentile interval of bootstrap draws over
    `units` units (see `tail`)."""
    import torch  # lazy: see Bootstrap.counts

    cut = tail(units)
    low, high = torch.quantile(draws.double(), torch.tensor([cut, 1 - cut], dtype=torch.float64)).tolist()
    return {name + LOW: low, name + HIGH: high}


def weighted_means(counts: torch.Tensor, sums: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """[resamples]: the mean over the values of the drawn units (unit i: `sums[i]` over `sizes[i]` values)."""
    return (counts @ sums.double()) / (counts @ sizes.double())


def resampled_quantile(values: torch.Tensor, unit: torch.Tensor, counts: torch.Tensor, q: float) -> torch.Tensor:
    """[resamples]: `torch.quantile(resampled values, q)` (linear interpolation) for every resample,
    where resample b repeats the values of unit u `counts[b, u]` times; computed from one sort of
    the values and cumulative counts, without building the resampled arrays."""
    import torch  # lazy: see Bootstrap.counts

    order = torch.argsort(values)
    ordered, owner = values[order].double(), unit[order]
    out = []
    step = max(1, _CHUNK // max(1, len(values)))
    for start in range(0, len(counts), step):
        weights = counts[start : start + step][:, owner]  # [b, n] copies of each value
        cumulative = weights.cumsum(1)
        position = q * (cumulative[:, -1] - 1)
        below, above = position.floor(), position.ceil()
        i_below = torch.searchsorted(cumulative, below[:, None], right=True)[:, 0]
        i_above = torch.searchsorted(cumulative, above[:, None], right=True)[:, 0]
        low, high = ordered[i_below], ordered[i_above]
        out.append(low + (position - below) * (high - low))
    return torch.cat(out)


def mcnemar_p(right_to_wrong: int, wrong_to_right: int) -> float:
    """Two-sided exact McNemar test: under "the change did not matter" each discordant item is
    equally likely to flip either way, so the smaller count is Binomial(b + c, 1/2)."""
    n = right_to_wrong + wrong_to_right
    if n == 0:
        return 1.0
    from scipy.stats import binomtest

    return float(binomtest(min(right_to_wrong, wrong_to_right), n, 0.5).pvalue)


def ratio_interval(ratios: list[float]) -> tuple[float, float] | None:
    """The interval of the geometric-mean ratio of paired repetitions: Student's t on log ratios.
    None when there are too few pairs, or a ratio is not a positive number."""
    if len(ratios) < MIN_REPETITIONS or not all(r > 0 and math.isfinite(r) for r in ratios):
        return None
    from scipy.stats import t

    logs = [math.log(r) for r in ratios]
    half = t.ppf(1 - (1 - CONFIDENCE) / 2, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    centre = statistics.fmean(logs)
    return math.exp(centre - half), math.exp(centre + half)


def has_interval(metrics: dict[str, float], name: str) -> bool:
    return name + LOW in metrics and name + HIGH in metrics


def interval_of(metrics: dict[str, float], name: str) -> tuple[float, float] | None:
    return (metrics[name + LOW], metrics[name + HIGH]) if has_interval(metrics, name) else None


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile of `values` (q in [0, 1]): a value that was measured, never one
    interpolated between two (latency percentiles as `vllm bench serve` reports them)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def pareto(points: list[tuple[float, ...]]) -> list[bool]:
    """For each point (every coordinate lower is better), whether no other point is at least as good
    on every coordinate and better on one: the Pareto frontier, as compare and tune draw it."""

    def dominates(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
        return all(x <= y for x, y in zip(a, b)) and any(x < y for x, y in zip(a, b))

    return [not any(dominates(q, p) for j, q in enumerate(points) if j != i) for i, p in enumerate(points)]
