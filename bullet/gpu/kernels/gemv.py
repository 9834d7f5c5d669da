"""One-row matrix-vector products for batch-1 decode, with the small ops around them fused in.

``y = x @ W.T`` streams the weights once; at batch 1 that is the whole cost of a step, and the ~10 small
kernels per layer between the products (norms, residual adds, SiLU) cost more than their bytes. So one
kernel does, as asked:

- ``norm``: RMSNorm of ``x`` first. The product takes ``x * weight`` tile by tile and each program sums
  ``x^2`` from the same tiles, scaling its sums by the rms at the end: no pass over ``x`` before the first
  multiply. So the normalised row is kept in fp32, not rounded to the model dtype as ``rms_norm`` rounds it
  (one rounding fewer than the unfused path);
- ``swiglu``: ``W`` is ``[gate; up]`` (``2I x K``), each program takes matching gate and up rows and writes
  ``silu(gate) * up`` (``I`` outputs), as ``silu_mul`` after the product would;
- ``residual``: ``residual += y`` in place, rounded once (as the batched path's ``addmm``);
- ``rope``: on the q/k/v projection, RoPE on q and k and the store of k and v into the paged pool (what
  ``rope_and_store`` does after the product): each q/k program owns matching rotation pairs of one head;
- ``pdl``: launched as a programmatic dependent launch (Hopper and newer): a program loads its first weight
  tile, bias, norm weight and (``rope``) the step's position, slot and rotation before waiting for the
  previous kernel, so the launch and the first memory round trips overlap that kernel's tail. Those inputs
  must not be written by the kernel right before (weights never are; positions and slots are written before
  a forward begins); ``x`` and ``residual`` are read after the wait.

Each program owns ``block_n`` output rows and walks K in ``block_k`` steps, keeping the next tile's loads
(weights, ``x``, the norm weight) in flight while it multiplies the current one. Loading ``x`` and the norm
weight inside the step instead put an L2 round trip on each step's critical path: at batch 1 the fused norm
then cost 0.21-0.31 ms a step (about 8.5 us a layer), 0.10-0.16 ms with them loaded ahead, and the plain GEMVs
went from 4.11 to 4.23-4.29 TB/s (bench/batch1_breakdown.py, bench/RESULTS.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import HAVE_TRITON, pdl_launch, use_triton
from .rope import rope_and_store

# launch options of the one-token path on CUDA (GpuExecutor's default), from bench/gpu_kernels.py's sweep
GEMV_DEFAULT = {"block_n": 4, "block_k": 1024, "num_warps": 4, "pdl": True}

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _gemv_kernel(X, NW, W, B, R, Y, N, K, stride_w, eps,
                     POS, COSSIN, stride_cs, KC, VC, SLOT, stride_cpage, stride_ctok, stride_chead,
                     NORM: tl.constexpr, SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                     ROPE: tl.constexpr, H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                     PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        if ROPE:  # q/k programs own BLOCK_N / 2 rotation pairs (row f and f + D/2 of a head), interleaved
            HALF: tl.constexpr = D // 2
            HB: tl.constexpr = BLOCK_N // 2
            j = tl.arange(0, BLOCK_N)
            p0 = pid * HB  # first pair of this program
            head_q = p0 // HALF
            f0 = p0 % HALF
            rot_rows = head_q * D + f0 + j // 2 + (j % 2) * HALF
            is_rot = pid * BLOCK_N < (H + KVH) * D
            offs_n = tl.where(is_rot, rot_rows, offs_n)
        nmask = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        rows = W + offs_n.to(tl.int64)[:, None] * stride_w
        rows_up = rows + N * stride_w  # SWIGLU only: the up half's matching rows
        wmask = nmask[:, None] & (offs_k < K)[None, :]
        w = tl.load(rows + offs_k[None, :], mask=wmask, other=0.0, eviction_policy="evict_first")
        if SWIGLU:
            wu = tl.load(rows_up + offs_k[None, :], mask=wmask, other=0.0, eviction_policy="evict_first")
        if NORM:
            nw = tl.load(NW + offs_k, mask=offs_k < K, other=0.0)
        if HAS_BIAS:
            bias = tl.load(B + offs_n, mask=nmask, other=0.0).to(tl.float32)
        if ROPE:  # the step's metadata (written before the forward began) and the rotation table
            pos = tl.load(POS).to(tl.int64)
            slot = tl.load(SLOT).to(tl.int64)
            offs_f = f0 + tl.arange(0, HB)
            cos = tl.load(COSSIN + pos * stride_cs + offs_f)
            sin = tl.load(COSSIN + pos * stride_cs + HALF + offs_f)
        if PDL:  # everything above was written before the previous kernel began; its outputs are read below
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        x = tl.load(X + offs_k, mask=offs_k < K, other=0.0)
        if RESIDUAL:  # in flight during the products
            r = tl.load(R + offs_n, mask=nmask, other=0.0).to(tl.float32)
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        ss = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            # the next tile of the weights, of x and of the norm weight in flight while this one is multiplied
            nk = k0 + BLOCK_K + offs_k
            nkmask = nk < K
            nwmask = nmask[:, None] & nkmask[None, :]
            w_next = tl.load(rows + nk[None, :], mask=nwmask, other=0.0, eviction_policy="evict_first")
            if SWIGLU:
                wu_next = tl.load(rows_up + nk[None, :], mask=nwmask, other=0.0, eviction_policy="evict_first")
            x_next = tl.load(X + nk, mask=nkmask, other=0.0)
            xf = x.to(tl.float32)
            if NORM:  # the rms comes from the tiles already loaded; it scales the sums at the end
                nw_next = tl.load(NW + nk, mask=nkmask, other=0.0)
                ss += xf * xf
                xf = xf * nw.to(tl.float32)
                nw = nw_next
            acc += w.to(tl.float32) * xf[None, :]
            if SWIGLU:
                acc_up += wu.to(tl.float32) * xf[None, :]
                wu = wu_next
            w = w_next
            x = x_next
        y = tl.sum(acc, axis=1)
        if NORM:
            rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)
            y = y * rstd
        if HAS_BIAS:
            y += bias
        if SWIGLU:
            g = y.to(Y.dtype.element_ty).to(tl.float32)  # the unfused path rounds both products
            u = tl.sum(acc_up, axis=1)
            if NORM:
                u = u * rstd
            u = u.to(Y.dtype.element_ty).to(tl.float32)
            y = g / (1.0 + tl.exp(-g)) * u
        if RESIDUAL:
            y = y + r  # rounded once, as the batched path's addmm
        if ROPE:  # rotate q and k (rounded first, as rope_and_store reads them), then k and v to the pool
            y = y.to(Y.dtype.element_ty).to(tl.float32)
            if is_rot:
                ya, yb = tl.split(tl.reshape(y, [HB, 2]))
                y = tl.reshape(tl.join(ya * cos - yb * sin, yb * cos + ya * sin), [BLOCK_N])
            kv_row = offs_n - H * D  # k rows, then v rows
            if (slot >= 0) & (pid * BLOCK_N >= H * D):
                is_v = kv_row >= KVH * D
                kvr = tl.where(is_v, kv_row - KVH * D, kv_row)
                addr = (slot // PAGE) * stride_cpage + (slot % PAGE) * stride_ctok + (kvr // D) * stride_chead \
                    + kvr % D
                yk = y.to(KC.dtype.element_ty)
                tl.store(KC + addr, yk, mask=nmask & ~is_v)
                tl.store(VC + addr, yk, mask=nmask & is_v)
        tl.store(Y + offs_n, y.to(Y.dtype.element_ty), mask=nmask)


class RopeStore(NamedTuple):
    """What ``rope_and_store`` takes besides the q/k/v row (no per-head q/k norm: Qwen3 keeps that kernel).
    With ``pdl`` the positions and slots are read before the wait: not written by the kernel right before."""

    positions: torch.Tensor  # [1] int
    cos_sin: torch.Tensor  # [max_position, D] float32
    k_cache: torch.Tensor  # [num_blocks, page, KVH, D] views, unit last stride
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [1] int (negative: not stored)
    num_heads: int
    num_kv_heads: int
    head_dim: int


def gemv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, *, norm: torch.Tensor | None = None,
         eps: float = 1e-6, swiglu: bool = False, residual: torch.Tensor | None = None,
         rope: RopeStore | None = None, out_dtype: torch.dtype | None = None, block_n: int = 4,
         block_k: int = 1024, num_warps: int = 4, pdl: bool = False) -> torch.Tensor:
    """``x``: ``[1, K]`` contiguous; ``w``: ``[N, K]`` with a unit last stride; ``b``: ``[N]`` or None.

    Returns ``[1, N]`` (``[1, N / 2]`` with ``swiglu``); with ``residual`` (``[1, N]``, contiguous) the sum is
    written into ``residual`` and that is returned. ``norm``: RMSNorm weight ``[K]`` applied to ``x`` first.
    ``rope``: ``w`` is the fused q/k/v projection; q and k come out rotated and k, v are stored in the pool,
    as ``rope_and_store`` on the product would. ``out_dtype``: of the result (default ``x``'s; not with
    ``residual``)."""
    N, K = w.shape
    if swiglu:
        assert N % 2 == 0 and b is None, "gemv: swiglu takes [gate; up] weights without bias"
        N //= 2
    if not use_triton(x):
        y = _gemv_torch(x, w, b, norm, eps, swiglu, residual)
        if out_dtype is not None and residual is None:
            y = y.to(out_dtype)
        if rope is not None:
            r = rope
            rope_and_store(y, r.positions, r.cos_sin, r.k_cache, r.v_cache, r.slot_mapping, r.num_heads,
                           r.num_kv_heads, r.head_dim)
        return y
    assert x.shape == (1, K) and x.is_contiguous() and w.stride(1) == 1
    out = residual if residual is not None else torch.empty((1, N), device=x.device, dtype=out_dtype or x.dtype)
    assert out.shape == (1, N) and out.is_contiguous()
    pdl = pdl and x.is_cuda  # the interpreter has no grid-dependency control
    if rope is not None:
        r = rope
        assert not swiglu and residual is None and r.head_dim % block_n == 0 and block_n >= 2
        assert r.k_cache.stride() == r.v_cache.stride() and r.k_cache.stride(3) == 1
        rope_args = (r.positions, r.cos_sin, r.cos_sin.stride(0), r.k_cache, r.v_cache, r.slot_mapping,
                     r.k_cache.stride(0), r.k_cache.stride(1), r.k_cache.stride(2))
        heads = {"H": r.num_heads, "KVH": r.num_kv_heads, "D": r.head_dim, "PAGE": r.k_cache.shape[1]}
    else:
        rope_args = (x, x, 0, x, x, x, 0, 0, 0)
        heads = {"H": 1, "KVH": 1, "D": 2, "PAGE": 1}
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x, norm if norm is not None else x, w, b if b is not None else w, out, out, N, K, w.stride(0), eps,
        *rope_args, NORM=norm is not None, SWIGLU=swiglu, RESIDUAL=residual is not None, HAS_BIAS=b is not None,
        ROPE=rope is not None, **heads, PDL=pdl, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
        **pdl_launch(pdl))
    return out


def _gemv_torch(x, w, b, norm, eps, swiglu, residual) -> torch.Tensor:
    """The same semantics from torch ops (the CPU path): fp32 products, rounded where the kernel rounds."""
    dtype = x.dtype
    xf = x.float()
    if norm is not None:  # the normalised row stays fp32 (see the module docstring)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * norm.float()
    y = F.linear(xf, w.float(), None if b is None else b.float())
    if swiglu:  # both products rounded first, as the unfused path rounds them
        g, u = y.to(dtype).float().chunk(2, dim=-1)
        y = F.silu(g) * u
    if residual is not None:  # the add before the rounding, as the batched path's addmm
        residual.copy_(y + residual.float())
        return residual
    return y.to(dtype)
