"""Random-weight models of real architectures' shapes, for measuring what a job costs as models
grow (bench/scale.py): time and memory depend on the shapes, not on the weights' values.

Each rung is a config of a published model's layer shapes with the default model's tokenizer
(its 49,152-token vocabulary: the texts quantbench scores are tokenized as for the default model),
written once into the cache (`~/.cache/quantbench/ladder/<name>/`), never into git. A dense model
is written tensor by tensor into safetensors shards, so building an 8B model holds one tensor in
memory, not the model; a mixture of experts (small) is built in memory and saved by transformers,
which knows its checkpoint layout. Weights are normal(0, 0.02), norms 1, seeded by name.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from quantbench.core.paths import cache_dir
from quantbench.sources.checkpoint import skeleton

log = logging.getLogger(__name__)

SHARD_BYTES = 2 * 2**30
VOCAB = 49152  # the default model's tokenizer


@dataclass(frozen=True)
class Rung:
    name: str
    like: str  # the published model whose shapes these are
    architecture: str  # LlamaForCausalLM | Qwen3MoeForCausalLM
    config: dict = field(default_factory=dict)


def _llama(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, tied: bool) -> dict:
    return {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": intermediate,
        "tie_word_embeddings": tied,
        "head_dim": hidden // heads,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "vocab_size": VOCAB,
    }


RUNGS = {
    r.name: r
    for r in (
        Rung("llama-3.2-1b", "meta-llama/Llama-3.2-1B", "LlamaForCausalLM", _llama(2048, 16, 32, 8, 8192, True)),
        Rung("llama-3.2-3b", "meta-llama/Llama-3.2-3B", "LlamaForCausalLM", _llama(3072, 28, 24, 8, 8192, True)),
        Rung("llama-3.1-8b", "meta-llama/Llama-3.1-8B", "LlamaForCausalLM", _llama(4096, 32, 32, 8, 14336, False)),
        # a mixture of experts small enough for a 2-core machine: Qwen3-30B-A3B's widths (128 experts of
        # 768, 8 per token, 48 layers) with 8 experts, 2 per token, 8 layers. A layout that every part of
        # the chain maps: not Mixtral's (with llm-compressor 0.14 and transformers 5.17 its compressed
        # experts reload at random), not OLMoE's (transformers cannot read it from a GGUF file).
        Rung(
            "moe-8x",
            "Qwen/Qwen3-30B-A3B, 8 experts of 128, 8 layers of 48",
            "Qwen3MoeForCausalLM",
            {
                **_llama(2048, 8, 32, 4, 6144, False),
                "head_dim": 128,
                "num_experts": 8,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 768,
                "norm_topk_prob": True,
                "router_aux_loss_coef": 0.0,
            },
        ),
    )
}


def path(name: str) -> Path:
    return cache_dir() / "ladder" / name


def held(name: str) -> list[Path]:
    """What the rung holds on disk: its model directory and the cached GGUF conversions of it
    (llama.cpp's F16 base, `engines/llamacpp.base_gguf`, named after the model's directory)."""
    conversions = sorted({f.parent for f in (cache_dir() / "gguf").glob(f"*/{name}-*.gguf")})
    return [p for p in (path(name), *conversions) if p.exists()]


def remove(name: str) -> int:
    """Remove the rung's model and its conversions; the bytes freed. An 8B rung holds ~28 GiB."""
    freed = 0
    for directory in held(name):
        freed += sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
        shutil.rmtree(directory)
    return freed


def build(name: str, tokenizer_dir: Path) -> Path:
    """The rung's model directory, built once (config, tokenizer, bf16 safetensors, a card)."""
    rung = RUNGS[name]
    dest = path(name)
    if (dest / "config.json").is_file() and (dest / ".complete").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=dest.parent))
    try:
        config = _config(rung)
        config.save_pretrained(tmp)
        if rung.architecture == "LlamaForCausalLM":
            _write_streamed(config, tmp)
        else:
            _write_in_memory(config, tmp)
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp)
        (tmp / "README.md").write_text(
            f"---\nlicense: apache-2.0\n---\n# {name}\n\nRandom weights (normal, std 0.02) in the shapes of "
            f"{rung.like}, with SmolLM2's tokenizer: for measuring cost, not quality.\n"
        )
        (tmp / ".complete").write_text("")
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _config(rung: Rung):
    from transformers import AutoConfig

    model_type = {"LlamaForCausalLM": "llama", "Qwen3MoeForCausalLM": "qwen3_moe"}[rung.architecture]
    config = AutoConfig.for_model(model_type, **rung.config, bos_token_id=1, eos_token_id=2)
    config.architectures = [rung.architecture]
    config.dtype = "bfloat16"
    return config


def _tensor(name: str, shape: tuple[int, ...]):
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") % 2**63
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)


def _write_streamed(config, dest: Path) -> None:
    """Every tensor of the model the config describes (names and shapes from its skeleton on the
    meta device), written shard by shard: one tensor and one shard in memory at a time."""
    from safetensors.torch import save_file

    names = {key: tuple(tensor.shape) for key, tensor in skeleton(config).state_dict().items()}
    if config.tie_word_embeddings:
        names.pop("lm_head.weight", None)
    shards: list[dict] = [{}]
    sizes = [0]
    for key, shape in names.items():
        nbytes = 2
        for n in shape:
            nbytes *= n
        if sizes[-1] and sizes[-1] + nbytes > SHARD_BYTES:
            shards.append({})
            sizes.append(0)
        shards[-1][key] = shape
        sizes[-1] += nbytes
    weight_map = {}
    count = len(shards)
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        save_file({k: _tensor(k, s) for k, s in shard.items()}, str(dest / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
        log.info("ladder: %s %d/%d", dest.name, i + 1, count)
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_in_memory(config, dest: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for key, tensor in model.state_dict().items():
            if tensor.is_floating_point():
                tensor.copy_(_tensor(key, tuple(tensor.shape)))
    model.save_pretrained(dest, max_shard_size="2GB")
