"""The engine's own thread: requests and aborts come in through a thread-safe queue, every step's updates go
out through ``deliver`` (called on the engine thread; the server hands them to its event loop).

The thread blocks on the queue while the engine is idle. Otherwise each step plans idle lanes and then waits
for results:
- the engine plans with its live horizon (``Engine``'s ``live_window`` = the window): a live engine cannot know
  the next arrival, so fused decode launches that a new request could join are sized to end about a window
  ahead; and while a request has no first token on a whole-GPU policy, to now, so that the launch sampling it
  ends with that step. A fused launch's tokens reach the host only when it ends, so a first token sampled at
  its first step would otherwise reach the client up to a window (on the CPU, where the latency model is a
  GPU's, up to ``max_decode_steps`` steps) after the time the server and the simulator count (CPU tiny model:
  33 of the 39 ms between the client's TTFT and the server's).
- the wait (:class:`LiveWait`) ends when a launch returns, when a request or abort comes in (it is taken at
  once and may start on an idle lane), or a window after the step began.
``serve(..., live_window=...)`` (``bullet simulate --fuse-window-ms``) plans the same way on a trace, so that a
simulation can be compared with a live server launch for launch.

Shutdown (``close``): no more requests are taken; the engine finishes what it holds until the deadline, then
aborts the rest (their KV is freed as their launches return) and the thread ends once it is idle. If a step
raises, every held request and every request still queued ends with the error, later submissions are refused
(:class:`EngineDead`), and ``error`` says what happened: nothing accepted is lost.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from ..batch import Executor, StepResult
from ..engine import Engine, Update
from ..request import Request

log = logging.getLogger("bullet.server")


class EngineDead(RuntimeError):
    """The engine thread has stopped (closed, or a step raised); no request can be taken."""


def _first_token(u: Update) -> bool:
    """Whether ``u`` carries its request's first output token."""
    return bool(u.token_times) and u.token_times[0] == u.request.first_token_time


class LiveWait:
    """The executor as the runner's engine sees it: ``wait(until)`` returns at ``until``, or earlier when a
    launch returns or something arrives in ``inbox`` (polled every ``tick_s``), so that a new request may
    start on an idle lane at once. Everything else is the executor's. ``until`` None: the executor's own
    wait."""

    def __init__(self, inner: Executor, inbox: queue.SimpleQueue, tick_s: float = 5e-4) -> None:
        self.inner, self.inbox, self.tick_s = inner, inbox, tick_s

    def wait(self, until: float | None) -> list[StepResult]:
        inner = self.inner
        if until is None:
            return inner.wait(None)
        while True:
            res = inner.wait(min(until, inner.now() + self.tick_s))
            if res or not self.inbox.empty() or inner.now() >= until:
                return res

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


class EngineRunner:
    def __init__(self, engine: Engine, deliver: Callable[[list[Update]], None], *, window_s: float = 0.01,
                 idle_poll_s: float = 0.1, after_step: Callable[[Engine], None] | None = None,
                 thread_init: Callable[[], None] | None = None,
                 on_take: Callable[[Request, float], None] | None = None) -> None:
        """``on_take(request, delay)``: the engine thread took ``request``, ``delay`` seconds after its
        arrival (executor clock)."""
        if window_s <= 0:
            raise ValueError("EngineRunner: window_s must be > 0")
        self.engine = engine
        self.deliver = deliver
        self.window_s, self.idle_poll_s = window_s, idle_poll_s
        self.after_step, self.thread_init, self.on_take = after_step, thread_init, on_take
        self.error: str | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wait = LiveWait(engine.executor, self._inbox)
        engine.executor = self._wait  # the engine thread waits through it; nothing else changes
        engine.live_window = window_s  # plan a window ahead (Engine's live horizon)
        self._lock = threading.RLock()  # orders submissions against the end; re-entrant: a signal handler
        # may call close() on the thread that is inside submit()
        self._taking = True
        self._deadline: float | None = None  # wall clock (time.monotonic) after which held requests are aborted
        self._aborted_all = False
        self._ready = threading.Event()  # set once thread_init has run (or failed)
        self._init_error: str | None = None  # why thread_init failed (start raises it)
        self._thread = threading.Thread(target=self._run, name="bullet-engine", daemon=True)

    # ---- any thread ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread and wait for its initialiser (``thread_init``: the GPU executor's warm-up,
        which must run on the thread that serves); RuntimeError if it failed."""
        self._thread.start()
        self._ready.wait()
        if self._init_error is not None:  # (not self.error: the first step may already have failed too)
            raise RuntimeError(self._init_error)

    def submit(self, req: Request) -> None:
        """Queue ``req`` for the engine; EngineDead if the engine takes no more requests."""
        with self._lock:
            if not self._taking:
                raise EngineDead(self.error or "the server is shutting down")
            self._inbox.put(("add", req))

    def abort(self, req_id: int) -> None:
        self._inbox.put(("abort", req_id))

    def close(self, timeout: float) -> None:
        """Take no more requests; finish the held ones within ``timeout`` seconds, then abort the rest."""
        with self._lock:
            self._taking = False
            if self._deadline is None:
                self._deadline = time.monotonic() + timeout
        self._inbox.put(("wake", None))

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end; True if it did."""
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # ---- the engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        try:
            if self.thread_init is not None:
                self.thread_init()
        except Exception as e:
            log.exception("the engine thread's start-up failed")
            self._init_error = f"the engine's start-up failed: {type(e).__name__}: {e}"
            self._die(self._init_error)
            return
        finally:
            self._ready.set()
        try:
            while True:
                self._take(block=eng.idle)
                if self._deadline is not None:
                    if not self._aborted_all and time.monotonic() >= self._deadline:
                        self._aborted_all = True
                        for rid in list(eng.held):
                            eng.abort(rid, "aborted: the server shut down before the request finished")
                    if eng.idle and self._inbox.empty():
                        self.deliver(eng.flush())
                        return
                if eng.idle:
                    ups = eng.flush()
                else:
                    ups = eng.step(eng.executor.now() + self.window_s)
                    if eng.stalled:  # nothing in flight and nothing launchable: it would never move again
                        for rid in list(eng.held):
                            eng.abort(rid, "the scheduler stalled: nothing schedulable")
                    else:  # the next launch goes out before the updates (handing them to the event loop
                        # costs this thread the GIL for up to a switch interval), with what arrived meanwhile;
                        # except a first token, which would wait for that launch's host work (an eager
                        # prefill's: several ms on the H200), a wait TTFT's client sees and no simulation has
                        self._take(block=False)
                        if any(_first_token(u) for u in ups):
                            self.deliver(ups)
                            ups = []
                        eng.launch_idle()
                    ups += eng.flush()
                    if self.after_step is not None:
                        self.after_step(eng)
                if ups:
                    self.deliver(ups)
        except Exception as e:  # the scheduler or the executor raised: its state is not to be trusted
            log.exception("the engine failed")
            self._die(f"the engine failed: {type(e).__name__}: {e}")

    def _take(self, block: bool) -> None:
        """Apply queued adds and aborts; wait for the first one if ``block``."""
        inbox, eng = self._inbox, self.engine
        while True:
            try:
                kind, item = inbox.get(timeout=self.idle_poll_s) if block else inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if kind == "add":
                eng.add(item)
                if self.on_take is not None:
                    self.on_take(item, eng.executor.now() - item.arrival)
            elif kind == "abort":
                eng.abort(item)

    def _die(self, why: str) -> None:
        with self._lock:
            self.error, self._taking = why, False
        eng = self.engine
        ups = eng.fail_all(why)
        while True:  # requests queued before submissions stopped: they end too
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                item.error = why
                ups.append(Update(item, finished=True, reason="error"))
        try:
            self.deliver(ups)
        except Exception:
            log.exception("delivering the engine's last updates failed")
