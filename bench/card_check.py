"""Does this GPU run the shipped profile's launches at the profile's speed? Re-measures a sample of the
profile's stand-alone points (prefill, mixed and decode on several partition sizes) through the profiler's own
code (`bullet.gpu.profile.Profiler`), and prints measured / profiled time per kind, with the card's identity
(UUID, serial) and its clocks and power while measuring.

Each device call may land on another card of the same model; `bullet validate` compares a simulation fitted on
one card with a run on another. This tells card-to-card speed differences from the model's own error.
Run on a GPU: `python3 bench/card_check.py [--profile profiles/h200/llama-3.1-8b] [--count 30] [--reps 3]`.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
from collections import defaultdict
from pathlib import Path

import numpy as np


def smi(query: str) -> list[str]:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return []
    return [x.strip() for x in out[0].split(",")] if out else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="profiles/h200/llama-3.1-8b", help="profile folder (points.csv, metadata.json)")
    ap.add_argument("--count", type=int, default=30, help="stand-alone points to re-measure (spread over kinds)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--coruns", type=int, default=0, help="co-run points to re-measure too (each ~3 s: 2 s of "
                                                          "sustained co-running first)")
    args = ap.parse_args()

    import json

    from bullet.config import resolve_model
    from bullet.gpu.executor import GpuExecutor
    from bullet.gpu.profile import Profiler, grid, read_points

    folder = Path(args.profile)
    meta = json.loads((folder / "metadata.json").read_text())
    every = {r["id"]: r for r in read_points(folder / "points.csv")}
    rows = {k: r for k, r in every.items() if not r["co_kind"]}
    spec = resolve_model(meta["model"])
    ex = GpuExecutor(spec, "dummy", "cuda", num_blocks=40000)
    menu = ex.menu
    pts = [p for p in grid(spec, (tuple(menu.prefill), tuple(menu.decode)), meta.get("grid") == "quick",
                           kv_tokens=ex.kv.num_blocks * ex.kv.block_size) if p.co is None and p.id in rows]
    by_kind = defaultdict(list)
    for p in pts:
        by_kind[p.shape.kind].append(p)
    rng = np.random.default_rng(args.seed)
    chosen = []
    for kind, ps in sorted(by_kind.items()):
        k = min(len(ps), max(1, args.count * len(ps) // len(pts)))
        chosen += [ps[i] for i in sorted(rng.choice(len(ps), k, replace=False))]
    ident = smi("name,uuid,serial,vbios_version")
    print(f"card: {' | '.join(ident)}; profile measured {meta.get('date')} ({meta.get('commit')})")
    if args.coruns:  # co-run points of the profile, seeded, both lanes
        co = [p for p in grid(spec, (tuple(menu.prefill), tuple(menu.decode)), meta.get("grid") == "quick",
                              kv_tokens=ex.kv.num_blocks * ex.kv.block_size, **meta.get("grid_options", {}))
              if p.co is not None and p.id in every]
        chosen += [co[i] for i in sorted(rng.choice(len(co), min(args.coruns, len(co)), replace=False))]
        rows = every
    prof = Profiler(ex, args.reps, prefill_graphs=bool(meta.get("prefill_graphs")))
    prof.solo.update({k: float(r["gpu_s"]) for k, r in every.items() if not r["co_kind"]})  # co-runs' stretches
    ratios = defaultdict(list)
    clocks = []
    for p in chosen:
        row = prof.measure(p)
        clocks.append(smi("clocks.sm,power.draw,temperature.gpu"))
        r = float(row["gpu_s"]) / float(rows[p.id]["gpu_s"])
        ratios[(p.shape.kind + (" co-run" if p.co is not None else ""), p.lane)].append(r)
        print(f"  {p.id:60s} {1e3 * float(rows[p.id]['gpu_s']):9.3f} ms -> {1e3 * float(row['gpu_s']):9.3f} ms  x{r:.3f}")
    print("\n| kind | lane | points | measured / profiled: median | min | max |")
    print("|---|---|---:|---:|---:|---:|")
    allr = []
    for (kind, lane), rs in sorted(ratios.items()):
        allr += rs
        print(f"| {kind} | {lane} | {len(rs)} | {statistics.median(rs):.3f} | {min(rs):.3f} | {max(rs):.3f} |")
    print(f"| all | | {len(allr)} | {statistics.median(allr):.3f} | {min(allr):.3f} | {max(allr):.3f} |")
    cl = [c for c in clocks if len(c) == 3]
    if cl:
        sm = [float(c[0]) for c in cl]
        pw = [float(c[1]) for c in cl]
        print(f"SM clock after each point: {min(sm):.0f}-{max(sm):.0f} MHz; power {min(pw):.0f}-{max(pw):.0f} W")
    ex.close()


if __name__ == "__main__":
    main()
