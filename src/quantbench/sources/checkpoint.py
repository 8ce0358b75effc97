"""A checkpoint directory and what quantbench knows about it, shared by every stage: the info file
each quantize run writes into it (`quantbench.json`), which checkpoint a run id or a directory
names, whether this machine can load its format, its size, and the sizes of a loaded model.

A checkpoint also travels with its run: `upload` logs it as the run's `checkpoint/` artifact with
a content hash (`quantbench.checkpoint_sha`), and `local_checkpoint` finds a run's checkpoint on
this machine, or downloads that artifact once into the cache and verifies it against the hash, so
`evaluate`, `bench` and `run:`/`recipe:` sources work on a machine other than the one that made it.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from quantbench.core.errors import UserError
from quantbench.core.files import atomic_write, file_sha
from quantbench.core.paths import cache_dir
from quantbench.sources.verify import gguf_tokenizer
from quantbench.tracking import TAG, tracking_uri

log = logging.getLogger(__name__)

INFO = "quantbench.json"  # written by the quantize pipeline into every checkpoint
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")
RUN_ID = re.compile(r"[0-9a-f]{32}")
# quantization_config.quant_method -> the package transformers needs to load that format
FORMAT_PACKAGES = {
    "compressed-tensors": "compressed_tensors",
    "bitsandbytes": "bitsandbytes",
    "gptq": "gptqmodel",
    "awq": "gptqmodel",
    "gguf": "gguf",
}
ARTIFACT = "checkpoint"  # the run's artifact directory that holds the checkpoint
# What the quantize pipeline writes into quantbench.json, with the JSON type each field has (null
# too: not recorded). Later stages read some of them; a file edited by hand or written by another
# tool is checked once here, not met as a TypeError deep in a stage.
INFO_FIELDS: dict[str, type] = {
    "run_id": str,
    "recipe": str,
    "recipe_sha": str,
    "method": str,
    "scheme": str,
    "format": str,
    "loaders": str,
    "kv_cache": str,
    "base_model": dict,
    "base_model.source": str,
    "base_model.name": str,
    "base_model.fingerprint": str,
    "base_model.license": str,
    "parent_run": str,
    "weights_sha": str,
}
JSON_TYPES = {
    str: "a string",
    dict: "an object",
    list: "an array",
    int: "a number",
    float: "a number",
    bool: "a boolean",
}
RESTORE = "quantbench writes this file with the checkpoint: restore it, or remove it and name the base with --base"


def read_info(path: Path) -> dict:
    """What the quantize pipeline recorded about the checkpoint at `path` ({} for a foreign one)."""
    info = path / INFO
    if not info.is_file():
        return {}
    try:
        data = json.loads(info.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{info}: cannot read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise UserError(
            f"{info}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); {RESTORE}"
        ) from None
    if not isinstance(data, dict):
        raise UserError(f"{info}: not a JSON object (got {JSON_TYPES.get(type(data), 'null')}); {RESTORE}")
    problems = []
    for key, kind in INFO_FIELDS.items():
        *parents, leaf = key.split(".")
        section = data
        for part in parents:
            section = section.get(part) if isinstance(section, dict) else None
        value = section.get(leaf) if isinstance(section, dict) else None
        if value is not None and not isinstance(value, kind):
            problems.append(
                f"{info}: {key}: expected {JSON_TYPES[kind]} (or null), got {json.dumps(value)[:80]}; {RESTORE}"
            )
    if problems:
        raise UserError(problems)
    return data


def write_info(dest: Path, info: dict) -> None:
    (dest / INFO).write_text(json.dumps(info, indent=2))


@dataclass
class Target:
    """The checkpoint a later stage (evaluate, bench) works on, and the run it logs into."""

    checkpoint: Path
    run_id: str | None  # None: a checkpoint this tracking store has no run for
    base_source: str
    info: dict = field(default_factory=dict)


def resolve_target(target: str, tracker, base: str | None) -> Target:
    """`target` is a checkpoint directory, a GGUF file (with `base`) or an MLflow run id; `base`
    overrides the base model.
    The checkpoint's config and weight files are checked (load_config, check_weights)."""
    target_ = _resolve(target, tracker, base)
    load_config(target_.checkpoint, target)
    check_weights(target_.checkpoint, target)
    return target_


def _resolve(target: str, tracker, base: str | None) -> Target:

    path = Path(target)
    if path.is_file() and path.suffix == ".gguf":  # a GGUF file on its own (a download, llama.cpp's output)
        if not base:
            raise UserError(f"'{target}': a GGUF file on its own names no base model: give it with --base SOURCE")
        return Target(gguf_checkpoint(path, target), None, base, {})
    if path.exists():
        if not (path.is_dir() and (path / "config.json").is_file()):
            raise UserError(f"'{target}' is not a model directory (no config.json)")
        info = read_info(path)
        run_id = info.get("run_id")
        if run_id and tracker.existing(run_id) is None:
            run_id = None  # made against another tracking store: later stages log into a new run
        source = base or (info.get("base_model") or {}).get("source")
        if not source:
            raise UserError(f"'{target}' was not written by quantbench: name its base model with --base SOURCE")
        return Target(path, run_id, source, info)
    if not RUN_ID.fullmatch(target):
        raise UserError(f"'{target}' is neither a checkpoint directory, a .gguf file nor an MLflow run id")
    run = tracker.existing(target)
    if run is None:
        raise UserError(f"MLflow run '{target}' does not exist at the tracking store ({tracking_uri()})")
    tags = run.data.tags
    checkpoint = local_checkpoint(run, tags)
    if checkpoint is None:
        raise UserError(
            f"MLflow run '{target}' has no checkpoint on this machine (tag {TAG}checkpoint: "
            f"{tags.get(TAG + 'checkpoint') or 'none'}) nor a {ARTIFACT}/ artifact to download"
        )
    return Target(checkpoint, target, base or tags[TAG + "base_model"], read_info(checkpoint))


# ---------------------------------------------------------------------------------------------
# A checkpoint that travels with its run


def content_sha(path: Path) -> str:
    """sha256 over every file of a checkpoint directory: of the lines `<sha256 of the file>  <path
    relative to the directory>`, sorted by path (what `sha256sum` prints for each file)."""
    lines = []
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        lines.append(f"{file_sha(file)}  {file.relative_to(path).as_posix()}\n")
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def upload(run, directory: Path) -> str:
    """Log a checkpoint directory as the run's `checkpoint/` artifact and record its content hash
    (`quantbench.checkpoint_sha`), against which every download is verified. Returns the hash."""

    sha = content_sha(directory)
    log.info("logging the checkpoint as the run's artifact %s/ (content sha %s)", ARTIFACT, sha[:12])
    run.log_artifacts(directory, ARTIFACT)
    run.set_tags({TAG + "checkpoint_sha": sha})
    return sha


def local_checkpoint(run, tags: dict[str, str]) -> Path | None:
    """A run's checkpoint on this machine: the directory its `quantbench.checkpoint` tag names if
    that is here; else its `checkpoint/` artifact, downloaded once into the cache
    (QUANTBENCH_CACHE/checkpoints/) and verified against `quantbench.checkpoint_sha`; else None."""

    named = tags.get(TAG + "checkpoint")
    if named and (Path(named) / "config.json").is_file():
        return Path(named)
    if not run.has_artifact(f"{ARTIFACT}/config.json"):
        return None
    sha = tags.get(TAG + "checkpoint_sha")
    root = cache_dir() / "checkpoints"
    dest = root / f"{run.run_id}-{(sha or 'unverified')[:16]}"
    if (dest / "config.json").is_file():
        return dest  # renamed into place only once it was complete and verified
    root.mkdir(parents=True, exist_ok=True)
    partial = root / f".{dest.name}.{os.getpid()}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        log.info(
            "run %s: its checkpoint is not on this machine (%s); downloading its %s/ artifact",
            run.run_id,
            named or "no path recorded",
            ARTIFACT,
        )
        downloaded = run.download(ARTIFACT, partial)
        if sha is None:
            log.warning("run %s has no %scheckpoint_sha: its checkpoint cannot be verified", run.run_id, TAG)
        elif content_sha(downloaded) != sha:
            raise UserError(
                f"MLflow run '{run.run_id}': the downloaded {ARTIFACT}/ artifact's content hash "
                f"{content_sha(downloaded)[:16]} differs from the run's {TAG}checkpoint_sha {sha[:16]}: "
                "the artifact changed after it was logged, or the download is incomplete; nothing was kept"
            )
        try:
            os.rename(downloaded, dest)
        except OSError:  # another process put it there first
            if not (dest / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    log.info("run %s: checkpoint downloaded to %s", run.run_id, dest)
    return dest


# ---------------------------------------------------------------------------------------------
# GGUF checkpoints: one .gguf file (llama.cpp's format: weights, tokenizer and config in one
# file), beside it the config.json and tokenizer files transformers reads from that file (so the
# directory reads like any other: its quantization_config says `gguf` and names the file) and the card


def gguf_file(checkpoint: Path) -> Path | None:
    """The checkpoint's .gguf file, if it is a GGUF checkpoint (a directory holding one, or the file)."""
    if checkpoint.suffix == ".gguf" and checkpoint.is_file():
        return checkpoint
    found = sorted(checkpoint.glob("*.gguf")) if checkpoint.is_dir() else []
    return found[0] if found else None


def gguf_checkpoint(file: Path, field: str) -> Path:
    """A GGUF file on its own as a checkpoint directory like those quantbench writes: under the
    cache, keyed by the file's content, a link to the file with the config.json and tokenizer that
    transformers reads from it (its quantization_config naming the file and its type, from the
    file's `general.file_type`). Made once; re-linked when the same content is found elsewhere."""
    import gguf as gguf_py
    from gguf import GGUFReader

    check_gguf(file, field)
    file = file.resolve()
    view = cache_dir() / "gguf-checkpoints" / f"{file.stem}-{file_sha(file)[:16]}"
    link = view / file.name
    view.mkdir(parents=True, exist_ok=True)
    if not (link.is_symlink() and link.resolve() == file):  # the same content, from where it is now
        tmp = view / f".{file.name}.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(file)
        os.replace(tmp, link)  # another process doing the same at once: one link wins, whole
    if (view / "config.json").is_file():
        return view
    from transformers import AutoConfig

    field_ = GGUFReader(file).fields.get("general.file_type")
    try:
        kind = gguf_py.LlamaFileType(int(field_.contents())).name.removeprefix("MOSTLY_") if field_ else "unknown"
    except ValueError:
        kind = "unknown"
    try:
        config = AutoConfig.from_pretrained(view, gguf_file=file.name)
        tokenizer = gguf_tokenizer(link)
    except (ValueError, KeyError, OSError) as exc:
        raise UserError(f"{field}: transformers cannot read {file} ({type(exc).__name__}: {exc})") from None
    tokenizer.save_pretrained(view)
    data = config.to_dict() | {"quantization_config": {"quant_method": "gguf", "type": kind, "file": file.name}}
    atomic_write(view / "config.json", json.dumps(data, indent=2))  # last: its presence says the view is whole
    log.info("%s: a checkpoint view of it in %s (%s)", file, view, kind)
    return view


def load_kwargs(checkpoint: Path) -> dict:
    """What transformers' from_pretrained needs besides the directory: the GGUF file's name (it
    de-quantizes the file on load), or nothing."""
    gguf = gguf_file(checkpoint)
    return {"gguf_file": gguf.name} if gguf is not None else {}


# formats compressed-tensors 0.19 de-compresses into bfloat16 whatever the model's dtype
BF16_DECOMPRESSED = ("nvfp4-pack-quantized", "mxfp4-pack-quantized", "mxfp8-quantized")


def load_model(checkpoint: Path, **kwargs):
    """AutoModelForCausalLM.from_pretrained for any checkpoint directory quantbench writes. The
    floating-point formats (NVFP4, MXFP4, MXFP8) are de-compressed as they load and their weights
    put in the dtype asked for (bfloat16 to float32 is exact): kept compressed, or left in
    bfloat16, a model computing in float32 fails on its first matmul ('expected m1 and m2 to have
    the same dtype'). Their activations' quantization (NVFP4, MXFP4 W4A4) still applies."""
    import torch
    from transformers import AutoModelForCausalLM

    config = checkpoint / "config.json"
    quant = (json.loads(config.read_text()).get("quantization_config") or {}) if config.is_file() else {}
    stored = {quant.get("format"), *((g or {}).get("format") for g in (quant.get("config_groups") or {}).values())}
    if quant.get("quant_method") != "compressed-tensors" or not stored & set(BF16_DECOMPRESSED):
        return AutoModelForCausalLM.from_pretrained(checkpoint, **load_kwargs(checkpoint), **kwargs)
    from transformers.utils.quantization_config import CompressedTensorsConfig

    with warnings.catch_warnings():  # "You passed `quantization_config` ...": run_compressed is what we pass
        warnings.filterwarnings("ignore", message="You passed `quantization_config`")
        loaded = AutoModelForCausalLM.from_pretrained(
            checkpoint, quantization_config=CompressedTensorsConfig(run_compressed=False), **kwargs
        )
    model = loaded[0] if isinstance(loaded, tuple) else loaded
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.nn.Parameter) and weight.dtype in (torch.bfloat16, torch.float16, torch.float32):
            weight.data = weight.data.to(model.dtype)
    return loaded


def gguf_tensors(file: Path) -> list[tuple[str, str, int, int]]:
    """(name, type, elements, bytes) of every tensor in a GGUF file, as stored."""
    from gguf import GGUFReader

    return [(t.name, t.tensor_type.name, int(t.n_elements), int(t.n_bytes)) for t in GGUFReader(file).tensors]


def gguf_bits_per_weight(file: Path) -> float:
    """Stored bits per parameter of the repeating blocks' 2-D weights (the layers a recipe
    quantizes: not the embeddings, the output head, norms or biases), as the file stores them."""
    stored = params = 0
    for name, _, elements, size in gguf_tensors(file):
        if name.startswith("blk.") and name.endswith(".weight") and "norm" not in name:
            stored, params = stored + size, params + elements
    return 8 * stored / params


def quant_method(checkpoint: Path) -> str | None:
    """`quantization_config.quant_method` of a checkpoint (None: not quantized)."""
    config = json.loads((checkpoint / "config.json").read_text())
    return (config.get("quantization_config") or {}).get("quant_method")


def check_loadable(checkpoint: Path) -> None:
    """A checkpoint whose format needs a package that is missing: say which."""
    method = quant_method(checkpoint)
    package = FORMAT_PACKAGES.get(method)
    if package and importlib.util.find_spec(package) is None:
        raise UserError(
            f"'{checkpoint}' is a {method} checkpoint; loading it needs the package '{package}', which is not installed"
        )


def weights_sha(path: Path) -> str | None:
    """sha256 over every tensor in a checkpoint's safetensors files: each tensor's name, dtype, shape
    and bytes, in name order. Sharding and file metadata do not change it; one changed weight does.
    None when the checkpoint holds no safetensors file. A GGUF checkpoint: its file's sha256 (the
    file is written by llama-quantize, which is deterministic for the same input and type)."""
    gguf = gguf_file(path)
    if gguf is not None:
        return file_sha(gguf)

    import torch
    from safetensors import safe_open

    per_tensor: dict[str, str] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for name in handle.keys():
                tensor = handle.get_tensor(name).contiguous()
                digest = hashlib.sha256(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
                digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
                per_tensor[name] = digest.hexdigest()
    if not per_tensor:
        return None
    return hashlib.sha256("".join(f"{k}={v}\n" for k, v in sorted(per_tensor.items())).encode()).hexdigest()


def weights_size_mb(path: Path) -> float:
    """Bytes of the weight files in a checkpoint directory, in MiB."""
    return sum(p.stat().st_size for p in path.iterdir() if p.name.endswith(WEIGHT_SUFFIXES)) / 2**20


def skeleton(config):
    """The model a config describes, built on the meta device: every module and shape, no weights,
    nothing loaded or allocated. A quantized checkpoint's config gives its unquantized shapes."""
    import torch
    from transformers import AutoModelForCausalLM

    if hasattr(config, "quantization_config"):
        config = copy.deepcopy(config)
        del config.quantization_config
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def linear_layers(config) -> dict[str, tuple[int, int, bool]]:
    """name -> (in_features, out_features, has bias) of every Linear layer of a model with this
    config except its output head: the layers a quantization recipe may quantize (read from its
    `skeleton`)."""
    import torch

    model = skeleton(config)
    head = model.get_output_embeddings()
    return {
        name: (m.in_features, m.out_features, m.bias is not None)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and m is not head
    }


# safetensors dtype names -> bytes per element
_DTYPE_BYTES = {
    "F64": 8,
    "I64": 8,
    "U64": 8,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F4": 0.5,
    "F6_E2M3": 0.75,
    "F6_E3M2": 0.75,
}


def tensor_bytes(path: Path) -> dict[str, float]:
    """Bytes of every tensor in a checkpoint's safetensors files, read from their headers only."""
    out: dict[str, float] = {}
    for file in sorted(path.glob("*.safetensors")):
        with open(file, "rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(size))
        for key, meta in header.items():
            if key != "__metadata__":
                start, end = meta["data_offsets"]
                out[key] = float(end - start)
    return out


def bits_per_weight(path: Path) -> float | None:
    """`model/bits_per_weight`: stored bits per parameter over the quantizable layers (every
    Linear layer but the output head), scales, zero points, packing metadata and biases included;
    a layer left unquantized counts at its stored width. None when the checkpoint has no
    safetensors files or none of its tensors are named after its layers."""
    from transformers import AutoConfig

    gguf = gguf_file(path)
    if gguf is not None:
        return gguf_bits_per_weight(gguf)
    tensors = tensor_bytes(path)
    if not tensors:
        return None
    stored = params = 0.0
    for name, (fan_in, fan_out, _) in linear_layers(AutoConfig.from_pretrained(path)).items():
        prefix = name + "."
        size = sum(b for key, b in tensors.items() if key.startswith(prefix))
        if size:
            stored += size
            params += fan_in * fan_out
    return 8 * stored / params if params else None


def param_bytes(model, saved_dtype=None) -> int:
    """Bytes of a loaded model's unique tensors (tied weights counted once): in the dtype they are
    loaded in, or with `saved_dtype` (a torch dtype) the floating-point ones in that dtype, the
    size they have on disk whatever dtype this machine computes in."""
    seen = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        floating = saved_dtype is not None and tensor.is_floating_point()
        itemsize = saved_dtype.itemsize if floating else tensor.element_size()
        seen[tensor.data_ptr()] = tensor.numel() * itemsize
    return sum(seen.values())


def vocab_mismatch(a_tokenizer, b_tokenizer, a_config, b_config) -> str:
    """ "" when two models share a vocabulary (config size and every token id), else what differs
    (a distillation student and its teacher, a speculative draft and its target)."""
    if a_config.vocab_size != b_config.vocab_size:
        return f"vocab_size {b_config.vocab_size} vs {a_config.vocab_size}"
    a, b = a_tokenizer.get_vocab(), b_tokenizer.get_vocab()
    if a != b:
        differ = sorted(set(a.items()) ^ set(b.items()))
        return f"{len(differ)} token ids differ, e.g. {differ[:3]}"
    return ""


def load_config(path: Path, field: str = "model.source"):
    """A checkpoint dir's transformers config; a config that is not JSON, names an architecture
    transformers does not know, or asks for custom code (auto_map) is a UserError naming the file."""
    from transformers import AutoConfig

    config_file = path / "config.json"
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{field}: cannot read {config_file}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise UserError(
            f"{field}: {config_file} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
        ) from None
    if not isinstance(raw, dict):
        raise UserError(f"{field}: {config_file} is not a JSON object")
    if raw.get("auto_map"):
        raise UserError(
            f"{field}: {config_file} asks for custom model code (auto_map: {', '.join(sorted(raw['auto_map']))}); "
            "quantbench runs only architectures transformers ships (it never sets trust_remote_code)"
        )
    try:
        return AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, OSError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"{field}: transformers cannot read {config_file} (model_type "
            f"{raw.get('model_type', 'missing')!r}): {first[:300]}"
        ) from None


def check_gguf(gguf: Path, field: str) -> None:
    """A .gguf that the gguf reader cannot parse (truncated, not GGUF) is a UserError naming it."""
    from gguf import GGUFReader

    try:
        GGUFReader(gguf)
    except Exception as exc:  # the reader raises ValueError, struct and numpy errors on a bad file
        raise UserError(
            f"{field}: {gguf} is not a readable GGUF file ({type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0][:200] if str(exc).strip() else 'no detail'})"
        ) from None


def check_weights(path: Path, field: str = "model.source") -> None:
    """The weight files of a checkpoint dir are safetensors, whole: a truncated file, a missing
    shard or pickled weights (pytorch_model.bin, which runs code when loaded) are refused here,
    before any run starts. A GGUF checkpoint (quantbench's `method: gguf`) is its .gguf file,
    which must read as one."""
    gguf = gguf_file(path)
    if gguf is not None and not (path / "model.safetensors").exists():
        check_gguf(gguf, field)
        return
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError, TypeError):
            raise UserError(f"{field}: {index} is not a safetensors index (no weight_map)") from None
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise UserError(f"{field}: {path} is missing weight shards named in {index.name}: {', '.join(missing[:5])}")
        files = [path / s for s in shards]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        if pickles:
            raise UserError(
                f"{field}: {path} holds only pickled weights ({', '.join(pickles[:3])}); loading a pickle "
                "runs code, so quantbench reads safetensors only. Convert them first, e.g. "
                "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir2) where you trust the file"
            )
        raise UserError(f"{field}: {path} has no weight files (*.safetensors)")
    for file in files:
        problem = _safetensors_problem(file)
        if problem:
            raise UserError(f"{field}: {file} {problem}")


def _safetensors_problem(file: Path) -> str | None:
    """None for a whole safetensors file; else what is wrong (from its header and its size)."""
    size = file.stat().st_size
    try:
        with open(file, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                return f"is truncated ({size} bytes)"
            length = int.from_bytes(head, "little")
            if length > size - 8 or length > 100 * 2**20:
                return f"is truncated or not safetensors (header of {length:,} bytes in a file of {size:,})"
            header = json.loads(fh.read(length))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"is not a safetensors file ({type(exc).__name__})"
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)]
    need = 8 + length + max(ends, default=0)
    if need > size:
        return f"is truncated: its header describes {need:,} bytes, the file has {size:,}"
    return None
