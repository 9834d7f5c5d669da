"""A decode step's two big kernels, launched a few times each for Nsight Compute to profile (issue 12: where a
kernel's remaining time goes). Llama-3.1-8B shapes, bf16, random data, whole GPU.

    ncu --clock-control none -k regex:_decode_split_kernel -c 1 --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section WarpStateStats python3 bench/ncu_decode.py attn
    ncu --clock-control none -k regex:'nvjet|gemm|_skinny' -c 2 ... python3 bench/ncu_decode.py gemm

``attn``: the paged decode attention at 128 x 1024 on one layer (the executor's default options);
``gemm``: the gate/up product at 128 rows through cuBLAS, then the skinny kernel (``--config``: block_n,
block_k, splits, warps, stages). Each kernel runs three times (warm-up); ncu's ``-c`` / ``--launch-skip``
choose which launch it profiles. Prints each kernel's time by CUDA events as a check of what ncu saw.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bullet.gpu.kernels.decode_attention import paged_decode_attention
from bullet.gpu.kernels.skinny import SkinnyConfig, skinny_linear


def events(fn, n: int = 3) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / n / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["attn", "gemm"])
    ap.add_argument("--config", default="64,128,1,8,4", help="skinny config: block_n,block_k,splits,warps,stages")
    ap.add_argument("--rows", type=int, default=128)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    if args.what == "attn":
        S, CTX, B, H, KVH, D = 128, 1024, 16, 32, 8, 128
        nblocks = S * CTX // B
        k = torch.randn(nblocks, KVH, B, D, device=dev, dtype=torch.bfloat16).transpose(1, 2)  # "hnd"
        v = torch.randn(nblocks, KVH, B, D, device=dev, dtype=torch.bfloat16).transpose(1, 2)
        bt = torch.randperm(nblocks).view(S, CTX // B).to(device=dev, dtype=torch.int32)
        cl = torch.full((S,), CTX, dtype=torch.int32, device=dev)
        q = torch.randn(S, H, D, device=dev, dtype=torch.bfloat16)
        nbytes = S * CTX * KVH * D * 2 * 2
        t = events(lambda: paged_decode_attention(q, k, v, bt, cl, D**-0.5, CTX))
        print(f"attention: {t * 1e6:.1f} us, {nbytes / t / 1e12:.2f} TB/s")
    else:
        M, N, K = args.rows, 28672, 4096
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K ** 0.5
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        t = events(lambda: F.linear(x, w))
        print(f"cuBLAS {M} x {N} x {K}: {t * 1e6:.1f} us, {N * K * 2 / t / 1e12:.2f} TB/s")
        cfg = SkinnyConfig(*(int(c) for c in args.config.split(",")))
        t = events(lambda: skinny_linear(x, w, config=cfg))
        print(f"skinny {cfg}: {t * 1e6:.1f} us, {N * K * 2 / t / 1e12:.2f} TB/s")


if __name__ == "__main__":
    main()
