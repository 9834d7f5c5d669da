"""Capacity of the best baselines with and without async scheduling, by the policy study's own search
(`bench/policy_study.py`'s ``capacity_task``: 1000 requests, 2 % steps), in the cells the study's best baselines
hold (issue 10's fairness check: does bullet still lead when the baselines hide their host time?).

    python3 bench/async_capacity.py [--latency fitted]      (about 2 minutes on a 2-core VM)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import policy_study as ps

# (trace, SLO set, the study's best baseline there)
CELLS = (("sharegpt", "paper", "prefill-first"), ("sharegpt", "tight", "prefill-first"),
         ("azure-code", "paper", "chunked-2048"), ("azure-code", "tight", "chunked-1024"),
         ("arxiv", "paper", "chunked-8192"), ("arxiv", "paper", "prefill-first"),
         ("arxiv", "tight", "chunked-2048"), ("arxiv", "tight", "chunked-8192"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--latency", default="fitted")
    ap.add_argument("--num-requests", type=int, default=1000)
    args = ap.parse_args()
    base = ps.policies()
    ahead = {f"{name}+async": dataclasses.replace(base[name], async_scheduling=True) for _, _, name in CELLS}
    ps.policies = lambda: {**base, **ahead}  # (capacity_task looks its configurations up here)
    print("| trace | SLOs | baseline | capacity req/s | with async |")
    print("|---|---|---|---:|---:|")
    for trace, slo, name in CELLS:
        caps = [ps.capacity_task(trace, slo, n, args.num_requests, args.latency)[3] for n in (name, name + "+async")]
        print(f"| {trace} | {slo} | {name} | {caps[0]:.2f} | {caps[1]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
