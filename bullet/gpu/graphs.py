"""Decode CUDA graphs per (partition, batch-size bucket, sampling mode).

A graph keeps the SM partition of the stream it was captured on (docs/background.md): captured on a 32-SM green
stream it replays at 32-SM speed on any stream. So each graph is captured ON the partition it will run on and
is keyed by that partition (``Side.key``: the green context, not just its SM count, since two contexts with
the same count from different splits are different SMs); the replay stream only orders work.

One graph is one whole decode step over static buffers: embedding, all layers (paged KV store + attention),
final norm, logits, sampling, then an in-graph *advance* (positions, context lengths, KV slots, sampling
offsets +1 and the sampled ids fed back as the next inputs), so ``k`` replays in a row are ``k`` fused decode
steps with no host work between them. Padding rows (context 0, slot -1) store nothing and stay padding.

One :class:`LaneGraphs` per executor lane: its buffers and memory pool are shared by every graph of that lane
(at most one launch in flight per lane, so no two of its graphs ever run at once).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..batch import Chunk
from .attention import _CTX, _NCOLS, _POS, _SLOT, DecodeBuffers
from .kernels.advance import advance
from .kvcache import PagedKvCache
from .model import Model
from .sampling import sample

DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def bucket_for(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding ``n`` rows (None: too many for any graph)."""
    for b in buckets:
        if b >= n:
            return b
    return None


class LaneGraphs:
    """Static buffers, a shared memory pool and the graphs of one lane."""

    def __init__(self, model: Model, kv: PagedKvCache, device: torch.device, *,
                 buckets: Sequence[int] = DEFAULT_BUCKETS, max_context: int = 16384) -> None:
        self.model, self.kv, self.device = model, kv, device
        self.buckets = tuple(sorted(buckets))
        self.max_batch = self.buckets[-1]
        self.block_size = kv.block_size
        self.max_blocks = -(-max_context // kv.block_size)
        self.bufs = DecodeBuffers(self.max_batch, self.max_blocks, kv.block_size, device)
        n = self.max_batch
        self.temperature = torch.zeros(n, dtype=torch.float32, device=device)
        self.top_p = torch.ones(n, dtype=torch.float32, device=device)
        self.seeds = torch.zeros(n, dtype=torch.int64, device=device)
        self.offsets = torch.zeros(n, dtype=torch.int64, device=device)
        self.out = torch.zeros(n, dtype=torch.int64, device=device)  # sampled ids of the last replay
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[str, int, bool], torch.cuda.CUDAGraph] = {}

    # ------------------------------------------------------------------ eligibility
    def fits(self, chunks: Sequence[Chunk], steps: int) -> int | None:
        """The bucket for a decode launch of ``chunks`` over ``steps`` steps, or None (run it eagerly)."""
        b = bucket_for(len(chunks), self.buckets)
        if b is None:
            return None
        last = max(c.start for c in chunks) + steps - 1  # position of the last step's new token
        return b if last // self.block_size < self.max_blocks else None

    # ------------------------------------------------------------------ capture
    def _body(self, bs: int, greedy: bool) -> None:
        """One decode step over the first ``bs`` rows of the static buffers, then the advance."""
        m, bufs = self.model, self.bufs
        meta = bufs.meta(bs)
        ids = bufs.input_ids[:bs]
        hidden = m.forward(ids, range(m.spec.num_layers), meta, self.kv)
        logits = m.logits(hidden, meta.sample_rows)
        if greedy:
            tok = logits.argmax(dim=-1)
        else:
            tok = sample(logits, self.temperature[:bs], self.top_p[:bs], self.seeds[:bs], self.offsets[:bs])
        advance(self.bufs.buf[:bs], tok, self.out[:bs], ids, self.offsets[:bs], self.block_size,
                (_POS, _CTX, _SLOT, _NCOLS))

    def capture(self, side, bs: int, greedy: bool) -> torch.cuda.CUDAGraph:
        """Capture (once) the step for ``bs`` rows on ``side``'s stream. Buffers are reset to padding
        first, so the warm-up and capture store nothing in the KV pool."""
        key = (side.key, bs, greedy)
        g = self.graphs.get(key)
        if g is not None:
            return g
        stream = side.stream
        cur = torch.cuda.current_stream(self.device)
        stream.wait_stream(cur)
        with torch.cuda.stream(stream):
            self.bufs.fill_arrays(np.zeros(0, np.int64), np.zeros((0, 0), np.int32), bs=bs)
            self._body(bs, greedy)  # warm-up: compiles kernels, makes this stream's cuBLAS workspace
            self.bufs.fill_arrays(np.zeros(0, np.int64), np.zeros((0, 0), np.int32), bs=bs)
            stream.synchronize()
            g = torch.cuda.CUDAGraph()
            g.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                self._body(bs, greedy)
            finally:
                g.capture_end()
        cur.wait_stream(stream)
        self.graphs[key] = g
        return g

    # ------------------------------------------------------------------ replay
    def prepare(self, positions: np.ndarray, tables: np.ndarray, ids: torch.Tensor, bs: int, greedy: bool,
                temperature: torch.Tensor | None = None, top_p: torch.Tensor | None = None,
                seeds: torch.Tensor | None = None, offsets: torch.Tensor | None = None) -> None:
        """Load the first step's inputs (on the current stream, which must be the replay stream):
        ``positions[i]`` of row i's new token and its block table ``tables[i]``, which must already cover
        every fused step (the in-graph advance reads the table, nothing refills it)."""
        n = len(positions)
        self.bufs.fill_arrays(positions, tables, bs=bs)
        self.bufs.input_ids[:n].copy_(ids)
        if not greedy:
            self.temperature[:n].copy_(temperature)
            self.top_p[:n].copy_(top_p)
            self.seeds[:n].copy_(seeds)
            self.offsets[:n].copy_(offsets)
