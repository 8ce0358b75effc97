"""Real tier: the shipped floating-point recipes on the embedded default model, quantized with a
trimmed calibration budget and scored with the cpu-smoke suite in one store (the base scored once):
each is the format it says, stores the bits its scheme says, and its quality against the base is
ordered as its precision is (FP8 blocks before FP4 weights and activations). GPTQ into NVFP4 and the MX
formats are scored in bench/formats.py and on the tiny model (tests/quantize/test_formats.py): the
real tier keeps to the two that cost least, for CI's time."""

import json
import shutil
from pathlib import Path

import pytest

from quantbench.cli import main
from quantbench.recipe import schemes
from tests.helpers import runs

pytestmark = pytest.mark.real
REPO = Path(__file__).resolve().parents[2]
TRIM = ["calibration.samples=4", "calibration.seq_len=256"]
RECIPES = {  # recipe -> (format written, the scheme it stores, overrides, the reload check's ppl ratio under)
    "fp8-block": ("float-quantized", schemes.fp8_block(64), [], 1.1),
    "nvfp4": ("nvfp4-pack-quantized", schemes.SCHEMES["NVFP4"], TRIM, 2.0),  # W4A4: measured 1.51
}


def test_the_floating_point_recipes_are_scored_on_a_cpu_in_order_of_their_precision(workdir, capsys):
    shutil.copytree(REPO / "suites", workdir / "suites", dirs_exist_ok=True)
    kld = {}
    for recipe, (stored_as, scheme, overrides, most) in RECIPES.items():
        shutil.copy(REPO / "recipes" / f"{recipe}.yaml", workdir / "recipes")
        args = ["quantize", recipe, "--json", "--set", "check.ppl_tokens=2048", "--set", "evaluate.suite=cpu-smoke"]
        code = main(args + [x for item in overrides for x in ("--set", item)])
        out, err = capsys.readouterr()
        assert code == 0, err[-3000:]
        result = json.loads(out.strip().splitlines()[-1])
        config = json.loads((Path(result["checkpoint"]) / "config.json").read_text())["quantization_config"]
        assert config["format"] == stored_as
        m = result["metrics"]
        # the default model's layers: 576 x 576 (q, o), 192 x 576 (k, v), 1536 x 576 (gate, up), 576 x 1536
        shapes = [(576, 576)] * 2 + [(576, 192)] * 2 + [(576, 1536)] * 2 + [(1536, 576)]
        predicted = sum(scheme.bits(i, o) * i * o for i, o in shapes) / sum(i * o for i, o in shapes)
        assert m["model/bits_per_weight"] == pytest.approx(predicted, rel=1e-6), recipe
        assert m["check/ppl_ratio"] < most, (recipe, m["check/ppl_ratio"])
        assert m["quality/kld_mean.ci_low"] <= m["quality/kld_mean"] <= m["quality/kld_mean.ci_high"]
        kld[recipe] = m["quality/kld_mean"]
    assert kld["fp8-block"] < kld["nvfp4"], kld
    assert kld["fp8-block"] < 0.05, kld  # 8-bit floats in blocks of 64: 0.023 with the full budget
    roles = sorted(r.data.tags["quantbench.role"] for r in runs())
    assert roles == ["baseline", "candidate", "candidate"]  # the base scored once
