"""PacedExecutor: the simulator on the wall clock. Each launch takes the time the latency model predicts for it
(next to whatever runs on the other lane, re-timed when that changes: :class:`SimExecutor`'s arithmetic) while
the host sleeps, and returns placeholder token ids. ``bullet run --device sim`` serves with it: a server that
paces like the GPU the model was fitted on, with no GPU and no torch, so that HTTP clients, SLO experiments and
the live engine's own overheads (its thread, the event loop, the GIL) can be measured against ``bullet
simulate`` on any machine: whatever differs between the two is host-side, not the latency model's error.

Token ids: ``TOKEN_BASE + position % 26`` (the byte-level tokenizer's 'a'..'z'); no end-of-sequence is ever
sampled, so a request runs to ``max_tokens`` or a stop string.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from bullet.batch import Batch, Lane, StepResult

from .executor import SimExecutor

TOKEN_BASE = 97


SPIN_S = 3e-4  # the last this much of a wait is spun, not slept: time.sleep overslept 134 us (median, 185 us
# p90) on a 2-core VM, a third of the 0.41 ms between two launches that a live engine on this executor showed
# (bench/RESULTS.md), which is the instrument's error, not the engine's; time.sleep(0) itself took 97 us there


def precise_sleep(seconds: float, clock: Callable[[], float] = time.perf_counter) -> None:
    """Sleep ``seconds`` less ``SPIN_S``, then spin until they are up (3 us late at the median on that VM; the
    interpreter still hands the GIL over at its switch interval)."""
    end = clock() + seconds
    if seconds > SPIN_S:
        time.sleep(seconds - SPIN_S)
    while clock() < end:
        pass


class PacedExecutor:
    """The Executor protocol over a :class:`SimExecutor` whose virtual clock follows ``clock`` (seconds since
    this object was made). Thread-safe for ``now()`` only, as the server needs."""

    def __init__(self, sim: SimExecutor, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = precise_sleep) -> None:
        self.sim, self._clock, self._sleep = sim, clock, sleep
        self._t0 = clock()
        self._ready: list[StepResult] = []

    def now(self) -> float:
        """Wall seconds since this executor was made, never behind the simulator's clock (which a sleep
        puts exactly where it aimed)."""
        return max(self._clock() - self._t0, self.sim.now())

    def busy(self, lane: Lane) -> bool:
        """In flight, or ended and not yet returned by ``wait`` (as a GPU launch whose events were not read)."""
        return self.sim.busy(lane) or any(r.batch.lane == lane for r in self._ready)

    def queued(self, lane: Lane) -> bool:
        """Two launches out on ``lane`` (async scheduling's most): ended and not yet returned, in flight, or
        queued behind the one in flight."""
        out = sum(r.batch.lane == lane for r in self._ready) + self.sim.busy(lane) + self.sim.queued(lane)
        return out >= 2

    def release(self, req_id: int) -> None:
        self.sim.release(req_id)

    def close(self) -> None:
        """Nothing to free (the server calls it on every executor)."""

    def launch(self, batch: Batch) -> None:
        self._advance(self.now())  # the simulator's clock at the launch's wall time: it starts now
        self.sim.launch(batch)

    def wait(self, until: float | None) -> list[StepResult]:
        """Launches that have ended by the wall clock, sleeping until the first one does or ``until``
        passes; [] at once with nothing in flight and no ``until``. After a sleep the simulator's clock is
        put where the sleep aimed (a launch ends at its predicted time, whatever the wall clock's rounding)."""
        while True:
            now = self.now()
            self._advance(now)
            if self._ready or (until is not None and now >= until):
                out, self._ready = self._ready, []
                return [_with_tokens(r) for r in out]
            nxt = self.sim.next_end()
            if nxt is None:
                if until is None:
                    return []
                nxt = until
            elif until is not None:
                nxt = min(nxt, until)
            self._sleep(max(0.0, nxt - now))
            self._advance(nxt)

    def _advance(self, t: float) -> None:
        """Run the simulator's clock to ``t``, keeping the launches that end by then."""
        while True:
            res = self.sim.wait(t)
            if not res:
                return
            self._ready.extend(res)


def _with_tokens(res: StepResult) -> StepResult:
    """``res`` with an id for every chunk that samples, at every step: its position's letter."""
    chunks = res.batch.chunks
    n = len(chunks)
    first = np.fromiter([c.start + c.num_tokens for c in chunks], np.int64, n)  # each chunk's first position
    sample = np.fromiter([c.sample for c in chunks], bool, n)
    pos = first[None, :] + np.arange(res.batch.steps)[:, None]  # (a per-chunk loop took 144-150 us a launch of
    toks = np.where(sample[None, :], TOKEN_BASE + pos % 26, -1)  # 60 requests on this VM, this 11-13 us)
    return StepResult(res.batch, res.start, res.end, res.step_ends, toks)
