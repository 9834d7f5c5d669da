"""vLLM-V1 / Sarathi-style hybrid batches on the whole GPU: every running decode first, then prefill
chunks fill what is left of the token budget (``max_batched_tokens``, 8192 by default)."""

from __future__ import annotations

from ..batch import Batch, Chunk, Lane
from .base import Scheduler


class ChunkedPrefill(Scheduler):
    lanes: tuple[Lane, ...] = ("all",)

    def schedule(self, lane: Lane, now: float, horizon: float | None) -> Batch | None:
        decoders = self._decoders()
        partial = len(decoders) < len(self.running)  # someone (idle: one lane) is mid-prefill
        if not partial and not self.admissible():
            if not decoders:
                return None
            return self._decode_batch(lane, self.whole_gpu, decoders, now, self.arrival_horizon(horizon))
        budget = self.cfg.max_batched_tokens
        chunks: list[Chunk] = []
        reqs = []
        tables = self.kv.tables
        for r in decoders[:budget]:
            if r.num_computed == 0 or not self._reserve(r, r.num_computed + 1):
                if r.num_computed:
                    self.preempt(r)
                continue
            chunks.append(Chunk(r.id, r.num_computed, 1, tables[r.id], True, None, r.sampling))
            reqs.append(r)
            self.busy.add(r.id)
        self._take_prefills(budget - len(chunks), chunks, reqs)
        if not chunks:
            return None
        return self._launch(lane, Batch(self.whole_gpu, self.all_layers, tuple(chunks)), reqs)
