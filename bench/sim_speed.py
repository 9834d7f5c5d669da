"""Simulator speed: the whole `bullet simulate` command (interpreter start, imports, trace load, simulation,
metrics) on the full Azure 2023 conversation trace, Llama-3.1-8B on an H200. Prints a table.

    python bench/sim_speed.py [--repeats 3] [--policy chunked ...]

The issue's target: <= 3.5 s wall on a 2-core machine, i.e. >= 1000x faster than the trace's 3,502 s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared/traces/raw/AzureLLMInferenceTrace_conv.csv"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--policy", nargs="+", default=["chunked"])
    ap.add_argument("--trace", default=str(TRACE))
    args = ap.parse_args()
    rows = []
    for policy in args.policy:
        walls, summary = [], None
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = subprocess.run([sys.executable, "-m", "bullet.cli", "simulate", "--trace", args.trace,
                                  "--policy", policy, "--json"], capture_output=True, text=True, check=True)
            walls.append(time.perf_counter() - t0)
            summary = json.loads(out.stdout)
        wall = statistics.median(walls)
        rows.append((policy, summary["requests"], summary["duration_s"], summary["launches"],
                     summary["sim_wall_s"], wall, summary["duration_s"] / wall))
    head = ("policy", "requests", "simulated s", "launches", "simulate() s", "command wall s", "x real time")
    print(" | ".join(head))
    for r in rows:
        print(f"{r[0]} | {r[1]} | {r[2]:.0f} | {r[3]} | {r[4]:.2f} | {r[5]:.2f} | {r[6]:.0f}x")


if __name__ == "__main__":
    main()
