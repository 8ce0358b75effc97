"""Shipped policies that a lossless candidate passes: the default model against itself, and its
llama.cpp Q8_0, scored on the shipped default suite, pass every quality row of every shipped policy.
(Speed rows are the bench's: the base against itself has no speedup to show, and a speed check
holds through a serving engine on a quiet machine; tests/speed covers them.) A policy that the base
itself or its Q8_0 cannot pass decides nothing: a Q8_0 of the default model (KLD 0.0026, top-1 0.966) failed
`release` on its last-word recovery, whose interval's low end was 0.889 with 154 items."""

from pathlib import Path

import pytest

from quantbench.cli import main
from quantbench.release.gate import load_policy, quality_checks
from quantbench.sources import models
from tests.helpers import last_json

pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.llamacpp]

REPO = Path(__file__).resolve().parents[2]


def test_the_base_and_its_q8_0_pass_every_shipped_policy_s_quality(workdir, monkeypatch, capsys):
    monkeypatch.setenv("QUANTBENCH_RECIPES", str(REPO / "recipes"))
    for sub in ("suites", "policies"):
        (workdir / sub).symlink_to(REPO / sub)
    assert main(["quantize", "gguf-q8_0", "--set", "bench=null", "--json"]) == 0, capsys.readouterr().err
    q8 = last_json(capsys.readouterr().out)["metrics"]
    base = models.resolve("builtin:smollm2-135m-instruct")
    assert main(["evaluate", str(base.path), "--base", "builtin:smollm2-135m-instruct", "--json"]) == 0
    itself = last_json(capsys.readouterr().out)["metrics"]
    assert itself["quality/kld_mean"] == pytest.approx(0, abs=1e-6) and itself["quality/flips_pct"] == 0
    assert q8["quality/kld_mean"] < 0.01  # lossless in practice
    policies = sorted(p.stem for p in (REPO / "policies").glob("*.yaml"))
    assert {"release", "experimental"} <= set(policies)
    for name in policies:
        policy = load_policy(name).policy
        for label, metrics in (("the base against itself", itself), ("gguf-q8_0", q8)):
            failed = [f"{c.check} {c.value} ({c.threshold})" for c in quality_checks(policy, metrics) if not c.passed]
            assert not failed, f"{label} fails policy {name}: {failed}"
