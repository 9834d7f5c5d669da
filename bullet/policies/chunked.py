"""vLLM-V1 / Sarathi-style hybrid batches on the whole GPU: every running decode first, then prefill
chunks fill what is left of the token budget (``max_batched_tokens``, 8192 by default). When a step
leaves no prefill work behind, the decode steps after it are fused into the same launch."""

from __future__ import annotations

from ..batch import Batch, Lane
from .base import Scheduler


class ChunkedPrefill(Scheduler):
    __slots__ = ()
    lanes: tuple[Lane, ...] = ("all",)

    def schedule(self, lane: Lane, now: float, horizon: float | None) -> Batch | None:
        decoders = self._decoders()
        if not self.partial and not self.admissible():
            if not decoders:
                return None
            return self._decode_batch(lane, self.whole_gpu, decoders, now, self.arrival_horizon(horizon))
        budget = self.cfg.max_batched_tokens
        reqs = self._one_step(decoders[:budget], named=True)  # (list chunks: the live tables)
        chunks = self._decode_chunks(reqs)
        self.busy.update([r.id for r in reqs])
        self._take_prefills(budget - len(chunks), chunks, reqs)
        if not chunks:
            return None
        if not self.admissible() and all(c.sample for c in chunks):  # nothing left to prefill next
            return self._fused(lane, self.whole_gpu, chunks, reqs, now, self.arrival_horizon(horizon))
        return self._launch(lane, Batch(self.whole_gpu, self.all_layers, tuple(chunks)), reqs)
