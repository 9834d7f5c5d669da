"""Preemption under KV pressure: priority is admission order, a request evicts only idle, never-preempted
requests of lower priority, and a preempted request is re-admitted only when it and everyone ahead of it can
finish. So no request is preempted twice, recomputation is bounded, and no policy thrashes
(bullet/policies/base.py explains the argument)."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bullet.config import GPUS, MODELS, SchedulerConfig
from bullet.engine import serve
from bullet.kvcache import BlockManager
from bullet.policies import make_scheduler
from bullet.policies.base import Scheduler
from bullet.request import Request
from bullet.traces import synthesize
from simulator import simulate
from tests.latency import LinearLatency
from tests.test_scheduler import EchoExecutor

MODEL = MODELS["llama-3.1-8b"]
GPU = GPUS["h200"]
L = MODEL.num_layers
# "+async": with async scheduling (a launch planned while the one before it runs; requests in flight are never
# victims, so a request short of KV may wait a launch instead of evicting one)
POLICIES = ["chunked", "prefill-first", "static-split", "naive-concurrent", "bullet", "chunked+async",
            "prefill-first+async"]
# static-split halves the GPU (64 / 68 SMs), which LinearLatency makes each lane about 2x slower: its span may
# legitimately be up to ~2.4x chunked's (seen over 200 random workloads); the whole-GPU policies stay within
# 1.4x; bullet (decode held at 64 SMs here) splits it too. The bug this guards against made prefill-first 3-27x slower than chunked on the same inputs.
# Tiny workloads under a small token budget go further for the split policies: 4 requests, a 64-token budget
# and a 9-block pool (hypothesis seed 243544) took static-split 3.08x chunked's 0.20 s: its half-GPU decode lane
# was busy 0.60 s of the 0.62 s span, in 9 launches as chunked's 9, with 2 preemptions in each and none twice.
SPAN_FACTOR = {"prefill-first": 2.0, "naive-concurrent": 2.0, "static-split": 4.0, "bullet": 4.0, "chunked+async": 2.0,
               "prefill-first+async": 2.0}


class Spy:
    """Records, for every preemption, who asked (through ``_reserve``), the victim and its state."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched, self.asker, self.events = sched, None, []
        reserve, preempt = sched._reserve, sched.preempt

        def spy_reserve(req, n):
            self.asker = req
            try:
                return reserve(req, n)
            finally:
                self.asker = None

        def spy_preempt(victim):
            s = self.sched
            self.events.append((self.asker, victim, s.rank[victim.id], victim.num_preemptions,
                                s.holds(victim.id) or victim.id in s.busy, victim.num_computed,
                                s.rank[self.asker.id]))
            preempt(victim)

        sched._reserve, sched.preempt = spy_reserve, spy_preempt
        self.hits: dict[int, list[int]] = {}  # per request, its prefix-cache hit (tokens) at each admission
        admit = sched._admit

        def spy_admit(req):
            admit(req)
            self.hits.setdefault(req.id, []).append(req.num_computed)

        sched._admit = spy_admit


def run(policy, reqs, num_blocks, prefix_caching=False, **cfg):
    policy, _, mode = policy.partition("+")
    cfg["async_scheduling"] = mode == "async"
    if policy == "static-split":
        cfg = {"prefill_sms": 68, "layers_per_step": 8, **cfg}
    if policy == "bullet":  # one decode size: its KV behaviour, not its TPOT squeeze, is under test here
        cfg = {"decode_sizes": (64,), **cfg}
    lat = LinearLatency(L)
    kv = BlockManager(num_blocks, 16, prefix_caching)
    sched = make_scheduler(SchedulerConfig(policy=policy, **cfg), MODEL, GPU, kv, lat)
    spy = Spy(sched)
    steps = []

    def on_step(res):
        steps.append(res)
        kv.check()

    done = serve(reqs, sched, EchoExecutor(lat, L, GPU), on_step=on_step)
    return done, steps, sched, spy


def computed_tokens(steps, reqs) -> dict[int, int]:
    """Positions each request ran through the model (counted once per full pass: at the first layer slice), up
    to its last one (a decode stretch's row may run past it, its tokens dropped: ``Scheduler.ride_past_end``)."""
    last = {r.id: r.prompt_len + r.max_new_tokens - 1 for r in reqs}
    out: dict[int, int] = {}
    for s in steps:
        if s.batch.layers.start == 0:
            for c in s.batch.chunks:
                stop = min(c.start + c.num_tokens + s.batch.steps - 1, last[c.req_id])
                out[c.req_id] = out.get(c.req_id, 0) + stop - c.start
    return out


workloads = st.fixed_dictionaries({
    "seed": st.integers(0, 2**32 - 1),
    "n": st.integers(3, 30),
    "prompt_max": st.integers(20, 1500),
    "output_max": st.integers(2, 300),
    "rate": st.floats(2.0, 300.0),
    "slack": st.floats(1.0, 3.0),  # pool size / the largest request's final size
    "budget": st.sampled_from([64, 256, 2048]),
    "prefixes": st.booleans(),  # prompts share prefixes (trace hash ids over 32-token blocks), cache on
})


def make(w) -> tuple[list[Request], int]:
    rng = np.random.default_rng(w["seed"])
    t = np.cumsum(rng.exponential(1 / w["rate"], w["n"]))
    reqs = []
    for i in range(w["n"]):
        plen = int(rng.integers(1, w["prompt_max"] + 1))
        hashes = None
        if w["prefixes"]:  # one of 3 families up to a random cut, then ids of its own
            nh, cut, fam = -(-plen // 32), int(rng.integers(0, 40)), int(rng.integers(0, 3))
            hashes = tuple(fam * 1000 + k if k < cut else 10**6 + i * 1000 + k for k in range(nh))
        reqs.append(Request(i, float(t[i]), plen, int(rng.integers(1, w["output_max"] + 1)), hash_ids=hashes,
                            hash_block=32))
    biggest = max(-(-(r.prompt_len + r.max_new_tokens) // 16) for r in reqs)
    return reqs, max(biggest, int(biggest * w["slack"]))


def fresh(reqs):
    return [Request(r.id, r.arrival, r.prompt_len, r.max_new_tokens, hash_ids=r.hash_ids, hash_block=r.hash_block)
            for r in reqs]


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=workloads)
def test_preemption_is_bounded(policy, w):
    reqs, blocks = make(w)
    cache = w["prefixes"]
    done, steps, sched, spy = run(policy, fresh(reqs), blocks, cache, max_batched_tokens=w["budget"])
    assert len(done) == len(reqs)
    for r in done:
        assert r.output_ids == list(range(r.prompt_len, r.prompt_len + r.max_new_tokens))
        assert r.num_preemptions <= 1  # the bound: each request is preempted at most once
    for _asker, _victim, rank, before, busy, _, asker_rank in spy.events:
        assert asker_rank < rank  # only lower priority is evicted
        assert before == 0 and not busy  # never one preempted before, never one in flight
    # every position of every request is computed once, except what came from the prefix cache, plus what
    # each preemption threw away: per admission, from its cache hit to where it stopped
    stops: dict[int, list[int]] = {}
    for _, victim, _, _, _, had, _ in spy.events:
        stops.setdefault(victim.id, []).append(had)
    ran = computed_tokens(steps, done)
    for r in done:
        ends = stops.get(r.id, []) + [r.prompt_len + r.max_new_tokens - 1]
        assert ran.get(r.id, 0) == sum(e - h for e, h in zip(ends, spy.hits[r.id], strict=True))
        if not cache:
            assert spy.hits[r.id] == [0] * len(ends)
    assert sched.kv.num_free == blocks and not sched.kv.tables and not sched.rank
    if policy != "chunked":
        base, _, _, _ = run("chunked", fresh(reqs), blocks, cache, max_batched_tokens=w["budget"])
        span = max(r.finish_time for r in done) - reqs[0].arrival
        chunked = max(r.finish_time for r in base) - reqs[0].arrival
        assert span <= SPAN_FACTOR[policy] * chunked


def test_victim_waits_until_everyone_ahead_can_finish():
    """A hand-made case. Pool of 10 blocks of 16 tokens. A (prompt 60, 60 new: 8 blocks at most) is admitted
    before B (prompt 60, 40 new: 7 blocks). They decode side by side; when A's context reaches 80 tokens (its
    sixth block) the pool is empty, so B (lower priority) is evicted with 80 tokens computed. B may come back
    only when A's remaining growth (8 - 6 = 2 blocks) plus B's 7 fit the free blocks (10 - 6 = 4): i.e. once
    A finishes. Before the fix B came back at once (its first chunk fit) and was evicted again."""
    a, b = Request(0, 0.0, 60, 60), Request(1, 0.0, 60, 40)
    _done, steps, _sched, spy = run("chunked", [a, b], 10)
    assert [(e[0].id, e[1].id, e[5]) for e in spy.events] == [(0, 1, 80)]
    assert a.num_preemptions == 0 and b.num_preemptions == 1
    readmitted = min(s.start for s in steps if s.batch.layers.start == 0
                     and any(c.req_id == 1 and c.start == 0 for c in s.batch.chunks) and s.start > 0)
    assert readmitted >= a.finish_time
    assert b.output_ids == list(range(60, 100))


@pytest.mark.parametrize("policy", ["prefill-first", "static-split", "naive-concurrent"])
def test_issue_reproduction_long_prompts(policy):
    """The reproduction from the issue: 200 prompts of 16,000 tokens with 1,000 outputs at 1.5 req/s on an
    H200's pool, roofline latency. prefill-first simulated 66,378 s with a median request preempted 999 times,
    against chunked's 230 s; now every policy stays within 1.5x of chunked (static-split within 1.5x too, its
    prefill lane having 96 of 132 SMs), and no request is preempted twice."""
    reqs = synthesize(200, 1.0, seed=0, input_mean=16000, input_cv=0, output_mean=1000, output_cv=0)
    span = (reqs[-1].arrival - reqs[0].arrival)
    for r in reqs:  # rescale to 1.5 req/s as --rate does: (n - 1) / span
        r.arrival *= (len(reqs) - 1) / span / 1.5
    copy = [Request(r.id, r.arrival, r.prompt_len, r.max_new_tokens) for r in reqs]
    base = simulate(copy, MODEL, GPU, SchedulerConfig(policy="chunked")).summary
    res = simulate(reqs, MODEL, GPU, SchedulerConfig(policy=policy))
    assert res.summary["duration_s"] <= 1.5 * base["duration_s"]
    assert res.columns["preemptions"].max() <= 1
