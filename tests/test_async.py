"""Async scheduling (``SchedulerConfig.async_scheduling``): a lane's next launch is planned shortly before the one
in flight ends and queued behind it, so the engine's host time between launches is hidden. On the simulator
without host time it must change nothing; with host time, launches that follow one another without an
arrival in between start back to back; an end-of-sequence token drops the tokens of a launch already queued.
Exactly-once, aborts, streaming, EOS and KV pressure under async run in tests/test_engine.py,
tests/test_preemption.py and tests/test_gpu_executor.py (their "+async" and ``async_scheduling`` cases)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from bullet.cli import app
from bullet.config import GPUS, MODELS, ConfigError, SchedulerConfig
from bullet.engine import AHEAD_LEAD_S, Engine, ahead_lead, serve
from bullet.kvcache import BlockManager
from bullet.policies import make_scheduler
from bullet.request import Request, SamplingParams
from simulator import simulate
from simulator.executor import SimExecutor
from tests.latency import LinearLatency
from tests.test_engine import drive
from tests.test_scheduler import EchoExecutor

MODEL = MODELS["llama-3.1-8b"]
GPU = GPUS["h200"]
L = MODEL.num_layers


def poisson(n, rate, seed):
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, n))
    return [Request(i, float(t[i]), int(rng.integers(16, 2000)), int(rng.integers(1, 300))) for i in range(n)]


@pytest.mark.parametrize("policy", ["chunked", "prefill-first"])
def test_without_host_time_async_changes_nothing(policy):
    """With no host gap a launch planned ahead sees what the launch planned at its predecessor's end would
    (no arrival came between: otherwise it is planned at that end, as without async), and the requests its
    predecessor finishes have given up their seats and KV already: every request's times and outputs equal
    the synchronous engine's."""
    reqs = poisson(300, 25.0, seed=3)
    runs = [simulate(reqs, MODEL, GPU, SchedulerConfig(policy=policy, async_scheduling=a), token_times=True,
                     host_gap=(0.0, 0.0)) for a in (False, True)]
    key = [sorted((r.id, r.first_token_time, r.finish_time, r.num_output, tuple(r.token_times))
                  for r in run.requests) for run in runs]
    assert key[0] == key[1]
    assert runs[0].summary["launches"] == runs[1].summary["launches"]


def test_back_to_back_launches_skip_the_host_gap():
    """One request, one decode step a launch, a host gap of 1 ms: the synchronous engine starts each launch 1
    ms after the one before it ends, async only the first (its lane was idle): each token after the first
    comes exactly 1 ms sooner per launch, and the launch durations are the same."""
    gap = 1e-3
    out = {}
    for ahead in (False, True):
        lat = LinearLatency(L)
        kv = BlockManager(1000, 16)
        sched = make_scheduler(SchedulerConfig(policy="chunked", max_decode_steps=1, async_scheduling=ahead),
                               MODEL, GPU, kv, lat)
        steps = []
        (req,) = serve([Request(0, 0.0, 500, 6)], sched, SimExecutor(lat, L, GPU, (gap, 0.0)),
                       on_step=steps.append)
        out[ahead] = (req.token_times, [(s.start, s.end) for s in steps])
    (sync_t, sync_s), (async_t, async_s) = out[False], out[True]
    assert len(sync_s) == len(async_s) == 6
    assert async_s[0] == sync_s[0] and async_s[0][0] == pytest.approx(gap)  # the first launch pays the gap
    for k in range(1, 6):
        assert sync_s[k][0] == pytest.approx(sync_s[k - 1][1] + gap)
        assert async_s[k][0] == pytest.approx(async_s[k - 1][1])  # back to back
        assert async_s[k][1] - async_s[k][0] == pytest.approx(sync_s[k][1] - sync_s[k][0])
        assert async_t[k] == pytest.approx(sync_t[k] - k * gap)


def test_an_arrival_during_a_launch_is_in_the_next_one_queued_without_a_gap():
    """Trace replay knows the next arrival: while it is due before the launch in flight ends, nothing is planned
    ahead; once it has come, the next launch is planned with it and queued. So the arrival is in the launch right
    after the one it came during (as without async), and that launch starts at its predecessor's end, without
    the 1 ms host gap the synchronous engine pays there."""
    out = {}
    for ahead in (False, True):
        lat = LinearLatency(L)
        sched = make_scheduler(SchedulerConfig(policy="chunked", max_decode_steps=1, async_scheduling=ahead),
                               MODEL, GPU, BlockManager(1000, 16), lat)
        a, b = Request(0, 0.0, 400, 40), Request(1, 0.05, 100, 3)
        steps = []
        serve([a, b], sched, SimExecutor(lat, L, GPU, (1e-3, 0.0)), on_step=steps.append)
        first_with_b = next(s for s in steps if any(c.req_id == 1 for c in s.batch.chunks))
        before = steps[steps.index(first_with_b) - 1]
        out[ahead] = first_with_b.start - before.end
    assert out[False] == pytest.approx(1e-3) and out[True] == 0.0
    assert before.start <= b.arrival < before.end  # async: no gaps, so it came during that launch


def test_the_lead_covers_the_host_and_a_launch_ending_early():
    assert ahead_lead(0.005) == AHEAD_LEAD_S == 0.002  # a short launch: the host's time
    assert ahead_lead(0.08) == pytest.approx(0.008)  # a tenth of a long one


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(["chunked", "prefill-first"]), seed=st.integers(0, 2**16),
       eos=st.integers(20, 600), steps=st.sampled_from([1, 4, 64]), blocks=st.sampled_from([150, 4000]))
def test_eos_anywhere_under_async_matches_sync(policy, seed, eos, steps, blocks):
    """Token ids are positions (EchoExecutor), so the end-of-sequence id ``eos`` ends every request whose
    positions reach it, wherever that falls in a launch (fused or not, in a launch already queued behind it or
    not), with KV short or not: each request's output is the synchronous engine's, each ends once, the block
    manager stays consistent at every result, and everything is returned at the end."""
    outs = {}
    for ahead in (False, True):
        rng = np.random.default_rng(seed)
        t = np.cumsum(rng.exponential(1 / 30.0, 25))
        reqs = [Request(i, float(t[i]), int(rng.integers(8, 500)), int(rng.integers(1, 120)),
                        sampling=SamplingParams(ignore_eos=False)) for i in range(25)]
        lat = LinearLatency(L)
        kv = BlockManager(blocks, 16)
        sched = make_scheduler(SchedulerConfig(policy=policy, max_decode_steps=steps, async_scheduling=ahead),
                               MODEL, GPU, kv, lat, eos_token_id=eos)
        done = serve(reqs, sched, EchoExecutor(lat, L, GPU, (2e-4, 0.0)), on_step=lambda _r, kv=kv: kv.check())
        assert sorted(r.id for r in done) == list(range(25))
        assert kv.num_free == kv.num_blocks and not sched.running and not sched.waiting and not sched.busy
        for r in done:
            assert r.num_output == len(r.output_ids) == len(r.token_times)
        for r in done:  # the id sampled after position p - 1 is p: the output stops at eos where it is reached
            last = eos if r.prompt_len <= eos < r.prompt_len + r.max_new_tokens else r.prompt_len + r.max_new_tokens - 1
            assert r.output_ids == list(range(r.prompt_len, last + 1))
        outs[ahead] = {r.id: r.output_ids for r in done}
    assert outs[True] == outs[False]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(["chunked", "prefill-first"]), seed=st.integers(0, 2**16),
       eos=st.integers(20, 600), steps=st.sampled_from([1, 64]),
       aborts=st.lists(st.tuples(st.floats(0, 1.5), st.integers(0, 19)), max_size=8))
def test_aborts_and_eos_under_async_end_each_request_once(policy, seed, eos, steps, aborts):
    """A live engine under async scheduling (streaming, arrivals unknown), with EOS anywhere and aborts at random
    times (of requests queued, in flight, queued behind a launch, ended or not yet arrived): every request ends
    exactly once, its streamed tokens are its output and a prefix of the hand-computed one, the pool stays
    consistent at every result, and everything is returned at the end."""
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / 30.0, 20))
    reqs = [Request(i, float(t[i]), int(rng.integers(8, 500)), int(rng.integers(1, 120)),
                    sampling=SamplingParams(ignore_eos=False)) for i in range(20)]
    lat = LinearLatency(L)
    kv = BlockManager(300, 16)
    sched = make_scheduler(SchedulerConfig(policy=policy, max_decode_steps=steps, async_scheduling=True),
                           MODEL, GPU, kv, lat, eos_token_id=eos)
    engine = Engine(sched, EchoExecutor(lat, L, GPU, (2e-4, 0.0)), stream=True, live_window=0.02,
                    on_step=lambda _r: kv.check())
    ups = drive(engine, reqs, aborts)
    ends = [u for u in ups if u.finished]
    assert sorted(u.request.id for u in ends) == list(range(20))
    aborted = {rid for _, rid in aborts}
    for u in ends:
        r = u.request
        assert u.reason in ("stop", "length") or (u.reason == "abort" and r.id in aborted)
        last = eos if r.prompt_len <= eos < r.prompt_len + r.max_new_tokens else r.prompt_len + r.max_new_tokens - 1
        full = list(range(r.prompt_len, last + 1))
        assert r.output_ids == (full if u.reason != "abort" else full[:len(r.output_ids)])
        assert [x for v in ups if v.request is r for x in v.token_ids] == r.output_ids
    assert kv.num_free == kv.num_blocks and not sched.running and not sched.waiting and not sched.ahead.pinned


torch = pytest.importorskip("torch")
TINY = MODELS["tiny-llama"]


def test_eos_drops_the_tokens_of_a_launch_already_queued():
    """Real executor, tiny model on the CPU, one decode step a launch: a request whose end-of-sequence token
    comes back while its next launch is already queued ends at that token (the synchronous run's output), that
    launch's token for it is dropped, and its KV is freed when that launch returns."""
    from bullet.gpu.executor import GpuExecutor
    from bullet.gpu.weights import load_weights

    weights = load_weights(TINY, "dummy", "cpu", torch.float32, seed=5)

    def run(ahead, eos):
        rng = np.random.default_rng(7)
        reqs = [Request(i, 0.0, int(n), 12, prompt_ids=tuple(int(x) for x in rng.integers(0, TINY.vocab_size, n)),
                        sampling=SamplingParams(ignore_eos=False))  # (a benchmark request ignores EOS)
                for i, n in enumerate(rng.integers(3, 24, 5))]
        kv = BlockManager(128, 4)
        # launches predicted to take no time: the next one is planned ahead (and queued) as soon as one is made
        sched = make_scheduler(SchedulerConfig(policy="chunked", max_batched_tokens=32, max_decode_steps=1,
                                               async_scheduling=ahead), TINY, GPU, kv,
                               LinearLatency(TINY.num_layers, base=0.0, per_token=0.0, per_kv=0.0),
                               eos_token_id=eos)
        ex = GpuExecutor(TINY, "dummy", "cpu", block_size=4, num_blocks=128, seed=5, weights=weights)
        steps = []
        done = serve(reqs, sched, ex, on_step=steps.append)
        ex.close()
        assert kv.num_free == kv.num_blocks and not ex._reqs
        return {r.id: r for r in done}, steps

    full, _ = run(False, None)
    eos = full[0].output_ids[2]  # request 0 ends at its third token (or earlier, where that id comes first)
    ref, _ = run(False, eos)
    got, steps = run(True, eos)
    for rid, r in ref.items():
        assert got[rid].output_ids == r.output_ids and got[rid].num_output == r.num_output
        assert len(got[rid].token_times) == r.num_output
    ended = {rid: r.finish_time for rid, r in got.items() if r.output_ids[-1] == eos}
    assert 0 in ended
    late = [s for s in steps for c in s.batch.chunks if c.req_id in ended and s.start >= ended[c.req_id]]
    assert late  # a launch queued before the EOS came back still ran the request (its token dropped)


def test_split_policies_refuse_async_scheduling():
    for policy in ("static-split", "naive-concurrent", "bullet"):
        with pytest.raises(ConfigError, match=f"not {policy}"):
            SchedulerConfig(policy=policy, async_scheduling=True)
    res = CliRunner().invoke(app, ["simulate", "--policy", "bullet", "--async-scheduling", "--num-prompts", "5"])
    assert res.exit_code == 2 and "single-lane policies" in res.output and "Traceback" not in res.output
