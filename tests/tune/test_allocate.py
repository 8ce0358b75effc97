"""Bit allocation (allocate.py), the budget search's decisions (search.py's Search) on a stand-in for
measuring, and the compact layer targets a tuned recipe is written with."""

import itertools
import random

import pytest

from quantbench.core.errors import UserError
from quantbench.recipe import schemes
from quantbench.release.gate import Bound
from quantbench.tune import allocate
from quantbench.tune.candidates import Candidate
from quantbench.tune.frontier import answer
from quantbench.tune.patterns import targets
from quantbench.tune.plan import Request
from quantbench.tune.search import Search, _beyond_bits
from quantbench.tune.sensitivity import Sensitivity, Settings, Unit


def brute_force(p: allocate.Problem, budget: float) -> float:
    return min(sum(o[2] for o in combo) for combo in itertools.product(*p.options) if sum(o[1] for o in combo) <= budget)


def test_the_dynamic_programme_finds_the_least_kld_within_the_budget():
    rng = random.Random(0)
    for _ in range(150):
        n = rng.randint(1, 6)
        options = [sorted(((f"s{i}", rng.uniform(1, 10), rng.uniform(0, 1)) for i in range(rng.randint(1, 4))),
                          key=lambda o: o[1]) for _ in range(n)]
        p = allocate.Problem([f"u{i}" for i in range(n)], [1] * n, options)
        lo, hi = sum(min(o[1] for o in opts) for opts in options), sum(max(o[1] for o in opts) for opts in options)
        budget = rng.uniform(lo, hi)
        got = allocate.solve(p, budget, resolution=20000)
        assert got.bits <= budget + 1e-9  # costs are rounded up: never over
        assert got.predicted_kld == pytest.approx(sum(o[2] for u, opts in enumerate(options) for o in opts
                                                      if o[0] == got.choice[f"u{u}"]))
        # the optimum, up to the budget's resolution (a solution within one bucket of the edge may be missed)
        assert got.predicted_kld <= brute_force(p, budget - (budget - lo) / 20000 * n) + 1e-12


def test_a_latency_budget_is_spent_where_the_time_buys_the_most_kld():
    """A latency problem: each option costs its predicted ms (a type can be smaller and still
    slower: here the 5-bit type decodes slower than the 8-bit one); the least KLD within the ms
    budget, checked against every combination, whatever the bits."""
    rng = random.Random(1)
    for _ in range(40):
        n = rng.randint(1, 5)
        options = [[(f"s{i}", rng.uniform(4, 16), rng.uniform(0, 1)) for i in range(rng.randint(1, 4))] for _ in range(n)]
        unit_ms = [{o[0]: rng.uniform(-1, 3) for o in opts} for opts in options]
        p = allocate.Problem([f"u{i}" for i in range(n)], [1] * n, options, unit_ms=unit_ms, base_ms=10.0)
        fastest, slowest = p.bounds()
        budget = rng.uniform(fastest, max(slowest, fastest + 1))
        got = allocate.solve(p, budget, resolution=20000)
        ms = {u: unit_ms[i][got.choice[u]] for i, u in enumerate(p.units)}
        assert got.predicted_ms == pytest.approx(10.0 + sum(ms.values())) and got.predicted_ms <= budget + 1e-9
        best = min(sum(o[2] for o in combo) for combo in itertools.product(*options)
                   if 10.0 + sum(unit_ms[i][o[0]] for i, o in enumerate(combo)) <= budget - (budget - fastest) / 20000 * n)
        assert got.predicted_kld <= best + 1e-12
        # bits are still counted (the recipe's size), whatever the budget was in
        assert got.bits == pytest.approx(sum(o[1] for i, opts in enumerate(options) for o in opts if o[0] == got.choice[f"u{i}"]))


def sensitivity(widths=(64, 64, 96), kld=None) -> Sensitivity:
    names = ["W4A16-G64", "W4A16-G32", "W8A8", "BF16"]
    units = [Unit(f"model.layers.{i}.mlp.down_proj", [f"model.layers.{i}.mlp.down_proj"], w, [32], i)
             for i, w in enumerate(widths)]
    table = kld or [[0.3 * (i + 1), 0.2 * (i + 1), 0.01 * (i + 1), 0.0] for i in range(len(units))]
    table = [[None if not schemes.get(s).fits(u.in_features) else v for s, v in zip(names, row)] for u, row in zip(units, table)]
    return Sensitivity("run", False, Settings(), names, units, table, 1.0, "key")


def test_a_budget_buys_the_units_that_matter_most_and_a_layer_no_scheme_fits_is_named():
    sens = sensitivity(kld=[[0.3, 0.2, 0.01, 0.0], [0.4, 0.3, 0.02, 0.0], [None, 5.0, 0.05, 0.0]])
    p = allocate.problem(sens, ["W4A16-G64", "W4A16-G32", "W8A8", "BF16"], 16, 0.0)
    cheapest = allocate.solve(p, p.bounds()[0])
    # width 96: group 64 does not fit, so that unit's cheapest is G32
    assert cheapest.choice == {"model.layers.0.mlp.down_proj": "W4A16-G64", "model.layers.1.mlp.down_proj": "W4A16-G64",
                               "model.layers.2.mlp.down_proj": "W4A16-G32"}
    one_more = p.bounds()[0] + 32 * 96 * (schemes.get("W8A8").bits(96, 32) - schemes.get("W4A16-G32").bits(96, 32))
    assert allocate.solve(p, one_more).choice["model.layers.2.mlp.down_proj"] == "W8A8"  # the most sensitive unit first
    with pytest.raises(UserError, match=r"--bits 4: below 4\.41"):
        allocate.for_bits(p, 4.0)
    with pytest.raises(UserError, match="no scheme of W4A16-G64 fits 1 layer.*input widths 96.*model.layers.2.mlp.down_proj"):
        allocate.problem(sens, ["W4A16-G64"], 16, 0.0)
    forced = allocate.problem(sens, ["W4A16-G64", "W4A16-G32"], 16, 0.0, unquantized={"model.layers.2.mlp.down_proj"})
    assert allocate.solve(forced, forced.bounds()[1]).choice["model.layers.2.mlp.down_proj"] == "BF16"


def test_compact_targets_select_exactly_the_layers_they_were_made_from():
    names = [f"model.layers.{b}.{k}" for b in range(12) for k in
             ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.down_proj")]
    chosen = [n for n in names if n.endswith("down_proj") and int(n.split(".")[2]) in (1, 10)] + \
             [n for n in names if ".2.self_attn." in n and not n.endswith("o_proj")]
    patterns = targets(chosen)
    assert len(patterns) == 2  # down_proj in blocks 1 and 10; q, k and v of block 2 in one pattern
    assigned = schemes.assign(names, "W4A16-G64", {"W8A8": patterns}, [])
    assert sorted(n for n, s in assigned.items() if s == "W8A8") == sorted(chosen)  # block 1 is not block 10 or 11


class StandIn(Search):
    """The search's decisions with measuring replaced: a candidate passes when its bits per weight
    reach `needed`; its measured KLD is the prediction times `scale`."""

    def __init__(self, sens, needed, scale, runs, limit, alternatives=(), parallel=1):
        self.sens, self.needed, self.scale = sens, needed, scale
        self.problem = allocate.problem(sens, sens.schemes, 16, 0.0)
        self.candidates, self.allocations, self.templates, self.rounds = [], {}, [], []
        policy = type("P", (), {"max": {"quality/kld_mean": limit}})
        request = Request("x", budget_runs=runs, parallel=parallel)
        self.plan = type("Plan", (), {"request": request, "alternatives": list(alternatives),
                                      "policy": type("L", (), {"policy": policy})})

    def measure_many(self, wanted):
        self.rounds.append(len(wanted))
        return [self.measure(*w) for w in wanted]

    def measure(self, alloc, budget_bits, template=None):
        self.allocations[f"sha{len(self.candidates)}"] = alloc
        self.templates.append(template)
        passed = alloc.bits_per_weight >= self.needed
        cand = Candidate(f"c{len(self.candidates)}", "r", f"sha{len(self.candidates)}", budget_bits, alloc.predicted_kld, alloc.size_mb, alloc.bits_per_weight,
                         alloc.counts(), run_id="run", status="finished",
                         metrics={"quality/kld_mean": alloc.predicted_kld * self.scale * (0.5 if template else 1),
                                  "model/size_mb": alloc.size_mb}, checks=[{"passed": passed}],
                         passed=passed, quality_passed=passed)
        self.candidates.append(cand)
        return cand


def many_units(n=40) -> Sensitivity:
    rng = random.Random(1)
    kld = []
    for _ in range(n):
        w4 = rng.uniform(0.001, 0.02)
        kld.append([w4, 0.8 * w4, 0.01 * w4, 0.0])
    return sensitivity(widths=(64,) * n, kld=kld)


@pytest.mark.parametrize("limit", [0.05, Bound(value=0.05, on="ci_high")], ids=["number", "interval-bound"])
def test_the_budget_search_narrows_to_the_smallest_passing_candidate(limit):
    # a policy's KLD limit is a number or, as release writes it, a bound on one end of the interval
    search = StandIn(many_units(), needed=6.0, scale=2.0, runs=8, limit=limit)
    search.budgets()
    bits = [c.bits_per_weight for c in search.candidates]
    passing = [c.bits_per_weight for c in search.candidates if c.passed]
    failing = [c.bits_per_weight for c in search.candidates if not c.passed]
    assert passing and failing and len(bits) <= 8 and len(set(bits)) == len(bits)  # no allocation measured twice
    assert min(passing) - max(failing) < 0.6  # the interval shrank around the threshold
    assert min(passing) >= 6.0 > max(failing)


def test_a_parallel_search_measures_rounds_of_n_and_narrows_as_far():
    """--parallel 3: each round measures the model's pick and two more in the widest gaps; with the
    same number of candidates it needs a third of the rounds and ends as close to the threshold."""
    serial = StandIn(many_units(), needed=6.0, scale=2.0, runs=6, limit=0.05)
    serial.budgets()
    wide = StandIn(many_units(), needed=6.0, scale=2.0, runs=6, limit=0.05, parallel=3)
    wide.budgets()
    assert wide.rounds == [3, 3] and len(serial.rounds) == len(serial.candidates) > 2
    for search in (serial, wide):
        bits = [c.bits_per_weight for c in search.candidates]
        assert len(set(bits)) == len(bits)  # no allocation measured twice, within a round or across
        passing = min(c.bits_per_weight for c in search.candidates if c.passed)
        failing = max(c.bits_per_weight for c in search.candidates if not c.passed)
        assert passing >= 6.0 > failing and passing - failing < 0.6
    first = sorted(c.budget_bits for c in wide.candidates[:3])
    cheapest, best = wide.problem.bounds()
    assert cheapest < first[0] < first[1] < first[2] < best  # three budgets spread inside the interval


def test_the_search_stops_at_once_when_the_cheapest_candidate_passes():
    search = StandIn(many_units(), needed=0.0, scale=1.0, runs=5, limit=10.0)
    search.budgets()
    assert len(search.candidates) == 1 and search.candidates[0].passed
    assert search.candidates[0].counts == {"W4A16-G64": 40}


def test_when_even_the_best_allocation_fails_the_search_stops():
    search = StandIn(many_units(), needed=99.0, scale=1.0, runs=5, limit=1e-12)
    search.budgets()
    [only] = search.candidates  # the prediction cannot reach the limit: the best allocation is tried, and fails
    assert only.bits_per_weight == search.problem.bounds()[1] / search.problem.total_params and not only.passed


def candidate(name, size, kld, top1, speed):
    checks = [{"check": "quality/kld_mean", "value": kld, "threshold": "<= 0.1", "passed": kld <= 0.1},
              {"check": "quality/top1_agreement", "value": top1, "threshold": ">= 0.85", "passed": top1 >= 0.85},
              {"check": "speedup/decode_tok_s", "value": speed, "threshold": ">= 1.0", "passed": speed >= 1.0}]
    passed = all(c["passed"] for c in checks)
    quality = all(c["passed"] for c in checks if not _beyond_bits(c["check"]))
    return Candidate(name, name + ".yaml", "sha", 0, 0, 0, 0, {}, run_id=name, status="finished",
                     metrics={"model/size_mb": size, "quality/kld_mean": kld}, checks=checks, passed=passed,
                     quality_passed=quality)


def test_the_answer_is_the_smallest_pass_or_names_each_unmet_check_with_the_closest_value():
    a, b, c = candidate("a", 100, 0.2, 0.80, 1.2), candidate("b", 120, 0.09, 0.86, 1.1), candidate("c", 140, 0.05, 0.9, 1.0)
    best, unmet = answer([a, b, c])
    assert best is b and unmet == []  # the smallest that passes
    slow = [candidate("a", 100, 0.2, 0.80, 0.7), candidate("b", 120, 0.09, 0.84, 0.9), candidate("c", 140, 0.12, 0.83, 0.8)]
    best, unmet = answer(slow)
    # nothing passes; quality passes nowhere either: the fewest failed checks, then the lowest KLD
    assert best.name == "b"
    assert unmet == [{"check": "quality/top1_agreement", "threshold": ">= 0.85", "closest": {"value": 0.84, "run_id": "b", "name": "b"}},
                     {"check": "speedup/decode_tok_s", "threshold": ">= 1.0", "closest": {"value": 0.9, "run_id": "b", "name": "b"}}]
    quality_ok = [candidate("a", 100, 0.2, 0.80, 0.7), candidate("b", 120, 0.09, 0.86, 0.9), candidate("c", 140, 0.05, 0.9, 0.8)]
    best, unmet = answer(quality_ok)
    assert best.name == "b" and [u["check"] for u in unmet] == ["speedup/decode_tok_s"]  # speed: bits cannot buy it


def test_other_templates_make_the_chosen_allocation_and_the_better_one_is_the_answer():
    autoround = type("Loaded", (), {"name": "autoround-w4a16", "recipe": type("R", (), {"quantize": type("Q", (), {"method": "autoround"})})})
    search = StandIn(many_units(), needed=6.0, scale=2.0, runs=4, limit=0.05, alternatives=[autoround])
    search.budgets()
    chosen, _ = answer(search.candidates)
    search.alternatives()
    extra = search.candidates[-1]
    assert search.templates[-1] is autoround and search.templates[:-1] == [None] * (len(search.candidates) - 1)
    assert extra.bits_per_weight == chosen.bits_per_weight  # the same allocation, another method
    assert answer(search.candidates)[0] is extra  # same size, lower KLD
