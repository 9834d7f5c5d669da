"""Causal attention of every multi-token chunk of a launch in ONE kernel call per layer, over the paged pool.

Each program takes one tile of ``BLOCK_Q`` consecutive new tokens of one sequence and one KV head, with all
the q heads sharing that head packed into the rows (``BLOCK_Q x G`` rows: token-major, head-minor), and runs
a flash-attention loop over the sequence's keys in the pool (its cached prefix and its own new tokens, which
the launch stored before attending). Keys before the tile's first query position are visible to every row and
run without the causal mask; only the last keys are masked.

Which tiles exist is a host-made table (``tile_table``: sequence, first token), so the grid is the table's
length: a launch with 64 prompts is one kernel call per layer instead of 64, and a table padded with
``-1`` rows keeps a fixed grid for CUDA-graph capture. Tiles are ordered longest work first.

Replaces, on CUDA, one SDPA call per sequence (plus a gather of each prefix's k/v out of the pool and
padding of prompt lengths for cuDNN's per-length plans).
"""

from __future__ import annotations

import numpy as np
import torch

from . import HAVE_TRITON, next_pow2, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _attend_block(acc, m_i, l_i, q, qpos, start, hi, KC, VC, bt, kv_head_off, stride_cpage, stride_ctok,
                      offs_d, scale_log2, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
                      PRECISION: tl.constexpr):
        offs_n = start + tl.arange(0, BLOCK_N)
        if MASK:
            nmask = offs_n < hi
            page = tl.load(bt + offs_n // PAGE, mask=nmask, other=0).to(tl.int64)
        else:
            page = tl.load(bt + offs_n // PAGE).to(tl.int64)
        kv_off = (page * stride_cpage + (offs_n % PAGE) * stride_ctok)[:, None] + kv_head_off + offs_d[None, :]
        if MASK:
            k = tl.load(KC + kv_off, mask=nmask[:, None], other=0.0)
            v = tl.load(VC + kv_off, mask=nmask[:, None], other=0.0)
        else:
            k = tl.load(KC + kv_off)
            v = tl.load(VC + kv_off)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        if MASK:
            s = tl.where((offs_n[None, :] <= qpos[:, None]) & nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return acc, m_new, l_i

    @triton.jit
    def _prefill_kernel(Q, KC, VC, O, BT, STARTS, CTX, TILES, scale_log2,
                        stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                        stride_cpage, stride_ctok, stride_chead,
                        PAGE: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                        BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
        t = tl.program_id(0)
        kvh = tl.program_id(1)
        s = tl.load(TILES + 2 * t)
        if s >= 0:
            m0 = tl.load(TILES + 2 * t + 1)
            row0 = tl.load(STARTS + s)
            q_len = tl.load(STARTS + s + 1) - row0
            ctx = tl.load(CTX + s)
            prefix = ctx - q_len
            BLOCK_M: tl.constexpr = BLOCK_Q * GP
            offs_m = tl.arange(0, BLOCK_M)
            j = m0 + offs_m // GP  # token of the sequence each row belongs to
            g = offs_m % GP
            rmask = (j < q_len) & (g < G)
            head = kvh * G + g
            offs_d = tl.arange(0, D)
            rows = (row0 + j).to(tl.int64)
            q = tl.load(Q + rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                        mask=rmask[:, None], other=0.0)
            qpos = prefix + j
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, D], tl.float32)
            bt = BT + s.to(tl.int64) * stride_bt
            kv_head_off = kvh * stride_chead
            hi = tl.minimum(ctx, prefix + m0 + BLOCK_Q)  # keys [0, hi) matter to this tile
            free = (prefix + m0) // BLOCK_N * BLOCK_N  # keys before this every row sees: no mask
            for start in range(0, free, BLOCK_N):
                acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, qpos, start, hi, KC, VC, bt, kv_head_off,
                                              stride_cpage, stride_ctok, offs_d, scale_log2, PAGE, BLOCK_N,
                                              False, PRECISION)
            for start in range(free, hi, BLOCK_N):
                acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, qpos, start, hi, KC, VC, bt, kv_head_off,
                                              stride_cpage, stride_ctok, offs_d, scale_log2, PAGE, BLOCK_N,
                                              True, PRECISION)
            o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
            tl.store(O + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                     o.to(O.dtype.element_ty), mask=rmask[:, None])


def block_q(group: int, block_m: int = 128) -> int:
    """New tokens per tile: ``block_m`` rows of (token, q head) pairs, heads padded to a power of two."""
    return max(1, block_m // next_pow2(group))


def tile_table(q_lens, ctx_lens, first: int, bq: int, pad_to: int | None = None) -> np.ndarray:
    """int32 ``[tiles, 2]`` of (sequence, first token) for the sequences ``first ..`` (their new-token counts
    ``q_lens`` and contexts after the launch ``ctx_lens``), ``bq`` tokens a tile, most keys first.
    ``pad_to``: add ``(-1, 0)`` rows up to that many (a fixed grid)."""
    seqs, starts, work = [], [], []
    for s in range(first, len(q_lens)):
        n, prefix = q_lens[s], ctx_lens[s] - q_lens[s]
        m0 = np.arange(0, n, bq)
        seqs.append(np.full(len(m0), s))
        starts.append(m0)
        work.append(prefix + np.minimum(m0 + bq, n))
    if not seqs:
        out = np.zeros((0, 2), np.int32)
    else:
        seq, m0, w = np.concatenate(seqs), np.concatenate(starts), np.concatenate(work)
        order = np.argsort(-w, kind="stable")
        out = np.stack([seq[order], m0[order]], axis=1).astype(np.int32)
    if pad_to is not None:
        if pad_to < len(out):
            raise ValueError(f"tile_table: {len(out)} tiles, room for {pad_to}")
        out = np.concatenate([out, np.tile(np.array([[-1, 0]], np.int32), (pad_to - len(out), 1))])
    return out


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      seq_starts: torch.Tensor, context_lens: torch.Tensor, tiles: torch.Tensor, scale: float,
                      out: torch.Tensor, block_n: int = 64, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """Causal attention of the rows of ``q [T, H, D]`` that ``tiles`` (from :func:`tile_table` with
    ``block_q(H // KVH)`` tokens a tile) cover, written into ``out [T, H, D]``. Sequence ``s`` has new-token
    rows ``seq_starts[s] .. seq_starts[s + 1]`` at positions ending at ``context_lens[s] - 1``; its keys and
    values (prefix and new tokens alike) are read from the pool ``k_cache``/``v_cache [blocks, page, KVH, D]``
    through ``block_tables[s]``."""
    H, D = q.shape[1], q.shape[2]
    KVH = k_cache.shape[2]
    G = H // KVH
    bq = block_q(G)
    if not use_triton(q):
        return _prefill_torch(q, k_cache, v_cache, block_tables, seq_starts, context_lens, tiles, scale, out, bq)
    if tiles.shape[0]:
        _prefill_kernel[(tiles.shape[0], KVH)](
            q, k_cache, v_cache, out, block_tables, seq_starts, context_lens, tiles, scale * 1.4426950408889634,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            PAGE=k_cache.shape[1], G=G, GP=next_pow2(G), D=D, BLOCK_Q=bq, BLOCK_N=block_n,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=num_warps, num_stages=num_stages)
    return out


def _prefill_torch(q, k_cache, v_cache, block_tables, seq_starts, context_lens, tiles, scale, out, bq):
    """The same semantics in plain torch (float32 math), tile by tile: the CPU path and the reference."""
    H = q.shape[1]
    KVH, page = k_cache.shape[2], k_cache.shape[1]
    G = H // KVH
    starts, ctxs, bts = seq_starts.tolist(), context_lens.tolist(), block_tables.long()
    for s, m0 in tiles.tolist():
        if s < 0:
            continue
        row0, q_len, ctx = starts[s], starts[s + 1] - starts[s], ctxs[s]
        n = min(bq, q_len - m0)
        hi = min(ctx, ctx - q_len + m0 + n)
        p = torch.arange(hi, device=q.device)
        blk, off = bts[s][p // page], p % page
        k = k_cache[blk, off].float().repeat_interleave(G, dim=1)  # [hi, H, D]
        v = v_cache[blk, off].float().repeat_interleave(G, dim=1)
        qt = q[row0 + m0:row0 + m0 + n].float()  # [n, H, D]
        sc = torch.einsum("nhd,khd->hnk", qt, k) * scale
        qpos = torch.arange(ctx - q_len + m0, ctx - q_len + m0 + n, device=q.device)
        sc = sc.masked_fill(p[None, None, :] > qpos[None, :, None], float("-inf"))
        o = torch.einsum("hnk,khd->nhd", torch.softmax(sc, dim=-1), v)
        out[row0 + m0:row0 + m0 + n] = o.to(out.dtype)
    return out
