"""A policy's capacity with the simulation's noise measured: the policy study's capacity search
(`bench/policy_study.py`'s ``capacity_task``: 1000 requests, 2 % steps) started at ``--starts`` rates 0.1 % apart
in each of the study's six cells, so a change to a policy can be told from the search's own jitter.

    python3 bench/capacity_noise.py [--policy bullet] [--starts 5] [--latency fitted]   (~8 min for bullet here)

Prints one row per cell: mean (sd) req/s over the starts, then each start's capacity.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import policy_study as ps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default="bullet", help="a name from policy_study.policies()")
    ap.add_argument("--starts", type=int, default=5)
    ap.add_argument("--latency", default="fitted")
    ap.add_argument("--num-requests", type=int, default=1000)
    args = ap.parse_args()
    guess = dict(ps.GUESS)
    print("| cell | capacity req/s, mean (sd) | each start | wall s |")
    print("|---|---:|---|---:|")
    for trace in ("sharegpt", "azure-code", "arxiv"):
        for slo in ("paper", "tight"):
            t0, caps = time.time(), []
            for k in range(args.starts):
                ps.GUESS[trace] = guess[trace] * (1 + 0.001 * k)  # (capacity_task starts from GUESS)
                caps.append(ps.capacity_task(trace, slo, args.policy, args.num_requests, args.latency)[3])
            ps.GUESS[trace] = guess[trace]
            sd = statistics.stdev(caps) if len(caps) > 1 else 0.0
            print(f"| {trace} {slo} | {statistics.mean(caps):.3f} ({sd:.3f}) | {' '.join(f'{c:.3f}' for c in caps)} "
                  f"| {time.time() - t0:.0f} |", flush=True)


if __name__ == "__main__":
    main()
