"""bullet variants on held-out windows of a trace, with the noise of the simulation measured beside them
(issue 10): capacity (the policy study's bisection, 2 % steps) per window, and attainment at fixed rates (a
short burst and a long run), so that a rule tuned on the study's window (requests 0-999) is judged on others.

Noise: attainment near capacity is chaotic (a change that moves one launch reorders the queue from there on):
rates 0.1 % apart give attainments up to 2-4 points apart. With ``--jitter K`` every cell is run at ``2K + 1``
rates ``R * (1 + k / 1000)``, ``k = -K..K`` (capacity: the bisection started from ``guess * (1 + k / 1000)``),
and the tables give the mean, and for each variant after the first the mean paired difference from the first
with its standard error (``sd / sqrt(2K + 1)``): a difference within two standard errors is noise.

A variant is ``NAME:key=value,...``: lower-case keys are ``SchedulerConfig`` fields (``policy=prefill-first``: a
baseline), upper-case ones constants of ``bullet/policies/bullet.py`` (set in the worker: trying a constant
without editing the file). ``bullet`` alone is bullet's default configuration.

    PYTHONPATH=$PWD python3 bench/overload_check.py --variants no-deferral:overload_deferral=false bullet \
        [--windows 0,1000,2000] [--caps sharegpt:paper ...] [--fixed 400:10,12,14,16,20 1000:10,12,14,16,20] \
        [--fixed-trace sharegpt:paper] [--jitter 3] [--jobs 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import policy_study as ps

from bullet.config import SchedulerConfig
from bullet.traces import load_trace
from simulator.capacity import capacity
from simulator.run import latency_model, simulate


def parse_variant(text: str) -> tuple[str, dict, dict]:
    name, _, rest = text.partition(":")
    cfg, consts = {}, {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        v: object = {"true": True, "false": False}.get(value.lower(), value)
        for kind in (int, float):
            if isinstance(v, str):
                try:
                    v = kind(v)
                except ValueError:
                    pass
        (consts if key.isupper() else cfg)[key] = v
    return name, cfg, consts


_DEFAULTS: dict = {}  # the constants as bullet.py sets them (a worker runs tasks of several variants)


def _patch(consts: dict) -> None:
    from bullet.policies import bullet as mod

    if not _DEFAULTS:
        _DEFAULTS.update({k: v for k, v in vars(mod).items() if k.isupper()})
    for k, v in _DEFAULTS.items():
        setattr(mod, k, v)
    for k, v in consts.items():
        if not hasattr(mod, k):
            raise SystemExit(f"bullet.py has no constant {k}")
        setattr(mod, k, v)


def run(trace: str, slo_set: str, cfg: dict, consts: dict, n: int, rate: float, start: int, latency: str) -> dict:
    _patch(consts)
    reqs = load_trace(trace, num_requests=n, rate=rate, start=start)
    sched = dataclasses.replace(SchedulerConfig(policy="bullet"), **cfg)
    res = simulate(reqs, ps.MODEL, ps.GPU, sched, slo=ps.slo_of(trace, slo_set),
                   latency=latency_model(latency, ps.MODEL, ps.GPU), timeline=False)
    return {"attainment": res.summary["slo_attainment"], "deferred": res.summary.get("requests_deferred", 0)}


def cap_task(trace: str, slo_set: str, cfg: dict, consts: dict, n: int, start: int, latency: str,
             guess_scale: float = 1.0) -> float:
    cap, _ = capacity(lambda r: run(trace, slo_set, cfg, consts, n, r, start, latency)["attainment"],
                      ps.GUESS[trace] * guess_scale, rel_tol=0.02)
    return cap


def stats(xs: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean."""
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, 0.0
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def cell(values: list[list[float]], i: int, fmt: str, scale: float = 1.0) -> str:
    """Variant ``i``'s mean; after the first, its paired difference from the first, +- its standard error."""
    m, _ = stats(values[i])
    if i == 0 or len(values[i]) < 2:
        return fmt.format(m)
    d, se = stats([(a - b) * scale for a, b in zip(values[i], values[0])])
    return fmt.format(m) + f" ({d:+.2f} ± {se:.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", nargs="+", default=["no-deferral:overload_deferral=false", "bullet"])
    ap.add_argument("--windows", default="0,1000,2000", help="first request of each window")
    ap.add_argument("--caps", nargs="*", default=["sharegpt:paper"], help="trace:SLOs cells for capacity")
    ap.add_argument("--cap-windows", default=None, help="windows for capacity (default: --windows)")
    ap.add_argument("--fixed", nargs="*", default=["400:10,12,14,16,20", "1000:10,12,14,16,20"],
                    help="N:rates (attainment at each, on --fixed-trace)")
    ap.add_argument("--fixed-trace", default="sharegpt:paper")
    ap.add_argument("--num-requests", type=int, default=1000, help="per capacity run")
    ap.add_argument("--jitter", type=int, default=0, help="K: 2K+1 rates 0.1 %% apart per cell (noise)")
    ap.add_argument("--latency", default="fitted")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    t0 = time.perf_counter()
    variants = [parse_variant(v) for v in args.variants]
    windows = [int(w) for w in args.windows.split(",")]
    cap_windows = [int(w) for w in (args.cap_windows or args.windows).split(",")]
    ftrace, fslo = args.fixed_trace.split(":")
    fixed = [(int(n), [float(r) for r in rates.split(",")]) for n, _, rates in (f.partition(":") for f in args.fixed)]
    ks = range(-args.jitter, args.jitter + 1)
    with ProcessPoolExecutor(args.jobs) as pool:
        caps = {(name, c, w, k): pool.submit(cap_task, *c.split(":"), cfg, consts, args.num_requests, w,
                                             args.latency, 1 + k / 1000)
                for name, cfg, consts in variants for c in args.caps for w in cap_windows for k in ks}
        pts = {(name, n, r, w, k): pool.submit(run, ftrace, fslo, cfg, consts, n, r * (1 + k / 1000), w, args.latency)
               for name, cfg, consts in variants for n, rates in fixed for r in rates for w in windows for k in ks
               if w + n <= 3000}
        caps = {key: f.result() for key, f in caps.items()}
        pts = {key: f.result() for key, f in pts.items()}
    names = [name for name, _, _ in variants]
    if caps:
        print(f"\nCapacity, req/s (window = first request; {len(ks)} bisections each"
              f"{', paired difference ± s.e.' if len(ks) > 1 else ''})\n")
        cols = [(c, w) for c in args.caps for w in cap_windows]
        print("| variant | " + " | ".join(f"{c} @{w}" for c, w in cols) + " |")
        print("|---|" + "---:|" * len(cols))
        for i, name in enumerate(names):
            vals = {(c, w): [[caps[v, c, w, k] for k in ks] for v in names] for c, w in cols}
            print(f"| {name} | " + " | ".join(cell(vals[col], i, "{:.2f}") for col in cols) + " |")
    if pts:
        print(f"\nAttainment, % on {ftrace}, {fslo} SLOs (mean of {len(ks)} rates; paired difference ± s.e., "
              f"points; requests deferred, mean)\n")
        for n, rates in fixed:
            for w in windows:
                if w + n > 3000:
                    continue
                print(f"| N = {n}, window {w} | " + " | ".join(f"R {r:g}" for r in rates) + " |")
                print("|---|" + "---:|" * len(rates))
                for i, name in enumerate(names):
                    cells = []
                    for r in rates:
                        vals = [[100 * pts[v, n, r, w, k]["attainment"] for k in ks] for v in names]
                        dfr = sum(pts[name, n, r, w, k]["deferred"] for k in ks) / len(ks)
                        cells.append(cell(vals, i, "{:.1f}") + (f" [{dfr:.0f}]" if dfr else ""))
                    print(f"| {name} | " + " | ".join(cells) + " |")
                print()
    print(f"{time.perf_counter() - t0:.0f} s on {args.jobs} processes")


if __name__ == "__main__":
    main()
