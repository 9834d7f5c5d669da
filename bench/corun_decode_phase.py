"""Decode launches beside a prefill, in saved `bullet validate --out` runs of a split policy, by where in the prefill
launch they started: measured over predicted time (the model each run was validated with), median and tenth
percentile, for small decode batches (<= ``--max-rows`` rows). A decode launch that starts as an eager prefill
launch begins shares the one host thread with the prefill's enqueue of its layers; this shows what that costs
(issue 9, static-split's TPOT on azure-code). No GPU needed.

    python3 bench/corun_decode_phase.py [RUN_FOLDER ...] [--max-rows 4]
        (default: the static-split azure-code runs in bench/data/validate-h200-2026-12-01/gpu-*)
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PHASES = (0.1, 0.3, 0.6, 1.0)  # upper edges of the start's place in the prefill launch (fraction of its span)


def launches(path: Path) -> tuple[list[dict], list[dict]]:
    with path.open() as f:
        rows = [{k: (v if k == "kind" else float(v)) for k, v in r.items()} for r in csv.DictReader(f)]
    return ([r for r in rows if r["kind"].startswith("decode/")], [r for r in rows if r["kind"].startswith("prefill/")])


def phases(run: Path, max_rows: int) -> dict[float, list[float]]:
    """Measured / predicted of each small decode launch that ran beside a prefill for >= 90 % of its length,
    keyed by the upper edge of where it started in that prefill launch."""
    dec, pre = launches(run / "launches.csv")
    out: dict[float, list[float]] = {e: [] for e in PHASES}
    for d in dec:
        if d["seqs"] > max_rows or d["overlap"] < 0.9:
            continue
        for p in pre:
            span = p["measured_ms"] / 1e3
            if p["start_s"] <= d["start_s"] < p["start_s"] + span:
                frac = (d["start_s"] - p["start_s"]) / span
                out[next(e for e in PHASES if frac <= e)].append(d["measured_ms"] / d["predicted_ms"])
                break
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="*", type=Path)
    ap.add_argument("--max-rows", type=int, default=4)
    args = ap.parse_args()
    runs = args.runs or sorted((ROOT / "bench/data/validate-h200-2026-12-01").glob("gpu-*/azure-code@*"))
    runs = [r for r in runs if (r / "launches.csv").exists() and ",decode/" in (r / "launches.csv").read_text()]
    if not runs:
        ap.error("no run folder with a split policy's launches (a launches.csv with decode-lane launches)")
    print("| run | " + " | ".join(f"start in prefill <= {e:g}: n, median, p90" for e in PHASES) + " |")
    print("|---|" + "---:|" * len(PHASES))
    for run in runs:
        cells = []
        for v in phases(run, args.max_rows).values():
            cells.append(f"{len(v)}, {np.median(v):.3f}, {np.percentile(v, 90):.3f}" if v else "0, -, -")
        print(f"| {run.parent.name}/{run.name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
