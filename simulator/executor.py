"""SimExecutor: the Executor protocol on a virtual clock. A launch must ask for a partition of the GPU's nested
menu that is disjoint from the other lane's (``check_launch``: the same rule as the GpuExecutor's). A launch ends at ``now + host gap +
predicted time`` (the host gap: the engine's own time before the launch's work starts, ``host_gap``; none by default), where
the prediction accounts for what co-runs on the other lane; when the co-runner changes mid-flight, the
remaining work is re-timed at the new rate (progress is conserved), so contention is modelled both ways.

A launch made while its lane is busy (async scheduling) is queued behind the one in flight and starts when
that one ends, with no host gap (the engine's host time ran while the GPU worked); one may wait per lane.

The clock is a heap of launch ends, at most one live entry per lane (a re-timed launch leaves its old entry
behind, skipped when it comes up). It keeps simpy's arithmetic and order -- an event at ``now + (t - now)``,
ties in the order scheduled, ``wait(until)`` stopping before anything due at ``until`` -- which this executor
used before; simpy's generality cost about a tenth of a simulation's time.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from heapq import heappop, heappush

import numpy as np

from bullet.batch import Batch, Lane, StepResult, check_launch
from bullet.config import GpuSpec
from bullet.perfmodel import LatencyModel, Work
from bullet.perfmodel.base import CachedLatency, batch_work, step_ends


def interp(xs: list[float], ps: list[float], ts: list[float]) -> list[float]:
    """``np.interp(xs, ps, ts).tolist()`` for non-decreasing ``xs`` and ``ps`` and finite values, in plain floats:
    numpy's operations (its C loop: the last ``j`` with ``ps[j] <= x``, ``ts[j]`` where ``ps[j] == x`` or ``j`` is
    the last, else ``(ts[j+1] - ts[j]) / (ps[j+1] - ps[j]) * (x - ps[j]) + ts[j]``, the slope the same number for
    every ``x`` of a segment), so the same numbers. A fused launch re-timed on the way maps its ~10 step ends
    through it: np.interp's wrapper and array conversions cost more than the loop there (bench/RESULTS.md, tenth
    speed pass); with ``xs`` in order each segment's are found by one bisection (thirteenth)."""
    last = len(ps) - 1
    n, i = len(xs), bisect_left(xs, ps[0])  # those below the first knot take its value
    out = [ts[0]] * i
    for j in range(last):
        p0, p1 = ps[j], ps[j + 1]
        k = bisect_left(xs, p1, i)  # xs[i:k] lie in [p0, p1): j is the last knot at or below each
        if k > i:
            t0 = ts[j]
            slope = (ts[j + 1] - t0) / (p1 - p0)
            out += [t0 if x == p0 else slope * (x - p0) + t0 for x in xs[i:k]]
            i = k
    out += [ts[last]] * (n - i)  # at or past the last knot
    return out


_new_result = tuple.__new__  # StepResult(...) without its generated __new__ (one per launch)


@dataclass(slots=True, eq=False)
class _Flight:
    batch: Batch
    work: Work
    sms: int  # the batch's partition size
    steps: int  # the batch's fused steps
    start: float
    cum: list[float] | np.ndarray | None = None  # a fused launch: each step's end, seconds after start at the
    # first rate (a list for a short stretch: CachedLatency.step_ends)
    duration: float = 0.0  # at the current rate
    progress: float = 0.0  # fraction done at ``mark``
    mark: float = 0.0
    end: float = 0.0
    token: int = 0  # the live clock entry's number (0: none yet)
    knots: list[tuple[float, float]] | None = None  # (time, progress) where the rate changed (None: never)


class SimExecutor:
    def __init__(self, latency: LatencyModel, num_layers: int, gpu: GpuSpec,
                 host_gap: tuple[float, float] = (0.0, 0.0)) -> None:
        """``host_gap`` (seconds fixed, seconds per request): the engine's host time before a launch starts
        on the GPU (results read back, planning, inputs prepared: ``a + b * chunks``); the launch's lane is
        taken from the launch call, its work starts that much later. (0, 0): launches start at once."""
        if min(host_gap) < 0:
            raise ValueError(f"host_gap must be >= 0, got {host_gap}")
        self.host_gap = host_gap
        self._now = 0.0
        self._events: list[tuple[float, int, Lane]] = []  # (due, token, lane): tokens rise, so ties go in order
        self.num_sms = gpu.num_sms
        self.sizes = {"prefill": frozenset(gpu.prefill_sizes), "decode": frozenset(gpu.decode_sizes),
                      "all": frozenset((gpu.num_sms,))}
        self.latency = latency
        if isinstance(latency, CachedLatency):  # (what base.step_ends / batch_work call: asked directly)
            self._step_ends, self._work_of = latency.step_ends, latency.work_of
        else:
            self._step_ends = lambda *a: step_ends(latency, *a)
            self._work_of = lambda b, n: batch_work(latency, b, n)
        self.num_layers = num_layers
        self._flights: dict[Lane, _Flight] = {}
        self._queued: dict[Lane, Batch] = {}  # a launch waiting behind the lane's flight (async scheduling)
        self._done: list[StepResult] = []
        self._tokens = 0
        self._pending: float | None = None  # a launch ended then: the other lane's re-time, not yet done
        self._legal: set[tuple] = set()  # (lane, SMs, (SMs, lane) of each launch in flight) found legal

    def now(self) -> float:
        return self._now

    def busy(self, lane: Lane) -> bool:
        return lane in self._flights

    def queued(self, lane: Lane) -> bool:
        """A launch waits behind the one in flight on ``lane``."""
        return lane in self._queued

    def release(self, req_id: int) -> None:
        """Nothing to forget: the simulator keeps no per-request state."""

    def launch(self, batch: Batch) -> None:
        lane = batch.partition.lane
        if lane in self._flights:
            if lane in self._queued:
                raise RuntimeError(f"lane {lane!r} already has a batch in flight and one queued")
            self._queued[lane] = batch
            return
        self._start(batch, self._now, True)

    def _start(self, batch: Batch, now: float, gap: bool) -> None:
        part = batch.partition
        lane, flights = part.lane, self._flights
        if not flights:
            key = (lane, part.num_sms)
        elif len(flights) == 1:  # (the usual case of a two-lane policy: the key below, without a comprehension)
            [(other_lane, other)] = flights.items()
            key = (lane, part.num_sms, (other.sms, other_lane))
        else:
            key = (lane, part.num_sms, *[(f.sms, other_lane) for other_lane, f in flights.items()])
        if key not in self._legal:  # the rule depends on the lanes and sizes alone: checked once per combination
            check_launch(batch, [f.batch for f in flights.values()], self.sizes, self.num_sms)
            self._legal.add(key)
        work = self._work_of(batch, self.num_layers)
        a, b = self.host_gap
        begin = now + (a + b * len(batch.chunks)) if gap and (a or b) else now
        f = flights[lane] = _Flight(batch, work, part.num_sms, batch.steps, begin, mark=begin)
        self._pending = None  # (pending since now: this re-time covers it, see _finish)
        if len(flights) == 1:
            self._time(lane, f, now, None, 0)
        else:  # the other lane's rate changes too
            for other_lane, other in flights.items():
                if other is not f:
                    self._time(other_lane, other, now, work, f.sms)
                    self._time(lane, f, now, other.work, other.sms)

    def _retime(self, now: float) -> None:
        """(Re)compute every flight's end for the current set of co-runners."""
        flights = list(self._flights.items())
        if len(flights) == 1:
            lane, f = flights[0]
            self._time(lane, f, now, None, 0)
        else:
            for (lane, f), (_, other) in zip(flights, flights[::-1]):
                self._time(lane, f, now, other.work, other.sms)

    def _time(self, lane: Lane, f: _Flight, now: float, co: Work | None, co_sms: int) -> None:
        """(Re)compute ``f``'s end next to ``co`` (on ``co_sms`` SMs; None: alone) from ``now`` on."""
        if f.steps > 1:
            cum = self._step_ends(f.work, f.steps, f.sms, co, co_sms)
            duration = float(cum[-1])
            if f.cum is None:
                f.cum = cum
        else:
            duration = float(self.latency.predict(f.work, f.sms, co, co_sms))
        if now < f.start:  # still in its host gap: no work done yet, it starts at the new rate
            f.duration = duration
            end = f.start + duration
            if end != f.end or not f.token:
                self._tokens += 1
                f.end, f.token = end, self._tokens
                heappush(self._events, (end, f.token, lane))
            return
        self._run_at(lane, f, now, duration)

    def _run_at(self, lane: Lane, f: _Flight, now: float, duration: float) -> None:
        """A running flight goes on from ``now`` at the rate of ``duration`` for all its work: the progress
        made so far is kept, its end moved."""
        if f.duration:  # already running: conserve progress, change rate
            progress = f.progress + (now - f.mark) / f.duration
            if progress > 1.0:  # noqa: PLR1730 -- min() costs a builtin's argument parsing
                progress = 1.0
            f.progress = progress
            if f.knots is None:
                f.knots = [(now, progress)]
            else:
                f.knots.append((now, progress))
        f.mark, f.duration = now, duration
        end = now + (1.0 - f.progress) * duration
        if end != f.end or not f.token:
            self._tokens += 1
            f.end, f.token = end, self._tokens
            heappush(self._events, (now + (end - now), f.token, lane))  # the sum simpy's timeout makes

    def _finish(self, lane: Lane, token: int) -> None:
        f = self._flights.get(lane)
        if f is None or f.token != token:
            return  # re-timed since: a stale entry
        del self._flights[lane]
        end = self._now
        if f.cum is None:
            ends = (end,)
        elif f.knots is None:
            start = f.start
            ends = [start + c for c in f.cum] if type(f.cum) is list else start + f.cum
            ends[-1] = end
        else:  # the rate changed on the way: map each step's share of the work onto the timeline
            ts = [f.start] + [t for t, _ in f.knots] + [end]
            ps = [0.0] + [p for _, p in f.knots] + [1.0]
            cum = f.cum
            if type(cum) is list:
                total = cum[-1]
                ends = interp([c / total for c in cum], ps, ts)
            else:
                ends = np.interp(cum / cum[-1], ps, ts)
            ends[-1] = end
        self._done.append(_new_result(StepResult, (f.batch, f.start, end, ends, None)))
        if self._queued:
            queued = self._queued.pop(lane, None)
            if queued is not None:  # starts now, on the GPU's heels: its host part ran meanwhile
                self._start(queued, end, False)
                return
        if self._flights:
            # The other lane runs alone from now on, but the engine usually launches on this lane at once:
            # re-time it then (or at the next wait). A re-time at the same instant adds no progress and
            # the same knot, so skipping this one changes no number.
            self._pending = end

    def _settle(self) -> None:
        if self._pending is not None:
            now, self._pending = self._pending, None
            self._retime(now)

    def next_end(self) -> float | None:
        """When the first launch in flight ends at the current rates (None: nothing in flight)."""
        self._settle()
        return min((f.end for f in self._flights.values()), default=None)

    def wait(self, until: float | None) -> list[StepResult]:
        if not self._done:
            self._settle()
            events = self._events
            first = None  # the flight that ends first (the first one of a tie)
            for f in self._flights.values():
                if first is None or f.end < first.end:
                    first = f
            if first is not None and (until is None or first.end <= until):
                token = first.token
                while True:  # run the clock until that launch's entry has come up
                    self._now, t, lane = heappop(events)
                    self._finish(lane, t)
                    if t == token:
                        break
                    self._settle()
            elif until is not None and until > self._now:
                stop = self._now + (until - self._now)
                while events and events[0][0] < stop:  # stale entries (a live one only by rounding)
                    self._now, t, lane = heappop(events)
                    self._finish(lane, t)
                    self._settle()
                self._now = stop
        done, self._done = self._done, []
        return done
