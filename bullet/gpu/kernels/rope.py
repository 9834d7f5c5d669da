"""RoPE on q and k (with Qwen3's per-head q/k RMSNorm first, where the model has it) and the store of the new
k and v into the paged pool: one launch per layer, in place on the fused qkv projection's output."""

from __future__ import annotations

import torch

from . import HAVE_TRITON, next_pow2, pdl_launch, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rotate(ptrs, mask, cos, sin, NW, eps, HALF: tl.constexpr, QK_NORM: tl.constexpr):
        x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
        if QK_NORM:
            offs = tl.arange(0, HALF)
            ms = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
            rstd = 1.0 / tl.sqrt(ms + eps)
            w1 = tl.load(NW + offs).to(tl.float32)
            w2 = tl.load(NW + HALF + offs).to(tl.float32)
            x1 = x1 * rstd[:, None] * w1[None, :]
            x2 = x2 * rstd[:, None] * w2[None, :]
        y1 = x1 * cos[None, :] - x2 * sin[None, :]
        y2 = x2 * cos[None, :] + x1 * sin[None, :]
        return y1, y2

    @triton.jit
    def _rope_store_kernel(QKV, stride_t, POS, stride_pos, COSSIN, stride_cs, QNW, KNW, eps,
                           KC, VC, SLOT, stride_slot, stride_cpage, stride_ctok, stride_chead,
                           PAGE: tl.constexpr,
                           H: tl.constexpr, KVH: tl.constexpr, HP2: tl.constexpr, KVHP2: tl.constexpr,
                           D: tl.constexpr, QK_NORM: tl.constexpr, PDL: tl.constexpr):
        HALF: tl.constexpr = D // 2
        if PDL:  # launched as a programmatic dependent launch: wait for the previous kernel's outputs
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        t = tl.program_id(0).to(tl.int64)
        pos = tl.load(POS + t * stride_pos).to(tl.int64)
        offs_d = tl.arange(0, HALF)
        cos = tl.load(COSSIN + pos * stride_cs + offs_d)
        sin = tl.load(COSSIN + pos * stride_cs + HALF + offs_d)
        base = QKV + t * stride_t
        # q heads, in place
        offs_h = tl.arange(0, HP2)
        qmask = (offs_h < H)[:, None]
        qp = base + offs_h[:, None] * D + offs_d[None, :]
        q1, q2 = _rotate(qp, qmask, cos, sin, QNW, eps, HALF, QK_NORM)
        tl.store(qp, q1.to(QKV.dtype.element_ty), mask=qmask)
        tl.store(qp + HALF, q2.to(QKV.dtype.element_ty), mask=qmask)
        # k heads, in place and into the pool
        offs_kh = tl.arange(0, KVHP2)
        kmask = (offs_kh < KVH)[:, None]
        kp = base + H * D + offs_kh[:, None] * D + offs_d[None, :]
        k1, k2 = _rotate(kp, kmask, cos, sin, KNW, eps, HALF, QK_NORM)
        k1 = k1.to(QKV.dtype.element_ty)
        k2 = k2.to(QKV.dtype.element_ty)
        tl.store(kp, k1, mask=kmask)
        tl.store(kp + HALF, k2, mask=kmask)
        slot = tl.load(SLOT + t * stride_slot).to(tl.int64)
        if slot >= 0:
            cp = (slot // PAGE) * stride_cpage + (slot % PAGE) * stride_ctok + offs_kh[:, None] * stride_chead \
                + offs_d[None, :]
            tl.store(KC + cp, k1.to(KC.dtype.element_ty), mask=kmask)
            tl.store(KC + cp + HALF, k2.to(KC.dtype.element_ty), mask=kmask)
            offs_fd = tl.arange(0, D)
            v = tl.load(base + (H + KVH) * D + offs_kh[:, None] * D + offs_fd[None, :], mask=kmask, other=0.0)
            vp = (slot // PAGE) * stride_cpage + (slot % PAGE) * stride_ctok + offs_kh[:, None] * stride_chead \
                + offs_fd[None, :]
            tl.store(VC + vp, v.to(VC.dtype.element_ty), mask=kmask)


def rope_and_store(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                   head_dim: int, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                   eps: float = 1e-6, pdl: bool = False) -> None:
    """In place on ``qkv`` (``[T, (H + 2 KVH) * D]``, unit last stride): per-head RMSNorm of q and k when
    ``q_norm``/``k_norm`` are given, then RoPE (rotate-half convention; ``cos_sin[p] = [cos | sin]`` of
    position ``p``); then k and v go to the pool (``[num_blocks, block_size, KVH, D]`` views with a unit last
    stride, either layout of ``PagedKvCache``) at
    ``slot_mapping`` (rows with a negative slot are not stored). ``pdl``: a programmatic dependent launch
    (see ``kernels.gemv``)."""
    H, KVH, D = num_heads, num_kv_heads, head_dim
    T = qkv.shape[0]
    if T == 0:
        return
    if not use_triton(qkv):
        _rope_and_store_torch(qkv, positions, cos_sin, k_cache, v_cache, slot_mapping, H, KVH, D,
                              q_norm, k_norm, eps)
        return
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1 and cos_sin.stride(1) == 1
    qk_norm = q_norm is not None
    pdl = pdl and qkv.is_cuda  # the interpreter has no grid-dependency control
    _rope_store_kernel[(T,)](
        qkv, qkv.stride(0), positions, positions.stride(0), cos_sin, cos_sin.stride(0),
        q_norm if qk_norm else cos_sin, k_norm if qk_norm else cos_sin, eps,
        k_cache, v_cache, slot_mapping, slot_mapping.stride(0), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), PAGE=k_cache.shape[1], H=H, KVH=KVH, HP2=next_pow2(H), KVHP2=next_pow2(KVH), D=D,
        QK_NORM=qk_norm, PDL=pdl, num_warps=4, **pdl_launch(pdl))


def _rope_and_store_torch(qkv, positions, cos_sin, k_cache, v_cache, slot_mapping, H, KVH, D,
                          q_norm, k_norm, eps) -> None:
    T = qkv.shape[0]
    half = D // 2
    cs = cos_sin[positions.long()]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    q = qkv[:, :H * D].view(T, H, D)
    k = qkv[:, H * D:(H + KVH) * D].view(T, KVH, D)
    v = qkv[:, (H + KVH) * D:].view(T, KVH, D)

    def rotate(x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
        xf = x.float()
        if w is not None:
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    q.copy_(rotate(q, q_norm))
    k.copy_(rotate(k, k_norm))
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    page = k_cache.shape[1]
    k_cache[slots // page, slots % page] = k.to(k_cache.dtype)  # writes through either layout's view
    v_cache[slots // page, slots % page] = v.to(v_cache.dtype)
