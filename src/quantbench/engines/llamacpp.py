"""llama.cpp's `llama-server` as a serving engine, and the GGUF files it serves.

- It serves GGUF checkpoints (a directory holding one `.gguf`, as `method: gguf` writes them)
  and unquantized models, which it serves as their F16 GGUF, converted once per model and cached
  (`base_gguf`): that is how a GGUF candidate's base is measured by the same build in the same run.
- The base GGUF is made the way that keeps the model's vocabulary right: a model quantbench
  converted from a GGUF (the embedded default came from a Q4_1 file) is de-quantized from that
  file (`llama-quantize --allow-requantize SRC F16`); any other with llama.cpp's own
  `convert_hf_to_gguf.py` from the same pinned source. Either way the file's tokenizer is checked
  against the model's own on sample text before it is used (`verify_tokenizer`): a converter that
  writes another vocabulary (seen here: a SentencePiece vocabulary for a BPE model) is refused.
- Its binaries are built by `llamacpp_build` on first use (`make llamacpp` ahead of time).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

from quantbench.core.errors import UserError
from quantbench.core.paths import cache_dir
from quantbench.engines import ServerSettings, ServingEngine, explain_log, head_size, model_config
from quantbench.engines import llamacpp_build as build
from quantbench.sources import data
from quantbench.sources.checkpoint import gguf_file
from quantbench.sources.models import known_fingerprint, source_gguf
from quantbench.sources.verify import gguf_tokenizer

log = logging.getLogger(__name__)

BASE_TYPE = "F16"  # what an unquantized model is served as, and GGUF recipes quantize from
# llama.cpp's CPU backend copies a quantized file's tensors of the types it has interleaved kernels
# for (Q4_0, Q4_K, IQ4_NL; which depends on the CPU) into a layout of its own at load, beside the
# mapped file (its log: "CPU_REPACK model buffer size"). Measured on the 8B rung (AVX512-BF16): Q4_K_M,
# 3,204 MiB of a 4,227 MiB file; Q8_0 (8.5 bits a weight) none, its server 7.6 GiB for a 7.3 GiB file;
# the F16 base none. Counted for files under REPACKED_BITS bits a weight.
REPACKED_SHARE = 0.8
REPACKED_BITS = 6.0


def threads() -> int:
    """The threads llama.cpp computes with: every core this process may use, or fewer where
    OMP_NUM_THREADS asks for fewer (as it does of torch; llama.cpp's threads spin-wait too)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    asked = os.environ.get("OMP_NUM_THREADS", "")
    return min(cores, int(asked)) if asked.isdigit() and int(asked) > 0 else cores


class LlamaServer(ServingEngine):
    name = "llamacpp"
    label = "llama.cpp"
    kind = "server"
    quality = "none"  # llama-server refuses `echo` (prompt log-probabilities): tasks score elsewhere
    drafts = None  # llama-server --model-draft; each response's timings count draft tokens and accepted ones
    prefix_cache = None  # the request's cache_prompt; each response's timings count the prompt tokens computed
    # llama-server --cache-type-k/-v (a quantized V cache needs flash attention, turned on with it)
    kv_cache_types = ("f16", "bf16", "q8_0", "q5_1", "q5_0", "iq4_nl", "q4_1", "q4_0")
    dtypes = ("auto", "float16")  # a GGUF file is served in its own types (a 16-bit base as F16)
    scores_kv_cache = True  # llama-perplexity scores a model with the KV-cache type it serves it with
    tune_format, tune_template = "gguf", "gguf-q4_0"  # llama-quantize's type per tensor
    health_timeout_s = 120.0  # loading a GGUF is seconds; a first build happens before, in ensure()
    runtime_bytes = int(0.15 * 2**30)  # llama-server besides the file it maps and its KV cache

    def __init__(self) -> None:
        self.tools: build.Tools | None = None

    def server_memory(
        self, weights: int, kv_per_token: int, max_len: int, slots: int, experts: int = 0, bits: float | None = None
    ) -> int:
        """The file it maps (its working set: pages it reads at every token), the KV cache, and, for
        weights of under REPACKED_BITS bits, the copy its CPU backend repacks them into."""
        repacked = int(REPACKED_SHARE * weights) if bits is not None and bits < REPACKED_BITS else 0
        return weights + kv_per_token * max_len * slots + self.runtime_bytes + repacked

    def status(self) -> tuple[bool, str | None, str]:
        tools, note = build.find()
        if tools is not None:
            return True, tools.version, f"{tools.describe()} in {tools.where}; serves GGUF files, {threads()} threads"
        missing = self.unavailable()
        if missing:
            return False, None, missing
        return True, None, f"{note}; would be the {build.variant().name} build of {build.PACKAGE} {build.VERSION}"

    def unavailable(self) -> str | None:
        tools, _ = build.find()
        if tools is not None:
            return None
        missing = build.missing_compilers()
        if missing:
            return f"llama.cpp is not built and cannot be here (no {', '.join(missing)})"
        return None

    def cpu_note(self) -> str:
        return f" ({build.variant().name} build)"

    def unserved(self, checkpoint: Path | dict) -> str | None:
        if isinstance(checkpoint, dict):
            config = checkpoint
        else:
            if gguf_file(checkpoint) is not None:
                return None
            config = json.loads((checkpoint / "config.json").read_text())
        method = (config.get("quantization_config") or {}).get("quant_method")
        if method and method != "gguf":
            return f"it serves GGUF files; this is a {method} checkpoint (llama.cpp cannot convert it faithfully)"
        return None

    def auto_picks(self, checkpoint: Path | dict | None) -> bool:
        """GGUF checkpoints only: it serves an unquantized one too, converted first, when asked by name."""
        if isinstance(checkpoint, dict):
            return (checkpoint.get("quantization_config") or {}).get("quant_method") == "gguf"
        return checkpoint is not None and gguf_file(checkpoint) is not None

    def ensure(self, why: str) -> None:
        self.tools = build.ensure(why)

    def describe(self, compiled: bool = True) -> str:
        if self.tools is None:
            return f"llama.cpp ({build.PACKAGE} {build.VERSION})"
        return f"llama.cpp ({self.tools.describe()}, {threads()} threads)"

    def server_command(
        self, checkpoint: Path, port: int, settings: ServerSettings, tmp: Path
    ) -> tuple[list[str], dict[str, str]]:
        self.ensure("serving a checkpoint")
        assert self.tools is not None
        model = gguf_file(checkpoint) or base_gguf(checkpoint, self.tools)
        slots = max(1, settings.slots)
        cmd = [
            self.tools.tool("llama-server"),
            "--model", str(model),
            "--alias", str(checkpoint),
            "--host", "127.0.0.1",
            "--port", str(port),
            "--threads", str(threads()),
            "--threads-batch", str(threads()),
            "--parallel", str(slots),
            "--ctx-size", str(settings.max_len * slots),  # split between the slots
            "--seed", "0",
            "--no-ui",
            "--log-verbosity", "4",  # the KV cache's size (kv_cache_mb), a few lines per request
        ]  # fmt: skip
        if settings.kv_cache:
            cmd += ["--cache-type-k", settings.kv_cache, "--cache-type-v", settings.kv_cache, "--flash-attn", "on"]
        if settings.draft is not None:  # speculative decoding with a draft model (llama.cpp's defaults: up to 3
            # tokens drafted per step); a draft model alone drafts nothing without its type named
            draft = gguf_file(settings.draft) or base_gguf(settings.draft, self.tools)
            cmd += ["--model-draft", str(draft), "--spec-type", "draft-simple"]
        return cmd, {**os.environ, **settings.extra_env}

    def request_body(self, model: str, prompt: str, max_tokens: int) -> dict:
        # exactly max_tokens for every request (as against vLLM): a model that says EOS early would
        # otherwise do less work than its base, or (a random test model) stream no token at all
        return super().request_body(model, prompt, max_tokens) | {"ignore_eos": True}

    def with_prefix_cache(self, body: dict, on: bool) -> dict:
        # llama-server keeps each slot's KV cache and, with cache_prompt, computes only the part of a
        # prompt that differs from what the slot holds
        return {**body, "cache_prompt": on}

    def explain(self, log_path: Path) -> str:
        lines = [x.strip() for x in log_path.read_text(errors="replace").splitlines() if x.strip()]
        errors = [x for x in lines if re.search(r"\b(error|failed|invalid)\b", x, re.I)]
        return " | ".join(dict.fromkeys(errors[-2:])) if errors else explain_log(log_path)

    def kv_cache_unfit(self, checkpoint: Path | dict, kv_cache: str) -> str | None:
        # a quantized type stores blocks of 32 values along each attention head: the server fails to
        # create its context for a head that is not a whole number of blocks
        if kv_cache in ("f16", "bf16"):
            return None
        config = model_config(checkpoint)
        head = head_size(config)
        if head % 32:
            return f"{kv_cache} stores blocks of 32 values along each attention head; this model's heads have {head}"
        return None

    def kv_cache_mb(self, log_path: Path) -> float | None:
        # "llama_kv_cache: size =   95.62 MiB (  8192 cells,  30 layers,  4/1 seqs), K (q8_0): ..."
        found = re.findall(r"llama_kv_cache: size =\s*([0-9.]+) MiB", log_path.read_text(errors="replace"))
        return float(found[-1]) if found else None

    def served_dtype(self, log_path: Path) -> str | None:
        """The file type of the GGUF the server was started with (its command line heads the log;
        llama-server itself does not print the type)."""
        try:
            found = re.search(r"--model (\S+)", log_path.read_text(errors="replace"))
        except OSError:
            return None
        return file_type(Path(found.group(1))) if found and Path(found.group(1)).is_file() else None

    def max_model_len(self, checkpoint: Path) -> int | None:
        gguf = gguf_file(checkpoint)
        if gguf is None:
            return super().max_model_len(checkpoint)
        from gguf import GGUFReader

        fields = GGUFReader(gguf).fields
        arch = fields["general.architecture"].contents()
        key = f"{arch}.context_length"
        return int(fields[key].contents()) if key in fields else None


def file_type(gguf: Path) -> str | None:
    """A GGUF's file type as llama-quantize names it (general.file_type: Q8_0, Q4_K_M, F16, ...)."""
    from gguf import GGUFReader, LlamaFileType

    field = GGUFReader(gguf).fields.get("general.file_type")
    if field is None:
        return None
    try:
        return LlamaFileType(int(field.contents())).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        return None


# ---------------------------------------------------------------------------------------------
# Running a tool, and an unquantized model as a GGUF


def imatrix(tools, base: Path, tokenizer, windows: list[list[int]], seq_len: int, folder: Path, log_path: Path) -> Path:
    """llama-imatrix of the GGUF `base` over token `windows` (decoded to text, one chunk per window):
    `folder/imatrix.gguf`, what `llama-quantize --imatrix` weighs each weight's rounding by."""
    folder.mkdir(parents=True, exist_ok=True)
    text = folder / "calibration.txt"
    text.write_text("".join(tokenizer.decode(w, skip_special_tokens=True) for w in windows))
    out = folder / "imatrix.gguf"
    run_tool(
        [tools.tool("llama-imatrix"), "-m", str(base), "-f", str(text), "-o", str(out), "-c", str(seq_len),
         "--chunks", str(len(windows)), "-t", str(threads()), "--no-ppl"],
        log_path, "llama-imatrix on the calibration text",
    )  # fmt: skip
    return out


def block(kind: str) -> int:
    """Weights per block of a ggml tensor type (256 for K-quants and IQ4_XS, 32 for Q4_0 ... IQ4_NL)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType[kind]][0]


def matrix_rows(gguf_file: Path) -> dict[str, int]:
    """Every 2-D tensor of a GGUF file, by name, with its row length (its input width)."""
    from gguf import GGUFReader

    return {t.name: int(t.shape[0]) for t in GGUFReader(gguf_file).tensors if len(t.shape) == 2}


def unfit(gguf_file: Path, layers: dict[str, list[str]]) -> list[str]:
    """The 2-D tensors of `gguf_file` that `layers` (tensor type -> llama-quantize patterns) gives a
    type whose blocks do not divide their rows, one line each. Matched as llama-quantize matches:
    the lower-cased pattern searched in the tensor's name, the first type whose pattern matches."""
    out = []
    for name, rows in matrix_rows(gguf_file).items():
        for kind, patterns in layers.items():
            if any(re.search(p.lower(), name) for p in patterns):
                if rows % block(kind):
                    out.append(f"{name} (rows of {rows}) in {kind} (blocks of {block(kind)})")
                break
    return out


def run_tool(cmd: list[str], log_path: Path, what: str) -> str:
    """Run one llama.cpp tool, its output appended to `log_path`; returns that output. UserError
    naming the tool's own error line when it fails."""
    log.info("%s: %s", what, " ".join(cmd))
    out = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    text = out.stdout + out.stderr
    with open(log_path, "a") as fh:
        fh.write(f"$ {' '.join(cmd)}\n{text}\n")
    if out.returncode != 0:
        lines = [x.strip() for x in text.splitlines() if x.strip()]
        errors = [x for x in lines if re.search(r"\b(error|failed|invalid|refus)", x, re.I)]
        raise UserError(
            f"{what}: {Path(cmd[0]).name} failed (exit code {out.returncode}): "
            f"{' | '.join((errors or lines)[-3:])} (log: {log_path})"
        )
    return text


def base_gguf(model_dir: Path, tools: build.Tools | None = None, log_path: Path | None = None) -> Path:
    """An unquantized model directory as an F16 GGUF file, made once and cached (keyed by the
    model's files and the build), its tokenizer verified against the model's own."""
    tools = tools or build.ensure("converting a model to GGUF")
    dest = base_gguf_path(model_dir)
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    log_path = log_path or dest.parent / "convert.log"
    partial = dest.with_suffix(f".{os.getpid()}.partial")
    source = source_gguf(model_dir)
    try:
        if source is not None:
            # converted by quantbench from this GGUF: llama.cpp's own reading of it, de-quantized
            run_tool(
                [tools.tool("llama-quantize"), "--allow-requantize", str(source), str(partial), BASE_TYPE],
                log_path, f"de-quantizing {source.name} to {BASE_TYPE} for llama.cpp",
            )  # fmt: skip
        else:
            if tools.source is None:
                raise UserError(
                    f"{model_dir}: converting it to GGUF needs llama.cpp's convert_hf_to_gguf.py, which "
                    f"${build.BIN_VAR} does not provide; unset it to let quantbench build llama.cpp"
                )
            with _converter_view(model_dir, dest.parent) as view:
                run_tool(
                    [sys.executable, str(tools.source / "convert_hf_to_gguf.py"), str(view),
                     "--outtype", BASE_TYPE.lower(), "--outfile", str(partial)],
                    log_path, f"converting {model_dir} to {BASE_TYPE} GGUF (convert_hf_to_gguf.py)",
                )  # fmt: skip
        verify_tokenizer(partial, model_dir)
        os.replace(partial, dest)
    finally:
        partial.unlink(missing_ok=True)
    log.info("GGUF of %s: %s", model_dir, dest)
    return dest


def base_gguf_path(model_dir: Path, fingerprint: str | None = None) -> Path:
    """Where `base_gguf` keeps a model directory's F16 GGUF, made or not yet (`fingerprint`: the
    model's, where the caller has it; else read or computed)."""
    key = f"{(fingerprint or known_fingerprint(model_dir))[:16]}-{build.VERSION}-{BASE_TYPE}"
    return cache_dir() / "gguf" / key / f"{model_dir.name}-{BASE_TYPE}.gguf"


@contextmanager
def _converter_view(model_dir: Path, scratch: Path):
    """The directory convert_hf_to_gguf.py should read. transformers' GGUF loader writes a byte-level
    BPE tokenizer (GPT-2 style: SmolLM2's) as tokenizer.json with `byte_fallback: true` and a
    SentencePiece-style decoder; every model made from such a base (a distilled student) inherits
    it, and llama.cpp's converter then takes the vocabulary for a Llama SentencePiece one (measured:
    the file's tokenizer prepended token 0 to every text). A byte-level tokenizer never falls back to
    bytes, so a view of the directory with `byte_fallback` off and the byte-level decoder alone is
    the same tokenizer (verify_tokenizer checks the file against the model's own)."""
    tokenizer_file = model_dir / "tokenizer.json"
    spec = json.loads(tokenizer_file.read_text()) if tokenizer_file.is_file() else {}
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    if not (model.get("type") == "BPE" and model.get("byte_fallback") and pre.get("type") == "ByteLevel"):
        yield model_dir
        return
    with tempfile.TemporaryDirectory(dir=scratch, prefix="convert-") as tmp:
        view = Path(tmp) / model_dir.name  # the converter names the model after its directory
        view.mkdir()
        for item in model_dir.iterdir():
            if item.name != "tokenizer.json":
                (view / item.name).symlink_to(item.resolve())
        spec["model"] = {**model, "byte_fallback": False}
        spec["decoder"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
        (view / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
        log.info("converting through a view of %s with its byte-level tokenizer's byte_fallback off", model_dir)
        yield view


def verify_tokenizer(gguf: Path, model_dir: Path) -> None:
    """The GGUF's tokenizer must give the model's own token ids on sample text (the default text's
    held-out split and a few hard strings): a file with another vocabulary is refused."""
    from transformers import AutoTokenizer

    own = AutoTokenizer.from_pretrained(model_dir)
    try:
        theirs = gguf_tokenizer(gguf)
    except Exception as exc:  # any failure to read it is the refusal's reason
        raise UserError(f"{gguf}: its tokenizer cannot be read ({type(exc).__name__}: {exc})") from None
    samples = [
        data.python_docs("evaluation")[:4000],
        "def f(x):\n\treturn x ** 2  # é ü 漢字 🙂\n\n",
        "  spaces   and\ttabs",
    ]
    for text in samples:
        a, b = own(text)["input_ids"], theirs(text)["input_ids"]
        if a != b:
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            raise UserError(
                f"{gguf}: its tokenizer does not reproduce {model_dir}'s: token {at} of a {len(text)}-character "
                f"sample differs ({a[at : at + 3]} vs {b[at : at + 3]}); llama.cpp's converter wrote another "
                "vocabulary for this model, so its GGUF would not be the same model"
            )


# ---------------------------------------------------------------------------------------------
# Quality through llama.cpp itself: llama-perplexity's KL divergence against the base's file

# llama-perplexity's summary lines; "±" values are standard errors
_ENGINE_STATS = {
    "kld_mean": re.compile(r"Mean\s+KLD:\s+(-?[\d.]+)\s+±\s+([\d.]+)"),
    "ppl_ratio": re.compile(r"Mean\s+PPL\(Q\)/PPL\(base\)\s*:\s*([\d.]+)\s+±\s+([\d.]+)"),
    "same_top_p": re.compile(r"Same top p:\s*([\d.]+)\s+±\s+([\d.]+)\s*%"),
}
# ... and its running line per chunk: chunk, PPL(Q), ln(PPL(Q)/PPL(base)), KLD, Δp RMS (%), same top p (%),
# each "value ± standard error", over every position so far. llama.cpp's logger is asynchronous and
# does not flush at exit (it leaks the logger on purpose, llama.cpp issue 22142): the summary printed
# last is lost on some runs (seen here: 2 of 4 identical runs), while the last chunk's line, printed
# before the summary is computed, holds the same means and standard errors.
_PM = r"(-?[\d.]+)\s+±\s+([\d.]+)"
_CHUNK_LINE = re.compile(rf"^\s*\d+\s+{_PM}\s+{_PM}\s+{_PM}\s+{_PM}\s*%\s+{_PM}\s*%\s*$", re.M)


def kld_stats(out: str) -> dict[str, tuple[float, float]] | None:
    """{name: (value, standard error)} from llama-perplexity --kl-divergence's output: its summary,
    else its last chunk line (the summary lost at exit); None when neither is there."""
    found = {name: pattern.search(out) for name, pattern in _ENGINE_STATS.items()}
    if all(found.values()):
        return {
            name: (float(m.group(1)) * (0.01 if name == "same_top_p" else 1.0),
                   float(m.group(2)) * (0.01 if name == "same_top_p" else 1.0))
            for name, m in found.items() if m is not None
        }  # fmt: skip
    rows = _CHUNK_LINE.findall(out)
    if not rows:
        return None
    _ppl, _ppl_se, ln_ratio, ln_se, kld, kld_se, _dp, _dp_se, top, top_se = map(float, rows[-1])
    # the summary's PPL ratio is exp(ln ratio) with the delta method's standard error
    return {
        "kld_mean": (kld, kld_se),
        "ppl_ratio": (math.exp(ln_ratio), math.exp(ln_ratio) * ln_se),
        "same_top_p": (top / 100, top_se / 100),
    }


def engine_quality(
    base: Path, candidate: Path, text: str, ctx: int, workdir: Path, log_path: Path, candidate_flags: Sequence[str] = ()
) -> dict[str, float]:
    """`quality_engine/*`: llama-perplexity on `text` in windows of `ctx` tokens (it scores the
    second half of each), the base's log-probabilities first (`--kl-divergence-base`), then the
    candidate against them (`--kl-divergence`, with `candidate_flags`: a KV-cache type): mean KLD,
    PPL ratio and the share of positions whose top token is the same, each with a 95 % interval
    (1.96 standard errors)."""
    tools = build.ensure("scoring through llama.cpp")
    workdir.mkdir(parents=True, exist_ok=True)
    text_file, logits = workdir / "engine-quality.txt", workdir / "engine-quality-base.kld"
    text_file.write_text(text)
    common = ["-f", str(text_file), "-c", str(ctx), "-b", str(ctx), "-t", str(threads()), "--kl-divergence-base"]
    try:
        run_tool([tools.tool("llama-perplexity"), "-m", str(base), *common, str(logits)], log_path,
                 "llama-perplexity: the base's log-probabilities")  # fmt: skip
        out = run_tool(
            [tools.tool("llama-perplexity"), "-m", str(candidate), *common, str(logits), "--kl-divergence",
             *candidate_flags],  # fmt: skip
            log_path, "llama-perplexity: the candidate's KL divergence",
        )  # fmt: skip
    finally:
        logits.unlink(missing_ok=True)  # n_tokens x vocab log-probabilities: hundreds of MB
        text_file.unlink(missing_ok=True)
    stats = kld_stats(out)
    if stats is None:
        raise UserError(f"llama-perplexity printed no KL divergence statistics (its output is in {log_path})")
    metrics: dict[str, float] = {}
    for name, (value, se) in stats.items():
        metrics |= {
            f"quality_engine/{name}": value,
            f"quality_engine/{name}.ci_low": value - 1.96 * se,
            f"quality_engine/{name}.ci_high": value + 1.96 * se,
        }
    return metrics
