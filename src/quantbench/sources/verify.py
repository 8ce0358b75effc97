"""Is a base model what it claims to be? Checked before it is believed:

- a converted source (a GGUF turned into a checkpoint dir) must reproduce its source: the same
  token ids on sample text, special tokens that agree with the model's config, and the same logits
  within a tolerance on a few windows (`verify_copy`);
- a base model's perplexity on held-out text must not be worse than a unigram model's of the same
  tokens (`check_perplexity`): a model that predicts worse than token frequencies alone has a
  tokenizer, BOS convention or dtype that does not match its weights. A near-uniform model (an
  untrained, random-init one, as tests build) is reported, not refused. It is measured once with
  and once without a BOS at the start of every window (`check_base_perplexity`); the verdict is
  the one with what the tokenizer does (data.bos_id), and both values are kept.

Why (measured, transformers 5.17): a Gemma-family GGUF converts into a checkpoint whose saved
tokenizer splits text into single characters (GemmaTokenizer rebuilds a BPE without merges from a
Unigram tokenizer.json); transformers ignores `tokenizer.ggml.add_bos_token`; and its Llama GGUF
converter names the BOS token as EOS; and it reads every Qwen-family file (qwen2, qwen3, their
mixtures of experts) with Qwen's own pre-tokenizer, where llama.cpp splits text as the file's
`tokenizer.ggml.pre` says (a Qwen3-MoE made with SmolLM2's tokenizer says "smollm": transformers put
"\n\n" in one token where the model and llama.cpp have two). quantbench saves the GGUF's tokenizer as
a plain tokenizer with the file's own special tokens, BOS/EOS flags and pre-tokenizer
(`gguf_tokenizer`), then verifies the copy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from quantbench.core.files import atomic_write, canonical_sha
from quantbench.core.measures import _windows, perplexity
from quantbench.core.paths import cache_dir
from quantbench.sources import data

log = logging.getLogger(__name__)

# llama.cpp's byte-level pre-tokenizers (llama-vocab.cpp, `tokenizer.ggml.pre`) that transformers'
# byte-level pre-tokenizer reproduces: GPT-2's expression, after each digit split off for the second
# set (llama.cpp's "\\p{N}" before it). Other names are left as transformers reads them.
GPT2_PRE = ("gpt-2", "mpt", "olmo", "jais")
DIGITS_GPT2_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
# the architectures transformers' GGUF reader tokenizes with Qwen's pre-tokenizer, whatever the file says
QWEN_READ = ("qwen2", "qwen2moe", "qwen3", "qwen3moe")

SAMPLE_TEXT = (
    "The quick brown fox reads the Python documentation about exceptions and classes. "
    "A for statement iterates over the items of any sequence, in the order that they appear."
)
LOGITS_RTOL = 1e-3  # of the reference's largest centred logit
UNIFORM_SHARE = 0.9  # mean predictive entropy >= this x ln(vocab): a near-uniform (untrained) model
# the other BOS convention predicting held-out text this many times better than the tokenizer's:
# worth a warning (a lost add_bos_token measured 192.8 against 45 with BOS; SmolLM2, which adds
# none, 14.53 without against 14.74 with its <|im_start|>)
BOS_HINT_RATIO = 1.5


# ---------------------------------------------------------------------------------------------
# A converted copy against its source


def gguf_tokenizer(gguf: Path):
    """The GGUF's tokenizer as a plain tokenizer that saves and reloads verbatim, with the special
    tokens the file names by id and BOS/EOS added as the file says (tokenizer.ggml.add_bos_token)."""
    from gguf import GGUFReader
    from transformers import AutoTokenizer
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    fields = GGUFReader(gguf).fields

    def get(key: str):
        return fields[key].contents() if key in fields else None

    loaded = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    pre = get("tokenizer.ggml.pre")
    if get("general.architecture") in QWEN_READ and get("tokenizer.ggml.model") == "gpt2" and pre != "qwen2":
        _split_as_llama_cpp(loaded.backend_tokenizer, pre, gguf)
    tokens = get("tokenizer.ggml.tokens") or []
    specials = {k: v for k, v in loaded.special_tokens_map.items() if isinstance(v, str)}
    for name, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        token_id = get(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= token_id < len(tokens):
            specials[name] = tokens[token_id]
    return TokenizersBackend(
        tokenizer_object=loaded.backend_tokenizer,
        **specials,
        add_bos_token=bool(get("tokenizer.ggml.add_bos_token")),
        add_eos_token=bool(get("tokenizer.ggml.add_eos_token")),
        chat_template=getattr(loaded, "chat_template", None),
    )


def _split_as_llama_cpp(rust, pre: str | None, gguf: Path) -> None:
    """A Qwen-family file's tokenizer (`rust`, a tokenizers.Tokenizer) given the pre-tokenizer its
    file names, as llama.cpp applies it, in place of Qwen's (and without Qwen's NFC normalizer)."""
    from tokenizers import normalizers, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=True)
    if pre in GPT2_PRE:
        rust.pre_tokenizer = byte_level
    elif pre in DIGITS_GPT2_PRE:
        rust.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        log.warning("%s: llama.cpp splits its text as %r, read here with Qwen's pre-tokenizer", gguf, pre)
        return
    rust.normalizer = normalizers.Sequence([])


def compare_tokenizers(reference, candidate, text: str = SAMPLE_TEXT) -> str | None:
    """None if both give the same ids for `text` (special tokens included), else the first difference."""
    a, b = reference(text)["input_ids"], candidate(text)["input_ids"]
    if a == b:
        return None
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    show = lambda tok, ids: tok.convert_ids_to_tokens(ids[max(0, i - 2) : i + 4])  # noqa: E731
    return (
        f"the saved tokenizer splits text differently from the source: {len(b)} tokens instead of {len(a)} "
        f"for a {len(text)}-character sample; first difference at token {i}: source {show(reference, a)} vs "
        f"saved {show(candidate, b)}"
    )


def compare_special_tokens(tokenizer, config) -> str | None:
    """The tokenizer's BOS/EOS must be the ones the model's config names (generation stops on those)."""
    problems = []
    for name in ("bos", "eos"):
        want = getattr(config, f"{name}_token_id", None)
        have = getattr(tokenizer, f"{name}_token_id", None)
        want = want if isinstance(want, list) else [want]
        if None not in want and have is not None and have not in want:
            problems.append(
                f"{name}_token is {getattr(tokenizer, name + '_token')!r} (id {have}) but the model config's "
                f"{name}_token_id is {want if len(want) > 1 else want[0]}"
            )
    return "; ".join(problems) or None


def reference_logits(model, token_ids: list[int], window: int = 64, windows: int = 3) -> list:
    """A model's float32 logits on up to `windows` windows of `token_ids` (what compare_logits checks
    a copy against; computed first, so the model can be let go before its copy is loaded)."""
    import torch

    out = []
    with torch.inference_mode():
        for k in range(max(1, min(windows, len(token_ids) // window))):
            ids = torch.tensor([token_ids[k * window : (k + 1) * window]])
            out.append(model(input_ids=ids).logits.float())
    return out


def compare_logits(
    reference,
    candidate_model,
    token_ids: list[int],
    window: int = 64,
    windows: int = 3,
    rtol: float = LOGITS_RTOL,
) -> str | None:
    """Logits of both on up to `windows` windows of `token_ids` (`reference`: a model, or its
    reference_logits), centred per position (softmax ignores a shift); None if they differ by at most
    `rtol` of the reference's largest centred logit (the same meaning for a real model and a random
    tiny one)."""
    wanted = reference if isinstance(reference, list) else reference_logits(reference, token_ids, window, windows)
    got = reference_logits(candidate_model, token_ids, window, windows)
    worst = scale = 0.0
    for a, b in zip(wanted, got):
        if a.shape != b.shape:
            return f"the saved model's output has shape {tuple(b.shape)}, the source's {tuple(a.shape)}"
        a, b = a - a.mean(-1, keepdim=True), b - b.mean(-1, keepdim=True)
        diff = (a - b).abs().max().item()
        worst = max(worst, diff if math.isfinite(diff) else math.inf)
        scale = max(scale, a.abs().max().item())
    if worst > rtol * scale:
        return (
            f"the saved model's logits differ from the source's by up to {worst:.3g} ({worst / max(scale, 1e-30):.3g} "
            f"of the logits' range; tolerance {rtol:g})"
        )
    return None


def verify_copy(dest: Path, ref_tokenizer, ref_model, text: str = SAMPLE_TEXT) -> list[str]:
    """Reload `dest` from disk (in the dtype it was saved in) and compare it with what it was written
    from (`ref_model`: the model, or its reference_logits on `copy_ids(ref_tokenizer, text)`, so a large
    model need not be in memory beside its copy); [] when faithful."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(dest)
    ids = copy_ids(ref_tokenizer, text)
    reference = ref_model if isinstance(ref_model, list) else reference_logits(ref_model.eval(), ids)
    model = AutoModelForCausalLM.from_pretrained(dest, dtype="auto").eval()
    problems = [
        p
        for p in (compare_tokenizers(ref_tokenizer, tokenizer, text), compare_special_tokens(tokenizer, model.config))
        if p
    ]
    if problem := compare_logits(reference, model, ids):
        problems.append(problem)
    return problems


def copy_ids(tokenizer, text: str = SAMPLE_TEXT) -> list[int]:
    """The token ids a converted copy's logits are compared on (three windows of 64)."""
    ids = tokenizer(text)["input_ids"]
    while len(ids) < 3 * 64:
        ids = ids + ids
    return ids


# ---------------------------------------------------------------------------------------------
# A base model's perplexity against a unigram model of the same tokens


@dataclass
class PerplexityCheck:
    ppl: float  # the model's perplexity on the held-out ids
    unigram_ppl: float  # an add-one-smoothed unigram model of the calibration ids, on the same ids
    entropy: float  # the model's mean predictive entropy (nats)
    vocab_size: int
    verdict: str  # "ok" | "near-uniform" | "refused"
    bos: bool = False  # the windows scored started with BOS (what the tokenizer does)
    # both framings on the first OTHER_FRAMING_WINDOWS windows (check_base_perplexity); None: not measured
    ppl_with_bos: float | None = None
    ppl_without_bos: float | None = None  # (a tokenizer without a BOS token has only this one)
    seconds_per_token: float | None = None  # the main pass's time on this machine (a cost estimate's basis)

    def describe(self) -> str:
        other = self.ppl_without_bos if self.bos else self.ppl_with_bos
        framing = (
            f" (windows {'with' if self.bos else 'without'} BOS, as the tokenizer encodes; "
            f"{'without' if self.bos else 'with'} BOS: {other:.4g} on the first {OTHER_FRAMING_WINDOWS} windows)"
            if other is not None
            else ""
        )
        return (
            f"perplexity {self.ppl:.4g} on held-out text{framing}; a unigram model of the same tokens gets "
            f"{self.unigram_ppl:.4g}; mean predictive entropy {self.entropy:.2f} nats (uniform: "
            f"{math.log(self.vocab_size):.2f})"
        )


def unigram_nll(counted: list[int], scored: list[int], vocab_size: int) -> float:
    """Cross-entropy (nats per token) of `scored` under add-one-smoothed unigram counts of `counted`."""
    counts = Counter(counted)
    total = len(counted) + vocab_size
    return -sum(math.log((counts[t] + 1) / total) for t in scored) / len(scored)


def check_perplexity(
    model, token_ids: list[int], calibration_ids: list[int], window: int, vocab_size: int
) -> PerplexityCheck:
    """The model's NLL and predictive entropy on `token_ids` against the unigram baseline."""
    import torch

    windows = _windows(token_ids, window)
    nll = entropy = 0.0
    count = 0
    with torch.inference_mode():
        for row in windows:
            log_probs = torch.log_softmax(model(input_ids=row[None]).logits[0, :-1].float(), -1)
            nll -= log_probs.gather(-1, row[1:, None]).sum().item()
            entropy -= (log_probs.exp() * log_probs).sum().item()
            count += len(row) - 1
    nll, entropy = nll / count, entropy / count
    unigram = unigram_nll(calibration_ids, windows[:, 1:].reshape(-1).tolist(), vocab_size)
    if entropy >= UNIFORM_SHARE * math.log(vocab_size):
        verdict = "near-uniform"
    else:
        verdict = "refused" if nll > unigram else "ok"
    return PerplexityCheck(math.exp(nll), math.exp(unigram), entropy, vocab_size, verdict)


# The other BOS convention is scored on this many windows only: it is a diagnostic (a tokenizer that
# lost its add_bos_token), and on a large model every pass over the held-out text costs minutes.
OTHER_FRAMING_WINDOWS = 2


def check_base_perplexity(
    model,
    text_ids: list[int],
    calibration_ids: list[int],
    tokens: int,
    window: int,
    vocab_size: int,
    bos_token_id: int | None,
    wants_bos: bool,
) -> PerplexityCheck:
    """check_perplexity on the first `tokens` positions of `text_ids` laid out as windows of `window`
    as the tokenizer frames them (`wants_bos`): its perplexity is the base model's on the reload
    check's text, so the job needs no second pass for it. The other framing (with a BOS at the start
    of every window, or without) is scored on the first OTHER_FRAMING_WINDOWS windows, and the
    framing used on the same windows, for bos_hint (one pass, when there is no BOS token)."""
    use_bos = wants_bos and bos_token_id is not None
    ids = data.framed(text_ids, window, bos_token_id if use_bos else None)[:tokens]
    started = time.perf_counter()
    used = check_perplexity(model, ids, calibration_ids, window, vocab_size)
    used.seconds_per_token = (time.perf_counter() - started) / max(1, len(ids))
    used.bos = use_bos
    if bos_token_id is None:
        used.ppl_without_bos = used.ppl
        return used
    few = min(tokens, OTHER_FRAMING_WINDOWS * window)
    other = data.framed(text_ids, window, None if use_bos else bos_token_id)[:few]
    same = perplexity(model, ids[:few], window)
    other_ppl = perplexity(model, other, window)
    used.ppl_with_bos, used.ppl_without_bos = (same, other_ppl) if use_bos else (other_ppl, same)
    return used


def bos_hint(result: PerplexityCheck) -> str | None:
    """A warning when the model predicts far better with the other BOS convention than with its
    tokenizer's on the same windows (a tokenizer that lost its add_bos_token, or gained one), else None."""
    other = result.ppl_without_bos if result.bos else result.ppl_with_bos
    same = result.ppl_with_bos if result.bos else result.ppl_without_bos
    if other is None or same is None or other * BOS_HINT_RATIO > same:
        return None
    return (
        f"the base model predicts held-out text far better {'without' if result.bos else 'with'} a BOS starting each "
        f"window (perplexity {other:.4g}) than as its tokenizer encodes ({same:.4g}, "
        f"{'with' if result.bos else 'without'} BOS, on the same {OTHER_FRAMING_WINDOWS} windows): check the "
        "tokenizer's add_bos_token (every window of the job follows the tokenizer)"
    )


def _check_path(key: dict) -> Path:
    return cache_dir() / "checks" / f"{canonical_sha(key)[:32]}.json"


def check_cached(key: dict) -> bool:
    """Whether the perplexity check of this key is in the cache (a job's plan: no model loaded for it)."""
    return _check_path(key).is_file()


def cached_check(key: dict, compute) -> PerplexityCheck:
    """A perplexity check keyed by what it depends on (model fingerprint, tokenizer, text), computed
    once and kept in the cache (a base model is checked once, not on every run)."""
    path = _check_path(key)
    if path.is_file():
        return PerplexityCheck(**json.loads(path.read_text()))
    result = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(result.__dict__))
    return result


def tokenizer_sha(path: Path) -> str:
    """sha256 over a checkpoint's tokenizer files (what turns text into the ids a check scored)."""
    digest = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model"):
        file = path / name
        if file.is_file():
            digest.update(name.encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()
