"""The in-graph advance between fused decode steps (``graphs.LaneGraphs``): the sampled ids become the next
inputs and every live row moves one token on (position, context length, KV slot, sampling offset). One
kernel on CUDA instead of ~15 small torch ops, which at batch 1 cost ~0.1 ms a step (bench/gpu_kernels.py,
the lane-graph row)."""

from __future__ import annotations

import torch

from . import HAVE_TRITON, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _advance_kernel(BUF, TOK, OUT, IDS, OFFS, bs, stride_b, max_blocks, PAGE: tl.constexpr,
                        POS: tl.constexpr, CTX: tl.constexpr, SLOT: tl.constexpr, NCOLS: tl.constexpr,
                        BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < bs
        row = BUF + i.to(tl.int64) * stride_b
        tok = tl.load(TOK + i, mask=m)
        tl.store(OUT + i, tok, mask=m)
        tl.store(IDS + i, tok, mask=m)
        ctx = tl.load(row + CTX, mask=m, other=0)
        step = (ctx > 0).to(tl.int32)
        pos = tl.load(row + POS, mask=m, other=0) + step
        tl.store(row + POS, pos, mask=m)
        tl.store(row + CTX, ctx + step, mask=m)
        block = tl.load(row + NCOLS + tl.minimum(pos // PAGE, max_blocks - 1), mask=m, other=0)
        tl.store(row + SLOT, tl.where(ctx > 0, block * PAGE + pos % PAGE, -1), mask=m)
        tl.store(OFFS + i, tl.load(OFFS + i, mask=m, other=0) + 1, mask=m)


def advance(buf: torch.Tensor, tok: torch.Tensor, out: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor,
            block_size: int, cols: tuple[int, int, int, int]) -> None:
    """``buf``: ``[bs, ncols + max_blocks]`` int32 rows of ``DecodeBuffers`` (``cols``: the indices of the
    position, context-length and slot columns, and the table's first column); ``tok``: ``[bs]`` sampled ids,
    copied to ``out`` and ``ids``; ``offsets``: ``[bs]`` sampling offsets, +1. Rows with context 0 are
    padding: they stay so (slot -1)."""
    pos_c, ctx_c, slot_c, ncols = cols
    bs = buf.shape[0]
    max_blocks = buf.shape[1] - ncols
    if use_triton(buf) and buf.is_cuda:
        assert buf.stride(1) == 1 and tok.is_contiguous() and out.is_contiguous() and ids.is_contiguous()
        block = 128
        _advance_kernel[(triton.cdiv(bs, block),)](
            buf, tok, out, ids, offsets, bs, buf.stride(0), max_blocks, PAGE=block_size, POS=pos_c, CTX=ctx_c,
            SLOT=slot_c, NCOLS=ncols, BLOCK=block, num_warps=4)
        return
    out.copy_(tok)
    ids.copy_(tok)
    live = buf[:, ctx_c] > 0
    step = live.to(torch.int32)
    buf[:, pos_c] += step
    buf[:, ctx_c] += step
    pos = buf[:, pos_c].long()
    col = (pos // block_size).clamp_(max=max_blocks - 1)
    block = buf[:, ncols:].gather(1, col[:, None]).squeeze(1).long()
    slot = block * block_size + pos % block_size
    buf[:, slot_c] = torch.where(live, slot, torch.full_like(slot, -1)).to(torch.int32)
    offsets += 1
