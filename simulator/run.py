"""``simulate()``: requests + configuration -> finished requests, summary and timeline, on a virtual GPU."""

from __future__ import annotations

import gc
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from bullet import __version__
from bullet.batch import Batch, Lane, StepResult
from bullet.config import (
    PROFILES_DIR,
    CacheConfig,
    ConfigError,
    GpuSpec,
    ModelSpec,
    SchedulerConfig,
    SloConfig,
)
from bullet.engine import serve
from bullet.kvcache import BlockManager
from bullet.metrics import PERCENTILES, Timeline, request_columns, summarize
from bullet.perfmodel import LatencyModel
from bullet.perfmodel.base import CachedLatency
from bullet.policies import Scheduler, make_scheduler
from bullet.policies.base import SchedulingError
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
    return PROFILES_DIR / gpu.name / model.name / "model.json"


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


def fresh_copies(requests: Sequence[Request]) -> list[Request]:
    """New requests with what a trace says of each one (id, arrival, lengths, prompt content, sampling) and no
    progress: what ``simulate`` runs, so that its inputs stay untouched and one list can be simulated again
    and again. About 0.5 us a request (the simulation costs about 150 us a request)."""
    return [Request(r.id, r.arrival, r.prompt_len, r.max_new_tokens, r.prompt_ids, r.hash_ids, r.hash_block,
                    r.sampling) for r in requests]


class ClientGate:
    """``vllm bench serve --max-concurrency N`` in front of a scheduler: the client keeps at most ``N`` requests
    in the server; one arriving while ``N`` are in flight waits at the client (in arrival order) and is sent when
    one finishes or is rejected. As in ``vllm bench serve``, a request's latencies count from when it is sent:
    its ``arrival`` becomes the send time. Stands in for the scheduler in ``serve()``: ``add``, ``schedule`` and
    ``on_result`` pass through it; every other attribute is the scheduler's."""

    def __init__(self, inner: Scheduler, limit: int) -> None:
        if limit < 1:
            raise ConfigError(f"max_concurrency must be >= 1, got {limit}")
        self.inner, self.limit = inner, limit
        self.lanes = inner.lanes
        self.held: deque[Request] = deque()  # arrived, not yet sent
        self.inside = 0  # sent, neither finished nor rejected

    def __getattr__(self, name: str):  # everything else the engine reads is the scheduler's
        return getattr(self.inner, name)

    def add(self, req: Request) -> None:
        if self.inside >= self.limit:
            self.held.append(req)
        else:
            self._send(req)

    def schedule(self, lane: Lane, now: float, horizon: float | None) -> Batch | None:
        before = len(self.inner.rejected)
        batch = self.inner.schedule(lane, now, horizon)
        if len(self.inner.rejected) > before:  # admission control turned some away: their seats are free
            self.inside -= len(self.inner.rejected) - before
            self._release(now)
        return batch

    def on_result(self, res: StepResult) -> list[Request]:
        done = self.inner.on_result(res)
        if done:
            self.inside -= len(done)
            self._release(res.end)
        return done

    def _send(self, req: Request) -> None:
        before = len(self.inner.rejected)
        self.inner.add(req)  # a SchedulingError propagates: serve() rejects the request, no seat taken
        self.inside += 1 - (len(self.inner.rejected) - before)

    def _release(self, now: float) -> None:
        while self.held and self.inside < self.limit:
            req = self.held.popleft()
            req.arrival = now
            try:
                self._send(req)
            except SchedulingError as e:  # serve() collects it with the admission-control rejections
                req.error, req.finish_time = str(e), now
                self.inner.rejected.append(req)


def simulate(requests: Sequence[Request], model: ModelSpec, gpu: GpuSpec, sched: SchedulerConfig,
             cache: CacheConfig | None = None, slo: SloConfig | None = None,
             latency: LatencyModel | None = None,
             on_finish: Callable[[Request], None] | None = None, *, max_concurrency: int | None = None,
             percentiles: Sequence[float] = PERCENTILES, token_times: bool = False,
             watch: Callable[[Scheduler, list[Request]], None] | None = None,
             timeline: bool = True, live_window: float | None = None,
             host_gap: tuple[float, float] | None = None) -> SimulationResult:
    """Serve ``requests`` on a virtual GPU. The requests are not changed: the simulation runs on fresh copies
    (:func:`fresh_copies`, whatever progress the inputs record is ignored), which ``SimulationResult.requests``
    returns, finished, in finishing order; ``on_finish`` sees the copies too. ``max_concurrency``: at most
    that many requests in the server at once (:class:`ClientGate`). ``percentiles``: those the summary
    reports besides the mean. ``token_times``: keep every output token's time on its request
    (``Request.token_times``); without it only the first and last are kept and the summary's inter-token
    latencies come from the pooled gaps (:class:`~bullet.metrics.TokenGaps`), so memory does not grow with
    output tokens. ``watch(scheduler, requests)`` is called once before serving with the scheduler and the
    copies it serves, for a caller that follows their progress (``bullet whatif``'s early stop).
    ``timeline=False``: no per-launch rows (the summary's launch count and busy times are kept).
    ``live_window`` (seconds): plan as ``bullet run``'s engine thread does with that fuse window, not knowing
    the next arrival (``serve``'s ``live_window``): to compare with a live server. ``host_gap`` (seconds
    fixed, seconds per request): the engine's host time before each launch starts (:class:`SimExecutor`);
    None: the latency model's own (a fitted model's ``host_gap``, measured by ``bullet profile``), else none.
    The summary
    records the configuration (scheduler, cache, SLOs, model, GPU,
    latency model, bullet version)."""
    t0 = time.perf_counter()
    requests = fresh_copies(requests)
    cache, slo = cache or CacheConfig(), slo or SloConfig()
    base = latency or default_latency_model(model, gpu)
    latency = CachedLatency(base)
    gap = host_gap if host_gap is not None else (getattr(base, "host_gap", None) or (0.0, 0.0))
    kv = BlockManager(cache.blocks_for(model, gpu), cache.block_size, cache.prefix_caching)
    scheduler = make_scheduler(sched, model, gpu, kv, latency, slo=slo)
    scheduler.keep_token_times(token_times)
    if watch is not None:
        watch(scheduler, requests)
    line = Timeline(lambda: (len(scheduler.waiting), len(scheduler.running), kv.num_blocks - kv.num_free),
                        kv.num_blocks, keep=timeline)
    front = scheduler if max_concurrency is None else ClientGate(scheduler, max_concurrency)
    gc_was_on = gc.isenabled()
    gc.disable()  # the loop allocates many small acyclic objects: collection passes cost time and free nothing
    try:
        done = serve(requests, front, SimExecutor(latency, model.num_layers, gpu, gap), on_step=line.on_step,
                     on_finish=on_finish, live_window=live_window)
    finally:
        if gc_was_on:
            gc.enable()
    cols = request_columns(done, slo)
    summary = summarize(done, slo, line.busy, cols, percentiles, scheduler.gaps)
    summary.update(policy=sched.policy, model=model.name, gpu=gpu.name, latency_model=latency_name(base),
                   kv_blocks=kv.num_blocks, block_size=kv.block_size, launches=line.launches,
                   prefix_caching=kv.prefix_caching, prefix_cache_hit_tokens=scheduler.hit_tokens,
                   prefix_cache_query_tokens=scheduler.query_tokens,
                   prefix_cache_hit_rate=(scheduler.hit_tokens / scheduler.query_tokens
                                          if scheduler.query_tokens else 0.0),
                   **scheduler.counters())
    summary["config"] = {"scheduler": _plain(asdict(sched)), "cache": asdict(cache), "tp": model.tp,
                         "max_concurrency": max_concurrency, "percentiles": list(percentiles),
                         "live_window_s": live_window, "host_gap_s": list(gap),
                         "bullet_version": __version__}
    wall = time.perf_counter() - t0
    summary["sim_wall_s"] = wall
    return SimulationResult(done, cols, summary, line, wall)


def _plain(d: dict) -> dict:
    """Tuples as lists: the summary goes to JSON."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}
