"""llama.cpp as an engine: the portable build chosen from the CPU's features, GGUF recipes checked
before anything runs, `auto` choosing llama-server for GGUF checkpoints only, and (slow: the real
build, made on first use, and real llama-server processes) a GGUF recipe quantized by
llama-quantize, reloaded by transformers and benchmarked through llama-server against its base's
F16 file, served by the same build in the same run."""

import json
import shutil
from pathlib import Path

import psutil
import pytest

from quantbench import engines
from quantbench.cli import main
from quantbench.core.errors import UserError
from quantbench.core.hardware import CPU
from quantbench.engines import llamacpp_build as build
from tests import gguf_files as gg
from tests.conftest import TINY_PROFILE
from tests.helpers import assert_sketched, last_json, ours, runs, write_recipe

AVX2 = frozenset({"avx", "avx2", "fma", "f16c", "bmi2"})
AMX = AVX2 | {"avx512f", "avx512_vnni", "avx512_bf16", "avx512vbmi", "amx_tile", "amx_int8", "amx_bf16"}


def test_the_build_is_portable_and_named_by_the_cpu_features_it_uses():
    avx2, amx, bare = build.variant(CPU(AVX2)), build.variant(CPU(AMX)), build.variant(CPU(frozenset()))
    assert avx2.name == "avx2" and {"-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_AVX512=OFF"} <= set(avx2.flags)
    # an AMX CPU gets the AVX-512 kernels: the vendored ggml's AMX kernels died with SIGILL at a tile
    # instruction in every tool on an x86-64 with AMX
    assert amx.name == "avx512-bf16" and {"-DGGML_AVX512=ON", "-DGGML_AVX512_BF16=ON"} <= set(amx.flags)
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(amx.flags)
    assert bare.name == "baseline" and all(flag.endswith("=OFF") for flag in bare.flags)
    # never the compiler's own detection (a native build died with SIGILL on a machine of this kind)
    assert "-DGGML_NATIVE=OFF" in build.CMAKE_FIXED
    # a checkout moved to another CPU class builds again rather than running what that CPU lacks
    assert len({build.key(avx2), build.key(amx), build.key(bare)}) == 3
    assert build.key(avx2).startswith(f"{build.VERSION}-avx2-")


@pytest.mark.parametrize(
    "quantize, message",
    [
        ("type: Q4_KM", "unknown llama-quantize type 'Q4_KM'. Did you mean 'Q4_K_M'?"),
        ("type: IQ2_XS", "IQ2_XS needs an importance matrix (llama-quantize refuses without one): set imatrix: true"),
        ("type: Q4_0\n  layers:\n    Q9_0: [attn_v]", "layers: unknown tensor type 'Q9_0'"),
        ("type: Q4_0\n  layers:\n    IQ2_S: [ffn_down]", "IQ2_S needs an importance matrix"),
    ],
)
def test_gguf_recipes_are_checked_before_anything_runs(quantize, message, workdir, capsys):
    write_recipe(workdir, "g", f"quantize:\n  method: gguf\n  {quantize}\n")
    assert main(["validate", "recipes/g.yaml"]) == 2
    err = capsys.readouterr().err
    assert message in err and "recipes/g.yaml" in err


def test_auto_serves_gguf_checkpoints_through_llama_cpp_and_nothing_else(tiny_model_dir):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    gguf = {**config, "quantization_config": {"quant_method": "gguf", "type": "Q8_0"}}
    llama = engines.get("llamacpp")
    buildable = build.find()[0] is not None or all(shutil.which(n) for n in ("cmake", "c++"))
    if buildable:
        chosen = engines.choose("auto", "auto", gguf, tiny_model_dir)
        assert chosen.engine is llama, chosen.why
        assert "vLLM does not serve the checkpoint" in chosen.why and "llama.cpp instead" in chosen.why
    else:
        with pytest.raises(UserError, match="llama.cpp is not built and cannot be here"):
            engines.choose("auto", "auto", gguf, tiny_model_dir)
    # an unquantized or other-format checkpoint is left to the others: auto never converts it
    assert engines.choose("auto", "auto", config, tiny_model_dir).engine is not llama
    other = {**config, "quantization_config": {"quant_method": "compressed-tensors"}}
    assert llama.unserved(other).startswith("it serves GGUF files; this is a compressed-tensors checkpoint")
    # transformers serve cannot load the file; in-process hf de-quantizes it
    assert "not a GGUF file" in engines.get("transformers").unserved(gguf)


def llama_servers() -> list:
    """The llama-server processes this test process started that still run."""
    return ours(p for p in psutil.process_iter(["name"]) if p.info["name"] == "llama-server")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    """A tiny llama-architecture GGUF (byte-level BPE vocabulary, SmolLM2's layout), F32 weights."""
    return gg.write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", gg.gpt2_bpe_vocab(400, add_bos=False))


@pytest.fixture(scope="module")
def tiny_gguf_head32(tmp_path_factory) -> Path:
    """The same with attention heads of 32 (2 heads of the hidden 64): a whole block of a quantized
    KV-cache type (llama.cpp's server refuses an 8-bit KV cache for heads of 16)."""
    path = tmp_path_factory.mktemp("gguf32") / "tiny32.gguf"
    return gg.write_tiny_gguf(path, gg.gpt2_bpe_vocab(400, add_bos=False), heads=2, kv_heads=1)


@pytest.mark.slow  # the real llama.cpp (built on first use: ~12 min on 2 cores), llama-server processes
@pytest.mark.llamacpp
def test_a_gguf_recipe_is_quantized_reloaded_and_benched_through_llama_server(tiny_gguf_head32, workdir, capsys):
    tiny_gguf = tiny_gguf_head32
    (workdir / "profiles").mkdir()
    # with a prefix workload (4 prompts sharing their first 64 tokens, each then 8 of its own), a
    # long-context request (128 tokens) and the candidate's server on an 8-bit KV cache
    (workdir / "profiles" / "tiny.yaml").write_text(TINY_PROFILE.replace("repetitions: 1", "repetitions: 2")
                                                    + "prefix: {tokens: 64, prompts: 4, suffix_tokens: 8}\n"
                                                    + "context_tokens: [128]\nkv_cache: q8_0\n")
    write_recipe(
        workdir, "tiny-q8",
        f"model:\n  source: {tiny_gguf}\n  dtype: float32\nquantize:\n  method: gguf\n  type: Q8_0\n"
        "check:\n  base_ppl_bound: false\n  ppl_tokens: 512\n  window: 128\nbench:\n  profile: tiny\n",
    )  # fmt: skip
    assert main(["quantize", "tiny-q8", "--json"]) == 0, capsys.readouterr().err[-3000:]
    result = last_json(capsys.readouterr().out)
    checkpoint = Path(result["checkpoint"])
    from quantbench.sources.checkpoint import gguf_tensors

    types = {name: kind for name, kind, _, _ in gguf_tensors(checkpoint / "model.gguf")}
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["blk.1.ffn_down.weight"] == "Q8_0"
    assert types["blk.0.attn_norm.weight"] == "F32"  # norms stay float
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "gguf", "type": "Q8_0", "file": "model.gguf"}
    assert_sketched(workdir / "recipes" / "tiny-q8.yaml", config["quantization_config"])
    [run] = runs()
    m, tags = run.data.metrics, run.data.tags
    assert run.info.status == "FINISHED" and tags["quantbench.format"] == "gguf"
    # Q8_0: blocks of 32 int8 weights and one f16 scale = 8.5 bits a weight
    assert m["model/bits_per_weight"] == pytest.approx(8.5)
    # reloaded by transformers (de-quantized) on the same held-out text: Q8_0 is close to lossless
    assert 0.97 < m["check/ppl_ratio"] < 1.03
    # measured through llama-server: the candidate's file and the base's F16 file, by the same build
    assert tags["quantbench.bench_server"] == "llamacpp" and tags["quantbench.bench_engine"].startswith("llama.cpp (")
    assert tags["quantbench.bench_dtype"] == "Q8_0" and tags["quantbench.bench_base_dtype"] == "F16"
    for prefix in ("speed/", "base_speed/"):
        assert m[prefix + "c1/throughput_tok_s"] > 0 and m[prefix + "ttft_ms_p50"] > 0
        # the prefix cache, by the server's own counts: with it on, only each prompt's own tail is
        # computed (its 8 tokens and the few where the prefix's text re-tokenizes differently)
        assert m[prefix + "prefix/computed_share"] < 0.3
        assert m[prefix + "prefix/ttft_ratio"] == pytest.approx(
            m[prefix + "prefix/nocache_ttft_ms_p50"] / m[prefix + "prefix/ttft_ms_p50"], rel=0.5)
        assert m[prefix + "ctx128/ttft_ms_p50"] > 0 and m[prefix + "ctx128/peak_mem_mb"] > 0
    # the KV cache as each server says it allocated it: q8_0 (blocks of 32 int8 values and an f16
    # scale: 8.5 bits) against 16 bits; the log prints MiB to 2 decimals, the tiny model's is 0.06
    assert tags["quantbench.bench_kv_cache"] == "q8_0"
    assert 0.4 < m["speed/kv_cache_mb"] / m["base_speed/kv_cache_mb"] < 0.7
    assert m["speedup/kv_cache_mb"] == pytest.approx(m["base_speed/kv_cache_mb"] / m["speed/kv_cache_mb"])
    assert "Tensor types written: " in (checkpoint / "README.md").read_text()
    assert llama_servers() == []  # both stopped


@pytest.mark.slow  # the real llama.cpp, a llama-server process
@pytest.mark.llamacpp
def test_mxfp4_layers_are_rounded_as_gguf_py_rounds_them_and_served_by_llama_server(tiny_gguf, workdir, capsys):
    """The MXFP4 recipe's shape (gguf-mxfp4): every linear layer MXFP4 through llama-quantize's
    --tensor-type, the rest Q8_0. What llama.cpp writes is gguf-py's MXFP4 rounding of the base's
    F16 file to the last bit (so a tune's in-process rounding is the file's), transformers reloads
    it de-quantized, and llama-server runs it on this CPU."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, GGUFReader, quants

    from quantbench.engines import llamacpp
    from quantbench.recipe import schemes
    from quantbench.sources import models

    (workdir / "profiles").mkdir()
    (workdir / "profiles" / "tiny.yaml").write_text(TINY_PROFILE)
    linear = "[attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down]"
    write_recipe(
        workdir, "tiny-mxfp4",
        f"model:\n  source: {tiny_gguf}\n  dtype: float32\nquantize:\n  method: gguf\n  type: Q8_0\n"
        f"  layers:\n    MXFP4: {linear}\n"
        "check:\n  base_ppl_bound: false\n  ppl_tokens: 512\n  window: 128\nbench:\n  profile: tiny\n",
    )  # fmt: skip
    assert main(["quantize", "tiny-mxfp4", "--json"]) == 0, capsys.readouterr().err[-3000:]
    checkpoint = Path(last_json(capsys.readouterr().out)["checkpoint"])
    written = {t.name: t for t in GGUFReader(checkpoint / "model.gguf").tensors}
    blocks = {n: t for n, t in written.items() if n.startswith("blk.") and len(t.shape) == 2}
    assert len(blocks) == 14 and {t.tensor_type.name for t in blocks.values()} == {"MXFP4"}
    assert written["token_embd.weight"].tensor_type.name == "Q8_0"
    base = {t.name: t for t in GGUFReader(llamacpp.base_gguf(models.resolve(str(tiny_gguf)).path)).tensors}
    for name, tensor in blocks.items():
        stored = quants.dequantize(tensor.data, GGMLQuantizationType.MXFP4)
        f16 = quants.dequantize(base[name].data, GGMLQuantizationType.F16).reshape(stored.shape)
        ours = schemes.GGUF_TUNE_TYPES["MXFP4"].fake_quantize(torch.from_numpy(np.ascontiguousarray(f16)))
        assert np.array_equal(ours.numpy(), stored), name
        assert not np.array_equal(f16, stored), name  # rounded, not copied
    [run] = runs()
    m, tags = run.data.metrics, run.data.tags
    assert run.info.status == "FINISHED"
    # 4-bit values and one 8-bit scale per block of 32
    assert m["model/bits_per_weight"] == pytest.approx(4.25)
    # reloaded de-quantized by transformers and checked on held-out text (a random model's perplexity
    # is about its vocabulary's size, rounded or not: 1.0005 here)
    assert m["check/ppl_ratio"] == pytest.approx(1, abs=0.05)
    # served as stored by llama-server, beside the base's F16 file
    assert tags["quantbench.bench_server"] == "llamacpp" and tags["quantbench.bench_dtype"] == "Q8_0"
    assert m["speed/c1/throughput_tok_s"] > 0 and m["base_speed/c1/throughput_tok_s"] > 0
    assert llama_servers() == []


@pytest.mark.slow  # the real llama.cpp and a llama-server process that fails
@pytest.mark.llamacpp
def test_a_gguf_llama_server_cannot_load_fails_with_its_own_words(tiny_gguf, tmp_path):
    from quantbench.engines.server import EndpointError, model_server

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.gguf").write_bytes(tiny_gguf.read_bytes()[:5000])  # truncated
    with pytest.raises(EndpointError, match=r"llama\.cpp .*could not serve .*exit code"):
        with model_server(broken, tmp_path / "server.log", "llamacpp"):
            pass
    assert llama_servers() == []


def test_a_gguf_whose_tokenizer_is_not_the_models_is_refused(tiny_gguf, tiny_model_dir):
    """The check every base GGUF passes before llama.cpp uses it: the file's own tokenizer must give
    the model's token ids (here a byte-level BPE file against the tiny model's other BPE)."""
    from quantbench.engines.llamacpp import verify_tokenizer
    from quantbench.sources import models

    with pytest.raises(UserError, match=r"its tokenizer does not reproduce .*: token \d+ of a \d+-character sample"):
        verify_tokenizer(tiny_gguf, tiny_model_dir)
    converted = models.resolve(str(tiny_gguf))  # quantbench's own conversion of that file: the same ids
    verify_tokenizer(tiny_gguf, converted.path)


@pytest.mark.slow  # the real llama.cpp and its converter
@pytest.mark.llamacpp
def test_a_model_llama_cpp_cannot_convert_is_refused_before_any_run(tiny_model_dir, workdir, capsys):
    """The tiny model's tokenizer was trained in this session: llama.cpp's converter does not know
    its pre-tokenizer and refuses; the recipe exits 2 naming that, and no run exists."""
    write_recipe(workdir, "tiny-q8", f"model:\n  source: {tiny_model_dir}\nquantize:\n  method: gguf\n"
                 "check:\n  base_ppl_bound: false\n")  # fmt: skip
    assert main(["quantize", "tiny-q8"]) == 2
    err = capsys.readouterr().err
    assert "convert_hf_to_gguf.py" in err and "failed (exit code" in err
    assert runs() == [] and not (workdir / "outputs" / "tiny-q8").exists()


@pytest.mark.slow  # the real llama.cpp: llama-perplexity on two tiny models
@pytest.mark.llamacpp
def test_engine_kld_reads_the_running_line_when_the_summary_is_lost(tiny_gguf, tmp_path):
    """llama.cpp's logger does not flush at exit, so llama-perplexity's summary is missing from some
    runs' output. The last chunk's running line holds the same means and standard errors: both give
    the same figures, and a truncated output still scores."""
    from quantbench.engines import llamacpp
    from quantbench.sources import data

    other = gg.write_tiny_gguf(tmp_path / "other.gguf", gg.gpt2_bpe_vocab(400, add_bos=False), seed=1)
    tools = build.ensure("test")
    text = tmp_path / "text.txt"
    text.write_text(data.python_docs("evaluation")[:60_000])
    common = ["-f", str(text), "-c", "128", "-b", "128", "-t", "2", "--kl-divergence-base", str(tmp_path / "base.kld")]
    llamacpp.run_tool([tools.tool("llama-perplexity"), "-m", str(tiny_gguf), *common], tmp_path / "log", "base")
    for _ in range(6):  # until one run's output has its summary
        out = llamacpp.run_tool([tools.tool("llama-perplexity"), "-m", str(other), *common, "--kl-divergence"],
                                tmp_path / "log", "candidate")  # fmt: skip
        if "Mean    KLD" in out and "Same top p:" in out:
            break
    else:
        pytest.fail("six llama-perplexity runs in a row lost their summary")
    summary = llamacpp.kld_stats(out)
    running = llamacpp.kld_stats(out[: out.index("====== Perplexity statistics")])
    assert summary and running and summary["kld_mean"][0] > 0.001
    for name in ("kld_mean", "ppl_ratio", "same_top_p"):
        (value, se), (value2, se2) = summary[name], running[name]
        assert value2 == pytest.approx(value, rel=1e-3, abs=1e-5) and se2 == pytest.approx(se, rel=0.05, abs=1e-5)
    assert llamacpp.kld_stats("no statistics here") is None

