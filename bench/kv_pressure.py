"""Policies under KV pressure: random workloads (up to 40 requests, prompts up to 1,500 tokens) on pools of 1 to 3
times the largest request, Llama-3.1-8B on an H200 with the roofline latency model. For each policy: the worst
and median ratio of its simulated span to chunked prefill's on the same input, and the most times any request
was preempted. A policy that thrashes (evicting and recomputing the same requests) shows up as a large ratio.

    python3 bench/kv_pressure.py [--workloads 200] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bullet.config import GPUS, MODELS, SchedulerConfig
from bullet.engine import serve
from bullet.kvcache import BlockManager
from bullet.perfmodel.roofline import RooflineModel
from bullet.policies import make_scheduler
from bullet.request import Request
from simulator import SimExecutor

MODEL, GPU = MODELS["llama-3.1-8b"], GPUS["h200"]
POLICIES = {"chunked": {}, "prefill-first": {}, "static-split": {"prefill_sms": 64, "layers_per_step": 8},
            "naive-concurrent": {}}


def workload(rng: np.random.Generator) -> tuple[list[tuple[float, int, int]], int, int]:
    n, pmax, omax = int(rng.integers(5, 40)), int(rng.integers(50, 1500)), int(rng.integers(2, 400))
    t = np.cumsum(rng.exponential(1 / rng.uniform(5, 200), n))
    rows = [(float(t[i]), int(rng.integers(1, pmax)), int(rng.integers(1, omax))) for i in range(n)]
    biggest = max(-(-(p + o) // 16) for _, p, o in rows)
    return rows, int(biggest * rng.uniform(1, 3)), int(rng.choice([64, 256, 2048]))


def run(policy: str, rows, blocks: int, budget: int) -> tuple[float, int, int]:
    latency = RooflineModel(MODEL, GPU)
    sched = make_scheduler(SchedulerConfig(policy=policy, max_batched_tokens=budget, **POLICIES[policy]), MODEL,
                           GPU, BlockManager(blocks, 16), latency)
    reqs = [Request(i, t, p, o) for i, (t, p, o) in enumerate(rows)]
    done = serve(reqs, sched, SimExecutor(latency, MODEL.num_layers, GPU))
    return (max(r.finish_time for r in done) - rows[0][0], sched.num_preemptions,
            max(r.num_preemptions for r in done))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    ratios: dict[str, list[float]] = {p: [] for p in POLICIES}
    preempt: dict[str, list[int]] = {p: [] for p in POLICIES}
    worst: dict[str, int] = dict.fromkeys(POLICIES, 0)
    for _ in range(args.workloads):
        rows, blocks, budget = workload(rng)
        base = None
        for policy in POLICIES:
            span, total, most = run(policy, rows, blocks, budget)
            base = span if base is None else base
            ratios[policy].append(span / base)
            preempt[policy].append(total)
            worst[policy] = max(worst[policy], most)
    print(f"{args.workloads} workloads, seed {args.seed}")
    print("policy | span / chunked: median | p90 | worst | preemptions per workload: mean | most for one request")
    print("|".join(["---"] * 6))
    for p in POLICIES:
        r = np.array(ratios[p])
        print(f"{p} | {np.median(r):.2f} | {np.percentile(r, 90):.2f} | {r.max():.2f} | "
              f"{np.mean(preempt[p]):.1f} | {worst[p]}")


if __name__ == "__main__":
    main()
