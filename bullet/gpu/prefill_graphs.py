"""CUDA graphs for small prefill and mixed launches: one graph per (partition, token bucket, layer range,
sampling mode), so a launch of a few hundred tokens costs one replay on the host instead of ~300 eager kernel
launches (about 11 ms of Python on the H200's host: bench/host_overhead.py).

A graph runs ``Model.forward`` over static buffers sized for its bucket of ``T`` token rows and ``max_seqs``
sequences. Every sequence, one-token rows included, goes through the one-call prefill attention
(``kernels.prefill_attention``) with a tile table padded to a fixed grid; rows past the launch's tokens are
padding (slot -1: they store nothing; no tile reads them; every kernel is row-local, so what they hold never
reaches a real row), as are sequences past its chunks (no rows, context 0, no tiles). A graph that reaches
the last layer samples one token per sequence (the sampling chunks' rows first); one that stops short leaves
its hidden state in the lane's ``hidden_in`` buffer, where the graph of the next slice reads it.

On the CPU there is no capture: a "graph" is the same body run again on the same buffers, so the CPU tests
drive exactly this bookkeeping (padding, tile tables, slices, sampling rows).

One :class:`PrefillGraphs` per executor lane: at most one launch in flight per lane, so its graphs share
buffers and one memory pool.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from ..batch import Chunk
from .attention import AttnMeta, CopyFence, fill_rows
from .kernels.prefill_attention import tile_table
from .kvcache import PagedKvCache
from .model import Model
from .sampling import sample

DEFAULT_TOKEN_BUCKETS: tuple[int, ...] = (16, 32, 64, 128, 256, 512)


def leading_decode(chunks: Sequence[Chunk]) -> int:
    """How many chunks from the first have one new token each: the rows the decode kernel takes."""
    nd = 0
    while nd < len(chunks) and chunks[nd].num_tokens == 1:
        nd += 1
    return nd


class _Replay:
    """The CPU's stand-in for a captured graph: replay runs the body again."""

    def __init__(self, body: Callable[[], object]) -> None:
        self.body = body

    def replay(self) -> None:
        self.body()


class PrefillGraphs:
    def __init__(self, model: Model, kv: PagedKvCache, device: torch.device, *,
                 buckets: Sequence[int] = DEFAULT_TOKEN_BUCKETS, max_seqs: int = 64,
                 max_context: int = 16384) -> None:
        if model.block_q is None:
            raise ValueError("PrefillGraphs: the model's prefill attention must be the tile kernel (not SDPA)")
        self.model, self.kv, self.device = model, kv, device
        self.cuda = device.type == "cuda"
        self.buckets = tuple(sorted(buckets))
        self.max_tokens, self.max_seqs = self.buckets[-1], max_seqs
        self.block_size = kv.block_size
        self.max_blocks = -(-max_context // kv.block_size)
        self.bq = model.block_q
        T, S, W = self.max_tokens, max_seqs, self.max_blocks
        # packed int32 metadata, 16-byte aligned parts: positions | slots | starts | ctx | sample rows | tables
        # | tiles | decode rows' ctx; filled on the host (pinned) and copied in one transfer
        sizes = (T, T, S + 1, S, S, S * W, 2 * self._num_tiles(T), S)
        offs = np.cumsum((0,) + tuple(-(-x // 4) * 4 for x in sizes))
        self._host = torch.zeros(int(offs[-1]), dtype=torch.int32, pin_memory=self.cuda)
        self._dev = torch.zeros(int(offs[-1]), dtype=torch.int32, device=device)
        self._fence = CopyFence(self.cuda)
        h = self._host.numpy()
        self._np = [h[offs[i]:offs[i] + sizes[i]] for i in range(8)]
        self._parts = [self._dev[offs[i]:offs[i] + sizes[i]] for i in range(8)]
        self.ids = torch.zeros(T, dtype=torch.int64, device=device)
        spec = model.spec
        self.hidden_in = torch.zeros((T, spec.hidden_size), dtype=model.dtype, device=device)
        self.temperature = torch.zeros(S, dtype=torch.float32, device=device)
        self.top_p = torch.ones(S, dtype=torch.float32, device=device)
        self.seeds = torch.zeros(S, dtype=torch.int64, device=device)
        self.offsets = torch.zeros(S, dtype=torch.int64, device=device)
        self.out = torch.zeros(S, dtype=torch.int64, device=device)  # sampled ids of the last replay
        self.pool = torch.cuda.graph_pool_handle() if self.cuda else None
        self.graphs: dict[tuple, object] = {}
        self.replays = 0
        self.decode_replays = 0  # replays of the ``dec`` variant

    def _num_tiles(self, bucket: int) -> int:
        return -(-bucket // self.bq) + self.max_seqs  # each sequence adds at most one partial tile

    # ------------------------------------------------------------------ eligibility
    def bucket(self, chunks: Sequence[Chunk]) -> int | None:
        """The token bucket for a launch of ``chunks``, or None (too many tokens, sequences or blocks)."""
        T = sum(c.num_tokens for c in chunks)
        if len(chunks) > self.max_seqs or T > self.max_tokens:
            return None
        if max(c.start + c.num_tokens for c in chunks) > self.max_blocks * self.block_size:
            return None
        return next(b for b in self.buckets if b >= T)

    def key(self, side, bucket: int, layers: range, greedy: bool, dec: bool = False) -> tuple:
        """A slice that stops short samples nothing: one graph serves both sampling modes. ``dec``: the variant
        whose leading one-token rows (decode rows) take the paged decode kernel; without it they are one-row
        tiles of the prefill kernel, which reads a row's context without a split: over long contexts that
        made a 45-token launch with 24 decode rows take 16 ms on the whole H200, against about 7 for a
        decode step of those rows (chunked, bench/RESULTS.md)."""
        greedy = greedy or layers.stop < self.model.spec.num_layers
        return (side.key if side is not None else "cpu", bucket, layers.start, layers.stop, greedy, dec)

    def decode_rows(self, bucket: int) -> int:
        """Rows the decode kernel of a ``dec`` graph covers: as many as a launch in the bucket can have."""
        return min(bucket, self.max_seqs)

    # ------------------------------------------------------------------ capture
    def meta(self, bucket: int, dec: bool = False) -> AttnMeta:
        """An AttnMeta over the static buffers for ``bucket`` token rows (views: capture and replay alike)."""
        pos, slot, starts, ctx, samp, bt, tiles, dctx = self._parts
        S, nd = self.max_seqs, self.decode_rows(bucket) if dec else 0
        return AttnMeta(positions=pos[:bucket], slot_mapping=slot[:bucket], seq_starts=starts, context_lens=ctx,
                        block_tables=bt.view(S, self.max_blocks), sample_rows=samp, num_decode=nd,
                        max_context=self.max_blocks * self.block_size, block_size=self.block_size,
                        q_lens=(), ctx_lens=None, tiles=tiles[:2 * self._num_tiles(bucket)].view(-1, 2),
                        decode_lens=dctx if dec else None)

    def _body(self, bucket: int, layers: range, greedy: bool, dec: bool = False) -> torch.Tensor:
        m = self.model
        meta = self.meta(bucket, dec)
        x = self.ids[:bucket] if layers.start == 0 else self.hidden_in[:bucket]
        hidden = m.forward(x, layers, meta, self.kv)
        if layers.stop < m.spec.num_layers:
            self.hidden_in[:bucket].copy_(hidden)
            return self.hidden_in
        logits = m.logits(hidden, meta.sample_rows)
        if greedy:
            tok = logits.argmax(dim=-1)
        else:
            tok = sample(logits, self.temperature, self.top_p, self.seeds, self.offsets)
        self.out.copy_(tok)
        return self.out

    def _fill_padding(self) -> None:
        """Every row padding, every sequence empty: what a warm-up or capture may run without touching the pool."""
        self._fence.wait()
        pos, slot, starts, ctx, samp, _bt, tiles, dctx = self._np
        pos[:] = 0
        slot[:] = -1
        starts[:] = 0
        ctx[:] = 0
        dctx[:] = 0
        samp[:] = 0
        tiles.reshape(-1, 2)[:] = (-1, 0)
        self._dev.copy_(self._host, non_blocking=self.cuda)
        self._fence.mark()

    def capture(self, side, bucket: int, layers: range, greedy: bool, dec: bool = False) -> object:
        """Capture (once) the launch body for ``bucket`` tokens over ``layers`` on ``side``'s stream (the
        partition it will run on: a graph keeps the partition it was captured on); ``dec``: see ``key``."""
        key = self.key(side, bucket, layers, greedy, dec)
        greedy = key[-2]
        g = self.graphs.get(key)
        if g is not None:
            return g
        if bucket not in self.buckets:
            raise ValueError(f"PrefillGraphs: {bucket} is not one of the token buckets {self.buckets}")
        if not self.cuda:
            g = self.graphs[key] = _Replay(lambda: self._body(bucket, layers, greedy, dec))
            return g
        stream = side.stream
        cur = torch.cuda.current_stream(self.device)
        stream.wait_stream(cur)
        with torch.cuda.stream(stream), self.model.on_sms(side.num_sms):
            self._fill_padding()
            self._body(bucket, layers, greedy, dec)  # warm-up: compiles kernels, makes this stream's cuBLAS workspace
            stream.synchronize()
            g = torch.cuda.CUDAGraph()
            g.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                self._body(bucket, layers, greedy, dec)
            finally:
                g.capture_end()
        cur.wait_stream(stream)
        self.graphs[key] = g
        return g

    # ------------------------------------------------------------------ replay
    def run(self, side, chunks: Sequence[Chunk], x: torch.Tensor, bucket: int, layers: range, greedy: bool,
            sampling: tuple | None = None, dec: bool = False, table=None) -> torch.Tensor:
        """Replay the captured graph for ``chunks`` (on the current stream, the replay stream): ``x`` is
        their token ids ``[T]`` (``layers.start == 0``) or the hidden state ``[T, hidden]`` of the previous
        slice. Returns the hidden state (a view of ``hidden_in``) for a slice that stops short, else the
        sampled ids of the sampling chunks, in chunk order (a view of ``out``). ``sampling``: (temperature,
        top_p, seeds, offsets) device tensors of the sampling chunks where not greedy. ``dec``: replay the
        variant whose decode kernel takes the leading one-token chunks (see ``key``). ``table``: each chunk's block
        ids, as :func:`fill_rows` takes them."""
        g = self.graphs[self.key(side, bucket, layers, greedy, dec)]
        T = sum(c.num_tokens for c in chunks)
        n = len(chunks)
        nd = leading_decode(chunks) if dec else 0
        self._fence.wait()
        pos, slot, starts, ctx, samp, bt, tiles, dctx = self._np
        fill_rows(chunks, self.block_size, pos, slot, starts, ctx, samp, bt.reshape(self.max_seqs, -1), table)
        pos[T:bucket] = 0
        slot[T:bucket] = -1
        starts[n + 1:] = T
        ctx[n:] = 0
        k = sum(1 for c in chunks if c.sample)
        samp[k:] = 0
        q_lens = [c.num_tokens for c in chunks]
        ctx_lens = [c.start + c.num_tokens for c in chunks]
        t = tile_table(q_lens, ctx_lens, nd, self.bq, self._num_tiles(bucket))
        tiles[:t.size] = t.ravel()
        dctx[:nd] = ctx[:nd]
        dctx[nd:] = 0
        self._dev.copy_(self._host, non_blocking=self.cuda)
        self._fence.mark()
        if layers.start == 0:
            self.ids[:T].copy_(x)
        elif x.data_ptr() != self.hidden_in.data_ptr():
            self.hidden_in[:T].copy_(x)
        if sampling is not None:
            for buf, src in zip((self.temperature, self.top_p, self.seeds, self.offsets), sampling):
                buf[:k].copy_(src)
        g.replay()
        self.replays += 1
        self.decode_replays += dec
        if layers.stop < self.model.spec.num_layers:
            return self.hidden_in[:T]
        return self.out[:k]
