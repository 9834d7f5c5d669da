"""Issue 9's decode-first question on a GPU: is the first step of a fused decode launch (``first_s``: its graph
replays' first step, held out at 3.2 % MAPE against a 3 % gate) scattered by noise or by structure? Re-measures
every ``--every``-th stand-alone decode point of a profile, in reverse order of the profile (so drift or order
effects show), through the profiler's own launch path, and keeps every run's first step and later steps, not
only their medians.

    python3 bench/decode_first_spread.py [--profile profiles/h200/llama-3.1-8b] [--every 3] [--reps 5] [--out F]

Writes ``F`` (CSV: point id, SMs, rows, KV read, the profile's first_s and step_s, then each run's first and
later-step time) and prints the spread within a point (each run against the point's median) beside the change
between the profile and this pass, per SM count.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from collections import defaultdict
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", type=Path, default=Path("profiles/h200/llama-3.1-8b"))
    ap.add_argument("--every", type=int, default=3, help="re-measure every N-th decode point")
    ap.add_argument("--reps", type=int, default=5, help="timed runs a point (after one warm-up run)")
    ap.add_argument("--out", type=Path, default=Path("decode_first.csv"))
    ap.add_argument("--device", default="cuda", help="'cuda', or 'cpu' (the tiny model's profile: the code path)")
    args = ap.parse_args()
    if args.every < 1 or args.reps < 2:
        ap.error("--every must be >= 1 and --reps >= 2")
    if not (args.profile / "points.csv").exists():
        ap.error(f"{args.profile}: no points.csv (a profile folder from `bullet profile`)")

    from bullet.config import resolve_model
    from bullet.gpu.executor import GpuExecutor
    from bullet.gpu.partitions import PartitionMenu
    from bullet.gpu.profile import Profiler, grid, read_points

    meta = json.loads((args.profile / "metadata.json").read_text())
    rows = {r["id"]: r for r in read_points(args.profile / "points.csv")}
    ex = GpuExecutor(resolve_model(meta["model"]), "dummy", args.device, gpu_memory_utilization=0.85,
                     num_blocks=4096 if args.device == "cpu" else None)
    ex.warmup()
    menu = ex.menu or PartitionMenu.fallback()
    opts = meta.get("grid_options", {})
    pts = [p for p in grid(ex.spec, (tuple(menu.prefill), tuple(menu.decode)), meta.get("grid") == "quick",
                           args.device == "cpu", kv_tokens=ex.kv.num_blocks * ex.kv.block_size, sizes=opts.get("sizes"))
           if p.co is None and p.shape.kind == "decode" and p.id in rows]
    pts = pts[::args.every][::-1]
    prof = Profiler(ex, args.reps, prefill_graphs=bool(meta.get("prefill_graphs")))
    out = []
    for i, p in enumerate(pts):
        firsts, laters = [], []
        for res, _ in prof.solo_runs(p):  # (the profiler's own runs of a point, each kept)
            ends = np.asarray(res.step_ends)
            firsts.append(float(ends[0] - res.start))
            laters.append(float((ends[-1] - ends[0]) / (len(ends) - 1)))
        r = rows[p.id]
        out.append([p.id, int(r["sms"]), int(r["seqs"]), int(r["kv_read"]), float(r["first_s"]), float(r["step_s"]),
                    *firsts, *laters])
        print(f"{i + 1}/{len(pts)} {p.id}: first {1e3 * float(r['first_s']):.3f} -> "
              f"{1e3 * statistics.median(firsts):.3f} ms", flush=True)
    ex.close()
    with args.out.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "sms", "seqs", "kv_read", "first_s", "step_s",
                    *[f"first_{k}" for k in range(args.reps)], *[f"later_{k}" for k in range(args.reps)]])
        w.writerows(out)
    by = defaultdict(list)
    for row in out:
        first = np.array(row[6:6 + args.reps])
        med = float(np.median(first))
        by[row[1]].append((100 * np.mean(np.abs(first / med - 1)), 100 * (med / row[4] - 1),
                           100 * (float(np.median(row[6 + args.reps:])) / row[5] - 1)))
    print("| SMs | points | first step: run vs its median, MAPE % | this pass / profile - 1, mean % (sd) | "
          "later steps: this pass / profile - 1, mean % |")
    print("|---:|---:|---:|---:|---:|")
    for sms, v in sorted(by.items()):
        a = np.array(v)
        print(f"| {sms} | {len(v)} | {a[:, 0].mean():.2f} | {a[:, 1].mean():+.2f} ({a[:, 1].std():.2f}) | "
              f"{a[:, 2].mean():+.2f} |")


if __name__ == "__main__":
    main()
