"""``simulate()``: requests + configuration -> finished requests, summary and timeline, on a virtual GPU."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bullet.config import CacheConfig, ConfigError, GpuSpec, ModelSpec, SchedulerConfig, SloConfig
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


ROOT = Path(__file__).resolve().parents[1]
LATENCY_CHOICES = ("auto", "roofline", "fitted")


def shipped_model_path(model: ModelSpec, gpu: GpuSpec) -> Path:
    """Where a fitted model for this model and GPU is shipped: profiles/<gpu>/<model>/model.json."""
    return ROOT / "profiles" / gpu.name / model.name / "model.json"


def latency_model(choice: str, model: ModelSpec, gpu: GpuSpec) -> LatencyModel:
    """``auto``: the shipped fitted model for this model and GPU if there is one, else the roofline;
    ``roofline``; ``fitted``: the shipped one (an error if there is none); anything else: a model JSON path.
    A fitted model for another model or GPU is refused (ConfigError naming both)."""
    from bullet.perfmodel.fitted import FittedModel
    from bullet.perfmodel.roofline import RooflineModel

    shipped = shipped_model_path(model, gpu)
    if choice == "roofline" or (choice == "auto" and not shipped.exists()):
        return RooflineModel(model, gpu)
    if choice in ("auto", "fitted"):
        if not shipped.exists():
            raise ConfigError(f"--latency fitted: no fitted model for {model.name} on {gpu.name} "
                              f"({shipped.relative_to(ROOT)} does not exist; `bullet fit` a profile, or give "
                              f"a model JSON path)")
        return FittedModel.load(shipped, model, gpu)
    return FittedModel.load(choice, model, gpu)


def latency_name(latency: LatencyModel) -> str:
    """How the summary names the latency model: 'roofline', or 'fitted: <path>'."""
    source = getattr(latency, "source", None)
    if source is not None:
        try:
            source = str(Path(source).resolve().relative_to(ROOT))
        except ValueError:
            pass
        return f"fitted: {source}"
    return type(latency).__name__.removesuffix("Model").lower()


def default_latency_model(model: ModelSpec, gpu: GpuSpec) -> LatencyModel:
    return latency_model("auto", model, gpu)


def simulate(requests: Sequence[Request], model: ModelSpec, gpu: GpuSpec, sched: SchedulerConfig,
             cache: CacheConfig | None = None, slo: SloConfig | None = None,
             latency: LatencyModel | None = None,
             on_finish: Callable[[Request], None] | None = None) -> SimulationResult:
    t0 = time.perf_counter()
    cache, slo = cache or CacheConfig(), slo or SloConfig()
    base = latency or default_latency_model(model, gpu)
    latency = CachedLatency(base)
    kv = BlockManager(cache.blocks_for(model, gpu), cache.block_size, cache.prefix_caching)
    scheduler = make_scheduler(sched, model, gpu, kv, latency, slo=slo)
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
    summary.update(policy=sched.policy, model=model.name, gpu=gpu.name, latency_model=latency_name(base), kv_blocks=kv.num_blocks,
                   block_size=kv.block_size, launches=len(timeline.rows), prefix_caching=kv.prefix_caching,
                   prefix_cache_hit_tokens=scheduler.hit_tokens, prefix_cache_query_tokens=scheduler.query_tokens,
                   prefix_cache_hit_rate=(scheduler.hit_tokens / scheduler.query_tokens
                                          if scheduler.query_tokens else 0.0))
    wall = time.perf_counter() - t0
    summary["sim_wall_s"] = wall
    return SimulationResult(done, cols, summary, timeline, wall)
