"""How well the Fisher proxy ranks layers against measured KLD, and what each costs, on the default
model (SmolLM2-135M), in one run.

Both measure every unit (q/k/v, o, gate/up, down of each of the 30 blocks: 120 units) with every
quantized scheme of `quantbench tune`'s default set (W4A16-G64, W4A16-G32, W8A8), on the same
held-back calibration windows:
  kld     measured: the unit alone fake-quantized, KL(base || perturbed) over the windows
  fisher  proxy: 1/2 sum F (W - Q(W))^2 from one backward pass per window
Printed: wall time of each (goal: measured <= 600 s on 2 cores, or the proxy's rho >= 0.8),
Spearman's rho of the proxy's unit ranking against the measured one for each scheme and pooled
over (unit, scheme), and the share of the measured top-10 units the proxy also puts in its
top 10. The last line is a JSON object.

    python bench/sensitivity_proxy.py [--windows 4] [--seq-len 256] [--fisher-windows 4] [--measured-from FILE]

--measured-from takes the JSON line of an earlier run with the same windows and reuses its
measured table (and time) instead of measuring again (15 minutes here), e.g. to check a change to
the proxy.

Run it alone (flock /work/heavy.lock ...): both timings are of a quiet machine only then.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

from scipy.stats import spearmanr

SCHEMES = ["W4A16-G64", "W4A16-G32", "W8A8", "BF16"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--fisher-windows", type=int, default=4)
    parser.add_argument("--measured-from", help="the JSON line of an earlier run: reuse its measured KLD")
    args = parser.parse_args()

    import torch
    from transformers import AutoTokenizer

    from quantbench.recipe import CalibrationSpec
    from quantbench.sources import data, models
    from quantbench.tune import sensitivity

    base = models.resolve(models_source := "builtin:smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(base.path)
    cal = CalibrationSpec()
    ids = tokenizer(data.python_docs("calibration"))["input_ids"]
    exclude = sensitivity._recipe_windows(len(ids), cal)
    windows = sensitivity.held_back_windows(ids, max(args.windows, args.fisher_windows), args.seq_len, 1, exclude)

    results, walls = {}, {}
    earlier = json.loads(open(args.measured_from).read().strip().splitlines()[-1]) if args.measured_from else None
    for method, count in (("fisher", args.fisher_windows), ("kld", args.windows)):
        settings = sensitivity.Settings(method=method, windows=count, seq_len=args.seq_len)
        if method == "kld" and earlier is not None:
            assert (earlier["windows"], earlier["seq_len"]) == (args.windows, args.seq_len), "other windows"
            walls[method] = earlier["kld_wall_s"]
            results[method] = sensitivity.Sensitivity("", True, settings, SCHEMES, results["fisher"].units,
                                                      earlier["measured"]["kld"], walls[method], "",
                                                      {"replay": earlier["replay"]})
            assert earlier["measured"]["units"] == [u.name for u in results["fisher"].units]
            print(f"kld     {walls[method]:7.1f} s  (reused from {args.measured_from})")
            continue
        started = time.perf_counter()
        results[method] = sensitivity.measure(base.path, windows[:count], SCHEMES, settings)
        walls[method] = time.perf_counter() - started
        print(f"{method:7s} {walls[method]:7.1f} s  ({count} x {args.seq_len} tokens, {len(results[method].units)} units)",
              flush=True)

    rhos, pooled_m, pooled_p = {}, [], []
    for i, scheme in enumerate(SCHEMES):
        if scheme == "BF16":
            continue
        m = [row[i] for row in results["kld"].kld]
        p = [row[i] for row in results["fisher"].kld]
        rhos[scheme] = float(spearmanr(m, p).statistic)
        pooled_m += m
        pooled_p += p
    rhos["pooled"] = float(spearmanr(pooled_m, pooled_p).statistic)
    top = {}
    for i, scheme in enumerate(SCHEMES[:1]):
        m = [row[i] for row in results["kld"].kld]
        p = [row[i] for row in results["fisher"].kld]
        best_m = set(sorted(range(len(m)), key=lambda k: -m[k])[:10])
        best_p = set(sorted(range(len(p)), key=lambda k: -p[k])[:10])
        top[scheme] = len(best_m & best_p) / 10
    for scheme, rho in rhos.items():
        print(f"Spearman rho (fisher vs measured KLD) {scheme:10s} {rho:.3f}")
    print(f"top-10 most sensitive units (W4A16-G64) shared: {top['W4A16-G64']:.0%}")
    print("most sensitive units (measured, W4A16-G64):", ", ".join(
        u.name for u, _ in sorted(zip(results["kld"].units, results["kld"].kld), key=lambda x: -x[1][0])[:5]))
    out = {"model": models_source, "windows": args.windows, "fisher_windows": args.fisher_windows, "seq_len": args.seq_len,
           "kld_wall_s": walls["kld"], "fisher_wall_s": walls["fisher"], "speedup": walls["kld"] / walls["fisher"],
           "rho": rhos, "top10_shared": top, "replay": results["kld"].extra.get("replay"),
           "torch": torch.__version__, "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
           "measured": {"units": [u.name for u in results["kld"].units], "kld": results["kld"].kld,
                        "fisher": results["fisher"].kld}}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
