"""The memory and disk a quantize job needs, planned from the model's config and the recipe before
anything is loaded, and refused (exit 2) where it cannot fit.

Each stage's peak resident memory is predicted as the sum of what it holds at once: the Python
runtime with its libraries, the model in the dtype it is loaded in, what the method adds (the
calibration activations a per-layer engine caches, GPTQ's Hessians, the compressed tensors while
saving), the activations of a pass over one window, and the processes it starts (llama.cpp's tools
map the files they read; servers hold their weights and KV cache). The constants are fitted to runs
measured on the size ladder (bench/scale.py, docs/results.md); every run logs the prediction
(`plan/<stage>/peak_rss_mb`) beside what it measured (`stage/<stage>/peak_rss_mb`), so drift shows.

The job holds one copy of the model at a time: the base is scored once (its perplexity in the base
check, its baseline before anything is quantized) and freed before the candidate is loaded.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from quantbench.core.errors import UserError
from quantbench.engines import GPU_SHARE_ALONE, GPU_SHARE_PAIR
from quantbench.quantize import ProduceFootprint
from quantbench.sources.shapes import GiB, MiB, Shape

# The process with torch, transformers, llm-compressor, lm-eval and MLflow imported, a tokenizer
# and the texts loaded: 0.6 GiB after the imports alone; fitted to the prepare stage of a 1B model
# (3.0 GiB measured with 2.0 GiB of weights and a window's logits).
RUNTIME = int(0.75 * GiB)

# what a stage holds as pages of a file it read once and no longer reads (see StagePlan.reclaimable):
# a checkpoint de-quantized as it loads (the check), or a base quantized without being written (a
# data-free method's produce), has its pages handed back to the kernel as it is read
# (core.files.pages_handed_back, every 0.25 s); what was read meanwhile stays. Measured at the peak,
# the libraries' own pages included: 1B FP8 0.35 GiB of file pages (produce and check), 8B FP8 0.55
# (produce) and 0.41 (check)
READ_ONCE = "the stored checkpoint's pages read meanwhile"
BASE_READ_ONCE = "the base's pages read meanwhile"
HANDED_BACK = int(0.25 * GiB)
# a mixture of experts' base: transformers 5 stacks the per-expert tensors into a copy as it loads,
# and the files' pages stay mapped while the other layers are views of them (the moe-8x rung:
# ~1.4 GiB of file pages beside the model's 1.2 GiB, with every stage planned ~1 GiB short before)
EXPERT_PAGES = "the experts' file pages, read once as they are stacked"
# what an evaluation leaves in the job's process for the stages after it: native allocations of its
# libraries (no live tensor; malloc_trim gives back 0.03 GiB) and pages of files they mapped, which a
# fresh process does not have (the moe-8x rung after `evaluate.suite=large`: 1.04 GiB anonymous where
# the prepare stage held 0.53, and 0.45 GiB more file pages; its in-process bench planned 32 % short)
EVALUATED = "what the evaluation left in this process"
EVALUATED_HELD = int(0.5 * GiB)
EVALUATED_PAGES = "pages of files the evaluation mapped"
EVALUATED_MAPPED = int(0.45 * GiB)
# the base's baseline for the suite, scored in the job before produce: its reference is kept in memory
# until the evaluation (the moe-8x rung's produce after its baseline, in-process: 0.3 GiB more
# anonymous memory than planned without it)
KEPT = "the base's reference, kept for the evaluation"
RECLAIMABLE = (READ_ONCE, BASE_READ_ONCE, EXPERT_PAGES, EVALUATED_PAGES)


@dataclass
class StagePlan:
    name: str
    ram: int  # peak resident memory of the process tree, bytes
    disk: int = 0  # left on disk by the stage (the checkpoint, cached files)
    temp_disk: int = 0  # held on disk meanwhile beyond that
    held: list[str] = field(default_factory=list)  # what makes up `ram`, for the table and refusals
    fits_with: list[str] = field(default_factory=list)  # settings that lower it, most effective first
    # of `ram`, pages of a file mapped and read once (a checkpoint de-quantized as it loads): the
    # kernel drops them under pressure instead of killing the job, so they do not decide the fit
    reclaimable: int = 0
    gpu: int = 0  # the least GPU memory its largest server needs (0: nothing on a GPU)
    gpu_limit: int = 0  # what that server may take of the GPU (its share of the GPU's memory)

    @property
    def needed(self) -> int:
        return self.ram - self.reclaimable

    def metrics(self) -> dict[str, float]:
        return {
            f"plan/{self.name}/peak_rss_mb": self.ram / MiB,
            f"plan/{self.name}/disk_mb": self.disk / MiB,
            f"plan/{self.name}/temp_disk_mb": self.temp_disk / MiB,
        }


@dataclass
class Footprint:
    stages: list[StagePlan]
    ram_available: int  # what the job can have: free memory now plus what this process holds
    disk_available: int
    outputs: Path
    shape: Shape | None = None  # what it was planned from
    # produce reads the base, loaded as views of its files, once and writes none: the job hands its
    # pages back as they are read (jobs/pipeline.py), and the plan counts what is read meanwhile
    reads_base_once: bool = False

    @property
    def peak(self) -> StagePlan:
        return max(self.stages, key=lambda s: s.ram)

    @property
    def tightest(self) -> StagePlan:
        """The stage that decides whether the job fits: the most memory the kernel cannot drop."""
        return max(self.stages, key=lambda s: s.needed)

    @property
    def disk(self) -> int:
        return sum(s.disk for s in self.stages) + max((s.temp_disk for s in self.stages), default=0)

    def metrics(self) -> dict[str, float]:
        out = {}
        for stage in self.stages:
            out |= stage.metrics()
        out["plan/peak_rss_mb"] = self.peak.ram / MiB
        out["plan/ram_available_mb"] = self.ram_available / MiB
        return out

    def lines(self) -> list[str]:
        """One line per stage, for the job's log beside the time estimate."""
        out = [
            f"memory plan (peak resident, this machine has {self.ram_available / GiB:.1f} GiB available; "
            f"disk {self.disk / GiB:.1f} GiB of {self.disk_available / GiB:.0f} GiB free at {self.outputs}):"
        ]
        for s in self.stages:
            disk = f", disk {s.disk / GiB:.2f} GiB" if s.disk else ""
            temp = f" (+{s.temp_disk / GiB:.2f} GiB meanwhile)" if s.temp_disk else ""
            dropped = f" ({s.reclaimable / GiB:.2f} of it file pages the kernel can drop)" if s.reclaimable else ""
            gpu = f"; on the GPU at least {gpu_line(s)}" if s.gpu else ""
            out.append(f"  {s.name:<9} {s.ram / GiB:6.2f} GiB  {'; '.join(s.held)}{dropped}{disk}{temp}{gpu}")
        return out

    def problems(self, where: str) -> list[str]:
        """Why the job cannot fit here (memory, disk), naming what would make it fit; [] if it can."""
        problems = []
        for stage in self.stages:
            if stage.needed > self.ram_available:
                hint = f" Settings that make it fit: {'; '.join(stage.fits_with)}." if stage.fits_with else ""
                problems.append(
                    f"{where}: the {stage.name} stage needs about {stage.needed / GiB:.1f} GiB of memory "
                    f"({'; '.join(stage.held)}), and this machine has {self.ram_available / GiB:.1f} GiB "
                    f"available: the job would be killed part-way.{hint}"
                )
            if stage.gpu > stage.gpu_limit:
                problems.append(
                    f"{where}: {gpu_refusal(stage)}, after every stage before it. Settings that make it fit: "
                    "--set bench=null (no bench); a bench on a GPU with more memory (`quantbench bench RUN` there)."
                )
        if self.disk > self.disk_available:
            problems.append(
                f"{where}: the job writes about {self.disk / GiB:.1f} GiB ({', '.join(f'{s.name} {s.disk / GiB:.1f}' for s in self.stages if s.disk)} "
                f"GiB, and {max(s.temp_disk for s in self.stages) / GiB:.1f} GiB meanwhile) and {self.outputs} has "
                f"{self.disk_available / GiB:.1f} GiB free. Free space there, or pass --outputs DIR on a larger disk."
            )
        return problems


MEMORY_VAR = "QUANTBENCH_MEMORY_GIB"


def available_ram() -> int:
    """Memory a job started now can have: what the system calls available plus what this process
    already holds (the job runs in it), within the container's limit (cgroup v2 `memory.max`, which
    the system's figure does not show), and within QUANTBENCH_MEMORY_GIB when set (plan for a share
    of the machine, or for a smaller one)."""
    rss = psutil.Process().memory_info().rss
    limits = [psutil.virtual_memory().available + rss]
    try:
        text = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if text != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            limits.append(int(text) - used + rss)
    except (OSError, ValueError):
        pass
    if os.environ.get(MEMORY_VAR):
        try:
            cap = float(os.environ[MEMORY_VAR])
        except ValueError:
            cap = math.nan
        if not math.isfinite(cap) or cap <= 0:
            raise UserError(f"{MEMORY_VAR}={os.environ[MEMORY_VAR]!r}: give the memory a job may use in GiB, e.g. 16")
        limits.append(int(cap * GiB))
    return min(limits)


def free_disk(path: Path) -> int:
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return shutil.disk_usage(existing).free


def gpu_line(stage: StagePlan) -> str:
    """What a stage's largest server needs of the GPU, against what it may take."""
    return f"{stage.gpu / GiB:.1f} GiB for one server, which may take {stage.gpu_limit / GiB:.1f} GiB of this GPU"


def gpu_refusal(stage: StagePlan) -> str:
    """Why a stage whose server does not fit its share of the GPU is refused."""
    return f"the {stage.name} stage needs on the GPU at least {gpu_line(stage)}: its server would not start"


def gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def _part(what: str, n: int) -> str:
    return f"{what} {n / GiB:.2f}"


def plan(
    shape: Shape,
    *,
    compute: str,
    saved: str,
    produce: ProduceFootprint,
    check_window: int,
    estimate_window: int | None,
    evaluation=None,  # quality.stage.Plan, or None
    baseline_cached: bool = True,
    base_checked: bool = False,
    bench=None,  # speed.bench.Plan, or None
    outputs: Path,
    gpu_total: int | None = None,  # the GPU's memory (hardware.cuda_memory), None without one
) -> Footprint:
    """Each stage's peak memory and disk, from the shapes alone (see the module's docstring)."""
    model_c = shape.weights(compute)
    pages = _expert_pages(shape)
    stages = []
    # prepare loads the base for its check (a window's pass) or the estimate (a calibration window),
    # one after the other; for neither where the check is cached and nothing is estimated (the 1B
    # AWQ and GPTQ jobs, base check cached: 2.80 GiB measured, 3.31 planned with the check's window)
    passes = [("a window", shape.window_activations(check_window))] * (not base_checked)
    if estimate_window:
        passes.append(("a calibration window", shape.window_activations(estimate_window)))
    prepared = bool(passes)
    held = [("runtime", RUNTIME)]
    if prepared:
        held += [(f"the base in {compute}", model_c), pages, max(passes, key=lambda part: part[1])]
    bf16 = "--set model.compute_dtype=bfloat16 (half the memory; slower where bfloat16 is emulated)"
    fits = [bf16] if compute == "float32" else []
    converting = [("runtime", RUNTIME), *produce.prepare_held]  # before the base is loaded, not beside it
    if sum(n for _, n in converting) > sum(n for _, n in held):
        held = converting
    stages.append(_stage("prepare", held, disk=produce.prepare_disk, fits_with=fits))
    if evaluation is not None and not baseline_cached:
        stages.append(baseline_stage(shape, evaluation))
    # the base's reference, scored in this job, is held from its baseline to the evaluation; read from
    # the store, it is a mapped file that only the evaluation reads (the 1B rung's RTN, GGUF, AWQ and
    # GPTQ jobs after fp8's baseline: their produce and check planned 0.39 GiB high, +16 to +23 %)
    kept = [] if evaluation is None or baseline_cached else [(KEPT, _reference_bytes(shape, evaluation))]
    # produce loads the base itself where prepare loaded none or the baseline let prepare's go
    loads_itself = not prepared or (evaluation is not None and not baseline_cached)
    base_held = _produce_base(shape, produce, compute, loads_itself)
    read_once = _reads_base_once(shape, produce, compute)
    stages.append(
        _stage(
            "produce",
            [("runtime", RUNTIME), *base_held, *produce.held, *kept],
            disk=produce.checkpoint,
            temp_disk=produce.temp_disk,
            fits_with=produce.fits_with + fits,
        )
    )
    # a compressed checkpoint is read as stored and de-quantized by its first forward pass (1B FP8:
    # 0.5 GiB after loading, 3.7 after one pass before its pages were handed back, 2.9 since)
    check = [
        ("runtime", RUNTIME),
        (READ_ONCE, min(produce.checkpoint, HANDED_BACK)),
        (f"its weights de-quantized to {compute}", model_c),
        *produce.reload_held,
        ("a window", shape.window_activations(check_window)),
        *kept,
    ]
    stages.append(_stage("check", check, fits_with=fits))
    if evaluation is not None:
        suite = evaluation.suite.suite
        held = [  # the check's model, its stored pages handed back there
            ("runtime", RUNTIME),
            (f"its weights de-quantized to {compute}", model_c),
            ("the base's reference", _reference_bytes(shape, evaluation)),
            ("a batch of windows", shape.window_activations(suite.window, suite.batch_size)),
        ]
        stages.append(_stage("evaluate", held, fits_with=["evaluate.suite with a smaller batch_size or window"] + fits))
    available = available_ram()
    if bench is not None:
        evaluated = evaluation is not None
        stages.append(bench_stage(shape, bench, produce.checkpoint, compute, available, evaluated, gpu_total))
    return Footprint(stages, available, free_disk(outputs), outputs, shape, read_once)


def _produce_base(shape: Shape, produce: ProduceFootprint, compute: str, loads_itself: bool) -> list[tuple[str, int]]:
    """What produce holds of the base: nothing for a quantizer that reads files; for a data-free one
    on the base as views of its files (loaded in its stored dtype), its stacked experts and the pages
    read meanwhile, handed back as they are read (loading the base itself, the experts' pages it
    reads as it stacks them, handed back before the rest is read: the moe-8x rung's produce 1.98
    GiB, 0.73 of it file pages, against 1.78 planned with only what is read meanwhile); else the
    model in the compute dtype."""
    if not produce.takes_model:
        return []
    pages = _expert_pages(shape)
    if not _reads_base_once(shape, produce, compute):
        return [(f"the base in {compute}", shape.weights(compute)), pages]
    files = pages if loads_itself and pages[1] > HANDED_BACK else (BASE_READ_ONCE, HANDED_BACK)
    return [("the base's stacked experts", shape.expert_params * shape.stored_bytes), files]


def _reads_base_once(shape: Shape, produce: ProduceFootprint, compute: str) -> bool:
    """Produce reads the base once, loaded in its stored dtype as views of its files, and writes none."""
    views = shape.weights(compute) == shape.params * shape.stored_bytes
    return produce.takes_model and produce.reads_base_once and views


def baseline_stage(shape: Shape, evaluation) -> StagePlan:
    """The base's reference distributions for the suite: the base as stored, computed in float32 one
    module at a time (core/upcast.py), the reference kept as it grows, beside what the suite's
    libraries allocate as they run (what an evaluation leaves in the process after it; the baseline
    was 0.2-0.7 GiB over its plan without it on every rung: 1B 3.9 GiB against 3.6, 8B 16.8 against
    16.3, moe-8x 3.69 against 3.31)."""
    suite = evaluation.suite.suite
    held = [
        ("runtime", RUNTIME),
        ("the suite's libraries", EVALUATED_HELD),
        ("the base as stored", shape.params * shape.stored_bytes),
        _expert_pages(shape),
        ("one layer in float32", shape.layer_params * 4),
        ("a batch of windows", shape.window_activations(suite.window, suite.batch_size)),
        ("the reference kept", _reference_bytes(shape, evaluation)),
    ]
    return _stage("baseline", held, fits_with=["evaluate.suite with a smaller batch_size or window"])


def _stage(
    name: str, held: list[tuple[str, int]], disk: int = 0, temp_disk: int = 0, fits_with=(), gpu=(0, 0)
) -> StagePlan:
    return StagePlan(
        name,
        sum(n for _, n in held),
        disk,
        temp_disk,
        [_part(w, n) for w, n in held if n],
        list(fits_with),
        sum(n for w, n in held if w in RECLAIMABLE),
        *gpu,
    )


def _expert_pages(shape: Shape) -> tuple[str, int]:
    """A loaded mixture of experts' file pages beside its stacked experts (0 for a dense model)."""
    return EXPERT_PAGES, shape.expert_params * shape.stored_bytes


def _reference_bytes(shape: Shape, evaluation) -> int:
    """The base's final hidden states (float32) over the suite's texts and its output head."""
    tokens = len(evaluation.token_ids) + len(evaluation.ood_ids or [])
    return tokens * shape.hidden * 4 + shape.vocab * shape.hidden * 4


# both servers at once only with this share of the memory to spare: a server's weights are mapped
# files, its working set, which the kernel drops and re-reads under pressure, mid-measurement (the
# 8B rung's two llama-servers: 22.35 GiB measured, 22.18 planned besides pages the kernel can
# drop, of 22.3 available)
SERVERS_HEADROOM = 0.1


def bench_stage(
    shape: Shape,
    bench,
    checkpoint_bytes: int,
    compute: str,
    available: int,
    evaluated: bool = False,
    gpu_total: int | None = None,
) -> StagePlan:
    """Both models' servers at once (interleaved repetitions); where they do not fit together with
    SERVERS_HEADROOM to spare, or, on a GPU (`gpu_total` its memory), in the share of it each may take
    then, the bench is told to measure one model, then the other (bench.one_at_a_time), which may take
    more of the GPU. `evaluated`: an evaluation ran before it in the same process."""
    engine, profile = bench.engine, bench.profile
    runtime = [("runtime", RUNTIME)]
    if evaluated:
        runtime += [(EVALUATED, EVALUATED_HELD), (EVALUATED_PAGES, EVALUATED_MAPPED)]
    if engine.kind != "server":  # in-process: one model at a time, de-quantized
        held = [*runtime, (f"one model in {compute}", shape.weights(compute))]
        if engine.stacks_experts:
            held.append(_expert_pages(shape))
        return _stage("bench", held)
    longest = max([*profile.prompt_tokens, *profile.context_tokens, 0]) + profile.output_tokens + 64
    kv = 2 * shape.layers * shape.kv_dim * 2  # bytes per token of a 16-bit KV cache
    slots = profile.slots
    experts = shape.expert_params * 2  # in 16 bits, where the engine's loader stacks them
    base = engine.server_memory(shape.params * 2, kv, longest, slots, experts)
    bits = 8 * checkpoint_bytes / shape.params
    candidate = engine.server_memory(checkpoint_bytes, kv, longest, slots, experts, bits=bits)
    fits = ["a bench profile with fewer concurrent requests or shorter prompts"]
    together = [*runtime, (f"the candidate's {engine.label} server", candidate),
                (f"the base's {engine.label} server", base)]  # fmt: skip
    gpu = pair = alone_gpu = 0
    if gpu_total:  # each server's weights and one request's KV cache at least (0: an engine on the CPU)
        gpu = max(engine.gpu_memory(shape.params * 2, kv, longest), engine.gpu_memory(checkpoint_bytes, kv, longest))
        pair, alone_gpu = int(GPU_SHARE_PAIR * gpu_total), int(GPU_SHARE_ALONE * gpu_total)
    in_ram = sum(n for w, n in together if w not in RECLAIMABLE) <= available * (1 - SERVERS_HEADROOM)
    if in_ram and gpu <= pair:
        return _stage("bench", together, fits_with=fits, gpu=(gpu, pair))
    bench.one_at_a_time = True
    alone = [*runtime, (f"one {engine.label} server at a time (the base's)", max(base, candidate))]
    return _stage("bench", alone, fits_with=fits, gpu=(gpu, alone_gpu))


def produce_footprint(quantizer, shape: Shape, loaded, compute: str) -> ProduceFootprint:
    """The quantizer's own footprint of its produce step, or, for a quantizer that declares none, one
    more copy of the model in the compute dtype beside what it takes (an over-estimate)."""
    declared = quantizer.footprint(shape, loaded, compute)
    if declared is not None:
        return declared
    return ProduceFootprint(
        [("the method's own copy of the model", shape.weights(compute))],
        shape.params * 2,
        takes_model=quantizer.takes_model,
    )
