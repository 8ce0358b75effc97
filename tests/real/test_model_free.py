"""Real tier: model-free quantization of the embedded default model writes the loaded path's
checkpoint bit for bit (FP8_DYNAMIC, and NVFP4A16, whose q/k/v and gate/up share a global scale).
The loaded path computes in bfloat16 here, the saved dtype, on any CPU: where `compute_dtype: auto`
picks float32 (an AVX2-only CPU) its scales are computed in float32 and cast when saving, and some
differ in their last bit (docs/recipes.md)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from quantbench.cli import main
from tests.helpers import write_recipe

pytestmark = pytest.mark.real

CHEAP = ["--set", "evaluate=null", "--set", "bench=null", "--set", "check.ppl_tokens=512", "--set", "check.window=256"]


def tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    found = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            found.update({name: f.get_tensor(name) for name in f.keys()})
    return found


@pytest.mark.parametrize("quantize", ["method: fp8\n  scheme: FP8_DYNAMIC", "method: rtn\n  scheme: NVFP4A16"])
def test_model_free_is_the_loaded_path_bit_for_bit_on_the_default_model(quantize, workdir, capsys):
    body = f"model:\n  source: builtin:smollm2-135m-instruct\n  dtype: bfloat16\n  compute_dtype: bfloat16\nquantize:\n  {quantize}\n"
    written = {}
    for name, model_free in (("loaded", "false"), ("free", "true")):
        write_recipe(workdir, name, body)
        code = main(["quantize", name, "--json", "--set", f"quantize.model_free={model_free}", *CHEAP])
        out, err = capsys.readouterr()
        assert code == 0, err[-3000:]
        written[name] = json.loads(out.strip().splitlines()[-1])
    ours, theirs = (tensors(Path(written[n]["checkpoint"])) for n in ("free", "loaded"))
    assert sorted(ours) == sorted(theirs) and len(ours) > 400
    assert not [n for n in ours if ours[n].dtype != theirs[n].dtype or not torch.equal(ours[n], theirs[n])]
    assert written["free"]["metrics"]["check/reload_ppl"] == written["loaded"]["metrics"]["check/reload_ppl"]
