"""Long context and the KV cache (profile `context_tokens:` and `kv_cache:`): what is refused before
anything runs. tests/engines/test_llamacpp.py measures both through a real llama-server (the KV
cache's size as the server says it, a request per long length)."""

import json
import shutil

import pytest

from quantbench.cli import main
from quantbench.metrics import direction
from tests.engines.test_registry import echo_servers
from tests.helpers import runs




def bench(tiny_model_dir, *extra: str) -> list[str]:
    return ["bench", str(tiny_model_dir), "--base", str(tiny_model_dir), "--profile", "long", *extra]


@pytest.mark.parametrize("text, backend, message", [
    # the tiny model allows 512 positions
    ("context_tokens: [600]\n", "echo", "--profile: prompts of 600 tokens plus 4 output tokens exceed"),
    ("kv_cache: q8_0\n", "echo",
     "--profile: kv_cache: echo server does not start with a KV cache of type 'q8_0' here; it takes no KV-cache "
     "type through quantbench (llama.cpp's server takes q8_0, q4_0, ...)"),
    ("kv_cache: q9_0\n", "llamacpp",
     "--profile: kv_cache: llama.cpp does not start with a KV cache of type 'q9_0' here; it takes f16, bf16, q8_0"),
    ("kv_cache: q4_0\n", "llamacpp",
     "--profile: kv_cache: llama.cpp cannot keep this checkpoint's KV cache so: q4_0 stores blocks of 32 values along "
     "each attention head; this model's heads have 16"),
    ("context_tokens: [256]\n", "hf", "--profile: context_tokens need a server"),
    ("kv_cache: q8_0\n", "hf", "--profile: kv_cache needs a server"),
])
def test_long_contexts_and_kv_caches_an_engine_cannot_take_are_refused_first(text, backend, message, echo_engine,
                                                                              workdir, tiny_model_dir, capsys):
    (workdir / "profiles").mkdir()
    (workdir / "profiles" / "long.yaml").write_text("prompt_tokens: [16]\noutput_tokens: 4\n" + text)
    if "q4_0" in text:  # the same model said to have 6 heads of 16 (it is refused from its config, never loaded)
        shutil.copytree(tiny_model_dir, workdir / "heads16")
        config = json.loads((workdir / "heads16" / "config.json").read_text())
        (workdir / "heads16" / "config.json").write_text(json.dumps({**config, "head_dim": 16, "num_attention_heads": 6}))
        tiny_model_dir = workdir / "heads16"
    assert main(bench(tiny_model_dir, "--backend", backend)) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert runs() == [] and echo_servers() == []


def test_the_long_context_metrics_are_catalogued_with_their_direction():
    assert direction("speed/ctx8192/ttft_ms_p50") == "lower" and direction("speed/ctx512/decode_tok_s") == "higher"
    assert direction("base_speed/ctx2048/peak_mem_mb") == "lower" and direction("speed/kv_cache_mb") == "lower"
    assert direction("speedup/kv_cache_mb") == "higher"
