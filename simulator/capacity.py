"""Capacity: the highest request rate at which at least ``target`` of the requests meet both SLOs
(DistServe's goodput definition), found by bracketing and bisection over a trace rescaled to each rate."""

from __future__ import annotations

from collections.abc import Callable


def capacity(attainment: Callable[[float], float], guess: float, target: float = 0.9, rel_tol: float = 0.02,
             max_runs: int = 40) -> tuple[float, list[tuple[float, float]]]:
    """The highest rate (requests/s) with ``attainment(rate) >= target``, to ``rel_tol``, starting from
    ``guess``. Returns ``(rate, [(rate, attainment), ...] in the order run)``. Attainment is assumed to fall
    with rate; where noise makes it not, bisection returns one crossing. 0.0 if even ``guess / 1024`` misses."""
    runs: list[tuple[float, float]] = []

    def ok(rate: float) -> bool:
        a = attainment(rate)
        runs.append((rate, a))
        return a >= target

    lo, hi = guess, guess
    if ok(guess):
        while len(runs) < max_runs:
            hi *= 2
            if not ok(hi):
                break
            lo = hi
    else:
        while len(runs) < max_runs:
            lo /= 2
            if ok(lo):
                break
            hi = lo
            if lo < guess / 1024:
                return 0.0, runs
    while hi - lo > rel_tol * lo and len(runs) < max_runs:
        mid = (lo + hi) / 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, runs
