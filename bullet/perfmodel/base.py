"""The interface every latency model implements, and the summary of a batch it predicts from.

The simulator and the policies see only this: a backend (analytic roofline now, fitted regressions
later) can be swapped without either noticing.
"""

from __future__ import annotations

from itertools import accumulate
from math import isfinite, sqrt
from operator import add
from typing import NamedTuple, Protocol

import numpy as np

from ..batch import Batch


class Work(NamedTuple):
    """What one launch asks of the GPU, summed over its chunks."""

    num_layers: int  # layers in the slice
    tokens: int  # sum of chunk lengths (rows of every linear layer)
    seqs: int  # chunks
    attn_pairs: float  # query-key pairs: causal inside the chunk, full over the cached prefix
    kv_read: int  # KV tokens each layer reads: sum of (start + num_tokens)
    samples: int  # rows through the LM head and sampler (0 unless the slice reaches the last layer)
    embed: bool  # the slice starts at layer 0 (embedding lookup)
    max_kv: int = 0  # the longest chunk's KV (start + num_tokens): skewed decode batches wait on it; 0 = unknown


# ``new_work(Work, (all eight fields))`` is ``Work(...)`` without its generated ``__new__`` (half the cost; the
# hot paths make a Work per launch, and bullet's a few more per decision)
new_work = tuple.__new__


def work_of(batch: Batch, total_layers: int) -> Work:
    chunks = batch.chunks
    seqs = len(chunks)
    _, starts, lens, _, sample, _, _ = zip(*chunks) if chunks else ((),) * 7
    tokens = sum(lens)
    kv = sum(starts) + tokens
    if tokens == seqs:  # one token each (decode): the longest is the latest start
        pairs = float(kv)
        max_kv = max(starts) + 1 if chunks else 0
    else:
        pairs = float(sum(n * s + n * (n + 1) / 2 for s, n in zip(starts, lens)))
        max_kv = max(map(add, starts, lens))
    last = batch.layers.stop == total_layers
    return new_work(Work, (len(batch.layers), tokens, seqs, pairs, kv, sum(sample) if last else 0,
                           batch.layers.start == 0, max_kv))


def check_sms(num_sms, total: int):
    """``(SM count as an int or an intp array, is_array)``, each in ``1..total`` (ValueError otherwise)."""
    if isinstance(num_sms, (int, np.integer)) or np.ndim(num_sms) == 0:
        n = int(num_sms)
        if not 1 <= n <= total:
            raise ValueError(f"num_sms must be in 1..{total}, got {num_sms!r}")
        return n, False
    n = np.asarray(num_sms, dtype=np.intp)
    if n.size and (n.min() < 1 or n.max() > total):
        raise ValueError(f"num_sms must be in 1..{total}, got {num_sms!r}")
    return n, True


def partly_co_run(alone: float, co_run: float, overlap: float) -> float:
    """Seconds of a launch that ran next to the other lane for the fraction ``overlap`` of its own time and alone
    for the rest, given its time alone and its time co-running throughout (its progress adds up to one launch:
    ``(1 - o) t / alone + o t / co_run = 1``). How a profile's co-run points and a real run's launches are read."""
    return alone / (1.0 - overlap + overlap * alone / co_run)


def shared_sms(n: int, co_sms: int, work: Work, co: Work, total: int) -> tuple[int, int]:
    """The SMs each of two overlapping launches gets (both lanes on the whole GPU: naive concurrency): the
    SMs they have in common split in proportion to sqrt(tokens) of each launch, since the hardware hands free
    SMs to whichever kernel has blocks waiting and a big prefill's GEMMs nearly always do. Fitted to one H200
    measurement (bench/gpu_concurrency.py, naive row: an 8192-token prefill slowed 1.04x, a 64 x 4096 decode
    step 5.9x); beyond it an assumption. Disjoint launches keep their own."""
    if not 0 <= co_sms <= total:
        raise ValueError(f"co_sms={co_sms!r} must be in 0..{total}")
    overlap = n + int(co_sms) - total
    if overlap <= 0:
        return n, co_sms
    mine = sqrt(work.tokens) / (sqrt(work.tokens) + sqrt(co.tokens))
    # min(overlap - 1, max(1, round(...))), max(1, ...) as conditionals (the builtins parse their arguments; naive
    # concurrency asks this for every new pair of token counts)
    take = round(overlap * mine)
    if take < 1:  # noqa: PLR1730
        take = 1
    if take > overlap - 1:  # noqa: PLR1730
        take = overlap - 1
    mine_n, co_n = n - overlap + take, int(co_sms) - take
    return (mine_n if mine_n > 1 else 1), (co_n if co_n > 1 else 1)  # noqa: FURB136


class LatencyModel(Protocol):
    def predict(self, work: Work, num_sms: int | np.ndarray, co: Work | None = None,
                co_sms: int = 0) -> float | np.ndarray:
        """Seconds for ``work`` on ``num_sms`` SMs (an array of SM counts gives an array), while ``co``
        runs on ``co_sms`` other SMs (None: alone on the GPU)."""

    def decode_steps(self, work: Work, steps: int, num_sms: int, co: Work | None = None,
                     co_sms: int = 0) -> np.ndarray:
        """Seconds of each of ``steps`` fused decode steps; every sequence grows by one token a step,
        so step i reads ``work.kv_read + i * work.seqs`` KV tokens (the longest ``work.max_kv + i``)."""


def step_times(latency: LatencyModel, first: Work, steps: int, num_sms: int, co: Work | None = None,
               co_sms: int = 0) -> np.ndarray:
    """Seconds of each step of a fused launch: ``first`` as given, then ``steps - 1`` decode steps of
    all its sequences (each having sampled a token in the step before)."""
    if first.tokens == first.seqs:  # the first step is itself a decode step
        return latency.decode_steps(first, steps, num_sms, co, co_sms)
    t0 = latency.predict(first, num_sms, co, co_sms)
    if steps == 1:
        return np.array([t0])
    out = np.empty(steps)
    out[0] = t0
    out[1:] = latency.decode_steps(decode_tail(first), steps - 1, num_sms, co, co_sms)
    return out


def decode_tail(first: Work) -> Work:
    """The first of the decode steps that follow ``first`` in a fused launch: every sequence of it, each with
    the token it sampled."""
    n = first.seqs
    kv = first.kv_read + n
    return new_work(Work, (first.num_layers, n, n, float(kv), kv, n, True, first.max_kv + 1))


def batch_work(latency: LatencyModel, batch: Batch, total_layers: int) -> Work:
    """``work_of(batch, total_layers)``, remembered per batch by a :class:`CachedLatency` (a policy and the
    simulator each ask about the launches in flight)."""
    if isinstance(latency, CachedLatency):
        return latency.work_of(batch, total_layers)
    return work_of(batch, total_layers)


def note_work(latency: LatencyModel, batch: Batch, total_layers: int, work: Work) -> None:
    """Tell a :class:`CachedLatency` that ``work == work_of(batch, total_layers)``, computed by a policy on its
    way to the launch (the simulator then asks :func:`batch_work` for it); other models keep nothing."""
    if isinstance(latency, CachedLatency):
        latency.remember(batch, total_layers, work)


def step_ends(latency: LatencyModel, first: Work, steps: int, num_sms: int, co: Work | None = None,
              co_sms: int = 0) -> np.ndarray:
    """``np.cumsum(step_times(...))``: each step's end, seconds after the launch starts. Memoised by a
    :class:`CachedLatency` (do not write into the array), which gives a short stretch's as a list of the
    same floats."""
    if isinstance(latency, CachedLatency):
        return latency.step_ends(first, steps, num_sms, co, co_sms)
    return np.cumsum(step_times(latency, first, steps, num_sms, co, co_sms))


class ScaledLatency:
    """A latency model whose predictions are multiplied by one factor for launches with prompt rows
    (``prefill``) and another for decode-only launches (``decode``): a card that runs the profiled launches
    faster or slower. Compute-bound launches under the H200's 700 W cap differ from card to card: whole-GPU
    prefill ran at 0.91x and 1.02x of the shipped profile on two lent cards of one day (bench/RESULTS.md,
    sixteenth session). Anything else is the wrapped model's."""

    def __init__(self, model: LatencyModel, prefill: float, decode: float) -> None:
        if not (prefill > 0 and decode > 0 and isfinite(prefill) and isfinite(decode)):
            raise ValueError(f"ScaledLatency: factors must be positive and finite, got {prefill!r}, {decode!r}")
        self.model, self.prefill, self.decode = model, float(prefill), float(decode)

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def _factor(self, work: Work) -> float:
        return self.prefill if work.tokens > work.seqs else self.decode

    def predict(self, work: Work, num_sms, co: Work | None = None, co_sms: int = 0):
        return self.model.predict(work, num_sms, co, co_sms) * self._factor(work)

    def decode_steps(self, work: Work, steps: int, num_sms: int, co: Work | None = None,
                     co_sms: int = 0) -> np.ndarray:
        return np.asarray(self.model.decode_steps(work, steps, num_sms, co, co_sms)) * self._factor(work)

    def decode_step_ends(self, work: Work, steps: int, num_sms: int, co: Work | None = None,
                         co_sms: int = 0) -> tuple[np.ndarray, np.ndarray]:
        times = self.decode_steps(work, steps, num_sms, co, co_sms)
        return times, times.cumsum()


class CachedLatency:
    """Wraps a LatencyModel so that asking again is free: the policy sizes a fused launch with
    ``step_times(..., k_max)``, the simulator then times ``k <= k_max`` steps of the same work."""

    def __init__(self, model: LatencyModel) -> None:
        self.model = model
        self._key: tuple | None = None
        self._steps = np.zeros(0)
        self._predicted: dict[tuple, float] = {}
        self._works: dict[int, tuple[Batch, int, Work]] = {}  # id(batch) -> (batch, layers, its work)
        self._ekey: tuple | None = None
        self._ends = np.zeros(0)
        # (times, their cumsum) of a decode stretch, where the model has it (decode_step_ends: roofline, fitted)
        self._step_ends = getattr(model, "decode_step_ends", None)

    def predict(self, work: Work, num_sms, co: Work | None = None, co_sms: int = 0):
        if type(num_sms) is not int and isinstance(num_sms, np.ndarray):  # (the type test first: the usual case)
            return self.model.predict(work, num_sms, co, co_sms)
        if co is None:  # (SMs of no co-runner: a policy may pass the other lane's size anyway)
            co_sms = 0
        if work.tokens == work.seqs:  # a decode step: its KV grows every step, so 14 % of bullet's asks hit and
            return self.model.predict(work, num_sms, co, co_sms)  # a miss costs the key and insert besides
        key = (work, num_sms, co, co_sms)
        out = self._predicted.get(key)
        if out is None:
            if len(self._predicted) >= 4096:  # bounded: most repeats are a policy's search over SM counts
                self._predicted.clear()
            out = self._predicted[key] = self.model.predict(work, num_sms, co, co_sms)
        return out

    def decode_steps(self, work: Work, steps: int, num_sms: int, co: Work | None = None,
                     co_sms: int = 0) -> np.ndarray:
        key = (work, num_sms, co, co_sms)
        if key != self._key or steps > len(self._steps):
            self._key, self._steps = key, self.model.decode_steps(work, steps, num_sms, co, co_sms)
        elif type(self._steps) is list:  # from decode_step_ends (step_ends)
            self._steps = np.array(self._steps)
        return self._steps[:steps]

    def step_ends(self, first: Work, steps: int, num_sms: int, co: Work | None = None,
                  co_sms: int = 0) -> list[float] | np.ndarray:
        """:func:`step_ends`, remembered for the last launch asked about: the policy sizes a launch with
        ``k_max`` steps and the simulator then times its ``k <= k_max`` (a cumulative sum's first ``k``
        entries are those of the first ``k`` steps' sum: the same numbers). Without a co-runner its SMs are
        left out of the key: a policy may pass the other lane's size, the simulator passes 0."""
        if co is None:
            co_sms = 0
        key = (first, num_sms, co, co_sms)
        if key != self._ekey or steps > len(self._ends):
            if first.tokens != first.seqs:
                if self._step_ends is None or steps < 2:
                    ends = step_times(self, first, steps, num_sms, co, co_sms).cumsum()
                else:  # step_times' numbers: the first step, then the model's decode stretch of the rest
                    t0 = self.predict(first, num_sms, co, co_sms)
                    tail = decode_tail(first)
                    times, _ = self._step_ends(tail, steps - 1, num_sms, co, co_sms)
                    self._key, self._steps = (tail, num_sms, co, co_sms), times
                    # summed in order from t0, as cumsum does (a short stretch comes as a list of floats)
                    ends = list(accumulate(times, initial=t0)) if type(times) is list \
                        else np.concatenate(([t0], times)).cumsum()
            elif self._step_ends is not None:  # a decode launch: the model sums its steps (and keeps them)
                self._key, (self._steps, ends) = key, self._step_ends(first, steps, num_sms, co, co_sms)
            else:
                ends = self.decode_steps(first, steps, num_sms, co, co_sms).cumsum()
            self._ekey, self._ends = key, ends
        return self._ends[:steps]

    def work_of(self, batch: Batch, total_layers: int) -> Work:
        """:func:`work_of` of the last few batches asked about (by identity: a Batch is immutable)."""
        hit = self._works.get(id(batch))
        if hit is not None and hit[0] is batch and hit[1] == total_layers:
            return hit[2]
        work = work_of(batch, total_layers)
        self.remember(batch, total_layers, work)
        return work

    def remember(self, batch: Batch, total_layers: int, work: Work) -> None:
        """Keep ``work`` as ``work_of(batch, total_layers)`` (the caller computed it)."""
        if len(self._works) >= 8:
            self._works.clear()
        self._works[id(batch)] = (batch, total_layers, work)
