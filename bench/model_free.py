"""Model-free quantization at size: quantbench's layer-at-a-time reading (quantize/model_free.py)
against llm-compressor's own `model_free_ptq` (a whole input file per job), on a size-ladder rung.

For each scheme, each path runs in a process of its own (one at a time) on the rung's safetensors
files: wall time, peak resident memory (the kernel's high-water mark, and the anonymous part
sampled every 0.2 s: file pages of a mapped file are counted in the first and are the kernel's to
drop), then the two outputs compared tensor by tensor (bit for bit). Printed: a row per scheme and
path, our figures as ratios of llm-compressor's, the goal (peak under 4 GiB at 8B), and the JSON
object as the last line. The rung is built once into the cache (bench/scale.py --clean frees it);
the outputs are removed after each comparison.

    python bench/model_free.py                                  # llama-3.1-8b, FP8_DYNAMIC and NVFP4A16
    python bench/model_free.py --rung llama-3.2-1b --schemes FP8_BLOCK
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from quantbench.core import hardware  # noqa: E402
from quantbench.sources import ladder, models  # noqa: E402

GiB = 2**30
GOAL_GIB = 4.0  # the bound on the 8B rung's peak


def _anon_peak(stop: threading.Event, peak: list[int]) -> None:
    while not stop.is_set():
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                peak[0] = max(peak[0], int(line.split()[1]) * 1024)
        stop.wait(0.2)


def child(path: str, scheme: str, source: Path, dest: Path) -> None:
    """One quantization in this process; prints its figures as JSON."""
    import torch
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from transformers import AutoConfig

    stop, peak = threading.Event(), [0]
    sampler = threading.Thread(target=_anon_peak, args=(stop, peak), daemon=True)
    sampler.start()
    started = time.perf_counter()
    if path == "quantbench":
        from quantbench.quantize import model_free, recipe_layers

        selected = {name for name, _, _ in recipe_layers(AutoConfig.from_pretrained(source), ["lm_head"])}
        config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(scheme, ["Linear"])}, ignore=["lm_head"])
        model_free.quantize_files(source, dest, config, selected, torch.bfloat16)
    else:
        from llmcompressor import model_free_ptq

        model_free_ptq(str(source), str(dest), scheme=scheme, ignore=["lm_head", "model.embed_tokens"], device="cpu")
    wall = time.perf_counter() - started
    stop.set()
    sampler.join()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"wall_s": round(wall, 1), "peak_rss_gib": round(peak_rss / GiB, 3), "peak_anon_gib": round(peak[0] / GiB, 3)}))


def same_tensors(a: Path, b: Path) -> tuple[int, list[str]]:
    """(tensors compared, names that differ), one tensor of each at a time."""
    import torch
    from safetensors import safe_open

    from quantbench.quantize.model_free import weight_map

    ours, theirs = weight_map(a), weight_map(b)
    if sorted(ours) != sorted(theirs):
        return len(ours), sorted(set(ours) ^ set(theirs))[:5]
    differ = []
    for name in ours:
        with safe_open(a / ours[name], framework="pt") as fa, safe_open(b / theirs[name], framework="pt") as fb:
            x, y = fa.get_tensor(name), fb.get_tensor(name)
        if x.dtype != y.dtype or not torch.equal(x, y):
            differ.append(name)
    return len(ours), differ


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rung", default="llama-3.1-8b", choices=sorted(ladder.RUNGS))
    parser.add_argument("--schemes", default="FP8_DYNAMIC,NVFP4A16")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], Path(args.child[2]), Path(args.child[3]))
        return 0

    print(f"# {hardware.device_line()}", flush=True)
    started = time.perf_counter()
    source = ladder.build(args.rung, models.resolve("builtin:smollm2-135m-instruct").path)
    print(f"# rung {args.rung}: {source} (ready in {time.perf_counter() - started:.0f} s)", flush=True)
    results = {}
    for scheme in args.schemes.split(","):
        row = {}
        with tempfile.TemporaryDirectory(dir=source.parent, prefix=".model-free-") as tmp:
            for path in ("llm-compressor", "quantbench"):
                dest = Path(tmp) / path
                dest.mkdir()
                done = subprocess.run(
                    [sys.executable, __file__, "--child", path, scheme, str(source), str(dest)],
                    capture_output=True, text=True,
                )  # fmt: skip
                if done.returncode:
                    print(done.stderr[-3000:], file=sys.stderr)
                    return 1
                row[path] = json.loads(done.stdout.strip().splitlines()[-1])
                row[path]["written_gib"] = round(sum(f.stat().st_size for f in dest.rglob("*.safetensors")) / GiB, 2)
                print(f"{scheme:12} {path:15} {json.dumps(row[path])}", flush=True)
            compared, differ = same_tensors(Path(tmp) / "quantbench", Path(tmp) / "llm-compressor")
            shutil.rmtree(tmp, ignore_errors=True)
        ours, theirs = row["quantbench"], row["llm-compressor"]
        row["tensors_compared"], row["tensors_differ"] = compared, len(differ)
        row["peak_rss_ratio"] = round(ours["peak_rss_gib"] / theirs["peak_rss_gib"], 3)
        row["wall_ratio"] = round(ours["wall_s"] / theirs["wall_s"], 3)
        row["goal_met"] = ours["peak_rss_gib"] < GOAL_GIB
        print(
            f"{scheme:12} quantbench / llm-compressor: peak {row['peak_rss_ratio']:.2f}x, time {row['wall_ratio']:.2f}x; "
            f"{compared} tensors, {len(differ)} differ{(' ' + ', '.join(differ[:3])) if differ else ''}; "
            f"peak {ours['peak_rss_gib']:.2f} GiB {'<' if row['goal_met'] else '>='} {GOAL_GIB} GiB",
            flush=True,
        )
        results[scheme] = row
    print(json.dumps({"rung": args.rung, "cpu": hardware.device_line(), "schemes": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
