"""Is a verdict stable? The same shipped recipe run N times (each `quantbench quantize` in its own
process, same seed), round-robin over the recipes so machine drift hits them alike; each run
evaluated (the recipe's suite, with intervals) and benched (--profile), then gated with each
policy. Printed, per recipe: the weights hash of every run, whether the quality metrics are
identical, every run's verdict per policy with the bounds it was decided on, and the speedups'
intervals; then the cost of the intervals: evaluate with intervals / evaluate without, from the
same runs' stage timings (evaluation.json: the stage's wall time less the baseline lookup, against
that less the interval computation).

Goals (issue 16): the same weights hash and identical quality metrics in every run (or the engine
step that varies named in docs/intervals.md), the same verdict in every run, intervals <= 1.10x.

    python bench/stability.py [--recipes fp8-dynamic awq-int4] [--runs 3] [--profile cpu-smoke]
                              [--policies release experimental] [--set calibration.samples=8]

The last line is a JSON object.
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
QUALITY = ("quality/", "quality_ood/", "task/", "recovery/")


def quantbench(args: list[str], env: dict) -> dict:
    proc = subprocess.run([sys.executable, "-m", "quantbench", *args, "--json"], cwd=REPO, env=env,
                          capture_output=True, text=True)
    if proc.returncode not in (0, 1) or not proc.stdout.strip():
        raise SystemExit(f"quantbench {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", default=["fp8-dynamic", "awq-int4"])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--profile", default="cpu-smoke", help="bench profile (profiles/NAME.yaml); 'none': no bench")
    parser.add_argument("--policies", nargs="+", default=["release", "experimental"])
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--summary", type=Path, help="only print the summary of an earlier run's runs.json")
    args = parser.parse_args()
    if args.summary:
        saved = json.loads(args.summary.read_text())
        args.runs, args.recipes, args.policies = saved["runs"], list(saved["found"]), saved["policies"]
        summarize(saved["found"], args, saved["seconds"])
        return

    from mlflow.tracking import MlflowClient

    tmp = Path(tempfile.mkdtemp(prefix="qb-stability-"))
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp}/mlflow.db", "MLFLOW_EXPERIMENT_NAME": "stability",
           "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    bench = [] if args.profile == "none" else ["--set", f"bench={{profile: {args.profile}}}"]
    found: dict[str, list[dict]] = {r: [] for r in args.recipes}
    started = time.perf_counter()
    for i in range(args.runs):
        for recipe in args.recipes:  # round-robin: drift hits every recipe alike
            t0 = time.perf_counter()
            made = quantbench(["quantize", recipe, "--outputs", str(tmp / "outputs"), *bench,
                               *[x for o in args.overrides for x in ("--set", o)]], env)
            run = client.get_run(made["run_id"])
            report = json.loads(Path(client.download_artifacts(made["run_id"], "evaluation.json", str(tmp))).read_text())
            verdicts = {}
            for policy in args.policies:
                gate = quantbench(["gate", made["run_id"], "--policy", policy], env)
                verdicts[policy] = {"passed": gate["passed"],
                                    "failed": sorted(c["check"] for c in gate["checks"] if not c["passed"]),
                                    "held": {c["check"]: {"on": c["on"], "value": c["value"], "ci": [c["ci_low"], c["ci_high"]]}
                                             for c in gate["checks"] if c.get("ci_low") is not None}}
            found[recipe].append({"run": i + 1, "run_id": made["run_id"], "wall_s": time.perf_counter() - t0,
                                  "weights_sha": run.data.tags.get("quantbench.weights_sha"),
                                  "threads": run.data.tags.get("quantbench.torch_threads"),
                                  "metrics": run.data.metrics, "seconds": report["seconds"],
                                  "baseline_reused": report["baseline_reused"], "verdicts": verdicts})
            print(f"{recipe} run {i + 1}: {time.perf_counter() - t0:.0f} s, weights {found[recipe][-1]['weights_sha'][:16]}, "
                  + ", ".join(f"{p}: {'PASS' if v['passed'] else 'FAIL'}" for p, v in verdicts.items()), flush=True)
            saved = {"runs": args.runs, "policies": args.policies, "seconds": time.perf_counter() - started, "found": found}
            (tmp / "runs.json").write_text(json.dumps(saved))  # --summary reprints from it
    print(f"raw results: {tmp / 'runs.json'}")
    summarize(found, args, time.perf_counter() - started)


def summarize(found: dict[str, list[dict]], args, seconds: float) -> None:
    summary = {"runs": args.runs, "profile": args.profile, "overrides": args.overrides, "recipes": {}}
    print(f"\n{args.runs} runs of each recipe, round-robin, {seconds:.0f} s in all")
    for recipe, rows in found.items():
        hashes = {r["weights_sha"] for r in rows}
        quality = [{k: v for k, v in r["metrics"].items() if k.startswith(QUALITY)} for r in rows]
        identical = all(q == quality[0] for q in quality)
        differing = sorted({k for q in quality for k in q if any(o.get(k) != q.get(k) for o in quality)})
        verdicts = {p: [r["verdicts"][p]["passed"] for r in rows] for p in args.policies}
        speed = sorted(k.removesuffix(".ci_low") for k in rows[0]["metrics"] if k.startswith("speedup/") and k.endswith(".ci_low"))
        widths = {k: [(r["metrics"][k + ".ci_high"] / r["metrics"][k + ".ci_low"]) ** 0.5 - 1 for r in rows
                      if k + ".ci_low" in r["metrics"]] for k in speed}
        print(f"\n{recipe}: weights hash {'the same in every run' if len(hashes) == 1 else f'{len(hashes)} different'}; "
              f"quality metrics {'identical' if identical else 'differ: ' + ', '.join(differing[:8])}")
        for r in rows:
            m = r["metrics"]
            kld = f"{m['quality/kld_mean']:.4f} [{m.get('quality/kld_mean.ci_low', float('nan')):.4f}, " \
                  f"{m.get('quality/kld_mean.ci_high', float('nan')):.4f}]"
            dec = (f"{m['speedup/decode_tok_s']:.3f} [{m.get('speedup/decode_tok_s.ci_low', float('nan')):.3f}, "
                   f"{m.get('speedup/decode_tok_s.ci_high', float('nan')):.3f}]") if "speedup/decode_tok_s" in m else "—"
            print(f"  run {r['run']}: {r['weights_sha'][:16]}  ppl {m['quality/ppl']:.4f}  KLD {kld}  "
                  f"ood KLD {m.get('quality_ood/kld_mean', float('nan')):.4f}  decode x {dec}  "
                  + "  ".join(f"{p} {'PASS' if v['passed'] else 'FAIL (' + ', '.join(v['failed']) + ')'}"
                              for p, v in r["verdicts"].items()))
        for p, v in verdicts.items():
            print(f"  {p}: {'the same verdict in every run' if len(set(v)) == 1 else 'VERDICT CHANGED'} ({v})")
        for k, w in widths.items():
            if w:
                print(f"  {k}: interval half-width (geometric) {', '.join(f'±{x * 100:.1f}%' for x in w)}")
        costs = [(r["seconds"]["evaluate"] - r["seconds"]["baseline"])
                 / (r["seconds"]["evaluate"] - r["seconds"]["baseline"] - r["seconds"]["intervals"]) for r in rows]
        spent = ", ".join(f"{r['seconds']['intervals']:.2f}" for r in rows)
        scoring = ", ".join(f"{r['seconds']['evaluate'] - r['seconds']['baseline']:.0f}" for r in rows)
        print(f"  evaluate with intervals / without: {', '.join(f'{c:.4f}' for c in costs)} "
              f"(intervals {spent} s of {scoring} s scoring the candidate)")
        summary["recipes"][recipe] = {"same_weights": len(hashes) == 1, "weights_sha": sorted(hashes),
                                      "identical_quality": identical, "differing": differing,
                                      "verdicts": verdicts, "same_verdicts": all(len(set(v)) == 1 for v in verdicts.values()),
                                      "interval_cost": costs, "speedup_halfwidths": widths,
                                      "runs": [{k: r[k] for k in ("run_id", "weights_sha", "threads", "wall_s", "seconds",
                                                                   "baseline_reused", "verdicts")} for r in rows]}
    worst = max(c for r in summary["recipes"].values() for c in r["interval_cost"])
    print(f"\nintervals cost at most x{worst:.4f} of evaluate (goal <= 1.10: {'met' if worst <= 1.10 else 'NOT met'})")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
