"""Scheduling policies, one module each, all on the shared :class:`~bullet.policies.base.Scheduler`."""

from __future__ import annotations

from ..config import GpuSpec, ModelSpec, SchedulerConfig, SloConfig
from ..kvcache import BlockManager
from ..perfmodel import LatencyModel
from .base import Scheduler, SchedulingError


def make_scheduler(cfg: SchedulerConfig, model: ModelSpec, gpu: GpuSpec, kv: BlockManager,
                   latency: LatencyModel, eos_token_id: int | None = None, slo: SloConfig | None = None) -> Scheduler:
    if cfg.policy == "chunked":
        from .chunked import ChunkedPrefill as cls
    elif cfg.policy == "prefill-first":
        from .prefill_first import PrefillFirst as cls
    elif cfg.policy == "static-split":
        from .static_split import StaticSplit as cls
    elif cfg.policy == "bullet":
        from .bullet import Bullet as cls
    else:
        from .naive_concurrent import NaiveConcurrent as cls
    return cls(model, gpu, cfg, kv, latency, eos_token_id, slo)


__all__ = ["Scheduler", "SchedulingError", "make_scheduler"]
