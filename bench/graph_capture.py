"""What decode CUDA graphs cost on the nested partition menu: capture time and device memory per decode size
(every batch-size bucket, greedy sampling), and one replay of the largest bucket on each size.

A graph keeps the partition it was captured on, so each decode size a policy uses needs its own graphs
(docs/background.md). Run on a GPU: `python3 bench/graph_capture.py [--sizes 8,40,72,112,132] [--model llama-3.1-8b]`.
Prints a table: decode SMs, graphs, capture seconds, MiB of device memory, ms per replayed 128-row step.
"""

from __future__ import annotations

import argparse
import time

import torch

from bullet.config import resolve_model
from bullet.gpu.executor import GpuExecutor
from bullet.gpu.graphs import DEFAULT_BUCKETS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--sizes", default="", help="decode SM counts (default: the whole decode menu)")
    ap.add_argument("--num-blocks", type=int, default=20000)
    args = ap.parse_args()
    spec = resolve_model(args.model)
    ex = GpuExecutor(spec, "dummy", "cuda", num_blocks=args.num_blocks)
    sizes = [int(s) for s in args.sizes.split(",") if s] or list(ex.menu.decode)
    rows = []
    for sms in sizes:
        torch.cuda.synchronize()
        free0 = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        ex.capture("decode", sms, DEFAULT_BUCKETS)
        torch.cuda.synchronize()
        t = time.perf_counter() - t0
        mem = free0 - torch.cuda.mem_get_info()[0]
        side = ex.menu.side("decode", sms)
        g = ex.graphs("decode").graphs[(side.key, 128, True)]
        with torch.cuda.stream(side.stream):
            g.replay()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(5):
                g.replay()
            e.record()
        e.synchronize()
        rows.append((sms, len(DEFAULT_BUCKETS), t, mem / 2**20, s.elapsed_time(e) / 5))
        print(f"  decode {sms} SMs: {t:.2f} s, {mem / 2**20:.0f} MiB", flush=True)
    print(f"\nmenu: {ex.menu.describe()}, {ex.menu.memory_bytes / 2**20:.0f} MiB for the green contexts\n")
    print("| decode SMs | graphs | capture s | MiB | 128-row step ms (padding rows, context 0) |")
    print("|---:|---:|---:|---:|---:|")
    for sms, n, t, mib, ms in rows:
        print(f"| {sms} | {n} | {t:.2f} | {mib:.0f} | {ms:.2f} |")
    print(f"| all | {sum(r[1] for r in rows)} | {sum(r[2] for r in rows):.1f} | {sum(r[3] for r in rows):.0f} | |")
    ex.close()


if __name__ == "__main__":
    main()
