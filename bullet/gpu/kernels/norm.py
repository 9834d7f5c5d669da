"""RMSNorm over the rows of a 2-D tensor (one program per row)."""

from __future__ import annotations

import torch

from . import HAVE_TRITON, next_pow2, pdl_launch, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rms_norm_kernel(X, W, OUT, stride_x, stride_o, N, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        var = tl.sum(x * x, axis=0) / N
        rstd = 1.0 / tl.sqrt(var + eps)
        w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + row * stride_o + offs, (x * rstd * w).to(OUT.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = False) -> torch.Tensor:
    """``x / rms(x) * weight`` in ``x``'s dtype. ``x``: ``[T, N]`` with a unit last stride. ``pdl``: a
    programmatic dependent launch."""
    if not use_triton(x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    T, N = x.shape
    out = torch.empty_like(x)
    pdl = pdl and x.is_cuda
    if T:
        block = next_pow2(N)
        _rms_norm_kernel[(T,)](x, weight, out, x.stride(0), out.stride(0), N, eps, BLOCK=block, PDL=pdl,
                               num_warps=max(1, min(16, block // 512)), **pdl_launch(pdl))
    return out
