"""``serve()``: THE event loop, shared verbatim by the simulator (``bullet simulate``) and the GpuExecutor."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from .batch import Executor, StepResult
from .policies.base import Scheduler, SchedulingError
from .request import Request


def serve(requests: Iterable[Request], scheduler: Scheduler, executor: Executor, *,
          on_step: Callable[[StepResult], None] | None = None,
          on_finish: Callable[[Request], None] | None = None) -> list[Request]:
    """Feed ``requests`` (by arrival time) to ``scheduler``, run its batches on ``executor`` until every
    request has finished; returns them in finishing order. ``on_step`` sees every launch's result. A request
    the scheduler refuses (longer than the model's context or the whole KV cache, or turned away by admission
    control) is returned at once with ``error`` set, and the others go on."""
    pending = sorted(requests, key=lambda r: (r.arrival, r.id))
    total, nxt = len(pending), 0
    finished: list[Request] = []
    lanes = scheduler.lanes
    release = getattr(executor, "release", None)
    while len(finished) < total:
        now = executor.now()
        while nxt < total and pending[nxt].arrival <= now:
            req = pending[nxt]
            nxt += 1
            try:
                scheduler.add(req)
            except SchedulingError as e:  # this request cannot be served at all: reject it alone
                req.error, req.finish_time = str(e), now
                finished.append(req)
                if on_finish is not None:
                    on_finish(req)
        horizon = pending[nxt].arrival if nxt < total else None
        for lane in lanes:
            if not executor.busy(lane):
                batch = scheduler.schedule(lane, now, horizon)
                if batch is not None:
                    executor.launch(batch)
        if scheduler.rejected:  # admission control turned these away (Request.error says why)
            for req in scheduler.rejected:
                finished.append(req)
                if on_finish is not None:
                    on_finish(req)
            scheduler.rejected.clear()
            continue  # plan again: the queue changed
        if horizon is None and not any(executor.busy(lane) for lane in lanes):
            raise SchedulingError(f"stalled at t={now:.3f}s with {len(scheduler.waiting)} waiting and "
                                  f"{len(scheduler.running)} running requests and nothing schedulable")
        for res in executor.wait(horizon):
            if on_step is not None:
                on_step(res)
            for req in scheduler.on_result(res):
                finished.append(req)
                if release is not None:
                    release(req.id)
                if on_finish is not None:
                    on_finish(req)
    return finished
