"""The decode families' ``longest_extra`` term (fit format version 10, issue 9): held-out error with and without
it, and with other program slots per SM (``attn_slots_per_sm``), on a shipped profile; then the skewed batches'
residuals (one 8,192-token row beside rows of 512) by rows and SM count, without and with the term.

    PYTHONPATH=$PWD python3 bench/decode_extra.py [PROFILE_DIR] [--seeds 10]

Random: a seeded 20 % of all points held out (``bullet fit``'s split), seeds 0..N-1 pooled; interior: each
decode partition size but the smallest and largest held out in turn. MAPE % of the held-out solo decode points'
first step and later steps, through the model's own prediction path (``predictions``).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bullet.perfmodel.fit import (
    default_terms,
    fit_model,
    folds,
    is_decode,
    is_solo,
    load_profile,
    predictions,
)
from bullet.perfmodel.fitted import DEFAULT_KERNELS, FittedModel

FAMS = ("decode first", "decode step")


def held_out(prof, terms, kernels, masks) -> dict[str, list[float]]:
    """Signed relative errors of the decode families on each mask's held-out points, with their rows."""
    out: dict[str, list] = defaultdict(list)
    for held in masks:
        fm = FittedModel(fit_model(prof, [r for r, h in zip(prof.rows, held) if not h], terms, kernels), host=True)
        for r, h in zip(prof.rows, held):
            if h and is_solo(r) and is_decode(r):
                for fam, (p, m) in predictions(fm, r).items():
                    if fam in FAMS:
                        out[fam].append((p / m - 1.0, r))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile", nargs="?", default="profiles/h200/llama-3.1-8b")
    ap.add_argument("--seeds", type=int, default=10)
    args = ap.parse_args()
    prof = load_profile(args.profile)
    rows = prof.rows
    base = default_terms(prof.num_sms, eager_sms={r["sms"] for r in rows if is_solo(r) and not is_decode(r)},
                         gemm=prof.gemm is not None)
    without = {k: [t for t in v if t[0] != "longest_extra"] if k.startswith("decode") else v for k, v in base.items()}
    dec = sorted({r["sms"] for r in rows if r["lane"] == "decode"})
    random_masks = [folds(prof, seed)[0][2] for seed in range(args.seeds)]
    interior = [[r["sms"] == s for r in rows] for s in dec[1:-1]]
    variants = [("without longest_extra", without, None)] + \
        [(f"slots per SM {c}", base, c) for c in (1, 2, 4, 8)]
    print(f"decode families' held-out MAPE %, {prof.folder} ({len(rows)} points), random over seeds "
          f"0-{args.seeds - 1} pooled\n")
    print("| variant | first step, random | later steps, random | first step, interior | later steps, interior |")
    print("|---|---:|---:|---:|---:|")
    skew = {}
    for name, terms, c in variants:
        kernels = {**DEFAULT_KERNELS, **({"attn_slots_per_sm": c} if c else {})}
        r_err, i_err = held_out(prof, terms, kernels, random_masks), held_out(prof, terms, kernels, interior)
        cells = [100 * np.mean([abs(e) for e, _ in errs[f]]) for errs in (r_err, i_err) for f in FAMS]
        print(f"| {name} | " + " | ".join(f"{v:.2f}" for v in cells) + " |")
        if c in (None, DEFAULT_KERNELS["attn_slots_per_sm"]):
            skew[name] = r_err["decode first"]
    print("\nfirst step's mean signed error % on held-out skewed batches (1 x 8192 + rows x 512), random splits:")
    for name, errs in skew.items():
        cell: dict[tuple[int, int], list[float]] = defaultdict(list)
        for e, r in errs:
            if r["id"].startswith("decode[|1x8192,") and r["id"].split(",")[1].split("x")[1].startswith("512|"):
                cell[(r["seqs"], r["sms"])].append(e)
        sms = sorted({s for _, s in cell})
        print(f"\n{name}\n\n| rows | " + " | ".join(map(str, sms)) + " |\n|---|" + "---:|" * len(sms))
        for b in sorted({b for b, _ in cell}):
            print(f"| {b} | " + " | ".join(f"{100 * np.mean(cell[b, s]):+.1f}" if (b, s) in cell else ""
                                           for s in sms) + " |")


if __name__ == "__main__":
    main()
