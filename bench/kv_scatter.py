"""Does where a request's KV blocks lie in the pool change a decode step's time? The profiler gives each point
freshly allocated, consecutive block ids; a serving engine grows every request a block at a time from one
free list, so a request's blocks end up spread over the whole pool (tens of GB on the H200). This times the
same decode points through the profiler's own code (`bullet.gpu.profile.Profiler`) both ways: consecutive
ids, and the free list shuffled first (seeded), so each request's blocks are scattered.

Why: on the H200 `bullet validate` found static-split's serving decode launches 2-6 % slower than the
shipped profile predicts (fourteenth session), while the same card re-measured the profile's own points
within 0.7 % (bench/card_check.py). Run on a GPU: `python3 bench/kv_scatter.py [--sms 40,132] [--reps 5]`.
Prints a table: SMs, decode batch x context, ms consecutive, ms scattered, ratio.
"""

from __future__ import annotations

import argparse

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--sms", default="40,132", help="decode partition sizes (the whole GPU's count for 'all')")
    ap.add_argument("--shapes", default="32x4096,64x2048,128x1024,128x2048", help="decode batch x context")
    ap.add_argument("--steps", type=int, default=8, help="fused decode steps per launch")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from bullet.config import resolve_model
    from bullet.gpu.executor import GpuExecutor
    from bullet.gpu.profile import Point, Profiler, Shape

    spec = resolve_model(args.model)
    ex = GpuExecutor(spec, "dummy", "cuda")  # the KV pool as serving sizes it: blocks spread over it all
    full = ex.menu.num_sms
    print(f"KV pool: {ex.kv.num_blocks} blocks of {ex.kv.block_size} tokens")
    rows = []
    for sms in (int(s) for s in args.sms.split(",")):
        lane = "all" if sms == full else "decode"
        for shape in args.shapes.split(","):
            n, ctx = (int(x) for x in shape.split("x"))
            pt = Point(Shape(decode=(ctx,) * n, steps=args.steps), lane, sms)
            times = []
            for scatter in (False, True):
                prof = Profiler(ex, args.reps)
                if scatter:  # the free list in a seeded random order: consecutive allocations land anywhere
                    free = prof.kv._free
                    np.random.default_rng(args.seed).shuffle(free)
                times.append(float(prof.measure(pt)["gpu_s"]))
            rows.append((sms, shape, *times))
    print("\n| SMs | batch x context | consecutive ms | scattered ms | scattered / consecutive |")
    print("|---:|---|---:|---:|---:|")
    for sms, shape, a, b in rows:
        print(f"| {sms} | {shape} | {a * 1e3:.3f} | {b * 1e3:.3f} | {b / a:.3f} |")
    ex.close()


if __name__ == "__main__":
    main()
