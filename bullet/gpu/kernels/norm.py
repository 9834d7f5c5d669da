"""RMSNorm, optionally fused with the residual add that precedes it (one pass over the row)."""

from __future__ import annotations

import torch

from . import HAVE_TRITON, next_pow2, pdl_launch, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rms_norm_kernel(X, R, W, OUT, ROUT, stride_x, stride_r, stride_o, stride_ro, N, eps,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
            s = (x + r).to(ROUT.dtype.element_ty)  # round as a separate add would, so slices stay exact
            tl.store(ROUT + row * stride_ro + offs, s, mask=mask)
            x = s.to(tl.float32)
        var = tl.sum(x * x, axis=0) / N
        rstd = 1.0 / tl.sqrt(var + eps)
        w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + row * stride_o + offs, (x * rstd * w).to(OUT.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` (rounded to x's dtype; ``s = x`` without a residual), ``y = s / rms(s) * weight``.
    Returns ``(y, s)``. ``x``: ``[T, N]`` with a unit last stride. ``pdl``: a programmatic dependent launch."""
    if not use_triton(x):
        s = x if residual is None else x + residual
        sf = s.float()
        y = sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
        return y.to(x.dtype), s
    T, N = x.shape
    out = torch.empty_like(x)
    if residual is None:
        s, r = x, x
    else:
        s, r = torch.empty_like(x), residual
    pdl = pdl and x.is_cuda
    if T:
        block = next_pow2(N)
        _rms_norm_kernel[(T,)](x, r, weight, out, s, x.stride(0), r.stride(0), out.stride(0), s.stride(0), N, eps,
                               HAS_RES=residual is not None, BLOCK=block, PDL=pdl,
                               num_warps=max(1, min(16, block // 512)), **pdl_launch(pdl))
    return out, s
