"""Paged decode attention for GQA over ragged contexts, split-K (flash-decoding): each program takes one
sequence, one KV head (with all the q heads that share it) and one slice of the context; a second launch
merges the slices by their log-sum-exp. With one slice the first launch writes the output directly."""

from __future__ import annotations

import math

import torch

from . import HAVE_TRITON, next_pow2, pdl_launch, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    # the split count is an argument Triton does not specialise on, and the merge reads a fixed 32 slices
    # (masked): a new count in the middle of serving compiles nothing (a compile of the merge kernel cost
    # 114 ms of host time in a first bullet run on the H200, bench/RESULTS.md, twenty-third session)
    @triton.jit(do_not_specialize=["num_splits"])
    def _decode_split_kernel(Q, KC, VC, BT, CL, OUT, OP, LP, scale,
                             stride_qs, stride_qh, stride_bt, stride_cl, stride_cpage, stride_ctok, stride_chead,
                             stride_os, stride_oh, stride_ps, stride_ph, stride_psp,
                             num_splits, PAGE: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                             D: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr,
                             PRECISION: tl.constexpr, HEAD_FIRST: tl.constexpr, OFF32: tl.constexpr,
                             PDL: tl.constexpr):
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if HEAD_FIRST:  # neighbouring programs share a sequence: they read the same pages together
            kvh = tl.program_id(0)
            s = tl.program_id(1).to(tl.int64)
        else:
            s = tl.program_id(0).to(tl.int64)
            kvh = tl.program_id(1)
        sp = tl.program_id(2)
        ctx = tl.load(CL + s * stride_cl)
        per = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
        lo = sp * per
        hi = tl.minimum(lo + per, ctx)
        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, D)
        gmask = offs_g < G
        heads = kvh * G + offs_g
        q = tl.load(Q + s * stride_qs + heads[:, None] * stride_qh + offs_d[None, :], mask=gmask[:, None],
                    other=0.0)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        bt = BT + s * stride_bt
        head_off = kvh * stride_chead
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            nmask = offs_n < hi
            page = tl.load(bt + offs_n // PAGE, mask=nmask, other=0)
            if not OFF32:  # 32-bit offsets where the layer's pool has < 2^31 elements: fewer instructions
                page = page.to(tl.int64)
            tok = page * stride_cpage + (offs_n % PAGE) * stride_ctok
            kv_off = tok[:, None] + head_off + offs_d[None, :]
            k = tl.load(KC + kv_off, mask=nmask[:, None], other=0.0)
            v = tl.load(VC + kv_off, mask=nmask[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            scores = tl.where(nmask[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        if DIRECT:
            tl.store(OUT + s * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
                     o.to(OUT.dtype.element_ty), mask=gmask[:, None])
        else:
            lse = tl.where(l_i > 0.0, m_i + tl.log(l_safe), float("-inf"))
            tl.store(OP + s * stride_ps + heads[:, None] * stride_ph + sp * stride_psp + offs_d[None, :], o,
                     mask=gmask[:, None])
            tl.store(LP + (s * stride_ps + heads * stride_ph) // D + sp, lse, mask=gmask)

    @triton.jit(do_not_specialize=["num_splits"])
    def _decode_reduce_kernel(OP, LP, OUT, stride_ps, stride_ph, stride_psp, stride_os, stride_oh, num_splits,
                              D: tl.constexpr, SP2: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        s = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        offs_sp = tl.arange(0, SP2)
        offs_d = tl.arange(0, D)
        spmask = offs_sp < num_splits
        lse = tl.load(LP + (s * stride_ps + h * stride_ph) // D + offs_sp, mask=spmask, other=float("-inf"))
        m = tl.max(lse, axis=0)
        m = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp(lse - m)
        den = tl.sum(w, axis=0)
        o = tl.load(OP + s * stride_ps + h * stride_ph + offs_sp[:, None] * stride_psp + offs_d[None, :],
                    mask=spmask[:, None], other=0.0)
        num = tl.sum(o * w[:, None], axis=0)
        out = num / tl.where(den > 0.0, den, 1.0)
        tl.store(OUT + s * stride_os + h * stride_oh + offs_d, out.to(OUT.dtype.element_ty))


def launch_defaults(num_sms: int | None) -> dict:
    """Launch options by the SMs the kernel runs on (None: the whole GPU). On the H200 at 64 x 4096
    (bench/decode_partition.py) two pipeline stages instead of three ran 15-20 % faster on 36- and 52-SM
    partitions (three programs per SM instead of two) and 0-3 % slower on 68 SMs and the whole GPU."""
    return {"num_stages": 2} if num_sms is not None and num_sms <= 56 else {}


MERGE_SLICES = 32  # slices the merge kernel is compiled for (decode_splits' default max_splits)
DECODE_TARGET_PROGRAMS = 1024  # programs a split aims at; from this many (sequence, KV head) pairs it does not split


def decode_splits(num_seqs: int, num_kv_heads: int, max_context: int, block_n: int = 64,
                  target_programs: int = DECODE_TARGET_PROGRAMS, max_splits: int = 32) -> int:
    """Context slices per (sequence, KV head): enough programs to fill the GPU, at least one tile each. At
    most 32: a graph sizes the split for its capacity (16384 tokens), and at batch 1 over 1024 tokens 64
    slices (mostly empty) took 4.19 ms a step against 4.14 with 32 and 4.13 with 16 (bench/gpu_kernels.py)."""
    want = math.ceil(target_programs / max(1, num_seqs * num_kv_heads))
    return max(1, min(want, max_splits, math.ceil(max(1, max_context) / block_n)))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           max_context: int, num_splits: int | None = None,
                           out: torch.Tensor | None = None, block_n: int | None = None, num_warps: int = 4,
                           num_stages: int = 3, head_first: bool = True,
                           offsets32: bool = False, pdl: bool = False) -> torch.Tensor:
    """One new token per sequence attends to its whole context (new token included, already in the pool).

    ``q``: ``[S, H, D]`` (unit last stride); ``k_cache``/``v_cache``: ``[num_blocks, page, KVH, D]`` views
    with a unit last stride (either pool layout of ``PagedKvCache``; ``v`` strided as ``k``);
    ``block_tables``: ``[S, max_blocks]`` int; ``context_lens``: ``[S]`` int (0: the row is padding, output
    0); ``max_context``: an upper bound on ``context_lens`` (sizes the split); ``pdl``: programmatic dependent
    launches (see ``kernels.gemv``). Returns ``[S, H, D]``."""
    S, H, D = q.shape
    _, page, KVH, _ = k_cache.shape
    if out is None:
        out = torch.empty((S, H, D), device=q.device, dtype=q.dtype)
    if S == 0:
        return out
    if not use_triton(q):
        out.copy_(_decode_torch(q, k_cache, v_cache, block_tables, context_lens, scale))
        return out
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1 and q.stride(2) == 1
    G = H // KVH
    pdl = pdl and q.is_cuda
    block_n = block_n or (64 if D <= 128 else 32)
    splits = num_splits or decode_splits(S, KVH, max_context, block_n)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    if splits == 1:
        op = lp = out  # unused
        sps = sph = spsp = 0
    else:
        op = torch.empty((S, H, splits, D), device=q.device, dtype=torch.float32)
        lp = torch.empty((S, H, splits), device=q.device, dtype=torch.float32)
        sps, sph, spsp = op.stride(0), op.stride(1), op.stride(2)
    grid = (KVH, S, splits) if head_first else (S, KVH, splits)
    _decode_split_kernel[grid](
        q, k_cache, v_cache, block_tables, context_lens, out, op, lp, scale,
        q.stride(0), q.stride(1), block_tables.stride(0), context_lens.stride(0), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), out.stride(0), out.stride(1), sps, sph, spsp, splits,
        PAGE=page, G=G, GP=max(16, next_pow2(G)), D=D, BLOCK_N=block_n, DIRECT=splits == 1,
        PRECISION=precision, HEAD_FIRST=head_first,
        OFF32=bool(offsets32) and k_cache.numel() < 2**31, PDL=pdl,
        num_warps=num_warps, num_stages=num_stages, **pdl_launch(pdl))
    if splits > 1:
        _decode_reduce_kernel[(S, H)](op, lp, out, sps, sph, spsp, out.stride(0), out.stride(1), splits,
                                      D=D, SP2=max(MERGE_SLICES, next_pow2(splits)), PDL=pdl, num_warps=4, **pdl_launch(pdl))
    return out


def _decode_torch(q, k_cache, v_cache, block_tables, context_lens, scale) -> torch.Tensor:
    """Reference semantics, vectorised over the batch (gathers up to the block table's width)."""
    S, H, D = q.shape
    _, page, KVH, _ = k_cache.shape
    G = H // KVH
    width = block_tables.shape[1] * page
    pos = torch.arange(width, device=q.device)
    blocks, offs = block_tables.long()[:, pos // page], pos % page  # [S, width] each
    k = k_cache[blocks, offs].float()  # [S, width, KVH, D]
    v = v_cache[blocks, offs].float()
    qf = q.float().view(S, KVH, G, D)
    scores = torch.einsum("skgd,snkd->skgn", qf, k) * scale
    valid = pos[None, :] < context_lens.long()[:, None]  # [S, width]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    o = torch.einsum("skgn,snkd->skgd", p, v)
    return o.reshape(S, H, D)
