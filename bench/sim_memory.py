"""Simulator memory: peak RSS of one simulation (a fresh process each) on synthetic traces whose requests differ
only in output length, with and without per-token times. Prints a table.

    python bench/sim_memory.py [--num-requests 30000] [--rate 3] [--outputs 300 1200] [--policy chunked]

Issue 13's target: memory that does not grow with total output tokens when per-token times are not asked for
(``simulate(token_times=False)``, the default; ``bullet simulate`` runs that way).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, resource, sys, time
sys.path.insert(0, {root!r})
import numpy as np
from bullet.config import SchedulerConfig, resolve_gpu, resolve_model
from bullet.request import Request
from simulator.run import latency_model, simulate
n, rate, out, policy, keep = {n}, {rate}, {out}, {policy!r}, {keep}
rng = np.random.default_rng(0)
t = np.cumsum(rng.exponential(1 / rate, n))
prompt = np.maximum(1, rng.lognormal(np.log(1000) - 0.125, 0.5, n)).astype(int)
output = np.maximum(2, rng.lognormal(np.log(out) - 0.125, 0.5, n)).astype(int)
reqs = [Request(i, float(t[i]), int(prompt[i]), int(output[i])) for i in range(n)]
model, gpu = resolve_model("llama-3.1-8b"), resolve_gpu("h200")
t0 = time.perf_counter()
res = simulate(reqs, model, gpu, SchedulerConfig(policy=policy), latency=latency_model("roofline", model, gpu),
               token_times=keep)
wall = time.perf_counter() - t0
print(json.dumps({{"tokens": res.summary["output_tokens"], "launches": res.summary["launches"], "wall": wall,
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=30_000)
    ap.add_argument("--rate", type=float, default=3.0)
    ap.add_argument("--outputs", type=int, nargs="+", default=[300, 1200], help="mean output tokens per request")
    ap.add_argument("--policy", default="chunked")
    args = ap.parse_args()
    print("| per-token times | mean output | output tokens | launches | simulate() s | peak RSS MB |")
    print("|---|---:|---:|---:|---:|---:|")
    for keep in (False, True):
        for out in args.outputs:
            code = CHILD.format(root=str(ROOT), n=args.num_requests, rate=args.rate, out=out, policy=args.policy,
                                keep=keep)
            r = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                          check=True).stdout)
            print(f"| {'kept' if keep else 'pooled gaps'} | {out} | {r['tokens']:,} | {r['launches']:,} | "
                  f"{r['wall']:.1f} | {r['rss_mb']:.0f} |")


if __name__ == "__main__":
    main()
