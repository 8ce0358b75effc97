"""The interval machinery (intervals.py) against direct computations and known values: the
resampled quantile, McNemar's exact test, the paired-repetition ratio interval, the block
bootstrap of the quality pass, the item bootstrap of tasks and flips, and the coverage of the
intervals on data whose truth is known."""

import math
import random

import pytest
import torch

from quantbench.core import intervals
from quantbench.core.measures import Comparison
from quantbench.quality.tasks import item_intervals
from quantbench.speed.measure import Profile, speedup_intervals

BOOT = intervals.Bootstrap(resamples=400, seed=0)


def test_the_expanded_tail_widens_small_samples_and_tends_to_two_and_a_half_percent():
    assert intervals.tail(16) == pytest.approx(0.01386, abs=1e-5)  # Phi(sqrt(16/15) * t_15(0.025))
    assert intervals.tail(10) < intervals.tail(16) < intervals.tail(235) < intervals.tail(100_000) < 0.025
    assert intervals.tail(100_000) == pytest.approx(0.025, abs=1e-4)


def test_counts_draw_every_unit_count_times_and_are_repeatable():
    counts = BOOT.counts(12)
    assert counts.shape == (400, 12) and torch.equal(counts.sum(1), torch.full((400,), 12.0, dtype=torch.float64))
    assert torch.equal(counts, BOOT.counts(12)) and not torch.equal(counts, intervals.Bootstrap(400, 1).counts(12))


@pytest.mark.parametrize("q", [0.0, 0.5, 0.9, 0.99, 1.0])
def test_resampled_quantile_is_the_quantile_of_the_resampled_array(q):
    gen = torch.Generator().manual_seed(1)
    values, units = torch.rand(6 * 7, generator=gen, dtype=torch.float64), 6
    owner = torch.arange(units).repeat_interleave(7)
    counts = intervals.Bootstrap(25, 3).counts(units)
    got = intervals.resampled_quantile(values, owner, counts, q)
    for b in range(len(counts)):
        drawn = torch.cat([values[owner == u].repeat(int(counts[b, u])) for u in range(units)])
        assert got[b].item() == pytest.approx(torch.quantile(drawn, q).item(), abs=1e-12)
    ones = torch.ones(1, units, dtype=torch.float64)  # every unit once: the plain quantile
    assert intervals.resampled_quantile(values, owner, ones, q).item() == pytest.approx(torch.quantile(values, q).item())


@pytest.mark.parametrize("b, c", [(0, 0), (10, 0), (0, 10), (5, 5), (3, 9), (12, 30), (1, 2)])
def test_mcnemar_matches_the_exact_binomial_test(b, c):
    from scipy.stats import binomtest

    expected = 1.0 if b + c == 0 else binomtest(min(b, c), b + c, 0.5).pvalue
    assert intervals.mcnemar_p(b, c) == pytest.approx(expected, rel=1e-12)


def test_ratio_interval_is_students_t_on_log_ratios():
    from scipy import stats

    ratios = [1.10, 1.05, 1.12, 1.08, 1.02]
    logs = [math.log(r) for r in ratios]
    low, high = stats.t.interval(0.95, len(logs) - 1, loc=sum(logs) / len(logs), scale=stats.sem(logs))
    assert intervals.ratio_interval(ratios) == pytest.approx((math.exp(low), math.exp(high)), rel=1e-12)
    assert intervals.ratio_interval([1.1, 1.2]) is None  # two pairs: too few
    assert intervals.ratio_interval([1.1, 0.0, 1.2]) is None


def comparison(windows: int, per_window: int = 9, seed: int = 0) -> tuple[Comparison, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n = windows * per_window
    base_nll = torch.rand(n, generator=gen) * 4
    cand = Comparison(base_nll + torch.rand(n, generator=gen) * 0.3, torch.rand(n, generator=gen) ** 3,
                      torch.rand(n, generator=gen) > 0.2, per_window)
    return cand, base_nll


def test_block_bootstrap_brackets_every_point_estimate_and_pairs_the_base():
    cand, base_nll = comparison(12)
    metrics, ci = cand.metrics(), cand.intervals(base_nll, BOOT)
    for name in ("quality/ppl", "quality/kld_mean", "quality/kld_p90", "quality/kld_p99", "quality/top1_agreement"):
        assert ci[name + ".ci_low"] < metrics[name] < ci[name + ".ci_high"], name
    assert "quality/kld_max.ci_low" not in ci and "quality/positions.ci_low" not in ci
    recovery = math.exp(base_nll.double().mean().item()) / metrics["quality/ppl"]
    assert ci["recovery/quality/ppl.ci_low"] < recovery < ci["recovery/quality/ppl.ci_high"]
    # paired: the candidate is the base plus a small shift, so recovery is much tighter than ppl
    rel = lambda name, point: (ci[name + ".ci_high"] - ci[name + ".ci_low"]) / point  # noqa: E731
    assert rel("recovery/quality/ppl", recovery) < rel("quality/ppl", metrics["quality/ppl"]) / 3
    # a candidate identical to the base: recovery exactly 1 in every resample
    same = Comparison(base_nll, torch.zeros_like(base_nll), torch.ones_like(base_nll, dtype=torch.bool), 9)
    ci_same = same.intervals(base_nll, BOOT)
    assert ci_same["recovery/quality/ppl.ci_low"] == ci_same["recovery/quality/ppl.ci_high"] == pytest.approx(1.0)
    assert ci_same["quality/kld_mean.ci_high"] == 0.0
    assert cand.intervals(base_nll, BOOT, "quality_ood/")["quality_ood/kld_mean.ci_low"] == ci["quality/kld_mean.ci_low"]


def test_too_few_windows_give_no_interval():
    cand, base_nll = comparison(intervals.MIN_UNITS - 1)
    assert cand.intervals(base_nll, BOOT) == {}
    cand, base_nll = comparison(intervals.MIN_UNITS)
    assert cand.intervals(base_nll, intervals.Bootstrap(0, 0)) == {}  # resamples: 0 switches them off
    assert "quality/kld_mean.ci_low" in cand.intervals(base_nll, BOOT)


def test_coverage_on_windows_whose_truth_is_known():
    """Windows of correlated values (a shared per-window offset): the true mean is 0.5. The 95 %
    block-bootstrap interval must hold it in most of 150 draws: well above what treating the
    positions as independent would give (that interval is far too narrow here)."""
    gen = torch.Generator().manual_seed(7)
    boot, held, naive_held, draws = intervals.Bootstrap(1000, 0), 0, 0, 150
    for _ in range(draws):
        windows, per = 16, 20
        offsets = torch.rand(windows, generator=gen).repeat_interleave(per)
        kld = offsets * 0.8 + torch.rand(windows * per, generator=gen) * 0.2  # E = 0.4 + 0.1
        cand = Comparison(torch.zeros(windows * per), kld, torch.ones(windows * per, dtype=torch.bool), per)
        ci = cand.intervals(torch.zeros(windows * per), boot)
        held += ci["quality/kld_mean.ci_low"] <= 0.5 <= ci["quality/kld_mean.ci_high"]
        half = 1.96 * kld.double().std().item() / math.sqrt(len(kld))
        naive_held += abs(kld.double().mean().item() - 0.5) <= half
    assert 0.88 <= held / draws <= 0.99, held  # measured 0.927 (150 draws; the plain percentile interval: 0.89)
    assert naive_held / draws < 0.6, naive_held


def items(values: dict[str, list]) -> dict:
    return {"t": {doc: {metric: v[doc] for metric, v in values.items()} for doc in range(len(next(iter(values.values()))))}}


def test_item_intervals_for_task_metrics_recovery_and_flips():
    rng = random.Random(0)
    n = 40
    base_acc = [float(rng.random() < 0.7) for _ in range(n)]
    cand_acc = [a if rng.random() < 0.85 else 1 - a for a in base_acc]
    base_ll = [-rng.random() * 3 for _ in range(n)]
    cand_ll = [x - rng.random() * 0.3 for x in base_ll]
    base, cand = items({"acc": base_acc, "perplexity": base_ll}), items({"acc": cand_acc, "perplexity": cand_ll})
    metrics = {"task/t/acc": sum(cand_acc) / n, "task/t/perplexity": math.exp(-sum(cand_ll) / n)}
    metrics.update({"recovery/task/t/acc": sum(cand_acc) / sum(base_acc),
                    "recovery/task/t/perplexity": math.exp(-sum(base_ll) / n) / metrics["task/t/perplexity"]})
    ci, notes = item_intervals(base, cand, metrics, BOOT)
    assert notes == []
    for name, point in metrics.items():
        assert ci[name + ".ci_low"] <= point <= ci[name + ".ci_high"], name
    # no recovery logged (as where the base scored 0): no interval for it either
    without = {k: v for k, v in metrics.items() if k != "recovery/task/t/acc"}
    assert "recovery/task/t/acc.ci_low" not in item_intervals(base, cand, without, BOOT)[0]
    assert ci["recovery/task/t/perplexity.ci_high"] < 1  # the candidate is worse on every item
    flipped = 100 * sum(a != b for a, b in zip(base_acc, cand_acc)) / n
    assert ci["quality/flips_pct.ci_low"] <= flipped <= ci["quality/flips_pct.ci_high"]
    # a logged score the items do not reproduce gets no interval, and a note says why
    ci, notes = item_intervals(base, cand, {**metrics, "task/t/acc": 0.123}, BOOT)
    assert "task/t/acc.ci_low" not in ci and any("do not reproduce" in n for n in notes)


def test_too_few_items_give_no_interval_and_say_so():
    base, cand = items({"acc": [1.0, 0.0] * 3}), items({"acc": [1.0, 1.0] * 3})
    ci, notes = item_intervals(base, cand, {"task/t/acc": 1.0}, BOOT)
    assert ci == {}
    assert notes == ["task/t/*: 6 items, too few for an interval (at least 10)",
                     "quality/flips_*: 6 items, too few for an interval (at least 10)"]


def test_speedup_intervals_pair_the_repetitions():
    profile = Profile(prompt_tokens=[16], concurrency=[1], repetitions=4, warmup=0)
    rng = random.Random(0)
    drift = [1 + 0.5 * rng.random() for _ in range(5)]  # the machine slows down and speeds up: both models alike
    base = {"p16/ttft_ms": [10 * d for d in drift], "p16/e2e_ms": [50 * d for d in drift],
            "p16/prefill_tok_s": [1600 / d for d in drift], "p16/decode_tok_s": [20 / d for d in drift],
            "p16/itl_ms": [50 * d for d in drift], "c1/throughput_tok_s": [20 / d for d in drift],
            "c1/requests_s": [1 / d for d in drift]}
    cand = {k: [v * (1.25 if "tok_s" in k or "requests" in k else 0.8) * (1 + 0.01 * (i % 2)) for i, v in enumerate(vals)]
            for k, vals in base.items()}
    out = speedup_intervals({"candidate": cand, "base": base}, profile)
    assert "speedup/e2e_ms_p95.ci_low" not in out and "speedup/e2e_ms_p50.ci_low" in out  # no tail to pair
    for key in ("decode_tok_s", "ttft_ms_p50", "c1/throughput_tok_s", "e2e_ms_p50"):
        low, high = out[f"speedup/{key}.ci_low"], out[f"speedup/{key}.ci_high"]
        assert low < 1.25 < high and high / low < 1.03, (key, low, high)  # the drift cancels in each pair
    two = {name: {k: v[:2] for k, v in rows.items()} for name, rows in (("candidate", cand), ("base", base))}
    assert speedup_intervals(two, profile) == {}


def test_the_pareto_frontier_keeps_what_nothing_beats():
    from quantbench.core.intervals import pareto

    # (size, KLD), lower is better on both: (2, 2) is beaten by (1, 1); ties stay together
    points = [(1.0, 1.0), (2.0, 2.0), (0.5, 3.0), (1.0, 1.0), (3.0, 0.1)]
    assert pareto(points) == [True, False, True, True, True]
    assert pareto([]) == [] and pareto([(5.0,)]) == [True]
