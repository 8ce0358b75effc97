"""Tiny, valid GGUF files written by the tests themselves (numpy and the `gguf` package only): a
llama-architecture or Gemma model with random F32 weights and a real-looking vocabulary built from
Python's own docs, one per tokenizer family transformers converts from GGUF:

- "llama" with a SentencePiece vocabulary (Llama-2 / Mistral style, `spm_bpe_vocab`);
- "llama" with a byte-level BPE vocabulary and merges (SmolLM2 / Llama-3 style, `gpt2_bpe_vocab`);
- "gemma2" / "gemma3" with a SentencePiece unigram vocabulary (`wordlike_spm_vocab`, deterministic).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SPIECE = "\u2581"  # ▁
# token types as llama.cpp writes them (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

def corpus_text(limit: int | None = None) -> list[str]:
    """Paragraphs of English from the Python docs shipped with the interpreter."""
    from pydoc_data.topics import topics

    paras = []
    for key in sorted(topics):
        paras += [p.strip() for p in topics[key].split("\n\n") if len(p.strip()) > 40]
    return paras[:limit] if limit else paras

@dataclass
class Vocab:
    model: str  # tokenizer.ggml.model: "llama" (SentencePiece) or "gpt2" (byte-level BPE)
    tokens: list[str]
    scores: list[float] | None = None
    token_types: list[int] | None = None
    merges: list[str] | None = None  # "a b" strings
    bos_id: int | None = None
    eos_id: int | None = None
    unk_id: int | None = None
    pad_id: int | None = None
    add_bos: bool | None = None
    add_space_prefix: bool | None = None
    pre: str | None = None  # tokenizer.ggml.pre
    extra: dict = field(default_factory=dict)

def spm_bpe_vocab(size: int = 400, byte_fallback: bool = False, add_bos: bool = True) -> Vocab:
    """SentencePiece-BPE style vocabulary (Mistral/Llama-2 are actually SPM-BPE): ▁ pieces with scores
    = -rank, no merges list in the file (llama.cpp writes none for tokenizer.ggml.model = llama)."""
    from tokenizers import SentencePieceBPETokenizer

    tok = SentencePieceBPETokenizer(replacement=SPIECE, add_prefix_space=True)
    n_special = 3 + (256 if byte_fallback else 0)
    tok.train_from_iterator(corpus_text(), vocab_size=size - n_special + 3, special_tokens=["<unk>", "<s>", "</s>"],
                            show_progress=False, min_frequency=2)
    model = json.loads(tok.to_str())["model"]
    by_id = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    tokens = ["<unk>", "<s>", "</s>"]
    scores = [0.0, 0.0, 0.0]
    types = [UNKNOWN, CONTROL, CONTROL]
    if byte_fallback:
        tokens += [f"<0x{b:02X}>" for b in range(256)]
        scores += [0.0] * 256
        types += [BYTE] * 256
    seen = set(tokens)
    for p, rank in by_id:
        if p in seen:
            continue
        seen.add(p)
        tokens.append(p)
        scores.append(-float(rank))
        types.append(NORMAL)
    return Vocab("llama", tokens, scores, types, None, bos_id=1, eos_id=2, unk_id=0, add_bos=add_bos)

def gpt2_bpe_vocab(size: int = 400, add_bos: bool | None = None) -> Vocab:
    """GPT-2 / Llama-3 / SmolLM2 style byte-level BPE: tokens (byte-level alphabet, Ġ for space) + merges.
    Special tokens as SmolLM2's GGUF has them: unk <|endoftext|>=0, bos <|im_start|>=1, eos = pad <|im_end|>=2."""
    from tokenizers import ByteLevelBPETokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = ByteLevelBPETokenizer(add_prefix_space=False)
    tok.train_from_iterator(corpus_text(), vocab_size=size, min_frequency=2, special_tokens=specials,
                            show_progress=False)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    assert tokens[:3] == specials, tokens[:3]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [CONTROL if t in specials else NORMAL for t in tokens]
    return Vocab("gpt2", tokens, None, types, merges, bos_id=1, eos_id=2, unk_id=0, pad_id=2, add_bos=add_bos,
                 pre="smollm")

def wordlike_spm_vocab(size: int = 400, style: str = "gemma", add_bos: bool = True) -> Vocab:
    """A deterministic SentencePiece-unigram-style vocabulary without any trainer (the tokenizers Unigram
    trainer is not reproducible run to run): the corpus' characters, then its most frequent words as
    whole pieces ("▁word" and "word"), scored by log relative frequency.
    style "gemma": <pad> <eos> <bos> <unk>, no dummy prefix; style "llama": <unk> <s> </s>."""
    text = "\n\n".join(corpus_text())
    chars = Counter(text.replace(" ", SPIECE))
    words = Counter(text.split())
    total = sum(chars.values()) + sum(words.values())
    if style == "gemma":
        specials, types = ["<pad>", "<eos>", "<bos>", "<unk>"], [CONTROL, CONTROL, CONTROL, UNKNOWN]
        ids = dict(bos_id=2, eos_id=1, unk_id=3, pad_id=0, add_space_prefix=False)
    else:
        specials, types = ["<unk>", "<s>", "</s>"], [UNKNOWN, CONTROL, CONTROL]
        ids = dict(bos_id=1, eos_id=2, unk_id=0)
    tokens, scores = list(specials), [0.0] * len(specials)
    for ch, n in sorted(chars.items(), key=lambda kv: (-kv[1], kv[0])):
        tokens.append(ch)
        scores.append(math.log(n / total))
    for word, n in sorted(words.items(), key=lambda kv: (-kv[1], kv[0])):
        for piece in (SPIECE + word, word):
            if len(tokens) < size and piece not in tokens:
                tokens.append(piece)
                scores.append(math.log(n / total) + (0.0 if piece.startswith(SPIECE) else -1.0))
        if len(tokens) >= size:
            break
    types = types + [NORMAL] * (len(tokens) - len(types))
    return Vocab("llama", tokens, scores, types, None, add_bos=add_bos, **ids)

def write_tiny_gguf(path: str | Path, vocab: Vocab, arch: str = "llama", layers: int = 2, hidden: int = 64,
                    heads: int = 4, kv_heads: int = 2, ffn: int = 128, ctx: int = 256, seed: int = 0,
                    std: float = 0.02, tie_embeddings: bool | None = None, name: str = "tiny-test-model",
                    license: str = "apache-2.0", q8_0: bool = False) -> Path:
    """A tiny GGUF with random F32 weights (normal, `std`; norms = identity) and `vocab` as its tokenizer.

    arch: "llama" (any vocabulary; SmolLM2 / Llama-2 / Llama-3 / Mistral GGUFs are this), or "gemma2" /
    "gemma3" (Gemma vocabularies; these are the families whose tokenizer breaks on save+reload).
    Self-contained: only numpy and gguf. Tensor names/shapes are what transformers' GGUF loader maps.
    `q8_0`: the weight matrices stored as Q8_0 (blocks of 32) and the file typed MOSTLY_Q8_0, as a
    quantized model someone was given is."""
    import gguf

    assert arch in ("llama", "gemma2", "gemma3"), arch
    gemma = arch != "llama"
    if tie_embeddings is None:
        tie_embeddings = gemma  # Gemma GGUFs have no output.weight (and transformers maps none for gemma2)
    path = Path(path)
    rng = np.random.default_rng(seed)
    n_vocab = len(vocab.tokens)
    head_dim = hidden // heads

    w = gguf.GGUFWriter(str(path), arch)  # writes general.architecture
    w.add_name(name)
    w.add_license(license)
    w.add_context_length(ctx)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6 if gemma else 1e-5)
    w.add_vocab_size(n_vocab)
    if gemma:
        w.add_key_length(head_dim)  # gemma2/3: ARCH.attention.key_length -> head_dim
        w.add_value_length(head_dim)
        w.add_sliding_window(ctx)
    else:
        w.add_rope_dimension_count(head_dim)  # llama: ARCH.rope.dimension_count -> head_dim
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q8_0) if q8_0 else int(gguf.LlamaFileType.ALL_F32))

    w.add_tokenizer_model(vocab.model)
    if vocab.pre:
        w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    if vocab.scores is not None:
        w.add_token_scores(vocab.scores)
    if vocab.token_types is not None:
        w.add_token_types(vocab.token_types)
    if vocab.merges is not None:
        w.add_token_merges(vocab.merges)
    for setter, value in ((w.add_bos_token_id, vocab.bos_id), (w.add_eos_token_id, vocab.eos_id),
                          (w.add_unk_token_id, vocab.unk_id), (w.add_pad_token_id, vocab.pad_id),
                          (w.add_add_bos_token, vocab.add_bos), (w.add_add_space_prefix, vocab.add_space_prefix)):
        if value is not None:
            setter(value)
    for key, value in vocab.extra.items():
        w.add_key_value(key, *value) if isinstance(value, tuple) else w.add_string(key, value)

    def rand(*shape):
        data = (rng.standard_normal(shape) * std).astype(np.float32)
        if not q8_0 or len(shape) != 2:
            return data
        from gguf.quants import quantize

        return quantize(data, gguf.GGMLQuantizationType.Q8_0)

    # RMSNorm identity: llama stores w = 1; Gemma's norms are zero-centred (scale 1 + w) and llama.cpp
    # stores w + 1, which transformers' Gemma2TensorProcessor undoes - so identity is 1.0 in both files.
    norm = lambda n: np.ones(n, dtype=np.float32)  # noqa: E731
    # numpy shapes are torch's (out, in); GGUFWriter stores them reversed, as ggml expects.
    # (llama.cpp also permutes llama's attn_q/attn_k rows, which transformers undoes on load; random
    # weights need no pre-permutation: both the GGUF-loaded and the saved model see the same tensors.)
    def put(name, data):
        if data.dtype == np.uint8:  # Q8_0 bytes: the writer is told the type (it infers the shape)
            w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, data)

    put("token_embd.weight", rand(n_vocab, hidden))
    for i in range(layers):
        b = f"blk.{i}."
        put(b + "attn_norm.weight", norm(hidden))
        put(b + "attn_q.weight", rand(heads * head_dim, hidden))
        put(b + "attn_k.weight", rand(kv_heads * head_dim, hidden))
        put(b + "attn_v.weight", rand(kv_heads * head_dim, hidden))
        put(b + "attn_output.weight", rand(hidden, heads * head_dim))
        if arch == "gemma3":
            put(b + "attn_q_norm.weight", norm(head_dim))
            put(b + "attn_k_norm.weight", norm(head_dim))
        if gemma:
            put(b + "post_attention_norm.weight", norm(hidden))
            put(b + "post_ffw_norm.weight", norm(hidden))
        put(b + "ffn_norm.weight", norm(hidden))
        put(b + "ffn_gate.weight", rand(ffn, hidden))
        put(b + "ffn_up.weight", rand(ffn, hidden))
        put(b + "ffn_down.weight", rand(hidden, ffn))
    put("output_norm.weight", norm(hidden))
    if not tie_embeddings:
        put("output.weight", rand(n_vocab, hidden))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
