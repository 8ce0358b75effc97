"""Long context and the KV cache (profile `context_tokens:` and `kv_cache:`): what is refused before
anything runs. tests/engines/test_llamacpp.py measures both through a real llama-server (the KV
cache's size as the server says it, a request per long length)."""

import json
import math
import shutil

import pytest

from quantbench.cli import main
from quantbench.metrics import direction
from tests.engines.test_registry import echo_servers
from tests.helpers import runs


def bench(tiny_model_dir, *extra: str) -> list[str]:
    return ["bench", str(tiny_model_dir), "--base", str(tiny_model_dir), "--profile", "long", *extra]


@pytest.mark.parametrize("text, engine, message", [
    # the tiny model allows 512 positions
    ("context_tokens: [600]\n", "echo", "--profile: prompts of 600 tokens plus 4 output tokens exceed"),
    ("kv_cache: q8_0\n", "echo",
     "--profile: kv_cache: echo server does not start with a KV cache of type 'q8_0' here; it takes no KV-cache "
     "type through quantbench (vLLM takes fp8 where its CPU build has AVX-512; llama.cpp's server q8_0, q4_0, ...)"),
    ("kv_cache: q9_0\n", "llamacpp",
     "--profile: kv_cache: llama.cpp does not start with a KV cache of type 'q9_0' here; it takes f16, bf16, q8_0"),
    ("kv_cache: q4_0\n", "llamacpp",
     "--profile: kv_cache: llama.cpp cannot keep this checkpoint's KV cache so: q4_0 stores blocks of 32 values along "
     "each attention head; this model's heads have 16"),
    ("context_tokens: [256]\n", "hf", "--profile: context_tokens need a server"),
    ("kv_cache: q8_0\n", "hf", "--profile: kv_cache needs a server"),
])
def test_long_contexts_and_kv_caches_an_engine_cannot_take_are_refused_first(text, engine, message, echo_engine,
                                                                              workdir, tiny_model_dir, capsys):
    (workdir / "profiles").mkdir()
    (workdir / "profiles" / "long.yaml").write_text("prompt_tokens: [16]\noutput_tokens: 4\n" + text)
    if "q4_0" in text:  # the same model said to have 6 heads of 16 (it is refused from its config, never loaded)
        shutil.copytree(tiny_model_dir, workdir / "heads16")
        config = json.loads((workdir / "heads16" / "config.json").read_text())
        (workdir / "heads16" / "config.json").write_text(json.dumps({**config, "head_dim": 16, "num_attention_heads": 6}))
        tiny_model_dir = workdir / "heads16"
    assert main(bench(tiny_model_dir, "--engine", engine)) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert runs() == [] and echo_servers() == []


def test_the_long_context_metrics_are_catalogued_with_their_direction():
    assert direction("speed/ctx8192/ttft_ms_p50") == "lower" and direction("speed/ctx512/decode_tok_s") == "higher"
    assert direction("base_speed/ctx2048/peak_mem_mb") == "lower" and direction("speed/kv_cache_mb") == "lower"
    assert direction("speedup/kv_cache_mb") == "higher"
    assert direction("quality_engine/ctx8064/ppl_ratio") == "lower"
    assert direction("quality_engine/ctx8064/top1_agreement:pos2048-8062") == "higher"


def test_quality_at_long_context_compares_per_position_scores_overall_and_per_bucket():
    from quantbench.speed.serving import scores_against

    n = 600  # positions 0-511 and 512-599
    base = [-2.0] * n
    cand = [-2.0] * 512 + [-3.0] * 88  # one nat worse per token after position 511
    top = ["token_id:1"] * n
    cand_top = top[:500] + ["token_id:2"] * 100
    m = scores_against("quality_engine/ctx601", cand, cand_top, base, top)
    assert m["quality_engine/ctx601/ppl_ratio:pos0-511"] == pytest.approx(1.0)
    assert m["quality_engine/ctx601/ppl_ratio:pos512-599"] == pytest.approx(math.e)
    assert m["quality_engine/ctx601/ppl_ratio"] == pytest.approx(math.exp(88 / 600))
    assert m["quality_engine/ctx601/top1_agreement:pos0-511"] == pytest.approx(500 / 512)
    assert m["quality_engine/ctx601/top1_agreement:pos512-599"] == 0
    assert m["quality_engine/ctx601/top1_agreement"] == pytest.approx(500 / 600)
    short = scores_against("quality_engine/ctx301", cand[:300], cand_top[:300], base[:300], top[:300])
    assert short == {"quality_engine/ctx301/ppl_ratio": 1.0, "quality_engine/ctx301/top1_agreement": 1.0}  # one bucket
