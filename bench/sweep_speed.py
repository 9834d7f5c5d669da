"""Sweep speed: a 100-configuration capacity sweep (``bullet whatif``'s library) over the first 2,000 requests
of the Azure 2023 conversation trace, Llama-3.1-8B on an H200, on local processes. Prints a table: wall time,
runs (verdicts at a rate), simulations (runs not replayed from a unit's shared ones: see ``bullet.whatif``) and
where the time goes per policy.

    python bench/sweep_speed.py [--jobs 2] [--num-requests 2000] [--rel-tol 0.02] [--policies ...]

The 100 configurations: 5 policies (chunked, prefill-first, static-split, naive-concurrent, bullet) x 5 token
budgets (512 ... 8192) x 4 SLO sets (TTFT 1 s or 3 s, TPOT 50 or 100 ms). The issue's target: <= 2 minutes on
a 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections import defaultdict
from pathlib import Path

from bullet.whatif import parse_sweep, run_tasks, summarize

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared/traces/raw/AzureLLMInferenceTrace_conv.csv"
POLICIES = "chunked,prefill-first,static-split,naive-concurrent,bullet"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--num-requests", type=int, default=2000)
    ap.add_argument("--rel-tol", type=float, default=0.02)
    ap.add_argument("--policies", default=POLICIES)
    ap.add_argument("--trace", default=str(TRACE))
    args = ap.parse_args()
    sweep = parse_sweep({"trace": args.trace, "num_prompts": args.num_requests, "policy": args.policies,
                         "max_num_batched_tokens": "512,1024,2048,4096,8192", "slo_ttft": "1000,3000",
                         "slo_tpot": "50,100", "rel_tol": args.rel_tol, "latency": "roofline"})
    tasks = sweep.tasks()
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    done = 0

    def tick(_res) -> None:
        nonlocal done
        done += 1
        if done % 10 == 0:
            print(f"  {done}/{len(tasks)} configurations, {time.perf_counter() - t0:.0f} s", flush=True)

    results = run_tasks(tasks, args.jobs, on_done=tick)
    wall = time.perf_counter() - t0
    rows = summarize(sweep, results)
    errors = [r for r in rows if r.error]
    by_policy: dict[str, list] = defaultdict(list)
    for task, res in zip(tasks, results):
        by_policy[task.config.policy].append(res)
    sims = sum(len(r.runs) for r in results)
    cpu_name = platform.processor() or platform.machine()
    print(f"\n{len(tasks)} configurations, {args.num_requests} requests each run, capacity grid "
          f"{100 * args.rel_tol:g} %, {args.jobs} processes on {os.cpu_count()} cores ({cpu_name}), load "
          f"average {load:.2f} at start\n")
    print("| policy | configs | runs | runs / config | simulated | task CPU s | CPU s / simulated | "
          "capacity req/s (min-max) |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for policy, res in by_policy.items():
        n_sims = sum(len(r.runs) for r in res)
        n_done = sum(r.simulated for r in res)
        cpu = sum(r.cpu_s for r in res)
        caps = [r.capacity for r in res if r.capacity is not None]
        print(f"| {policy} | {len(res)} | {n_sims} | {n_sims / len(res):.1f} | {n_done} | {cpu:.0f} | "
              f"{cpu / max(n_done, 1):.2f} | {min(caps):.2f}-{max(caps):.2f} |")
    cpu = sum(r.cpu_s for r in results)
    task_wall = sum(r.wall_s for r in results)
    done_all = sum(r.simulated for r in results)
    print(f"| **all** | {len(results)} | {sims} | {sims / len(results):.1f} | {done_all} | {cpu:.0f} | "
          f"{cpu / max(done_all, 1):.2f} | |")
    mean_cap = statistics.fmean(r.mean for r in rows if r.mean)
    print(f"\n**wall {wall:.0f} s** for {len(tasks)} configurations ({sims} simulations; mean capacity "
          f"{mean_cap:.2f} req/s; errors: {len(errors)}). The tasks used {cpu:.0f} CPU s in "
          f"{task_wall:.0f} s of their own wall time (CPU share {cpu / task_wall:.2f}: below 1 when other "
          f"programs share the cores); on {args.jobs} idle cores: about {cpu / args.jobs:.0f} s.")


if __name__ == "__main__":
    main()
