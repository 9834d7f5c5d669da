"""Co-run prefill: where the fit misses, and how much of it is measurement noise (issue 9).

For a profile folder (default: the shipped H200 Llama-3.1-8B), on points.csv as it is and, where the folder has
corun_passes.csv, on points.csv rebuilt with the median of every co-run point's passes (what ``bullet profile``
writes as the passes are measured; ``--medians``):

1. every co-run prefill point, held out on the interior loso split and in sample: the error split into the eager
   family's at the shape (the predicted stand-alone time over the measured twin, the same shape alone on the same
   SMs) and the slowdown's (the measured co-run time over the twin against the predicted slowdown), then the mean
   error and bias by prefill SMs, co-runner rows, prompt tokens and layers;
2. the noise: each pass against the others (log ratio: mean, sd), one pass's sd from passes on the same card, the
   MAPE that this noise alone gives a median of K passes, and the held-out error against each pass alone and for
   points with 3 passes against those with 2;
3. the random 20 % split over seeds 0..S-1 (``--seeds``), every gated family: is a family's miss on seed 0 (mixed
   n=6) a small-sample artifact?

    PYTHONPATH=$PWD python3 bench/corun_residuals.py [PROFILE_DIR] [--medians] [--seeds 5] [--no-split-factor]
        [--kernel prefill_attn_slots_per_sm=2 ...]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

from bullet.config import ConfigError
from bullet.gpu.profile import PASSES_FILE, median_row, read_passes
from bullet.perfmodel import FittedModel
from bullet.perfmodel.base import partly_co_run
from bullet.perfmodel.fit import (
    COLUMNS,
    GATED,
    co_work_of_row,
    fit_model,
    folds,
    load_profile,
    predictions,
    work_of_row,
)
from bullet.perfmodel.fit import _read_points as read_typed
from bullet.perfmodel.fitted import DEFAULT_KERNELS

FAMILIES = (*GATED, "launch")


def with_medians(prof):
    """``prof`` with each co-run point's row the median of its passes in corun_passes.csv (points that have passes
    but no row yet appended), as ``bullet profile`` writes them."""
    path = prof.folder / PASSES_FILE
    med = {pid: median_row(rows) for pid, rows in read_passes(path).items()}
    rows = [med.pop(r["id"], r) for r in prof.rows] + list(med.values())
    return dataclasses.replace(prof, rows=typed(prof, rows))


def typed(prof, rows: list[dict]) -> list[dict]:
    """Rows (strings or numbers) typed as the fit reads points.csv."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore")
    w.writeheader()
    w.writerows({k: (f"{v:.9g}" if isinstance(v, float) else v) for k, v in r.items()} for r in rows)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d) / "points.csv"
        tmp.write_text(buf.getvalue())
        return read_typed(tmp, prof.num_sms)[0]


def fitted(prof, held: list[bool], fit: dict | None = None) -> FittedModel:
    """The model fitted on the rows not ``held`` out; ``fit``: :func:`fit_model`'s options (``split``, ``kernels``)."""
    return FittedModel(fit_model(prof, [r for r, h in zip(prof.rows, held) if not h], **(fit or {})), host=True)


def co_prefill(r: dict) -> bool:
    return bool(r["co_kind"]) and r["kind"] != "decode"


def parts(fm: FittedModel, r: dict, twin: float) -> tuple[float, float, float]:
    """(total, eager-at-shape, slowdown) relative errors of a co-run prefill point against the measured twin."""
    w, n = work_of_row(r), r["sms"]
    alone = fm.gpu_time(w, n)
    co = fm.eager_next_to(w, alone, n, co_work_of_row(r), r["co_sms"])
    o = min(1.0, max(r["overlap"], 0.0))
    return (partly_co_run(alone, co, o) / r["gpu_s"] - 1, alone / twin - 1,
            partly_co_run(twin, twin * co / alone, o) / r["gpu_s"] - 1)


def group(p: dict) -> dict[str, str]:
    rows = p["co_seqs"]
    return {"prefill SMs (the decode lane has the rest)": str(p["sms"]),
            "co-runner rows": "1" if rows == 1 else "2-8" if rows <= 8 else "16-64" if rows <= 64 else "128",
            "prompt tokens": "512-1024" if p["tokens"] <= 1024 else "1536-4096" if p["tokens"] <= 4096 else "6144-8192",
            "layers": str(p["layers"])}


def residuals(prof, fit: dict | None = None) -> dict[str, list[float]]:
    rows, twins = prof.rows, {r["id"]: r["gpu_s"] for r in prof.rows if not r["co_kind"]}

    def twin_of(r: dict) -> float:  # NaN where the profile did not measure the shape alone (no --twins)
        return twins.get(r["id"].split(" || ")[0], float("nan"))
    out: dict[str, dict] = {"interior": {}, "in sample": {}}
    for name, split, held in folds(prof):
        if split == "interior" and any(h and co_prefill(r) for r, h in zip(rows, held)):
            fm = fitted(prof, held, fit)
            out["interior"].update({r["id"]: parts(fm, r, twin_of(r)) for r, h in zip(rows, held) if h and co_prefill(r)})
    fm = fitted(prof, [False] * len(rows), fit)
    out["in sample"] = {r["id"]: parts(fm, r, twin_of(r)) for r in rows if co_prefill(r)}
    by_id = {r["id"]: r for r in rows}
    print("\n1. co-run prefill, MAPE % (bias) of the co-run time | eager at the shape (alone over twin) | slowdown "
          "(with the twin as the stand-alone time)")
    for split, errs in out.items():
        a = np.array(list(errs.values()))
        tw = ~np.isnan(a[:, 1])
        print(f"   {split}, {len(a)} points ({tw.sum()} with a twin): " + " | ".join(
            f"{100 * np.abs(a[tw | (i == 0), i]).mean():.2f} ({100 * a[tw | (i == 0), i].mean():+.2f})" for i in range(3)))
        cells = defaultdict(list)
        for pid, e in errs.items():
            for key, val in group(by_id[pid]).items():
                cells[(key, val)].append(e)
        for key in ("prefill SMs (the decode lane has the rest)", "co-runner rows", "prompt tokens", "layers"):
            vals = sorted({v for k, v in cells if k == key}, key=lambda v: (len(v), v))
            print(f"     by {key}: " + "  ".join(
                f"{v}: {len(cells[(key, v)])} {100 * np.abs(np.array(cells[(key, v)])[:, 0]).mean():.1f} "
                f"({100 * np.array(cells[(key, v)])[:, 0].mean():+.1f})" for v in vals))
    print("     (by group: points, MAPE (bias) of the co-run time)")
    worst = sorted(out["interior"].items(), key=lambda kv: -abs(kv[1][0]))[:6]
    print("   largest interior misses (total | eager | slowdown, %): " + "; ".join(
        f"{pid[8:pid.index('|')]}@{by_id[pid]['sms']} next to {by_id[pid]['co_seqs']} rows@{by_id[pid]['co_sms']}: "
        f"{100 * e[0]:+.1f} | {100 * e[1]:+.1f} | {100 * e[2]:+.1f}" for pid, e in worst))
    return out["interior"]


def noise(prof, interior: dict, first_card: set[str], fit: dict | None = None) -> None:
    """``first_card``: the co-run ids whose first pass was measured on another card (the rows points.csv had
    before the re-measurement's passes): one pass's sd is taken from their later passes only."""
    path = prof.folder / PASSES_FILE
    if not path.exists():
        print("\n2. noise: no corun_passes.csv")
        return
    passes = read_passes(path)
    col = {"prefill": "gpu_s", "decode": "step_s"}
    print("\n2. co-run passes, 100 x log(pass b / pass a): points, mean, sd")
    sd_same = {}
    for kind in ("prefill", "decode"):
        cells = []
        for a, b in ((1, 2), (1, 3), (2, 3)):
            d = [np.log(float(ps[b - 1][col[kind]]) / float(ps[a - 1][col[kind]])) for ps in passes.values()
                 if len(ps) >= b and ps[0]["kind"] == kind]
            cells.append(f"{b}/{a}: {len(d)} {100 * np.mean(d):+.2f} {100 * np.std(d, ddof=1):.2f}")
        # one pass's sd from passes on the same card: 2 and 3 of a shipped point, 1 and 2 of a new one (measured
        # after the re-measurement began); the shipped points' first pass is the older card's
        same = [np.log(float(ps[-1][col[kind]]) / float(ps[-2][col[kind]])) for ps in passes.values()
                if ps[0]["kind"] == kind and len(ps) - (ps[0]["id"] in first_card) >= 2]
        sd_same[kind] = float(np.std(same, ddof=1) / np.sqrt(2))
        print(f"   {kind}: " + "; ".join(cells) + f"; one pass's sd on one card {100 * sd_same[kind]:.2f} % "
              f"({len(same)} pairs)")
    rng = np.random.default_rng(0)
    z = rng.standard_normal((200_000, 3))
    floor = {k: float(np.mean(np.abs(np.median(z[:, :k], axis=1) if k != 2 else z[:, :2].mean(axis=1))))
             for k in (1, 2, 3)}
    print("   MAPE of a perfect model against a median of K passes, the pass noise alone (one card), %: " + "; ".join(
        f"{kind} " + " ".join(f"K={k} {100 * sd * floor[k]:.2f}" for k in (1, 2, 3)) for kind, sd in sd_same.items()))
    by_id = {r["id"]: r for r in prof.rows}
    print("   interior held-out co-run prefill error against each pass alone (MAPE %, bias), and by passes measured:")
    fold_models = {}
    rows = prof.rows
    for name, split, held in folds(prof):
        if split == "interior":
            for r, h in zip(rows, held):
                if h and co_prefill(r):
                    fold_models[r["id"]] = (name, held)
    cache: dict[str, FittedModel] = {}
    per_pass = defaultdict(list)
    by_k = defaultdict(list)
    for pid, (name, held) in fold_models.items():
        fm = cache.get(name) or cache.setdefault(name, fitted(prof, held, fit))
        for k, row in enumerate(passes.get(pid, []), 1):
            r = dict(by_id[pid], **{c: float(row[c]) for c in ("gpu_s", "overlap")})
            p, m = predictions(fm, r)["co-run prefill"]
            per_pass[k].append(p / m - 1)
        by_k[len(passes.get(pid, []))].append(interior[pid][0])
    print("     " + "  ".join(f"pass {k}: {len(v)} {100 * np.mean(np.abs(v)):.2f} ({100 * np.mean(v):+.2f})"
                              for k, v in sorted(per_pass.items()))
          + "  | median row: " + "  ".join(f"{k} passes: {len(v)} {100 * np.mean(np.abs(v)):.2f}"
                                          for k, v in sorted(by_k.items())))


def seeds(prof, n: int, fit: dict | None = None) -> None:
    print(f"\n3. random 20 % split, seeds 0..{n - 1}: MAPE % (points) per seed, then pooled")
    pooled, over = defaultdict(list), defaultdict(int)
    for seed in range(n):
        held = folds(prof, seed)[0][2]
        fm = fitted(prof, held, fit)
        errs = defaultdict(list)
        for r, h in zip(prof.rows, held):
            if h:
                for fam, (p, m) in predictions(fm, r).items():
                    errs[fam].append(abs(p / m - 1))
        print(f"   seed {seed}: " + "  ".join(f"{f} {100 * np.mean(errs[f]):.2f} ({len(errs[f])})"
                                             for f in FAMILIES if errs[f]))
        for f in FAMILIES:
            pooled[f] += errs[f]
            over[f] += bool(errs[f]) and float(np.mean(errs[f])) > 0.03
    print("   pooled: " + "  ".join(f"{f} {100 * np.mean(v):.2f} ({len(v)}, {over[f]} of {n} seeds over 3 %)"
                                    for f, v in pooled.items() if v))


KERNEL_HELP = ("a kernel constant of the fit (fitted.DEFAULT_KERNELS), e.g. prefill_attn_slots_per_sm=2; "
               "prefill_attn_slots_per_sm=1e-9 makes attn_extra 0 (the version 10 fit); repeatable")


def kernel_overrides(items: list[str]) -> dict:
    """DEFAULT_KERNELS with ``NAME=VALUE`` items (``--kernel``) put in."""
    kernels = dict(DEFAULT_KERNELS)
    for item in items:
        name, _, value = item.partition("=")
        if name not in kernels or not value:
            raise SystemExit(f"error: --kernel {item!r}: give NAME=VALUE, NAME one of {', '.join(kernels)}")
        kernels[name] = int(value) if value.isdigit() else float(value)
    return kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile", nargs="?", default="profiles/h200/llama-3.1-8b", help="profile folder")
    ap.add_argument("--medians", action="store_true", help="co-run rows: the median of their passes")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--no-split-factor", action="store_true",
                    help="fit without the co-run factor per prefill size (format version 8's fit)")
    ap.add_argument("--kernel", action="append", default=[], metavar="NAME=VALUE", help=KERNEL_HELP)
    a = ap.parse_args()
    try:
        prof = load_profile(a.profile)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    first_card = {r["id"] for r in prof.rows if r["co_kind"]}  # (the shipped profile: its rows are their 1st pass)
    if a.medians and (prof.folder / PASSES_FILE).exists():
        prof = with_medians(prof)
    print(f"=== {a.profile}: {len(prof.rows)} points" + (", co-run rows the median of their passes" if a.medians else ""))
    fit = {"split": not a.no_split_factor, "kernels": kernel_overrides(a.kernel)}
    interior = residuals(prof, fit)
    noise(prof, interior, first_card, fit)
    seeds(prof, a.seeds, fit)


if __name__ == "__main__":
    main()
