"""The engine thread's wait (bullet/server/runner.py, ``LiveWait``): it returns at ``until``, in ticks, and
earlier when a launch returns or a request comes in. A fake executor on a fake clock: no threads, no
timing."""

from __future__ import annotations

import queue

from bullet.server.runner import LiveWait


class FakeExecutor:
    """``wait(until)`` advances the clock to ``until`` (or to the launch's end, returning it)."""

    def __init__(self, launch_end: float | None = None) -> None:
        self.t, self.launch_end, self.calls = 0.0, launch_end, []
        self.kv = "the executor's own"

    def now(self) -> float:
        return self.t

    def wait(self, until):
        self.calls.append(until)
        if self.launch_end is not None and (until is None or self.launch_end <= until):
            self.t, self.launch_end = max(self.t, self.launch_end), None
            return ["result"]
        self.t = max(self.t, until)
        return []


def test_waits_to_until_in_ticks():
    ex, inbox = FakeExecutor(), queue.SimpleQueue()
    w = LiveWait(ex, inbox, tick_s=0.001)
    assert w.wait(0.01) == []
    assert ex.t == 0.01 and len(ex.calls) == 10 and max(ex.calls) <= 0.01


def test_returns_when_a_launch_returns():
    ex = FakeExecutor(launch_end=0.0035)
    w = LiveWait(ex, queue.SimpleQueue(), tick_s=0.001)
    assert w.wait(0.01) == ["result"] and ex.t == 0.0035


def test_returns_when_a_request_comes_in():
    ex, inbox = FakeExecutor(), queue.SimpleQueue()
    w = LiveWait(ex, inbox, tick_s=0.001)
    inbox.put(("add", None))
    assert w.wait(0.01) == [] and len(ex.calls) == 1 and ex.t == 0.001


def test_without_until_it_is_the_executors_wait():
    ex = FakeExecutor(launch_end=0.5)
    w = LiveWait(ex, queue.SimpleQueue())
    assert w.wait(None) == ["result"] and ex.calls == [None]
    assert w.kv == "the executor's own" and w.now() == 0.5
