"""Device time of resuming a profile with more grid options (``bullet profile --sizes/--twins/--corun-min/
--corun-passes``), estimated on the CPU from the profile's own measurements: the points and co-run passes a
resume would measure, by kind, times what points like them took.

    PYTHONPATH=$PWD python3 bench/profile_resume_estimate.py [--profile profiles/h200/llama-3.1-8b]
        [--sizes all] [--twins] [--corun-min 4] [--corun-passes 3] [--redo-coruns] [--kv-tokens 700000]

A solo point runs once to warm up and ``reps`` times timed: ``(reps + 1) x max(GPU, host)`` plus a fixed cost a
point (its inputs, block tables, graph capture), calibrated by the shipped profile (426 points measured from
scratch in about 8 min, 23:12-23:20 UTC, of which the 74 co-run points at 165 s / 56 each, as the 56 co-run
points of an earlier grid took with ``--redo-coruns``). A new solo point's times are those of the same shape
measured on other SM counts of its lane, interpolated linearly in 1 / SMs (nearest size outside them); a
twin's are its co-run point's (an upper bound: the co-runner slows it). ``--kv-tokens``: the KV pool of the
executor that measured the profile (700,000 reproduces the shipped profile's grid exactly).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import numpy as np

from bullet.config import GPUS, MODELS
from bullet.gpu.profile import grid, read_points

CORUN_S = 165.0 / 56  # s a co-run point (2 s of sustained co-running, then the timed runs)
SOLO_FIXED_S = 0.20  # s a solo point beyond its runs: (480 s - 74 x CORUN_S - sum of runs) / 352 solo points
START_S = 30.0  # executor start-up and warm-up a call (a 16-point resume took about 30 s)


def solo_time(known: dict, key: tuple[str, str], sms: int, reps: int) -> float | None:
    """``(reps + 1) x max(GPU, host)`` of a shape on ``sms`` from its measurements on other SM counts."""
    pts = sorted(known.get(key, {}).items())
    if not pts:
        return None
    n = np.array([s for s, _ in pts], float)
    t = np.array([v for _, v in pts], float)
    x = 1.0 / n  # np.interp wants increasing x
    order = np.argsort(x)
    return (reps + 1) * float(np.interp(1.0 / sms, x[order], t[order]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", type=Path, default=Path("profiles/h200/llama-3.1-8b"))
    ap.add_argument("--sizes", choices=("all", "alternate"))
    ap.add_argument("--twins", action="store_true")
    ap.add_argument("--corun-min", type=int, default=0)
    ap.add_argument("--corun-passes", type=int, default=1)
    ap.add_argument("--redo-coruns", action="store_true")
    ap.add_argument("--kv-tokens", type=int, default=700_000)
    a = ap.parse_args()
    meta = json.loads((a.profile / "metadata.json").read_text())
    spec, gpu = MODELS[meta["model"]], GPUS["h200"]
    reps = int(meta.get("reps", 3))
    rows = read_points(a.profile / "points.csv")
    have = {r["id"]: r for r in rows}
    pts = grid(spec, (gpu.prefill_sizes, gpu.decode_sizes), meta["grid"] == "quick", kv_tokens=a.kv_tokens,
               sizes=a.sizes, twins=a.twins, corun_min=a.corun_min)
    known: dict = {}
    for r in rows:
        if not r["co_kind"]:
            key = (r["id"].rsplit("@", 1)[0], r["lane"])
            known.setdefault(key, {})[int(r["sms"])] = max(float(r["gpu_s"]), float(r["host_s"]))
    co_of = {r["id"].split(" || ")[0]: r for r in rows if r["co_kind"]}  # a twin's id -> its co-run row
    counts: Counter = Counter()
    seconds: Counter = Counter()
    for pt in pts:
        if pt.co is not None:
            runs = a.corun_passes - (0 if a.redo_coruns or pt.id not in have else 1)
            kind = f"co-run {pt.lane} ({'new' if pt.id not in have else 'in the profile'})"
            counts[kind] += max(runs, 0)
            seconds[kind] += max(runs, 0) * CORUN_S
            continue
        if pt.id in have:
            continue
        t = solo_time(known, (pt.shape.key(), pt.lane), pt.sms, reps)
        kind = f"solo {pt.lane}, {'twin' if pt.id in co_of else 'more sizes'}"
        if t is None:
            r = co_of.get(pt.id)
            if r is not None:
                t = (reps + 1) * (float(r["gpu_s"]) if pt.lane == "prefill" else float(r["step_s"]) * pt.shape.steps)
            else:  # the twin of a new co-run point: the profile's median solo point of its lane
                kind = f"solo {pt.lane}, twin of a new co-run"
                t = (reps + 1) * float(np.median([max(float(r["gpu_s"]), float(r["host_s"])) for r in rows
                                                  if not r["co_kind"] and r["lane"] == pt.lane]))
        counts[kind] += 1
        seconds[kind] += t + SOLO_FIXED_S
    print(f"resume of {a.profile} ({len(rows)} points) to {len(pts)} points: sizes={a.sizes} twins={a.twins} "
          f"corun_min={a.corun_min} corun_passes={a.corun_passes} redo_coruns={a.redo_coruns}")
    print(f"{'what':42} {'measured':>9} {'seconds':>8}")
    for kind in sorted(counts):
        print(f"{kind:42} {counts[kind]:>9} {seconds[kind]:>8.0f}")
    total = sum(seconds.values())
    print(f"{'total (measuring)':42} {sum(counts.values()):>9} {total:>8.0f}")
    print(f"with {START_S:.0f} s of start-up a call: one call {total + START_S:.0f} s, two calls {total + 2 * START_S:.0f} s")


if __name__ == "__main__":
    main()
