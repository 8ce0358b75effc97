"""A model's shapes as memory depends on them, read from its config without loading a weight:
parameters (tied embeddings once), the part a recipe quantizes, widths, layers, the KV cache's
width. The memory planner (jobs/footprint.py) and the quantizers' own footprints use them."""

from __future__ import annotations

from dataclasses import dataclass

from quantbench.sources.checkpoint import skeleton

GiB = 2**30
MiB = 2**20
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Shape:
    """What memory depends on, read from a model's config (its skeleton on the meta device)."""

    params: int  # unique parameters (tied embeddings counted once)
    quantized_params: int  # of the Linear layers a recipe quantizes (not the output head)
    hidden: int
    intermediate: int  # the widest MLP (an expert's, in a mixture of experts)
    layers: int
    vocab: int
    layer_params: int  # one decoder layer's parameters (the largest)
    hessian_bytes: int  # GPTQ's float32 Hessians of one decoder layer (in_features² per Linear)
    kv_dim: int  # key/value width per layer (heads × head dim), for a KV cache
    experts: int = 1
    stored_bytes: int = 2  # per parameter as the base is saved
    # of `params`, those of a mixture of experts' stacked 3-D expert tensors: transformers 5 builds
    # them from a checkpoint's per-expert tensors as it loads (a copy, beside the files' pages)
    expert_params: int = 0

    @classmethod
    def from_config(cls, config, stored: str | None = None) -> Shape:
        model = skeleton(config)
        params = {id(p): p.numel() for p in model.parameters()}
        layers = getattr(getattr(model, "model", model), "layers", None) or []
        # what a recipe quantizes: the weight matrices of the decoder layers (Linear layers, and the
        # stacked experts of a mixture of experts, which transformers 5 keeps as 3-D tensors), not the
        # embeddings or the head. A GPTQ Hessian is in_features² (the last dimension) per matrix, per expert.
        quantized, layer_params, hessians, stacked = 0, 0, 0, 0
        for layer in layers:
            matrices = [p for name, p in layer.named_parameters() if p.dim() >= 2 and not _router(name)]
            quantized += sum(p.numel() for p in matrices)
            stacked += sum(p.numel() for p in matrices if p.dim() == 3)
            layer_params = max(layer_params, sum(p.numel() for p in layer.parameters()))
            hessians = max(hessians, sum(4 * p.shape[-1] ** 2 * (p.shape[0] if p.dim() == 3 else 1) for p in matrices))
        text = getattr(config, "text_config", config)
        heads = getattr(text, "num_attention_heads", 1)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        experts = getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None) or 1
        intermediate = max(
            getattr(text, "intermediate_size", 0) or 0,
            getattr(text, "moe_intermediate_size", 0) or 0,
        )
        saved = stored or str(getattr(config, "dtype", None) or "bfloat16")
        return cls(
            params=sum(params.values()),
            quantized_params=quantized,
            hidden=text.hidden_size,
            intermediate=intermediate or 4 * text.hidden_size,
            layers=len(layers) or getattr(text, "num_hidden_layers", 1),
            vocab=text.vocab_size,
            layer_params=layer_params,
            hessian_bytes=hessians,
            kv_dim=kv_heads * head_dim,
            experts=int(experts),
            stored_bytes=BYTES.get(saved.removeprefix("torch."), 2),
            expert_params=stacked,
        )

    def weights(self, dtype: str) -> int:
        return self.params * BYTES[dtype]

    def window_activations(self, tokens: int, batch: int = 1) -> int:
        """A forward pass over `batch` windows of `tokens` with logits scored in float32: the logits,
        their log-softmax and what is gathered from them, and the widest hidden activations."""
        return batch * tokens * (3 * self.vocab * 4 + 6 * max(self.hidden, self.intermediate) * 4)


def _router(name: str) -> bool:
    """A mixture of experts' router (`mlp.gate`, `block_sparse_moe.gate`): tiny, left unquantized."""
    return name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight", "router.weight"))
