"""Policies on the real GPU next to their simulation: the same requests through ``serve()`` with the GpuExecutor
and with the SimExecutor (same policy code, same latency model for both the policy's decisions and the
simulator), at a few rates per trace. Prints SLO attainment, goodput and TTFT/TPOT percentiles, real vs
simulated, and writes each run's SM split timeline (lane, SMs, start, end per launch) for plotting.

    python3 bench/policy_real.py --latency profiles/h200/llama-3.1-8b/model.json \\
        --runs sharegpt:6,9,12 arxiv:8,12 --policies bullet chunked-2048 --num-requests 120 --out $OUT/real
    python3 bench/policy_real.py --device cpu --model tiny-llama --runs sharegpt:20 --num-requests 12   # smoke
    python3 bench/policy_real.py --sim-only --latency fitted --runs arxiv:10,12,13 --policies bullet chunked-8192
    python3 bench/policy_real.py --runs arxiv:12 --starts 0,100,200 --num-requests 100   # three windows each
    python3 bench/policy_real.py --runs arxiv:10,12 --policies bullet chunked-8192 --repeat 2   # the card's noise

``--sim-only`` runs the simulated half alone, on any machine (no torch, no GPU): the same requests, policies and
latency model, with ``--num-blocks`` KV blocks (the H200 run's pool: 46,390 with dummy weights at 0.85 of memory).

Dummy weights (seeded random); every request generates exactly its trace output length; prompt ids are
synthetic per request. Paper SLOs per trace (TTFT per prompt token, TPOT) unless ``--slo tight``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bullet.config import CacheConfig, SchedulerConfig, SloConfig, resolve_gpu, resolve_model
from bullet.engine import serve
from bullet.kvcache import BlockManager
from bullet.metrics import request_columns, summarize
from bullet.perfmodel.base import CachedLatency
from bullet.policies import make_scheduler
from bullet.traces import load_trace
from simulator.run import latency_model, simulate

PAPER = {"sharegpt": (0.003, 0.150), "azure-code": (0.0015, 0.200), "arxiv": (0.0015, 0.175),
         "azure-conv": (0.003, 0.150)}


def policy_cfg(name: str, layers: int, decode_sizes: tuple[int, ...] | None) -> SchedulerConfig:
    if name.endswith("+async"):  # e.g. chunked-8192+async: with async scheduling
        return dataclasses.replace(policy_cfg(name.removesuffix("+async"), layers, decode_sizes),
                                   async_scheduling=True)
    if name == "bullet":
        return SchedulerConfig(policy="bullet", layers_per_step=layers, decode_sizes=decode_sizes)
    if name.startswith("chunked-"):
        return SchedulerConfig(policy="chunked", max_batched_tokens=int(name.split("-")[1]))
    if name.startswith("static-"):
        return SchedulerConfig(policy="static-split", prefill_sms=int(name.split("-")[1]), layers_per_step=layers)
    return SchedulerConfig(policy=name)


def slo_for(trace: str, which: str) -> SloConfig:
    if which == "paper":
        per_token, tpot = PAPER[trace]
        return SloConfig(ttft=None, ttft_per_token=per_token, tpot=tpot)
    return SloConfig(ttft=0.5, tpot=0.05)


def check_runs(ap: argparse.ArgumentParser, runs: list[str]) -> None:
    """Each ``--runs`` word is TRACE:RATE,RATE,... with positive rates, else one argparse error (before the
    executor starts: a minute on the GPU)."""
    for run in runs:
        trace, _, rates = run.partition(":")
        try:
            ok = bool(trace) and all(float(x) > 0 for x in rates.split(","))
        except ValueError:
            ok = False
        if not ok:
            ap.error(f"--runs: TRACE:RATE,RATE,... with rates > 0 (e.g. sharegpt:10,14), got {run!r}")


def sim_only(args, spec, gpu, latency, sizes) -> None:
    """The simulated half of every row: what ``main`` runs beside each real run, with ``args.num_blocks`` KV blocks."""
    print("| trace | rate | policy | attainment | goodput | makespan s | TTFT p50 ms | TTFT p90 | TPOT p50 | TPOT p90 "
          "| last to finish: request, arrival s, output tokens, TTFT ms, TPOT ms |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|")
    cache = CacheConfig(num_blocks=args.num_blocks, prefix_caching=False)
    for spec_run in args.runs:
        trace, rates = spec_run.split(":")
        slo = slo_for(trace, args.slo)
        for rate, start in ((float(x), int(k)) for x in rates.split(",") for k in args.starts.split(",")):
            for name in args.policies:
                reqs = load_trace(trace, num_requests=args.num_requests, rate=rate, start=start)
                res = simulate(reqs, spec, gpu, policy_cfg(name, args.layers_per_step, sizes), cache, slo, latency,
                               timeline=False)
                s, last = res.summary, res.requests[-1]  # finishing order: the last sets the makespan
                ttft, out = last.first_token_time - last.arrival, last.num_output
                tpot = (last.last_token_time - last.first_token_time) / max(out - 1, 1)
                print(f"| {trace} | {rate:g} @{start} | {name} | {100 * s['slo_attainment']:.1f} % | {s['goodput']:.2f} | "
                      f"{s['duration_s']:.3f} | {s['ttft_ms']['p50']:.0f} | {s['ttft_ms']['p90']:.0f} | "
                      f"{s['tpot_ms']['p50']:.1f} | {s['tpot_ms']['p90']:.1f} | {last.id}, {last.arrival:.3f}, {out}, "
                      f"{1e3 * ttft:.0f}, {1e3 * tpot:.2f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--gpu", default="h200", help="GPU preset the policy and the simulator plan for")
    ap.add_argument("--runs", nargs="+", default=["sharegpt:6,9,12"], help="TRACE:RATE,RATE,...")
    ap.add_argument("--policies", nargs="+", default=["bullet", "chunked-2048"])
    ap.add_argument("--num-requests", type=int, default=120)
    ap.add_argument("--starts", default="0",
                    help="trace rows skipped first, comma-separated: each (rate, policy) runs once on each window "
                         "of --num-requests rows (the bundled traces are timed: a rate rescales their times, so "
                         "repeats need other windows), so a close pair can be told from the spread")
    ap.add_argument("--repeat", type=int, default=1,
                    help="real runs of each (window, rate, policy), the policies taking turns (the simulation "
                         "runs once: it is deterministic); the comparison table takes each policy's median")
    ap.add_argument("--latency", default="auto", help="latency model for the policies and the simulator")
    ap.add_argument("--slo", default="paper", choices=["paper", "tight"])
    ap.add_argument("--layers-per-step", type=int, default=16, help="bullet / static-split prefill slices")
    ap.add_argument("--decode-sizes", default="16,32,48,64,80,96,112",
                    help="bullet's decode sizes (each costs its own decode graphs on the GPU)")
    ap.add_argument("--no-prefill-graphs", action="store_true",
                    help="run prefill/mixed launches eagerly (no prefill graphs captured)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--sim-only", action="store_true", help="only the simulated half (no GPU, no torch)")
    ap.add_argument("--num-blocks", type=int, default=46390, help="--sim-only: KV blocks (the H200 run's pool)")
    args = ap.parse_args()
    if not all(k.strip().isdigit() for k in args.starts.split(",")):
        ap.error(f"--starts: comma-separated row counts (>= 0), got {args.starts!r}")
    if args.repeat < 1:
        ap.error(f"--repeat: at least 1, got {args.repeat}")
    check_runs(ap, args.runs)

    spec, gpu = resolve_model(args.model), resolve_gpu(args.gpu)
    latency = latency_model(args.latency, spec, gpu)
    sizes = tuple(int(x) for x in args.decode_sizes.split(",")) if args.decode_sizes else None
    if args.sim_only:
        sim_only(args, spec, gpu, latency, sizes)
        return

    import torch

    from bullet.gpu.executor import GpuExecutor, freeze_heap, prepare_graphs

    cuda = args.device == "cuda"
    t0 = time.perf_counter()
    ex = GpuExecutor(spec, "dummy", args.device, num_blocks=None if cuda else 4096, gpu_memory_utilization=0.85)
    if cuda:
        ex.warmup()
        free = torch.cuda.mem_get_info()[0]
        for name in args.policies:  # every policy's partitions, decode and prefill graphs
            counts = prepare_graphs(ex, policy_cfg(name, args.layers_per_step, sizes), gpu,
                                    prefill=not args.no_prefill_graphs)
        torch.cuda.synchronize()
        print(f"graphs: {counts}, {(free - torch.cuda.mem_get_info()[0]) / 2**30:.1f} GiB", flush=True)
    print(f"executor ready in {time.perf_counter() - t0:.1f} s: {ex.kv.num_blocks} KV blocks", flush=True)
    rows, timelines = [], []
    for spec_run in args.runs:
        trace, rates = spec_run.split(":")
        slo = slo_for(trace, args.slo)
        for rate, start in ((float(x), int(k)) for x in rates.split(",") for k in args.starts.split(",")):
            sims: dict[str, dict] = {}
            for rep, name in ((k, n) for k in range(args.repeat) for n in args.policies):
                cfg = policy_cfg(name, args.layers_per_step, sizes)
                reqs = load_trace(trace, num_requests=args.num_requests, rate=rate, start=start)
                shift = ex.now() + 0.05
                for r in reqs:
                    r.arrival += shift
                kv = BlockManager(ex.kv.num_blocks, ex.kv.block_size, False)
                sched = make_scheduler(cfg, spec, gpu, kv, CachedLatency(latency), slo=slo)
                steps = []
                freeze_heap()  # what the earlier runs and simulations left (kept rows) is out of the collector's
                # scans: a generation-2 pass over it held the GIL for 256 ms in the middle of a run on the H200
                t1 = time.perf_counter()
                done = serve(reqs, sched, ex, on_step=steps.append)
                wall = time.perf_counter() - t1
                busy = {}
                for s in steps:
                    busy[s.batch.lane] = busy.get(s.batch.lane, 0.0) + s.end - s.start
                real = summarize(done, slo, busy, request_columns(done, slo))
                first = name not in sims
                if first:
                    sim_reqs = load_trace(trace, num_requests=args.num_requests, rate=rate, start=start)
                    sim = simulate(sim_reqs, spec, gpu, cfg, CacheConfig(num_blocks=ex.kv.num_blocks,
                                                                         prefix_caching=False), slo, latency)
                    sims[name] = sim.summary
                row = {"trace": trace, "rate": rate, "start": start, "policy": name, "rep": rep, "wall_s": wall,
                       "launches": len(steps)}
                for key, s in (("real", real), ("sim", sims[name])):
                    row[f"{key}_attainment"] = s["slo_attainment"]
                    row[f"{key}_goodput"] = s["goodput"]
                    for m in ("ttft", "tpot"):
                        for q in ("p50", "p90"):
                            row[f"{key}_{m}_{q}_ms"] = s[f"{m}_ms"][q]
                rows.append(row)
                for s in steps:
                    timelines.append((trace, rate, start, name, f"real{rep}" if rep else "real", s.batch.lane,
                                      s.batch.partition.num_sms, s.start - shift, s.end - shift))
                for r in sim.timeline.rows if first else ():
                    timelines.append((trace, rate, start, name, "sim", r[0], r[1], r[6], r[7][-1]))
                print(f"{trace} {rate:g} req/s from row {start} {name}{f' (run {rep + 1})' if args.repeat > 1 else ''}: real attainment {100 * row['real_attainment']:.1f} % goodput "
                      f"{row['real_goodput']:.2f} | sim {100 * row['sim_attainment']:.1f} % {row['sim_goodput']:.2f} "
                      f"| {wall:.1f} s wall, {len(steps)} launches", flush=True)
    ex.close()
    print("\n| trace | rate | policy | attainment real / sim | goodput real / sim (err) | TTFT p50 real / sim ms "
          "| TTFT p90 real / sim | TPOT p50 real / sim | TPOT p90 real / sim |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        err = 100 * (r["sim_goodput"] - r["real_goodput"]) / r["real_goodput"] if r["real_goodput"] else float("nan")
        print(f"| {r['trace']} | {r['rate']:g} @{r['start']} | {r['policy']}{run_tag(r)} | {100 * r['real_attainment']:.1f} / "
              f"{100 * r['sim_attainment']:.1f} % | {r['real_goodput']:.2f} / {r['sim_goodput']:.2f} ({err:+.0f} %) | "
              f"{r['real_ttft_p50_ms']:.0f} / {r['sim_ttft_p50_ms']:.0f} | {r['real_ttft_p90_ms']:.0f} / "
              f"{r['sim_ttft_p90_ms']:.0f} | {r['real_tpot_p50_ms']:.1f} / {r['sim_tpot_p50_ms']:.1f} | "
              f"{r['real_tpot_p90_ms']:.1f} / {r['sim_tpot_p90_ms']:.1f} |")
    if len(args.policies) > 1 and "bullet" in args.policies:
        compare(rows)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "runs.json").write_text(json.dumps(rows, indent=1))
        with (args.out / "timeline.csv").open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["trace", "rate", "start", "policy", "source", "lane", "sms", "start_s", "end_s"])
            w.writerows(timelines)
        print(f"wrote {args.out}/runs.json, timeline.csv")


def run_tag(row: dict) -> str:
    return f" #{row['rep'] + 1}" if row.get("rep") else ""


def compare(rows: list[dict]) -> None:
    """bullet's real goodput against the best other policy's, per (trace, rate, window): medians over the
    repeats, and every run's figure."""
    cases: dict[tuple, dict[str, list[float]]] = {}
    for r in rows:
        cases.setdefault((r["trace"], r["rate"], r["start"]), {}).setdefault(r["policy"], []).append(r["real_goodput"])
    print("\n| trace | rate | bullet goodput (runs) | best other (runs) | bullet vs best, median |")
    print("|---|---:|---:|---:|---:|")
    for (trace, rate, start), by in cases.items():
        if "bullet" not in by or len(by) < 2:
            continue
        med = {k: statistics.median(v) for k, v in by.items()}
        other = max((k for k in med if k != "bullet"), key=med.get)
        runs = {k: " ".join(f"{x:.3f}" for x in v) for k, v in by.items()}
        gain = 100 * (med["bullet"] / med[other] - 1) if med[other] else float("nan")
        print(f"| {trace} | {rate:g} @{start} | {med['bullet']:.3f} ({runs['bullet']}) | {other} {med[other]:.3f} "
              f"({runs[other]}) | {gain:+.1f} % |")


if __name__ == "__main__":
    main()
