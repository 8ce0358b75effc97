"""Model-free quantization (`quantize.model_free: true`, quantize/model_free.py) on the tiny model:
the same checkpoint as the loaded-model path, tensor for tensor and bit for bit, for every data-free
scheme it takes; read one decoder layer at a time whatever the files hold; and refused, naming the
field, where it cannot apply (a scheme that calibrates, a KV cache's scales, a mixture of experts,
a base that is not safetensors)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from quantbench.cli import main
from quantbench.sources.checkpoint import load_model
from tests.helpers import last_json, tiny_recipe, write_recipe

SCHEMES = {
    "w4a16": "method: rtn\nscheme: W4A16\ngroup_size: 32\n",
    "w8a16-mixed": "method: rtn\nscheme: W8A16\ngroup_size: null\nlayers:\n  W4A16-G32: ['re:.*mlp\\.down_proj$']\n  BF16: [model.layers.0.self_attn.o_proj]\n",
    "nvfp4a16": "method: rtn\nscheme: NVFP4A16\n",
    "mxfp4a16": "method: rtn\nscheme: MXFP4A16\n",
    "w4afp8": "method: rtn\nscheme: W4AFP8\ngroup_size: 32\n",
    "fp8-dynamic": "method: fp8\n",
    "fp8-block": "method: fp8\nscheme: FP8_BLOCK\nblock_size: 32\n",
}


def tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    found = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            found.update({name: f.get_tensor(name) for name in f.keys()})
    return found


def groups(quantization_config: dict) -> list:
    """Its config groups as what a loader reads (targets, format, weights' and activations' args),
    whatever the groups are called and in whichever order (the loaded path's save renames them);
    the observer that rounded the weights is not read by a loader."""
    found = []
    for group in quantization_config["config_groups"].values():
        weights = {k: v for k, v in group["weights"].items() if k != "observer"}
        found.append(json.dumps([group["targets"], group["format"], weights, group["input_activations"]], sort_keys=True))
    return sorted(found)


def quantize(workdir, capsys, name: str, recipe: str) -> dict:
    write_recipe(workdir, name, recipe)
    assert main(["quantize", name, "--json"]) == 0, capsys.readouterr().err[-3000:]
    return last_json(capsys.readouterr().out)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_model_free_writes_the_loaded_path_s_checkpoint_bit_for_bit(scheme, workdir, tiny_model_dir, capsys):
    loaded = quantize(workdir, capsys, "loaded", tiny_recipe(tiny_model_dir, SCHEMES[scheme]))
    free = quantize(workdir, capsys, "free", tiny_recipe(tiny_model_dir, SCHEMES[scheme] + "model_free: true\n"))
    ours, theirs = tensors(Path(free["checkpoint"])), tensors(Path(loaded["checkpoint"]))
    assert sorted(ours) == sorted(theirs)
    different = [n for n in ours if ours[n].dtype != theirs[n].dtype or not torch.equal(ours[n], theirs[n])]
    assert not different, different
    configs = [json.loads((Path(r["checkpoint"]) / "config.json").read_text()) for r in (free, loaded)]
    (q_free, q_loaded) = (c["quantization_config"] for c in configs)
    assert q_free["format"] == q_loaded["format"] and set(q_free["ignore"]) == set(q_loaded["ignore"])
    assert groups(q_free) == groups(q_loaded)
    assert configs[0]["dtype"] == configs[1]["dtype"] == "float32"
    # it reloads and computes as the loaded path's checkpoint does
    assert free["metrics"]["check/reload_ppl"] == pytest.approx(loaded["metrics"]["check/reload_ppl"], rel=1e-6)
    model = load_model(Path(free["checkpoint"]), dtype="float32")
    assert model.dtype == torch.float32


def test_files_are_read_one_layer_at_a_time_whatever_their_shards_hold(tmp_path, tiny_model_dir):
    """A base whose files split a layer (q_proj in one file, k_proj and v_proj in another: NVFP4's
    fused global scale needs all three) gives the same tensors as its single file; the most read at
    once is one decoder layer (or the embeddings), and output shards are cut at `shard_bytes`,
    with transformers' names and index."""
    import shutil

    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from quantbench.quantize import model_free, recipe_layers

    whole = tensors(tiny_model_dir)
    split = tmp_path / "split"
    split.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(tiny_model_dir / name, split / name)
    first = {n: t for n, t in whole.items() if n.endswith("q_proj.weight") or "layers." not in n}
    files = {"a.safetensors": first, "b.safetensors": {n: t for n, t in whole.items() if n not in first}}
    for file, part in files.items():
        save_file(part, str(split / file))
    index = {n: file for file, part in files.items() for n in part}
    (split / model_free.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": index}))

    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("NVFP4A16", ["Linear"])}, ignore=["lm_head"])
    selected = {n for n, _, _ in recipe_layers(AutoConfig.from_pretrained(tiny_model_dir), ["lm_head"])}
    outs = {}
    for label, source, shard in (("whole", tiny_model_dir, model_free.SHARD_BYTES), ("split", split, 100_000)):
        dest = tmp_path / f"out-{label}"
        dest.mkdir()
        written = model_free.quantize_files(source, dest, config, selected, torch.float32, shard_bytes=shard)
        outs[label] = (dest, written)
    (whole_dest, whole_written), (split_dest, split_written) = outs["whole"], outs["split"]
    a, b = tensors(whole_dest), tensors(split_dest)
    assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)
    assert whole_written.shards == 1 and (whole_dest / "model.safetensors").is_file()
    assert split_written.shards > 2 and not (split_dest / "model.safetensors").exists()
    shards = sorted(p.name for p in split_dest.glob("*.safetensors"))
    assert shards == [f"model-{i:05d}-of-{split_written.shards:05d}.safetensors" for i in range(1, split_written.shards + 1)]
    weight_map = json.loads((split_dest / model_free.INDEX).read_text())["weight_map"]
    assert sorted(weight_map) == sorted(b) and set(weight_map.values()) == set(shards)
    assert whole_written.quantized == split_written.quantized == len(selected) == 14  # 7 Linear layers x 2 layers
    layer = sum(t.numel() for n, t in whole.items() if n.startswith("model.layers.0.")) * 4
    embeddings = whole["model.embed_tokens.weight"].numel() * 4
    assert whole_written.largest_group_bytes == split_written.largest_group_bytes == max(layer, embeddings)
    assert model_free.layer_groups(index)[0] == {"a.safetensors": ["model.embed_tokens.weight"]}


def test_the_plan_of_a_model_free_job_holds_a_layer_not_the_model(workdir, tiny_model_dir):
    """An 8B shape's produce stage, planned from its config: the loaded path holds the whole model
    (in place); model-free, the largest group read at once (a 0.41 GiB decoder layer: the ladder's
    49,152-token embeddings are 0.38 GiB) with its rounding, and an output shard."""
    from quantbench.jobs import footprint
    from quantbench.quantize import model_free, quantizer_class
    from quantbench.recipe import load_recipe
    from quantbench.sources import ladder
    from quantbench.sources.shapes import Shape

    shape = Shape.from_config(ladder._config(ladder.RUNGS["llama-3.1-8b"]))
    planned = {}
    for name, extra in (("loaded", ""), ("free", "model_free: true\n")):
        path = write_recipe(workdir, name, tiny_recipe(tiny_model_dir, "method: fp8\n" + extra).replace("float32", "bfloat16"))
        loaded = load_recipe(path)
        quantizer = quantizer_class("fp8")(loaded.recipe.quantize)
        planned[name] = quantizer.footprint(shape, loaded, "bfloat16")
    assert planned["loaded"].takes_model and not planned["free"].takes_model
    largest = max(shape.layer_params, shape.vocab * shape.hidden) * 2
    assert largest == shape.layer_params * 2 == 436_224_000
    held = dict(planned["free"].held)
    rounding = held["the largest group of tensors read at once, and its rounding"]
    assert rounding == int(largest * model_free.ROUNDING_COPIES["other"])
    assert sum(held.values()) < 4 * 2**30
    assert planned["free"].checkpoint == planned["loaded"].checkpoint
    # measured on the 8B rung (bench/model_free.py, docs/results.md): FP8_DYNAMIC 2.25 GiB, NVFP4A16 3.68,
    # the job's runtime (footprint.RUNTIME) included; the plan within 5 % of each
    nvfp4 = quantizer_class("rtn")(load_recipe(write_recipe(workdir, "nv", tiny_recipe(
        tiny_model_dir, "method: rtn\nscheme: NVFP4A16\nmodel_free: true\n").replace("float32", "bfloat16"))).recipe.quantize)
    for quantizer, measured in ((quantizer_class("fp8")(loaded.recipe.quantize), 2.245), (nvfp4, 3.678)):
        plan = quantizer.footprint(shape, loaded, "bfloat16")
        planned_gib = (footprint.RUNTIME + sum(dict(plan.held).values())) / 2**30
        assert planned_gib == pytest.approx(measured, rel=0.05), (quantizer.scheme.name, planned_gib)


@pytest.mark.parametrize(
    ("quantize_section", "said"),
    [
        ("method: rtn\nscheme: NVFP4\nmodel_free: true\n", "model_free: NVFP4 calibrates its activations' scales on data"),
        ("method: fp8\nkv_cache: fp8\nmodel_free: true\n", "model_free: the FP8 KV cache's scales are calibrated on data"),
        ("method: gptq\ngroup_size: 32\nmodel_free: true\n", "model_free"),
    ],
)
def test_what_model_free_cannot_do_is_refused_naming_the_field(quantize_section, said, workdir, tiny_model_dir, capsys):
    write_recipe(workdir, "r", tiny_recipe(tiny_model_dir, quantize_section))
    assert main(["quantize", "r"]) == 2
    err = capsys.readouterr().err
    assert "recipes/r.yaml" in err and said in err, err
    assert not (workdir / "outputs").exists()


def test_a_mixture_of_experts_is_refused_model_free(workdir, tmp_path, tiny_tokenizer, capsys):
    from tests.quantize.test_moe import build_moe

    moe = build_moe(tmp_path / "moe", tiny_tokenizer)
    write_recipe(workdir, "r", tiny_recipe(moe, "method: fp8\nmodel_free: true\nignore: [lm_head, 're:.*mlp.gate$']\n"))
    assert main(["validate", "recipes/r.yaml"]) == 2
    assert "quantize.model_free: " in capsys.readouterr().err


def test_a_data_free_job_that_cannot_fit_is_told_of_model_free(workdir, tiny_model_dir, capsys, monkeypatch):
    from quantbench.jobs import footprint

    monkeypatch.setenv(footprint.MEMORY_VAR, "0.2")
    write_recipe(workdir, "fp8", tiny_recipe(tiny_model_dir, "method: fp8\n"))
    assert main(["quantize", "fp8"]) == 2
    err = capsys.readouterr().err
    assert "the produce stage needs about" in err and "--set quantize.model_free=true" in err, err
