"""Prefill attention on the H200: the one-call Triton kernel over the paged pool (``kernels.prefill_attention``)
against the SDPA path (one call per sequence, cuDNN/flash, prefix k/v gathered out of the pool), at the shapes
serving produces. Each shape is first checked against a float32 reference; times are CUDA events after warm-up
(median of ``--reps``), with the host time of one call beside them.

    python3 bench/prefill_attention.py [--model llama-3.1-8b] [--reps 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bullet.batch import Chunk
from bullet.config import resolve_model
from bullet.gpu.attention import attention, build_meta
from bullet.gpu.kernels.prefill_attention import block_q

# (label, [(new tokens, cached prefix) per sequence])
SHAPES = [
    ("1 x 1024", [(1024, 0)]),
    ("1 x 4096", [(4096, 0)]),
    ("1 x 8192", [(8192, 0)]),
    ("8 x 512", [(512, 0)] * 8),
    ("64 x 64", [(64, 0)] * 64),
    ("4 x 512 over 4096", [(512, 4096)] * 4),
    ("1 x 2048 over 8192", [(2048, 8192)]),
    ("32 decode + 1 x 1024", [(1, 2000)] * 32 + [(1024, 0)]),
]
VARIANTS = {"tiles n64 w8 s2": {}, "tiles n64 w4 s3": {"num_warps": 4, "num_stages": 3},
            "tiles n128 w8 s2": {"block_n": 128}, "tiles n32 w4 s2": {"block_n": 32, "num_warps": 4}}


def flops(seqs, H, D) -> float:
    return sum(4 * H * D * n * (p + (n + 1) / 2) for n, p in seqs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    spec = resolve_model(args.model)
    H, KVH, D, page = spec.heads_per_gpu, spec.kv_heads_per_gpu, spec.head_dim, 16
    dev, dt = "cuda", torch.bfloat16
    print("| shape | path | max err vs fp32 | ms | TFLOP/s | host us per call |")
    print("|---|---|---:|---:|---:|---:|")
    for label, seqs in SHAPES:
        g = torch.Generator(device=dev).manual_seed(len(seqs))
        chunks, nblk = [], 0
        for i, (n, p) in enumerate(seqs):
            need = -(-(n + p) // page)
            chunks.append(Chunk(i, p, n, tuple(range(nblk, nblk + need)), True))
            nblk += need
        perm = torch.randperm(nblk, device=dev, generator=g)  # scattered blocks
        chunks = [c._replace(block_ids=tuple(perm[list(c.block_ids)].tolist())) for c in chunks]
        kc = torch.randn(nblk, page, KVH, D, device=dev, dtype=dt, generator=g)
        vc = torch.randn(nblk, page, KVH, D, device=dev, dtype=dt, generator=g)
        T = sum(n for n, _ in seqs)
        q = torch.randn(T, H, D, device=dev, dtype=dt, generator=g)
        meta_t = build_meta(chunks, page, dev, block_q=block_q(H // KVH))
        meta_s = build_meta(chunks, page, dev)
        slots = meta_s.slot_mapping.long()
        k_new = kc.view(-1, KVH, D)[slots]
        v_new = vc.view(-1, KVH, D)[slots]
        scale = D ** -0.5
        ref = attention(q.float(), k_new.float(), v_new.float(), meta_s, kc.float(), vc.float(), scale,
                        {}, {"sdpa": True}).float()
        args_ = (q, k_new, v_new)
        paths = {"sdpa": lambda: attention(*args_, meta_s, kc, vc, scale, {}, {"sdpa": True})}  # noqa: B023
        for name, opt in VARIANTS.items():
            paths[name] = lambda opt=opt: attention(*args_, meta_t, kc, vc, scale, {}, {"tiles": opt})  # noqa: B023
        for name, fn in paths.items():
            err = float((fn().float() - ref).abs().max())
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            ts, hs = [], []
            for _ in range(args.reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                t = time.perf_counter()
                fn()
                hs.append(time.perf_counter() - t)
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b))
            ms = statistics.median(ts)
            print(f"| {label} | {name} | {err:.3g} | {ms:.3f} | {flops(seqs, H, D) / ms / 1e9:.0f} | "
                  f"{statistics.median(hs) * 1e6:.0f} |")


if __name__ == "__main__":
    main()
