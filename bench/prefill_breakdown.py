"""Where the time of a whole-GPU prefill goes, kernel by kernel (torch.profiler), against what each kernel
class would take at the measured ceilings. Llama-3.1-8B shapes, dummy bf16 weights, one prompt.

    python bench/prefill_breakdown.py [--tokens 4096]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bullet.batch import Chunk
from bullet.config import MODELS
from bullet.gpu.attention import build_meta
from bullet.gpu.kvcache import PagedKvCache
from bullet.gpu.model import Model
from bullet.gpu.weights import load_weights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--model", default="llama-3.1-8b")
    args = ap.parse_args()
    dev = torch.device("cuda")
    spec = MODELS[args.model]
    model = Model(spec, load_weights(spec, "dummy", dev, torch.bfloat16, seed=0), dev)
    T, page = args.tokens, 16
    kv = PagedKvCache(spec, T // page + 2, page, dev)
    meta = build_meta([Chunk(0, 0, T, tuple(range(1, T // page + 2)), True)], page, dev)
    x = torch.randint(0, spec.vocab_size, (T,), device=dev)

    def run():
        return model.logits(model.forward(x, range(spec.num_layers), meta, kv), meta.sample_rows)

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    run()
    b.record()
    torch.cuda.synchronize()
    wall = a.elapsed_time(b)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU work queued first: the host enqueues without waiting
    t0 = time.perf_counter()
    torch.cuda.set_sync_debug_mode("warn")  # a host sync inside the forward is reported
    run()
    torch.cuda.set_sync_debug_mode(0)
    host = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name].append(e.device_time_total / 1e3)
    total = sum(sum(v) for v in by_name.values())
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    gaps: dict[tuple[str, str], list[float]] = defaultdict(list)  # idle GPU time between two kernels, us
    for (_, end, a), (start, _, b) in itertools.pairwise(kernels):
        gaps[(a[:40], b[:40])].append(max(0.0, start - end))
    span = (kernels[-1][1] - kernels[0][0]) / 1e3
    print(f"profiled span {span:.2f} ms; idle between kernels {sum(sum(g) for g in gaps.values()) / 1e3:.2f} ms")
    for (a, b), g in sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:8]:
        print(f"  idle {sum(g) / 1e3:6.2f} ms over {len(g):3d} gaps: {a} -> {b}")
    print(f"{spec.name}, prefill of {T} tokens: {wall:.2f} ms between events; kernels sum to {total:.2f} ms; "
          f"the host enqueues it in {host:.2f} ms")
    print(f"{'kernel':<90} {'calls':>5} {'ms':>8} {'share':>6}")
    for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:25]:
        print(f"{name[:90]:<90} {len(times):>5} {sum(times):8.2f} {sum(times) / total:6.1%}")


if __name__ == "__main__":
    main()
