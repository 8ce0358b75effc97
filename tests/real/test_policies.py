"""Shipped policies that a lossless candidate passes: the default model's llama.cpp Q8_0, scored on
the shipped default suite, passes every quality row of every shipped policy. (The base against
itself passes them by construction: every quality row is relative to the base, and its comparisons
agree to float32 rounding, as tests/quality/test_stage.py checks on the tiny model; scoring it here took a third
full pass of the default suite, ~200 s at the end of `make test`.)
(Speed rows are the bench's: the base against itself has no speedup to show, and a speed check
holds through a serving engine on a quiet machine; tests/speed covers them.) A policy that the base
itself or its Q8_0 cannot pass decides nothing: a Q8_0 of the default model (KLD 0.0026, top-1 0.966) failed
`release` on its last-word recovery, whose interval's low end was 0.889 with 154 items."""

from pathlib import Path

import pytest

from quantbench.cli import main
from quantbench.release.gate import load_policy, quality_checks
from tests.helpers import last_json

pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.llamacpp]

REPO = Path(__file__).resolve().parents[2]


def test_the_default_model_s_q8_0_passes_every_shipped_policy_s_quality(workdir, monkeypatch, capsys):
    monkeypatch.setenv("QUANTBENCH_RECIPES", str(REPO / "recipes"))
    for sub in ("suites", "policies"):
        (workdir / sub).symlink_to(REPO / sub)
    assert main(["quantize", "gguf-q8_0", "--set", "bench=null", "--json"]) == 0, capsys.readouterr().err
    q8 = last_json(capsys.readouterr().out)["metrics"]
    assert q8["quality/kld_mean"] < 0.01  # lossless in practice
    policies = sorted(p.stem for p in (REPO / "policies").glob("*.yaml"))
    assert {"release", "experimental"} <= set(policies)
    for name in policies:
        policy = load_policy(name).policy
        checks = quality_checks(policy, q8)
        assert checks, f"policy {name} has no quality rows"
        failed = [f"{c.check} {c.value} ({c.threshold})" for c in checks if not c.passed]
        assert not failed, f"gguf-q8_0 fails policy {name}: {failed}"
