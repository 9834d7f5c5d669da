"""Simulate saved `bullet validate --out` runs again with the latency model scaled by given launch-speed factors
(or each run's own), and print the gated errors against the runs' real metrics: does one run's card speed carry
to the others? With ``--gap-from``, the simulator's host gap is also taken from serving (the gaps between a
lane's back-to-back launches in a run, `bullet.validate.serving_gap`) instead of the one each run used (the
model's, from the profile). No GPU needed once the runs are saved.

    python3 bench/validate_rescale.py VALIDATE_OUT [VALIDATE_OUT ...] [--from RUN_FOLDER | --factors P,D]
        [--gap-from RUN_FOLDER | --gap-own] [--latency profiles/h200/llama-3.1-8b/model.json]
    python3 bench/validate_rescale.py VALIDATE_OUT --held-out [--latency ...]

Each run folder (``trace@rate``) holds report.json and launches.csv. The requests are rebuilt as `bullet validate`
built them (the bundled trace, the run's rate, seed 0, from its first row; runs with --start, --seed,
--max-prompt or prefix caching are not rebuilt here). ``--from``: that run's launch speed for every run; ``--factors``:
given factors; neither: each run's own speed (what `bullet validate` prints as "at speed"). ``--gap-from``: that
run's serving gap for every run; ``--gap-own``: each run's own. ``--held-out``: every run of one policy simulated
with the factors of each other run of that policy in the same folder (a card), with the run's recorded host gap
and with the source run's serving gap; per run, the mean |error| over the sources both ways (a folder's
card-profile/model.json, where it keeps one, instead of --latency: its runs were made with it).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bullet.config import CacheConfig, SchedulerConfig, SloConfig, resolve_gpu, resolve_model
from bullet.traces import load_trace
from bullet.validate import GATED, at_speed_of, compare, launch_speed, serving_gap
from simulator.run import latency_model, simulate


def launch_rows(folder: Path) -> list[dict]:
    with open(folder / "launches.csv") as f:
        return [{**r, "tokens": int(r["tokens"]), "seqs": int(r["seqs"]), "measured_ms": float(r["measured_ms"]),
                 "predicted_ms": float(r["predicted_ms"])} for r in csv.DictReader(f)]


def resimulate(run: Path, base, spec, gpu, factors: tuple[float, float],
               gap: tuple[float, float] | None) -> tuple[str, list[float]]:
    """Run folder ``run`` simulated again at ``factors`` with host gap ``gap`` (None: the one it recorded): its
    policy and the gated errors (%, TTFT mean, p90, TPOT mean, p90)."""
    rep = json.loads((run / "report.json").read_text())
    trace, rate = run.name.split("@")
    conf, slo = rep["sim"]["config"], rep["sim"]["slo"]
    ms = {k: (None if slo[f"{k}_ms"] is None else slo[f"{k}_ms"] / 1e3) for k in ("ttft", "tpot", "ttft_per_token")}
    reqs = load_trace(trace, num_requests=rep["real"]["requests"], rate=float(rate), seed=0)
    out = simulate(reqs, spec, gpu, SchedulerConfig(**conf["scheduler"]),
                   CacheConfig(num_blocks=conf["cache"]["num_blocks"], block_size=conf["cache"]["block_size"]),
                   SloConfig(ttft=ms["ttft"], tpot=ms["tpot"], ttft_per_token=ms["ttft_per_token"]),
                   at_speed_of(base, *factors), host_gap=gap or tuple(conf["host_gap_s"]), timeline=False).summary
    rows = {r["metric"]: 100 * r["error"] for r in compare(rep["real"], out) if r["gated"]}
    return conf["scheduler"]["policy"], [rows[f"{m.upper()} {s} (ms)"]
                                         for m, s in sorted(GATED, key=lambda g: (g[0] != "ttft", g[1]))]


def gap_of(run: Path) -> tuple[float, float]:
    g = serving_gap([launch_rows(run)])
    return g["fixed_s"], g["per_request_s"]


def held_out(folders: list[Path], base, spec, gpu) -> None:
    """Per folder (a card) and policy: each run at every other run's factors, without and with its serving gap."""
    print("| card | run | policy | sources | TTFT mean | TTFT p90 | TPOT mean | TPOT p90 | worst | within 5 % |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    every: list[list[np.ndarray]] = [[], []]
    for folder in folders:
        own = folder / "card-profile" / "model.json"  # runs made with the card's own profile keep it there
        lat = latency_model(str(own), spec, gpu) if own.exists() else base
        runs = sorted(p for p in folder.iterdir() if (p / "report.json").exists())
        policy = {r: json.loads((r / "report.json").read_text())["sim"]["config"]["scheduler"]["policy"] for r in runs}
        speed = {r: launch_speed(launch_rows(r)) for r in runs}
        gaps = {r: gap_of(r) for r in runs}
        pooled: dict[str, list[list[np.ndarray]]] = {}
        for run in runs:
            srcs = [s for s in runs if s != run and policy[s] == policy[run]]
            both = []
            for with_gap in (False, True):
                both.append(np.array([resimulate(run, lat, spec, gpu, speed[s], gaps[s] if with_gap else None)[1]
                                      for s in srcs]))
            pooled.setdefault(policy[run], [[], []])
            for k, e in enumerate(both):
                pooled[policy[run]][k].append(e)
                every[k].append(e)
            cells = []
            for k in range(4):
                cells.append(" / ".join(f"{np.abs(e[:, k]).mean():.1f}" for e in both))
            worst = " / ".join(f"{np.abs(e).max(axis=1).mean():.1f}" for e in both)
            within = " / ".join(f"{int((np.abs(e).max(axis=1) <= 5).sum())}" for e in both)
            print(f"| {folder.name} | {run.name} | {policy[run]} | {len(srcs)} | " + " | ".join(cells)
                  + f" | {worst} | {within} of {len(srcs)} |")
        for pol, (alone, gapped) in sorted(pooled.items()):  # every (run, source) pair of the policy
            _pooled_row(folder.name, pol, alone, gapped)
    if len(folders) > 1:
        _pooled_row("every card", "both", *every)


def _pooled_row(card: str, policy: str, alone: list[np.ndarray], gapped: list[np.ndarray]) -> None:
    a, g = np.concatenate(alone), np.concatenate(gapped)
    cells = [f"{np.abs(a[:, k]).mean():.1f} / {np.abs(g[:, k]).mean():.1f}" for k in range(4)]
    print(f"| {card} | **all** | {policy} | {len(a)} pairs | " + " | ".join(cells)
          + f" | {np.abs(a).max(axis=1).mean():.1f} / {np.abs(g).max(axis=1).mean():.1f} | "
          f"{int((np.abs(a).max(axis=1) <= 5).sum())} / {int((np.abs(g).max(axis=1) <= 5).sum())} of {len(a)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outs", nargs="+", type=Path, help="`bullet validate --out` folders (or run folders)")
    ap.add_argument("--from", dest="source", type=Path, help="run folder whose launch speed is used for every run")
    ap.add_argument("--factors", help="P,D: launch-speed factors for launches with prompt rows, decode-only")
    ap.add_argument("--gap-from", type=Path, help="run folder whose serving gap is used for every run")
    ap.add_argument("--gap-own", action="store_true", help="each run's own serving gap")
    ap.add_argument("--held-out", action="store_true", help="each run at every other run's factors of its "
                    "folder and policy, without and with that run's serving gap (mean |error| over them)")
    ap.add_argument("--latency", default="profiles/h200/llama-3.1-8b/model.json")
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--gpu", default="h200")
    args = ap.parse_args()
    for path in [*args.outs, *([args.source] if args.source else []), *([args.gap_from] if args.gap_from else [])]:
        if not path.is_dir():
            ap.error(f"{path}: not a folder")
    for flag, path in (("--from", args.source), ("--gap-from", args.gap_from)):
        if path and not (path / "launches.csv").exists():
            ap.error(f"{flag} {path}: no launches.csv (give a run folder, trace@rate)")
    spec, gpu = resolve_model(args.model), resolve_gpu(args.gpu)
    base = latency_model(args.latency, spec, gpu)
    if args.held_out:
        held_out(args.outs, base, spec, gpu)
        return
    fixed = launch_speed(launch_rows(args.source)) if args.source else \
        tuple(float(x) for x in args.factors.split(",")) if args.factors else None
    gap = gap_of(args.gap_from) if args.gap_from else None
    runs = sorted(p for out in args.outs for p in ([out] if (out / "report.json").exists() else out.iterdir())
                  if (p / "report.json").exists())
    print("| run | policy | factors | TTFT mean | TTFT p90 | TPOT mean | TPOT p90 | worst | host gap |")
    print("|---|---|---|---:|---:|---:|---:|---:|---|")
    for run in runs:
        factors = fixed or launch_speed(launch_rows(run))
        g = gap_of(run) if args.gap_own else gap
        policy, cells = resimulate(run, base, spec, gpu, factors, g)
        used = g or json.loads((run / "report.json").read_text())["sim"]["config"]["host_gap_s"]
        print(f"| {run.name} | {policy} | {factors[0]:.3f} / {factors[1]:.3f} | "
              + " | ".join(f"{c:+.1f} %" for c in cells) + f" | {max(map(abs, cells)):.1f} % | "
              f"{used[0] * 1e3:.3f} ms + {used[1] * 1e6:.1f} us{'' if g else ' (recorded)'} |")


if __name__ == "__main__":
    main()
