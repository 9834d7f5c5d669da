"""Prefix caching in the simulator: each trace simulated with and without it (Llama-3.1-8B on an H200, roofline
latency, chunked prefill with its defaults). Prints, per trace and rate, the ideal hit rate (an infinite cache,
`bullet trace stats`), the simulated hit rate, and TTFT, TPOT and throughput with the cache off and on.

    python3 bench/prefix_cache.py                       # bundled traces + the public Mooncake trace
    python3 bench/prefix_cache.py --trace mooncake.jsonl --rate 1 2 --num-requests 1000
    python3 bench/prefix_cache.py --trace mooncake.jsonl --rate 1 --num-blocks 52000 200000 1000000   # pool size

Requests longer than the model's context (10 of the Mooncake trace's 3,993) are left out, and said so.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bullet.config import GPUS, MODELS, CacheConfig, SchedulerConfig, SloConfig
from bullet.kvcache import ideal_hit_tokens
from bullet.traces import load_trace
from simulator import simulate

ROOT = Path(__file__).resolve().parents[1]
MOONCAKE = ROOT.parent / "shared/traces/raw/mooncake_synthetic_trace.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", nargs="+", default=["sharegpt", "azure-conv", "azure-code", "arxiv", str(MOONCAKE)])
    ap.add_argument("--rate", nargs="+", type=float, default=[None],
                    help="request rates to rescale each trace to (default: the trace's own timing)")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--policy", default="chunked")
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--num-blocks", nargs="+", type=int, default=[None],
                    help="KV pool sizes in 16-token blocks (default: what fits in the H200's memory)")
    args = ap.parse_args()
    model, gpu = MODELS[args.model], GPUS["h200"]
    slo = SloConfig(ttft=None, tpot=0.15, ttft_per_token=0.003)
    print("trace | rate req/s | KV pool tokens | requests | ideal hit % | hit % | TTFT mean ms off / on | "
          "TTFT p90 ms off / on | TPOT mean ms off / on | tokens/s off / on | duration s off / on | sim wall s on")
    print("|".join(["---"] * 12))
    for trace, rate, blocks in ((t, r, b) for t in args.trace for r in args.rate for b in args.num_blocks):
        reqs = load_trace(trace, num_requests=args.num_requests, rate=rate)
        keep = [r for r in reqs if r.prompt_len + r.max_new_tokens <= model.max_position]
        if len(keep) < len(reqs):
            print(f"# {trace}: {len(reqs) - len(keep)} requests longer than {model.name}'s "
                  f"{model.max_position} positions left out", file=sys.stderr)
        hit, total = ideal_hit_tokens(keep, 16)
        runs = {}
        for on in (False, True):
            copy = load_trace(trace, num_requests=args.num_requests, rate=rate)
            copy = [r for r in copy if r.prompt_len + r.max_new_tokens <= model.max_position]
            runs[on] = simulate(copy, model, gpu, SchedulerConfig(policy=args.policy),
                                CacheConfig(prefix_caching=on, num_blocks=blocks), slo)
        off, on = runs[False].summary, runs[True].summary

        def pair(key, sub=None, fmt="{:.0f}", off=off, on=on):
            a, b = (off[key], on[key]) if sub is None else (off[key][sub], on[key][sub])
            return f"{fmt.format(a)} / {fmt.format(b)}"

        name = Path(trace).name if "/" in trace else trace
        pool = runs[True].summary["kv_blocks"] * runs[True].summary["block_size"]
        print(f"{name} | {'trace' if rate is None else f'{rate:g}'} | {pool:,} | {len(keep)} | "
              f"{100 * hit / total:.1f} | {100 * on['prefix_cache_hit_rate']:.1f} | {pair('ttft_ms', 'mean')} | {pair('ttft_ms', 'p90')} | "
              f"{pair('tpot_ms', 'mean', '{:.1f}')} | {pair('total_token_throughput')} | "
              f"{pair('duration_s')} | {runs[True].wall_s:.1f}")


if __name__ == "__main__":
    main()
