"""Real tier: the shipped floating-point recipes on the embedded default model, quantized with a
trimmed calibration budget and scored with the cpu-smoke suite in one store (the base scored once):
each is the format it says, stores the bits its scheme says, and its quality against the base is
ordered as its precision is (FP8 blocks before FP4 weights and activations). The other new schemes
(MXFP8, NVFP4A16, MXFP4A16, W4AFP8) are scored rounded to nearest with a suite of KLD alone, for CI's
time; the shipped GPTQ and AWQ recipes in those schemes are scored in bench/formats.py."""

import json
import shutil
from pathlib import Path

import pytest

from quantbench.cli import main
from quantbench.recipe import schemes
from tests.helpers import runs, write_recipe

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


# scheme -> (group size given in the recipe, the reload check's ppl ratio under). The float formats fix
# their own group size; 128 does not divide 576. Measured (KLD, ppl ratio): MXFP8 0.040, 1.03; NVFP4A16
# 0.250, 1.28; MXFP4A16 0.576, 1.43; W4AFP8 0.529, 1.41 (rounded to nearest: GPTQ halves the 4-bit ones)
ROUNDED = {"MXFP8": (None, 1.1), "NVFP4A16": (None, 1.6), "MXFP4A16": (None, 1.6), "W4AFP8": (64, 1.6)}
TINY_SUITE = """\
description: the formats check of tests/real/test_formats.py, KLD on 12 windows of 128 tokens and no tasks
tokens: 1536
window: 128
ood_text: null
tasks: []
"""


def test_every_new_scheme_reloads_and_is_scored_on_the_real_model(workdir, capsys):
    """The schemes the recipes above leave to bench/formats.py, each rounded to nearest (seconds, no
    calibration) on the default model and scored against its base in a suite of KLD alone: each
    stores its format and bits, reloads within a perplexity bound, and the 8-bit format scores
    closest to the base, NVFP4's FP8 scales per 16 closer than MXFP4's powers of two per 32."""
    (workdir / "suites").mkdir(exist_ok=True)
    (workdir / "suites" / "formats-tiny.yaml").write_text(TINY_SUITE)
    kld = {}
    for name, (group, most) in ROUNDED.items():
        group_line = f"  group_size: {group}\n" if group else ""
        write_recipe(workdir, f"rtn-{name.lower()}", "model: {source: builtin:smollm2-135m-instruct, dtype: bfloat16}\n"
                     f"quantize:\n  method: rtn\n  scheme: {name}\n{group_line}  ignore: [lm_head]\n"
                     "evaluate: {suite: formats-tiny}\n")  # fmt: skip
        code = main(["quantize", f"rtn-{name.lower()}", "--json", "--set", "check.ppl_tokens=1024"])
        out, err = capsys.readouterr()
        assert code == 0, err[-3000:]
        result = json.loads(out.strip().splitlines()[-1])
        scheme = schemes.from_recipe(name, group)
        config = json.loads((Path(result["checkpoint"]) / "config.json").read_text())["quantization_config"]
        assert config["format"] == scheme.stored_as, name
        m = result["metrics"]
        shapes = [(576, 576)] * 2 + [(576, 192)] * 2 + [(576, 1536)] * 2 + [(1536, 576)]
        predicted = sum(scheme.bits(i, o) * i * o for i, o in shapes) / sum(i * o for i, o in shapes)
        assert m["model/bits_per_weight"] == pytest.approx(predicted, rel=1e-6), name
        assert m["check/ppl_ratio"] < most, (name, m["check/ppl_ratio"])
        assert m["quality/kld_mean.ci_low"] <= m["quality/kld_mean"] <= m["quality/kld_mean.ci_high"]
        kld[name] = (m["quality/kld_mean.ci_low"], m["quality/kld_mean"], m["quality/kld_mean.ci_high"])
    assert kld["MXFP8"][2] < min(low for name, (low, _, _) in kld.items() if name != "MXFP8"), kld
    assert kld["NVFP4A16"][1] < kld["MXFP4A16"][1], kld
    roles = sorted(r.data.tags["quantbench.role"] for r in runs())
    assert roles == ["baseline"] + ["candidate"] * len(ROUNDED)  # the base scored once
