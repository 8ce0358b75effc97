"""A base model is checked before it is believed: a GGUF converts into a checkpoint that reproduces
it (token ids, BOS/EOS, logits) for every tokenizer family transformers converts, and a base model
that predicts worse than a unigram model of its own tokens is refused before anything runs."""

import json

import pytest
import torch

from quantbench.cli import main
from quantbench.core.errors import UserError
from quantbench.sources import models, verify
from tests import gguf_files as gg
from tests.helpers import runs, tiny_recipe, write_recipe

SAMPLE = ("The following example shows how the function returns a value for each element in the list. "
          "A for statement iterates over the items of any sequence.")
FAMILIES = {
    # id: (general.architecture, vocabulary)
    "llama2-spm": ("llama", lambda: gg.spm_bpe_vocab(400)),  # Llama-2 / Mistral: SentencePiece, BOS added
    "llama3-gpt2": ("llama", lambda: gg.gpt2_bpe_vocab(400, add_bos=False)),  # SmolLM2 / Llama-3: byte-level BPE
    "gemma2": ("gemma2", lambda: gg.wordlike_spm_vocab(400, style="gemma")),  # SentencePiece unigram
    "gemma3": ("gemma3", lambda: gg.wordlike_spm_vocab(400, style="gemma")),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def converted(request, tmp_path_factory):
    """A tiny GGUF of one family, converted the way quantbench converts every GGUF source."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    arch, build = FAMILIES[request.param]
    vocab = build()
    root = tmp_path_factory.mktemp(request.param)
    gguf = gg.write_tiny_gguf(root / "tiny.gguf", vocab, arch=arch)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QUANTBENCH_CACHE", str(root / "cache"))
        resolved = models.resolve(str(gguf))
    return {"family": request.param, "vocab": vocab, "resolved": resolved,
            "gguf_tok": AutoTokenizer.from_pretrained(root, gguf_file=gguf.name),
            "gguf_model": AutoModelForCausalLM.from_pretrained(root, gguf_file=gguf.name, dtype=torch.float32),
            "tok": AutoTokenizer.from_pretrained(resolved.path),
            "model": AutoModelForCausalLM.from_pretrained(resolved.path, dtype=torch.float32)}


def test_the_saved_tokenizer_splits_like_the_gguf(converted):
    """Gemma's converted tokenizer used to reload as single characters (40 ids became 90)."""
    a = converted["gguf_tok"](SAMPLE, add_special_tokens=False)["input_ids"]
    b = converted["tok"](SAMPLE, add_special_tokens=False)["input_ids"]
    assert len(a) < 0.6 * len(SAMPLE)  # words and pieces, not characters
    assert b == a, f"{len(b)} ids after conversion vs {len(a)} from the GGUF"


def test_bos_and_eos_are_the_files(converted):
    vocab, tok = converted["vocab"], converted["tok"]
    assert (tok("hi")["input_ids"][0] == vocab.bos_id) == bool(vocab.add_bos)  # tokenizer.ggml.add_bos_token
    from quantbench.sources.data import (
        bos_id,  # so every window of a job on it starts with that BOS, or with none
    )

    assert bos_id(tok) == (vocab.bos_id if vocab.add_bos else None)
    assert tok.eos_token == vocab.tokens[vocab.eos_id] and tok.bos_token == vocab.tokens[vocab.bos_id]


@torch.inference_mode()
def test_the_saved_weights_are_the_gguf_weights(converted):
    ids = torch.tensor([converted["gguf_tok"](SAMPLE)["input_ids"]])
    assert torch.equal(converted["gguf_model"](ids).logits, converted["model"](ids).logits)
    info = json.loads((converted["resolved"].path / models.SOURCE_INFO).read_text())
    assert info["conversion"] == models.CONVERSION and info["license"] == "apache-2.0"


def test_the_guard_names_a_broken_copy(converted, tmp_path):
    """What the conversion's check catches: a tokenizer that splits differently, a wrong EOS, damaged weights."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    good = tmp_path / "good"
    shutil.copytree(converted["resolved"].path, good)
    reference_tok = AutoTokenizer.from_pretrained(good)
    assert verify.verify_copy(good, reference_tok, converted["model"]) == []
    chars = tmp_path / "chars"  # a tokenizer.json whose model can only split into characters
    shutil.copytree(good, chars)
    data = json.loads((chars / "tokenizer.json").read_text())
    if data["model"]["type"] == "BPE":
        data["model"]["merges"] = []
    else:
        data["model"]["vocab"] = [[p, s] for p, s in data["model"]["vocab"] if len(p) == 1 or p.startswith("<")]
    (chars / "tokenizer.json").write_text(json.dumps(data))
    [problem] = verify.verify_copy(chars, reference_tok, converted["model"])
    assert "splits text differently from the source" in problem
    damaged = tmp_path / "damaged"
    shutil.copytree(good, damaged)
    weights = load_file(str(damaged / "model.safetensors"))
    weights = {k: (v + 0.05 if k == "model.norm.weight" else v).contiguous() for k, v in weights.items()}
    save_file(weights, str(damaged / "model.safetensors"), metadata={"format": "pt"})
    [problem] = verify.verify_copy(damaged, reference_tok, converted["model"])
    assert "logits differ from the source's" in problem


def test_a_wrong_eos_is_named(converted, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    copy = tmp_path / "eos"
    shutil.copytree(converted["resolved"].path, copy)
    config = json.loads((copy / "config.json").read_text())
    config["eos_token_id"] = (config["eos_token_id"] + 5) % 300 + 10
    (copy / "config.json").write_text(json.dumps(config))
    problems = verify.verify_copy(copy, AutoTokenizer.from_pretrained(converted["resolved"].path), converted["model"])
    assert any("eos_token is" in p and "model config's eos_token_id" in p for p in problems), problems


# ---------------------------------------------------------------------------------------------
# The perplexity bound


def test_a_random_model_is_near_uniform_and_a_peaked_random_one_is_refused(tiny_model_dir, tiny_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    from quantbench.sources.data import python_docs
    from tests.conftest import build_tiny

    ids = tiny_tokenizer(python_docs("evaluation"))["input_ids"][:1024]
    calibration = tiny_tokenizer(python_docs("calibration")[:100_000])["input_ids"]
    near = verify.check_perplexity(AutoModelForCausalLM.from_pretrained(tiny_model_dir), ids, calibration, 128, 512)
    assert near.verdict == "near-uniform" and near.entropy > 0.9 * 6.238
    peaked_dir = build_tiny(tmp_path / "peaked", tiny_tokenizer, initializer_range=0.2)
    peaked = verify.check_perplexity(AutoModelForCausalLM.from_pretrained(peaked_dir), ids, calibration, 128, 512)
    assert peaked.verdict == "refused" and peaked.ppl > peaked.unigram_ppl
    assert 50 < peaked.unigram_ppl < 512  # token frequencies alone beat uniform guessing
    assert verify.unigram_nll([1, 1, 2], [1], 3) == pytest.approx(-__import__("math").log(3 / 6))


def test_the_base_check_measures_with_and_without_bos_and_judges_as_the_tokenizer_does(tiny_model_dir, tiny_tokenizer):
    """The verdict and `ppl` are those of the windows the tokenizer makes, over every token asked
    for (the job's base perplexity: no second pass); both framings are compared on the first
    OTHER_FRAMING_WINDOWS windows only (one more short pass, not a second full one)."""
    from transformers import AutoModelForCausalLM

    from quantbench.core.measures import perplexity
    from quantbench.sources import data

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    text = data.text_ids(tiny_tokenizer, data.python_docs("evaluation"))
    calibration = data.text_ids(tiny_tokenizer, data.python_docs("calibration")[:100_000])
    with_bos = verify.check_perplexity(model, data.framed(text, 128, 1)[:512], calibration, 128, 512)
    without = verify.check_perplexity(model, text[:512], calibration, 128, 512)
    wants = verify.check_base_perplexity(model, text, calibration, 512, 128, 512, bos_token_id=1, wants_bos=True)
    plain = verify.check_base_perplexity(model, text, calibration, 512, 128, 512, bos_token_id=1, wants_bos=False)
    assert wants.bos and wants.ppl == with_bos.ppl and wants.unigram_ppl == with_bos.unigram_ppl
    assert not plain.bos and plain.ppl == without.ppl
    few = verify.OTHER_FRAMING_WINDOWS * 128
    assert few < 512
    first_with, first_without = perplexity(model, data.framed(text, 128, 1)[:few], 128), perplexity(model, text[:few], 128)
    for result in (wants, plain):
        assert (result.ppl_with_bos, result.ppl_without_bos) == (first_with, first_without)
    assert with_bos.ppl != without.ppl
    assert f"with BOS, as the tokenizer encodes; without BOS: {first_without:.4g}" in wants.describe()
    none = verify.check_base_perplexity(model, text, calibration, 512, 128, 512, bos_token_id=None, wants_bos=False)
    assert not none.bos and none.ppl_with_bos is None and none.ppl == without.ppl
    assert verify.bos_hint(wants) is None and verify.bos_hint(none) is None  # a random model: BOS hardly matters


def test_a_model_far_better_with_the_other_bos_convention_is_pointed_out():
    def check(bos, with_bos, without):
        return verify.PerplexityCheck(with_bos if bos else without, 900.0, 3.0, 49152, "ok", bos, with_bos, without)

    lost = verify.bos_hint(check(False, 45.0, 192.8))  # the defect: a tokenizer that lost add_bos_token
    assert lost and "far better with a BOS" in lost and "perplexity 45)" in lost and "(192.8, without BOS, on the same 2 windows)" in lost
    assert verify.bos_hint(check(False, 14.74, 14.53)) is None  # SmolLM2: adds no BOS, and is no better with one
    assert verify.bos_hint(check(True, 30.0, 45.0)) is None
    assert verify.bos_hint(check(True, 30.0, 20.0))  # exactly BOS_HINT_RATIO (1.5x) better: pointed out
    assert verify.bos_hint(check(True, 30.0, 20.0 + 1e-9)) is None


def test_quantize_refuses_a_broken_base_before_any_run(workdir, tiny_tokenizer, capsys, monkeypatch):
    from tests.conftest import build_tiny

    monkeypatch.setenv("QUANTBENCH_CACHE", str(workdir / "cache"))
    peaked = build_tiny(workdir / "peaked", tiny_tokenizer, initializer_range=0.2)
    write_recipe(workdir, "p", tiny_recipe(peaked, "method: fp8\n"))
    assert main(["quantize", "p"]) == 2
    err = capsys.readouterr().err
    assert "error: recipes/p.yaml: model.source: the base model" in err and "worse than a unigram model" in err
    assert "tokenizer does not match its weights" in err and "check.base_ppl_bound: false" in err
    assert runs() == [] and not (workdir / "outputs").exists()
    cached = list((workdir / "cache" / "checks").glob("*.json"))
    assert len(cached) == 1 and json.loads(cached[0].read_text())["verdict"] == "refused"
    write_recipe(workdir, "p", tiny_recipe(peaked, "method: fp8\n").replace("check:\n", "check:\n  base_ppl_bound: false\n"))
    assert main(["quantize", "p"]) == 0  # the escape hatch, for a model known to be random


def test_a_corrupt_gguf_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path / "cache"))
    gguf = gg.write_tiny_gguf(tmp_path / "ok.gguf", gg.gpt2_bpe_vocab(300, add_bos=False))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf.read_bytes()[:-5000])
    with pytest.raises(UserError, match=r"cut.gguf is not a readable GGUF file"):
        models.resolve(str(cut))
    assert models.resolve(str(gguf)).path.is_dir()


def test_a_gguf_converted_from_a_file_since_gone_is_read_from_where_it_is_now(tmp_path, monkeypatch):
    """The cache keeps one conversion per GGUF content; the file it was made from may be gone (a
    temporary directory, a moved download). The same content from another path is the source now:
    llama.cpp reads that file again rather than converting the safetensors copy back."""
    import shutil

    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path / "cache"))
    (tmp_path / "a").mkdir()
    first = gg.write_tiny_gguf(tmp_path / "a" / "tiny.gguf", gg.gpt2_bpe_vocab(300, add_bos=False))
    converted = models.resolve(str(first)).path
    assert models.source_gguf(converted) == first
    moved = tmp_path / "b" / "tiny.gguf"
    moved.parent.mkdir()
    shutil.move(first, moved)
    assert models.source_gguf(converted) is None  # the recorded file is gone
    again = models.resolve(str(moved))
    assert again.path == converted and models.source_gguf(converted) == moved
    assert json.loads((converted / models.SOURCE_INFO).read_text())["source"] == str(moved)


def _tokenizer_only_gguf(path, arch: str, pre: str, vocab):
    """A GGUF holding a byte-level BPE vocabulary and no tensors (what a tokenizer is read from)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_head_count(1)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.token_types)
    w.add_token_merges(vocab.merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_qwen_family_gguf_is_split_as_its_file_says_as_llama_cpp_does(tmp_path):
    """transformers reads every Qwen-family GGUF with Qwen's pre-tokenizer (blank lines in one
    token); llama.cpp splits as the file's tokenizer.ggml.pre says. A Qwen3-MoE-layout file with
    SmolLM2's vocabulary ("smollm") reads as the same vocabulary in a llama-layout file does, where a
    real Qwen one ("qwen2") keeps Qwen's split."""
    vocab = gg.gpt2_bpe_vocab(400)
    text = "def f(x):\n\n\n    return x + 2026\n\nand then\n"
    ids = {
        (arch, pre): verify.gguf_tokenizer(_tokenizer_only_gguf(tmp_path / f"{arch}-{pre}.gguf", arch, pre, vocab))(
            text
        )["input_ids"]
        for arch, pre in (("llama", "smollm"), ("qwen3moe", "smollm"), ("qwen3moe", "qwen2"), ("qwen2", "gpt-2"))
    }
    assert ids[("qwen3moe", "smollm")] == ids[("llama", "smollm")] == ids[("qwen2", "gpt-2")]
    assert ids[("qwen3moe", "qwen2")] != ids[("llama", "smollm")]
