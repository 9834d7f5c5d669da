"""``simulate()``: requests + configuration -> finished requests, summary and timeline, on a virtual GPU."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from bullet.config import CacheConfig, GpuSpec, ModelSpec, SchedulerConfig, SloConfig
from bullet.engine import serve
from bullet.kvcache import BlockManager
from bullet.metrics import Timeline, request_columns, summarize
from bullet.perfmodel import LatencyModel
from bullet.perfmodel.base import CachedLatency
from bullet.policies import make_scheduler
from bullet.request import Request

from .executor import SimExecutor


@dataclass
class SimulationResult:
    requests: list[Request]
    columns: dict[str, np.ndarray]
    summary: dict
    timeline: Timeline
    wall_s: float


def default_latency_model(model: ModelSpec, gpu: GpuSpec) -> LatencyModel:
    from bullet.perfmodel.roofline import RooflineModel

    return RooflineModel(model, gpu)


def simulate(requests: Sequence[Request], model: ModelSpec, gpu: GpuSpec, sched: SchedulerConfig,
             cache: CacheConfig | None = None, slo: SloConfig | None = None,
             latency: LatencyModel | None = None,
             on_finish: Callable[[Request], None] | None = None) -> SimulationResult:
    t0 = time.perf_counter()
    cache, slo = cache or CacheConfig(), slo or SloConfig()
    latency = CachedLatency(latency or default_latency_model(model, gpu))
    kv = BlockManager(cache.blocks_for(model, gpu), cache.block_size, cache.prefix_caching)
    scheduler = make_scheduler(sched, model, gpu, kv, latency)
    timeline = Timeline()
    gc_was_on = gc.isenabled()
    gc.disable()  # the loop allocates many small acyclic objects: collection passes cost time and free nothing
    try:
        done = serve(requests, scheduler, SimExecutor(latency, model.num_layers, gpu), on_step=timeline.on_step,
                     on_finish=on_finish)
    finally:
        if gc_was_on:
            gc.enable()
    cols = request_columns(done, slo)
    summary = summarize(done, slo, timeline.busy, cols)
    summary.update(policy=sched.policy, model=model.name, gpu=gpu.name, kv_blocks=kv.num_blocks,
                   block_size=kv.block_size, launches=len(timeline.rows), prefix_caching=kv.prefix_caching,
                   prefix_cache_hit_tokens=scheduler.hit_tokens, prefix_cache_query_tokens=scheduler.query_tokens,
                   prefix_cache_hit_rate=(scheduler.hit_tokens / scheduler.query_tokens
                                          if scheduler.query_tokens else 0.0))
    wall = time.perf_counter() - t0
    summary["sim_wall_s"] = wall
    return SimulationResult(done, cols, summary, timeline, wall)
