"""THE event loop, shared by trace replay (``bullet simulate``, tests) and live serving (``bullet run``).

:class:`Engine` drives one scheduler on one executor: ``add`` hands it a request, ``abort`` takes one back,
``step(until)`` plans every idle lane, launches, waits for results until ``until`` and returns what changed
for each request (:class:`Update`). :func:`serve` wraps it for a closed list of requests with known arrival
times; ``bullet.server`` drives it from its own thread for requests arriving over HTTP.

Rules that hold for both:
- a request the scheduler refuses at ``add`` (too long for the model or the whole KV cache, turned away by
  admission control, bad parameters) ends at once with ``Request.error`` set; the others go on;
- requests that admission control rejects while planning (``Scheduler.rejected``) end the same way, right
  after planning, and the step returns without waiting (the queue changed: plan again);
- an abort of a request inside a launch in flight takes effect when that launch returns (its KV is freed
  then); otherwise at once;
- every request added ends exactly once: one :class:`Update` with ``finished`` set.

``SchedulerConfig.async_scheduling`` (single-lane policies): shortly before a lane's launch N is predicted to end
(:func:`ahead_lead`), launch N+1 is planned from N's expected outcome and queued behind it
(``Scheduler.plan_ahead``), so the host's time between launches (reading tokens back, the policy, preparing
inputs) runs while the GPU works; N's tokens reach the requests before N+2 is planned. A request that arrives
in that lead joins at N+2. Where the next arrival is known (trace replay) and comes before N's end, N+1 is
planned when it has come (with it), or when N returns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .batch import Batch, Executor, StepResult
from .policies.base import Scheduler, SchedulingError
from .request import Request

ABORTED = "aborted"
_AT_UNTIL = object()  # Engine.step's default horizon: plan to ``until``
AHEAD_LEAD_S, AHEAD_LEAD_FRAC = 0.002, 0.1  # async scheduling: see ahead_lead


def ahead_lead(duration: float) -> float:
    """How long before a launch's predicted end the next one on its lane is planned: the host's time for it (2
    ms covers the H200's 0.3-1 ms) or, for longer launches, a tenth of the launch, since a launch may end that
    much sooner than predicted (the H200 ran the shipped model's launches at 0.93-1.02x, bench/RESULTS.md) and
    its lane would then idle through the host time after all. The price, live: a request that arrives in the
    lead joins one launch later (trace replay knows its arrivals and plans around them)."""
    return max(AHEAD_LEAD_S, AHEAD_LEAD_FRAC * duration)


@dataclass(frozen=True, slots=True, init=False)
class Update:
    """What one step changed for one request. ``token_ids``/``token_times``: tokens sampled since the last
    update (a streaming engine only; the simulator has no ids, so there only the times). ``reason`` once
    finished: "stop" (its end-of-sequence token), "length" (max_new_tokens), "abort", or "error"
    (``request.error`` says why)."""

    request: Request
    token_ids: tuple[int, ...] = ()
    token_times: tuple[float, ...] = ()
    finished: bool = False
    reason: str | None = None

    def __init__(self, request: Request, token_ids: tuple[int, ...] = (), token_times: tuple[float, ...] = (),
                 finished: bool = False, reason: str | None = None) -> None:
        # one per request a trace replay ends: the fields set through their slots (the generated __init__ of a
        # frozen dataclass goes through object.__setattr__ per field, ~3x the cost)
        _SET_REQUEST(self, request)
        _SET_TOKEN_IDS(self, token_ids)
        _SET_TOKEN_TIMES(self, token_times)
        _SET_FINISHED(self, finished)
        _SET_REASON(self, reason)


_SET_REQUEST, _SET_TOKEN_IDS, _SET_TOKEN_TIMES, _SET_FINISHED, _SET_REASON = (
    getattr(Update, f).__set__ for f in ("request", "token_ids", "token_times", "finished", "reason"))


class Engine:
    """One scheduler on one executor. Not thread-safe: one thread calls ``add``, ``abort`` and ``step``.

    ``stream``: report every request's new tokens after each launch (live serving); otherwise only finished
    requests are reported (trace replay: no per-token work on the simulator's hot path). ``on_launch`` sees
    every batch launched, ``on_step`` every launch's result, ``on_finish`` every request that ends.

    ``live_window`` (seconds): plan as a live engine must, not knowing the next arrival: a window ahead of
    now, or to now while an added request has no first token yet and the policy runs on the whole GPU (one
    launch may both sample that token and fuse decode steps after it, holding the token back until it ends;
    a split policy's first tokens come from prefill launches, which never fuse). None: plan to ``until``."""

    def __init__(self, scheduler: Scheduler, executor: Executor, *, stream: bool = False,
                 on_launch: Callable[[Batch], None] | None = None,
                 on_step: Callable[[StepResult], None] | None = None,
                 on_finish: Callable[[Request], None] | None = None,
                 live_window: float | None = None) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.lanes = scheduler.lanes  # (a class attribute of the scheduler: an instance's is the cheaper read)
        self.ahead = scheduler.cfg.async_scheduling
        if self.ahead:
            scheduler.plan_ahead()
        self._ends: dict[str, tuple[float, float]] = {}  # async: each lane's newest launch's predicted start, end
        self.stream = stream
        self.live_window = live_window
        self._no_first: dict[int, Request] | None = {} if "all" in scheduler.lanes else None
        self.on_launch, self.on_step, self.on_finish = on_launch, on_step, on_finish
        self.held: dict[int, Request] = {}  # added and not finished, by id
        self.stalled = False  # the last step found requests held, nothing in flight and nothing to launch
        self._sent: dict[int, int] = {}  # stream: outputs already reported, by request id
        self._aborting: dict[int, str] = {}  # abort asked (and why) while the request was inside a launch
        self._out: list[Update] = []

    @property
    def idle(self) -> bool:
        """Nothing held and nothing in flight."""
        return not self.held and not any(self.executor.busy(lane) for lane in self.scheduler.lanes)

    def add(self, req: Request) -> bool:
        """Hand ``req`` to the scheduler; False if it was refused (it then ends at once with ``error``
        set, reported by the next ``step`` or ``flush``)."""
        if req.id in self.held:
            return self._refuse(req, f"request id {req.id} is already being served")
        try:
            self.scheduler.add(req)
        except (SchedulingError, ValueError) as e:  # this request cannot be served at all: reject it alone
            return self._refuse(req, str(e))
        self.held[req.id] = req
        if self.live_window is not None and self._no_first is not None:
            self._no_first[req.id] = req
        return True

    def _horizon(self, now: float) -> float:
        """The live planning horizon (see the class): now + live_window, or now while a first token is due."""
        waiting = self._no_first
        if waiting:
            for rid in [rid for rid, r in waiting.items() if r.first_token_time is not None
                        or rid not in self.held]:
                del waiting[rid]
            if waiting:
                return now
        return now + self.live_window

    def _refuse(self, req: Request, why: str) -> bool:
        """End a request the engine never held (its id may be another's: touch nothing of that one)."""
        req.error, req.finish_time = why, self.executor.now()
        self._out.append(Update(req, finished=True, reason="error"))
        if self.on_finish is not None:
            self.on_finish(req)
        return False

    def abort(self, req_id: int, why: str = ABORTED) -> bool:
        """Stop request ``req_id``: it ends with reason "abort" and ``error = why``, and its KV is freed, now
        or when the launch it is inside returns. False if the engine does not hold it (it finished already,
        or never came)."""
        req = self.held.get(req_id)
        if req is None:
            return False
        if self.scheduler.holds(req_id):  # inside a launch (or a layer-sliced prefill under way)
            self._aborting[req_id] = why
            self.scheduler.hold_back(req_id)
        else:
            self._drop(req, why)
        return True

    def _drop(self, req: Request, why: str) -> None:
        now = self.executor.now()
        self.scheduler.abort(req.id, now)
        req.error, req.finish_time = why, now
        self._end(req, "abort")

    def fail_all(self, why: str) -> list[Update]:
        """End every held request with ``error = why`` without asking the scheduler (its state is not to be
        trusted any more: the executor or a policy raised). Returns every update not yet reported."""
        now = self.executor.now()
        for req in list(self.held.values()):
            req.error, req.finish_time = why, now
            self._end(req, "error")
        return self.flush()

    def flush(self) -> list[Update]:
        """Updates produced since the last step (requests refused at ``add``, aborts applied at once)."""
        out, self._out = self._out, []
        return out

    def step(self, until: float | None, horizon: float | None | object = _AT_UNTIL) -> list[Update]:
        """Plan every idle lane, launch, then wait for results until ``until`` (the next known arrival, or
        when a live server wants control back; None: until a launch returns). ``horizon`` is what the policy
        plans with: the next time something could change its plan, where fused decode stretches end (default:
        ``until``, or the live horizon with ``live_window``). Returns the updates since the last call. With ``until`` None, nothing in flight and
        requests held, nothing could ever move: SchedulingError (a stall)."""
        sched, ex, lanes = self.scheduler, self.executor, self.lanes
        now = ex.now()
        self.stalled = False
        if horizon is _AT_UNTIL:
            horizon = until if self.live_window is None else self._horizon(now)
        if not self._plan(now, horizon):
            return self.flush()  # plan again: the queue changed
        if until is None or self.stream:  # (serve() with a horizon never asks: kept off its hot path)
            self.stalled = bool(self.held) and not any(ex.busy(lane) for lane in lanes)
        if self.stalled and until is None:
            raise SchedulingError(f"stalled at t={now:.3f}s with {len(sched.waiting)} waiting and "
                                  f"{len(sched.running)} running requests and nothing schedulable")
        wake = until
        if self.ahead:  # wake up to plan a lane's next launch ahead of its end
            for lane in lanes:
                due = self._ahead_due(lane, horizon)
                if due is not None and due > ex.now() and (wake is None or due < wake):
                    wake = due
        for res in ex.wait(wake):
            if self.on_step is not None:
                self.on_step(res)
            if self.ahead and ex.busy(lane := res.batch.partition.lane):  # the launch queued behind it started
                start, end = self._ends[lane]  # at its end: re-anchor its predicted span there
                self._ends[lane] = res.end, res.end + (end - start)
            done = sched.on_result(res)
            if self.stream:
                self._report(res, done)
            for req in done:
                self._end(req, self._reason(req))
            if self._aborting:
                for rid in [r for r in self._aborting if not sched.holds(r)]:
                    why = self._aborting.pop(rid)
                    req = self.held.get(rid)
                    if req is not None:
                        self._drop(req, why)
        out, self._out = self._out, []  # (flush(), inline: once a step)
        return out

    def launch_idle(self) -> None:
        """Plan and launch every idle lane now, with the live horizon (``live_window``), without waiting: a live
        engine calls it as soon as results are in, before handing updates over (the server's event loop then
        takes its turn with the GIL while the GPU works, not between one launch and the next). The next
        ``step`` finds those lanes busy and goes on to wait."""
        now = self.executor.now()
        self._plan(now, None if self.live_window is None else self._horizon(now))

    def _plan(self, now: float, plan_to: float | None) -> bool:
        """Plan every idle lane to ``plan_to`` and launch; False if admission control turned requests away
        (they are ended; the queue changed)."""
        sched, ex = self.scheduler, self.executor
        for lane in self.lanes:
            if not ex.busy(lane):
                batch = sched.schedule(lane, now, plan_to)
                if batch is not None:
                    self._launch(lane, batch, now)
            if self.ahead:
                due = self._ahead_due(lane, plan_to)
                if due is not None and now >= due:  # plan N+1 from N's expected end, queued behind N
                    start = max(now, self._ends[lane][1])
                    batch = sched.schedule(lane, start, plan_to if self.live_window is None else
                                           self._horizon(start))
                    if batch is not None:
                        sched.ahead.planned += 1
                    self._launch(lane, batch, start)
        if sched.rejected:  # admission control turned these away (Request.error says why)
            for req in sched.rejected:
                self.held.pop(req.id, None)
                self._end(req, "error")
            sched.rejected.clear()
            return False
        return True

    def _launch(self, lane: str, batch: Batch | None, start: float) -> None:
        """Launch ``batch`` (if any) on its lane; under async scheduling note its predicted span from ``start``."""
        if batch is None:
            return
        self.executor.launch(batch)
        if self.on_launch is not None:
            self.on_launch(batch)
        if self.ahead:
            self._ends[lane] = start, self.scheduler.predicted_end(batch, start)

    def _ahead_due(self, lane: str, plan_to: float | None) -> float | None:
        """Async scheduling: when to plan ``lane``'s next launch ahead (None: not now, nothing to plan ahead
        of, one is queued already, or a known arrival comes before the launch in flight ends)."""
        ex = self.executor
        if not ex.busy(lane) or ex.queued(lane):
            return None
        span = self._ends.get(lane)
        if span is None or (self.live_window is None and plan_to is not None and plan_to <= span[1]):
            return None
        return span[1] - ahead_lead(span[1] - span[0])

    def _report(self, res: StepResult, done: list[Request]) -> None:
        """Stream mode: an update with the new tokens of every request that sampled in ``res``; a request
        finished by it gets its last tokens in its finishing update."""
        ending = {r.id for r in done}
        for c in res.batch.chunks:
            req = self.held.get(c.req_id)
            if not c.sample or req is None or c.req_id in ending:
                continue
            new = self._new_tokens(req)
            if new is not None:
                self._out.append(Update(req, *new))

    def _new_tokens(self, req: Request) -> tuple[tuple[int, ...], tuple[float, ...]] | None:
        sent = self._sent.get(req.id, 0)
        n = len(req.token_times)
        if n == sent:
            return None
        self._sent[req.id] = n
        return tuple(req.output_ids[sent:]), tuple(req.token_times[sent:n])

    def _reason(self, req: Request) -> str:
        eos = self.scheduler.eos_token_id
        if (eos is not None and req.output_ids and req.output_ids[-1] == eos
                and not req.sampling.ignore_eos):
            return "stop"
        return "length"

    def _end(self, req: Request, reason: str) -> None:
        self.held.pop(req.id, None)
        self._aborting.pop(req.id, None)
        new = self._new_tokens(req) if self.stream else None
        self._sent.pop(req.id, None)
        self.executor.release(req.id)
        self._out.append(Update(req, *(new or ((), ())), finished=True, reason=reason))
        if self.on_finish is not None:
            self.on_finish(req)


def serve(requests: Iterable[Request], scheduler: Scheduler, executor: Executor, *,
          on_step: Callable[[StepResult], None] | None = None,
          on_finish: Callable[[Request], None] | None = None,
          live_window: float | None = None) -> list[Request]:
    """Feed ``requests`` (by arrival time) to ``scheduler``, run its batches on ``executor`` until every
    request has finished; returns them in finishing order. ``on_step`` sees every launch's result. A request
    the scheduler refuses (longer than the model's context or the whole KV cache, or turned away by admission
    control) is returned at once with ``error`` set, and the others go on.

    The policy plans to the next arrival, which a trace knows. ``live_window`` (seconds) plans as ``bullet
    run``'s engine thread does instead, not knowing when the next request comes (:class:`Engine`'s
    ``live_window``). Arrivals are still taken the moment they come."""
    pending = sorted(requests, key=lambda r: (r.arrival, r.id))
    total, nxt = len(pending), 0
    finished: list[Request] = []
    engine = Engine(scheduler, executor, on_step=on_step, on_finish=on_finish, live_window=live_window)
    while len(finished) < total:
        now = executor.now()
        while nxt < total and pending[nxt].arrival <= now:
            engine.add(pending[nxt])
            nxt += 1
        for u in engine.step(pending[nxt].arrival if nxt < total else None):
            finished.append(u.request)  # not streaming: every update is a request that ended
    while not engine.idle:  # async scheduling: a launch queued with requests that ended (EOS) before it ran
        engine.step(None)
    return finished
