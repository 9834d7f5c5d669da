"""The ``bullet`` policy on the simulator: TPOT step budgets and decode sizes by hand, deadline order, lateness,
no starvation, admission control, partition legality, and determinism. Latency from tests/latency.py
(hand-computable: time scales as 132 / SMs)."""

from __future__ import annotations

import bisect
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bullet.config import GPUS, MODELS, SchedulerConfig, SloConfig, check_corun
from bullet.engine import serve
from bullet.kvcache import BlockManager
from bullet.perfmodel import Work
from bullet.policies import make_scheduler
from bullet.policies.base import SchedulingError
from bullet.policies.bullet import LATE_GRACE
from bullet.request import Request
from simulator import SimExecutor
from tests.latency import LinearLatency

MODEL, GPU = MODELS["llama-3.1-8b"], GPUS["h200"]
L = MODEL.num_layers


def make(slo=None, num_blocks=6000, lat=None, **cfg):
    lat = lat or LinearLatency(L)
    kv = BlockManager(num_blocks, 16)
    sched = make_scheduler(SchedulerConfig(policy="bullet", **cfg), MODEL, GPU, kv, lat, slo=slo or SloConfig())
    return sched, lat


def run(reqs, slo=None, **cfg):
    sched, lat = make(slo, **cfg)
    steps = []
    done = serve(reqs, sched, SimExecutor(lat, L, GPU), on_step=steps.append)
    return done, steps, sched


def decoding(i, out, first, max_new, computed):
    r = Request(i, 0.0, 100, max_new)
    r.num_output, r.first_token_time, r.num_computed = out, first, computed
    return r


def test_step_budget_by_hand():
    sched, _ = make(SloConfig(tpot=0.1))
    # 11 tokens at 0.1 s each: 1.0 s for the 10 steps after the first. 5 steps done in 0.5 s: 0.1 s each left.
    assert sched.step_budget([decoding(0, 6, 0.0, 11, 105)], 0.5) == pytest.approx(0.1)
    # the same request 0.3 s behind: its 5 remaining steps must make up for it, 0.04 s each
    assert sched.step_budget([decoding(0, 6, 0.0, 11, 105)], 0.8) == pytest.approx(0.04)
    # ahead of schedule: slack may be spent
    assert sched.step_budget([decoding(0, 6, 0.0, 11, 105)], 0.25) == pytest.approx(0.15)
    # a request already past its whole budget is left out; the tightest of the rest wins
    reqs = [decoding(0, 6, 0.0, 11, 105), decoding(1, 6, -1.0, 11, 105), decoding(2, 2, 0.7, 101, 101)]
    assert sched.step_budget(reqs, 0.8) == pytest.approx(0.04)
    assert sched.step_budget(reqs[1:], 0.8) == pytest.approx((0.1 * 100 - 0.1) / 99)
    assert make(SloConfig(tpot=None))[0].step_budget(reqs, 0.8) == math.inf


def test_step_loan_by_hand():
    """A request ahead of 95 % of its target lends its next step what its other steps would save at that pace,
    at most 1.3 targets and never less than its step budget; the tightest loan wins; none while 3/4 of the
    seats are taken."""
    sched, _ = make(SloConfig(tpot=0.1), max_num_seqs=8)
    # 11 tokens, 5 out at 0.5 s: a = 0.5 s for 5 steps. Loan 0.5 - 4 * 0.095 = 0.12 s (budget 0.1)
    assert sched.step_loan([decoding(0, 6, 0.0, 11, 105)], 0.5) == pytest.approx(0.12)
    # at 0.25 s: a = 0.75, 0.75 - 0.38 = 0.37 capped at 0.13, below the budget 0.15: the budget
    assert sched.step_loan([decoding(0, 6, 0.0, 11, 105)], 0.25) == pytest.approx(0.15)
    # 0.3 s behind (a = 0.2): 0.2 - 0.38 < 0.04, the budget: a late request lends nothing
    assert sched.step_loan([decoding(0, 6, 0.0, 11, 105)], 0.8) == pytest.approx(0.04)
    # 101 tokens, the first at -0.2 s and 2 out at 0.5 s (a = 0.1 * 100 - 0.7 = 9.3 for 99 steps, behind the
    # 95 % pace): 9.3 - 98 * 0.095 = -0.01, so its budget 9.3 / 99; next to request 0 (0.12) the tightest
    reqs = [decoding(0, 6, 0.0, 11, 105), decoding(2, 2, -0.2, 101, 101)]
    assert sched.step_loan(reqs, 0.5) == pytest.approx(9.3 / 99)
    # 6 of 8 seats taken: no loans, the even pace
    sched.running.extend(decoding(10 + i, 1, 0.0, 11, 101) for i in range(6))
    assert sched.step_loan([decoding(0, 6, 0.0, 11, 105)], 0.5) == pytest.approx(0.1)
    assert make(SloConfig(tpot=None))[0].step_loan(reqs, 0.8) == math.inf


@pytest.fixture
def split_only(monkeypatch):
    """No mixed launches (``Bullet._mixed_time``): the tests of the split and its slices."""
    from bullet.policies.bullet import Bullet

    monkeypatch.setattr(Bullet, "_mixed_time", lambda self, now, view: None)


def test_a_job_runs_its_rest_at_once_when_nothing_can_change_before_it_ends(split_only):
    """Slices let the split and the order be re-decided between them; with nobody waiting and no arrival due
    before the job's predicted end nothing can change them, so the rest of the job is one launch. LinearLatency:
    request 1's 3000-token job takes (2e-3 + 0.03) s on the whole GPU, over 0.03 s on what decode leaves."""
    slo = SloConfig(ttft=None, tpot=0.05)
    def lone():
        return [Request(0, 0.0, 2000, 2000), Request(1, 1.0, 3000, 5)]

    _, steps, _ = run(lone(), slo, layers_per_step=8)
    job1 = [s for s in steps if s.batch.lane == "prefill" and s.batch.chunks[0].req_id == 1]
    assert [s.batch.layers for s in job1] == [range(L)] and job1[0].batch.partition.num_sms < 132
    # request 2 arrives 10 ms into request 1's job: that job keeps 8-layer slices (the arrival is due before its
    # end; then request 2 waits behind it); request 2's own job, nobody behind it, is one launch
    _, steps, _ = run(lone() + [Request(2, 1.01, 3000, 5)], slo, layers_per_step=8)
    job1 = [s for s in steps if s.batch.lane == "prefill" and s.batch.chunks[0].req_id == 1]
    job2 = [s for s in steps if s.batch.lane == "prefill" and s.batch.chunks[0].req_id == 2]
    assert [s.batch.layers for s in job1] == [range(i, i + 8) for i in range(0, L, 8)]
    assert [s.batch.layers for s in job2] == [range(L)]


def mixed_case(tpot, ttft=None, both=False):
    """Request 0 (100 tokens, 2000 to generate) decodes alone on the whole GPU from ~1 ms; at 1.0 s request 1
    (3000 tokens; with ``both`` request 2 too) arrives. Returns the prefill launches from 1.0 s and the run's steps."""
    reqs = [Request(0, 0.0, 100, 2000), Request(1, 1.0, 3000, 5)] + ([Request(2, 1.0, 3000, 5)] if both else [])
    _, steps, sched = run(reqs, SloConfig(ttft=ttft, tpot=tpot), layers_per_step=8)
    return [s for s in steps if s.batch.lane == "prefill" and s.start >= 1.0], steps, sched


def mixed_time(batch):
    """LinearLatency, whole GPU, all layers: 2e-3 + 1e-5 per token + 1e-7 per KV token read."""
    return 2e-3 + 1e-5 * batch.num_tokens + 1e-7 * sum(c.start + c.num_tokens for c in batch.chunks)


def test_a_job_and_a_decode_step_in_one_launch():
    """With TPOT 50 ms, request 0 at 1.0 s is ~490 steps (~2.03 ms each) into its 2000 and may lend its next
    step 1.3 targets (65 ms; 58.5 ms with the 10 % margin); request 1's 3000 tokens and request 0's decode
    row on the whole GPU take 2e-3 + 3001e-5 + 1e-7 * (3000 + ~590) = ~32.4 ms: they run as one launch on the
    132 SMs, all layers, and no decode launch runs beside it (request 0's step is inside)."""
    pre, steps, sched = mixed_case(0.05)
    first = pre[0]
    assert first.batch.partition.num_sms == 132 and first.batch.layers == range(L)
    assert [(c.req_id, c.num_tokens) for c in first.batch.chunks] == [(0, 1), (1, 3000)]
    assert first.end - first.start == pytest.approx(mixed_time(first.batch))
    assert 0.032 < first.end - first.start < 0.033
    assert not [s for s in steps if s.batch.lane == "decode" and s.start < first.end and s.end > first.start]
    assert sched.counters()["mixed_launches"] == 1


@pytest.mark.parametrize(("tpot", "ttft", "first"), [(0.02, None, "split"), (0.05, 0.05, "alone"),
                                                     (0.05, 0.07, "mixed")])
def test_no_mixed_launch_past_its_limit(tpot, ttft, first):
    """The ~32.4 ms launch above needs request 0's loan: with TPOT 20 ms it is at most 1.3 * 20 = 26 ms (23.4 ms
    with the margin) and the job runs on the split (prefill next to decode, < 132 SMs). It also holds the prefill
    lane for a request arriving just after it starts: at most half the tightest of the last arrivals' TTFT
    targets, 25 ms under a 50 ms target (not mixed), 35 ms under a 70 ms one (mixed). Under the 50 ms target
    the prompt runs alone on the whole GPU, decode waiting: an absolute TTFT target, nobody late, and the stall
    (~32.3 ms, then a ~2 ms decode step) is far within half of what request 0 can lend (~490 of its 2000 tokens
    done in ~1 s against a 50 ms TPOT: seconds of slack); without a TTFT target the split keeps it."""
    pre, _, _ = mixed_case(tpot, ttft)
    batch = pre[0].batch
    kind = "mixed" if len(batch.chunks) == 2 else "alone" if batch.partition.num_sms == 132 else "split"
    assert kind == first
    assert [c.req_id for c in batch.chunks] == ([0, 1] if first == "mixed" else [1])


@pytest.mark.parametrize("tpot", [0.05, 0.1])
def test_a_mixed_launch_takes_more_prompts_while_it_fits(tpot):
    """Requests 1 and 2 (3000 tokens each) arrive together; the job is request 1 alone (a 4096-token target).
    Both prompts and request 0's decode row take 2e-3 + 6001e-5 + 1e-7 * (6000 + ~590) = ~62.7 ms: past request
    0's 58.5 ms loan under TPOT 50 ms (two mixed launches, one prompt each, the second with request 1's decode
    row too), within its 117 ms (1.3 * 0.1 * 0.9) under TPOT 100 ms (one launch with both)."""
    pre, _, _ = mixed_case(tpot, both=True)
    jobs = [[(c.req_id, c.num_tokens) for c in s.batch.chunks] for s in pre[:2]]
    if tpot == 0.05:
        assert jobs == [[(0, 1), (1, 3000)], [(0, 1), (1, 1), (2, 3000)]]
    else:
        assert jobs[0] == [(0, 1), (1, 3000), (2, 3000)]
        assert 0.062 < pre[0].end - pre[0].start < 0.063
    assert all(s.batch.partition.num_sms == 132 for s in pre[:len(jobs) if tpot == 0.05 else 1])


def test_decode_size_is_the_smallest_that_keeps_tpot():
    """LinearLatency: a step of n rows reading kv tokens takes (2e-3 + 1e-5 n + 1e-7 kv) * 132 / d seconds,
    times ``contention`` next to a co-runner. 40 rows with 1000 tokens each: 6.4 ms * 132 / d."""
    lat = LinearLatency(L, contention=1.25)
    sched, _ = make(SloConfig(tpot=0.05), lat=lat, slo_margin=0.1)
    reqs = [decoding(i, 2, 0.0, 100, 999) for i in range(40)]  # each reads 1000 tokens next step
    step132 = 2e-3 + 1e-5 * 40 + 1e-7 * 40_000
    co = Work(8, 4096, 1, 4096 * 4097 / 2, 4096, 0, True, 4096)
    # at now = 0.01 (each had one step's time already) the loan is min(1.3 * 50 ms, 4.94 - 97 * 47.5 ms) = 65 ms
    budget = 0.065 * 0.9
    want = min(d for d in GPU.decode_sizes[:-1] if step132 * 132 / d * 1.25 <= budget)  # 24 by hand (d >= 18.05)
    assert want == 24
    assert sched._decode_need(sched._view(reqs, 0.01), co) == want
    # a tighter TPOT needs more SMs; one nobody can meet gets the largest decode size

    def need(**kw):
        s = make(lat=lat, **kw)[0]
        return s._decode_need(s._view(reqs, 0.01), co)

    # tpot 30 ms: even pace (0.03 * 99 - 0.01) / 98 = 30.2 ms; the loan min(1.3 * 30, 2.96 - 97 * 0.95 * 0.03)
    # = 39 ms; with the margin 35.1 ms, and 1.056 / d * ... <= 35.1 ms needs d >= 30.1: 32 (40 at the even pace)
    assert need(slo=SloConfig(tpot=0.03)) == 32
    assert need(slo=SloConfig(tpot=0.001)) == 112
    assert need(slo=SloConfig(tpot=0.05), decode_sizes=(16, 56)) == 56  # decode_sizes restricts the menu
    # the work of the step: 40 rows reading 1000 tokens each, the longest 1000
    assert sched._view(reqs, 0.01).work == Work(L, 40, 40, 40_000.0, 40_000, 40, True, 1000)


def test_prefill_gets_what_decode_leaves_and_the_whole_gpu_alone(split_only):
    """A decode batch that needs d SMs runs next to prefill slices on N - d; with nothing decoding the prefill
    takes the whole GPU, and decode alone takes the whole GPU."""
    reqs = [Request(0, 0.0, 2000, 2000)] + [Request(i, 1.0, 3000, 5) for i in range(1, 4)]
    done, steps, _ = run(reqs, SloConfig(ttft=None, tpot=0.05), layers_per_step=8)
    first = next(s for s in steps if s.batch.lane == "prefill")
    # request 0 alone, nothing decoding: the whole GPU, all layers in one launch (no slice boundary to use)
    assert first.batch.partition.num_sms == 132 and first.batch.layers == range(L)
    lone = [s for s in steps if s.batch.lane == "decode" and s.start < 1.0]
    assert lone and {s.batch.partition.num_sms for s in lone} == {132}
    co = [s for s in steps if s.batch.lane == "prefill" and s.start >= 1.0]
    assert co and all(s.batch.partition.num_sms < 132 for s in co)
    # next to decode: 8-layer slices while requests wait behind the job (each prompt is a job of its own: the
    # token target is 4096); the last job, with nobody behind it and no arrival to come, is one launch
    last = max(s.batch.chunks[0].req_id for s in co)
    assert all(len(s.batch.layers) == 8 for s in co if s.batch.chunks[0].req_id != last)
    assert [s.batch.layers for s in co if s.batch.chunks[0].req_id == last] == [range(L)]
    r0 = next(r for r in done if r.id == 0)
    tpot = (r0.finish_time - r0.first_token_time) / (r0.num_output - 1)
    assert tpot <= 0.05


def test_with_nobody_waiting_decode_gets_its_idle_knee(split_only):
    """With nobody waiting behind the prefill job, decode gets the smallest size whose step is within
    IDLE_KNEE (50 %) of its step on the largest decode size (112 SMs): LinearLatency scales time by 132 / d, so
    d >= 112 / 1.5 = 74.7: 80 SMs, prefill the other 52 (loose SLOs: the job's deadline needs less, decode's
    TPOT needs 8). With a prompt waiting behind the job, prefill takes all decode does not need: 132 - 8.
    (The TTFT target is per token, 10 s for these prompts: an absolute one would send the job to the whole
    GPU, decode lending the stall, LIGHT_STALL.)"""
    for behind, want in ((False, 52), (True, 124)):
        reqs = [Request(0, 0.0, 20, 400), Request(1, 0.5, 100, 5)] + ([Request(2, 0.5, 100, 5)] if behind else [])
        slo = SloConfig(ttft=None, ttft_per_token=0.1, tpot=1.0)
        _, steps, _ = run(reqs, slo, layers_per_step=8, max_batched_tokens=128)
        first = next(s for s in steps if s.batch.lane == "prefill" and s.start >= 0.5)
        assert [c.req_id for c in first.batch.chunks] == [1] and first.batch.partition.num_sms == want
        dec = next(s for s in steps if s.batch.lane == "decode" and s.start >= first.start)
        assert dec.batch.partition.num_sms == 132 - want


def test_edf_order_and_late_requests_go_last():
    """Per-token TTFT: three prompts arriving together are prefilled shortest (earliest deadline) first. With
    an absolute TTFT of 50 ms, a prompt that cannot make it even alone goes after one that can."""
    reqs = [Request(0, 0.0, 1500, 2), Request(1, 0.0, 100, 2), Request(2, 0.0, 600, 2)]
    done, _, _ = run(reqs, SloConfig(ttft=None, ttft_per_token=0.003, tpot=1.0), max_batched_tokens=512)
    first = {r.id: r.first_token_time for r in done}
    assert first[1] < first[2] < first[0]
    # LinearLatency: 6000 prompt tokens take (2e-3 + 0.06) s > 50 ms; 100 tokens take 3 ms
    reqs = [Request(0, 0.0, 6000, 2), Request(1, 0.0, 100, 2)]
    done, _, sched = run(reqs, SloConfig(ttft=0.05, tpot=1.0), max_batched_tokens=512)
    first = {r.id: r.first_token_time for r in done}
    assert first[1] < first[0] and first[1] <= 0.05 and sched.num_late >= 1


def overload(seed, n=120, rate=40.0):
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, n))  # far above what LinearLatency serves at these lengths
    return [Request(i, float(t[i]), int(rng.integers(50, 4000)), int(rng.integers(1, 60))) for i in range(n)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_starvation(seed):
    """A request r is ordered no later than key(r) = arrival + (1 + LATE_GRACE) * its TTFT target, so no
    request arriving after that point is admitted before it: every request's wait is bounded by the work
    that arrived before its key."""
    slo = SloConfig(ttft=0.2, tpot=1.0)
    reqs = overload(seed)
    done, _, _ = run(reqs, slo, max_batched_tokens=2048)
    first = {r.id: r.first_token_time for r in done}
    late = 0
    for r in reqs:
        key = r.arrival + (1 + LATE_GRACE) * 0.2
        after = [s for s in reqs if s.arrival > key]
        assert all(first[s.id] >= first[r.id] for s in after), r.id
        late += first[r.id] - r.arrival > 0.2
    assert late > 10  # the load really is an overload: many miss, none starves


def assert_nobody_after_key_first(reqs, done, target: float) -> None:
    """No request arriving after key(r) = r's arrival + (1 + LATE_GRACE) x ``target`` got its first token
    before r."""
    first = {r.id: r.first_token_time for r in done}
    arrivals = sorted((r.arrival, r.id) for r in reqs)
    for r in reqs:
        key = r.arrival + (1 + LATE_GRACE) * target
        later = arrivals[bisect.bisect_right(arrivals, (key, len(reqs))):]
        assert all(first[i] >= first[r.id] for _, i in later), r.id


@pytest.mark.parametrize("rate", [40.0, 50.0])
def test_no_job_is_set_aside_for_a_request_past_its_key(rate):
    """An overload with a fixed 200 ms TTFT target: a long prompt's job could be set aside between slices
    (``_urgent``) for every new head that would meet its own deadline, so a request of that job, already late,
    waited while newer ones went first: request 181 at 50 req/s (68 at 40) got its first token after one that
    arrived past its key (arrival + (1 + LATE_GRACE) x target). Nobody arriving after key(r) is served first."""
    slo = SloConfig(ttft=0.2, tpot=1.0)
    reqs = overload(0, n=1000, rate=rate)
    done, _, _ = run(reqs, slo, max_batched_tokens=2048)
    assert_nobody_after_key_first(reqs, done, 0.2)


def test_no_starvation_with_requests_shed_on_arrival():
    """Over 17 s of an overload (60 req/s: 1.74 s of whole-GPU work a second by LinearLatency, over
    SHED_CAPACITY and under SHED_DEEP) on 32 seats (so that SHED_SEATS of them are taken: outputs of 1-60 tokens
    never fill 256), the costliest arrivals are shed (deferred on arrival) and they too are ordered by key(r) =
    arrival + (1 + LATE_GRACE) * target: nobody arriving after that is served first."""
    slo = SloConfig(ttft=0.2, tpot=1.0)
    reqs = overload(0, n=1000, rate=60.0)
    done, _, sched = run(reqs, slo, max_batched_tokens=2048, max_num_seqs=32)  # (on by default)
    assert sched.num_shed > 10
    _, _, off = run(overload(0, n=1000, rate=60.0), slo, max_batched_tokens=2048, max_num_seqs=32,
                    overload_deferral=False)
    assert off.num_shed == 0  # --no-overload-deferral
    assert_nobody_after_key_first(reqs, done, 0.2)


def test_admission_control_rejects_and_counts():
    from bullet.metrics import request_columns, summarize

    slo = SloConfig(ttft=0.2, tpot=1.0)
    reqs = overload(3, rate=60.0)  # (at 40 req/s this seed's prompts all meet 200 ms on the whole GPU: no overload)
    done, _, sched = run(reqs, slo, admission_control=True, max_batched_tokens=2048)
    rejected = [r for r in done if r.error]
    assert len(done) == len(reqs) and len({r.id for r in done}) == len(reqs)  # nothing lost or doubled
    assert rejected and all("admission control" in r.error for r in rejected)
    assert all(r.first_token_time is None and not r.token_times for r in rejected)
    served = [r for r in done if not r.error]
    cols = request_columns(done, slo)
    s = summarize(done, slo, None, cols)
    assert s["rejected"] == len(rejected)
    on_time = sum(1 for r in served if r.first_token_time - r.arrival <= 0.2)
    assert s["slo_attainment"] == pytest.approx(on_time / len(reqs))
    # off (the default): nobody is rejected, the late are served best-effort
    done, _, sched = run(overload(3, rate=60.0), slo, max_batched_tokens=2048)
    assert not any(r.error for r in done) and sched.num_late > 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), tpot=st.sampled_from([0.02, 0.05, 0.2]), layers=st.sampled_from([1, 8, 32]),
       blocks=st.sampled_from([400, 6000]))
def test_launches_are_legal_and_complete(seed, tpot, layers, blocks):
    """Random loads (a small KV pool too): every request finishes with all its tokens, every launch asks for a
    size on its lane's menu, and launches in flight together never share SMs (the simulator would raise)."""
    rng = np.random.default_rng(seed)
    n = 40
    t = np.cumsum(rng.exponential(1 / float(rng.uniform(2, 60)), n))
    reqs = [Request(i, float(t[i]), int(rng.integers(1, 3000)), int(rng.integers(1, 200))) for i in range(n)]
    done, steps, sched = run(reqs, SloConfig(ttft=None, ttft_per_token=0.003, tpot=tpot), layers_per_step=layers,
                             num_blocks=blocks)
    assert len(done) == n and all(r.num_output == r.max_new_tokens for r in done)
    assert sched.kv.num_free == sched.kv.num_blocks
    pre = [s for s in steps if s.batch.lane == "prefill"]
    dec = [s for s in steps if s.batch.lane == "decode"]
    assert all(s.batch.partition.num_sms in GPU.prefill_sizes for s in pre)
    assert all(s.batch.partition.num_sms in GPU.decode_sizes for s in dec)
    for p in pre:
        for d in dec:
            if p.start < d.end and d.start < p.end:  # in flight together
                check_corun(p.batch.partition.num_sms, d.batch.partition.num_sms, GPU.num_sms)


def test_deterministic():
    slo = SloConfig(ttft=None, ttft_per_token=0.003, tpot=0.1)

    def trace():
        done, steps, _ = run(overload(5, 80), slo)
        return ([(s.batch.lane, s.batch.partition.num_sms, s.batch.layers, s.start, s.end) for s in steps],
                sorted((r.id, r.first_token_time, r.finish_time) for r in done))

    assert trace() == trace()


def test_bad_decode_sizes_are_a_config_error():
    from bullet.config import ConfigError

    with pytest.raises(ConfigError, match="not on h200's decode menu"):
        make(decode_sizes=(8, 44))


def test_work_of_by_hand():
    """Decode rows at positions 5 and 9 read 6 + 10 KV tokens, the longest 10; a 20-token prompt chunk beside
    one decode row: 21 tokens, causal pairs 20 * 21 / 2 + 6, the longest 20."""
    from bullet.batch import Batch, Chunk, Partition
    from bullet.perfmodel import work_of

    dec = Batch(Partition("all", 132), range(L), (Chunk(0, 5, 1, [], True), Chunk(1, 9, 1, [], True)))
    assert work_of(dec, L) == Work(L, 2, 2, 16.0, 16, 2, True, 10)
    mixed = Batch(Partition("all", 132), range(8), (Chunk(0, 5, 1, [], True), Chunk(1, 0, 20, [], True)))
    assert work_of(mixed, L) == Work(8, 21, 2, 216.0, 26, 0, True, 20)


def test_shortest_first_only_where_it_breaks_no_deadline():
    """LinearLatency prefill: (2e-3 + 1.01e-5 t) s for t tokens on the whole GPU; the policy's batch target is
    4096 tokens (the smallest of 512..8192 within 5 % of the best per-token time: 2e-3 / t <= 7.6e-7), so it
    predicts 2e-3 / 4096 + 1.01e-5 = 10.59 us a token."""
    per_token = 2e-3 / 4096 + 1.01e-5

    def order(reqs, ttft):
        sched, _ = make(SloConfig(ttft=ttft, tpot=None))
        assert sched.token_target == 4096
        for r in reqs:
            sched.add(r)
        sched._order(1.0)
        return [r.id for r in sched.waiting]

    # same deadline (1.05 s): shortest first meets all three (4200 tokens end at 44.5 ms)
    assert 4200 * per_token < 0.05
    assert order([Request(0, 1.0, 3000, 2), Request(1, 1.0, 200, 2), Request(2, 1.0, 1000, 2)], 0.05) == [1, 2, 0]
    # request 0 (3000 tokens) is due at 1.033 s: first, it ends at 31.8 ms; behind request 1 at 33.9 ms, too late
    assert 3000 * per_token < 0.033 < 3200 * per_token
    assert order([Request(0, 0.993, 3000, 2), Request(1, 1.0, 200, 2)], 0.04) == [0, 1]


def test_abort_of_a_queued_request_forgets_its_deadline():
    sched, _ = make(SloConfig(ttft=0.5, tpot=0.1))
    sched.add(Request(0, 0.0, 100, 5))
    sched.add(Request(1, 0.0, 100, 5))
    assert sched.abort(1, 0.01).id == 1
    assert 1 not in sched.deadline and 1 not in sched.target and [r.id for r in sched.waiting] == [0]
    assert [e[1] for e in sched._by_deadline] == [e[1] for e in sched._by_length] == [0]  # out of _order's lists


# ---- incremental state: DecodeArrays and the sorted queue lists equal a from-scratch recomputation ----------

@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["join", "advance", "leave", "first"]), st.integers(0, 10**6)),
                    max_size=60),
       tpot=st.sampled_from([None, 0.02, 0.1]), seats=st.sampled_from([8, 256]))
def test_decode_arrays_equal_the_python_pass(ops, tpot, seats):
    """Random joins (some with no token out yet), decode launches coming back (a random subset, or every
    decoding request), first tokens, finishes and preemptions: after each, the array view equals the Python
    pass over the same requests to the bit (Work, budget, loan), at several clocks, and the sorted tokens left
    (the seat releases') equal a fresh sort. The Work comes from the sums kept through every change (count, KV
    tokens, the longest context, dropped and gathered again when its request leaves), the budget and loan
    from the arrays when first read."""
    from bullet.policies.bullet import DecodeArrays

    sched, _ = make(SloConfig(tpot=tpot), max_num_seqs=seats)
    arrays = DecodeArrays(tpot, [])
    live: list[Request] = []
    rng = np.random.default_rng(len(ops))
    for i, (op, x) in enumerate(ops):
        if op == "join" or not live:
            out = x % 3 and int(x % 50)  # a third have no token out (prefilling)
            r = Request(i, 0.0, 50 + x % 2000, 1 + x % 400)
            r.num_output = min(out, r.max_new_tokens - 1)
            r.num_computed = r.prompt_len + r.num_output - (1 if r.num_output else r.prompt_len)
            r.first_token_time = float(rng.uniform(0, 5)) if r.num_output else None
            live.append(r)
            arrays.join(r)
        elif op == "advance":
            dec = [r for r in live if r.num_output]
            batch = dec if x % 2 else [r for r in dec if rng.random() < 0.5]
            steps = 1 + x % 8
            slots = arrays.slots(batch)
            for r in batch:
                r.num_computed += steps
                r.num_output += steps
            arrays.advance(slots, steps)
            for r in [r for r in batch if r.num_output >= r.max_new_tokens]:  # finished
                live.remove(r)
                arrays.leave(r)
        elif op == "first":  # a prefill came back: its first token (or a preempted one recomputed)
            r = live[x % len(live)]
            r.num_computed = r.prompt_len + r.num_output
            r.num_output += 1
            r.first_token_time = r.first_token_time or float(rng.uniform(0, 5))
            arrays.sync(r)
        else:  # finished or preempted
            arrays.leave(live.pop(x % len(live)))
        sched.running = live
        for now in (0.0, 2.5, 7.0, 40.0):
            lend = tpot is not None and len(live) < 0.75 * seats
            cap, pace = (1.3 * tpot, 0.95 * tpot) if lend else (0.0, 0.0)
            assert arrays.view(now, lend, cap, pace, L) == sched._view(list(live), now)
        assert arrays.sorted_left().tolist() == sorted(r.max_new_tokens - r.num_output for r in live)


def test_lazy_view_refuses_a_stale_budget():
    """A view read from the arrays computes its budget when first read, from the arrays as they are then: read
    after a decoding request changed, it would be another view's, and it says so instead. Its budget, read in
    time, is the Python pass's (0.1 s a step: 0.5 s of its 1 s of TPOT left for its last 5 tokens)."""
    from bullet.policies.bullet import DecodeArrays

    r = decoding(0, 6, 0.0, 11, 105)
    arrays = DecodeArrays(0.1, [r])
    assert arrays.view(0.5, False, 0.0, 0.0, L).budget == pytest.approx(0.1)
    view = arrays.view(0.5, False, 0.0, 0.0, L)
    r.num_output, r.num_computed = 7, 106
    arrays.advance(arrays.slots([r]), 1)
    with pytest.raises(SchedulingError, match="after its decoding requests changed"):
        _ = view.loan
    assert view.work == Work(L, 1, 1, 106.0, 106, 1, True, 106)  # (the Work is taken when the view is made)


def test_arrays_and_sorted_queue_in_whole_runs(monkeypatch):
    """Overloads with preemption (a small KV pool), a tight TPOT and admission control, with the arrays on from
    two running requests: every view read from the arrays equals the Python pass, the queue lists equal the
    fresh queue sorted from scratch at every ordering, and every request's times equal those of a run without
    the arrays."""
    import bullet.policies.bullet as mod

    def load(seed):  # long outputs: decode grows past a small pool and preempts
        rng = np.random.default_rng(seed)
        t = np.cumsum(rng.exponential(1 / 40.0, 150))
        return [Request(i, float(t[i]), int(rng.integers(50, 1500)), int(rng.integers(1, 400))) for i in range(150)]

    def times(reqs, slo, **cfg):
        done, steps, sched = run(reqs, slo, max_batched_tokens=2048, **cfg)
        return (sorted((r.id, r.first_token_time, r.finish_time, r.num_preemptions, r.error) for r in done),
                len(steps), sched.num_preemptions, sum(bool(r.error) for r in done))

    view, order, seen = mod.Bullet._view, mod.Bullet._order, {"arrays": 0, "orders": 0}

    def checked_view(self, reqs, now, **kw):
        got = view(self, reqs, now, **kw)
        if reqs is self.running and self._arrays is not None:
            assert got == view(self, list(reqs), now, **kw)
            seen["arrays"] += 1
        return got

    def checked_order(self, now):
        k = sum(1 for r in self.waiting if r.id in self.rank)
        fresh = list(self.waiting)[k:]
        assert [e[:4] for e in self._by_deadline] == sorted((self.deadline[r.id], r.id, r.known, r) for r in fresh)
        late_key = {r.id: self.deadline[r.id] + mod.LATE_GRACE * self.target[r.id] for r in fresh}
        assert all(e[4] == (-e[2], -e[0], -e[1], (*e[:4], (late_key[e[1]], e[1], e[3]))) for e in self._by_deadline)
        assert self._by_length == sorted((r.known, r.id, self.deadline[r.id], r) for r in fresh)
        seen["orders"] += bool(fresh)
        return order(self, now)

    tight = SloConfig(ttft=None, ttft_per_token=0.003, tpot=0.03)
    cases = ((load, 0, tight, {}), (load, 1, tight, {"num_blocks": 300}),
             (overload, 2, SloConfig(ttft=0.2, tpot=0.03), {"admission_control": True}))
    preempted = rejected = 0
    for make_load, seed, slo, cfg in cases:
        plain = times(make_load(seed), slo, **cfg)  # (serve changes its requests: each run gets fresh ones)
        preempted, rejected = preempted + plain[2], rejected + plain[3]
        with monkeypatch.context() as m:
            m.setattr(mod, "ARRAYS_FROM", 2)
            m.setattr(mod, "ARRAYS_UNTIL", 1)
            m.setattr(mod.Bullet, "_view", checked_view)
            m.setattr(mod.Bullet, "_order", checked_order)
            assert times(make_load(seed), slo, **cfg) == plain
    assert seen["arrays"] > 500 and seen["orders"] > 100 and preempted > 10 and rejected > 5, (seen, preempted,
                                                                                              rejected)


def test_summary_counts_jobs_set_aside(monkeypatch):
    """The simulation summary reports how many prefill jobs bullet set aside for an urgent prompt: one in
    this case (the hand-timed case of tests/test_gpu_executor.py's set-aside test: a 150-token job in
    one-layer slices, then a 4-token prompt that misses its 80 ms target behind it and meets it ahead of its
    second slice); policies that set nothing aside report no such count."""
    from bullet.config import CacheConfig
    from simulator.run import simulate

    spec, gpu = MODELS["tiny-llama"], GPUS["h200"]
    lat = LinearLatency(spec.num_layers, base=2e-3, per_token=1e-3)
    slo = SloConfig(ttft=None, ttft_per_token=0.02, tpot=0.5)
    reqs = [Request(0, 0.0, 4, 30), Request(1, 0.0, 4, 30), Request(2, 0.03, 150, 12), Request(3, 0.045, 4, 2)]
    cache = CacheConfig(num_blocks=256, block_size=4)
    monkeypatch.setattr("bullet.policies.bullet.IDLE_KNEE", math.inf)  # the case's split: decode on its TPOT floor
    res = simulate(reqs, spec, gpu, SchedulerConfig(policy="bullet", max_batched_tokens=48, layers_per_step=1),
                   cache, slo, lat)
    assert res.summary["jobs_set_aside"] == 1
    other = simulate(reqs, spec, gpu, SchedulerConfig(policy="chunked"), cache, slo, lat)
    assert "jobs_set_aside" not in other.summary


def test_a_cached_prefix_makes_the_queue_head_short_enough_to_go_first():
    """`_urgent` times the queue's head by what it computes, its prompt less the prefix the cache holds.
    LinearLatency, 1 ms a token: request 0's 100-token prompt (ids 0..99) is prefilled first and stays cached
    while it decodes (300 tokens: the later job shares the GPU with it, so it runs in one-layer slices); a
    150-token job starts at 0.3 s; request 3 arrives at 0.31 s with ids 0..95 then 4 new ones and a 100 ms TTFT
    target. Behind the job's ~150 ms it would miss; alone ahead of its second slice its 4 fresh tokens after 96
    cached take a few ms, so the job is set aside and request 3 meets its target (timed as all 100 tokens it
    would be late anyway, and nothing would be set aside: this test fails without the cached prefix counted).
    The target is per token, 1 ms (under an absolute one the job would not be sliced: LIGHT_STALL)."""
    from bullet.config import CacheConfig
    from simulator.run import simulate

    spec, gpu = MODELS["tiny-llama"], GPUS["h200"]
    lat = LinearLatency(spec.num_layers, base=2e-3, per_token=1e-3)
    slo = SloConfig(ttft=None, ttft_per_token=1e-3, tpot=0.5)  # (per token: 100 ms for request 3)
    reqs = [Request(0, 0.0, 100, 300, prompt_ids=tuple(range(100))),
            Request(2, 0.3, 150, 4, prompt_ids=tuple(range(1000, 1150))),
            Request(3, 0.31, 100, 4, prompt_ids=tuple(range(96)) + (5000, 5001, 5002, 5003))]
    cache = CacheConfig(num_blocks=256, block_size=4, prefix_caching=True)
    res = simulate(reqs, spec, gpu, SchedulerConfig(policy="bullet", max_batched_tokens=48, layers_per_step=1),
                   cache, slo, lat)
    assert res.summary["jobs_set_aside"] == 1
    r3 = next(r for r in res.requests if r.id == 3)
    assert r3.num_cached_tokens == 96 and r3.first_token_time - r3.arrival <= 0.1


def test_stall_room_by_hand():
    """How long every decoding request's next token may take: its loan without the 1.3-target cap (its other
    steps at 95 % of the target), at least its step budget; the tightest wins; 0 while 3/4 of the seats are
    taken; inf without a TPOT target."""
    sched, _ = make(SloConfig(tpot=0.1), max_num_seqs=8)
    # 11 tokens, 5 out at 0.5 s: a = 0.1 * 10 - 0.5 = 0.5 s for 5 steps: 0.5 - 4 * 0.095 = 0.12 (budget 0.1)
    sched.running[:] = [decoding(0, 6, 0.0, 11, 105)]
    assert sched._stall_room(0.5) == pytest.approx(0.12)
    # 101 tokens, 2 out at 0.5 s: a = 10 - 0.5 = 9.5 for 99 steps: 9.5 - 98 * 0.095 = 0.19 (a loan caps it at 0.13)
    sched.running[:] = [decoding(1, 2, 0.0, 101, 101)]
    assert sched._stall_room(0.5) == pytest.approx(0.19)
    # both: the tightest; a request past its whole budget (first token at -2 s: a < 0) is left out
    sched.running[:] = [decoding(0, 6, 0.0, 11, 105), decoding(1, 2, 0.0, 101, 101), decoding(2, 6, -2.0, 11, 105)]
    assert sched._stall_room(0.5) == pytest.approx(0.12)
    # behind the 95 % pace (0.3 s late: a = 0.2 for 5 steps): its even-pace budget 0.04, not 0.2 - 0.38 < 0
    sched.running[:] = [decoding(0, 6, 0.0, 11, 105)]
    assert sched._stall_room(0.8) == pytest.approx(0.04)
    sched.running[:] = [decoding(10 + i, 2, 0.0, 101, 101) for i in range(6)]  # 6 of 8 seats
    assert sched._stall_room(0.5) == 0.0
    none, _ = make(SloConfig(tpot=None))
    none.running[:] = [decoding(0, 6, 0.0, 11, 105)]
    assert none._stall_room(0.5) == math.inf


@pytest.mark.parametrize(("ttft", "per_token"), [(0.1, False), (0.2, True), (0.2, False)])
def test_whole_gpu_prefill_when_the_split_misses_the_deadline(ttft, per_token):
    """LinearLatency with co-running 1.25x slower. Request 0 (100 tokens, 2000 to generate) decodes alone on the
    whole GPU from ~3 ms, ~2.05 ms a step; at 0.5 s two 8000-token prompts arrive (TPOT 50 ms, TTFT ``ttft``).
    Request 1's job is planned when request 0's decode launch in flight ends, at t in (0.5, 0.5021]. Request
    0 lends 65 ms a step (the cap), 58.5 ms with the margin: its step next to prefill, 2.045 ms * 132 / d *
    1.25, fits from d = 5.8, so 8 SMs and prefill 124 (request 2 waits: all that decode does not need). The
    8000 tokens on 124 SMs next to decode: (2e-3 + 8000e-5 + 8000e-7) * 132 / 124 * 1.25 = 110.2 ms; on the
    whole GPU 82.8 ms. With a 100 ms target, the split misses its 0.6 s deadline with the 10 % margin ((0.6 - t)
    * 0.9 <= 90 ms) and the whole GPU meets it (t + 82.8 ms <= 0.585 s), and request 0 can wait 82.8 + ~2 ms
    for its next token (its room: 0.05 * 1999 - ~0.5 - ~1755 * 0.0475 = ~16 s): request 1 runs at once on the
    132 SMs, decode waiting, and meets its target, where 8-layer slices on 124 SMs would miss it by ~10 ms.
    Request 2's deadline is also 0.6 s: from 0.585 s even the whole GPU misses it, so it runs next to decode
    (nobody behind it and no arrival to come: its whole job in one launch). With a 200 ms target the split meets
    request 1's ((0.7 - t) * 0.9 >= 178 ms): given per token (25 us a token), slices on 124; given as an absolute
    target, the whole GPU all the same (LIGHT_STALL: the stall, 82.8 + ~2 ms, is within half of request 0's ~16 s
    of room and nobody queued is late)."""
    reqs = [Request(0, 0.0, 100, 2000), Request(1, 0.5, 8000, 10), Request(2, 0.5, 8000, 10)]
    lat = LinearLatency(L, contention=1.25)
    slo = SloConfig(ttft=None, ttft_per_token=ttft / 8000, tpot=0.05) if per_token else SloConfig(ttft=ttft, tpot=0.05)
    sched, _ = make(slo, lat=lat)
    steps = []
    done = serve(reqs, sched, SimExecutor(lat, L, GPU), on_step=steps.append)
    pre = {i: [s for s in steps if s.batch.lane == "prefill" and s.batch.chunks[0].req_id == i] for i in (1, 2)}
    r1 = next(r for r in done if r.id == 1)
    first = pre[1][0]
    assert 0.5 < first.start <= 0.5021
    if not per_token:
        assert [(s.batch.partition.num_sms, s.batch.layers) for s in pre[1]] == [(132, range(L))]
        assert first.end - first.start == pytest.approx(2e-3 + 8000e-5 + 8000e-7)
        assert not [s for s in steps if s.batch.lane == "decode" and s.start < first.end and s.end > first.start]
        assert r1.first_token_time - r1.arrival <= ttft
    if ttft == 0.1:
        assert [(s.batch.partition.num_sms < 132, s.batch.layers) for s in pre[2]] == [(True, range(L))]
    if per_token:
        assert [(s.batch.partition.num_sms, len(s.batch.layers)) for s in pre[1]] == [(124, 8)] * 4
        assert r1.first_token_time - r1.arrival <= 0.2


# ---- which requests the queue order predicts late: Moore-Hodgson, seat releases -----------------------------

PER_TOKEN = 2e-3 / 4096 + 1.01e-5  # LinearLatency's prefill per token at the 4096-token target, whole GPU


def test_late_is_the_longest_not_the_last():
    """Absolute TTFT 50 ms, ordered at 1.0 s with the prefill lane free on the whole GPU (10.59 us a token).
    Request 0 (3000 tokens, 31.76 ms) is due at 1.04 s, requests 1 and 2 (1500 tokens, 15.88 ms each) at
    1.05 and 1.051 s. In deadline order 0 ends at 1.0318, 1 at 1.0476 and 2 at 1.0635 > 1.051: dropping the
    last one (2) leaves two on time, dropping the longest kept (0) leaves 1 and 2 ending at 1.0159 and 1.0318,
    both on time. Request 0 goes behind them (its key: 1.04 + LATE_GRACE * 0.05 s)."""
    sched, _ = make(SloConfig(ttft=0.05, tpot=None))
    for r in (Request(0, 0.99, 3000, 2), Request(1, 1.0, 1500, 2), Request(2, 1.001, 1500, 2)):
        sched.add(r)
    assert 1.0 + 6000 * PER_TOKEN > 1.051 and 1.0 + 4500 * PER_TOKEN <= 1.05 and 1.0 + 3000 * PER_TOKEN <= 1.04
    sched._order(1.0)
    assert [r.id for r in sched.waiting] == [1, 2, 0] and sched.num_late == 1


def test_equal_lengths_drop_the_latest_due():
    """Two 2000-token prompts (21.18 ms each) due at 1.03 and 1.035 s, ordered at 1.0: the second ends at
    1.0424, late; the two are equally long, so the later due one is dropped, as plain deadline order does."""
    sched, _ = make(SloConfig(ttft=0.05, tpot=None))
    sched.add(Request(0, 0.98, 2000, 2))
    sched.add(Request(1, 0.985, 2000, 2))
    sched._order(1.0)
    assert [r.id for r in sched.waiting] == [0, 1] and sched.num_late == 1 and sched._late == {1}


@settings(max_examples=40, deadline=None)
@given(jobs=st.lists(st.tuples(st.integers(1, 6000), st.floats(0.0, 0.1)), min_size=1, max_size=7))
def test_fewest_late_by_brute_force(jobs):
    """With seats to spare, the number predicted late equals the fewest possible: the largest set of requests
    that all meet their deadlines when run back to back in deadline order (every subset tried)."""
    from itertools import combinations

    sched, _ = make(SloConfig(ttft=0.05, tpot=None))
    reqs = [Request(i, 1.0 - age, n, 2) for i, (n, age) in enumerate(jobs)]
    for r in reqs:
        sched.add(r)
    sched._order(1.0)

    def feasible(sub):
        t = 1.0
        for r in sorted(sub, key=lambda r: (r.arrival, r.id)):
            t += r.prompt_len * PER_TOKEN
            if t > r.arrival + 0.05 + 1e-12:
                return False
        return True

    best = max(k for k in range(len(reqs) + 1) if any(feasible(c) for c in combinations(reqs, k)))
    assert sched.num_late == len(reqs) - best


def test_a_full_house_waits_for_a_seat_release():
    """Two seats, both held by decoding requests (106 KV tokens each; 5 and 99 tokens left), nothing in flight:
    decode's step is predicted on its knee, the smallest decode size within 10 % of 112 SMs' step under
    LinearLatency (time ~ 132 / SMs): 104 SMs. Step: (2e-3 + 2 * 1e-5 + 212 * 1e-7) * 132 / 104 = 2.591 ms,
    so the first seat frees at 5 steps, 12.95 ms. A 100-token prompt arriving at 0 (1.06 ms of prefill) ends
    at 14.01 ms: late for a 10 ms TTFT (prefill alone would meet it), on time for 20 ms."""
    for ttft, late in ((0.01, 1), (0.02, 0)):
        sched, _ = make(SloConfig(ttft=ttft, tpot=None), max_num_seqs=2)
        sched.running = [decoding(0, 6, 0.0, 11, 105), decoding(1, 2, 0.0, 101, 105)]
        sched.add(Request(2, 0.0, 100, 2))
        step = (2e-3 + 2e-5 + 212e-7) * 132 / 104
        assert 0.01 < 5 * step + 100 * PER_TOKEN <= 0.02
        assert sched._seat_releases(0.0, 0, 1) == (0, [pytest.approx(5 * step)])
        sched._order(0.0)
        assert sched.num_late == late



def reference_order(fresh, deadline, target, now, per_token, free, releases, shed, reject):
    """The queue _order makes, from scratch and by the plainest means: Moore-Hodgson over the requests by
    (deadline, id), each kept one waiting for seat release c - free (c: the kept before it), the longest kept
    (then the latest due, then the highest id) dropped when one would end late; shed ones late from the start.
    The on-time ones shortest first if that meets every one of their deadlines, else by deadline; each late one
    (by its deadline + LATE_GRACE targets, then id) before the first on-time one due after that key."""
    kept, late, t = [], [], now
    for r in sorted(fresh, key=lambda r: (deadline[r.id], r.id)):
        if r.id in shed:
            late.append(r)
            continue
        kept.append(r)
        cost = r.known * per_token
        t += cost
        j = len(kept) - 1 - free
        seat = releases[j] if 0 <= j < len(releases) else -math.inf
        if t > deadline[r.id] or seat + cost > deadline[r.id]:
            x = max(kept, key=lambda q: (q.known, deadline[q.id], q.id))
            kept.remove(x)
            t -= x.known * per_token
            late.append(x)
    on_time, t = sorted(kept, key=lambda r: (r.known, r.id)), now
    for r in on_time:
        t += r.known * per_token
        if t > deadline[r.id]:
            on_time = sorted(kept, key=lambda r: (deadline[r.id], r.id))
            break
    keyed = [] if reject else sorted(late, key=lambda r: (deadline[r.id] + LATE_GRACE * target[r.id], r.id))
    out = []
    for r in on_time:
        while keyed and deadline[keyed[0].id] + LATE_GRACE * target[keyed[0].id] < deadline[r.id]:
            out.append(keyed.pop(0))
        out.append(r)
    return out + keyed, {r.id for r in late}


def test_order_left_unbuilt_while_seats_are_full_changes_no_run(monkeypatch):
    """_order leaves the queue's order to be built while no seat is free for a fresh request (nobody reads it
    before the next _order). Runs that always build it give every request the same times, preemptions and
    rejections: overloads with few seats (full most of the time), a small KV pool (preemptions: requests queued
    ahead of the fresh ones) and admission control; and the unbuilt path is taken."""
    import bullet.policies.bullet as mod

    def times(reqs, slo, **cfg):
        done, steps, sched = run(reqs, slo, **cfg)
        return (sorted((r.id, r.first_token_time, r.finish_time, r.num_preemptions, r.error) for r in done),
                len(steps), sched.num_late, sched.num_mixed)

    order, unbuilt = mod.Bullet._order, [0]

    def counted(self, now, build=None):  # (the default's choice, counted: seats full for the fresh requests)
        k = sum(1 for r in self.waiting if r.id in self.rank)
        unbuilt[0] += build is None and self.cfg.max_num_seqs - len(self.running) - k <= 0 < len(self.waiting) - k
        return order(self, now, build)

    def long_outputs(seed):  # long outputs hold the seats while arrivals queue
        rng = np.random.default_rng(seed)
        t = np.cumsum(rng.exponential(1 / 60.0, 150))
        return [Request(i, float(t[i]), int(rng.integers(50, 2000)), int(rng.integers(50, 400))) for i in range(150)]

    slo = SloConfig(ttft=None, ttft_per_token=0.003, tpot=0.05)
    cases = ((long_outputs(3), {"max_num_seqs": 8}), (long_outputs(4), {"max_num_seqs": 16, "num_blocks": 400}),
             (long_outputs(5), {"max_num_seqs": 8, "admission_control": True}))
    for reqs, cfg in cases:
        with monkeypatch.context() as m:
            m.setattr(mod.Bullet, "_order", counted)
            lazy = times([Request(r.id, r.arrival, r.prompt_len, r.max_new_tokens) for r in reqs], slo, **cfg)
        with monkeypatch.context() as m:
            m.setattr(mod.Bullet, "_order", lambda self, now, build=None: order(self, now, True))
            assert times([Request(r.id, r.arrival, r.prompt_len, r.max_new_tokens) for r in reqs], slo, **cfg) \
                == lazy
    assert unbuilt[0] > 100, unbuilt


@pytest.mark.parametrize("seed", range(12))
def test_order_equals_a_plain_moore_hodgson(seed):
    """Random queues (some requests deferred, a lull now and then, some seats taken by decoding requests, arrivals
    and admissions in between): after every _order, the queue and the late set equal :func:`reference_order`'s from scratch, given
    the same per-token prefill speed and seat releases (what _order reads from the latency model)."""
    rng = np.random.default_rng(seed)
    reject = seed % 4 == 3
    sched, _ = make(SloConfig(ttft=None, ttft_per_token=float(rng.choice([0.0005, 0.002])), tpot=0.05),
                    max_num_seqs=int(rng.integers(4, 40)), admission_control=reject)
    for i in range(int(rng.integers(0, sched.cfg.max_num_seqs + 1))):
        sched.running.append(decoding(10_000 + i, int(rng.integers(1, 50)), 0.0, 60, 150))
    now, n = 1.0, 0
    for _ in range(8):
        for _ in range(int(rng.integers(1, 30))):  # arrivals
            r = Request(n, now - float(rng.uniform(0, 0.5)), int(rng.integers(1, 800)), 10)
            n += 1
            try:
                sched.add(r)
            except SchedulingError:  # (admission control refused it on arrival)
                continue
            if rng.random() < 0.15:
                sched._shed.add(r.id)
        lull = bool(rng.random() < 0.2)  # (the arrivals' load is not under test: whether it calls a lull is set)
        sched._lull = lambda now, lull=lull: lull
        fresh, shed = list(sched.waiting), set() if lull else set(sched._shed)
        deadline, target = dict(sched.deadline), dict(sched.target)
        per_token = sched._prefill_per_token()
        free, releases = sched._seat_releases(now, 0, len(fresh))
        want, late = reference_order(fresh, deadline, target, now, per_token, free, releases, shed, reject)
        sched._order(now)
        if len(fresh) == 1 and not late:  # (the one-request path: nothing moves)
            want = fresh
        if free <= 0 and not (reject and late):  # no seat for a fresh request: the order is left to be built
            assert [r.id for r in sched.waiting] == [r.id for r in fresh]
            sched._order(now, build=True)  # (built: the same late set, counted once)
        assert [r.id for r in sched.waiting] == [r.id for r in want]
        assert late <= sched._late | {r.id for r in sched.rejected} and (reject or late <= sched._late)
        assert not reject or {r.id for r in sched.rejected} >= late
        for _ in range(int(rng.integers(0, 4))):  # admissions from the head
            if sched.waiting:
                sched._admit(sched.waiting[0])
        now += float(rng.uniform(0.01, 0.3))


@pytest.mark.parametrize("seed", range(12))
def test_orders_a_little_apart_equal_a_plain_moore_hodgson(seed):
    """Long runs of orders a little apart, as a simulation makes them (one or two arrivals, an admission or an
    abort, a decode step of every running request, a completion, the prefill speed changing now and then, a
    deferral or a lull now and then; now and then a long prompt that came early, longer than the requests dropped
    after it): after every _order the queue and the late set equal :func:`reference_order`'s from scratch. (What
    an order that starts from the last one's answer must keep: bench/RESULTS.md, the order's helper section.)"""
    rng = np.random.default_rng(100 + seed)
    seats = int(rng.integers(8, 48))
    sched, _ = make(SloConfig(ttft=None, ttft_per_token=float(rng.choice([0.0005, 0.001, 0.002])), tpot=0.05),
                    max_num_seqs=seats)
    for i in range(int(rng.integers(seats // 2, seats + 1))):
        sched.running.append(decoding(10_000 + i, int(rng.integers(1, 50)), 0.0, 200, 150))
    speed = [float(rng.uniform(1e-5, 4e-5))]
    sched._prefill_per_token = lambda: speed[0]
    lull = [False]
    sched._lull = lambda now: lull[0]
    now, n = 1.0, 0
    for step in range(60):
        for _ in range(int(rng.integers(40, 70)) if step == 0 else int(rng.choice([0, 0, 1, 1, 2]))):
            long = rng.random() < 0.2  # (now and then a long prompt come early: longer than a drop after it)
            r = Request(n, now - float(rng.uniform(0, 1.0 if long else 0.3)),
                        int(rng.integers(600, 2000) if long else rng.integers(1, 800)), 10)
            n += 1
            sched.add(r)
            if rng.random() < 0.03:
                sched._shed.add(r.id)
        lull[0] = bool(rng.random() < 0.03)
        if rng.random() < 0.1:
            speed[0] *= float(rng.uniform(0.8, 1.25))
        fresh, shed = list(sched.waiting), set() if lull[0] else set(sched._shed)
        deadline, target = dict(sched.deadline), dict(sched.target)
        free, releases = sched._seat_releases(now, 0, len(fresh))
        want, late = reference_order(fresh, deadline, target, now, speed[0], free, releases, shed, False)
        num_late = sched.num_late
        sched._order(now)
        if len(fresh) == 1 and not late:
            want = fresh
        if free <= 0:  # no seat for a fresh request: the order is left to be built (and then counts nobody again)
            assert [r.id for r in sched.waiting] == [r.id for r in fresh]
            count = sched.num_late
            sched._order(now, build=True)
            assert sched.num_late == count >= num_late
        assert [r.id for r in sched.waiting] == [r.id for r in want]
        assert late <= sched._late
        if sched.waiting and rng.random() < 0.4:
            sched._admit(sched.waiting[0])
        if sched.waiting and rng.random() < 0.1:
            sched.abort(sched.waiting[int(rng.integers(len(sched.waiting)))].id, now)
        for r in sched.running:  # a decode step
            r.num_output += 1
            r.num_computed += 1
        if sched.running and rng.random() < 0.2:
            sched.running.pop(int(rng.integers(len(sched.running))))  # (a completion: a seat frees)
        now += float(rng.uniform(0.001, 0.03))


# ---- requests deferred on arrival when the recent arrivals overload the GPU (_shed_on_arrival) -------------


def test_whole_work_by_hand():
    """LinearLatency: 2 ms + 10 us a token + 0.1 us a KV token read, whole GPU. A 1000-token prompt alone:
    2 + 10 + 0.1 = 12.1 ms. Its 100 output tokens at a 256-row step with KV 1000 + 50 each: 2 + 2.56 +
    26.88 = 31.44 ms a step, 0.1228125 ms a row, 12.28125 ms for 100. Whole: 24.38125 ms."""
    sched, _ = make(SloConfig(ttft=1.0, tpot=None))
    assert sched._whole_work(Request(0, 0.0, 1000, 100)) == pytest.approx(0.02438125)


@pytest.fixture
def no_seat_gate(monkeypatch):
    """The window's arithmetic alone: deferral whatever the seats and the prompt's share (SHED_SEATS and
    SHED_PROMPT_SHARE have their own tests)."""
    from bullet.policies import bullet as mod

    monkeypatch.setattr(mod, "SHED_SEATS", 0.0)
    monkeypatch.setattr(mod, "SHED_PROMPT_SHARE", 0.0)


def test_costliest_arrival_deferred_when_cheaper_ones_fill_the_window(no_seat_gate):
    """SHED_WINDOW 10 s, SHED_CAPACITY 1.15, SHED_DEEP 1.8. Four 20000-token prompts with 1000 output tokens
    (2.2718 s of whole-GPU work each: 204 ms of prompt, 1000 x 529.36 / 256 ms of decode) arrive at 0, 2.5, 5
    and 7.5 s: none is deferred (before 5 s the window spans less than half of 10 s; later nothing is cheaper
    than the newcomer). At 7.5 s a prompt of the same length with 1001 tokens (2.2739 s) makes the window
    carry 4 x 2.2718 + 2.2739 = 11.3611 s over 7.5 s (1.51 a second: an overload, not a deep one, 11.3611 <=
    1.8 x 7.5 = 13.5), an excess of 11.3611 - 1.15 x 7.5 = 2.7361 s that holds its own 2.2739 s: deferred, a
    late request keyed at its deadline + LATE_GRACE targets (8.5 + 20 = 28.5 s), after every on-time request's
    deadline here, so it is ordered last. A 100-token prompt at 7.5 s (3.07 ms) has nothing cheaper: kept. At
    17.6 s the window holds only the newcomer: kept."""
    from bullet.policies.bullet import SHED_CAPACITY, SHED_DEEP, SHED_WINDOW

    assert (SHED_WINDOW, SHED_CAPACITY, SHED_DEEP) == (10.0, 1.15, 1.8)
    sched, _ = make(SloConfig(ttft=1.0, tpot=None), overload_deferral=True)
    for i in range(4):
        sched.add(Request(i, 2.5 * i, 20000, 1000))
    assert sched._whole_work(Request(9, 0.0, 20000, 1000)) == pytest.approx(0.204 + 1000 * 0.52936 / 256)
    assert sched._shed == set()
    sched.add(Request(6, 7.5, 20000, 1001))
    sched.add(Request(7, 7.5, 100, 2))
    assert sched._shed == {6} and sched.num_shed == 1
    sched._order(7.5)
    assert sched.waiting[-1].id == 6 and 6 in sched._late
    sched.add(Request(8, 17.6, 20000, 1001))
    assert sched._shed == {6}


def test_a_deep_burst_defers_nobody(no_seat_gate):
    """The same arrivals closer together: six 2.2718 s requests at 0..5 s, then the 2.2739 s one at 5 s. The
    window carries 6 x 2.2718 + 2.2739 = 15.9047 s over 5 s, 3.18 a second: more than SHED_DEEP (1.8 x 5 =
    9 s), a burst that deferring the costliest few cannot bring under SHED_CAPACITY (deferred, they would wait
    out the burst behind the queue). Nobody is deferred, though the excess (15.9047 - 5.75 s) holds it."""
    sched, _ = make(SloConfig(ttft=1.0, tpot=None), overload_deferral=True)
    for i in range(6):
        sched.add(Request(i, float(i), 20000, 1000))
    sched.add(Request(6, 5.0, 20000, 1001))
    assert sched._shed == set() and sched.num_shed == 0


def test_deferred_requests_rejoin_the_queue_after_a_lull(no_seat_gate):
    """The overload of the first test above, TTFT target 10 s (deadlines: arrival + 10). LinearLatency
    prefills a 20000-token prompt in 0.2 s on the whole GPU (2 ms + 10 us a token; no decode runs). Ordered
    at 9 s, the last SHED_LULL (5 s) of arrivals, at 7.5 s (two: 2.2718 + 2.2739 s), carry more than
    SHED_LULL_LOAD (0.5) x 5 = 2.5 s: request 4 stays deferred, keyed at 17.5 + 20 x 10 = 217.5 s, last; the
    others end at 9.2-9.8 s, within their deadlines 10-17.5 s. Ordered at 13 s, nothing arrived after 8 s:
    the overload is over and request 4 rejoins. Requests 0 and 1 (deadlines 10 and 12.5 s) are late at 13.2
    / 13.4 s, keyed at 210 and 212.5 s; 2, 3 and 4 end at 13.2, 13.4 and 13.6 s, within 15, 17.5 and 17.5 s,
    in deadline order (ties by id; shortest first is the same order: equal prompts)."""
    from bullet.policies.bullet import SHED_LULL, SHED_LULL_LOAD

    assert (SHED_LULL, SHED_LULL_LOAD) == (5.0, 0.5)
    sched, _ = make(SloConfig(ttft=10.0, tpot=None), overload_deferral=True)
    for i in range(4):
        sched.add(Request(i, 2.5 * i, 20000, 1000))
    sched.add(Request(4, 7.5, 20000, 1001))
    assert sched._shed == {4}
    sched._order(9.0)
    assert [r.id for r in sched.waiting] == [0, 1, 2, 3, 4] and sched._shed == {4}
    sched._order(13.0)
    assert sched._shed == set()
    assert [r.id for r in sched.waiting] == [2, 3, 4, 0, 1]


def test_nobody_is_deferred_while_seats_are_free(monkeypatch):
    """The overload of test_costliest_arrival_deferred_when_cheaper_ones_fill_the_window (request 6 at 7.5 s: an
    excess of 2.7361 s that holds its 2.2739 s), with 8 seats and SHED_SEATS = 3/4 of them: with 5 running
    (5 < 6) nobody is deferred, with 6 running (6 >= 6) request 6 is (the prompt's share aside: its own test)."""
    from bullet.policies import bullet as mod

    assert mod.SHED_SEATS == 0.75
    monkeypatch.setattr(mod, "SHED_PROMPT_SHARE", 0.0)
    for running, shed in ((5, set()), (6, {6})):
        sched, _ = make(SloConfig(ttft=1.0, tpot=None), max_num_seqs=8)
        sched.running = [decoding(100 + i, 1, 0.0, 50, 100) for i in range(running)]
        for i in range(4):
            sched.add(Request(i, 2.5 * i, 20000, 1000))
        sched.add(Request(6, 7.5, 20000, 1001))
        assert sched._shed == shed and sched.num_shed == len(shed)


def test_a_decode_heavy_request_is_not_deferred(no_seat_gate, monkeypatch):
    """The same overload. Request 6's prompt (20000 tokens) costs 0.204 s on the whole GPU and its 1001 output
    tokens 1001 x 0.52936 / 256 = 2.0699 s: the prompt is 0.0986 of its decode share. With SHED_PROMPT_SHARE at
    0.5 (the default) it is not deferred; at 0.09 (0.204 >= 0.09 x 2.0699 = 0.1863) it is."""
    from bullet.policies import bullet as mod

    for share, shed in ((0.5, set()), (0.09, {6})):
        monkeypatch.setattr(mod, "SHED_PROMPT_SHARE", share)
        sched, _ = make(SloConfig(ttft=1.0, tpot=None))
        assert sched._work_parts(Request(6, 7.5, 20000, 1001)) == (pytest.approx(0.204),
                                                                   pytest.approx(1001 * 0.52936 / 256))
        for i in range(4):
            sched.add(Request(i, 2.5 * i, 20000, 1000))
        sched.add(Request(6, 7.5, 20000, 1001))
        assert sched._shed == shed


def ride_case(ride, monkeypatch, seats=8, later=True):
    """Requests 0 (5 tokens to generate) and 1 (40) arrive at 0 s and decode together on the whole GPU; with
    ``seats`` 2, request 2 arrives at 1 ms and waits for a seat. ``later``: request 3 arrives at 100 s, so the
    stretches have a horizon (the next arrival) past request 1's end."""
    from bullet.policies.bullet import Bullet

    monkeypatch.setattr(Bullet, "ride_past_end", ride)
    reqs = [Request(0, 0.0, 100, 5), Request(1, 0.0, 100, 40)] + ([Request(2, 0.001, 100, 3)] if seats == 2 else [])
    reqs += [Request(3, 100.0, 100, 2)] if later else []
    done, steps, _ = run(reqs, SloConfig(tpot=0.05), max_num_seqs=seats)
    return {r.id: r for r in done}, [s for s in steps if s.batch.lane == "decode" and s.start < 100.0]


def test_a_decode_stretch_rides_past_a_completion_when_nobody_waits(monkeypatch):
    """With nobody waiting and seats free until the next arrival, request 0's completion ends no launch: one
    decode stretch carries both requests to request 1's last token, request 0's tokens stop at its own last (its
    later rows dropped), and its times are those of the same steps when its completion ended the stretch."""
    rode, rode_steps = ride_case(True, monkeypatch)
    cut, cut_steps = ride_case(False, monkeypatch)
    assert len(rode_steps) == 1 and len(cut_steps) == 2
    (stretch,) = rode_steps
    assert [c.req_id for c in stretch.batch.chunks] == [0, 1] and stretch.batch.steps == 39  # request 1's 39 left
    assert rode[0].num_output == 5 and rode[1].num_output == 40 and len(rode[0].token_times) == 5
    assert rode[0].finish_time == stretch.step_ends[3]  # its 4 decode tokens: steps 1-4 of the stretch
    assert rode[0].finish_time == cut[0].finish_time == cut_steps[0].end
    assert rode[1].finish_time == stretch.end


def test_no_ride_past_a_completion_without_a_horizon(monkeypatch):
    """With no arrival to come (a trace's tail), a stretch that rode past request 0's end would carry its row
    (its whole context read at every step) to the end of the longest request, however long: on the H200 model
    an arxiv tail took 3,272 steps of 80 rows for one request's 3,278 tokens and stretched the run from 25.6 s
    to 58.8 s. So the stretch ends at request 0's completion, as unfused steps would."""
    done, steps = ride_case(True, monkeypatch, later=False)
    assert [s.batch.steps for s in steps] == [4, 35]  # request 0's 4 decode steps left, then request 1's 35
    assert [c.req_id for c in steps[1].batch.chunks] == [1]
    assert done[0].finish_time == steps[0].end and done[1].finish_time == steps[1].end


def test_no_ride_past_a_completion_while_a_request_waits(monkeypatch):
    """Request 2 waits for one of 2 seats: request 0's completion frees it, so the stretch ends there."""
    done, steps = ride_case(True, monkeypatch, seats=2)
    first = steps[0]
    assert [c.req_id for c in first.batch.chunks] == [0, 1] and first.batch.steps == 4  # request 0's 4 left
    assert done[0].finish_time == first.end
    assert all(r.num_output == r.max_new_tokens for r in done.values())


def test_a_mixed_launchs_work_is_work_of_its_batch(monkeypatch):
    """The mixed launch's Work, summed from the job's and the decode rows' parts, is work_of() of its batch."""
    from bullet.perfmodel import work_of
    from bullet.policies.bullet import Bullet

    seen = []
    real = Bullet._start_prefill

    def start(self, now, batch, work, *a, **k):
        seen.append((batch, work))
        return real(self, now, batch, work, *a, **k)

    monkeypatch.setattr(Bullet, "_start_prefill", start)
    mixed_case(0.05, both=True)
    mixed = [(b, w) for b, w in seen if any(c.num_tokens == 1 for c in b.chunks)]
    assert mixed and all(w == work_of(b, L) for b, w in mixed)


def _decode_workload(n=400, seed=5):
    """Enough requests at once that hundreds run (the decode arrays engage from 64), with outputs long enough for
    fused stretches to cross block boundaries, under a TPOT target."""
    rng = np.random.default_rng(seed)
    return [Request(i, float(rng.uniform(0, 2.0)), int(rng.integers(20, 600)), int(rng.integers(20, 400)))
            for i in range(n)]


@pytest.mark.parametrize("num_blocks", [20000, 2600])  # roomy, and short enough that requests are preempted
def test_decode_from_the_arrays_equals_the_python_path(monkeypatch, num_blocks):
    """bullet's decode launches planned from the decode arrays (``_array_decode``) are the Python path's: the same
    launches (lane, SMs, steps, requests, starts) and per-request times, with and without preemption. Along the way
    the arrays' decoders are ``_decoders()``, their mirror of the tables is ``BlockManager.held``, the pool's
    invariants hold, a decode launch's chunks, read, name every block their stretch writes, and its requests are
    held (no abort) while it is in flight though not in ``busy``."""
    from bullet.policies.bullet import Bullet

    slo = SloConfig(ttft=None, ttft_per_token=0.003, tpot=0.08)

    def simulate(arrays: bool):
        sched, lat = make(slo, num_blocks=num_blocks)
        if not arrays:
            monkeypatch.setattr(sched, "_array_decoders", lambda: None)
        seen = {"fast": 0}
        plain = Bullet._array_decoders

        def checked(now, horizon):
            assert sched._flight_ids is None  # (the decode lane is idle: its last launch came back)
            fast = plain(sched) if arrays else None
            if fast is not None:
                seen["fast"] += 1
                assert [r.id for r in fast] == [r.id for r in sched._decoders()]
            batch = Bullet._schedule_decode(sched, now, horizon)
            if sched._flight_ids is not None:  # planned from the arrays: its requests are held, though not in busy
                rid = sched._flight_ids[-1]
                assert sched.holds(rid) and rid not in sched.busy and not sched.holds(-1)
                with pytest.raises(SchedulingError):
                    sched.abort(rid, now)
            if batch is not None and fast is not None and batch.steps > 1:
                for c in batch.chunks:  # (names the reserved blocks, as an executor's read does)
                    assert len(c.block_ids) * 16 >= c.start + batch.steps
            a = sched._arrays
            if a is not None:
                a.refresh_held()  # (read again if the Python path grew tables: a no-op when it says they are current)
                for rid, s in a.slot.items():
                    assert a.held[s] == sched.kv.held.get(rid, 0) or not a.dec[s] or rid in sched.busy
            sched.kv.check()
            return batch

        monkeypatch.setattr(sched, "_schedule_decode", checked)
        launches = []

        def note(res):
            b = res.batch
            launches.append((b.partition.lane, b.partition.num_sms, b.steps, b.layers.stop,
                             tuple((c.req_id, c.start, c.num_tokens) for c in b.chunks), res.end))

        done = serve([Request(r.id, r.arrival, r.prompt_len, r.max_new_tokens) for r in _decode_workload()], sched,
                     SimExecutor(lat, L, GPU), on_step=note)
        return launches, {r.id: (r.first_token_time, r.finish_time) for r in done}, sched, seen["fast"]

    fast, fast_times, sched, n_fast = simulate(True)
    slow, slow_times, ref, _ = simulate(False)
    assert n_fast > 50  # the arrays planned most decode launches
    assert fast == slow and fast_times == slow_times
    assert sched.num_preemptions == ref.num_preemptions and (sched.num_preemptions > 0) == (num_blocks < 10000)
    assert sched.kv.num_free == sched.kv.num_blocks
