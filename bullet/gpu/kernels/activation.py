"""SwiGLU: ``silu(gate) * up`` from the fused gate/up projection, in one pass."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import HAVE_TRITON, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _silu_mul_kernel(X, OUT, stride_x, stride_o, F_DIM, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < F_DIM
        g = tl.load(X + t * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(X + t * stride_x + F_DIM + offs, mask=mask, other=0.0).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u
        tl.store(OUT + t * stride_o + offs, y.to(OUT.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """``x``: ``[T, 2F]`` (gate then up) -> ``[T, F]``."""
    T, two_f = x.shape
    f = two_f // 2
    if not use_triton(x):
        return (F.silu(x[:, :f].float()) * x[:, f:].float()).to(x.dtype)
    out = torch.empty((T, f), device=x.device, dtype=x.dtype)
    if T:
        block = 1024
        _silu_mul_kernel[(T, triton.cdiv(f, block))](x, out, x.stride(0), out.stride(0), f, BLOCK=block,
                                                      num_warps=4)
    return out
