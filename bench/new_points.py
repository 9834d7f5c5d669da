"""A fitted model's error on points measured after it was fitted: the rows of profile NEW whose ids profile OLD
(the one the model was fitted to) does not hold, per family, and the co-run prefill rows by split.

    python3 bench/new_points.py NEW_PROFILE [--old profiles/h200/llama-3.1-8b] [--model OLD/model.json] [-v]

E.g. the co-runner sweeps (bench/corun_sweep.py) against the shipped model: ``python3 bench/new_points.py
bench/data/h200-2026-12-03b/profile``. Error = predicted / measured - 1.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import numpy as np

from bullet.gpu.profile import read_points
from bullet.perfmodel.fit import FAMILY_ORDER, load_profile, predictions
from bullet.perfmodel.fitted import FittedModel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("new", type=Path, help="profile folder holding the new points")
    ap.add_argument("--old", type=Path, default=Path("profiles/h200/llama-3.1-8b"), help="the model's own profile")
    ap.add_argument("--model", type=Path, default=None, help="model JSON (default: OLD/model.json)")
    ap.add_argument("-v", action="store_true", help="every co-run point's error")
    args = ap.parse_args()
    for folder in (args.new, args.old):
        if not (folder / "points.csv").exists():
            ap.error(f"{folder}: no points.csv")
    old = {r["id"] for r in read_points(args.old / "points.csv")}
    fm = FittedModel.load(args.model or args.old / "model.json")
    errs: dict[str, list[float]] = defaultdict(list)
    by_split: dict[tuple[int, int], list[float]] = defaultdict(list)
    detail = []
    for r in load_profile(args.new).rows:
        if r["id"] in old:
            continue
        for fam, (pred, meas) in predictions(fm, r).items():
            e = 100 * (pred / meas - 1)
            errs[fam].append(e)
            if fam == "co-run prefill":
                by_split[(r["sms"], r["co_sms"])].append(e)
            if fam.startswith("co-run"):
                detail.append((fam, e, r["id"]))
    print(f"{sum(len(v) for v in errs.values())} predictions of points {args.new} holds and {args.old} does not")
    print("| family | points | MAPE % | bias % | p95 % |")
    print("|---|---:|---:|---:|---:|")
    for fam in FAMILY_ORDER:
        if errs.get(fam):
            e = np.array(errs[fam])
            print(f"| {fam} | {len(e)} | {np.abs(e).mean():.2f} | {e.mean():+.2f} | {np.percentile(np.abs(e), 95):.1f} |")
    print("\nco-run prefill by split (prefill / decode SMs): points, MAPE % (bias)")
    for (p, d), v in sorted(by_split.items()):
        e = np.array(v)
        print(f"  {p} / {d}: {len(e)}, {np.abs(e).mean():.1f} ({e.mean():+.1f})")
    if args.v:
        for fam, e, pid in sorted(detail):
            print(f"{fam:15s} {e:+6.1f}  {pid}")


if __name__ == "__main__":
    main()
