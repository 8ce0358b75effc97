"""The tuned frontier against the shipped uniform recipes on the default model, from the runs in
the tracking store (measured by `quantbench tune` and `make quantize RECIPE=...` beforehand, same
suite, same machine).

Printed, one row per checkpoint sorted by size: kind (tuned / shipped), name, model/size_mb,
model/bits_per_weight, quality/kld_mean, predicted KLD (tuned), decode speedup when benched. Then
the goals of issue 14:
  dominance  every shipped recipe is dominated by a tuned checkpoint (at most as large, lower
             KLD), and no shipped recipe is both smaller and lower in KLD than any tuned one
  4.5 bits   the lowest KLD of a tuned checkpoint at model/bits_per_weight <= 4.5, over the best
             shipped uniform INT4 recipe's KLD (goal <= 0.6)
The last line is a JSON object.

    MLFLOW_TRACKING_URI=sqlite:///$PWD/mlflow.db python bench/tune_frontier.py [--experiment quantbench]

To fill the store: `make quantize RECIPE=<each shipped recipe>` (or a sweep of them) and e.g.
`quantbench tune --policy experimental --bits 4.5`, `... --bits 5`, `make tune POLICY=release`.
"""

from __future__ import annotations

import argparse
import json

INT4 = ("W4A16", "NF4", "FP4")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiment", default=None)
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    args = parser.parse_args()

    from quantbench.recipe import available_recipes
    from quantbench.sources import models
    from quantbench.tracking import TAG, Tracker
    from quantbench.tune.frontier import shipped_references

    tracker = Tracker(args.experiment)
    base = models.resolve(args.model)
    shipped = shipped_references(tracker, base.fingerprint)
    names = set(available_recipes())
    tuned = [r for r in tracker.search({TAG + "role": "candidate", TAG + "base_fingerprint": base.fingerprint})
             if TAG + "tune" in r.data.tags and "quality/kld_mean" in r.data.metrics]
    rows = []
    for kind, found in (("shipped", shipped), ("tuned", tuned)):
        for r in found:
            m = r.data.metrics
            rows.append({"kind": kind, "name": r.data.tags.get(TAG + "recipe"), "run_id": r.info.run_id,
                         "scheme": r.data.tags.get(TAG + "scheme"), "size_mb": m.get("model/size_mb"),
                         "bits_per_weight": m.get("model/bits_per_weight"), "kld": m["quality/kld_mean"],
                         "predicted_kld": m.get("tune/predicted_kld"), "decode_speedup": m.get("speedup/decode_tok_s")})
    rows.sort(key=lambda r: r["size_mb"])
    fmt = lambda v, f: "—" if v is None else format(v, f)  # noqa: E731
    print(f"{'kind':8s} {'name':36s} {'MiB':>7s} {'bits/w':>7s} {'KLD':>8s} {'pred':>8s} {'decode x':>8s}")
    for r in rows:
        print(f"{r['kind']:8s} {r['name'][:36]:36s} {fmt(r['size_mb'], '7.1f'):>7s} {fmt(r['bits_per_weight'], '7.3f'):>7s} "
              f"{r['kld']:8.4f} {fmt(r['predicted_kld'], '8.4f'):>8s} {fmt(r['decode_speedup'], '8.2f'):>8s}")
    t_rows = [r for r in rows if r["kind"] == "tuned"]
    s_rows = [r for r in rows if r["kind"] == "shipped"]
    beaten = {s["name"]: [t["name"] for t in t_rows if t["size_mb"] <= s["size_mb"] and t["kld"] < s["kld"]] for s in s_rows}
    beating = {t["name"]: [s["name"] for s in s_rows if s["size_mb"] < t["size_mb"] and s["kld"] < t["kld"]] for t in t_rows}
    print("\nshipped recipe -> a tuned checkpoint at most as large with lower KLD:")
    for name, by in beaten.items():
        print(f"  {name:24s} {'dominated by ' + by[0] if by else 'NOT dominated'}")
    print("tuned checkpoints beaten on both axes by a shipped recipe:",
          ", ".join(f"{t} (by {', '.join(s)})" for t, s in beating.items() if s) or "none")
    int4 = [s for s in s_rows if s["scheme"] in INT4]
    best_int4 = min(int4, key=lambda s: s["kld"]) if int4 else None
    small = [t for t in t_rows if t["bits_per_weight"] is not None and t["bits_per_weight"] <= 4.5]
    best_small = min(small, key=lambda t: t["kld"]) if small else None
    ratio = best_small["kld"] / best_int4["kld"] if best_small and best_int4 else None
    if ratio is not None:
        print(f"at <= 4.5 bits/weight: tuned {best_small['name']} KLD {best_small['kld']:.4f} vs best shipped INT4 "
              f"{best_int4['name']} {best_int4['kld']:.4f}: ratio {ratio:.3f} (goal <= 0.6)")
    missing = sorted(names - {s["name"] for s in s_rows})
    if missing:
        print("shipped recipes with no measured run in this store:", ", ".join(missing))
    print(json.dumps({"rows": rows, "shipped_dominated": {k: bool(v) for k, v in beaten.items()},
                      "tuned_beaten_by_shipped": {k: v for k, v in beating.items() if v},
                      "best_tuned_le_4_5_bits": best_small, "best_shipped_int4": best_int4, "ratio_le_4_5_bits": ratio,
                      "not_measured": missing}))


if __name__ == "__main__":
    main()
