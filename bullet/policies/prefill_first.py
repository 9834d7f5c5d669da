"""SGLang-style: whenever a prefill can run, run a prefill-only batch (chunked at
``max_batched_tokens``, 8192 by default); otherwise decode every running request."""

from __future__ import annotations

from ..batch import Batch, Chunk, Lane
from .base import Scheduler


class PrefillFirst(Scheduler):
    __slots__ = ()
    lanes: tuple[Lane, ...] = ("all",)

    def schedule(self, lane: Lane, now: float, horizon: float | None) -> Batch | None:
        chunks: list[Chunk] = []
        reqs = []
        self._take_prefills(self.cfg.max_batched_tokens, chunks, reqs)
        if chunks:
            return self._launch(lane, Batch(self.whole_gpu, self.all_layers, tuple(chunks)), reqs)
        decoders = self._decoders()
        if not decoders:
            return None
        return self._decode_batch(lane, self.whole_gpu, decoders, now, self.arrival_horizon(horizon))
