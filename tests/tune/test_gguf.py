"""`quantbench tune --engine llamacpp`: llama.cpp tensor types chosen per tensor. Bad input refused
before anything runs; the patterns a candidate recipe gives llama-quantize select exactly their
tensors; and (slow: the real llama.cpp) a tune on a tiny GGUF whose candidate file holds, tensor for
tensor, the types the allocation chose, at the size and bits it predicted, each weight rounded as
the sensitivity rounded it; K- and I-quants (which only llama-quantize writes) read back from its
file in the transformers layer's row order."""

import collections
import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from quantbench.cli import main
from quantbench.tune import gguf as gguf_tune
from tests import gguf_files as gg
from tests.conftest import TINY_SUITE
from tests.helpers import last_json, runs, tiny_recipe, write_recipe


@pytest.fixture
def setup(workdir, tmp_path_factory):
    """A tiny llama-architecture GGUF as the base, a gguf template recipe on it, the tiny suite and
    a `loose` policy (quantize and evaluate, any KLD below 1)."""
    tiny = gg.write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", gg.gpt2_bpe_vocab(400, add_bos=False),
                              heads=2, kv_heads=1)
    (workdir / "suites").mkdir()
    (workdir / "suites" / "tiny.yaml").write_text(TINY_SUITE)
    recipe = tiny_recipe(tiny, "method: gguf\ntype: Q4_0\n").replace("check:\n", "check:\n  base_ppl_bound: false\n")
    write_recipe(workdir, "tiny-g", recipe + "evaluate:\n  suite: tiny\n")
    (workdir / "policies").mkdir()
    (workdir / "policies" / "loose.yaml").write_text(yaml.safe_dump({
        "stages": ["quantize", "evaluate"], "max": {"quality/kld_mean": 1.0}, "registry": {"model": "tiny-{recipe}"}}))
    return workdir


@pytest.mark.parametrize("args, message", [
    (["--engine", "llamacpp", "--schemes", "Q4_K"], "--schemes: no scheme of Q4_K fits 14 layer(s) of "),
    (["--engine", "llamacpp", "--schemes", "Q4_K"], "(input widths 64, 128, e.g. model.layers.0.self_attn.q_proj; Q4_K "
                                                     "needs a multiple of 256). Add one that fits: Q4_0 ... Q8_0, IQ4_NL"),
    (["--engine", "llamacpp", "--schemes", "BF16"], "--schemes: a tune does not choose BF16 per tensor"),
    (["--engine", "llamacpp", "--schemes", "Q4_O"], "--schemes: unknown llama.cpp type 'Q4_O' for a tune. Did you mean"),
    (["--engine", "vllm"], "--engine vllm: --from tiny-g is a gguf recipe; a vLLM tune needs a compressed-tensors"),
    (["--engine", "llamacpp", "--from", "tiny-rtn"], "--engine llamacpp: --from tiny-rtn is a rtn recipe"),
    (["--from", "tiny-g", "tiny-rtn"], "--from tiny-rtn: every template must name the same model"),
    (["--schemes", "W4A16-G64"], "--schemes: unknown llama.cpp type 'W4A16-G64'"),
])
def test_bad_input_exits_2_before_anything_runs(args, message, setup, tiny_model_dir, capsys):
    write_recipe(setup, "tiny-rtn", tiny_recipe(tiny_model_dir, "method: rtn\n"))
    argv = ["tune", "--policy", "loose", *args]
    assert main(argv if "--from" in args else [*argv, "--from", "tiny-g"]) == 2
    assert message in capsys.readouterr().err
    assert runs() == [] and not (setup / "outputs").exists()


def test_each_tune_type_stores_what_llama_cpp_stores_and_fits_only_its_blocks():
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from quantbench.recipe import schemes

    for name, scheme in schemes.GGUF_TUNE_TYPES.items():
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
        assert (scheme.block, scheme.bytes_per_block) == (block, size), name
        assert scheme.bits(1536, 576) == pytest.approx(8 * size / block)
        # rows of 576 (most of the default model's tensors) take blocks of 32 only; 1,536 every type
        assert scheme.fits(576) == (block in (1, 32)) and scheme.fits(1536), name
        # gguf-py quantizes the legacy types in-process; the K- and I-quants come from llama-quantize
        assert scheme.by_engine == (name.startswith("IQ") or name.endswith("_K")), name
    assert {"IQ4_NL", "IQ4_XS", "Q4_K", "Q5_K", "Q6_K"} <= set(schemes.DEFAULT_GGUF_TUNE_TYPES)
    assert not {"Q2_K", "Q3_K", "MXFP4"} & set(schemes.DEFAULT_GGUF_TUNE_TYPES)  # MXFP4: by name only


def test_patterns_select_exactly_their_tensors():
    names = [f"blk.{b}.{k}" for b in range(12) for k in ("attn_q", "attn_k", "attn_output", "ffn_down")]
    chosen = ["blk.1.attn_q", "blk.1.attn_k", "blk.10.attn_q", "blk.10.attn_k", "blk.2.attn_output", "blk.11.ffn_down"]
    found = patterns = gguf_tune.patterns(chosen)
    assert len(patterns) == 3  # q and k taken in the same blocks share one pattern
    # llama-quantize lower-cases a pattern and searches each tensor's full name with it
    found = {n for n in names for p in patterns if re.search(p.lower(), n + ".weight")}
    assert found == set(chosen)  # blk.1 is not blk.10 or blk.11; attn_output is not output
    pinned = [n for n in ("token_embd.weight", "output.weight", "blk.0.attn_output.weight")
              if any(re.search(p, n) for p in gguf_tune.PINNED)]
    assert pinned == ["token_embd.weight", "output.weight"]


def _wide_model(tmp_path: Path, seed: int = 0):
    """A tiny llama GGUF with rows of 256 (q, k, v, o, gate, up) and 512 (down), so every type
    fits somewhere: (the resolved model, its Linear layers by name, their GGUF tensor names)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantbench.sources import models

    tiny = gg.write_tiny_gguf(tmp_path / f"wide-{seed}.gguf", gg.gpt2_bpe_vocab(300, add_bos=False), layers=1,
                              hidden=256, heads=4, kv_heads=2, ffn=512, seed=seed)
    base = models.resolve(str(tiny))
    model = AutoModelForCausalLM.from_pretrained(base.path, dtype=torch.float32)
    modules = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    return base, modules, gguf_tune.tensor_names(AutoConfig.from_pretrained(base.path), list(modules))


@pytest.mark.llamacpp
def test_k_and_i_quants_are_read_back_from_llama_quantize_in_the_layers_row_order(tmp_path):
    from quantbench.core.errors import UserError
    from quantbench.engines import llamacpp
    from quantbench.engines import llamacpp_build as build
    from quantbench.recipe import schemes

    tools = build.ensure("the test")
    base, modules, names = _wide_model(tmp_path)
    rounding = gguf_tune.EngineRounding(tools, llamacpp.base_gguf(base.path, tools), names, tmp_path, tmp_path / "log")

    def error(layer: str, kind: str) -> float:
        w = modules[layer].weight.data
        scheme = schemes.GGUF_TUNE_TYPES[kind]
        assert rounding.rounds(scheme) == scheme.by_engine  # no importance matrix: the legacy types in-process
        q = rounding(layer, w, kind) if scheme.by_engine else scheme.fake_quantize(w)
        assert q.shape == w.shape and q.dtype == w.dtype
        return float(((q - w) ** 2).sum() / (w**2).sum())

    for layer in ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj", "model.layers.0.mlp.down_proj"):
        errors = {kind: error(layer, kind) for kind in ("Q4_0", "IQ4_NL", "IQ4_XS", "Q4_K", "Q5_K", "Q6_K", "Q8_0")}
        # each row where the layer has it (a row out of place would err by about twice the weight itself),
        # and the types ordered as their bits and grids order them
        assert max(errors.values()) < 0.02, (layer, errors)
        assert errors["Q6_K"] < errors["Q5_K"] < errors["Q4_K"] < errors["Q4_0"], (layer, errors)
        assert errors["IQ4_NL"] < errors["Q4_0"] and errors["Q8_0"] < errors["Q6_K"], (layer, errors)
    # the converter permutes q's rows for llama.cpp's rotary layout, and leaves v's alone
    assert rounding.orders["model.layers.0.self_attn.q_proj"] is not None
    assert rounding.orders["model.layers.0.self_attn.v_proj"] is None
    # a GGUF of another model: refused, naming the tensor
    other, _, _ = _wide_model(tmp_path, seed=7)
    (tmp_path / "other").mkdir()
    stranger = gguf_tune.EngineRounding(tools, llamacpp.base_gguf(other.path, tools), names, tmp_path / "other",
                                        tmp_path / "log")
    with pytest.raises(UserError, match="tensor blk.0.attn_q does not hold the rows of model.layers.0.self_attn.q_proj"):
        stranger("model.layers.0.self_attn.q_proj", modules["model.layers.0.self_attn.q_proj"].weight.data, "Q4_K")


@pytest.mark.llamacpp
def test_with_an_importance_matrix_every_type_is_rounded_by_llama_quantize_weighing_by_it(tmp_path):
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    from quantbench.engines import llamacpp
    from quantbench.engines import llamacpp_build as build
    from quantbench.recipe import schemes

    tools = build.ensure("the test")
    base, modules, names = _wide_model(tmp_path)
    base_file = llamacpp.base_gguf(base.path, tools)
    rng = np.random.default_rng(0)
    windows = [rng.integers(0, 300, 64).tolist() for _ in range(4)]
    computed = []

    def compute() -> Path:
        computed.append(1)
        tokenizer = AutoTokenizer.from_pretrained(base.path)
        return llamacpp.imatrix(tools, base_file, tokenizer, windows, 64, tmp_path / "im", tmp_path / "log")

    rounding = gguf_tune.EngineRounding(tools, base_file, names, tmp_path, tmp_path / "log", ("four windows", compute))
    (tmp_path / "plain").mkdir()
    plain = gguf_tune.EngineRounding(tools, base_file, names, tmp_path / "plain", tmp_path / "log")
    assert "imatrix four windows" in rounding.key and computed == []  # computed when first needed, not before
    assert rounding.rounds(schemes.GGUF_TUNE_TYPES["Q4_0"]) and not rounding.rounds(schemes.GGUF_TUNE_TYPES["F16"])
    for layer in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"):
        w = modules[layer].weight.data
        for kind in ("Q4_0", "Q5_0", "IQ4_NL", "Q4_K"):
            weighed = rounding(layer, w, kind)
            without = plain(layer, w, kind)  # llama-quantize's own rounding of the same F16 file, unweighed
            matrix = {t.name: np.asarray(t.data) for t in GGUFReader(tmp_path / "im" / "imatrix.gguf").tensors}
            importance = matrix[f"{names[layer]}.weight.in_sum2"].reshape(1, -1)  # per input column

            def cost(q):
                return float((importance * (q - w).numpy() ** 2).sum())

            # the matrix moves the rounding toward the columns that matter, each row in its place
            assert cost(weighed) < cost(without), (layer, kind)
            assert float(((weighed - w) ** 2).sum() / (w**2).sum()) < 0.02, (layer, kind)
    assert computed == [1]  # once for every type


@pytest.mark.llamacpp
def test_a_layers_type_a_tensor_cannot_hold_is_refused_by_name_unless_the_recipe_lets_it_fall_back(setup, capsys):
    from quantbench.sources.checkpoint import gguf_tensors

    source = yaml.safe_load((setup / "recipes" / "tiny-g.yaml").read_text())["model"]["source"]
    body = "method: gguf\ntype: Q4_0\nlayers:\n  Q8_0: [ffn_down]\n  Q4_K: [attn_q, ffn_down]\n"
    recipe = tiny_recipe(source, body).replace("check:\n", "check:\n  base_ppl_bound: false\n")
    write_recipe(setup, "tiny-k", recipe)
    assert main(["quantize", "tiny-k"]) == 2
    err = capsys.readouterr().err
    # rows of 64 (the tiny model's width) in blocks of 256; ffn_down matched Q8_0 first, as llama-quantize takes it
    assert ("quantize.layers (line 11): 2 tensor(s) cannot hold the type given them: blk.0.attn_q.weight (rows of 64) in Q4_K "
            "(blocks of 256); blk.1.attn_q.weight (rows of 64) in Q4_K (blocks of 256). llama-quantize would") in err
    assert "quantize.fallback: true" in err and runs() == []
    write_recipe(setup, "tiny-k", recipe.replace("  layers:\n", "  fallback: true\n  layers:\n"))
    assert main(["quantize", "tiny-k", "--json"]) == 0, capsys.readouterr().err[-2000:]
    written = dict((name, kind) for name, kind, _, _ in gguf_tensors(Path(last_json(capsys.readouterr().out)["checkpoint"])
                                                                      / "model.gguf"))
    assert written["blk.0.ffn_down.weight"] == "Q8_0"
    # llama-quantize chose another quantized type for it (Q5_0, its fallback for Q4_K)
    assert written["blk.0.attn_q.weight"] not in ("Q4_K", "F16", "F32")


@pytest.mark.slow  # the real llama.cpp (built on first use), a whole tune with a child job
@pytest.mark.llamacpp
def test_a_gguf_tune_writes_the_types_it_chose_at_the_size_it_predicted(setup, capsys):
    from gguf import GGMLQuantizationType, GGUFReader, quants

    from quantbench.engines import llamacpp
    from quantbench.recipe import schemes
    from quantbench.sources import models

    assert main(["tune", "--policy", "loose", "--from", "tiny-g", "--bits", "6", "--budget-runs", "1",
                 "--sensitivity-windows", "2", "--json"]) == 0
    summary = last_json(capsys.readouterr().out)
    [cand] = summary["candidates"]
    assert cand["status"] == "finished" and summary["passed"]
    # a unit per tensor (llama.cpp does not fuse q/k/v): 7 per block, 2 blocks
    [sens] = [r for r in runs() if r.data.tags.get("quantbench.role") == "sensitivity"]
    assert sens.data.metrics["sensitivity/units"] == 14
    assert sum(cand["counts"].values()) == 14 and len(cand["counts"]) > 1  # a mix, not one type
    recipe = yaml.safe_load(Path(cand["recipe"]).read_text())["quantize"]
    # the recipe's type: its most common quantized type (a tie goes to the first by name)
    assert recipe["method"] == "gguf"
    assert recipe["type"] == max(sorted(k for k in cand["counts"] if k != "F16"), key=cand["counts"].get), cand["counts"]
    [run] = [r for r in runs() if r.info.run_id == cand["run_id"]]
    checkpoint = next(Path("outputs").glob(f"tiny-g-mixed-*/{run.info.run_id}"))
    reader = GGUFReader(checkpoint / "model.gguf")
    written = {t.name: t for t in reader.tensors}
    blocks = {n: t for n, t in written.items() if n.startswith("blk.") and len(t.shape) == 2}
    # the file holds the allocation: its types, counted tensor by tensor; the embeddings pinned
    assert collections.Counter(t.tensor_type.name for t in blocks.values()) == cand["counts"]
    assert written["token_embd.weight"].tensor_type.name == gguf_tune.EMBEDDINGS
    # at the bits and size the allocation predicted (the file's own bytes)
    m = run.data.metrics
    assert m["model/bits_per_weight"] == pytest.approx(cand["bits_per_weight"], abs=1e-9)
    assert m["model/size_mb"] == pytest.approx(cand["predicted_size_mb"], rel=2e-3)
    # each weight as the sensitivity rounded it: the tune's type, applied to the base's F16 file,
    # equals what llama-quantize wrote, to the last bit
    source = yaml.safe_load((setup / "recipes" / "tiny-g.yaml").read_text())["model"]["source"]
    base = {t.name: t for t in GGUFReader(llamacpp.base_gguf(models.resolve(source).path)).tensors}
    import torch

    for name, tensor in blocks.items():
        kind = tensor.tensor_type
        if kind.name == "F16" or schemes.GGUF_TUNE_TYPES[kind.name].by_engine:
            continue  # K- and I-quants: llama-quantize's own (the test above)
        stored = quants.dequantize(tensor.data, kind).reshape(base[name].shape[::-1])
        f16 = quants.dequantize(base[name].data, GGMLQuantizationType.F16).reshape(stored.shape)
        ours = schemes.GGUF_TUNE_TYPES[kind.name].fake_quantize(torch.from_numpy(np.ascontiguousarray(f16)))
        assert np.array_equal(ours.numpy(), stored), name

    # the latency objective: a cost table measured once through llama-bench (cached), then the
    # fastest mix the policy's KLD allows is the first candidate; it passes (`loose`), so it is the answer
    assert main(["tune", "--policy", "loose", "--from", "tiny-g", "--objective", "latency", "--budget-runs", "2",
                 "--sensitivity-windows", "2", "--json"]) == 0
    fast = last_json(capsys.readouterr().out)
    assert fast["objective"] == "latency" and fast["tune"] != summary["tune"]
    table = fast["cost_table"]
    # every default type the tiny model's rows (64, 128) fit: not the K-quants or IQ4_XS (rows of 256)
    assert set(table["ms"]) == {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16", "IQ4_NL"}
    assert all(v > 0 for v in table["ms"].values())
    [quick] = fast["candidates"]  # the fastest mix passes: nothing between it and itself to search
    assert fast["best_run"] == quick["run_id"]
    # the fastest mix whose predicted KLD the policy allows (`loose`: below 1): the fastest uniform
    # file's time when that file's predicted KLD is below 1, else more (which type is fastest, and
    # how far its KLD goes on this random model, depends on the CPU)
    assert min(table["ms"].values()) - 1e-9 <= quick["predicted_ms"] <= max(table["ms"].values()) + 1e-9
    assert quick["predicted_kld"] <= 1
    [run] = [r for r in runs() if r.info.run_id == quick["run_id"]]
    assert run.data.metrics["tune/predicted_decode_ms"] == pytest.approx(quick["predicted_ms"])
    stored = Path(table["path"])
    measured_at = stored.stat().st_mtime
    # a latency budget below what any mix reaches: exit 2 before any candidate, the table reused
    assert main(["tune", "--policy", "loose", "--from", "tiny-g", "--latency-ms", "0.0001",
                 "--sensitivity-windows", "2"]) == 2
    err = capsys.readouterr().err
    assert "--latency-ms 0.0001: below" in err and "the fastest any mix of" in err
    assert stored.stat().st_mtime == measured_at
    # --remeasure-costs: the table measured again and replaced (the same refusal after it)
    assert main(["tune", "--policy", "loose", "--from", "tiny-g", "--latency-ms", "0.0001", "--remeasure-costs",
                 "--sensitivity-windows", "2"]) == 2
    assert "--latency-ms 0.0001: below" in capsys.readouterr().err
    assert stored.stat().st_mtime > measured_at and json.loads(stored.read_text())["ms"].keys() == table["ms"].keys()
    assert len([r for r in runs() if r.data.tags.get("quantbench.role") == "candidate"]) == 2
