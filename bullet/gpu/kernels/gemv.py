"""``y = x @ W.T (+ b)`` for one row ``x`` (batch-1 decode): a weight-streaming GEMV. Each program owns
``BLOCK_N`` output features and walks K in ``BLOCK_K`` steps, so many small programs keep every SM reading.
Used by the model only where the bench measured it faster than cuBLAS (``Model.gemv_config``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import HAVE_TRITON, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _gemv_kernel(X, W, B, Y, N, K, stride_w, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < N
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        rows = W + offs_n.to(tl.int64)[:, None] * stride_w
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            kmask = offs_k < K
            x = tl.load(X + offs_k, mask=kmask, other=0.0).to(tl.float32)
            w = tl.load(rows + offs_k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
            acc += w.to(tl.float32) * x[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(B + offs_n, mask=nmask, other=0.0).to(tl.float32)
        tl.store(Y + offs_n, y.to(Y.dtype.element_ty), mask=nmask)


def gemv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, block_n: int = 8,
         block_k: int = 512, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """``x``: ``[1, K]`` contiguous; ``w``: ``[N, K]`` with unit last stride. Returns ``[1, N]``."""
    if not use_triton(x) or x.shape[0] != 1:
        return F.linear(x, w, b)
    N, K = w.shape
    y = torch.empty((1, N), device=x.device, dtype=x.dtype)
    _gemv_kernel[(triton.cdiv(N, block_n),)](x, w, b if b is not None else w, y, N, K, w.stride(0),
                                             HAS_BIAS=b is not None, BLOCK_N=block_n, BLOCK_K=block_k,
                                             num_warps=num_warps, num_stages=num_stages)
    return y
