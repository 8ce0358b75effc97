"""The offline GPU check's steps (docs/offline.md), run by `bash bench/gpu_check.sh --offline DIR`.

On one GPU (`--device cuda`, the default) or this CPU (`--device cpu`, what the CPU test runs), with
nothing but the node's packages and the wheelhouse on the path:
  1. the default model through awq-int4 and fp8-dynamic (the shipped recipes), and awq-int4 with its
     GPU budget on a GPU: quantized (llm-compressor picks the GPU itself), saved, reloaded on the
     device and scored with suites/offline.yaml (the default suite's quality passes, no lm-eval tasks)
     against the base model scored there too;
  2. CPU-GPU agreement: each recipe's KLD beside the interval of the same recipe's CPU run
     (bench/offline/cpu_figures.json, written by `--write-figures` on a CPU);
  3. scale: a random-weight model of Llama-3.1-8B's shape built on the device, W4A16 round-to-nearest
     and FP8-dynamic over every layer (wall time, peak device memory), AWQ on its first layers with a
     small calibration budget (per-layer time, projected to 256 x 512 tokens over every layer);
  4. speed: through a serving engine only where the node has one; else says what is needed.
Prints every step's elapsed time, a failing step by name, one table, then one JSON line.
Exit 2: no GPU (with --device cuda); 1: a step failed or a KLD fell outside the CPU interval.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib.util
import json
import platform
import sys
import tempfile
import time
from contextlib import contextmanager
from datetime import date
from pathlib import Path

import torch
from transformers import AutoTokenizer

from quantbench.core import environment, hardware
from quantbench.core.intervals import HIGH, LOW
from quantbench.core.measures import compare, reference
from quantbench.quality import stage as evaluate_stage
from quantbench.quality.suite import load_suite
from quantbench.quantize.llmcompressor import LLMCompressorQuantizer
from quantbench.recipe import load_recipe, resolve_recipe_path
from quantbench.recipe.methods import AWQSpec, FP8Spec, RTNSpec
from quantbench.sources import data, models
from quantbench.sources.checkpoint import load_model, weights_size_mb

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ROOT / "bench" / "offline" / "cpu_figures.json"
# The recipes' own comments give the GPU budget of awq-int4 (256 x 512 calibration tokens, 20 grid points)
GPU_BUDGET = {"awq-int4": ["calibration.samples=256", "calibration.seq_len=512", "quantize.n_grid=20"]}
# Llama-3.1-8B's shape (its config.json); the weights are random: time and memory do not depend on them
LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
METRICS = ("quality/kld_mean", "quality/top1_agreement", "quality/ppl", "quality_ood/kld_mean")


class Steps:
    """Each step prints its start and the elapsed time; a failure names the step."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.times: dict[str, float] = {}
        self.failed: str | None = None

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    @contextmanager
    def __call__(self, name: str):
        print(f"== [{self.elapsed():.0f} s] {name}", flush=True)
        start = time.perf_counter()
        try:
            yield
        except BaseException:
            self.failed = name
            print(f"gpu_check: FAILED at step: {name} (after {self.elapsed():.0f} s)", file=sys.stderr, flush=True)
            raise
        self.times[name] = round(time.perf_counter() - start, 1)
        print(f"   {name}: {self.times[name]:.1f} s", flush=True)


class Device:
    """Where the check computes, and how its time and memory are read there."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.cuda = name == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def peak_mb(self) -> float | None:
        """Peak GPU memory allocated since reset_peak (None on the CPU: a process's peak RSS never falls)."""
        return torch.cuda.max_memory_allocated() / 2**20 if self.cuda else None

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def describe(self) -> dict[str, str]:
        info = {
            "device": self.name,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpu": environment.describe()["cpu"],
            "cpu_class": hardware.cpu().klass,
        }
        if self.cuda:
            import subprocess

            props = torch.cuda.get_device_properties(0)
            driver = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
            ).stdout.strip()
            info |= {
                "gpu": props.name,
                "gpu_memory_gib": f"{props.total_memory / 2**30:.0f}",
                "capability": f"sm_{props.major}{props.minor}",
                "cuda": str(torch.version.cuda),
                "driver": driver,
            }
        for lib in ("transformers", "llmcompressor", "compressed-tensors"):
            info[lib] = environment.describe().get(f"version.{lib}", "missing")
        return info


@contextmanager
def timed(device: Device):
    """Wall seconds and peak device MB of the block, in the dict it yields ("s", "mb") once it ends."""
    took: dict = {}
    device.reset_peak()
    start = time.perf_counter()
    yield took
    device.sync()
    took["s"], took["mb"] = time.perf_counter() - start, device.peak_mb()


# ---------------------------------------------------------------------------------------------
# 1. the default model through the shipped recipes, scored on the device


def score_recipe(name: str, overrides: list[str], base, tokenizer, plan, refs, device: Device, work: Path) -> dict:
    """Quantize the base with recipes/<name>.yaml (+ overrides), save, reload on the device, score."""
    loaded = load_recipe(resolve_recipe_path(name, ROOT / "recipes"), overrides)
    spec = loaded.recipe
    quantizer = LLMCompressorQuantizer(spec.quantize)
    calibration = None
    if quantizer.calibrates:
        cal = spec.calibration
        text = data.load_text(cal.source, field="calibration.source", text_field=cal.text_field, hub_split=cal.split)
        calibration = data.recipe_windows(tokenizer, text, cal)
    compute = spec.model.computes_in()
    model = load_model(base.path, dtype=getattr(torch, compute))
    with timed(device) as quantized:
        quantizer.quantize(model, calibration)
    dest = work / (name + ("-" + hashlib.sha256(" ".join(overrides).encode()).hexdigest()[:8] if overrides else ""))
    quantizer.save(model, tokenizer, dest, spec.model.dtype)
    del model
    device.free()
    reloaded = load_model(dest, dtype=getattr(torch, hardware.compute_dtype_of(dest)), device_map=device.name).eval()
    suite = plan.suite.suite
    boot = plan.bootstrap
    with timed(device) as scored:
        comparison = compare(reloaded, plan.token_ids, suite.window, refs[0], suite.batch_size)
    metrics = comparison.metrics() | comparison.intervals(refs[0].nll, boot)
    if plan.ood_ids is not None:
        ood = compare(reloaded, plan.ood_ids, suite.window, refs[1], suite.batch_size)
        metrics |= ood.metrics("quality_ood/") | ood.intervals(refs[1].nll, boot, "quality_ood/")
    del reloaded
    device.free()
    return {
        "recipe": name,
        "overrides": overrides,
        "calibration": f"{len(calibration)} x {spec.calibration.seq_len}" if calibration else "none",
        "compute_dtype": compute,
        "quantize_s": round(quantized["s"], 2),
        "quantize_peak_mb": quantized["mb"],
        "score_s": round(scored["s"], 2),
        "size_mb": round(weights_size_mb(dest), 1),
        "metrics": {k: v for k, v in metrics.items() if k.split(".ci_")[0] in METRICS},
    }


def base_references(base, tokenizer, device: Device, suite_name: str):
    """The suite's plan and the base model's reference distributions, computed on the device in float32
    (as the evaluate stage scores every baseline)."""
    plan = evaluate_stage.prepare(load_suite(suite_name), tokenizer)
    suite = plan.suite.suite
    model = load_model(base.path, dtype=torch.float32, device_map=device.name).eval()
    ref = reference(model, plan.token_ids, suite.window, suite.batch_size)
    ref_ood = reference(model, plan.ood_ids, suite.window, suite.batch_size) if plan.ood_ids is not None else None
    del model
    device.free()
    return plan, (ref, ref_ood)


# ---------------------------------------------------------------------------------------------
# 2. CPU-GPU agreement


def agreement(rows: list[dict], figures: dict) -> list[dict]:
    """Each recipe scored on both: this device's KLD against the CPU run's value and 95 % interval."""
    out = []
    cpu_rows = {(r["recipe"], tuple(r["overrides"])): r for r in figures["recipes"]}
    for row in rows:
        cpu = cpu_rows.get((row["recipe"], tuple(row["overrides"])))
        if cpu is None:
            continue
        for metric in ("quality/kld_mean", "quality_ood/kld_mean"):
            lo, hi = cpu["metrics"].get(metric + LOW), cpu["metrics"].get(metric + HIGH)
            here = row["metrics"].get(metric)
            if lo is None or hi is None or here is None:
                continue
            out.append(
                {
                    "recipe": row["recipe"],
                    "metric": metric,
                    "cpu": cpu["metrics"][metric],
                    "cpu_interval": [lo, hi],
                    "here": here,
                    "inside": lo <= here <= hi,
                }
            )
    return out


# ---------------------------------------------------------------------------------------------
# 3. scale: Llama-3.1-8B's shape, random weights, built on the device


def random_llama(device: Device, layers: int, where: Path):
    """Built on the device in bfloat16; its config saved in `where`, which llm-compressor's oneshot
    reads back (`config.name_or_path`) before it quantizes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**LLAMA_8B, "num_hidden_layers": layers})
    config.save_pretrained(where)
    config.name_or_path = str(where)
    # oneshot with a dataset also loads a processor from there; the windows are token ids already, so a
    # one-word tokenizer stands in for Llama-3.1's (which is not carried)
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    stand_in = Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=stand_in, unk_token="<unk>").save_pretrained(where)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device.name):
            model = LlamaForCausalLM(config)  # post_init draws normal(0, 0.02) weights on the device
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def scale(
    device: Device, layers: int, awq_layers: int, awq_samples: int, awq_seq_len: int, awq_grid: int, work: Path
) -> dict:
    """Wall time and peak device memory of three schemes on an 8B-shaped model, through quantbench's quantizer."""
    out: dict = {"layers": layers, "shape": "Llama-3.1-8B (random weights)"}
    specs = {
        "W4A16 RTN": RTNSpec(method="rtn", scheme="W4A16", group_size=128),
        "FP8_DYNAMIC": FP8Spec(method="fp8", scheme="FP8_DYNAMIC"),
    }
    for label, spec in specs.items():
        with timed(device) as built:
            model = random_llama(device, layers, work / f"llama-8b-shape-{layers}")
        params = sum(p.numel() for p in model.parameters())
        quantizer = LLMCompressorQuantizer(spec)
        with timed(device) as quantized:
            quantizer.quantize(model, None)
        wall, peak = quantized["s"], quantized["mb"]
        out[label] = {"build_s": round(built["s"], 1), "wall_s": round(wall, 1), "peak_mb": peak, "params": params}
        print(f"   {label}: {params / 1e9:.2f} B parameters, {wall:.1f} s, peak {peak or 0:.0f} MB", flush=True)
        del model, quantizer
        device.free()
    model = random_llama(device, awq_layers, work / f"llama-8b-shape-{awq_layers}")
    spec = AWQSpec(method="awq", group_size=128, n_grid=awq_grid)
    gen = torch.Generator().manual_seed(0)
    windows = torch.randint(0, LLAMA_8B["vocab_size"], (awq_samples, awq_seq_len), generator=gen).tolist()
    with timed(device) as quantized:
        LLMCompressorQuantizer(spec).quantize(model, windows)
    wall, peak = quantized["s"], quantized["mb"]
    per_layer = wall / awq_layers
    budget = 256 * 512 / (awq_samples * awq_seq_len)  # the GPU budget of awq-int4, in tokens, over this run's
    out["AWQ W4A16"] = {
        "layers": awq_layers,
        "calibration": f"{awq_samples} x {awq_seq_len}",
        "n_grid": awq_grid,
        "wall_s": round(wall, 1),
        "peak_mb": peak,
        "per_layer_s": round(per_layer, 2),
        "projected_256x512_s": round(per_layer * budget * LLAMA_8B["num_hidden_layers"], 0),
    }
    del model
    device.free()
    return out


# ---------------------------------------------------------------------------------------------
# 4. speed


def speed_engine() -> str:
    """The serving engine this node has, or what speed here needs."""
    if importlib.util.find_spec("vllm") is not None:
        return "vllm"
    return (
        "no serving engine here: speed on this node needs vLLM (its wheel and its own torch, several hundred MB: "
        "not carried) or llama.cpp built for sm_90 (docs/offline.md: its source and build time); "
        "`bash bench/gpu_check.sh` on a connected GPU machine measures it through vLLM"
    )


# ---------------------------------------------------------------------------------------------


def table(rows: list[dict], agreed: list[dict], scaled: dict | None, engine: str) -> str:
    lines = [
        f"{'recipe':24s} {'calib':>9s} {'quant s':>8s} {'KLD':>8s} {'KLD 95 %':>19s} {'top-1':>7s} {'ppl':>7s} "
        f"{'CPU KLD 95 %':>19s} {'agree':>6s}"
    ]
    cpu = {a["recipe"]: a for a in agreed if a["metric"] == "quality/kld_mean"}
    for r in rows:
        m = r["metrics"]
        name = r["recipe"] + (
            " (GPU budget)" if any(o in GPU_BUDGET.get(r["recipe"], []) for o in r["overrides"]) else ""
        )
        lo, hi = m.get("quality/kld_mean" + LOW, float("nan")), m.get("quality/kld_mean" + HIGH, float("nan"))
        interval = f"[{lo:.4f}, {hi:.4f}]"
        a = cpu.get(r["recipe"]) if not r["overrides"] else None
        cpu_cell = f"[{a['cpu_interval'][0]:.4f}, {a['cpu_interval'][1]:.4f}]" if a else "-"
        lines.append(
            f"{name:24s} {r['calibration']:>9s} {r['quantize_s']:8.1f} {m['quality/kld_mean']:8.4f} {interval:>19s} "
            f"{m['quality/top1_agreement']:7.3f} {m['quality/ppl']:7.2f} {cpu_cell:>19s} "
            f"{('yes' if a['inside'] else 'NO') if a else '-':>6s}"
        )
    if scaled:
        lines.append("")
        lines.append(f"scale: {scaled['shape']}, {scaled['layers']} layers")
        for label in ("W4A16 RTN", "FP8_DYNAMIC"):
            s = scaled[label]
            peak = f"{s['peak_mb'] / 1024:.1f} GiB" if s["peak_mb"] else "(CPU)"
            lines.append(f"  {label:12s} {s['wall_s']:7.1f} s   peak {peak}   ({s['params'] / 1e9:.2f} B parameters)")
        a = scaled["AWQ W4A16"]
        lines.append(
            f"  AWQ W4A16    {a['per_layer_s']:7.2f} s a layer ({a['layers']} layers, {a['calibration']}, n_grid "
            f"{a['n_grid']}); projected to 256 x 512 over 32 layers: {a['projected_256x512_s'] / 60:.1f} min"
        )
    lines.append("")
    lines.append(f"speed: {engine}")
    return "\n".join(lines)


def overrides_for(recipe: str, items: list[str]) -> list[str]:
    """The --set items that apply to `recipe`: KEY=VALUE, and RECIPE:KEY=VALUE naming it."""
    out = []
    for item in items:
        name, sep, rest = item.partition(":")
        if not sep or "=" in name:
            out.append(item)
        elif name == recipe:
            out.append(rest)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--recipes", nargs="*", default=["awq-int4", "fp8-dynamic"], help="none: no default-model step")
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct", help="the base model (a model source)")
    parser.add_argument("--suite", default="offline")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        dest="overrides",
        help="KEY=VALUE for every recipe, RECIPE:KEY=VALUE for one",
    )
    parser.add_argument("--gpu-budget", choices=["auto", "yes", "no"], default="auto", help="auto: on a GPU")
    parser.add_argument("--figures", type=Path, default=FIGURES, help="the CPU run's figures to agree with")
    parser.add_argument("--write-figures", type=Path, help="write this run's figures as the CPU figures")
    parser.add_argument("--scale-layers", type=int, default=32, help="0: no scale step")
    parser.add_argument("--awq-layers", type=int, default=2)
    parser.add_argument("--awq-calibration", default="16x512", help="samples x seq_len of the scale step's AWQ")
    parser.add_argument("--awq-grid", type=int, default=20)
    parser.add_argument("--work", type=Path, help="where checkpoints go (default: a temporary directory)")
    args = parser.parse_args(argv)

    steps = Steps()
    device = Device(args.device)
    with steps("device"):
        if device.cuda and not torch.cuda.is_available():
            print(
                f"gpu_check: torch {torch.__version__} sees no CUDA GPU (--device cpu runs the CPU-possible steps)",
                file=sys.stderr,
            )
            return 2
        info = device.describe()
        print("   " + ", ".join(f"{k} {v}" for k, v in info.items()), flush=True)
    work_dir = tempfile.TemporaryDirectory(prefix="gpu-check-") if args.work is None else None
    work = args.work or Path(work_dir.name)
    rows: list[dict] = []
    runs = [(name, overrides_for(name, args.overrides)) for name in args.recipes]
    if args.gpu_budget == "yes" or (args.gpu_budget == "auto" and device.cuda):
        runs += [
            (name, overrides_for(name, args.overrides) + GPU_BUDGET[name])
            for name in args.recipes
            if name in GPU_BUDGET
        ]
    if runs:
        with steps("the base model"):
            base = models.resolve(args.model)
            tokenizer = AutoTokenizer.from_pretrained(base.path)
        with steps(f"the base model's reference distributions (suite {args.suite}, float32, {device.name})"):
            plan, refs = base_references(base, tokenizer, device, args.suite)
    for name, overrides in runs:
        label = name + (" with " + " ".join(overrides) if overrides else "")
        with steps(f"quantize {label}, reload, score on {device.name}"):
            rows.append(score_recipe(name, overrides, base, tokenizer, plan, refs, device, work))
            m = rows[-1]["metrics"]
            print(f"   KLD {m['quality/kld_mean']:.4f}, quantized in {rows[-1]['quantize_s']:.1f} s", flush=True)
    agreed: list[dict] = []
    if args.write_figures is None and args.figures.is_file():
        with steps(f"CPU-{device.name} agreement ({args.figures.name})"):
            agreed = agreement(rows, json.loads(args.figures.read_text()))
    scaled = None
    if args.scale_layers:
        samples, seq_len = (int(x) for x in args.awq_calibration.split("x"))
        with steps(f"scale: Llama-3.1-8B's shape on {device.name}"):
            scaled = scale(device, args.scale_layers, args.awq_layers, samples, seq_len, args.awq_grid, work)
    with steps("speed"):
        engine = speed_engine()
    summary = {
        "check": "gpu_check --offline",
        "date": date.today().isoformat(),
        "environment": info,
        "model": args.model,
        "suite": args.suite,
        "recipes": rows,
        "agreement": agreed,
        "scale": scaled,
        "speed": engine,
        "seconds": steps.times,
        "total_s": round(steps.elapsed(), 1),
    }
    if args.write_figures:
        args.write_figures.parent.mkdir(parents=True, exist_ok=True)
        kept = {k: summary[k] for k in ("date", "environment", "model", "suite", "recipes", "seconds")}
        args.write_figures.write_text(json.dumps(kept, indent=1) + "\n")
        print(f"wrote {args.write_figures}")
    print()
    print(table(rows, agreed, scaled, engine))
    print(json.dumps(summary))
    if work_dir is not None:
        work_dir.cleanup()
    outside = [a for a in agreed if not a["inside"]]
    if outside:
        print(
            "gpu_check: outside the CPU run's 95 % interval: "
            + ", ".join(f"{a['recipe']} {a['metric']} {a['here']:.4f} not in {a['cpu_interval']}" for a in outside),
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
