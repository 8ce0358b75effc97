"""llama.cpp's tools as binaries quantbench builds and manages.

- **From a pinned source package.** PyPI has llama.cpp as source only: `llama-cpp-python`
  (MIT) vendors the whole llama.cpp tree (its tools, `convert_hf_to_gguf.py`, `gguf-py`), but
  its own build makes the library only. quantbench downloads that sdist with pip (pip's cache
  keeps it), builds the tools it needs with cmake (`TOOLS`) and keeps the binaries and the
  converter in quantbench's cache, `~/.cache/quantbench/llamacpp/<key>` (`$QUANTBENCH_LLAMACPP_DIR`
  moves it), one build per version and CPU variant shared by every checkout (the binaries are
  static). Created on first use, under a lock, with progress lines; `make llamacpp` does it ahead
  of time.
- **Portable, and recorded.** Never `-march=native` (a native build died with SIGILL on a
  machine of this kind): the ISA flags are named explicitly from the CPU's detected features
  (`variant()`: AVX2, AVX-512, AMX, ...), and the variant is part of the build key, so a checkout
  that moves to another CPU class builds again instead of running what that CPU cannot.
- `$QUANTBENCH_LLAMACPP_BIN` names a directory of llama.cpp binaries you built yourself instead;
  nothing is built then.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from quantbench.core import hardware
from quantbench.core.errors import UserError
from quantbench.core.paths import cache_dir

log = logging.getLogger(__name__)

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"  # vendors llama.cpp 0.5.0-dev (MIT)
TOOLS = ("llama-server", "llama-quantize", "llama-imatrix", "llama-perplexity", "llama-bench")
DIR_VAR = "QUANTBENCH_LLAMACPP_DIR"  # where the managed builds live
BIN_VAR = "QUANTBENCH_LLAMACPP_BIN"  # a directory of binaries you manage
STAMP = ".quantbench-llamacpp.json"
# what convert_hf_to_gguf.py needs beside itself (it imports gguf from gguf-py and its model
# classes from conversion/)
CONVERTER = ("convert_hf_to_gguf.py", "conversion", "gguf-py")
CMAKE_FIXED = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",  # explicit ISA flags instead (variant())
    "-DBUILD_SHARED_LIBS=OFF",  # binaries that run from wherever they are copied
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # would try a download
)


# ---------------------------------------------------------------------------------------------
# The build: which ISA, which flags


@dataclass(frozen=True)
class Variant:
    """The CPU variant the binaries are built for: a name and ggml's cmake ISA flags."""

    name: str
    flags: tuple[str, ...]


def variant(cpu: hardware.CPU | None = None) -> Variant:
    """The most a CPU with these features runs, as ggml's ISA options (never native detection)."""
    f = (cpu or hardware.cpu()).flags
    on: list[str] = []
    if "avx2" in f:
        on += ["AVX", "AVX2"] + [n for n, flag in (("FMA", "fma"), ("F16C", "f16c"), ("BMI2", "bmi2")) if flag in f]
        name = "avx2"
        if "avx512f" in f:
            on.append("AVX512")
            on += [n for n, flag in (("AVX512_VBMI", "avx512vbmi"), ("AVX512_VNNI", "avx512_vnni")) if flag in f]
            name = "avx512"
            if "avx512_bf16" in f:
                on.append("AVX512_BF16")
                name = "avx512-bf16"
            # not AMX: the vendored ggml's AMX kernels die with SIGILL at a tile instruction (seen on
            # an x86-64 with AMX, 2026-12-03: `tilezero` in tinygemm_kernel_amx, in every tool; how
            # ggml asks Linux for the tile state and where it keeps its tile configuration is what
            # llama.cpp pull request 26954 changes). The AVX-512 kernels run there.
    elif "avx" in f:
        on, name = ["AVX"], "avx"
    else:
        on, name = [], "baseline"
    every = ("AVX", "AVX2", "FMA", "F16C", "BMI2", "AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "AMX_TILE",
             "AMX_INT8", "AMX_BF16")  # fmt: skip
    return Variant(name, tuple(f"-DGGML_{n}={'ON' if n in on else 'OFF'}" for n in every))


def key(v: Variant | None = None) -> str:
    v = v or variant()
    text = json.dumps([PACKAGE, VERSION, TOOLS, CMAKE_FIXED, v.flags])
    return f"{VERSION}-{v.name}-{hashlib.sha256(text.encode()).hexdigest()[:10]}"


# ---------------------------------------------------------------------------------------------
# Where the tools are


@dataclass(frozen=True)
class Tools:
    bin: Path  # the directory holding TOOLS
    source: Path | None  # the directory holding CONVERTER (None: binaries of your own)
    version: str
    variant: str
    where: str

    def tool(self, name: str) -> str:
        return str(self.bin / name)

    def describe(self) -> str:
        return f"llama.cpp from {PACKAGE} {self.version}, {self.variant} build"


def home() -> Path:
    """The directory holding the managed builds."""
    if os.environ.get(DIR_VAR):
        return Path(os.environ[DIR_VAR]).expanduser()
    return cache_dir() / "llamacpp"


def missing_compilers() -> list[str]:
    """What a build needs and this machine lacks (cmake, a C and a C++ compiler)."""
    return [name for name in ("cmake", "c++", "cc") if shutil.which(name) is None]


def _stamp(directory: Path) -> dict | None:
    try:
        return json.loads((directory / STAMP).read_text())
    except (OSError, ValueError):
        return None


def find() -> tuple[Tools | None, str]:
    """The tools to use without building anything: (tools or None, where they are or why not)."""
    if os.environ.get(BIN_VAR):
        directory = Path(os.environ[BIN_VAR]).expanduser()
        missing = [t for t in TOOLS if not (directory / t).is_file()]
        if missing:
            return None, f"${BIN_VAR}={directory} lacks {', '.join(missing)}"
        return Tools(directory, None, "your own", "your own", f"${BIN_VAR}"), f"${BIN_VAR}={directory}"
    directory = home() / key()
    stamp = _stamp(directory)
    if stamp is None:
        return (
            None,
            f"not built yet for this CPU ({directory}); `make llamacpp` or the first command that needs it builds it",
        )
    return Tools(directory / "bin", directory / "src", stamp["version"], stamp["variant"], str(directory)), str(
        directory
    )


def ensure(why: str) -> Tools:
    """The tools, built first if missing. UserError (exit 2) naming the cause when they cannot be."""
    tools, note = find()
    if tools is not None:
        return tools
    if os.environ.get(BIN_VAR):
        raise UserError(f"{why}: llama.cpp: {note}; unset it to let quantbench build its own")
    missing = missing_compilers()
    if missing:
        raise UserError(
            f"{why}: llama.cpp is built from source here and needs a C/C++ compiler and cmake; missing: "
            f"{', '.join(missing)} (Debian/Ubuntu: `apt-get install build-essential cmake`; or pip install cmake)"
        )
    directory = home() / key()
    lock = FileLock(home() / f"{directory.name}.lock")
    try:
        home().mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except OSError as exc:
        raise UserError(f"llama.cpp cannot be built in {directory}: {exc.strerror or exc}") from None
    try:
        tools, _ = find()  # another process may have built it while this one waited
        if tools is None:
            build(directory, why)
            tools, note = find()
            if tools is None:
                raise UserError(f"{why}: llama.cpp was built but is not usable: {note}")
    finally:
        lock.release()
    return tools


# ---------------------------------------------------------------------------------------------
# Building


def build(directory: Path, why: str) -> None:
    """Download the source package, build TOOLS for this CPU's variant into `directory`; the
    output goes to `<directory>.build.log`. UserError naming the failing step (nothing left)."""
    v = variant()
    log_path = directory.parent / f"{directory.name}.build.log"
    jobs = os.cpu_count() or 1
    log.info(
        "llama.cpp: %s needs it; building %s from %s %s once for this CPU (%s variant, %d jobs) in %s: about 12 min "
        "on 2 cores (`make llamacpp` does this ahead of time; log: %s)",
        why, ", ".join(TOOLS), PACKAGE, VERSION, v.name, jobs, directory, log_path,
    )  # fmt: skip
    start = time.monotonic()
    shutil.rmtree(directory, ignore_errors=True)
    work = Path(tempfile.mkdtemp(prefix="llamacpp-build-", dir=directory.parent))
    try:
        with open(log_path, "w") as out:
            log.info("llama.cpp [1/4] downloading the source (%s==%s, pip's cache)", PACKAGE, VERSION)
            _run(
                [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps",
                 "--no-binary", ":all:", f"{PACKAGE}=={VERSION}", "-d", str(work)],
                out, log_path, "downloading the source",
            )  # fmt: skip
            [sdist] = work.glob("*.tar.gz")
            src = _extract(sdist, work / "src")
            log.info("llama.cpp [2/4] configuring (cmake, %s) (%.0f s so far)", v.name, time.monotonic() - start)
            _run(["cmake", "-S", str(src), "-B", str(work / "build"), *CMAKE_FIXED, *v.flags], out, log_path,
                 "configuring")  # fmt: skip
            log.info("llama.cpp [3/4] compiling (%.0f s so far)", time.monotonic() - start)
            cmd = ["cmake", "--build", str(work / "build"), "-j", str(jobs), "--target", *TOOLS]
            _run(cmd, out, log_path, "compiling", progress=start)
            log.info("llama.cpp [4/4] checking the binaries run (%.0f s so far)", time.monotonic() - start)
            (directory / "bin").mkdir(parents=True)
            for tool in TOOLS:
                shutil.copy2(work / "build" / "bin" / tool, directory / "bin" / tool)
            _run(
                [str(directory / "bin" / "llama-server"), "--version"], out, log_path, "running llama-server --version"
            )
            (directory / "src").mkdir()
            for name in CONVERTER:
                (shutil.copytree if (src / name).is_dir() else shutil.copy2)(src / name, directory / "src" / name)
            shutil.copy2(src / "LICENSE", directory / "LICENSE")
        seconds = time.monotonic() - start
        stamp = {"key": key(v), "package": f"{PACKAGE}=={VERSION}", "version": VERSION, "variant": v.name,
                 "flags": list(v.flags), "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "seconds": round(seconds),
                 "jobs": jobs}  # fmt: skip
        (directory / STAMP).write_text(json.dumps(stamp, indent=1))
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("llama.cpp: built in %.0f s (%s variant): %s", seconds, v.name, directory)


def _extract(sdist: Path, into: Path) -> Path:
    """The sdist's vendor/llama.cpp tree, extracted into `into`."""
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name]
        tar.extractall(into, members=members, filter="data")
    [root] = into.iterdir()
    return root / "vendor" / "llama.cpp"


_PERCENT = re.compile(r"^\[\s*(\d+)%\]")


def _run(cmd: list[str], out, log_path: Path, what: str, progress: float | None = None) -> None:
    out.write(f"$ {' '.join(cmd)}\n")
    out.flush()
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    except OSError as exc:
        raise UserError(f"llama.cpp cannot be built: {what}: {exc}") from None
    shown = -10
    assert proc.stdout is not None
    for line in proc.stdout:
        out.write(line)
        found = _PERCENT.match(line)
        if progress is not None and found and int(found.group(1)) >= shown + 10:
            shown = int(found.group(1))
            log.info("llama.cpp: compiling %d%% (%.0f s so far)", shown, time.monotonic() - progress)
    code = proc.wait()
    if code != 0:
        out.flush()
        lines = [x.strip() for x in log_path.read_text(errors="replace").splitlines() if x.strip()]
        first = next((x for x in lines if re.search(r"\berror\b|ERROR|Error:", x)), None)
        detail = first or " | ".join(lines[-3:])
        raise UserError(
            f"llama.cpp cannot be built: {what} failed (exit code {code}): {detail} (full log: {log_path}). "
            f"`make llamacpp` tries again; ${BIN_VAR} can name a directory of llama.cpp binaries instead"
        )
