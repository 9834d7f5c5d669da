"""Decode launches that ran beside a prefill for all their length, in saved `bullet validate` runs: measured over
predicted time (median) by decode batch size and by the prefill's token count, per card. Shows whether the
fitted co-run decode family misses a dependence on the decode's own batch (issue 9). No GPU needed.

    python3 bench/corun_decode_ratio.py [FOLDER ...]   (default: bench/data/validate-h200-2026-12-01/*)

Each folder holds run folders (``trace@rate``) with a launches.csv; a card's runs are compared with each other
only (each card's runs were predicted by the model that card was validated with).
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEQ_BINS = (2, 4, 8, 16, 64, 256)  # upper edges: 1-2 rows, 3-4, ..., 65-256
CO_BINS = (3000, 6000, 9000)  # the prefill's tokens: up to 3,000, 6,000, 9,000


def bin_of(x: int, edges: tuple[int, ...]) -> int | None:
    return next((e for e in edges if x <= e), None)


def ratios(folder: Path) -> dict[tuple[int, int], list[float]]:
    out: dict[tuple[int, int], list[float]] = {}
    for path in sorted(folder.glob("*@*/launches.csv")):
        with path.open() as f:
            for r in csv.DictReader(f):
                if r["kind"] != "decode/decode" or float(r["overlap"]) < 0.95 or int(r["co_tokens"]) <= 0:
                    continue
                s, c = bin_of(int(r["seqs"]), SEQ_BINS), bin_of(int(r["co_tokens"]), CO_BINS)
                if s is not None and c is not None:
                    out.setdefault((s, c), []).append(float(r["measured_ms"]) / float(r["predicted_ms"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="*", type=Path)
    args = ap.parse_args()
    folders = args.folders or sorted((ROOT / "bench/data/validate-h200-2026-12-01").glob("gpu-*"))
    print("| card | decode rows | prefill tokens <= 3,000 | <= 6,000 | <= 9,000 |")
    print("|---|---|---:|---:|---:|")
    for folder in folders:
        if not folder.is_dir():
            sys.exit(f"{folder}: not a folder")
        r = ratios(folder)
        if not r:
            continue
        lo = 0
        for s in SEQ_BINS:
            cells = [f"{statistics.median(r[s, c]):.3f} ({len(r[s, c])})" if (s, c) in r else "-" for c in CO_BINS]
            if any(x != "-" for x in cells):
                print(f"| {folder.name} | {lo + 1}-{s} | " + " | ".join(cells) + " |")
            lo = s


if __name__ == "__main__":
    main()
