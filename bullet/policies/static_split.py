"""Prefill and decode run concurrently on a fixed pair of disjoint SM partitions (e.g. 92/40). Prefill
advances ``layers_per_step`` layers per launch (all of them by default); decode steps run on the rest."""

from __future__ import annotations

from ..batch import Batch, Chunk, Lane, Partition
from ..config import ConfigError
from ..perfmodel import Work
from ..perfmodel.base import batch_work
from ..request import Request
from .base import LayerSliced


class StaticSplit(LayerSliced):
    __slots__ = ("decode_part", "prefill_part", "prefill_until", "prefill_work")
    lanes: tuple[Lane, ...] = ("prefill", "decode")  # prefill is planned first: decode sizes to it

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.prefill_part, self.decode_part = self._partitions()
        self.prefill_until = 0.0  # predicted end of the prefill launch in flight
        self.prefill_work: Work | None = None  # ... and its Work (decode's co-runner while it runs)

    def _partitions(self) -> tuple[Partition, Partition]:
        p, gpu = self.cfg.prefill_sms, self.gpu
        menu = gpu.prefill_sizes[:-1]  # a split leaves decode the rest, so not the whole GPU
        if p not in menu:
            raise ConfigError(f"prefill_sms={p} is not a prefill size of {gpu.name}'s partition menu: "
                              f"{gpu.sm_remainder} + a multiple of {gpu.sm_granule}, from {menu[0]} to {menu[-1]}")
        return Partition("prefill", p), Partition("decode", gpu.num_sms - p)

    def schedule(self, lane: Lane, now: float, horizon: float | None) -> Batch | None:
        return self._schedule_prefill(now) if lane == "prefill" else self._schedule_decode(now, horizon)

    def _schedule_prefill(self, now: float) -> Batch | None:
        if self.job is None:
            if not self.waiting and not self.partial:
                return None  # nothing to prefill (the usual case when the prefill lane frees up)
            chunks: list[Chunk] = []
            reqs: list[Request] = []
            self._take_prefills(self.cfg.max_batched_tokens, chunks, reqs)
            if not chunks:
                return None
            self.job = (tuple(chunks), reqs, 0)
        chunks, reqs, first = self.job
        step = self.cfg.prefill_layers(self.model.num_layers)
        stop = first + step
        if stop > self.model.num_layers:  # noqa: PLR1730 -- min(): see Scheduler._stretch
            stop = self.model.num_layers
        batch = Batch(self.prefill_part, range(first, stop), chunks)
        decode = self.inflight.get("decode")
        co = batch_work(self.latency, decode[0], self.model.num_layers) if decode else None
        work = self.prefill_work = batch_work(self.latency, batch, self.model.num_layers)
        self.prefill_until = now + float(self.latency.predict(work, self.prefill_part.num_sms, co,
                                                              self.decode_part.num_sms))
        return self._launch("prefill", batch, reqs)

    def _schedule_decode(self, now: float, horizon: float | None) -> Batch | None:
        decoders = self._decoders()
        if not decoders:
            return None
        if "prefill" in self.inflight:  # new decoders join when the prefill launch in flight ends
            until, co = self.prefill_until, self.prefill_work
        else:
            until, co = self.arrival_horizon(horizon), None
        return self._decode_batch("decode", self.decode_part, decoders, now, until, co,
                                  self.prefill_part.num_sms)
