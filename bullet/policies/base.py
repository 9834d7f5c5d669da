"""State every policy shares: queues, the KV block manager, results coming back, preemption, and the
sizing of fused decode stretches. A policy subclasses :class:`Scheduler` and writes ``schedule``.

The scheduler returns plans (:class:`~bullet.batch.Batch`) and changes request state only when results
come back (``on_result``), so the same code drives the simulator and the GPU.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from ..batch import Batch, Chunk, DecodeChunks, Lane, Partition, StepResult, all_sample
from ..config import GpuSpec, ModelSpec, SchedulerConfig, SloConfig
from ..kvcache import BlockManager
from ..metrics import TokenGaps
from ..perfmodel import LatencyModel, Work
from ..perfmodel.base import batch_work, new_work, note_work, step_ends
from ..request import Request


def most_steps(need: Callable[[int], int], steps: int, free: int) -> int:
    """The most steps ``k`` (<= ``steps``, >= 0) whose blocks ``need(k)`` (non-decreasing in ``k``) fit in ``free``:
    ``steps`` if they all fit, else by bisection."""
    if need(steps) <= free:
        return steps
    lo, hi = 0, steps  # need(lo) fits, need(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if need(mid) <= free else (lo, mid)
    return lo


class SchedulingError(RuntimeError):
    pass


@dataclass(slots=True, eq=False)
class Ahead:
    """What async scheduling keeps (:meth:`Scheduler.plan_ahead`)."""

    outstanding: dict[Lane, deque[tuple[Batch, list[Request], list[int]]]]  # launches out, in order, per lane
    pinned: Counter[int] = field(default_factory=Counter)  # request id -> launches in flight that hold it
    ended: dict[int, bool] = field(default_factory=dict)  # ended (EOS) while a launch held it -> KV still held
    planned: int = 0  # launches the engine planned ahead (queued behind the lane's launch in flight)


class Scheduler:
    # Each class names its attributes in __slots__: a slot is read and written at a fixed offset, a dict-backed
    # attribute by a keyed lookup (and past 30 attributes CPython 3.11 drops the shared-key dict, bench/RESULTS.md,
    # ninth pass; bullet has 59). ``__dict__`` stays for anything else set on an instance (a test's patched method).
    __slots__ = ("__dict__", "_hit_memo", "_new_hits", "_next_rank", "_step_s", "ahead", "all_layers", "busy", "cfg",
                 "eos_token_id", "gaps", "gpu", "hit_tokens", "inflight", "keyed", "kv", "latency", "model",
                 "num_preemptions", "partial", "query_tokens", "rank", "rejected", "running", "slo", "waiting",
                 "whole_gpu")
    lanes: tuple[Lane, ...] = ("all",)
    # A fused decode stretch with no co-runner runs past a request's last token (its row computed, its later tokens
    # dropped, as after an end-of-sequence token) instead of ending there, while nobody waits and a seat is free (a
    # completion then frees nothing anyone can take before the stretch's horizon): bullet's (bench/RESULTS.md).
    # Only up to a known horizon (the next arrival): without one (a trace's tail, live serving) the finished rows
    # would ride to the longest request's end, each step reading their whole contexts. Off: a stretch ends at its
    # first completion.
    ride_past_end = False

    def __init__(self, model: ModelSpec, gpu: GpuSpec, cfg: SchedulerConfig, kv: BlockManager,
                 latency: LatencyModel, eos_token_id: int | None = None, slo: SloConfig | None = None) -> None:
        self.model = model
        self.slo = slo or SloConfig()  # the targets; only SLO-aware policies (bullet) plan with them
        self.gpu = gpu
        self.cfg = cfg
        self.kv = kv
        self.latency = latency
        self.eos_token_id = eos_token_id
        self.all_layers = range(model.num_layers)
        self.whole_gpu = Partition("all", gpu.num_sms)
        self.waiting: deque[Request] = deque()  # arrived, holding no KV
        self.running: list[Request] = []  # admitted (hold KV), in admission order
        self.inflight: dict[Lane, tuple[Batch, list[Request], list[int]]] = {}  # lane -> (batch, requests, ids)
        self.busy: set[int] = set()  # ids of requests inside a launched batch
        self.partial: dict[int, Request] = {}  # running, prompt (or recompute) not finished: next is a chunk
        self.rank: dict[int, int] = {}  # priority (admission order, lower first), fixed at first admission
        self._next_rank = 0
        self.num_preemptions = 0
        self.hit_tokens = 0  # prefix-cache hits at admissions, in tokens
        self.query_tokens = 0  # known tokens of the requests admitted with prefix caching on
        self._new_hits = 0  # hits admitted since the last launch (reported on that launch)
        self._hit_memo: tuple[Request, int, list[int]] | None = None
        self.rejected: list[Request] = []  # turned away by admission control; serve() collects them
        # Every output token's time on its request (Request.token_times), or (None) only the pooled
        # inter-token gaps here: memory that does not grow with output tokens (set_token_times).
        self.gaps: TokenGaps | None = None
        self.keyed = False  # a request with prompt ids or hashes came: the prefix cache may key its blocks
        self._step_s = 0.0  # the last fused stretch's mean step time: how far the next one is timed first
        self.ahead: Ahead | None = None  # async scheduling's state (plan_ahead); None: synchronous

    def keep_token_times(self, keep: bool) -> None:
        """Record each output token's time on its request (the default; streaming needs it), or, with
        False, only first and last token times and the pooled gaps in ``self.gaps``. Before the first add."""
        self.gaps = None if keep else TokenGaps()

    def counters(self) -> dict[str, int]:
        """What a policy counts of its own decisions, for the run's summary (here: under async scheduling, the
        launches planned ahead and queued behind the one before them)."""
        return {"launches_planned_ahead": self.ahead.planned} if self.ahead is not None else {}

    # ---- arrivals and admission -------------------------------------------------------------------
    def add(self, req: Request) -> None:
        total = req.prompt_len + req.max_new_tokens
        if total > self.model.max_position:
            raise SchedulingError(f"request {req.id} needs {total} positions but {self.model.name} supports "
                                  f"{self.model.max_position}")
        need = self.kv.blocks_for(total)
        if need > self.kv.num_blocks:
            raise SchedulingError(f"request {req.id} needs {total} tokens of KV ({need} blocks) but the whole "
                                  f"cache holds {self.kv.num_blocks} blocks")
        if req.prompt_ids is not None or req.hash_ids is not None:
            self.keyed = True
        self.waiting.append(req)

    def schedule(self, lane: Lane, now: float, horizon: float | None) -> Batch | None:
        """The next launch on ``lane`` (idle now), or None. ``horizon``: the next time something
        outside the scheduler happens (an arrival); fused decode stretches end there."""
        raise NotImplementedError

    def _launch(self, lane: Lane, batch: Batch, reqs: list[Request], ids: list[int] | None = None) -> Batch:
        """Hold ``batch`` in flight on ``lane`` with its requests (``ids``: theirs in any order, where the caller
        has them)."""
        if self._new_hits:  # prefix-cache hits of the requests admitted into this launch
            batch = replace(batch, cached_tokens=self._new_hits)
            self._new_hits = 0
        if ids is None:
            ids = [r.id for r in reqs]
        self.inflight[lane] = (batch, reqs, ids)
        self.busy.update(ids)
        if self.ahead is not None:
            self._apply_planned(lane, batch, reqs)
        return batch

    # ---- async scheduling: plan launch N+1 while N runs ---------------------------------------------
    # With ``plan_ahead()`` a launch changes its requests' state when it is made, as if it had completed
    # (positions computed, outputs counted, prefix-cache blocks committed; a request that reaches
    # max_new_tokens leaves ``running`` and frees its seat and KV), so the next launch on the lane can be planned
    # and queued behind it while it runs; its results (token ids and times) are recorded when it returns. A
    # lane's launches run in order on one stream, so a queued launch reads what the one before it wrote, and
    # blocks freed by one are written only by launches after it; lanes run side by side, so only single-lane
    # policies plan ahead. A request stays ``pinned`` (never preempted or aborted) while a launch in flight
    # holds it (the blocks a request's last launch fills with generated tokens are not prefix-cached: their ids
    # come back after its KV was freed). What a result can still change: an end-of-sequence token ends its
    # request early; a later launch already queued with it runs on, its tokens for it are dropped, and the
    # request's KV is freed when no launch in flight holds it any more.
    def plan_ahead(self) -> None:
        """Switch to async scheduling (before the first request is added; ``SchedulerConfig`` allows it for
        single-lane policies only)."""
        assert self.lanes == ("all",), self.lanes
        self.ahead = Ahead({lane: deque() for lane in self.lanes})

    def predicted_end(self, batch: Batch, start: float) -> float:
        """When ``batch`` would end if it started at ``start`` alone on its partition (where a queued launch
        after it is planned from)."""
        work = batch_work(self.latency, batch, self.model.num_layers)
        sms = batch.partition.num_sms
        if batch.steps > 1:
            return start + float(step_ends(self.latency, work, batch.steps, sms)[-1])
        return start + float(self.latency.predict(work, sms))

    def holds(self, req_id: int) -> bool:
        """A launch in flight holds request ``req_id``: it cannot be dropped now."""
        return req_id in self.ahead.pinned if self.ahead is not None else req_id in self.busy

    def hold_back(self, req_id: int) -> None:
        """Plan no further launch for ``req_id`` (an abort waits for the launches that hold it). Without async
        scheduling a request in flight is never planned again before its launch returns anyway."""
        if self.ahead is not None:
            self.busy.add(req_id)

    def _apply_planned(self, lane: Lane, batch: Batch, reqs: list[Request]) -> None:
        if batch.layers.stop != self.model.num_layers:
            raise SchedulingError("async scheduling does not plan layer slices")
        steps, caching, bs = batch.steps, self.kv.prefix_caching, self.kv.block_size
        busy, pinned = self.busy, self.ahead.pinned
        outs = []  # each request's planned output count after this launch
        for c, r in zip(batch.chunks, reqs):
            r.num_computed = c.start + c.num_tokens + steps - 1
            pinned[r.id] += 1
            if caching and r.num_computed // bs != c.start // bs and (r.prompt_ids is not None
                                                                      or r.hash_ids is not None):
                self.kv.commit(r, r.num_computed)  # (blocks of generated tokens: when their ids come back)
            busy.discard(r.id)  # plannable again
            if not c.sample:
                self.partial[r.id] = r
            else:
                self.partial.pop(r.id, None)
                r.num_output += steps
                if r.num_output >= r.max_new_tokens:  # its last launch: seat and KV go to the launches after it
                    self._release(r)
            outs.append(r.num_output)
        self.ahead.outstanding[lane].append((batch, reqs, outs))

    def _record(self, res: StepResult) -> list[Request]:
        """``on_result`` under async scheduling: the launch's state was applied when it was made; record its
        tokens and times, and end the requests it finished (by length, or by an end-of-sequence token)."""
        lane = res.batch.partition.lane
        ahead = self.ahead
        batch, reqs, outs = ahead.outstanding[lane].popleft()
        if batch is not res.batch:
            raise SchedulingError(f"lane {lane!r}: a result came back out of launch order")
        if self.inflight[lane][0] is batch:  # (the lane's newest launch; a queued one may be newer)
            del self.inflight[lane]
        steps, tokens = batch.steps, res.tokens
        caching = self.kv.prefix_caching
        ends = [res.end] if steps == 1 else list(res.step_ends)
        done: list[Request] = []
        pinned, ended, rank = ahead.pinned, ahead.ended, self.rank
        for j, (c, r) in enumerate(zip(batch.chunks, reqs)):
            pinned[r.id] -= 1
            if not pinned[r.id]:
                del pinned[r.id]
            if r.id in ended:  # ended by an earlier launch's EOS: this one's tokens for it are dropped
                if r.id not in pinned and ended.pop(r.id):  # the last launch holding it: its KV goes now
                    self.kv.free(r.id)
                continue
            if not c.sample:
                continue
            n_new, eos = self._take_tokens(r, tokens, j, ends)
            if caching and r.prompt_ids is not None and r.id in rank:  # blocks of generated tokens: ids known now
                self.kv.commit(r, c.start + c.num_tokens + n_new - 1)
            if eos or outs[j] >= r.max_new_tokens:
                r.num_output = outs[j] - (steps - n_new)  # what it really produced
                r.num_computed = c.start + c.num_tokens + n_new - 1
                r.finish_time = ends[n_new - 1]
                self.busy.discard(r.id)  # (held back for an abort, or planned to its last token)
                if r.id in pinned:  # a later launch in flight holds it: its tokens are dropped, its KV kept till then
                    ended[r.id] = r.id in rank  # (False: that launch was its last, which released it already)
                    if r.id in rank:
                        self.running.remove(r)
                        del rank[r.id]
                elif r.id in rank:  # ended by EOS before the launch that would have been its last
                    self._release(r)
                done.append(r)
        return done

    # ---- KV, priority and preemption ----------------------------------------------------------------
    # Priority is admission order: a request's rank is fixed when it is first admitted, and ``running`` is
    # kept sorted by it. The rules, and why no request is preempted twice:
    #  1. a request short of KV may evict only idle running requests of lower priority (higher rank), never
    #     one that was preempted before; if that cannot make room, it waits (holding what it has);
    #  2. a fresh request is admitted only if its whole known prefix fits beside what running prefills
    #     still need;
    #  3. a preempted request waits at the front of the queue (in rank order) and is re-admitted only when
    #     it and every running request of higher priority could all grow to their final length
    #     (prompt + max_new_tokens) within the free blocks.
    # By 3, the requests ranked at or above the lowest-priority re-admitted one fit the pool at their final
    # size; so whenever one of them is short, the blocks it needs are free or held by lower-priority,
    # never-preempted requests, which rule 1 may evict: a re-admitted request is never a victim and never
    # starves. Each request is preempted at most once, so the recomputed tokens are at most what each
    # preempted request had computed when it was evicted (tests/test_preemption.py checks both).
    def _reserve(self, req: Request, num_tokens: int) -> bool:
        """Make ``req`` hold ``num_tokens`` tokens, evicting idle, never-preempted running requests of lower
        priority (lowest first) if the pool is short. False, evicting nobody, if that cannot make room."""
        kv = self.kv
        need = kv.extra_blocks(req.id, num_tokens)
        if need > kv.num_free:
            rank, busy, mine = self.rank, self.busy, self.rank[req.id]
            victims = []
            for v in reversed(self.running):
                if rank[v.id] <= mine:
                    break
                if v.id not in busy and not v.num_preemptions and not (self.ahead and v.id in self.ahead.pinned):
                    victims.append(v)
            if need > kv.num_free + kv.freeable([v.id for v in victims]):
                return False
            for v in victims:
                if need <= kv.num_free:
                    break
                self.preempt(v)
        kv.allocate(req.id, num_tokens)
        return True

    def preempt(self, req: Request) -> None:
        """Drop ``req``'s KV (its cached blocks stay cached); it goes back to the front of the queue, behind
        preempted requests of higher priority, and later recomputes what it knew."""
        self.kv.free(req.id)
        self.running.remove(req)
        self.partial.pop(req.id, None)
        req.num_computed = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        waiting, rank, mine = self.waiting, self.rank, self.rank[req.id]
        i = 0
        while i < len(waiting) and waiting[i].num_preemptions and rank[waiting[i].id] < mine:
            i += 1
        waiting.insert(i, req)

    def _hits(self, req: Request) -> list[int]:
        """Cached blocks of ``req``'s prefix (memoised while the cache is unchanged)."""
        if not self.kv.prefix_caching or (req.prompt_ids is None and req.hash_ids is None):
            return []
        memo = self._hit_memo
        if memo is not None and memo[0] is req and memo[1] == self.kv.version:
            return memo[2]
        hits = self.kv.match(req)
        self._hit_memo = (req, self.kv.version, hits)
        return hits

    def _fits(self, req: Request) -> bool:
        """Rules 2 and 3 above: may ``req`` (the head of the queue) be admitted now?"""
        kv = self.kv
        hits = self._hits(req)
        held, blocks_for = kv.held, kv.blocks_for
        if req.num_preemptions:
            mine = self.rank[req.id]
            need = blocks_for(req.prompt_len + req.max_new_tokens) - len(hits)
            for r in self.running:
                if self.rank[r.id] > mine:
                    break
                need += max(0, blocks_for(r.prompt_len + r.max_new_tokens) - held[r.id])
        else:
            need = blocks_for(req.known) - len(hits)
            for r in self.partial.values():
                need += max(0, blocks_for(r.known) - held[r.id])
        return need + (kv.hit_cost(hits) if hits else 0) <= kv.num_free

    def _admit(self, req: Request) -> None:
        """Move the head of the queue to ``running`` (in rank order), starting its table with its cached
        prefix; its first chunk starts after the hit."""
        self.waiting.popleft()
        hits = self._hits(req)
        if req.id not in self.rank:
            self.rank[req.id] = self._next_rank
            self._next_rank += 1
            self.running.append(req)
            req.num_cached_tokens = len(hits) * self.kv.block_size
        else:
            insort(self.running, req, key=lambda r: self.rank[r.id])
        if self.kv.prefix_caching:
            self.kv.take(req.id, hits)
            got = len(hits) * self.kv.block_size
            req.num_computed = got
            self.hit_tokens += got
            self.query_tokens += req.known
            self._new_hits += got

    def admissible(self) -> bool:
        """The head of the queue could start its prefill now: a seat, and KV under the rules above."""
        if not self.waiting or len(self.running) >= self.cfg.max_num_seqs:
            return False
        return self._fits(self.waiting[0])

    # ---- chunks ------------------------------------------------------------------------------------
    def _prefill_chunk(self, req: Request, budget: int) -> Chunk:
        start = req.num_computed
        known = req.prompt_len + req.num_output
        n = known - start
        if budget < n:  # noqa: PLR1730 -- min(): see _stretch
            n = budget
        ids = None
        if req.prompt_ids is not None:
            ids = (req.prompt_ids if not req.output_ids else req.prompt_ids + tuple(req.output_ids))[start:start + n]
        # (a plain tuple of Chunk's type, as _decode_chunks makes them: the same object at half Chunk()'s cost)
        return tuple.__new__(Chunk, (req.id, start, n, self.kv.table(req.id), start + n == known, ids, req.sampling))

    def _take_prefills(self, budget: int, chunks: list[Chunk], reqs: list[Request]) -> int:
        """Fill ``budget`` tokens with prefill chunks: partially prefilled running requests first, then
        the queue in order. Returns the budget left."""
        for r in list(self.partial.values()):  # a snapshot: _reserve may preempt (remove) others
            if budget <= 0:
                return budget
            if r.id in self.busy or r.id not in self.partial:
                continue  # in flight, or preempted just now
            n = r.remaining
            if budget < n:  # noqa: PLR1730
                n = budget
            if not self._reserve(r, r.num_computed + n):
                continue
            chunks.append(self._prefill_chunk(r, n))
            reqs.append(r)
            self.busy.add(r.id)  # protects it from preemption while the batch is built
            budget -= n
        while budget > 0 and self.admissible():
            r = self.waiting[0]
            self._admit(r)  # rules 2-3 leave room for the whole prefill: no preemption to admit new work
            n = r.remaining
            if budget < n:  # noqa: PLR1730
                n = budget
            self.kv.allocate(r.id, r.num_computed + n)
            chunks.append(self._prefill_chunk(r, n))
            reqs.append(r)
            self.busy.add(r.id)
            budget -= n
        return budget

    def arrival_horizon(self, horizon: float | None) -> float | None:
        """An arrival changes the plan only if it could be admitted: nobody is queued ahead of it (a
        queued request that cannot start now cannot start then either) and a seat is free."""
        if self.waiting or len(self.running) >= self.cfg.max_num_seqs:
            return None
        return horizon

    def _decoders(self) -> list[Request]:
        """Idle running requests whose next pass is a one-token decode step: an output exists and only the
        last sampled token is left to feed."""
        busy = self.busy
        return [r for r in self.running
                if r.num_output and r.prompt_len + r.num_output - r.num_computed == 1 and r.id not in busy]

    def _decode_batch(self, lane: Lane, partition: Partition, reqs: list[Request], now: float,
                      horizon: float | None, co: Work | None = None, co_sms: int = 0,
                      co_end: Callable[[Work, int, float], float] | None = None) -> Batch | None:
        """Decode every request in ``reqs`` (growing KV, preempting if short), fused over as many steps
        as fit before ``horizon``, the first completion, the KV pool and ``max_decode_steps``. ``co_end``: the
        horizon is the co-runner's predicted end next to this launch instead, ``co_end(work, SMs, now)`` with
        the launch's first-step Work."""
        reqs = self._one_step(reqs)
        if not reqs:
            return None
        # _fused over _decode_chunks(reqs), with the sums taken from the requests' starts: one token each (the
        # chunks made only if an executor reads them, their tables' reserved blocks named then)
        starts = [r.num_computed for r in reqs]
        chunks = DecodeChunks(reqs, starts, self.kv)
        n = len(starts)
        kv_end = sum(starts) + n
        work = new_work(Work, (self.model.num_layers, n, n, float(kv_end), kv_end, n, True, max(starts) + 1))
        if co_end is not None:
            horizon = co_end(work, partition.num_sms, now)
        return self._stretch(lane, partition, chunks, reqs, work, starts, 1, now, horizon, co, co_sms)

    def _decode_chunks(self, reqs: list[Request], starts: list[int] | None = None) -> list[Chunk]:
        """One decode chunk per request (its KV held), from ``starts`` (the requests' ``num_computed``, where
        the caller has them). Built as plain tuples of Chunk's type: the same objects as ``Chunk(...)`` at half
        the cost of its generated ``__new__`` (one per request per launch)."""
        new = tuple.__new__
        if starts is None:
            starts = [r.num_computed for r in reqs]
        kv = self.kv
        tables = kv.tables
        if not kv.num_reserved:  # (every table named: the usual case, one lookup a request)
            return [new(Chunk, (r.id, s, 1, tables[r.id], True, None, r.sampling)) for r, s in zip(reqs, starts)]
        held = kv.held  # (the table named, the call made only for one with reserved blocks)
        return [new(Chunk, (r.id, s, 1, tables[r.id] if len(tables[r.id]) == held[r.id] else kv.table(r.id), True,
                            None, r.sampling)) for r, s in zip(reqs, starts)]

    def _fused(self, lane: Lane, partition: Partition, chunks: list[Chunk], reqs: list[Request], now: float,
               horizon: float | None, co: Work | None = None, co_sms: int = 0) -> Batch:
        """Launch ``chunks`` (their KV held; every one samples) and then as many decode steps of all of
        them as end before ``horizon`` and the first completion, and fit the KV pool and
        ``max_decode_steps``. The hot path of a simulation: list comprehensions and builtins over the
        requests (no per-request statements, no small numpy calls)."""
        n = len(chunks)
        ends = [c.start + c.num_tokens for c in chunks]  # each chunk's KV after the first step
        kv_end = sum(ends)
        tokens = kv_end - sum([c.start for c in chunks])
        if tokens == n:  # one token each: n * start + n * (n + 1) / 2 is start + 1
            pairs = float(kv_end)
        else:  # integers summed exactly, as work_of() sums them in floats
            pairs = float(sum([c.num_tokens * c.start + c.num_tokens * (c.num_tokens + 1) // 2
                               for c in chunks]))
        work = new_work(Work, (self.model.num_layers, tokens, n, pairs, kv_end, n, True, max(ends)))  # == work_of()
        return self._stretch(lane, partition, tuple(chunks), reqs, work, ends, 0, now, horizon, co, co_sms)

    def _stretch(self, lane: Lane, partition: Partition, chunks: tuple[Chunk, ...] | DecodeChunks,
                 reqs: list[Request], work: Work, ends: list[int], off: int, now: float, horizon: float | None,
                 co: Work | None, co_sms: int) -> Batch:
        """:meth:`_fused` once ``work`` (``work_of`` the first step) is known; ``ends[i] + off`` is request i's
        KV after the first step."""
        kv, bs = self.kv, self.kv.block_size
        # decode steps after the first: up to the first completion (the last one when the policy rides past
        # completions and nobody could take a freed seat: see ride_past_end) and max_decode_steps
        left = [r.max_new_tokens - r.num_output for r in reqs]
        extra = min(left)
        # (an if, not min(): the builtin's argument parsing costs ~1,300 instructions a call against ~200, and the
        # per-launch path made several: bench/RESULTS.md, sixteenth speed pass)
        if self.cfg.max_decode_steps < extra:  # noqa: PLR1730
            extra = self.cfg.max_decode_steps
        extra -= 1
        if self.ride_past_end and horizon is not None and co is None and not self.waiting \
                and len(self.running) < self.cfg.max_num_seqs and self.ahead is None:
            # (a row past its end writes positions below the model's limit)
            extra = max(extra, min(self.cfg.max_decode_steps, max(left), self.model.max_position - max(ends) - off
                                   + 1) - 1)
        if extra > 0 and len(reqs) * (extra // bs + 1) > kv.num_free:  # the pool may be short: count
            held = kv.held
            extra = self._kv_steps([held[r.id] * bs - off - e for r, e in zip(reqs, ends)], extra)
        if extra > 0 and horizon is not None:
            extra = self._steps_before(work, extra, horizon - now, partition.num_sms, co, co_sms)
        if extra > 0:
            held, k = kv.held, extra + off
            grow = [(r.id, e + k) for r, e in zip(reqs, ends) if e + k > held[r.id] * bs]
            if grow:  # (most stretches stay within the requests' last blocks)
                kv.grow(grow, named=type(chunks) is not DecodeChunks)  # (chunks holding the live lists: named)
        else:
            extra = 0
        batch = Batch(partition, self.all_layers, chunks, extra + 1)
        note_work(self.latency, batch, self.model.num_layers, work)  # the simulator needs it too
        return self._launch(lane, batch, reqs)

    def _steps_before(self, work: Work, extra: int, budget: float, num_sms: int, co: Work | None,
                      co_sms: int) -> int:
        """Of ``extra`` decode steps after ``work``'s first step, those that start within ``budget`` seconds
        (the one crossing it included, as unfused steps do). The stretch is timed only as far as the answer
        needs: first to a guess from the last stretch's step time, then to four times as many steps while every
        guessed step ends in time, and to all ``extra + 1`` steps only past that. The first entries of a
        cumulative sum do not depend on its length, so the answer is the same; most stretches stop after a few
        steps of the hundreds allowed (timed to all of them after a short guess, bullet's stretches on the Azure
        conversation trace asked for three times the steps they ran)."""
        steps = extra + 1
        per_step = self._step_s
        if per_step > 0.0 and budget < per_step * steps:
            guess = int(budget / per_step * 1.25) + 2
            if guess < 2:  # noqa: PLR1730 -- a horizon already past
                guess = 2
            while guess < steps:
                cum = step_ends(self.latency, work, guess, num_sms, co, co_sms)
                within = bisect_left(cum, budget)  # (cum.searchsorted(budget), without numpy's call cost)
                if within < guess:
                    self._step_s = float(cum[-1]) / guess
                    return within if within < extra else extra  # noqa: FURB136 -- min(): see _stretch
                guess *= 4
        cum = step_ends(self.latency, work, steps, num_sms, co, co_sms)
        self._step_s = float(cum[-1]) / steps
        within = bisect_left(cum, budget)
        return within if within < extra else extra  # noqa: FURB136

    def _one_step(self, reqs: list[Request], named: bool = False) -> list[Request]:
        """KV for one more token of each request (by priority), evicting lower-priority idle ones when short;
        returns those that got it (the others wait a step, or were evicted). ``named``: the new blocks named now
        (:meth:`BlockManager.grow`), for chunks that hold the tables' live lists."""
        kv, bs, held = self.kv, self.kv.block_size, self.kv.held
        grow = [(r.id, r.num_computed + 1) for r in reqs if r.num_computed >= held[r.id] * bs]
        if grow:
            if len(grow) > kv.num_free:
                return self._make_room(reqs)
            kv.grow(grow, named)
        return reqs

    def _make_room(self, reqs: list[Request]) -> list[Request]:
        """Reserve one step of KV for each request in priority order under rule 1; a request that cannot
        get it waits this step, and one evicted by a request ahead of it (num_computed 0) drops out. A request
        that got its step is never evicted later in the loop: only requests behind it ask after it."""
        return [r for r in reqs if r.num_computed and self._reserve(r, r.num_computed + 1)]

    def _kv_steps(self, spare: list[int], steps: int) -> int:
        """The most steps (<= ``steps``, >= 0) that every request can grow by within the free blocks;
        ``spare``: tokens that still fit in each request's blocks."""
        bs = self.kv.block_size
        return most_steps(lambda k: sum(-(-(k - s) // bs) for s in spare if k > s), steps, self.kv.num_free)

    # ---- results -----------------------------------------------------------------------------------
    def on_result(self, res: StepResult) -> list[Request]:
        """Apply a finished launch; returns the requests it finished."""
        if self.ahead is not None:
            return self._record(res)
        batch, reqs, ids = self.inflight.pop(res.batch.partition.lane)
        if batch.layers.stop != self.model.num_layers:
            self._slice_done(batch, reqs)
            return []
        self.busy.difference_update(ids)
        if res.tokens is None and not (self.keyed and self.kv.prefix_caching):
            return self._counted(batch, reqs, res)
        steps = batch.steps
        tokens = res.tokens
        ends = [res.end] if steps == 1 else list(res.step_ends)
        done: list[Request] = []
        caching, bs = self.kv.prefix_caching, self.kv.block_size
        for j, (c, r) in enumerate(zip(batch.chunks, reqs)):
            mine = ends
            if c.sample and r.num_output + steps > r.max_new_tokens:  # it rode past its last token (ride_past_end)
                mine = ends[:r.max_new_tokens - r.num_output]
            r.num_computed = c.start + c.num_tokens + len(mine) - 1
            keyed = (caching and r.num_computed // bs != c.start // bs  # a block filled up: cache it
                     and (r.prompt_ids is not None or r.hash_ids is not None))
            if not c.sample:
                self.partial[r.id] = r
                if keyed:
                    self.kv.commit(r, r.num_computed)
                continue
            if self.partial:
                self.partial.pop(r.id, None)
            n_new, eos = self._take_tokens(r, tokens, j, mine)
            if keyed:
                self.kv.commit(r, r.num_computed)
            r.num_output += n_new
            if eos or r.num_output >= r.max_new_tokens:
                self._finish(r, mine[n_new - 1])
                done.append(r)
        return done

    def _take_tokens(self, r: Request, tokens: np.ndarray | None, j: int, ends: list[float]) -> tuple[int, bool]:
        """Record what column ``j`` of a launch sampled for ``r`` in its first ``len(ends)`` steps (step ends
        ``ends``): its token ids, cut after an end-of-sequence token, and their times. Returns (tokens taken,
        whether an EOS ended it)."""
        n_new, eos = len(ends), False
        if tokens is not None:
            new = tokens[:n_new, j].tolist()
            if not r.sampling.ignore_eos and self.eos_token_id in new:
                n_new = new.index(self.eos_token_id) + 1
                eos = True
                del new[n_new:]
            r.output_ids.extend(new)
        mine = ends if n_new == len(ends) else ends[:n_new]
        gaps = self.gaps
        if gaps is None:
            r.token_times.extend(mine)
        else:
            if r.last_token_time is not None:
                gaps.add(mine[0] - r.last_token_time, 1)
            if n_new > 1:
                gaps.add_steps(np.asarray(mine), 1)
        if r.first_token_time is None:
            r.first_token_time = mine[0]
        r.last_token_time = mine[-1]
        return n_new, eos

    def _counted(self, batch: Batch, reqs: list[Request], res: StepResult) -> list[Request]:
        """``on_result`` where tokens are counted, not stored, and no block can enter the prefix cache (the
        simulator on a trace without prompt hashes): the same updates, in one tight pass over the launch."""
        steps = batch.steps
        more = steps - 1
        first_end, end = (res.end, res.end) if steps == 1 else (float(res.step_ends[0]), res.end)
        gaps, partial = self.gaps, self.partial
        times = None if gaps is not None else [res.end] if steps == 1 else list(res.step_ends)
        lasts: list[float] = []  # previous-token times: each one's gap to this launch's first step
        done: list[Request] = []
        rode: list[int] = []  # steps of the requests that rode past their last token (ride_past_end)
        sampling = reqs if steps > 1 or all_sample(batch.chunks) else self._partial_chunks(batch, reqs)
        for r in sampling:
            # a sampling chunk ends at its request's last known token (a Chunk field read costs a generic
            # attribute lookup in 3.11, three per request per launch here)
            r.num_computed = r.prompt_len + r.num_output + more
            if partial:
                partial.pop(r.id, None)
            last = r.last_token_time
            if last is None:
                r.first_token_time = first_end
            else:
                lasts.append(last)
            if times is not None:
                r.token_times.extend(times)
            r.last_token_time = end
            r.num_output += steps
            if r.num_output >= r.max_new_tokens:
                if r.num_output > r.max_new_tokens:
                    rode.append(self._rode(r, res.step_ends, steps))
                    self._finish(r, r.last_token_time)
                else:
                    self._finish(r, end)
                done.append(r)
        if gaps is not None and lasts:
            if lasts.count(lasts[0]) == len(lasts):  # the usual case: all from one launch
                gaps.add(first_end - lasts[0], len(lasts))
            else:
                counts: dict[float, int] = {}  # (Counter's order and counts, without its call overhead)
                for last in lasts:
                    counts[last] = counts.get(last, 0) + 1
                for last, n in counts.items():
                    gaps.add(first_end - last, n)
        if gaps is not None and more:
            if len(rode) < len(batch.chunks):
                gaps.add_steps(res.step_ends, len(batch.chunks) - len(rode))
            for n in rode:
                if n > 1:
                    gaps.add_steps(res.step_ends[:n], 1)
        return done

    def _partial_chunks(self, batch: Batch, reqs: list[Request]) -> list[Request]:
        """``_counted``'s chunks that do not sample (a prompt not finished): their progress; returns the requests
        of the others, in order."""
        sampling = []
        for c, r in zip(batch.chunks, reqs):
            if c.sample:
                sampling.append(r)
            else:
                r.num_computed = c.start + c.num_tokens
                self.partial[r.id] = r
        return sampling

    def _rode(self, r: Request, step_ends, steps: int) -> int:
        """``_counted`` counted all ``steps`` of a fused launch for ``r``, which rode past its last token: keep the
        tokens up to it (the rest are dropped). Returns the steps kept."""
        n = steps - (r.num_output - r.max_new_tokens)
        r.num_output = r.max_new_tokens
        r.num_computed -= steps - n
        r.last_token_time = float(step_ends[n - 1])
        if self.gaps is None:
            del r.token_times[len(r.token_times) - (steps - n):]
        return n

    def _slice_done(self, batch: Batch, reqs: list[Request]) -> None:
        """A layer slice of a prefill finished; policies with layer-granular prefill override this."""
        raise SchedulingError("a partial layer slice came back to a policy that never launches one")

    def abort(self, req_id: int, now: float) -> Request | None:
        """Drop request ``req_id`` between launches (its client went away): out of the queue, or out of
        ``running`` with its KV freed (full blocks stay in the prefix cache) as if it finished at ``now``.
        Returns it, or None if the scheduler does not hold it. A request inside a launch in flight (``busy``,
        a layer-sliced prefill under way included) cannot be dropped: SchedulingError; the engine retries
        when that launch returns."""
        if self.holds(req_id):
            raise SchedulingError(f"request {req_id} is inside a launch in flight")
        self.busy.discard(req_id)  # (async scheduling: held back from planning while it was in flight)
        for r in self.running:
            if r.id == req_id:
                self.partial.pop(req_id, None)
                self._finish(r, now)
                return r
        for r in self.waiting:
            if r.id == req_id:
                self.waiting.remove(r)
                self.rank.pop(req_id, None)  # a preempted request keeps its rank while it waits
                if self._hit_memo is not None and self._hit_memo[0] is r:
                    self._hit_memo = None
                return r
        return None

    def _finish(self, r: Request, now: float) -> None:
        r.finish_time = now
        self._release(r)

    def _release(self, r: Request) -> None:
        """``r`` leaves: its KV freed (full blocks stay in the prefix cache), its seat and rank given up."""
        self.kv.free(r.id)
        self.running.remove(r)
        del self.rank[r.id]
        self.busy.discard(r.id)
        self.partial.pop(r.id, None)


class LayerSliced(Scheduler):
    """A policy whose prefill lane runs one job (chunks, their requests, the next layer) a layer slice per
    launch: the job advances as slices come back and ends with the slice that reaches the last layer."""

    __slots__ = ("job",)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.job: tuple[tuple[Chunk, ...], list[Request], int] | None = None

    def _slice_done(self, batch: Batch, reqs: list[Request]) -> None:
        chunks, reqs, _ = self.job
        self.job = (chunks, reqs, batch.layers.stop)

    def on_result(self, res: StepResult) -> list[Request]:
        done = super().on_result(res)
        if res.batch.partition.lane == "prefill" and res.batch.layers.stop == self.model.num_layers:
            self.job = None
        return done
