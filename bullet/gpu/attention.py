"""Attention metadata (built once per launch from the chunks; nothing global), the static buffers that decode
CUDA graphs are captured on, and attention over the paged pool.

Rows ``[0, num_decode)`` are one-token chunks and go through the paged decode kernel in one launch. The
remaining chunks (prefill, or anything after the first multi-token chunk) go, where the metadata carries a
tile table (``build_meta(..., block_q=...)``), through one causal attention call over the pool for all of them
(``kernels.prefill_attention``: Triton on CUDA, its torch twin on the CPU); without one, through SDPA one
sequence at a time (on the chunk's own k/v when it has no cached prefix, else on k/v gathered from the pool).
Executors should put decode chunks first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from ..batch import Chunk
from .kernels.decode_attention import paged_decode_attention
from .kernels.prefill_attention import prefill_attention, tile_table

# A lone fresh prompt of this many tokens or more goes to SDPA (cuDNN) on CUDA even with a tile table: on the
# H200 at 4096 tokens it ran 0.35 ms a layer against 0.53-0.61 for the tile kernel, at 8192 1.07 against 1.58
# (bench/prefill_attention.py); at 1024 the two were equal, and with several sequences or a cached prefix the
# tile kernel won 1.3-114x (one call instead of one per sequence, no gather).
SDPA_FROM = 2048

# columns of the packed int32 metadata rows (one host->device copy per launch)
_POS, _CTX, _SLOT, _SAMPLE = 0, 1, 2, 3
_NCOLS = 4


@dataclass(frozen=True, slots=True)
class AttnMeta:
    positions: torch.Tensor  # [T] int32: position of each new token
    slot_mapping: torch.Tensor  # [T] int32: pool slot of each new token's k/v (-1: not stored)
    seq_starts: torch.Tensor  # [S + 1] int32: cu_seqlens of the new tokens
    context_lens: torch.Tensor  # [S] int32: tokens in context after this launch (prefix + new)
    block_tables: torch.Tensor  # [S, max_blocks] int32
    sample_rows: torch.Tensor  # [num_sampled] int32: row of the last token of each sampled chunk
    num_decode: int  # sequences [0, num_decode) have one new token each (rows [0, num_decode))
    max_context: int  # upper bound on context_lens (sizes the decode split)
    block_size: int
    q_lens: tuple[int, ...]  # host copies, used by the prefill path only
    ctx_lens: tuple[int, ...] | None
    tiles: torch.Tensor | None = None  # [tiles, 2] int32 (sequence, first token): the one-call prefill path
    # prefill graphs: contexts of rows [0, num_decode) for the decode kernel (0: not a decode row, output 0);
    # the tile table then covers every other row, whatever num_decode says
    decode_lens: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]


def build_meta(chunks: Sequence[Chunk], block_size: int, device: torch.device | str,
               max_blocks: int | None = None, block_q: int | None = None,
               table: Callable[[Chunk], Sequence[int]] | None = None) -> AttnMeta:
    """Metadata for one launch over ``chunks`` (their token rows in chunk order). ``block_q``: new tokens per
    tile of the one-call prefill attention (``kernels.prefill_attention.block_q``); None: SDPA per sequence.
    ``table``: as :func:`fill_rows`'s."""
    n = len(chunks)
    q_lens = tuple(c.num_tokens for c in chunks)
    ctx_lens = tuple(c.start + c.num_tokens for c in chunks)
    T = sum(q_lens)
    need_blocks = max((-(-c // block_size) for c in ctx_lens), default=1)
    # a width that is a multiple of 16 and 16-byte aligned parts of the buffer below: Triton compiles a kernel
    # per divisibility of its integer and pointer arguments, so these keep every launch on one compiled variant
    width = max(1, -(-need_blocks // 16) * 16 if max_blocks is None else max_blocks)
    if need_blocks > width:
        raise ValueError(f"build_meta: a chunk needs {need_blocks} blocks, more than max_blocks={width}")
    num_decode = 0
    while num_decode < n and q_lens[num_decode] == 1:
        num_decode += 1
    num_sampled = sum(1 for c in chunks if c.sample)
    tiles = None if block_q is None else tile_table(q_lens, ctx_lens, num_decode, block_q)
    # one int32 buffer: [positions T | slots T | seq_starts n+1 | ctx n | sample_rows k | block tables n*width
    # | tiles 2 t]
    sizes = (T, T, n + 1, n, num_sampled, n * width, 0 if tiles is None else tiles.size)
    offs = np.cumsum((0,) + tuple(-(-x // 4) * 4 for x in sizes))
    buf = np.zeros(offs[-1], dtype=np.int32)
    pos, slot, starts, ctx, sample, bt, tls = (buf[offs[i]:offs[i] + sizes[i]] for i in range(7))
    if tiles is not None:
        tls[:] = tiles.ravel()
    fill_rows(chunks, block_size, pos, slot, starts, ctx, sample, bt.reshape(n, width), table)
    host = torch.from_numpy(buf)
    if torch.device(device).type == "cuda":  # pinned and asynchronous: a copy from pageable memory would wait
        # for the stream to drain first (the host could not run ahead of a multi-step eager launch)
        dev = host.pin_memory().to(device, non_blocking=True)
    else:
        dev = host.to(device)
    parts = [dev[offs[i]:offs[i] + sizes[i]] for i in range(7)]
    return AttnMeta(positions=parts[0], slot_mapping=parts[1], seq_starts=parts[2], context_lens=parts[3],
                    sample_rows=parts[4], block_tables=parts[5].view(n, width), num_decode=num_decode,
                    max_context=max(ctx_lens, default=1), block_size=block_size, q_lens=q_lens,
                    ctx_lens=ctx_lens, tiles=None if tiles is None else parts[6].view(-1, 2))


def fill_rows(chunks: Sequence[Chunk], block_size: int, pos: np.ndarray, slot: np.ndarray, starts: np.ndarray,
              ctx: np.ndarray, sample: np.ndarray, bt: np.ndarray,
              table: Callable[[Chunk], Sequence[int]] | None = None) -> None:
    """Write the chunks' rows into int32 arrays: positions and pool slots of the new tokens, cu_seqlens
    (``starts[0]`` is left as it is: 0), contexts after the launch, the row of each sampling chunk's last
    token, and block tables (``bt [>= len(chunks), >= blocks needed]``; columns past a chunk's need untouched).
    ``table(chunk)``: its block ids (the executor's per-request int32 copies, ``GpuExecutor._block_table``);
    default ``chunk.block_ids``. One-token rows (decode rows, most of a mixed launch's) take no numpy call."""
    row = k = 0
    for i, c in enumerate(chunks):
        m = c.num_tokens
        n = c.start + m
        need = -(-n // block_size)
        blocks = c.block_ids if table is None else table(c)
        if len(blocks) < need:
            raise ValueError(f"build_meta: request {c.req_id} has {len(blocks)} blocks, too few for "
                             f"{n} tokens")
        if need > bt.shape[1]:
            raise ValueError(f"build_meta: request {c.req_id} needs {need} blocks, room for {bt.shape[1]}")
        bt[i, :need] = blocks[:need]
        if m == 1:
            p = c.start
            pos[row] = p
            slot[row] = int(blocks[p // block_size]) * block_size + p % block_size
        else:
            p = np.arange(c.start, n)
            pos[row:row + m] = p
            slot[row:row + m] = np.asarray(blocks[:need], np.int64)[p // block_size] * block_size + p % block_size
        row += m
        starts[i + 1] = row
        ctx[i] = n
        if c.sample:
            sample[k] = row - 1
            k += 1


class CopyFence:
    """The last host->device copy out of a pinned staging buffer that is reused: ``wait()`` before writing the
    buffer again, ``mark()`` right after enqueuing the copy. With one launch per lane the copy has long run by
    then; a launch queued behind another (async scheduling) may fill the buffer before the copy of the launch
    ahead of it has run. A no-op on the CPU."""

    def __init__(self, cuda: bool) -> None:
        self._ev = torch.cuda.Event() if cuda else None
        self._marked = False

    def wait(self) -> None:
        if self._marked:
            self._ev.synchronize()

    def mark(self) -> None:
        if self._ev is not None:
            self._ev.record()
            self._marked = True


class DecodeBuffers:
    """Static metadata tensors for CUDA-graph capture of decode steps (one token per sequence).

    Row ``i`` of the pinned host buffer and of its device twin holds ``(position, context_len, slot,
    sample_row, block table...)``; ``fill`` writes the first ``bs`` rows on the host and copies them in one
    host->device copy (asynchronous: fill again only after the step that reads them has been ordered after
    it, as the executor's one sync per step does). Padding rows have context 0 and slot -1: they store
    nothing and attend to nothing."""

    def __init__(self, max_batch: int, max_blocks: int, block_size: int, device: torch.device | str) -> None:
        self.max_batch, self.max_blocks, self.block_size = max_batch, max_blocks, block_size
        self.device = torch.device(device)
        cols = _NCOLS + max_blocks
        self._host = torch.zeros((max_batch, cols), dtype=torch.int32,
                                 pin_memory=self.device.type == "cuda")
        self._np = self._host.numpy()
        self._np[:, _SAMPLE] = np.arange(max_batch)
        self._np[:, _SLOT] = -1
        self.buf = torch.zeros((max_batch, cols), dtype=torch.int32, device=self.device)
        self.buf.copy_(self._host)
        self.seq_starts = torch.arange(max_batch + 1, dtype=torch.int32, device=self.device)
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=self.device)  # for graph inputs
        self._fence = CopyFence(self.device.type == "cuda")

    def fill(self, chunks: Sequence[Chunk], bs: int | None = None) -> None:
        """Rows for one-token ``chunks`` (position ``start``), padded to ``bs`` rows. Each row gets the
        chunk's whole block table (up to ``max_blocks``), so fused steps that cross into a block allocated
        ahead of them read it, not a stale column."""
        n = len(chunks)
        positions = np.fromiter((c.start for c in chunks), dtype=np.int64, count=n)
        self._fence.wait()
        bt = self._np[:n, _NCOLS:]
        B = self.block_size
        for i, c in enumerate(chunks):
            nb = positions[i] // B + 1
            if nb > self.max_blocks or len(c.block_ids) < nb:
                raise ValueError(f"DecodeBuffers.fill: request {c.req_id} at position {c.start} needs {nb} "
                                 f"blocks (has {len(c.block_ids)}, room for {self.max_blocks})")
            k = min(len(c.block_ids), self.max_blocks)
            bt[i, :k] = c.block_ids[:k]
        self._write(positions, bs)

    def fill_arrays(self, positions: np.ndarray, block_tables: np.ndarray, bs: int | None = None) -> None:
        """Rows from arrays: ``positions[i]`` of the new token, ``block_tables[i, :]`` (at most max_blocks)."""
        n = len(positions)
        self._fence.wait()
        self._np[:n, _NCOLS:_NCOLS + block_tables.shape[1]] = block_tables
        self._write(np.asarray(positions, dtype=np.int64), bs)

    def _write(self, positions: np.ndarray, bs: int | None) -> None:
        n = len(positions)
        bs = n if bs is None else bs
        if not n <= bs <= self.max_batch:
            raise ValueError(f"DecodeBuffers: {n} rows padded to {bs}, room for {self.max_batch}")
        h, B = self._np, self.block_size
        h[:n, _POS] = positions
        h[:n, _CTX] = positions + 1
        h[:n, _SLOT] = h[np.arange(n), _NCOLS + positions // B] * B + positions % B
        h[n:bs, _POS] = 0
        h[n:bs, _CTX] = 0
        h[n:bs, _SLOT] = -1
        self.buf[:bs].copy_(self._host[:bs], non_blocking=True)
        self._fence.mark()

    def meta(self, bs: int) -> AttnMeta:
        """An AttnMeta over the first ``bs`` rows (views: valid for capture and replay alike)."""
        b = self.buf[:bs]
        return AttnMeta(positions=b[:, _POS], slot_mapping=b[:, _SLOT], seq_starts=self.seq_starts[:bs + 1],
                        context_lens=b[:, _CTX], block_tables=b[:, _NCOLS:], sample_rows=b[:, _SAMPLE],
                        num_decode=bs, max_context=self.max_blocks * self.block_size,
                        block_size=self.block_size, q_lens=(1,) * bs, ctx_lens=None)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMeta, k_cache: torch.Tensor,
              v_cache: torch.Tensor, scale: float, decode_config: dict | None = None,
              prefill_config: dict | None = None) -> torch.Tensor:
    """``q``: ``[T, H, D]``; ``k``/``v``: ``[T, KVH, D]`` of the new tokens (already stored in the pool).
    ``decode_config``: launch options of the decode kernel (block_n, num_warps, num_stages, num_splits,
    head_first). ``prefill_config``: ``backends`` (a list of ``torch.nn.attention.SDPBackend`` to allow) and
    ``enable_gqa`` (pass KV heads unexpanded to SDPA) for the SDPA path; ``tiles`` (options of
    ``prefill_attention``: block_n, num_warps, num_stages) for the one-call path, and ``sdpa_from`` (a lone fresh
    prompt this long goes to SDPA on CUDA all the same; default ``SDPA_FROM``).
    Returns ``[T, H, D]``."""
    T, H, D = q.shape
    nd = meta.num_decode
    cfg = prefill_config or {}
    if nd == meta.num_seqs - 1 and nd == 0 and meta.ctx_lens is not None and meta.ctx_lens[0] == T \
            and (meta.tiles is None or (q.is_cuda and T >= cfg.get("sdpa_from", SDPA_FROM))):
        # one prompt from position 0 and nothing else: SDPA's output is the result, no copy
        return _prefill_one(q, k, v, None, scale, cfg)
    out = torch.empty((T, H, D), device=q.device, dtype=q.dtype)
    lens = meta.context_lens if meta.decode_lens is None else meta.decode_lens
    if nd:
        paged_decode_attention(q[:nd], k_cache, v_cache, meta.block_tables[:nd], lens[:nd],
                               scale, meta.max_context, out=out[:nd], **(decode_config or {}))
    if nd == meta.num_seqs and meta.decode_lens is None:
        return out
    if meta.tiles is not None:  # every multi-token chunk in one call, keys and values from the pool
        return prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_starts, meta.context_lens,
                                 meta.tiles, scale, out, **cfg.get("tiles", {}))
    assert meta.ctx_lens is not None, "multi-token chunks need host-side lengths (use build_meta)"
    B = meta.block_size
    row = nd
    for i in range(nd, meta.num_seqs):
        n, ctx = meta.q_lens[i], meta.ctx_lens[i]
        if ctx == n:
            o = _prefill_one(q[row:row + n], k[row:row + n], v[row:row + n], None, scale, cfg)
        else:  # over a cached prefix: the context's k/v come from the pool (the new tokens are there too)
            p = torch.arange(ctx, device=q.device)
            blocks, offs = meta.block_tables[i].long()[p // B], p % B
            o = _prefill_one(q[row:row + n], k_cache[blocks, offs], v_cache[blocks, offs], ctx, scale, cfg)
        out[row:row + n] = o
        row += n
    return out


def _prefill_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int | None, scale: float,
                 cfg: dict) -> torch.Tensor:
    """Causal attention of ``q [n, H, D]`` over ``k``/``v [ctx, KVH, D]`` whose last ``n`` rows are the new
    tokens (``ctx`` None: no prefix). Returns ``[n, H, D]`` (a view of SDPA's output)."""
    n, H = q.shape[:2]
    KVH = k.shape[1]
    pad = padded_length(n) - n if ctx is None and q.is_cuda else 0
    if pad:  # padded rows go last: under the causal mask no real query sees them; their output is dropped
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
    # unexpanded KV heads (enable_gqa) measured faster on the H200 for the causal path; with a prefix the
    # lower-right causal bias takes its own kernel call, which wants the heads expanded
    gqa = H != KVH and ctx is None and cfg.get("enable_gqa", True)
    if H != KVH and not gqa:
        k, v = k.repeat_interleave(H // KVH, dim=1), v.repeat_interleave(H // KVH, dim=1)
    qi = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    ki = k.transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, H or KVH, ctx, D]
    vi = v.transpose(0, 1).unsqueeze(0).to(q.dtype)
    kwargs: dict = {"scale": scale}
    if gqa:
        kwargs["enable_gqa"] = True
    if ctx is None:
        kwargs["is_causal"] = True
    else:  # new token j (at position ctx - n + j) sees keys 0 .. ctx - n + j: causal from the lower right,
        # which SDPA runs on its flash or memory-efficient kernel without building an n x ctx mask
        kwargs["attn_mask"] = causal_lower_right(n, ctx)
    if cfg.get("backends") and ctx is None:  # a backend list is for the causal path (no prefix)
        with sdpa_kernel(cfg["backends"]):
            o = F.scaled_dot_product_attention(qi, ki, vi, **kwargs)
    else:
        o = F.scaled_dot_product_attention(qi, ki, vi, **kwargs)
    return o[0].transpose(0, 1)[:n]


def padded_length(n: int) -> int:
    """Prompt lengths are padded to a multiple of 256 (2048 past 8192) for the causal SDPA call: the cuDNN
    backend builds a plan per sequence length, ~70 ms each on the H200 (bench/mixed_step.py), which a
    serving run with every prompt a new length would pay on every prefill."""
    g = 256 if n <= 8192 else 2048
    return -(-n // g) * g


def warm_prefill(spec, device, dtype, max_tokens: int = 8192, cfg: dict | None = None) -> int:
    """Run the causal prefill attention once per padded length up to ``max_tokens`` (builds the SDPA plans
    ahead of serving); returns how many lengths."""
    H, KVH, D = spec.heads_per_gpu, spec.kv_heads_per_gpu, spec.head_dim
    lengths = sorted({padded_length(n) for n in range(1, max_tokens + 1, 256)})
    for n in lengths:
        # a padded prompt reaches SDPA as contiguous copies, one of exactly n tokens as views of the model's
        # q/k/v projection: cuDNN keys its plans by strides too, so both (the views' first call of 2048
        # tokens took 99 ms against 43 on the H200 after a warm-up of the copies alone: bench/RESULTS.md)
        q = torch.zeros((n, H, D), device=device, dtype=dtype)
        kv = torch.zeros((n, KVH, D), device=device, dtype=dtype)
        _prefill_one(q, kv, kv, None, 1.0, cfg or {})
        qkv = torch.zeros((n, (H + 2 * KVH) * D), device=device, dtype=dtype)
        q, k, v = (qkv[:, a * D:b * D].view(n, -1, D) for a, b in ((0, H), (H, H + KVH), (H + KVH, H + 2 * KVH)))
        _prefill_one(q, k, v, None, 1.0, cfg or {})
    return len(lengths)
