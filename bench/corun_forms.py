"""Co-run prefill: the slowdown's forms, held out (issue 9; bench/RESULTS.md, "Co-run prefill and the eager ramps").

Each fold's solo families are fitted once by ``bullet fit``'s own code (the random 20 % of seeds 0..S-1 and the
interior loso folds); the co-run prefill slowdown (``co_eager``) is then refitted on each fold's training points with
each candidate set of features (non-negative least squares weighted to the relative error of the co-run time, as
``bullet fit`` does) and its held-out co-run prefill points predicted. Prints, per form, the MAPE % of seed 0's random
split, of the random splits pooled over the seeds, and of the interior split. The kept form reproduces ``bullet fit``'s
co-run prefill figures.

    PYTHONPATH=$PWD python3 bench/corun_forms.py [PROFILE_DIR] [--seeds 10]
"""

from __future__ import annotations

import argparse

import numpy as np

from bullet.config import ConfigError
from bullet.perfmodel import FittedModel
from bullet.perfmodel.base import partly_co_run
from bullet.perfmodel.fit import _nnls, co_work_of_row, fit_model, folds, load_profile, work_of_row
from bullet.perfmodel.fitted import tensor_cores

KEPT = ["co_bw", "co_bw_share", "own_bw_co_bw", "own_flops_co_sm", "co_gemm_half"]
FORMS = {
    "kept (format version 8)": KEPT,
    "version 7's six terms": ["co_bw", "co_bw_share", "co_sm_share", "own_bw_co_bw", "own_flops_co_sm", "co_gemm_co_sm"],
    "kept + co_sm_share": [*KEPT, "co_sm_share"],
    "kept + min(m, N/2)/N": [*KEPT, "half_sm"],
    "GEMM share x u in place of co_gemm_half": [*KEPT[:4], "gemm_u"],
    "tensor cores x min(m, N/2)/N in place": [*KEPT[:4], "tc_half"],
    "the co-runner's weight stream in place of u": ["weight_bw", *KEPT[1:]],
    "weight stream, own demand x weight stream": ["weight_bw", "co_bw_share", "own_weight_bw", "own_flops_co_sm",
                                                   "co_gemm_half"],
    "kept + the co-runner's step over the prefill's x min(m, N/2)/N": [*KEPT, "step_ratio_half"],
}


def features(fm: FittedModel, r: dict) -> tuple[dict, float]:
    """The contention features of a co-run prefill point under ``fm`` (its own and a few candidates), and the
    prefill's stand-alone prediction."""
    w, n, co, m = work_of_row(r), r["sms"], co_work_of_row(r), r["co_sms"]
    N = fm.num_sms
    alone = fm.gpu_time(w, n)
    f = dict(fm.co_features(n, co, m, False, fm.own_bw(w, alone), fm.own_flops(w, alone)))
    co_alone = fm.gpu_time(co, m)
    g = f["co_gemm_co_sm"] / (m / N)
    weight_bw = co.num_layers * fm.q.layer_weight_bytes / co_alone * 1e-12
    own = f["own_bw_co_bw"] / f["co_bw"] if f["co_bw"] else 0.0
    f.update(half_sm=min(m, N / 2) / N, gemm_u=g * f["co_bw"], tc_half=tensor_cores(co) * min(m, N / 2) / N,
             weight_bw=weight_bw, own_weight_bw=own * weight_bw,
             step_ratio_half=min(1.0, co_alone / alone) * min(m, N / 2) / N)
    return f, alone


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile", nargs="?", default="profiles/h200/llama-3.1-8b")
    ap.add_argument("--seeds", type=int, default=10)
    a = ap.parse_args()
    if a.seeds < 1:
        ap.error(f"--seeds: at least 1, got {a.seeds}")
    try:
        prof = load_profile(a.profile)
    except ConfigError as e:
        ap.error(str(e))
    rows = prof.rows
    cp = [i for i, r in enumerate(rows) if r["co_kind"] and r["kind"] != "decode"]
    fl = [(f"seed {s}", "random", folds(prof, s)[0][2]) for s in range(a.seeds)]
    fl += [(name, split, held) for name, split, held in folds(prof) if split == "interior"]
    fits = []
    for name, split, held in fl:
        fm = FittedModel(fit_model(prof, [r for r, h in zip(rows, held) if not h]), host=False)
        fits.append((name, split, held, {i: features(fm, rows[i]) for i in cp}))
    print(f"co-run prefill MAPE %: seed 0 | random, seeds 0..{a.seeds - 1} pooled | interior")
    for label, terms in FORMS.items():
        errs: dict[str, list[float]] = {"seed 0": [], "random": [], "interior": []}
        for name, split, held, feats in fits:
            X, y, test = [], [], []
            for i in cp:
                r, (f, alone) = rows[i], feats[i]
                x = [f[t] for t in terms]
                if held[i]:
                    test.append((r, x, alone))
                    continue
                t, o = r["gpu_s"], min(1.0, max(r["overlap"], 0.0))
                if o <= 0.0 or alone <= (1.0 - o) * t:
                    continue
                X.append(x)
                y.append((o * t / (alone - (1.0 - o) * t) if o < 1.0 else t / alone) - 1.0)
            ya = np.asarray(y)
            c = _nnls(np.asarray(X), ya, relative=False, weights=1.0 / (1.0 + ya) ** 2)
            for r, x, alone in test:
                p = partly_co_run(alone, alone * (1.0 + float(np.dot(c, x))), min(1.0, max(r["overlap"], 0.0)))
                e = abs(p / r["gpu_s"] - 1.0)
                errs[split].append(e)
                if name == "seed 0":
                    errs["seed 0"].append(e)
        print(f"  {label:64s} " + " | ".join(f"{100 * np.mean(v):.2f}" for v in errs.values()))


if __name__ == "__main__":
    main()
