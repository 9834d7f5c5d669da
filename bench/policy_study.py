"""Policy study (simulated): capacity of every policy on the bundled traces, Llama-3.1-8B on an H200.

Capacity = the highest request rate at which >= 90 % of requests meet both SLOs (DistServe's goodput
definition), by bisection over each trace rescaled to each rate (``simulator/capacity.py``). Policies: bullet
(and bullet without its default ``overload_deferral``, reported beside it, never counted as a baseline);
chunked prefill at 512, 1024, 2048 and 8192 tokens; prefill-first; static-split at every other prefill size of
the nested menu (the best one is reported); naive-concurrent. Two SLO sets: the Bullet paper's (TTFT per
prompt token 3.0 / 1.5 / 1.5 ms and TPOT 150 / 200 / 175 ms for sharegpt / azure-code / arxiv) and a tight
interactive one (TTFT 500 ms, TPOT 50 ms). Then, at three rates (0.5x, 0.75x and 1x the best baseline's
capacity), goodput and TTFT/TPOT percentiles of bullet and the best baselines; plots of attainment vs rate
and of bullet's SM split over time.

Usage: ``python3 bench/policy_study.py [--num-requests 1000] [--traces sharegpt,azure-code,arxiv]
[--slos paper,tight] [--latency roofline] [--jobs 2] [--out bench/out/policy_study]``. Prints markdown tables;
writes ``runs.csv`` (every simulated point), ``capacity.csv``, ``rates.csv`` and PNG plots under ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from bullet.config import GPUS, MODELS, SchedulerConfig, SloConfig
from bullet.traces import load_trace
from simulator.capacity import capacity
from simulator.run import latency_model, simulate

MODEL, GPU = MODELS["llama-3.1-8b"], GPUS["h200"]
PAPER = {"sharegpt": (0.003, 0.150), "azure-code": (0.0015, 0.200), "arxiv": (0.0015, 0.175)}
GUESS = {"sharegpt": 8.0, "azure-code": 2.0, "arxiv": 10.0}  # where bisection starts (req/s)
STATIC_SIZES = GPU.prefill_sizes[1:-1:2]  # 28, 44, ..., 124


def slo_of(trace: str, slo_set: str) -> SloConfig:
    if slo_set == "paper":
        per_token, tpot = PAPER[trace]
        return SloConfig(ttft=None, ttft_per_token=per_token, tpot=tpot)
    return SloConfig(ttft=0.5, tpot=0.05)


def policies() -> dict[str, SchedulerConfig]:
    out = {"bullet": SchedulerConfig(policy="bullet"),
           "bullet-no-deferral": SchedulerConfig(policy="bullet", overload_deferral=False)}
    for t in (512, 1024, 2048, 8192):
        out[f"chunked-{t}"] = SchedulerConfig(policy="chunked", max_batched_tokens=t)
    out["prefill-first"] = SchedulerConfig(policy="prefill-first")
    for p in STATIC_SIZES:
        out[f"static-{p}"] = SchedulerConfig(policy="static-split", prefill_sms=p, layers_per_step=8)
    out["naive-concurrent"] = SchedulerConfig(policy="naive-concurrent", layers_per_step=8)
    return out


def run_point(trace: str, slo_set: str, name: str, rate: float, n: int, latency: str, timeline: bool = False):
    cfg = policies()[name]
    reqs = load_trace(trace, num_requests=n, rate=rate)
    res = simulate(reqs, MODEL, GPU, cfg, slo=slo_of(trace, slo_set), latency=latency_model(latency, MODEL, GPU))
    s = res.summary
    row = {"trace": trace, "slo": slo_set, "policy": name, "rate": rate, "attainment": s["slo_attainment"],
           "goodput": s["goodput"], "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p90_ms": s["ttft_ms"]["p90"],
           "ttft_p99_ms": s["ttft_ms"]["p99"], "tpot_p50_ms": s["tpot_ms"]["p50"],
           "tpot_p90_ms": s["tpot_ms"]["p90"], "tpot_p99_ms": s["tpot_ms"]["p99"],
           "throughput_tok_s": s["output_throughput"]}
    if timeline:
        row["timeline"] = [(r[0], r[1], r[6], r[7][-1]) for r in res.timeline.rows]
    return row


def capacity_task(trace: str, slo_set: str, name: str, n: int, latency: str):
    runs = []

    def attain(rate: float) -> float:
        row = run_point(trace, slo_set, name, rate, n, latency)
        runs.append(row)
        return row["attainment"]

    cap, _ = capacity(attain, GUESS[trace], rel_tol=0.02)
    return trace, slo_set, name, cap, runs


def write_csv(rows: list[dict], path: Path) -> None:
    keys = [k for k in rows[0] if k != "timeline"]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def plot(runs: list[dict], caps: dict, rates_rows: list[dict], out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    combos = sorted({(r["trace"], r["slo"]) for r in runs})
    fig, axes = plt.subplots(len(combos), 1, figsize=(8, 3.2 * len(combos)), squeeze=False)
    for ax, (trace, slo_set) in zip(axes[:, 0], combos):
        shown = _shown(caps, trace, slo_set)
        for name in shown:
            pts = sorted((r["rate"], r["attainment"]) for r in runs
                         if r["trace"] == trace and r["slo"] == slo_set and r["policy"] == name)
            label = f"{name} ({caps[trace, slo_set, name]:.2f})"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=label)
        ax.axhline(0.9, color="grey", lw=0.8, ls="--")
        ax.set_title(f"{trace}, {slo_set} SLOs: attainment vs rate (capacity in legend)")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("SLO attainment")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "attainment.png", dpi=110)
    plt.close(fig)
    made.append("attainment.png")
    tl = [r for r in rates_rows if r.get("timeline")]
    if tl:
        fig, axes = plt.subplots(len(tl), 1, figsize=(9, 2.6 * len(tl)), squeeze=False)
        for ax, r in zip(axes[:, 0], tl):
            for lane, color in (("prefill", "tab:blue"), ("decode", "tab:orange")):
                xs, ys = [], []
                for ln, sms, start, end in r["timeline"]:
                    if ln == lane:
                        xs += [start, end, None]
                        ys += [sms, sms, None]
                ax.plot(xs, ys, color=color, lw=1.0, label=f"{lane} SMs")
            ax.set_title(f"bullet SM split: {r['trace']}, {r['slo']} SLOs, {r['rate']:.2f} req/s")
            ax.set_xlabel("time (s)")
            ax.set_ylabel("SMs")
            ax.set_xlim(0, min(60.0, max(e for _, _, _, e in r["timeline"])))
            ax.legend(fontsize=7, loc="upper right")
        fig.tight_layout()
        fig.savefig(out / "split_timeline.png", dpi=110)
        plt.close(fig)
        made.append("split_timeline.png")
    return made


def _shown(caps: dict, trace: str, slo_set: str) -> list[str]:
    """bullet, the best chunked, prefill-first, the best static split, naive-concurrent."""
    mine = {name: c for (t, s, name), c in caps.items() if (t, s) == (trace, slo_set)}
    chunked = max((n for n in mine if n.startswith("chunked")), key=mine.get)
    static = max((n for n in mine if n.startswith("static")), key=mine.get)
    return ["bullet", chunked, "prefill-first", static, "naive-concurrent"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--traces", default="sharegpt,azure-code,arxiv")
    ap.add_argument("--slos", default="paper,tight")
    ap.add_argument("--latency", default="roofline", help="roofline, fitted, or a model JSON path")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path, default=Path("bench/out/policy_study"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    combos = [(t, s) for t in args.traces.split(",") for s in args.slos.split(",")]
    names = list(policies())
    caps, runs = {}, []
    with ProcessPoolExecutor(args.jobs) as pool:
        futs = [pool.submit(capacity_task, t, s, name, args.num_requests, args.latency)
                for t, s in combos for name in names]
        for i, f in enumerate(futs, 1):
            trace, slo_set, name, cap, rr = f.result()
            caps[trace, slo_set, name] = cap
            runs += rr
            print(f"  [{i}/{len(futs)}] {trace} {slo_set} {name}: {cap:.2f} req/s", flush=True)
        rate_futs = []
        for t, s in combos:
            shown = _shown(caps, t, s)
            best = max(caps[t, s, n] for n in names if not n.startswith("bullet"))
            for frac in (0.5, 0.75, 1.0):
                for name in shown:
                    tl = name == "bullet" and frac == 0.75
                    rate_futs.append(pool.submit(run_point, t, s, name, frac * best, args.num_requests,
                                                 args.latency, tl))
        rates_rows = [f.result() for f in rate_futs]
    write_csv(runs, args.out / "runs.csv")
    write_csv(rates_rows, args.out / "rates.csv")
    with (args.out / "capacity.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["trace", "slo", "policy", "capacity_req_s"])
        for (t, s, name), c in sorted(caps.items()):
            w.writerow([t, s, name, f"{c:.3f}"])
    made = plot(runs + rates_rows, caps, rates_rows, args.out)

    print(f"\nCapacity (req/s at >= 90 % SLO attainment), {args.num_requests} requests per run, latency model "
          f"{args.latency}, {time.perf_counter() - t0:.0f} s on {args.jobs} processes\n")
    cols = ["bullet", "bullet-no-deferral", "chunked-512", "chunked-1024", "chunked-2048", "chunked-8192", "prefill-first",
            "best static", "naive-concurrent", "bullet / best baseline", "without deferral"]
    print("| trace | SLOs | " + " | ".join(cols) + " |")
    print("|---|---|" + "---:|" * len(cols))
    for t, s in combos:
        static = max((n for n in names if n.startswith("static")), key=lambda n: caps[t, s, n])
        best = max(caps[t, s, n] for n in names if not n.startswith("bullet"))
        cells = [f"{caps[t, s, n]:.2f}" for n in cols[:7]]
        cells += [f"{caps[t, s, static]:.2f} ({static.split('-')[1]} SMs)", f"{caps[t, s, 'naive-concurrent']:.2f}",
                  f"**{caps[t, s, 'bullet'] / best:.2f}x**" if best else "inf",
                  f"{caps[t, s, 'bullet-no-deferral'] / best:.2f}x" if best else "inf"]
        print(f"| {t} | {s} | " + " | ".join(cells) + " |")
    print("\nAt three rates (fractions of the best baseline's capacity): goodput (req/s), TTFT p90 and TPOT p90 (ms)\n")
    print("| trace | SLOs | rate | policy | attainment | goodput | TTFT p50 | TTFT p90 | TPOT p50 | TPOT p90 |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rates_rows:
        print(f"| {r['trace']} | {r['slo']} | {r['rate']:.2f} | {r['policy']} | {100 * r['attainment']:.1f} % | "
              f"{r['goodput']:.2f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p90_ms']:.0f} | {r['tpot_p50_ms']:.0f} | "
              f"{r['tpot_p90_ms']:.0f} |")
    print(f"\nwrote {args.out}/runs.csv, capacity.csv, rates.csv" + (", " + ", ".join(made) if made else ""))


if __name__ == "__main__":
    main()
