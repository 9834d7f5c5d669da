"""What the executor's warm-up leaves for serving to pay: each eager launch shape run twice right after
`GpuExecutor.warmup()`, first against second time, with the Triton kernels compiled in between (a fresh
Triton cache, so the warm-up compiles everything it covers and any kernel compiled later shows up by name).

A first run much slower than the second is a cost the middle of serving pays once per process: a kernel
variant the warm-up missed (Triton specialises on constexprs and on integer and pointer arguments) or a cuDNN
plan built for new strides. Run on a GPU: `python3 bench/first_launch.py [--model llama-3.1-8b]`. Prints a
table: shape, first ms, second ms, kernels compiled by the first run.
"""

from __future__ import annotations

import argparse
import glob
import os
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cache = os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="triton-"))
    import numpy as np
    import torch

    from bullet.batch import Batch, Partition
    from bullet.config import resolve_model
    from bullet.gpu.executor import GpuExecutor, shape_chunks
    from bullet.kvcache import BlockManager

    spec = resolve_model(args.model)
    ex = GpuExecutor(spec, "dummy", "cuda", num_blocks=40000)
    t = time.perf_counter()
    ex.warmup()
    print(f"warm-up {time.perf_counter() - t:.1f} s")

    def entries() -> set[str]:
        return set(glob.glob(os.path.join(cache, "*", "*.json")))

    seen = entries()
    kv = BlockManager(ex.kv.num_blocks, ex.kv.block_size)
    L, sms = spec.num_layers, ex.menu.num_sms
    rid = 1 << 41

    def run(prefill, decode_ctx) -> tuple[float, list[str]]:
        nonlocal rid, seen
        chunks = shape_chunks(kv, rid, prefill, decode_ctx)
        rid += len(chunks)
        torch.cuda.synchronize()
        t = time.perf_counter()
        ex.launch(Batch(Partition("all", sms), range(L), tuple(chunks)))
        while ex.busy("all"):
            ex.wait(None)
        dt = time.perf_counter() - t
        for c in chunks:
            kv.free(c.req_id)
            ex.release(c.req_id)
        new = entries() - seen
        seen |= new
        return dt, sorted({os.path.basename(x).split(".")[0] for x in new})

    rng = np.random.default_rng(args.seed)
    shapes = [("1 x 2048 fresh", [(2048, 0)], []), ("1 x 1024 fresh", [(1024, 0)], []),
              ("1 x 2304 fresh", [(2304, 0)], []), ("1 x 2000 fresh", [(2000, 0)], [])]
    for seqs in (1, 3, 10, 33, 130):
        for dec in (0, 7, 130):
            tok = 2048 - dec
            base = tok // seqs
            pre = [(base + (1 if i < tok - base * seqs else 0), int(rng.integers(0, 3000)) if i % 2 else 0)
                   for i in range(seqs)]
            shapes.append((f"{seqs} prompts + {dec} decode rows", pre, [int(x) for x in rng.integers(100, 4000, dec)]))
    print("\n| launch | first ms | second ms | compiled by the first |\n|---|---:|---:|---|")
    for name, pre, dec in shapes:
        d1, names = run(pre, dec)
        d2, _ = run(pre, dec)
        flag = " **slow**" if d1 > 1.3 * d2 + 0.003 else ""
        print(f"| {name} | {d1 * 1e3:.1f}{flag} | {d2 * 1e3:.1f} | {', '.join(names) or '-'} |", flush=True)
    ex.close()


if __name__ == "__main__":
    main()
