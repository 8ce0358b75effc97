"""The produce step's time, estimated before it starts from forward passes timed here, and held to
the recipe's budget_minutes: said and gone on, or refused with --strict-budget (exit 2, no run)."""

import time

import pytest

from quantbench.cli import main
from quantbench.quantize import estimate
from quantbench.recipe.methods import AutoRoundSpec, AWQSpec, DistillSpec, FP8Spec, GPTQSpec
from tests.helpers import last_json, runs, tiny_recipe, write_recipe


def test_work_grows_with_the_methods_knobs():
    few, many = (estimate.passes(AWQSpec(method="awq", n_grid=n), 16, 30)[0] for n in (5, 20))
    assert many / few == pytest.approx((estimate.AWQ_BASE + 20 * estimate.AWQ_PER_GRID)
                                       / (estimate.AWQ_BASE + 5 * estimate.AWQ_PER_GRID))
    assert estimate.passes(AWQSpec(method="awq"), 32, 30)[0] == 2 * estimate.passes(AWQSpec(method="awq"), 16, 30)[0]
    count, fixed, how = estimate.passes(GPTQSpec(method="gptq"), 8, 30)
    assert count == 8 * estimate.GPTQ_PASSES and fixed == 30 * estimate.GPTQ_SOLVE_S and "30 layers" in how
    # the solve grows with the layers' widths: the 3B ladder rung's 101 M weights a layer took ~27 s
    # each (AVX512-BF16, 2 cores), where 0.5 s a layer at any width had said 14 s for all of them
    wide = estimate.passes(GPTQSpec(method="gptq"), 8, 28, 100.7e6)[1]
    assert wide / 28 == pytest.approx(27, rel=0.05)
    assert wide / 28 > 10 * estimate.passes(GPTQSpec(method="gptq"), 8, 28)[1] / 28  # the default model's widths
    # GPTQModel's formats add its child process's start and save, a fixed cost
    count2, fixed2, how2 = estimate.passes(GPTQSpec(method="gptq", format="gptq"), 8, 30)
    assert count2 == count and fixed2 == fixed + estimate.GPTQMODEL_FIXED_S and "GPTQModel's child process" in how2
    awq = estimate.passes(AWQSpec(method="awq"), 16, 30)
    assert estimate.passes(AWQSpec(method="awq", format="awq"), 16, 30)[1] == awq[1] + estimate.GPTQMODEL_FIXED_S
    assert estimate.passes(DistillSpec(method="distill", steps=10, batch_size=2), 0, 30)[0] == 20 * estimate.DISTILL_PER_STEP
    assert estimate.passes(AutoRoundSpec(method="autoround", iters=50, batch_size=8), 4, 30)[0] == 4 * 3.0 * 50  # 4 windows: a batch of 4
    assert estimate.passes(FP8Spec(method="fp8"), 8, 30) is None  # seconds whatever the data


def test_a_forward_pass_is_timed(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    windows = [[5] * 64, [6] * 64, [7] * 64]
    seconds = estimate.forward_seconds(model, windows)
    assert 0 < seconds < 5
    # another process takes the cores during one timed pass: the estimate scales the fastest pass
    calls = []

    def contend(*_):
        calls.append(1)
        time.sleep(1.0 if len(calls) == 2 else 0)

    hook = model.register_forward_pre_hook(contend)
    contended = estimate.forward_seconds(model, windows + [[8] * 64])
    hook.remove()
    assert len(calls) == 4 and contended < 0.5
    found = estimate.estimate(AWQSpec(method="awq", n_grid=4), model, windows, 2, "float32")
    # scaled from its own timed pass (a second timing of a millisecond pass is noise, not a check)
    assert 0 < found.per_pass_s < 5
    assert found.seconds == pytest.approx(3 * (estimate.AWQ_BASE + 4 * estimate.AWQ_PER_GRID) * found.per_pass_s)
    assert f"forward passes of {found.per_pass_s:.3f} s" in found.basis
    assert "64 tokens, float32" in found.basis
    assert found.over(found.minutes() / 2) and not found.over(found.minutes() * 2) and not found.over(None)


def test_over_budget_is_said_and_the_job_goes_on(workdir, tiny_model_dir, capsys, caplog):
    write_recipe(workdir, "awq", tiny_recipe(tiny_model_dir, "method: awq\ngroup_size: 32\nn_grid: 4\n")
                 + "budget_minutes: 0.00001\n")
    assert main(["quantize", "awq", "--json"]) == 0
    result = last_json(capsys.readouterr().out)
    assert 0 < result["metrics"]["quantize/estimate_s"] < 60
    assert "budget_minutes: the produce step is estimated at" in caplog.text
    assert "--set calibration.samples=N" in caplog.text and "--set quantize.n_grid=N" in caplog.text
    assert "Going on (--strict-budget refuses instead)" in caplog.text
    [run] = runs()
    assert run.info.status == "FINISHED" and run.data.metrics["quantize/estimate_s"] == result["metrics"]["quantize/estimate_s"]


def test_strict_budget_refuses_before_any_run(workdir, tiny_model_dir, capsys):
    write_recipe(workdir, "awq", tiny_recipe(tiny_model_dir, "method: awq\ngroup_size: 32\nn_grid: 4\n")
                 + "budget_minutes: 0.00001\n")
    assert main(["quantize", "awq", "--strict-budget"]) == 2
    err = capsys.readouterr().err
    assert "recipes/awq.yaml: budget_minutes: the produce step is estimated at" in err
    assert "over the recipe's budget of 1e-05 min" in err and "Refused: --strict-budget." in err
    assert runs() == [] and not (workdir / "outputs" / "awq").exists()
    # within budget, strict or not, the job runs
    assert main(["quantize", "awq", "--strict-budget", "--set", "budget_minutes=30"]) == 0
