#!/usr/bin/env python3
"""Per-layout loss / grad-norm differences against the one-GPU reference, from the metrics.jsonl files kept here
(also for the runs that the slot stopped before layout_check.py wrote its table).

    python3 compare_runs.py callA/conc_nvfp4 callA/conc_bf16 callA/seq_nvfp4 --after 4
    python3 compare_runs.py callC/mini_nvfp4 --after 3
"""
import argparse
import glob
import json
import os
import statistics


def load(d: str) -> dict[int, dict]:
    out = {}
    try:
        for line in open(os.path.join(d, "metrics.jsonl")):
            r = json.loads(line)
            if r.get("type") == "train":
                out[r["step"]] = r
    except FileNotFoundError:
        pass
    return out


ap = argparse.ArgumentParser()
ap.add_argument("roots", nargs="+")
ap.add_argument("--after", type=int, default=4, help="compare the steps after this one (the resumed checkpoint)")
a = ap.parse_args()
for root in a.roots:
    ref = load(os.path.join(root, "1"))
    for d in sorted(glob.glob(os.path.join(root, "*/"))):
        name = os.path.basename(d.rstrip("/"))
        if name == "1":
            continue
        m = load(d)
        steps = sorted(s for s in m if s in ref and s > a.after)
        if not steps:
            print(f"{root} {name}: no step after {a.after}")
            continue
        rel = max(abs(m[s]["loss"] - ref[s]["loss"]) / ref[s]["loss"] for s in steps)
        gn = max(abs(m[s]["grad_norm"] - ref[s]["grad_norm"]) / ref[s]["grad_norm"] for s in steps)
        tps = statistics.median([m[s]["tokens_per_s"] for s in steps[1:]]) if len(steps) > 1 else float("nan")
        print(f"{root} {name}: steps {steps[0]}-{steps[-1]}, max rel loss diff {rel:.2e}, grad norm {gn:.2e}, "
              f"median tokens/s {tps:,.0f}")
