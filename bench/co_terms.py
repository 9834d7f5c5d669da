"""Which contention terms explain a profile's co-run points: each co-run point's slowdown (measured time over the
fitted model's stand-alone prediction, less one) fitted by non-negative least squares on candidate term sets,
with the in-sample and leave-one-point-out mean error of the co-run time. Prints a table per lane.

    python3 bench/co_terms.py [--profile profiles/h200/llama-3.1-8b]

The candidates: the co-runner's HBM demand ``u`` (its bytes over its stand-alone time, TB/s), ``u x n/N``, its SM
share ``co_sms/N`` (the version-1/2 terms, "base"); and, for the slowed lane, its own stand-alone HBM demand
``own`` (a decode step's or a prefill's), the bandwidth a reference decode step pulls on ``n`` SMs (``ref``,
what ``sm_bw_co_sm`` uses) and the SM share ``n/N``. The stand-alone predictions are the model's solo families
(the contention terms do not change them).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from scipy.optimize import nnls

from bullet.config import ConfigError
from bullet.perfmodel import fit as F
from bullet.perfmodel.fitted import FittedModel


def error(X: np.ndarray, y: np.ndarray, c: np.ndarray) -> float:
    """Mean relative error of the co-run time, (1 + predicted slowdown) / (1 + measured) - 1, in %."""
    return float(np.mean(np.abs((1 + X @ c) / (1 + y) - 1)) * 100)


def loo(X: np.ndarray, y: np.ndarray) -> float:
    errs = []
    for i in range(len(y)):
        keep = np.arange(len(y)) != i
        c, _ = nnls(X[keep], y[keep])
        errs.append(abs((1 + X[i] @ c) / (1 + y[i]) - 1))
    return float(np.mean(errs) * 100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", type=Path, default=Path("profiles/h200/llama-3.1-8b"))
    args = ap.parse_args()
    try:
        prof = F.load_profile(args.profile)
        fm = FittedModel.load(args.profile / "model.json", host=False)
    except (ConfigError, OSError) as e:
        ap.error(str(e))
    N = prof.num_sms
    sm_bw = fm._sm_bw()
    rows = []
    for r in prof.rows:
        if not r["co_kind"]:
            continue
        n, co, co_sms, w = r["sms"], F.co_work_of_row(r), r["co_sms"], F.work_of_row(r)
        if r["kind"] == "decode":
            if r["overlap"] <= 0.0:
                continue
            wm = F.decode_mid(w, 2.0 * (r["steps"] / 2.0 + 1.0))
            alone, measured = float(fm.decode_steps(wm, 2, n)[1]), r["step_s"]
        else:
            alone, measured = fm.gpu_time(w, n), r["gpu_s"]
        f = fm.co_features(n, co, co_sms, False)
        rows.append({"lane": r["lane"], "y": measured / alone - 1, "own": fm.own_bw(w, alone), "ref": sm_bw[n],
                     "share": n / N, **f})
    for lane in ("prefill", "decode"):
        d = [r for r in rows if r["lane"] == lane]
        y = np.array([r["y"] for r in d])
        col = {k: np.array([r[k] for r in d]) for k in ("co_bw", "co_bw_share", "co_sm_share", "own", "ref", "share")}
        base = np.c_[col["co_bw"], col["co_bw_share"], col["co_sm_share"]]
        cands = {"base": base,
                 "base + own x u": np.c_[base, col["own"] * col["co_bw"]],
                 "base + own x co_sms/N": np.c_[base, col["own"] * col["co_sm_share"]],
                 "base + both own terms": np.c_[base, col["own"] * col["co_bw"], col["own"] * col["co_sm_share"]],
                 "base + ref x co_sms/N": np.c_[base, col["ref"] * col["co_sm_share"]],
                 "base + n/N x co_sms/N": np.c_[base, col["share"] * col["co_sm_share"]]}
        print(f"\nco-run {lane}: {len(y)} points")
        print("| terms | in sample % | leave one out % |")
        print("|---|---:|---:|")
        for name, X in cands.items():
            c, _ = nnls(X, y)
            print(f"| {name} | {error(X, y, c):.2f} | {loo(X, y):.2f} |")


if __name__ == "__main__":
    main()
