"""Capacity: the highest request rate at which at least ``target`` of the requests meet both SLOs
(DistServe's goodput definition), found by bracketing and bisection over a trace rescaled to each rate.

:func:`capacity` bisects from a guess: its answer is within ``rel_tol`` below the crossing, but which rate it
lands on depends on where it started. :func:`grid_capacity` searches a fixed geometric grid of rates,
``(1 + rel_tol) ** k`` req/s, for the highest one that passes: as long as attainment falls with rate, every
start gives the same answer (a start at or next to it costs two runs), so searches may start from each
other's answers (``bullet whatif`` does) without changing any."""

from __future__ import annotations

import math
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


def grid_rate(k: int, rel_tol: float) -> float:
    """Rate ``k`` of the capacity grid: ``(1 + rel_tol) ** k`` requests/s (``k`` may be negative)."""
    return (1.0 + rel_tol) ** k


def grid_index(rate: float, rel_tol: float) -> int:
    """The grid point at or just below ``rate`` (> 0)."""
    k = math.floor(math.log(rate) / math.log1p(rel_tol))
    while grid_rate(k + 1, rel_tol) <= rate:  # float rounding of the logarithms, either way
        k += 1
    while grid_rate(k, rel_tol) > rate:
        k -= 1
    return k


def grid_capacity(ok: Callable[[int], bool], start: int, floor: int) -> int | None:
    """The highest grid index ``k`` with ``ok(k)``, where ``ok`` is true up to some index and false above it:
    from ``start``, steps of 1, 2, 4, ... the same way until the answer flips, then bisection of the bracket.
    The answer does not depend on ``start``; the cost does (two calls when ``start`` is the answer, or just
    above it). None when ``ok`` is false down to ``floor``."""
    step = 1
    if ok(start):
        lo = start
        while ok(lo + step):
            lo, step = lo + step, 2 * step
        hi = lo + step
    else:
        hi = start
        while True:
            lo = hi - step
            if lo < floor:
                return None
            if ok(lo):
                break
            hi, step = lo, 2 * step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo
