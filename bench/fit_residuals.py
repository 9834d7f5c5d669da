"""Where the eager (prefill) family misses when one SM count is held out, and why (issue 9).

Prints, for each profile folder given (default: the two shipped H200 profiles):

1. model-free: each solo prefill shape's time at each interior partition size against the linear-in-1/n
   interpolation of its two measured neighbours (what the ramps do with that size held out), per shape and the
   median per size;
2. per shape over its 7 partition sizes (20..116), the rms relative residual of small non-negative fits on a
   few SM bases: ``N/n + 1`` (compute and bandwidth linear in SMs, plus a constant), ``+ ceil(N/n)`` (a grid
   sized for the whole GPU, run in whole rounds on n SMs), ``+ power`` (``N/n max(1, n/68)^0.5``: SM-seconds
   rising past the 700 W cap's knee) and both;
3. the noise: the spread of each point's 3 timed runs, ``(max - min) / median``, by SM count (and the co-run
   passes where the profile has ``corun_passes.csv``);
4. the held-out error of ``bullet fit``'s families without and with the ``grid`` term (``gemm_flops x
   ceil(N/n)``), and the interior folds' prefill MAPE and bias one by one;
5. in sample (the fit of every point): each solo prefill shape's error by SM count, and the mixed points' largest
   misses.

    PYTHONPATH=$PWD python3 bench/fit_residuals.py [PROFILE_DIR ...] [--kernel prefill_attn_slots_per_sm=1e-9]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

from bullet.config import ConfigError
from bullet.perfmodel import FittedModel
from bullet.perfmodel.fit import (
    default_terms,
    evaluate,
    fit_model,
    folds,
    in_sample,
    is_decode,
    is_solo,
    load_profile,
    pass_spread,
    predictions,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corun_residuals import KERNEL_HELP, kernel_overrides

PROFILES = ("profiles/h200/llama-3.1-8b", "profiles/h200/qwen3-8b")
GRID = ("gemm_flops", "grid")


def shapes(prof) -> dict[str, dict[int, float]]:
    """GPU seconds of each solo prefill shape (its id without the partition) by SM count."""
    out: dict[str, dict[int, float]] = defaultdict(dict)
    for r in prof.rows:
        if is_solo(r) and r["kind"] == "prefill":
            out[r["id"].rsplit("@", 1)[0]][r["sms"]] = r["gpu_s"]
    return out


def neighbours(prof) -> None:
    t = shapes(prof)
    ns = sorted({n for v in t.values() for n in v if n < prof.num_sms})
    inner = ns[1:-1]
    print("\n1. interpolation of the two measured neighbours in 1/n, over the measured time - 1 (%)")
    print(f"{'shape':46s}" + "".join(f"{n:>7d}" for n in inner))
    cols = defaultdict(list)
    for k, v in t.items():
        cells = []
        for a, b, c in zip(ns, ns[1:], ns[2:]):
            if not all(x in v for x in (a, b, c)):
                cells.append("      -")
                continue
            al = (1 / b - 1 / c) / (1 / a - 1 / c)
            e = 100 * ((al * v[a] + (1 - al) * v[c]) / v[b] - 1)
            cols[b].append(e)
            cells.append(f"{e:7.1f}")
        if any(c.strip() != "-" for c in cells):
            print(f"{k[:46]:46s}" + "".join(cells))
    print(f"{'median':46s}" + "".join(f"{statistics.median(cols[n]):7.1f}" for n in inner))


def per_shape(prof) -> None:
    N = prof.num_sms
    bases = {"N/n": lambda n: N / n, "1": lambda n: np.ones_like(n), "ceil(N/n)": lambda n: np.ceil(N / n),
             "power": lambda n: N / n * np.maximum(1.0, n / 68.0) ** 0.5}
    sets = (("N/n", "1"), ("N/n", "1", "ceil(N/n)"), ("N/n", "1", "power"), ("N/n", "1", "ceil(N/n)", "power"))
    print("\n2. per shape, rms relative residual (%) of a non-negative fit over its partition sizes below the whole GPU")
    print(f"{'shape':46s}" + "".join(f"{'+ ' + ' + '.join(s[2:]) if s[2:] else 'N/n + 1':>18s}" for s in sets))
    tot = defaultdict(list)
    for k, v in shapes(prof).items():
        n = np.array([s for s in sorted(v) if s < N], float)
        if len(n) < 6:
            continue
        y = np.array([v[int(s)] for s in n])
        cells = []
        for s in sets:
            X = np.column_stack([bases[b](n) for b in s]) / y[:, None]
            c, _ = nnls(X, np.ones(len(y)))
            e = 100 * float(np.sqrt(np.mean((X @ c - 1) ** 2)))
            tot[s].append(e)
            cells.append(f"{e:18.2f}")
        print(f"{k[:46]:46s}" + "".join(cells))
    print(f"{'mean':46s}" + "".join(f"{np.mean(tot[s]):18.2f}" for s in sets))


def noise(prof) -> None:
    by = defaultdict(list)
    for r in prof.rows:
        if is_solo(r) and r["kind"] == "prefill" and r["reps"] > 1:
            by[r["sms"]].append(100 * (r["gpu_s_max"] - r["gpu_s_min"]) / r["gpu_s"])
    print("\n3. solo prefill, spread of a point's timed runs (max - min) / median, %: mean (max) by SM count")
    print("   " + "  ".join(f"{n}: {np.mean(v):.2f} ({max(v):.1f})" for n, v in sorted(by.items())))
    allv = [x for v in by.values() for x in v]
    print(f"   all {len(allv)} points: mean {np.mean(allv):.2f} %, median {np.median(allv):.2f} %")
    spread = pass_spread(prof.folder / "corun_passes.csv")
    print("   co-run passes: " + ("none (no corun_passes.csv)" if spread is None else
                                  f"{spread['points']} points, mean spread {100 * spread['spread_mean']:.2f} %"))


def without_grid(prof, rows) -> dict:
    """fit_model's default terms on ``rows``, less the grid term: the fit before it."""
    terms = default_terms(prof.num_sms, eager_sms={r["sms"] for r in rows if is_solo(r) and not is_decode(r)},
                          gemm=prof.gemm is not None)
    terms["eager"] = [t for t in terms["eager"] if t != GRID]
    return fit_model(prof, rows, terms)


def held_out(prof) -> None:
    print("\n4. held-out MAPE %, random 20 % / loso / interior loso / in sample: without -> with the grid term")
    base = evaluate_with(prof, without_grid)
    new = evaluate_with(prof, lambda p, rows: fit_model(p, rows))
    print(f"   {'family':16s} {'without':>26s}   {'with':>26s}")
    for fam in ("prefill", "co-run prefill", "launch", "decode first", "mixed"):
        a, b = (" / ".join("-" if v is None else f"{100 * v:.2f}" for v in x[fam]) for x in (base, new))
        print(f"   {fam:16s} {a:>26s}   {b:>26s}")
    print("   prefill by interior fold, MAPE (bias) %, without -> with:")
    fa, fb = fold_errors(prof, without_grid), fold_errors(prof, lambda p, rows: fit_model(p, rows))
    print("   " + "  ".join(f"{k}: {fa[k][0]:.1f} ({fa[k][1]:+.1f}) -> {fb[k][0]:.1f} ({fb[k][1]:+.1f})" for k in fa))


def evaluate_with(prof, fitter) -> dict:
    """evaluate()'s table (means) with each fold fitted by ``fitter(prof, rows)``, and the in-sample mean."""
    import bullet.perfmodel.fit as fit_mod

    real = fit_mod.fit_model
    fit_mod.fit_model = lambda p, rows, terms=None, kernels=None: fitter(p, rows)  # evaluate's folds
    try:
        table = evaluate(prof)
        ins = in_sample(prof, fitter(prof, prof.rows))
    finally:
        fit_mod.fit_model = real
    return {fam: tuple(table[fam][s]["mean"] for s in ("random", "loso", "interior")) +
            ((ins[fam]["mean"] if fam in ins else None),) for fam in table}


def fold_errors(prof, fitter) -> dict[str, tuple[float, float]]:
    rows, out = prof.rows, {}
    for name, split, held in folds(prof):
        if split != "interior":
            continue
        fm = FittedModel(fitter(prof, [r for r, h in zip(rows, held) if not h]), host=True)
        e = [p / m - 1 for r, h in zip(rows, held) if h for fam, (p, m) in predictions(fm, r).items()
             if fam == "prefill"]
        if e:
            out[name.split()[0]] = (100 * float(np.mean(np.abs(e))), 100 * float(np.mean(e)))
    return out


def in_sample_table(prof, kernels: dict | None = None) -> None:
    """The fit of all points (``kernels``: its kernel constants) in sample: each solo prefill shape's error by SM count, then the mixed points'
    largest misses either way."""
    fm = FittedModel(fit_model(prof, prof.rows, kernels=kernels), host=True)
    by: dict[str, dict[int, float]] = defaultdict(dict)
    mixed = []
    for r in prof.rows:
        if not is_solo(r):
            continue
        for fam, (p, m) in predictions(fm, r).items():
            if fam == "prefill":
                by[r["id"].rsplit("@", 1)[0]][r["sms"]] = 100 * (p / m - 1)
            elif fam == "mixed":
                mixed.append((100 * (p / m - 1), m, r["id"]))
    ns = sorted({n for v in by.values() for n in v})
    print("\n5. in sample, predicted / measured - 1 (%), solo prefill shapes by SM count")
    print(f"{'shape':48}" + "".join(f"{n:>7}" for n in ns))
    for shape, v in sorted(by.items()):
        print(f"{shape[:48]:48}" + "".join(f"{v[n]:+7.1f}" if n in v else " " * 7 for n in ns))
    mixed.sort()
    print(f"   mixed, {len(mixed)} points, MAPE {np.mean([abs(e) for e, _, _ in mixed]):.2f} %; the largest misses:")
    for e, m, pid in mixed[:5] + mixed[-5:]:
        print(f"   {e:+6.1f} % {1e3 * m:8.2f} ms  {pid[:100]}")


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profiles", nargs="*", help="profile folders (default: the two shipped H200 profiles)")
    ap.add_argument("--kernel", action="append", default=[], metavar="NAME=VALUE",
                    help=KERNEL_HELP + " (section 5)")
    a = ap.parse_args(argv)
    kernels = kernel_overrides(a.kernel)
    for folder in a.profiles or PROFILES:
        try:
            prof = load_profile(folder)
        except ConfigError as e:
            sys.exit(f"error: {e}")
        print(f"\n=== {folder} ({len(prof.rows)} points)")
        neighbours(prof)
        per_shape(prof)
        noise(prof)
        held_out(prof)
        in_sample_table(prof, kernels)


if __name__ == "__main__":
    main(sys.argv[1:])
