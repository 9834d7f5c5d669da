"""Mixed launches (prompt chunks and decode rows in one eager launch): the fitted model's held-out error by the
launch's make-up, and how much of it the decode rows would explain if ``Work`` carried them (issue 9).

``Work`` sums a launch's chunks, so the model cannot tell a mixed launch's decode rows (one-token chunks, which the
executor runs through the decode kernel) from its prompt rows; a profile point knows both (``decode_seqs``, and
each prompt chunk's length and start in its id). Over the random 20 % split of seeds 0..S-1, every held-out solo
mixed point: its error by prompt tokens and by the decode rows' share of the tokens; then the error left after a
least-squares correction on (1, decode rows / tokens, decode KV / (decode KV + prompt pairs)) fitted to those
held-out errors themselves: an upper bound on what a decode-row term could gain, not a held-out figure.

    PYTHONPATH=$PWD python3 bench/mixed_residuals.py [PROFILE_DIR ...] [--seeds 10]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bullet.perfmodel.fit import fit_model, folds, load_profile, predictions
from bullet.perfmodel.fitted import FittedModel


def held_out_mixed(folder: str, seeds: int) -> list[tuple]:
    """(error, decode rows, decode KV, prompt tokens, prompt pairs, tokens, id) of every held-out solo mixed point."""
    prof = load_profile(folder)
    out = []
    for seed in range(seeds):
        _, _, held = folds(prof, seed)[0]  # the random 20 %
        fm = FittedModel(fit_model(prof, [r for r, h in zip(prof.rows, held) if not h]), host=True)
        for r, h in zip(prof.rows, held):
            if not h or r["kind"] != "mixed" or r["co_kind"]:
                continue
            pm = predictions(fm, r).get("mixed")
            if pm is None:  # host-bound: not in the family
                continue
            chunks = [tuple(map(int, c.split("@"))) for c in re.match(r"mixed\[([^|]*)\|", r["id"]).group(1).split("+")]
            ptok = sum(n for n, _ in chunks)
            pairs = sum(n * s + n * (n + 1) / 2 for n, s in chunks)
            dkv = r["kv_read"] - sum(n + s for n, s in chunks)
            out.append((pm[0] / pm[1] - 1, r["decode_seqs"], dkv, ptok, pairs, r["tokens"], r["id"]))
    return out


def report(folder: str, seeds: int) -> None:
    pts = held_out_mixed(folder, seeds)
    a = np.array([p[:6] for p in pts], dtype=float)
    err, rows, dkv, ptok, pairs, tokens = a.T
    print(f"\n{folder}: {len(pts)} held-out mixed points over seeds 0..{seeds - 1}")
    print("| group | points | MAPE % | bias % |\n|---|---:|---:|---:|")
    print(f"| all | {len(a)} | {100 * np.abs(err).mean():.2f} | {100 * err.mean():+.2f} |")
    share = rows / tokens
    groups = [("prompt tokens 0-512", ptok < 512), ("prompt tokens 512-1536", (ptok >= 512) & (ptok < 1536)),
              ("prompt tokens 1536-up", ptok >= 1536), ("decode rows / tokens 0-0.05", share < .05),
              ("decode rows / tokens 0.05-0.2", (share >= .05) & (share < .2)), ("decode rows / tokens 0.2-1.01", share >= .2)]
    for name, sel in groups:
        if sel.any():
            print(f"| {name} | {sel.sum()} | {100 * np.abs(err[sel]).mean():.2f} | {100 * err[sel].mean():+.2f} |")
    X = np.column_stack([np.ones(len(a)), share, dkv / (dkv + pairs)])
    coef, *_ = np.linalg.lstsq(X, err, rcond=None)
    print(f"left after a correction on the decode rows fitted to these errors (upper bound): "
          f"{100 * np.abs(err - X @ coef).mean():.2f} %")
    print("largest misses: " + "; ".join(f"{100 * p[0]:+.1f} % {p[6].split('|L')[0]}]" for p in
                                          sorted(pts, key=lambda p: -abs(p[0]))[:4]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profiles", nargs="*", default=["profiles/h200/qwen3-8b", "profiles/h200/llama-3.1-8b"])
    ap.add_argument("--seeds", type=int, default=10)
    args = ap.parse_args()
    for folder in args.profiles:
        report(folder, args.seeds)


if __name__ == "__main__":
    main()
