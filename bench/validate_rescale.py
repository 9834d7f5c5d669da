"""Simulate saved `bullet validate --out` runs again with the latency model scaled by given launch-speed factors
(or each run's own), and print the gated errors against the runs' real metrics: does one run's card speed carry
to the others? No GPU needed once the runs are saved.

    python3 bench/validate_rescale.py VALIDATE_OUT [VALIDATE_OUT ...] [--from RUN_FOLDER | --factors P,D]
        [--latency profiles/h200/llama-3.1-8b/model.json]

Each run folder (``trace@rate``) holds report.json and launches.csv. The requests are rebuilt as `bullet validate`
built them (the bundled trace, the run's rate, seed 0, from its first row; runs with --start, --seed,
--max-prompt or prefix caching are not rebuilt here). ``--from``: that run's launch speed for every run; ``--factors``:
given factors; neither: each run's own speed (what `bullet validate` prints as "at speed").
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bullet.config import CacheConfig, SchedulerConfig, SloConfig, resolve_gpu, resolve_model
from bullet.traces import load_trace
from bullet.validate import GATED, at_speed_of, compare, launch_speed
from simulator.run import latency_model, simulate


def launch_rows(folder: Path) -> list[dict]:
    with open(folder / "launches.csv") as f:
        return [{**r, "tokens": int(r["tokens"]), "seqs": int(r["seqs"]), "measured_ms": float(r["measured_ms"]),
                 "predicted_ms": float(r["predicted_ms"])} for r in csv.DictReader(f)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outs", nargs="+", type=Path, help="`bullet validate --out` folders (or run folders)")
    ap.add_argument("--from", dest="source", type=Path, help="run folder whose launch speed is used for every run")
    ap.add_argument("--factors", help="P,D: launch-speed factors for launches with prompt rows, decode-only")
    ap.add_argument("--latency", default="profiles/h200/llama-3.1-8b/model.json")
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--gpu", default="h200")
    args = ap.parse_args()
    for path in [*args.outs, *([args.source] if args.source else [])]:
        if not path.is_dir():
            ap.error(f"{path}: not a folder")
    if args.source and not (args.source / "launches.csv").exists():
        ap.error(f"--from {args.source}: no launches.csv (give a run folder, trace@rate)")
    spec, gpu = resolve_model(args.model), resolve_gpu(args.gpu)
    base = latency_model(args.latency, spec, gpu)
    fixed = launch_speed(launch_rows(args.source)) if args.source else \
        tuple(float(x) for x in args.factors.split(",")) if args.factors else None
    runs = sorted(p for out in args.outs for p in ([out] if (out / "report.json").exists() else out.iterdir())
                  if (p / "report.json").exists())
    print("| run | policy | factors | TTFT mean | TTFT p90 | TPOT mean | TPOT p90 | worst |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for run in runs:
        rep = json.loads((run / "report.json").read_text())
        trace, rate = run.name.split("@")
        conf, slo = rep["sim"]["config"], rep["sim"]["slo"]
        ms = {k: (None if slo[f"{k}_ms"] is None else slo[f"{k}_ms"] / 1e3) for k in ("ttft", "tpot", "ttft_per_token")}
        factors = fixed or launch_speed(launch_rows(run))
        reqs = load_trace(trace, num_requests=rep["real"]["requests"], rate=float(rate), seed=0)
        out = simulate(reqs, spec, gpu, SchedulerConfig(**conf["scheduler"]),
                       CacheConfig(num_blocks=conf["cache"]["num_blocks"], block_size=conf["cache"]["block_size"]),
                       SloConfig(ttft=ms["ttft"], tpot=ms["tpot"], ttft_per_token=ms["ttft_per_token"]),
                       at_speed_of(base, *factors), host_gap=tuple(conf["host_gap_s"]), timeline=False).summary
        rows = {r["metric"]: 100 * r["error"] for r in compare(rep["real"], out) if r["gated"]}
        cells = [rows[f"{m.upper()} {s} (ms)"] for m, s in sorted(GATED, key=lambda g: (g[0] != "ttft", g[1]))]
        print(f"| {run.name} | {conf['scheduler']['policy']} | {factors[0]:.3f} / {factors[1]:.3f} | "
              + " | ".join(f"{c:+.1f} %" for c in cells) + f" | {max(map(abs, cells)):.1f} % |")


if __name__ == "__main__":
    main()
