"""What distillation buys on this machine, measured in one run (the shipped recipe).

1. `quantbench quantize distill-smollm2-half` (teacher: the default model, student: 15 of its 30
   layers) in a fresh store: training wall time and tokens/s; the student's perplexity and KLD to
   the teacher on held-out text before training (the pruned student) and after, and the ratios;
   then its evaluate and bench stages: decode speedup of the student over the teacher.
2. `quantbench bench --draft <that run>`: the teacher with the student as its speculative-decoding
   draft against the teacher alone: acceptance rate and decode speedup.

    python bench/distill.py [--steps 200] [--profile cpu-smoke] [--keep DIR]

--steps trims the training (e.g. 20 for a quick look); the goal printed is the issue's: training
must lower the student's KLD to the teacher clearly (after / before well below 1).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUANTBENCH = [sys.executable, "-m", "quantbench"]


def quantbench(args: list[str], cwd: Path, env: dict) -> dict:
    proc = subprocess.run([*QUANTBENCH, *args, "--json"], cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"quantbench {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the recipe's)")
    parser.add_argument("--profile", default="cpu-smoke", help="speed profile for bench and bench --draft")
    parser.add_argument("--keep", type=Path, default=None, help="keep the store and checkpoint in this dir")
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="qb-distill-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    for name in ("recipes", "suites", "profiles"):
        if not (root / name).exists():
            (root / name).symlink_to(REPO / name)
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}", "PYTHONWARNINGS": "ignore"}
    sets = ["--set", f"bench.profile={args.profile}"] + (["--set", f"quantize.steps={args.steps}"] if args.steps else [])

    started = time.perf_counter()
    result = quantbench(["quantize", "distill-smollm2-half", *sets], root, env)
    total = time.perf_counter() - started
    m = result["metrics"]
    spec = quantbench(["bench", "--draft", result["run_id"], "--profile", args.profile], root, env)["metrics"]

    print(f"\ndistill-smollm2-half on this machine ({m['distill/steps']:.0f} steps, "
          f"{m['distill/tokens']:.0f} tokens); run {result['run_id']} in {root}")
    print(f"whole job (train + save + reload + evaluate + bench): {total:7.1f} s")
    print(f"training:                 {m['distill/wall_s']:7.1f} s   {m['distill/tokens_per_s']:7.1f} tokens/s")
    print(f"student parameters:       {m['distill/student_params'] / 1e6:7.1f} M   teacher "
          f"{m['distill/teacher_params'] / 1e6:.1f} M   size {m['model/size_mb']:.1f} MB")
    print(f"{'':26s}{'before':>10s} {'after':>10s} {'after/before':>13s}")
    kld = m["distill/kld_after"] / m["distill/kld_before"]
    ppl = m["distill/ppl_after"] / m["distill/ppl_before"]
    print(f"{'KLD to the teacher':26s}{m['distill/kld_before']:10.3f} {m['distill/kld_after']:10.3f} {kld:13.3f}")
    print(f"{'perplexity (teacher ' + format(m['check/base_ppl'], '.1f') + ')':26s}"
          f"{m['distill/ppl_before']:10.4g} {m['distill/ppl_after']:10.4g} {ppl:13.4f}")
    print(f"goal: training lowers the KLD clearly (after/before <= 0.5): {'met' if kld <= 0.5 else 'NOT met'}")
    print(f"evaluate (suite default): KLD {m.get('quality/kld_mean', float('nan')):.3f}, top-1 agreement "
          f"{m.get('quality/top1_agreement', float('nan')):.3f}, ppl recovery {m.get('recovery/quality/ppl', float('nan')):.3f}")
    print(f"decode tok/s student / teacher:           {m.get('speedup/decode_tok_s', float('nan')):.3f}x "
          f"({m.get('speed/decode_tok_s', float('nan')):.1f} vs {m.get('base_speed/decode_tok_s', float('nan')):.1f})")
    print(f"speculative decoding, teacher + student draft: acceptance {spec['speed/spec_acceptance']:.3f}, "
          f"{spec['speed/spec_tokens_per_target_step']:.2f} tokens per teacher step, "
          f"{spec['speed/spec_decode_tok_s']:.1f} vs {spec['base_speed/spec_decode_tok_s']:.1f} tok/s alone = "
          f"{spec['speedup/spec_decode_tok_s']:.3f}x")


if __name__ == "__main__":
    main()
