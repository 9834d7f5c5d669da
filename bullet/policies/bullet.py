"""``bullet``: SLO-aware dynamic SM provisioning between concurrent prefill and decode (after Bullet, ASPLOS'26,
with per-request deadlines where the paper checks a P90 of predictions).

Two lanes on the nested partition menu (any prefill size p and decode size d with p + d <= N are disjoint),
re-split at every launch of either lane:

* **Decode gets the fewest SMs that keep every decoding request's TPOT.** A request with ``n`` of its ``T``
  tokens out, the first at ``t1``, meets its target ``tpot`` if its remaining ``T - n`` steps average at most
  ``(tpot * (T - 1) - (now - t1)) / (T - n)`` (its *step budget*: slack it built up may be spent, a deficit
  must be made up). TPOT is a mean, so a request ahead of ``BORROW_PACE`` of its target may also lend its
  next step what it would save if its other remaining steps ran at that pace, up to ``BORROW_CAP`` targets
  (its *loan*; never less than its step budget): prefill gets SMs now and the request's own later steps pay
  them back, its budget tightening as they come (``bench/RESULTS.md``: no more TPOT misses when the GPU runs
  20 % slower than the model says). Not while seats run short (``BORROW_SEATS``): slow decode holds them.
  The decode size is the smallest on the menu whose predicted step, next to the prefill on the rest of the
  GPU, fits the tightest loan with ``slo_margin`` to spare. A request whose budget is already gone (it will
  miss whatever happens) does not hold SMs hostage. With nothing to prefill, decode takes the whole GPU, in
  stretches that end at the next arrival. **With nobody waiting behind the prefill job**, decode gets more:
  the size within ``IDLE_KNEE`` of its best step (prefill still what its deadlines need): squeezing decode
  then only defers its work into a backlog that lengthens every request's decode and the run.
* **When the queue is blocked** (its head cannot be admitted: seats or KV are full), decode speed is what
  frees room: decode gets its bandwidth knee (more SMs barely help) and prefill what its job's deadlines need.
* **Prefill gets the rest**, without chunking: whole prompts, batched up to the token count where the model
  says a bigger batch stops paying (``token_target``: per-token time within 5 % of the best), advanced
  ``layers_per_step`` layers per launch (8 by default) so SMs can move between slices. A prompt longer
  than the target runs alone. With nobody waiting and no arrival due before the job's predicted end (the
  planning horizon: the next arrival in a trace replay, a window ahead live), nothing can change the split
  or the order before the job ends, so the rest of the job is one launch: on the Azure conversation trace
  a third fewer launches (each pays the engine's host gap), capacity within the simulation's noise in
  every cell of the policy study (bench/RESULTS.md).
* **The whole GPU for a job the split would make late** (``_whole_gpu``): when the rest of the job, on what
  decode leaves it and next to decode, would miss the earliest TTFT deadline among its requests (with
  ``slo_margin``) but meets it on the whole GPU, and every decoding request can lend the stall from its TPOT
  slack (its loan without ``BORROW_CAP``), the rest of the job runs at once on the whole GPU and decode waits
  for it. Not while the queue is blocked. Co-running saves little GPU time at the splits a tight TPOT
  leaves prefill, and a long prompt next to decode took 1.5-2x its whole-GPU time to its first token.
* **A job and a decode step in one launch** (``_mixed_time``, ``_mixed``): a job not started and one decode
  step of every decoding request run as one launch on the whole GPU, all layers (a decode row needs them all),
  when that launch fits the tightest decoding request's loan (with ``slo_margin``), ``MIXED_HOLD`` of the
  tightest TTFT target among the last ``MIXED_RECENT`` arrivals (one arriving as it starts waits for all of it)
  and ``max_batched_tokens``, the queue is not blocked, fewer than ``BORROW_SEATS`` of the seats are taken,
  and no queued request is predicted late and the head still meets its deadline after it; the job first takes
  more whole prompts from the queue while all that holds. Decode rows ride in a prefill launch at the cost of
  their attention reads, as chunked prefill's do, where the split runs decode at a fraction of its speed on
  the few SMs its TPOT needs and slows the prefill beside it: at light load on arxiv the split's makespan was
  1.3-2.7 % longer than chunked prefill's (bench/RESULTS.md). A decode launch in flight that ends within
  ``WAIT_FOR_DECODE`` of the mixed launch is waited for.
* **A job may be set aside between two of its slices** (``_urgent``) for the queue's head when the head would
  miss its TTFT deadline behind the rest of the job and meets it run alone first, and the job's own requests
  still meet theirs after it (or miss them either way); the job resumes when the head's job ends. One job at
  a time is set aside. Under per-token TTFT targets this stops a short prompt from waiting out a long one.
* **Queue order: earliest TTFT deadline first** (arrival + the TTFT target, absolute or per prompt token),
  among requests predicted to meet theirs, or shortest first where that order still meets every one of
  those deadlines (the paper's heuristic, kept only where it breaks none). Which requests are predicted to
  miss is Moore-Hodgson's choice: in deadline order, when one would end late, the longest prompt kept so far
  is dropped instead (on one machine: the fewest late). A request past the seats free now waits for a
  running request's predicted release (its remaining tokens at today's decode step): under overload the
  seats, not prefill, gate admission. A request predicted to miss goes
  before the first on-time request due after its key, its deadline plus ``LATE_GRACE`` times its target, so
  nobody arriving after that key is ahead of it: no starvation. With ``admission_control`` a request
  predicted to miss is rejected instead, on arrival (behind the job in flight and the queued prompts due
  before it) or when the queue is next ordered (``Request.error``; counted against attainment). Priority for
  KV is admission order (``base.py``), so the no-livelock guarantee holds under this order too.
* **Overload sheds the costliest arrivals** (``_shed_on_arrival``, on by default: ``overload_deferral``;
  bench/RESULTS.md): a request is deferred on arrival -- put in
  the late set, keyed like every late request (deadline + ``LATE_GRACE`` targets, so the starvation bound
  holds) -- when the last ``SHED_WINDOW`` of arrivals cheaper than it in whole-GPU work already carry more
  than ``SHED_CAPACITY`` times their span, but not more than ``SHED_DEEP`` times it (a deeper overload is a
  burst that deferring a few cannot carry: deferred, they would wait it out behind the queue while the GPU,
  once it ends, would have served most of them), at least ``SHED_SEATS`` of the seats are taken (what a
  deferral buys is seats for later arrivals; with seats free it buys nothing), and its prompt is at least
  ``SHED_PROMPT_SHARE`` of its decode share (decode beside prefill is nearly free: deferring a decode-heavy
  request frees little). Deferred requests rejoin the
  queue when the arrivals of the last ``SHED_LULL`` seconds carry at most ``SHED_LULL_LOAD`` of work a second
  (``_lull``): the overload is over. The queue's snapshot does not see the decode work that holds the seats;
  the fewest miss when the costliest wait.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, insort
from collections import deque

import numpy as np

from ..batch import Batch, Chunk, DecodeChunks, Lane, Partition, StepResult
from ..config import ConfigError
from ..perfmodel import Work, work_of
from ..perfmodel.base import batch_work, new_work, note_work, step_times
from ..request import Request
from .base import LayerSliced, SchedulingError, most_steps

LATE_GRACE = 20.0  # a request predicted to miss its TTFT is ordered as if its deadline were this many targets later
BORROW_PACE = 0.95  # a loan leaves the request's other remaining steps this fraction of its TPOT target each
BORROW_CAP = 1.3  # ... and is at most this many TPOT targets for one step
BORROW_SEATS = 0.75  # no loans while this fraction of max_num_seqs is running (slow decode holds seats)
EFFICIENT_WITHIN = 0.05  # token_target: the smallest batch whose per-token prefill time is this close to the best
KNEE = 0.1  # decode's useful size: within this fraction of the step time on its largest size
IDLE_KNEE = 0.5  # ... and, with nobody waiting behind the prefill job, within this fraction
WAIT_FOR_DECODE = 0.25  # a slice waits for SMs decode holds if decode ends within this fraction of the slice
# Under an absolute TTFT target, the rest of a prefill job runs on the whole GPU, decode waiting, whenever that stall
# (and a decode step after it) takes at most this fraction of what every decoding request can lend and no queued
# request is predicted late: the fitted H200 model serves a 2,000-6,738-token prompt 22-29 % sooner on the whole GPU
# than on 116 SMs beside 16-SM decode, which a burst of long prompts needs (bench/RESULTS.md, "bullet under an
# absolute TTFT target")
LIGHT_STALL = 0.5
SHED_WINDOW = 10.0  # seconds of recent arrivals whose whole-GPU work _shed_on_arrival weighs against their span
SHED_CAPACITY = 1.15  # ... and the whole-GPU seconds of work one second is taken to carry (lanes co-running)
SHED_DEEP = 1.8  # ... no deferral when they carry more than this a second: a burst deferring cannot carry
SHED_LULL = 5.0  # deferred requests rejoin the queue when the arrivals of this many seconds ...
SHED_LULL_LOAD = 0.5  # ... carry at most this many whole-GPU seconds of work a second (the overload ended)
# ... and nobody is deferred while fewer than this fraction of max_num_seqs run: a deferral buys seats for later
# arrivals, and with seats free admitting the costly request takes nothing from them. The seat-scarcity level
# BORROW_SEATS already uses (bench/RESULTS.md, bench/overload_check.py; before SHED_PROMPT_SHARE): sharegpt paper
# capacity 11.88 / 12.00 / 11.38 req/s at 0.6 / 0.75 / 0.9 on the study's window, 13.25 / 13.25 / 13.00 and 12.12 /
# 12.25 / 12.38 on requests 1000-1999 and 2000-2999; without the gate 400-request bursts at 16 req/s lost 0.6-1.6
# points of attainment (mean of 7 rates 0.1 % apart, on 4 of 5 windows), with it none
SHED_SEATS = BORROW_SEATS
# ... nor a request whose prompt costs less than this fraction of its decode share (whole-GPU seconds, _work_parts):
# beside a prefill, decode runs on a few SMs at little cost to it, so deferring a decode-heavy request frees less
# than its whole-GPU work says (arxiv paper: deferring 2-4 k-token outputs behind 1-800-token prompts cost 0.09-0.33
# req/s of capacity on three windows; at 1.0 / 0.5 sharegpt paper kept +0.12 / +0.58 req/s of its gain on the
# study's window, +0.21 / +0.54 on requests 1000-1999, arxiv none lost: means of 3 bisections)
SHED_PROMPT_SHARE = 0.5
MIXED_HOLD = 0.5  # a mixed launch holds the prefill lane at most this fraction of the tightest recent TTFT target ...
MIXED_RECENT = 50  # ... among this many last arrivals
ARRAYS_FROM = 64  # running requests from which the view reads DecodeArrays (a Python pass is faster below)
ARRAYS_UNTIL = 16  # ... and at or under which the arrays are dropped (kept up to date only while worth it)


def add_work(a: Work, b: Work) -> Work:
    """The Work of two sets of chunks in one launch over the same layers: sums, and the longer KV."""
    # (max(a.max_kv, b.max_kv) as a conditional: the builtin parses its arguments, and the prefill planning adds
    # Works thousands of times: bench/RESULTS.md, sixteenth speed pass)
    longer = b.max_kv if b.max_kv > a.max_kv else a.max_kv  # noqa: FURB136
    return new_work(Work, (a.num_layers, a.tokens + b.tokens, a.seqs + b.seqs, a.attn_pairs + b.attn_pairs,
                           a.kv_read + b.kv_read, a.samples + b.samples, a.embed or b.embed, longer))


class DecodeView:
    """The decoding requests' next step (``work``), the tightest per-step time that keeps every TPOT at an even
    pace (``budget``) and the tightest next-step time with slack lent (``loan``: >= budget; == budget when no
    loans). Read from :class:`DecodeArrays`, the two times are computed when first read: a prefill decision
    with the queue blocked reads only the work (the split's knee), and their six array operations over 255
    decoding requests were ~5 us of its ~60 (bench/policy_decision.py, hot)."""

    __slots__ = ("_budget", "_loan", "_of", "work")

    def __init__(self, work: Work, budget: float | None = None, loan: float | None = None,
                 of: tuple | None = None) -> None:
        self.work, self._budget, self._loan, self._of = work, budget, loan, of

    def _times(self) -> None:
        arrays, version, args = self._of
        if arrays.version != version:
            raise SchedulingError("a decode view's budget read after its decoding requests changed")
        self._budget, self._loan = arrays.budgets(*args)

    @property
    def budget(self) -> float:
        if self._budget is None:
            self._times()
        return self._budget

    @property
    def loan(self) -> float:
        if self._loan is None:
            self._times()
        return self._loan

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DecodeView):
            return NotImplemented
        return (self.work, self.budget, self.loan) == (other.work, other.budget, other.loan)

    __hash__ = None  # (mutable: its times are filled in when first read)

    def __repr__(self) -> str:
        return f"DecodeView(work={self.work!r}, budget={self.budget!r}, loan={self.loan!r})"


class DecodeArrays:
    """The decode progress of the running requests as numpy arrays, one stable slot per request, kept up to date
    as requests join (admission), advance (results) and leave (finish, preemption): the view over hundreds of
    decoding requests is then a few array operations instead of a Python pass. Every quantity is what
    :meth:`Bullet._view` computes per request, by the same operations in the same order (numpy's elementwise
    float64 arithmetic rounds as Python's does), so the budgets are equal to the bit. The decoding requests'
    next-step Work is kept as sums (their count, KV tokens and longest context: integers, so the same numbers
    as the arrays' sums), so that a decode launch coming back costs its one array update, not a regathering
    (~5 us of a ~15 us view after a launch, bench/policy_decision.py). With the block manager (``kv``), each slot
    also mirrors its request's id and the blocks its table holds (``BlockManager.held``), so that a decode launch
    of every decoding request finds who needs blocks and reserves them in a few array operations
    (:meth:`Bullet._array_decode`): a decoding request's blocks change only there, in a decode launch planned
    without the arrays (:meth:`held_changed` after it: read again before the arrays plan one) or when it
    leaves."""

    def __init__(self, tpot: float | None, reqs, kv=None) -> None:
        self.tpot = tpot
        self._held = kv.held if kv is not None else {}  # the block manager's blocks held, by request
        self._held_ok = True  # False: a decoding slot's held may be stale (refresh_held)
        self.slot: dict[int, int] = {}  # request id -> slot
        self.free: list[int] = []  # freed slots (a heap: the lowest is reused first)
        self.size = 0  # slots ever used: the arrays' live prefix
        self.live = np.zeros(64, bool)  # the slot holds a running request
        self.dec = np.zeros(64, bool)  # the slot holds a running request with a token out (decoding)
        self.left = np.zeros(64, np.int64)  # max_new_tokens - num_output
        # num_computed + left: fixed while a request decodes (a step adds one to the first, takes one from the
        # second), so a decode launch coming back changes one array; num_computed is tot - left
        self.tot = np.zeros(64, np.int64)
        self.t1 = np.zeros(64)  # first_token_time (nan: none yet)
        self.a0 = np.zeros(64)  # tpot * (max_new_tokens - 1)
        # the decoding slots' count, the sum of their num_computed and its largest (None: to be gathered again)
        self.ndec = 0
        self.csum: int | None = 0
        self.cmax: int | None = None
        self.version = 0  # changes with any change to a decoding slot (a view's lazy budget checks it)
        self.ids = np.zeros(64, np.int64)  # request id
        self.held = np.zeros(64, np.int64)  # blocks its table holds (mirrors BlockManager.held)
        # gathered once per change: the decoding slots and what a decode step leaves as it is (slots, tot, a0, t1),
        # until a decoding request joins, leaves or syncs; their view's inputs (left, a0, t1), and their Work, until
        # any change to a decoding slot (a request joining to prefill changes neither: a new job's admission keeps
        # what its decision's seat releases gathered for its view); the running requests' tokens left, sorted
        # (_seat_releases), until any change
        self._dec: tuple | None = None
        self._step: tuple | None = None  # (left, num_computed, next-step Work) of the decoding slots, per change
        self._ids: tuple | None = None  # (their ids as an array, as a list), until a decoding slot changes
        self._kept: tuple | None = None
        self._work: Work | None = None
        self._sorted: np.ndarray | None = None
        for r in reqs:
            self.join(r)

    def join(self, r: Request) -> None:
        if self.free:
            s = heapq.heappop(self.free)
        else:
            s, self.size = self.size, self.size + 1
            if s == len(self.dec):  # grow: double every array
                for name in ("live", "dec", "left", "tot", "t1", "a0", "ids", "held"):
                    old = getattr(self, name)
                    setattr(self, name, np.concatenate([old, np.zeros_like(old)]))
        self.slot[r.id] = s
        self.live[s] = True
        self.ids[s] = r.id
        self.sync(r)

    def leave(self, r: Request) -> None:
        s = self.slot.pop(r.id, None)
        if s is not None:
            if self.dec[s]:
                self._drop(s)
            self.live[s] = False
            heapq.heappush(self.free, s)
            self._sorted = None

    def _drop(self, s: int) -> None:
        """Take decoding slot ``s``, whose request leaves, out of the count and the sums."""
        if self.csum is not None:
            comp = int(self.tot[s] - self.left[s])
            self.csum -= comp
            if comp == self.cmax:
                self.cmax = None
        self.ndec -= 1
        self.dec[s] = False
        self._dec = self._ids = self._step = self._kept = self._work = None
        self.version += 1

    def sync(self, r: Request) -> None:
        """Copy ``r``'s progress into its slot (it joined, or a result changed it)."""
        s = self.slot.get(r.id)
        if s is None:
            return
        was, dec = bool(self.dec[s]), r.num_output > 0
        left = self.left[s] = r.max_new_tokens - r.num_output
        self.tot[s] = r.num_computed + left
        self.t1[s] = math.nan if r.first_token_time is None else r.first_token_time
        self.a0[s] = 0.0 if self.tpot is None else self.tpot * (r.max_new_tokens - 1)
        self.held[s] = self._held.get(r.id, 0)
        self._sorted = None
        if not (was or dec):  # (a slot that neither was nor is decoding is in no gathered view: kept)
            return
        self._dec = self._ids = self._step = self._kept = self._work = None
        self.version += 1
        if was:  # its old progress is not read back: the sums are gathered again when next asked (a mixed
            # launch syncs every decoding row; one gather then costs less than a scalar read per row)
            self.csum = self.cmax = None
            self.ndec -= 1
        if dec:
            self.dec[s] = True
            self.ndec += 1
            comp = r.num_computed
            if self.csum is not None:  # (a first token: its progress joins the sums)
                self.csum += comp
                if self.ndec == 1 or (self.cmax is not None and comp > self.cmax):  # (the first: the largest)
                    self.cmax = comp
        else:
            self.dec[s] = False

    def held_changed(self) -> None:
        """Decoding requests' tables grew outside :meth:`Bullet._array_decode`: read them again before it plans
        (a numpy scalar write per request after every launch the Python path planned cost more than that path)."""
        self._held_ok = False

    def refresh_held(self) -> None:
        """Mirror what every decoding slot's table holds now (after :meth:`held_changed`): one C-level read of the
        block manager per slot (a slot that is not decoding syncs its own when it starts)."""
        if not self._held_ok:
            dec, ids = self._decoding()[0], self.decoding_ids()[1]
            self.held[dec] = np.fromiter(map(self._held.__getitem__, ids), np.int64, len(ids))
            self._held_ok = True

    def decoding_count(self) -> int:
        """How many slots hold a decoding request."""
        return len(self._decoding()[0])

    def slots(self, reqs: list[Request]) -> np.ndarray:
        """The slots of ``reqs``: every decoding slot when they are all the decoding requests (no Python pass)."""
        if len(reqs) == self.ndec:
            return self._decoding()[0]
        slot = self.slot
        return np.fromiter((slot[r.id] for r in reqs), np.intp, len(reqs))

    def advance(self, slots: np.ndarray, steps: int) -> None:
        """The requests in ``slots`` each decoded ``steps`` tokens (a decode launch came back): each decoding one's
        num_computed grows by ``steps``, and so does the largest when every decoding slot is among them."""
        self.left[slots] -= steps
        g = self._dec
        k = self.ndec if g is not None and slots is g[0] else int(np.count_nonzero(self.dec[slots]))
        if self.csum is not None:
            self.csum += k * steps
            if k < self.ndec:
                self.cmax = None
            elif self.cmax is not None:
                self.cmax += steps
        # every running request decoded as many tokens: their tokens left keep their order (one subtraction
        # instead of a gather and a sort of 256: ~3 us of the seat releases' ~6, bench/policy_decision.py, hot)
        sl = self._sorted
        self._sorted = sl - steps if sl is not None and k == len(self.slot) else None
        self._step = self._kept = self._work = None
        self.version += 1

    def _decoding(self) -> tuple:
        """(the decoding slots, their tot, a0 and t1), gathered once until a request joins, leaves or syncs."""
        g = self._dec
        if g is None:  # (index arrays: a take costs less than a boolean mask's gather)
            dec = np.flatnonzero(self.dec[:self.size])
            g = self._dec = (dec, self.tot[dec], self.a0[dec], self.t1[dec])
        return g

    def sorted_left(self) -> np.ndarray:
        """Every running request's tokens left, sorted (gathered once per change)."""
        if self._sorted is None:  # (no slot freed since the arrays were made: every one live, no mask to gather)
            left = self.left[:self.size]
            self._sorted = np.sort(left if len(self.slot) == self.size else left[self.live[:self.size]])
        return self._sorted

    def work(self, num_layers: int) -> Work:
        """The decoding requests' next-step Work, from the sums (kept until a decoding slot changes)."""
        work = self._work
        if work is None or work.num_layers != num_layers:
            n, cmax = self.ndec, self.cmax
            if self.csum is None:  # (a decoding request's progress copied anew: gathered)
                dec, tot, _, _ = self._decoding()
                comp = tot - self.left[dec]
                self.csum, cmax = int(comp.sum()), int(comp.max()) if n else None
                self.cmax = cmax
            elif cmax is None and n:  # (the largest left with its slot, or some decoded and others not)
                dec, tot, _, _ = self._decoding()
                cmax = self.cmax = int((tot - self.left[dec]).max())
            kv = self.csum + n
            work = self._work = new_work(Work, (num_layers, n, n, float(kv), kv, n, True, cmax + 1 if n else 0))
        return work

    def view(self, now: float, lend: bool, cap: float, pace: float, num_layers: int) -> DecodeView:
        """:meth:`Bullet._view` over every decoding request: its budget and loan computed when first read."""
        return DecodeView(self.work(num_layers), of=(self, self.version, (now, lend, cap, pace)))

    def budgets(self, now: float, lend: bool, cap: float, pace: float) -> tuple[float, float]:
        """(budget, loan) of :meth:`Bullet._view` over every decoding request."""
        left, a0, t1 = self._timed()
        if self.tpot is None or not len(left):
            return math.inf, math.inf
        a = a0 - (now - t1)
        on = a > 0
        if np.count_nonzero(on) < len(on):
            a, left = a[on], left[on]
            if not len(a):
                return math.inf, math.inf
        b = a / left
        best = float(b.min())
        if not lend:
            return best, best
        x = np.maximum(np.minimum(a - (left - 1) * pace, cap), b)
        return best, float(x.min())

    def decoding_ids(self) -> tuple:
        """(the decoding slots' request ids as an array, and as a list), gathered once until one joins, leaves or
        syncs (a numpy call costs 7-19k instructions whatever its length: bench/RESULTS.md, issue 10)."""
        g = self._ids
        if g is None:
            ids = self.ids[self._decoding()[0]]
            g = self._ids = (ids, ids.tolist())
        return g

    def step(self, num_layers: int) -> tuple:
        """(tokens left, num_computed, the next step's Work) of the decoding slots (in slot order), once per change,
        for a decode launch planned from the arrays (not to be written to). The Work is :meth:`work`'s (the sums)."""
        step = self._step
        if step is None:
            dec, tot = self._decoding()[:2]
            left = self.left[dec]
            step = self._step = (left, tot - left, self.work(num_layers))
        return step

    def _timed(self) -> tuple:
        """(left, a0, t1) of the decoding requests with tokens left, gathered once per change."""
        kept = self._kept
        if kept is None:
            dec, _, a0, t1 = self._decoding()
            left = self.left[dec]
            timed = left > 0  # (a nan first-token time drops out in budgets: nan > 0 is False)
            if np.count_nonzero(timed) < len(dec):
                left, a0, t1 = left[timed], a0[timed], t1[timed]
            kept = self._kept = (left, a0, t1)
        return kept


class Bullet(LayerSliced):
    __slots__ = ("N", "_arrays", "_by_deadline", "_by_length", "_decode_end", "_decode_slots", "_decode_until",
                 "_flight_ids", "_hold", "_job_sums", "_last", "_late", "_parts", "_paused", "_per_token", "_queued", "_recent",
                 "_shed", "_slice_rate", "_slice_work", "_targets", "deadline", "dec_sizes", "layers_step", "num_late",
                 "num_mixed", "num_paused", "num_shed", "pre_sizes", "prefill_until", "target", "token_target")
    lanes: tuple[Lane, ...] = ("prefill", "decode")  # prefill planned first: it leaves decode what it needs
    # (base.py) on the whole GPU: with nobody waiting a completion there changes no decision before the stretch's
    # horizon, and no prefill is planned while it runs (beside a slice, the slice's next split would be planned
    # from a finished request's step budget)
    ride_past_end = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        gpu, cfg = self.gpu, self.cfg
        self.N = gpu.num_sms
        menu = gpu.decode_sizes[:-1]
        sizes = tuple(cfg.decode_sizes) if cfg.decode_sizes else menu
        bad = [d for d in sizes if d not in menu]
        if bad:
            raise ConfigError(f"decode_sizes {bad} are not on {gpu.name}'s decode menu ({', '.join(map(str, menu))})")
        self.dec_sizes = sorted(sizes)
        self.layers_step = cfg.prefill_layers(self.model.num_layers)
        self.deadline: dict[int, float] = {}
        self.target: dict[int, float] = {}
        self.prefill_until = 0.0  # predicted end of the prefill launch in flight
        self._decode_end: tuple[Batch, float, Work | None, int] | None = None  # decode in flight: its end's inputs
        self._decode_until = 0.0  # ... and that end, predicted when first asked (_predicted_decode_end)
        self._slice_work: Work | None = None  # the Work of the prefill slice in flight
        self._slice_rate = (0.0, 0.0, 0.0)  # ... its progress (mark, fraction done then, duration at that rate)
        self._job_sums: tuple[tuple[Chunk, ...], Work] | None = None  # (the job's chunks, their whole Work)
        self._paused: tuple[tuple[Chunk, ...], list[Request], int] | None = None  # a job set aside (_urgent)
        self.num_paused = 0  # jobs paused between slices for an urgent request
        self.pre_sizes = list(gpu.prefill_sizes[:-1])
        # every partition a launch may ask for, made once (a Partition per launch costs a frozen dataclass)
        self._parts = {(lane, n): Partition(lane, n) for lane, sizes in (("prefill", gpu.prefill_sizes),
                                                                          ("decode", gpu.decode_sizes))
                       for n in sizes}
        self._last: dict[str, int] = {}  # search -> the index _smallest answered last (its warm start)
        self.token_target = self._token_target()
        self.num_late = 0  # requests predicted to miss their TTFT when ordered (served best-effort or rejected)
        self._late: set[int] = set()  # those of them still held (each is counted once)
        # the fresh part of the queue (never admitted), kept sorted for _order: by (TTFT deadline, id) and by
        # (known tokens, as a float, id), each entry with the other of the two (and the first with _order's heap
        # item, made once, which ends with (deadline, id, known, request, (late key, id, request)): the entry
        # _order and _late_ones pass around, the late key _late_key's); none of them changes while a request waits
        self._by_deadline: list[tuple[float, int, float, Request, tuple]] = []
        self._by_length: list[tuple[float, int, float, Request]] = []
        self._queued: dict[int, tuple[tuple, tuple]] = {}  # request id -> its two keys
        self._arrays: DecodeArrays | None = None  # while many requests run (ARRAYS_FROM)
        # the ids of a decode launch planned from the arrays while it is in flight, kept out of ``busy`` (holds());
        # adding them and taking them out again cost ~40k instructions a launch of 256 requests
        self._flight_ids: list[int] | None = None
        self._decode_slots: tuple[Batch, DecodeArrays, np.ndarray] | None = None  # the decode launch in flight's
        # [arrival, known tokens, max_new_tokens, whole-GPU work or None until asked] of the last SHED_WINDOW's arrivals
        self._recent: deque[list] = deque()
        self._shed: set[int] = set()  # queued requests deferred on arrival (_shed)
        self.num_shed = 0
        self.num_mixed = 0  # mixed launches: a job and a decode step of every decoding request (_mixed_time)
        self._targets: deque[float] = deque(maxlen=MIXED_RECENT)  # the last arrivals' TTFT targets
        self._hold: float | None = None  # MIXED_HOLD of their tightest (None: not taken since the last arrival)
        self._per_token: dict[int, float] = {}  # prefill SMs -> _prefill_per_token's answer

    # ---- arrivals ---------------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        super().add(req)
        target = self.slo.ttft_target(req.prompt_len)
        target = math.inf if target is None else target
        deadline = req.arrival + target
        if self.cfg.admission_control and target < math.inf:
            ttft = self._predicted_ttft(req, deadline)
            if ttft > target:
                self.waiting.remove(req)
                raise SchedulingError(f"rejected by admission control: predicted TTFT {1e3 * ttft:.0f} ms > "
                                      f"target {1e3 * target:.0f} ms")
        self.target[req.id], self.deadline[req.id] = target, deadline
        self._targets.append(target)
        self._hold = None  # (_mixed_limit's, from the targets: again when next asked)
        if self.cfg.overload_deferral and target < math.inf and self._shed_on_arrival(req):
            self._shed.add(req.id)
            self.num_shed += 1
        i, known = req.id, req.known
        # (and below, with _order's max-heap item: longest, then latest due; the late key made once; the known
        # tokens as a float where _order and _merged multiply them by the per-token time: the same product, as
        # Python converts an int operand first, by the interpreter's float multiply instead of its generic one)
        first = (deadline, i, known, req, (self._late_key(i), i, req))
        fk = float(known)
        keys = self._queued[i] = ((deadline, i, fk, req, (-fk, -deadline, -i, first)), (fk, i, deadline, req))
        insort(self._by_deadline, keys[0])
        insort(self._by_length, keys[1])

    def _predicted_ttft(self, req: Request, deadline: float) -> float:
        """From arrival: the prefill job in flight, then every queued prompt due before ``deadline`` and this
        one, at the per-token speed prefill has now."""
        due = self.deadline
        ahead = req.known + sum(r.known for r in self.waiting if r is not req and due.get(r.id, 0.0) <= deadline)
        return max(0.0, self.prefill_until - req.arrival) + ahead * self._prefill_per_token()

    def _late_key(self, req_id: int) -> float:
        """Where a request predicted late is ordered: its deadline plus LATE_GRACE targets. Nobody arriving
        after it is served before it (the starvation bound)."""
        return self.deadline[req_id] + LATE_GRACE * self.target[req_id]

    def _whole_work(self, req: Request) -> float:
        """Whole-GPU seconds ``req`` asks for (:meth:`_work_parts`, summed)."""
        pre, dec = self._work_parts(req)
        return pre + dec

    def _work_parts(self, req: Request) -> tuple[float, float]:
        """Whole-GPU seconds of ``req``'s prompt alone and of its output tokens at their share of a full-seat
        decode step at its mean KV."""
        return self._parts_of(req.known, req.max_new_tokens)

    def _parts_of(self, n: int, out: int) -> tuple[float, float]:
        """:meth:`_work_parts` of a request with ``n`` known tokens and ``out`` output tokens."""
        L, N = self.model.num_layers, self.N
        pre = float(self.latency.predict(Work(L, n, 1, n * (n + 1) / 2, n, 1, True, n), N))
        S, K = self.cfg.max_num_seqs, n + out // 2
        step = float(self.latency.predict(Work(L, S, S, float(S * K), S * K, S, True, K), N))
        return pre, out * step / S

    def _shed_on_arrival(self, req: Request) -> bool:
        """Whether ``req`` is deferred on arrival: the arrivals of the last SHED_WINDOW seconds (``req`` and
        those before it, once they span half the window) ask for more whole-GPU work (:meth:`_whole_work`)
        than SHED_CAPACITY times their span, and ``req``'s work together with every costlier one among them
        is at most that excess: under overload somebody misses, and the fewest do when the costliest wait. A
        deferred request joins the late set and is ordered as every late one is (its deadline plus
        LATE_GRACE targets: keyed last instead, the study's capacity was 1-3 % lower on two of three windows
        of the sharegpt trace, and no wait would be bounded). Moore-Hodgson over the queue alone (``_order``) sees an overload
        only once it has built up, and then drops the longest prompts queued, not the costliest arrivals.
        A snapshot of the queue does not see the decode work that holds the seats (sharegpt paper, 11.75
        req/s: output tokens drain at 61 ms a token on 256 seats, 9.7 requests a second). No deferral when
        the window carries more than SHED_DEEP times its span: the costliest tenth of sharegpt's requests
        carry about a quarter of its work, so deferring a few cannot bring such a load under SHED_CAPACITY,
        and on a burst of that depth (400 requests at 16-20 req/s) deferral cost 2-9 points of attainment. No
        deferral either while fewer than SHED_SEATS of the seats are taken: what a deferral buys is seats for
        the arrivals behind it (a costly request holds one for tens of seconds), and with seats free it takes
        nothing from them (at the start of a 400-request burst at 16 req/s, requests deferred with a quarter of
        the seats free would have been served within 1-5 s; deferred, they waited out the burst and missed).
        Nor a request whose prompt costs less than SHED_PROMPT_SHARE of its decode share: its decode runs
        beside prefill on the few SMs the split leaves it, nearly free, so deferring it frees little (arxiv)."""
        recent = self._recent
        mine = [req.arrival, req.known, req.max_new_tokens, None]
        recent.append(mine)
        while recent and recent[0][0] <= req.arrival - SHED_WINDOW:
            recent.popleft()
        span = req.arrival - recent[0][0]
        if span < SHED_WINDOW / 2 or len(self.running) < SHED_SEATS * self.cfg.max_num_seqs:
            return False
        pre, dec = self._parts_of(mine[1], mine[2])
        c = mine[3] = pre + dec
        if pre < SHED_PROMPT_SHARE * dec:
            return False
        works = [self._recent_work(e) for e in recent]
        total = sum(works)
        excess = total - SHED_CAPACITY * span
        if excess <= 0 or total > SHED_DEEP * span:
            return False
        return sum([w for w in works if w >= c]) <= excess

    def _recent_work(self, entry: list) -> float:
        """The whole-GPU work of a recent arrival (an entry of ``_recent``), predicted when first asked for: while
        seats are free nobody asks, and predicting every arrival's work at once was ~3 % of bullet's simulation
        of the Azure conversation trace. From the lengths it arrived with: the same numbers whenever asked."""
        w = entry[3]
        if w is None:
            pre, dec = self._parts_of(entry[1], entry[2])
            w = entry[3] = pre + dec
        return w

    def _lull(self, now: float) -> bool:
        """Whether the arrivals of the last SHED_LULL seconds carry at most SHED_LULL_LOAD whole-GPU seconds of
        work a second: the overload that deferred requests is over, and they rejoin the queue as it is ordered
        (Moore-Hodgson then keeps those that still meet their deadline)."""
        work, since = 0.0, now - SHED_LULL
        for entry in reversed(self._recent):
            if entry[0] <= since:
                break
            work += self._recent_work(entry)
        return work <= SHED_LULL_LOAD * SHED_LULL

    def _token_target(self) -> int:
        """Prefill tokens per batch: the smallest of 512..max_batched_tokens whose predicted per-token time on
        the whole GPU is within EFFICIENT_WITHIN of the best (batches of 512-token prompts)."""
        sizes = [t for t in (512, 1024, 2048, 4096, 8192, 16384) if t <= self.cfg.max_batched_tokens]
        if not sizes:
            return self.cfg.max_batched_tokens
        per_tok = [float(self.latency.predict(self._probe(t), self.N)) / t for t in sizes]
        best = min(per_tok)
        return next(t for t, x in zip(sizes, per_tok) if x <= best * (1 + EFFICIENT_WITHIN))

    # ---- scheduling --------------------------------------------------------------------------------------
    def counters(self) -> dict[str, int]:
        return {"jobs_set_aside": self.num_paused, "requests_deferred": self.num_shed, "mixed_launches": self.num_mixed}

    def schedule(self, lane: Lane, now: float, horizon: float | None) -> Batch | None:
        return self._schedule_prefill(now, horizon) if lane == "prefill" else self._schedule_decode(now, horizon)

    def _part(self, lane: Lane, n: int) -> Partition:
        part = self._parts.get((lane, n))
        return part if part is not None else Partition(lane, n)  # (off the menu: the executor says so)

    def _decode_sms(self) -> int:
        dec = self.inflight.get("decode")
        return dec[0].partition.num_sms if dec else 0

    def _schedule_prefill(self, now: float, horizon: float | None) -> Batch | None:
        d_cur = self._decode_sms()
        if d_cur >= self.N:
            return None  # decode holds the whole GPU until the next event; then the split is decided afresh
        urgent = False
        if self.job is not None and self.job[2] > 0 and self._paused is None and self.waiting \
                and self.admissible() and self._urgent(now, d_cur):
            self._paused, self.job, urgent = self.job, None, True  # the queue's head runs first
            self.num_paused += 1
        elif self.job is None and self._paused is not None:
            self.job, self._paused = self._paused, None  # back to the job set aside
        if self.job is None:
            if not self.waiting:
                return None
            if not urgent:  # (_urgent just ordered it)
                self._order(now)
            chunks, reqs = self._take_whole(alone=urgent)
            if not chunks:
                return None
            self.job = (tuple(chunks), reqs, 0)
        chunks, reqs, first = self.job
        L = self.model.num_layers
        view = self._view(self._decoding(), now)
        alone = not d_cur and not view.work.seqs  # nothing to share SMs with: the rest of the job at once
        layers = range(first, L if alone else min(first + self.layers_step, L))
        work = self._job_work(layers)
        if first == 0 and view.work.seqs:  # a job not started, with requests decoding: one mixed launch?
            t = self._mixed_time(now, view)
            if t is not None:
                if not d_cur:
                    batch = self._mixed(now, view)
                    if batch is not None:
                        return batch
                elif self._predicted_decode_end() - now < WAIT_FOR_DECODE * t:
                    return None  # once decode's launch in flight ends
        p = self.N if alone else self._prefill_want(now, work, view)
        if p < self.N and not alone and self._whole_gpu(now, view, p):
            if d_cur:
                return None  # once decode's launch in flight ends (within a step)
            p, layers = self.N, range(first, L)  # the rest of the job at once, decode waiting
            work = self._job_work(layers)
        if p > self.N - d_cur:  # decode holds SMs this slice wants: wait for it if it ends soon
            if self._predicted_decode_end() - now < WAIT_FOR_DECODE * float(self.latency.predict(work, p)):
                return None
            p = self.N - d_cur
        dec = self.inflight.get("decode")
        co = batch_work(self.latency, dec[0], L) if dec else None  # the simulator asks for it too
        if layers.stop < L and not self.waiting:  # nothing to re-decide before the job ends: its rest at once
            rest = self._job_work(range(first, L))
            if horizon is None or now + float(self.latency.predict(rest, p, co, d_cur)) <= horizon:
                layers, work = range(first, L), rest
        return self._start_prefill(now, Batch(self._part("prefill", p), layers, chunks), work, reqs, co, d_cur)

    def _start_prefill(self, now: float, batch: Batch, work: Work, reqs: list[Request], co: Work | None = None,
                       d_cur: int = 0) -> Batch:
        """Launch a prefill-lane batch whose Work is ``work`` next to ``co`` on ``d_cur`` SMs (or alone): its
        predicted end and rate, which :meth:`_slice_end` re-times when decode starts beside it."""
        note_work(self.latency, batch, self.model.num_layers, work)
        duration = float(self.latency.predict(work, batch.partition.num_sms, co, d_cur))
        self.prefill_until = now + duration
        self._slice_work, self._slice_rate = work, (now, 0.0, duration)
        return self._launch("prefill", batch, reqs)

    def _mixed_limit(self, view: DecodeView) -> float:
        """The longest mixed launch (:meth:`_mixed_time`): the tightest decoding request's loan with
        ``slo_margin`` to spare, and MIXED_HOLD of the tightest TTFT target among the last MIXED_RECENT arrivals
        (a request arriving as it starts waits for all of it: no slice boundary to set it aside at)."""
        hold = self._hold
        if hold is None:  # (the window changes only with an arrival)
            hold = self._hold = MIXED_HOLD * min(self._targets) if self._targets else math.inf
        loan = view.loan * (1 - self.cfg.slo_margin)
        return hold if hold < loan else loan  # noqa: FURB136 -- min(): see add_work

    def _mixed_time(self, now: float, view: DecodeView) -> float | None:
        """The predicted time of the job (not started) and one decode step of every decoding request (``view``)
        in one launch on the whole GPU, if it may run so; None if not. Decode rows ride in a prefill launch
        at the cost of their attention reads (their weights are read for the prompt anyway), where the split
        runs decode on the few SMs its TPOT needs at a fraction of its speed and slows the prefill next to it
        (the fitted H200 model: a 3000-token slice 19-30 % slower next to decode on 8-16 SMs; arxiv at light
        load, bench/RESULTS.md). It may when the launch fits :meth:`_mixed_limit` and ``max_batched_tokens``, the
        queue is not blocked, fewer than BORROW_SEATS of the seats are taken (slow decode holds them), no queued
        request is predicted late and the queue's head still meets its TTFT deadline after it."""
        if (self.waiting and not self.admissible()) or len(self.running) >= BORROW_SEATS * self.cfg.max_num_seqs:
            return None
        w, v = self._job_work(self.all_layers), view.work
        if w.tokens + v.tokens > self.cfg.max_batched_tokens:
            return None
        t = float(self.latency.predict(add_work(w, v), self.N))
        if t > self._mixed_limit(view) or not self._queue_keeps(now, t):
            return None
        return t

    def _late_queued(self) -> bool:
        """Whether a queued request is predicted to miss its TTFT (:meth:`_order`'s late set)."""
        late = self._late
        return bool(late) and any(r.id in late for r in self.waiting)

    def _queue_keeps(self, now: float, t: float, skip: int = 0) -> bool:
        """No queued request is predicted late, and the head (past the first ``skip``) meets its TTFT deadline
        after ``t`` seconds more of prefill (at the per-token speed prefill has now)."""
        if self._late_queued():
            return False
        if len(self.waiting) <= skip:
            return True
        head = self.waiting[skip]
        return now + t + head.known * self._prefill_per_token() <= self.deadline.get(head.id, math.inf)

    def _mixed(self, now: float, view: DecodeView) -> Batch | None:
        """The mixed launch :meth:`_mixed_time` allowed: the decode step's KV taken (None when the pool cannot
        hold it), the job grows by whole prompts from the queue's head while the launch still fits its limit and
        the token budget, each added request meets its own deadline and the queue keeps (fewer, larger
        launches: each one reads every decoding request's KV once); then the job's chunks and a decode chunk of
        every decoding request run on the whole GPU, all layers (a decode row needs them all)."""
        decoders = self._decoders()
        kv, bs, held = self.kv, self.kv.block_size, self.kv.held
        grow = [(r.id, r.num_computed + 1) for r in decoders if r.num_computed >= held[r.id] * bs]
        if len(grow) > kv.num_free:
            return None
        if grow:
            kv.grow(grow, named=True)  # (list chunks below: the live tables)
            if self._arrays is not None:
                self._arrays.held_changed()
        chunks, reqs, _ = self.job
        L, N, limit, budget = self.model.num_layers, self.N, self._mixed_limit(view), self.cfg.max_batched_tokens
        work = add_work(self._job_work(self.all_layers), view.work)
        while self.admissible():
            r = self.waiting[0]
            k = r.known
            c = min(len(self._hits(r)) * bs, k - 1)  # what it computes: its prompt less a cached prefix
            n = k - c
            more = add_work(work, Work(L, n, 1, n * c + n * (n + 1) / 2, k, 1, True, k))
            t_more = float(self.latency.predict(more, N))
            if more.tokens > budget or t_more > limit or now + t_more > self.deadline.get(r.id, math.inf):
                break
            if not self._queue_keeps(now, t_more, 1):
                break
            self._admit(r)
            kv.allocate(r.id, r.known)
            chunks += (self._prefill_chunk(r, r.remaining),)
            reqs.append(r)
            self.busy.add(r.id)
            work = more
        self.job = (chunks, reqs, 0)
        starts = [r.num_computed for r in decoders]
        batch = Batch(self._part("prefill", N), self.all_layers, tuple(self._decode_chunks(decoders, starts)) + chunks)
        self.num_mixed += 1
        # work_of(batch, L), from the job's sums and the decode rows' starts: its sums are of integers (pairs
        # too, as floats below 2**53), so taken in parts they are the same numbers
        n, kv = len(starts), sum(starts) + len(starts)
        rows = new_work(Work, (L, n, n, float(kv), kv, n, True, max(starts, default=-1) + 1))
        return self._start_prefill(now, batch, add_work(self._job_work(self.all_layers), rows), decoders + reqs)

    def _urgent(self, now: float, d_cur: int) -> bool:
        """Whether to set the job in flight aside between two of its slices for the queue's head (ordered
        now): the head meets its TTFT deadline if it runs alone first and misses it behind the rest of the job,
        and the job's requests still meet theirs after it (or already miss them either way). The paper's
        layer-granular prefill re-decides SMs between slices; this re-decides the order too, so a short prompt
        with a tight per-token target does not wait out a long prompt's whole job."""
        self._order(now)
        head = self.waiting[0]
        deadline = self.deadline.get(head.id, math.inf)
        if deadline == math.inf or head.id in self.rank:  # no target, or a preempted request coming back
            return False
        _, reqs, first = self.job
        if any(head.arrival > self._late_key(r.id) for r in reqs):
            return False  # the head came after a job request's late key: it may not go first (no starvation)
        L, p = self.model.num_layers, (self.N - d_cur if d_cur < self.N else self.N)
        rest = float(self.latency.predict(self._job_work(range(first, L)), p))
        k = head.known  # what the head computes: its prompt less a prefix the cache holds (at least one token)
        c = min(len(self._hits(head)) * self.kv.block_size, k - 1)
        n = k - c
        mine = float(self.latency.predict(Work(L, n, 1, n * c + n * (n + 1) / 2, k, 1, True, k), p))
        if now + rest + mine <= deadline or now + mine > deadline:  # on time behind the job, or late anyway
            return False
        due = min((self.deadline.get(r.id, math.inf) for r in reqs), default=math.inf)
        return now + mine + rest <= due or now + rest > due

    def _job_work(self, layers: range) -> Work:
        """``work_of`` the job's chunks over ``layers``: the sums over its chunks are taken once per job."""
        chunks, L = self.job[0], self.model.num_layers
        if self._job_sums is None or self._job_sums[0] is not chunks:
            self._job_sums = (chunks, work_of(Batch(self.whole_gpu, self.all_layers, chunks), L))
        # all layers: every sample counted, the embedding included (unpacked once: a field read is a generic lookup)
        _, tokens, seqs, pairs, kv, samples, _, max_kv = self._job_sums[1]
        return new_work(Work, (len(layers), tokens, seqs, pairs, kv, samples if layers.stop == L else 0,
                               layers.start == 0, max_kv))

    def _prefill_want(self, now: float, work: Work, view: DecodeView) -> int:
        """The prefill size for the next slice (``work``), next to the decoding requests (``view``). When the
        queue is blocked (its head cannot be admitted: seats or KV are full), decode speed is what frees
        them, so decode gets its knee and prefill the fewest SMs that still finish the job by its requests'
        deadlines. When nobody waits behind the job, finishing it early gains nothing but squeezing decode
        to its TPOT floor defers decode work into a backlog (at 7 req/s on sharegpt, the run's last request
        decoded 24 % slower than under chunked prefill and the run ended 4 % later: bench/RESULTS.md): decode gets a looser knee
        (IDLE_KNEE), prefill at least what its deadlines need, decode at least what its TPOT targets need.
        Else prefill takes all that decode does not need for its TPOT targets."""
        if self.waiting and not self.admissible():
            return max(self._prefill_need(now), self.N - self._decode_knee(view.work, work))
        if not self.waiting:  # nobody to make room for: decode's speed is worth more than a prefill ahead of time
            knee = self._decode_knee(view.work, work, IDLE_KNEE, "idle_knee")
            want = max(self._prefill_need(now), self.N - knee)
            return min(want, self.N - self._decode_need(view, work))
        return self.N - self._decode_need(view, work)

    def _whole_gpu(self, now: float, view: DecodeView, p: int) -> bool:
        """Whether the rest of the job runs on the whole GPU at once, decode waiting, instead of its next slice
        on ``p`` SMs next to the decoding requests (``view``): on ``p`` SMs it would end less than ``slo_margin``
        before the earliest deadline among its requests that can still meet theirs, on the whole GPU it is
        predicted to meet it, and every decoding request can lend the stall (the rest of the job on the whole
        GPU, then a decode step there) with ``slo_margin`` to spare (:meth:`_stall_room`). Not while the
        queue is blocked (seats or KV full): decode speed is what frees them. At the splits decode's TPOT
        leaves prefill, co-running saves the fitted H200 model only 1-14 % of GPU time against running the
        lanes in turn, while a prompt next to decode on 68-100 SMs takes 1.5-2x its whole-GPU time: under an
        absolute TTFT target, long prompts missed theirs on the split (bench/RESULTS.md, sharegpt tight). So under
        an absolute TTFT target (``slo.absolute_ttft``) the whole GPU is also taken, whatever the deadlines, while
        the stall and a decode step after it fit in LIGHT_STALL of that room and no queued request is predicted
        late (a queue already late is an overload, where co-running's throughput counts more)."""
        if not view.work.seqs or (self.waiting and not self.admissible()):
            return False
        _, reqs, first = self.job
        predict, N = self.latency.predict, self.N
        rest = self._job_work(range(first, self.model.num_layers))
        stall = room = None  # (each computed once: the room is a pass over the decoding requests)
        if self.slo.absolute_ttft and not self._late_queued():
            stall, room = float(predict(rest, N)) + float(predict(view.work, N)), self._stall_room(now)
            if stall <= LIGHT_STALL * room:
                return True  # decode can lend it twice over: the prompts' TTFT is worth more
        due = min((self.deadline[r.id] for r in reqs if self.deadline.get(r.id, 0.0) > now), default=None)
        if due is None:
            return False
        if predict(rest, p, view.work, N - p) <= (due - now) * (1 - self.cfg.slo_margin):
            return False  # the split meets it
        whole = float(predict(rest, N))
        if now + whole > due:
            return False  # the whole GPU misses it too: no reason to stall decode
        if stall is None:
            stall, room = whole + float(predict(view.work, N)), self._stall_room(now)
        return stall <= room * (1 - self.cfg.slo_margin)

    def _stall_room(self, now: float) -> float:
        """The longest next token every decoding request can wait for: its loan (:meth:`_view`) without the
        ``BORROW_CAP`` cap, ``a - (T - n - 1) * BORROW_PACE * tpot`` (its other remaining steps then at that
        pace), at least its step budget; 0 while loans are off (``BORROW_SEATS``), inf without a TPOT target.
        Requests whose budget is already spent are left out, as in :meth:`_view`."""
        if self.slo.tpot is None:
            return math.inf
        if len(self.running) >= BORROW_SEATS * self.cfg.max_num_seqs:
            return 0.0
        return self._view(self._decoding(), now, cap=math.inf).loan

    def _prefill_need(self, now: float) -> int:
        """The smallest prefill size that ends the rest of the job (all its remaining layers) by the earliest
        deadline among its requests that can still meet theirs; the smallest size if none can."""
        _, reqs, first = self.job
        L, sizes = self.model.num_layers, self.pre_sizes
        left = min((self.deadline[r.id] for r in reqs if self.deadline.get(r.id, 0.0) > now), default=None)
        if left is None:
            return sizes[0]
        rest = self._job_work(range(first, L))
        predict, budget = self.latency.predict, (left - now) * (1 - self.cfg.slo_margin)
        return self._smallest(sizes, lambda p: predict(rest, p) <= budget, "prefill_need")

    def _schedule_decode(self, now: float, horizon: float | None) -> Batch | None:
        # (the arrays exist from ARRAYS_FROM running requests: below, not even asked)
        fast = self._array_decoders() if self._arrays is not None or len(self.running) >= ARRAYS_FROM else None
        decoders = fast if fast is not None else self._decoders()
        if not decoders:
            return None
        pre = self.inflight.get("prefill")
        if pre is None:  # nothing to prefill now (it would have launched first): the whole GPU
            batch = self._decode_launch(self._part("decode", self.N), decoders, fast is not None, now,
                                        self.arrival_horizon(horizon))
            self._note_decode_end(batch, now, None, 0)
            return batch
        p = pre[0].partition.num_sms
        if p >= self.N:
            return None  # prefill holds the whole GPU for this slice
        co = self._slice_work  # the prefill slice in flight
        d = self.N - p  # all that prefill left (its size already counted what decode needs)
        batch = self._decode_launch(self._part("decode", d), decoders, fast is not None, now, None, co, p,
                                    self._slice_end)
        self._note_decode_end(batch, now, co, p)
        return batch

    def _array_decoders(self) -> list[Request] | None:
        """``_decoders()`` read off the arrays, when they can tell, without touching the requests: every decoding
        slot's request is idle and has only its last sampled token to feed unless it is in a launch in flight or
        mid-prompt (``busy``, ``partial``: a few requests, the job's), so when none of those decodes, the decoders
        are the running requests with a token out, in running order: all of them, or all but those few (found by
        rank: ``running`` is sorted by it). None without the arrays or when one of those decodes (a preempted
        request recomputing)."""
        arrays = self._decode_arrays()
        if arrays is None:
            return None
        slot, dec = arrays.slot, arrays.dec
        idle = set()  # running requests with no token out: the job's
        for ids in (self.busy, self.partial):
            for i in ids:
                s = slot.get(i)
                if s is not None:
                    if dec[s]:
                        return None
                    idle.add(i)
        running = self.running
        if len(running) - arrays.decoding_count() != len(idle):  # (cannot be: a pass, to be sure)
            return [r for r in running if r.num_output]
        if not idle:
            return list(running)
        rank = self.rank
        at = sorted([bisect_left(running, rank[i], key=lambda r: rank[r.id]) for i in idle])
        out, prev = [], 0
        for k in at:
            out += running[prev:k]
            prev = k + 1
        out += running[prev:]
        return out

    def _decode_launch(self, partition: Partition, reqs: list[Request], fast: bool, now: float,
                       horizon: float | None, co: Work | None = None, co_sms: int = 0, co_end=None) -> Batch | None:
        """``_decode_batch`` of ``reqs``: from the arrays when ``fast`` (they are every decoding slot), unless
        the pool is short of a block for one of them (then the Python path, which evicts by priority); the
        arrays' mirror of the tables then catches up."""
        if fast:
            batch = self._array_decode(partition, reqs, now, horizon, co, co_sms, co_end)
            if batch is not None:
                return batch
        batch = self._decode_batch("decode", partition, reqs, now, horizon, co, co_sms, co_end)
        if self._arrays is not None:
            self._arrays.held_changed()
        return batch

    def _array_decode(self, partition: Partition, reqs: list[Request], now: float, horizon: float | None,
                      co: Work | None, co_sms: int, co_end) -> Batch | None:
        """``_decode_batch`` (its ``_one_step`` and ``_stretch``) over every decoding request, ``reqs``, from the
        arrays: who needs a block for the first step, the stretch's steps (first completion, max_decode_steps,
        riding past ends, the KV pool, the horizon) and the blocks it needs, each a few array operations, then
        one reservation (``BlockManager.reserve``) for every table that grows; the launch's requests are held by
        their ids (``_flight_ids``, :meth:`holds`) instead of in ``busy``. The same numbers as the Python path,
        whose per-request passes (five) and growing of every table (a Python statement each) cost ~300 us of a
        104-step stretch's decision over 256 requests on this VM (bench/RESULTS.md, issue 10). Each array
        operation costs 7-19k instructions whatever its length, so the answers that need none are not asked
        (the exact count of first-step blocks, the indices when every table grows). None, with nothing changed,
        when the pool cannot give every request its first step's block."""
        arrays, kv, cfg = self._arrays, self.kv, self.cfg
        bs, L = kv.block_size, self.model.num_layers
        dec = arrays._decoding()[0]
        left, comp, work = arrays.step(L)  # comp: each request's num_computed, where its first step writes
        arrays.refresh_held()
        had = arrays.held[dec]
        spare = had * bs - comp  # tokens that fit in its blocks: 0 needs a block for the first step (_one_step)
        # free blocks after the first step's: at least num_free less one each, counted only where that bound
        # could change an answer (a numpy call costs ~10k instructions)
        free, exact = kv.num_free - len(dec), False
        if free < 0:
            free, exact = kv.num_free - int(np.count_nonzero(spare == 0)), True
            if free < 0:
                return None
        if co_end is not None:
            horizon = co_end(work, partition.num_sms, now)
        extra = int(left.min())  # steps after the first: as _stretch counts them
        if cfg.max_decode_steps < extra:  # noqa: PLR1730 -- min(): see _stretch
            extra = cfg.max_decode_steps
        extra -= 1
        if self.ride_past_end and horizon is not None and co is None and not self.waiting \
                and len(self.running) < cfg.max_num_seqs and self.ahead is None:
            extra = max(extra, min(cfg.max_decode_steps, int(left.max()), self.model.max_position - int(comp.max()))
                        - 1)
        if extra > 0 and len(dec) * (extra // bs + 1) > free and not exact:
            free, exact = kv.num_free - int(np.count_nonzero(spare == 0)), True
        if extra > 0 and len(dec) * (extra // bs + 1) > free:  # the pool may be short: count
            extra = self._kv_steps_of(np.where(spare == 0, bs, spare) - 1, extra, free)
        if extra > 0 and horizon is not None:
            extra = self._steps_before(work, extra, horizon - now, partition.num_sms, co, co_sms)
        if extra < 0:  # noqa: PLR1730 -- max(): see _stretch
            extra = 0
        ids, id_list = arrays.decoding_ids()
        grown = np.flatnonzero(spare <= extra)  # short of comp + extra + 1 tokens
        if len(grown) == len(dec):  # (every table: a long stretch)
            blocks = (comp + (extra + bs)) // bs  # blocks_for(comp + extra + 1)
            kv.reserve(id_list, blocks.tolist(), int((blocks - had).sum()))
            arrays.held[dec] = blocks
        elif len(grown):
            blocks = (comp[grown] + (extra + bs)) // bs
            kv.reserve(ids[grown].tolist(), blocks.tolist(), int((blocks - had[grown]).sum()))
            arrays.held[dec[grown]] = blocks
        batch = Batch(partition, self.all_layers, DecodeChunks(reqs, comp, kv, ids), extra + 1)
        note_work(self.latency, batch, L, work)  # the simulator needs it too
        batch = self._launch("decode", batch, reqs, ())
        self._flight_ids = id_list
        return batch

    def _kv_steps_of(self, spare: np.ndarray, steps: int, free: int) -> int:
        """``_kv_steps`` over an array: the most steps (<= ``steps``, >= 0) that every request can grow by within
        ``free`` blocks; ``spare``: tokens that still fit in each request's blocks."""
        bs = self.kv.block_size

        def need(k: int) -> int:
            d = k - spare
            d = d[d > 0]
            return int(((d + bs - 1) // bs).sum())

        return most_steps(need, steps, free)

    def _slice_end(self, work: Work, d: int, now: float) -> float:
        """When the prefill slice in flight is predicted to end once the decode launch ``work`` on ``d`` SMs
        starts beside it now: the progress it made at the rate predicted so far, the rest at the rate next to
        this launch (as the simulator re-times it). A slice planned while decode was idle was predicted
        alone, and decode, launched right after it, slows it down: a stretch sized to that alone-end stopped
        short and decode was relaunched a step at a time until the slice really ended (on the Azure
        conversation trace ~18,000 one-step launches of the same requests on the same SMs)."""
        mark, done, duration = self._slice_rate
        if duration > 0.0:
            done += (now - mark) / duration
            if done > 1.0:  # noqa: PLR1730 -- min(): see add_work
                done = 1.0
        p = self.inflight["prefill"][0].partition.num_sms
        duration = float(self.latency.predict(self._slice_work, p, work, d))
        self._slice_rate = (now, done, duration)
        self.prefill_until = now + (1.0 - done) * duration
        return self.prefill_until

    def _note_decode_end(self, batch: Batch | None, now: float, co: Work | None, co_sms: int) -> None:
        """Keep what predicts the end of the decode launch just planned (a prefill slice that wants its SMs
        asks, rarely: predicted then) and, with the arrays, its requests' slots to advance when it returns."""
        if batch is None:
            return
        self._decode_end = (batch, now, co, co_sms)
        arrays = self._arrays
        if arrays is not None:
            self._decode_slots = (batch, arrays, arrays.slots(self.inflight["decode"][1]))

    def _predicted_decode_end(self) -> float:
        """When the decode launch in flight (or the last one) is predicted to end."""
        if self._decode_end is not None:
            batch, now, co, co_sms = self._decode_end
            times = step_times(self.latency, batch_work(self.latency, batch, self.model.num_layers), batch.steps,
                               batch.partition.num_sms, co, co_sms)
            self._decode_until, self._decode_end = now + float(times.sum()), None
        return self._decode_until

    def holds(self, req_id: int) -> bool:
        """``Scheduler.holds``, and the requests of a decode launch planned from the arrays (not in ``busy``: while
        it is in flight nothing bullet plans reads ``busy`` for them, as the decode lane plans nothing then and
        the prefill lane takes only queued requests)."""
        if super().holds(req_id):
            return True
        ids = self._flight_ids
        return ids is not None and req_id in ids

    def on_result(self, res: StepResult) -> list[Request]:
        if res.batch.partition.lane == "decode":
            self._flight_ids = None
        arrays = self._arrays
        if arrays is None:
            self._decode_slots = None
            return super().on_result(res)
        batch, reqs, _ = self.inflight[res.batch.partition.lane]
        done = super().on_result(res)
        if batch.layers.stop == self.model.num_layers:
            pending = self._decode_slots
            if pending is not None and pending[0] is batch and pending[1] is arrays:
                arrays.advance(pending[2], batch.steps)
            else:  # a prefill job's first tokens (or a launch from before the arrays were made)
                for r in reqs:
                    arrays.sync(r)
        if res.batch.partition.lane == "decode":
            self._decode_slots = None
        return done

    # ---- the decode size -----------------------------------------------------------------------------
    def _decoding(self) -> list[Request]:
        """Running requests not inside the prefill job (``_view`` keeps those with a token out: decoding)."""
        job = self.job
        if not job or not any(r.num_output for r in job[1]):  # (a job member has outputs after a preemption)
            return self.running
        skip = {r.id for r in job[1]}
        return [r for r in self.running if r.id not in skip]

    def _view(self, reqs, now: float, cap: float | None = None) -> DecodeView:
        """One pass over ``reqs`` that have a token out (decoding): the Work of their next step, the
        tightest per-step time that keeps every TPOT, and the tightest loan. Request r, with n of its T
        tokens out and the first at t1, keeps TPOT if its T - n remaining steps average at most
        ``b = a / (T - n)``, ``a = tpot * (T - 1) - (now - t1)``: slack it built up may be spent, a deficit
        must be made up. Its loan is ``a - (T - n - 1) * BORROW_PACE * tpot`` (the next step may take what
        leaves its other steps that pace), at most ``cap`` (default ``BORROW_CAP``) times ``tpot`` and at least ``b``; ``b`` while
        ``BORROW_SEATS`` of the seats are taken. A request whose budget is already spent is left out (it
        misses whatever the split); inf without a TPOT target."""
        tpot = self.slo.tpot
        lend = tpot is not None and len(self.running) < BORROW_SEATS * self.cfg.max_num_seqs
        cap, pace = ((BORROW_CAP if cap is None else cap) * tpot, BORROW_PACE * tpot) if lend else (0.0, 0.0)
        arrays = self._decode_arrays() if reqs is self.running else None
        if arrays is not None:
            return arrays.view(now, lend, cap, pace, self.model.num_layers)
        n = kv = max_kv = 0
        best = loan = math.inf
        for r in reqs:
            if not r.num_output:
                continue
            n += 1
            c = r.num_computed + 1
            kv += c
            if c > max_kv:  # noqa: PLR1730 -- an if beats a max() call in this per-request loop
                max_kv = c
            left = r.max_new_tokens - r.num_output
            if tpot is None or left <= 0 or r.first_token_time is None:
                continue
            a = tpot * (r.max_new_tokens - 1) - (now - r.first_token_time)
            if a <= 0:
                continue
            b = a / left
            if b < best:  # noqa: PLR1730
                best = b
            if lend:
                x = a - (left - 1) * pace
                if x > cap:  # noqa: PLR1730
                    x = cap
                if x < b:  # noqa: PLR1730
                    x = b
                if x < loan:  # noqa: PLR1730
                    loan = x
        if not lend:
            loan = best
        return DecodeView(new_work(Work, (self.model.num_layers, n, n, float(kv), kv, n, True, max_kv)), best, loan)

    def _decode_arrays(self) -> DecodeArrays | None:
        """The running requests' :class:`DecodeArrays`, made when ARRAYS_FROM of them run and dropped at
        ARRAYS_UNTIL (below a few dozen requests a Python pass beats numpy's per-call cost); None between."""
        n = len(self.running)
        if self._arrays is None and n >= ARRAYS_FROM:
            self._arrays = DecodeArrays(self.slo.tpot, self.running, self.kv)
        elif self._arrays is not None and n <= ARRAYS_UNTIL:
            self._arrays = None
        return self._arrays

    def step_budget(self, reqs, now: float) -> float:
        """The tightest per-step time among decoding ``reqs`` that keeps every TPOT (see :meth:`_view`)."""
        return self._view(reqs, now).budget

    def step_loan(self, reqs, now: float) -> float:
        """The tightest next-step time among decoding ``reqs`` with slack lent (see :meth:`_view`)."""
        return self._view(reqs, now).loan

    def _smallest(self, sizes: list[int], fits, search: str) -> int:
        """The smallest of ascending ``sizes`` for which ``fits(size)`` holds (the largest if none does),
        by bisection: predicted time falls as SMs grow. Starts from this ``search``'s last answer (the split
        moves little between decisions): two predictions when it still holds, else bisection over the side
        they leave (above it when it misses, below the size under it when that fits). With ``fits`` monotone
        in the size, as bisection assumes, the answer is bisection's over all of ``sizes``."""
        i = self._last.get(search)
        lo, hi, top = 0, len(sizes) - 1, True  # (top: whether fits(sizes[hi]) is still to be asked)
        if i is not None and i <= hi:
            if not fits(sizes[i]):
                lo = i + 1
            elif i == 0 or not fits(sizes[i - 1]):
                return sizes[i]
            else:
                hi, top = i - 1, False
        self._last[search] = i = self._bisect(sizes, fits, lo, hi, top)
        return sizes[i]

    @staticmethod
    def _bisect(sizes: list[int], fits, lo: int = 0, hi: int | None = None, top: bool = True) -> int:
        """The index :meth:`_smallest` answers, by bisection alone over ``sizes[lo:hi + 1]`` (``top``: whether
        ``fits(sizes[hi])`` is still to be asked; if it fails, ``hi``)."""
        if hi is None:
            hi = len(sizes) - 1
        if lo > hi or (top and not fits(sizes[hi])):  # (lo > hi: the last answer, the largest, missed)
            return hi
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(sizes[mid]):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _decode_knee(self, work: Work, co: Work | None, slack: float | None = None, search: str = "decode_knee",
                     seen: dict[int, float] | None = None) -> int:
        """The decode size past which more SMs barely speed ``work`` up (within ``slack`` of the largest
        size's step; None: ``KNEE``, read when called): memory-bound decode saturates HBM well before it has every SM
        (docs/background.md: 64 of 132 SMs pull 85 % of the whole GPU's bandwidth on the H200). ``search``: its
        warm start's name, one per slack. ``seen``: filled with the step predicted on each size asked."""
        predict, N, sizes = self.latency.predict, self.N, self.dec_sizes
        if not work.seqs:
            return sizes[0]
        top = sizes[-1]
        t_top = float(predict(work, top, co, N - top))
        best = t_top * (1 + (KNEE if slack is None else slack))

        def fits(d: int) -> bool:  # (the largest size fits by definition: not predicted twice)
            t = t_top if d == top else predict(work, d, co, N - d)
            if seen is not None:
                seen[d] = t
            return t <= best

        return self._smallest(sizes, fits, search)

    def _decode_need(self, view: DecodeView, co: Work | None) -> int:
        """The smallest decode size whose predicted next step, next to ``co`` on the rest of the GPU, fits the
        view's loan with ``slo_margin`` to spare; the largest if none."""
        sizes = self.dec_sizes
        budget = view.loan * (1 - self.cfg.slo_margin)
        if not view.work.seqs or budget == math.inf:
            return sizes[0]
        work, predict, N = view.work, self.latency.predict, self.N
        return self._smallest(sizes, lambda d: predict(work, d, co, N - d) <= budget, "decode_need")

    def _order(self, now: float, build: bool | None = None) -> None:
        """Order the fresh part of the queue (preempted requests stay in front, in rank order): the requests
        predicted to meet their TTFT by deadline (or shortest first if that still meets every deadline), the
        rest merged in by deadline + LATE_GRACE targets. With admission control, the rest are rejected. The
        fresh requests come sorted both ways from ``_by_deadline`` and ``_by_length`` (kept as they come and go).
        ``build``: whether the queue is put in that order (None: while a seat is free for a fresh request, see
        :meth:`_late_ones`); the late set and the rejections are made either way."""
        waiting, rank = self.waiting, self.rank
        k = 0
        while k < len(waiting) and waiting[k].id in rank:
            k += 1
        if len(waiting) - k < 1:
            return
        if len(waiting) - k != len(self._by_deadline):
            raise SchedulingError(f"{len(waiting) - k} fresh requests queued but {len(self._by_deadline)} in the "
                                  f"deadline order (a request left the queue without _admit or abort)")
        per_token = self._prefill_per_token()
        free, releases = self._seat_releases(now, k, len(waiting) - k)
        if self._shed and self._lull(now):
            self._shed.clear()
        shed, by_deadline = self._shed, self._by_deadline
        if len(by_deadline) == 1:  # one fresh request (a light load's usual queue): on time, nothing moves
            deadline, i, known, _, _ = by_deadline[0]
            cost = known * per_token
            if now + cost <= deadline and not (0 <= -free < len(releases) and releases[-free] + cost > deadline) \
                    and not (shed and i in shed):
                return
        # seats[c]: when the c-th request kept (from 0) gets its seat: release c - free (-inf: a seat is free now)
        seats = releases[-free:] if free < 0 else [-math.inf] * min(free, len(by_deadline)) + releases
        if len(seats) < len(by_deadline):
            seats += [-math.inf] * (len(by_deadline) - len(seats))
        # Moore-Hodgson: add requests in deadline order (a job is ordered when the prefill lane is free: from
        # now); when one would end past its deadline, drop the longest prompt kept so far (the latest due among
        # equals: perhaps itself) to the late set. On one machine that leaves the fewest requests late.
        # kept: a max-heap of the kept lengths, of (-known, -deadline, -id, entry) items (made on arrival): the
        # longest first, then the latest due
        kept: list[tuple[int, float, int, tuple]] = []
        late: list[tuple] = []  # the items' entries: (deadline, id, known, request, (late key, id, request))
        push, pop, pushpop = heapq.heappush, heapq.heappop, heapq.heappushpop
        t, c = now, -1  # c: the kept requests less one (the seat the latest waits for)
        # (a plain list until the first drop, then a heap: the same requests are dropped, as pops take the
        # largest item of a total order whatever the heap's layout)
        heaped = False
        for deadline, i, known, _, item in by_deadline:
            if shed and i in shed:
                late.append(item[3])
                continue
            cost = known * per_token
            t += cost
            c += 1
            if t > deadline or seats[c] + cost > deadline:  # its prefill or its seat comes too late
                if not heaped:
                    kept.append(item)
                    heapq.heapify(kept)
                    heaped = True
                    x = pop(kept)
                else:
                    x = pushpop(kept, item)
                t += x[0] * per_token
                late.append(x[3])
                c -= 1
            elif heaped:
                push(kept, item)
            else:
                kept.append(item)
        on_time = self._late_ones(now, late, per_token, free > 0 if build is None else build)
        if on_time is None:  # (no seat for a fresh request: the queue's order is built when there is one)
            return
        if k:
            for _ in range(len(waiting) - k):
                waiting.pop()
        else:
            waiting.clear()
        waiting.extend(on_time)

    def _seat_releases(self, now: float, back: int, fresh: int) -> tuple[int, list[float]]:
        """Seats free for the ``fresh`` requests of the queue now (the ``back`` preempted ones ahead of them
        take theirs first), and -- when they are fewer than ``fresh`` -- when the running requests are predicted
        to release theirs, sorted: each decodes its remaining tokens at the step the model predicts for
        today's decode batch on the decode lane's SMs (its knee when it has none). Fresh request ``j`` past
        the free seats waits for release ``j - free``; the queue's own releases, further out, are not
        predicted. Under overload the seats, not prefill, gate admission (sharegpt, paper SLOs, 11.75 req/s:
        all 256 taken from 24 s to 104 s of a 128 s run; bench/RESULTS.md)."""
        free = self.cfg.max_num_seqs - len(self.running) - back
        if fresh <= free:
            return free, []
        arrays = self._decode_arrays()  # (the arrays' Work: gathered once for this and the decision's view)
        work = arrays.work(self.model.num_layers) if arrays is not None else self._view(self.running, now).work
        if not work.seqs:
            return free, []
        d = self._decode_sms()
        if d:
            step = float(self.latency.predict(work, d))
        else:  # the knee's search predicted its step on the knee already
            seen: dict[int, float] = {}
            # (its own warm start: the split's knee, next to the job's slice, answers another size, and one
            # search name for both made each of a new job's two knees miss the other's answer and bisect)
            d = self._decode_knee(work, None, search="seat_knee", seen=seen)
            step = float(seen[d] if d in seen else self.latency.predict(work, d))
        if arrays is not None:  # every running request's tokens left, from the arrays (no Python pass)
            return free, (now + step * arrays.sorted_left()[:fresh - free]).tolist()
        left = sorted([r.max_new_tokens - r.num_output for r in self.running])
        return free, [now + step * n for n in left[:fresh - free]]

    def _late_ones(self, now: float, late: list[tuple], per_token: float, build: bool = True) -> list[Request] | None:
        """Count the requests predicted to miss their TTFT (``late``: the entries of ``_order``'s items); reject them
        (admission control) or merge each in before the first on-time request due after its key (its deadline
        + LATE_GRACE targets). Returns the queue's new fresh part: the on-time requests shortest first where
        that breaks none of their deadlines, else by deadline, with the late ones merged in; None, without
        building it, when not ``build`` and nobody is rejected. ``_order`` builds it only while a seat is free
        for a fresh request: with none, nobody reads the fresh part's order before the next ``_order`` (which
        builds it afresh from the sorted lists; a job forms only after one, and only a job's decisions read the
        order without ordering first), and with seats full the two walks were ~a fifth of the order's
        instructions (64 queued: bench/policy_decision.py --callgrind). The late set is kept up to date at every
        order: the mixed launch's check reads it."""
        skip = {e[1] for e in late}
        fresh_late = skip - self._late
        if fresh_late:
            self.num_late += len(fresh_late)
            self._late |= fresh_late
        reject = self.cfg.admission_control
        if not build and not (reject and late):
            return None
        keyed = [] if reject else sorted([e[4] for e in late])  # ((late key, id, request): _late_key's sum)
        out = None
        if len(self._by_deadline) - len(skip) > 1:
            out = self._merged(self._by_length, 2, skip, keyed, now, per_token)
        if out is None:
            out = self._merged(self._by_deadline, 0, skip, keyed)
        if reject:  # (after the walks: _forget changes the lists)
            for e in late:
                r = e[3]
                ttft = now - r.arrival + r.known * per_token
                r.error = (f"rejected by admission control: predicted TTFT {1e3 * ttft:.0f} ms > target "
                           f"{1e3 * self.target[r.id]:.0f} ms")
                r.finish_time = now
                self.rejected.append(r)
                self._forget(r.id)
        return out

    @staticmethod
    def _merged(order: list[tuple], due: int, skip: set[int], keyed: list[tuple], t: float | None = None,
                per_token: float = 0.0) -> list[Request] | None:
        """The requests of ``order`` (``_by_deadline`` or ``_by_length``, whose entries hold the deadline at
        ``due``) not in ``skip``, with ``keyed`` ((key, id, request), sorted) merged in, each before the first of
        them due after its key. With ``t`` (``_by_length``: shortest first), None as soon as one of them, prefilled
        one after another from ``t`` at ``per_token`` a token, would end past its deadline."""
        out: list[Request] = []
        i, n = 0, len(keyed)
        key = keyed[0][0] if n else math.inf
        for e in order:
            if e[1] in skip:
                continue
            d = e[due]
            if t is not None:
                t += e[0] * per_token
                if t > d:
                    return None
            while key < d:
                out.append(keyed[i][2])
                i += 1
                key = keyed[i][0] if i < n else math.inf
            out.append(e[3])
        if i < n:
            out.extend([x[2] for x in keyed[i:]])
        return out

    def _probe(self, tokens: int) -> Work:
        """A prefill of ``tokens`` tokens in 512-token prompts: what prefill speed is judged on."""
        n = max(1, tokens // 512)
        return Work(self.model.num_layers, tokens, n, n * 512 * 513 / 2, tokens, n, True, 512)

    def _prefill_per_token(self) -> float:
        """Predicted prefill seconds per token on the SMs prefill has now (a token_target-sized batch)."""
        d = self._decode_sms()
        p = self.N - d if d < self.N else self.N
        t = self._per_token.get(p)
        if t is None:  # (one number per prefill size: the model and the probe are fixed)
            t = self._per_token[p] = float(self.latency.predict(self._probe(self.token_target), p)) / self.token_target
        return t

    def _take_whole(self, alone: bool = False) -> tuple[list[Chunk], list[Request]]:
        """Admit whole prompts from the head of the queue up to ``token_target`` tokens (the first one whatever
        its length; only it with ``alone``), under the KV rules of ``base.py``."""
        chunks: list[Chunk] = []
        reqs: list[Request] = []
        tokens, bs = 0, self.kv.block_size
        while self.admissible():
            r = self.waiting[0]
            n = r.known - len(self._hits(r)) * bs
            if reqs and (alone or tokens + n > self.token_target):
                break
            self._admit(r)
            self.kv.allocate(r.id, r.known)
            chunks.append(self._prefill_chunk(r, r.remaining))
            reqs.append(r)
            self.busy.add(r.id)
            tokens += r.remaining
        return chunks, reqs

    def abort(self, req_id: int, now: float) -> Request | None:
        r = super().abort(req_id, now)
        self._forget(req_id)  # (a running request's went with _finish; a queued one's goes here)
        return r

    def _admit(self, req: Request) -> None:
        self._unqueue(req.id)
        super()._admit(req)
        if self._arrays is not None:
            self._arrays.join(req)

    def preempt(self, req: Request) -> None:
        super().preempt(req)
        if self._arrays is not None:
            self._arrays.leave(req)

    def _finish(self, r: Request, now: float) -> None:
        super()._finish(r, now)
        self._forget(r.id)
        if self._arrays is not None:
            self._arrays.leave(r)

    def _unqueue(self, req_id: int) -> None:
        """Take a fresh request out of the sorted queue lists (admitted, aborted or rejected)."""
        keys = self._queued.pop(req_id, None)
        if keys is not None:
            for lst, key in zip((self._by_deadline, self._by_length), keys):
                del lst[bisect_left(lst, key[:2])]

    def _forget(self, req_id: int) -> None:
        self._unqueue(req_id)
        self.deadline.pop(req_id, None)
        self.target.pop(req_id, None)
        self._late.discard(req_id)
        self._shed.discard(req_id)
