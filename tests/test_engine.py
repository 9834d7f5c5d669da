"""The online engine (bullet/engine.py): streamed updates add up to each request's output, every request ends
exactly once, aborts free KV at once or when the launch holding the request returns, a request that cannot be
served is rejected alone, EOS ends a request wherever it falls in a fused launch (every policy, real executor),
and the engine thread (bullet/server/runner.py) answers every accepted request even when a step raises."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bullet.config import GPUS, MODELS, SchedulerConfig
from bullet.engine import ABORTED, Engine, serve
from bullet.kvcache import BlockManager
from bullet.policies import make_scheduler
from bullet.policies.base import SchedulingError
from bullet.request import Request, SamplingParams
from tests.latency import LinearLatency
from tests.test_scheduler import EchoExecutor

MODEL = MODELS["llama-3.1-8b"]
GPU = GPUS["h200"]
# "+async": the policy with async scheduling (each launch planned while the one before it runs)
POLICIES = ["chunked", "prefill-first", "static-split", "naive-concurrent", "bullet", "chunked+async",
            "prefill-first+async"]
SPLIT = {"static-split": {"layers_per_step": 8}, "bullet": {"layers_per_step": 8}}


def config(policy, **cfg):
    name, _, mode = policy.partition("+")
    return SchedulerConfig(policy=name, async_scheduling=mode == "async", **{**SPLIT.get(name, {}), **cfg})


def setup(policy, num_blocks=4000, **cfg):
    lat = LinearLatency(MODEL.num_layers)
    kv = BlockManager(num_blocks, 16)
    sched = make_scheduler(config(policy, **cfg), MODEL, GPU, kv, lat)
    return sched, EchoExecutor(lat, MODEL.num_layers, GPU), kv


def make_requests(n, seed=0, rate=50.0):
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, n))
    return [Request(i, float(t[i]), int(rng.integers(16, 1500)), int(rng.integers(1, 200))) for i in range(n)]


def drive(engine: Engine, reqs, aborts=(), step_until=None):
    """Feed ``reqs`` at their arrival times like serve() does, aborting ``(time, req_id)`` pairs when the
    clock passes them; returns every update."""
    pending = sorted(reqs, key=lambda r: r.arrival)
    aborts = sorted(aborts)
    ups = []
    ex = engine.executor
    while pending or aborts or not engine.idle:
        now = ex.now()
        while pending and pending[0].arrival <= now:
            engine.add(pending.pop(0))
        while aborts and aborts[0][0] <= now:
            engine.abort(aborts.pop(0)[1])
        nxt = min([r.arrival for r in pending[:1]] + [t for t, _ in aborts[:1]], default=None)
        if step_until is not None:
            nxt = now + step_until if nxt is None else min(nxt, now + step_until)
        ups += engine.step(nxt)
    return ups + engine.flush()


@pytest.mark.parametrize("policy", POLICIES)
def test_stream_updates_add_up_to_each_output(policy):
    """Stream mode: per request, the updates' ids and times concatenate to its output_ids and token_times,
    tokens arrive in order (the echo ids are positions), and exactly the last update is the finishing one."""
    sched, ex, kv = setup(policy)
    reqs = make_requests(60, seed=1)
    ups = drive(Engine(sched, ex, stream=True), reqs)
    by_req: dict[int, list] = {}
    for u in ups:
        by_req.setdefault(u.request.id, []).append(u)
    assert sorted(by_req) == [r.id for r in reqs]
    for r in reqs:
        seq = by_req[r.id]
        assert [u.finished for u in seq] == [False] * (len(seq) - 1) + [True]
        assert seq[-1].reason == "length"
        ids = [t for u in seq for t in u.token_ids]
        assert ids == r.output_ids == list(range(r.prompt_len, r.prompt_len + r.max_new_tokens))
        assert [t for u in seq for t in u.token_times] == r.token_times
    assert kv.num_free == kv.num_blocks and not sched.running and not sched.waiting


@pytest.mark.parametrize("policy", POLICIES)
def test_serve_is_the_engine(policy):
    """serve() and a hand-driven non-streaming Engine give identical requests (times, outputs, order)."""
    a = make_requests(80, seed=2)
    b = make_requests(80, seed=2)
    done = serve(a, *setup(policy)[:2])
    ups = drive(Engine(*setup(policy)[:2]), b)
    assert all(u.finished for u in ups)
    key = [(r.id, r.first_token_time, r.finish_time, tuple(r.token_times)) for r in done]
    assert key == [(u.request.id, u.request.first_token_time, u.request.finish_time, tuple(u.request.token_times))
                   for u in ups]


def test_abort_of_an_idle_request_frees_its_kv_at_once():
    sched, ex, kv = setup("chunked", max_decode_steps=4)
    eng = Engine(sched, ex, stream=True)
    eng.add(Request(0, 0.0, 100, 50))
    eng.add(Request(1, 0.0, 100, 50))
    eng.step(None)  # the prefill of both
    assert set(kv.tables) == {0, 1} and not ex.busy("all")
    held = kv.held[1]
    free = kv.num_free
    assert eng.abort(1)
    (u,) = eng.flush()
    assert u.request.id == 1 and u.finished and u.reason == "abort" and u.request.error == ABORTED
    assert 1 not in kv.tables and kv.num_free == free + held
    assert not eng.abort(1)  # already gone
    rest = drive(eng, [])
    assert [u.request.id for u in rest if u.finished] == [0]
    assert kv.num_free == kv.num_blocks


def test_abort_of_a_waiting_request():
    sched, ex, kv = setup("chunked", max_num_seqs=1, max_decode_steps=4)
    eng = Engine(sched, ex, stream=True)
    eng.add(Request(0, 0.0, 100, 50))
    eng.add(Request(1, 0.0, 100, 50))
    eng.step(None)
    assert [r.id for r in sched.waiting] == [1] and 1 not in kv.tables
    eng.abort(1)
    assert not sched.waiting and eng.flush()[0].reason == "abort"
    drive(eng, [])
    assert kv.num_free == kv.num_blocks


@pytest.mark.parametrize("policy", POLICIES)
def test_abort_inside_a_launch_takes_effect_when_it_returns(policy):
    """An abort of a request inside a launch in flight leaves its KV alone until that launch (or, for a
    layer-sliced prefill, the slice sequence) returns; then it is freed and the request ends once."""
    sched, ex, kv = setup(policy)
    eng = Engine(sched, ex, stream=True)
    for i in range(4):
        eng.add(Request(i, 0.0, 1200, 100))
    eng.step(1e-4)  # everything just launched is still in flight
    assert any(ex.busy(lane) for lane in sched.lanes)
    victim = next(iter(sched.busy or sched.ahead.pinned))  # (async scheduling: its launch holds it, planned or not)
    assert eng.abort(victim) and not eng.flush()
    assert victim in kv.tables  # not yet: the launch holding it is in flight
    ends = []
    launches = 0
    while not ends:
        launches += 1
        ends = [u for u in eng.step(None) if u.finished and u.request.id == victim]
    assert ends[0].reason == "abort" and victim not in kv.tables
    assert victim not in sched.busy and all(r.id != victim for r in sched.running)
    kv.check()
    rest = drive(eng, [])
    assert sorted(u.request.id for u in rest if u.finished) == sorted(set(range(4)) - {victim})
    assert kv.num_free == kv.num_blocks


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(POLICIES), seed=st.integers(0, 2**16),
       aborts=st.lists(st.tuples(st.floats(0, 3), st.integers(0, 29)), max_size=12))
def test_every_request_ends_exactly_once(policy, seed, aborts):
    """Random arrivals and aborts at random times (of requests queued, running, in flight, finished or not
    yet arrived): every request ends exactly once, tokens come in order, the block manager stays
    consistent, and everything is returned at the end."""
    sched, ex, kv = setup(policy, num_blocks=600)
    reqs = make_requests(30, seed=seed, rate=20)
    ups = drive(Engine(sched, ex, stream=True, on_step=lambda _res: kv.check()), reqs, aborts)
    ends = [u.request.id for u in ups if u.finished]
    assert sorted(ends) == list(range(30))
    aborted = {rid for _, rid in aborts}
    for u in ups:
        if u.finished and u.reason == "abort":
            assert u.request.id in aborted
    for r in reqs:
        assert r.output_ids == list(range(r.prompt_len, r.prompt_len + r.num_output))
    assert kv.num_free == kv.num_blocks and not sched.running and not sched.waiting and not sched.busy


def test_a_request_that_cannot_be_served_is_rejected_alone():
    sched, ex, _ = setup("chunked", num_blocks=100)
    eng = Engine(sched, ex, stream=True)
    ok = Request(0, 0.0, 100, 10)
    assert eng.add(ok)
    assert not eng.add(Request(1, 0.0, 5000, 10))  # more KV than the whole pool
    assert not eng.add(Request(0, 0.0, 10, 10))  # the id of a request being served
    first = eng.flush()
    assert [(u.request.id, u.reason) for u in first] == [(1, "error"), (0, "error")]
    assert "1600 tokens" in first[0].request.error or "blocks" in first[0].request.error
    assert "already being served" in first[1].request.error
    rest = drive(eng, [])
    assert [u.request.id for u in rest if u.finished] == [0] and ok.num_output == 10


def test_a_stall_raises_without_a_horizon():
    sched, ex, _ = setup("chunked")
    sched.schedule = lambda lane, now, horizon: None  # a policy that never launches
    eng = Engine(sched, ex, stream=True)
    eng.add(Request(0, 0.0, 10, 10))
    with pytest.raises(SchedulingError, match="stalled"):
        eng.step(None)
    eng.step(1.0)  # with a horizon the engine waits (serve: an arrival may come) and says it is stalled
    assert eng.stalled and ex.now() == 1.0


# ---- the real executor's CPU path: EOS ------------------------------------------------------------------
torch = pytest.importorskip("torch")
TINY = MODELS["tiny-llama"]


@pytest.fixture(scope="module")
def tiny_weights():
    from bullet.gpu.weights import load_weights

    return load_weights(TINY, "dummy", "cpu", torch.float32, seed=5)


def tiny_run(weights, policy, eos, ignore_eos, **cfg):
    from bullet.gpu.executor import GpuExecutor

    rng = np.random.default_rng(7)
    reqs = []
    for i in range(5):
        plen = int(rng.integers(3, 24))
        ids = tuple(int(x) for x in rng.integers(0, TINY.vocab_size, plen))
        reqs.append(Request(i, 0.002 * i, plen, 10, prompt_ids=ids, sampling=SamplingParams(ignore_eos=ignore_eos)))
    ex = GpuExecutor(TINY, "dummy", "cpu", block_size=4, num_blocks=128, seed=5, weights=weights)
    kv = BlockManager(128, 4)
    cfg = {**({"layers_per_step": 1} if policy.partition("+")[0] in SPLIT else {}), **cfg}
    sched = make_scheduler(config(policy, max_batched_tokens=32, **cfg), TINY, GPU, kv,
                           LinearLatency(TINY.num_layers), eos_token_id=eos)
    ups = drive(Engine(sched, ex, stream=True), reqs, step_until=0.01)
    ex.close()
    assert kv.num_free == kv.num_blocks and not ex._reqs
    return reqs, {u.request.id: u.reason for u in ups if u.finished}


@pytest.mark.parametrize("policy,fuse", [(p, 64) for p in POLICIES] + [("chunked", 1), ("chunked+async", 1)])
def test_eos_ends_a_request_wherever_it_falls(tiny_weights, policy, fuse):
    """Outputs without an EOS id are the reference; with EOS = a token some outputs produce (first at a
    chosen position), each output is cut right after its first EOS (reason "stop"), whether the EOS was a
    single step, inside a fused stretch or its last token; ignore_eos runs on to max_tokens."""
    full, _ = tiny_run(tiny_weights, policy, None, False, max_decode_steps=fuse)
    first = full[0].output_ids
    eos = next(t for k, t in enumerate(first) if k >= 1 and t not in first[:k])
    cut, reasons = tiny_run(tiny_weights, policy, eos, False, max_decode_steps=fuse)
    for f, c in zip(full, cut):
        if eos in f.output_ids:
            assert c.output_ids == f.output_ids[:f.output_ids.index(eos) + 1] and reasons[c.id] == "stop"
        else:
            assert c.output_ids == f.output_ids and reasons[c.id] == "length"
    assert reasons[0] == "stop"
    kept, reasons = tiny_run(tiny_weights, policy, eos, True, max_decode_steps=fuse)
    assert [r.output_ids for r in kept] == [r.output_ids for r in full]
    assert set(reasons.values()) == {"length"}


# ---- the engine thread ----------------------------------------------------------------------------------
def test_runner_answers_everything_when_a_step_raises():
    from bullet.server.runner import EngineDead, EngineRunner

    sched, ex, _ = setup("chunked")
    eng = Engine(sched, ex, stream=True)
    got: list = []
    done = threading.Event()

    def deliver(ups):
        got.extend(ups)
        if sum(u.finished for u in got) == 3:
            done.set()

    def boom(batch):
        raise RuntimeError("device lost")

    ex.launch = boom
    runner = EngineRunner(eng, deliver, window_s=0.001)
    for i in range(3):
        runner.submit(Request(i, 0.0, 10, 10))
    runner.start()
    assert done.wait(30)
    assert runner.join(30) and not runner.alive
    assert sorted(u.request.id for u in got if u.finished) == [0, 1, 2]
    assert all("device lost" in u.request.error for u in got if u.finished)
    with pytest.raises(EngineDead, match="device lost"):
        runner.submit(Request(3, 0.0, 10, 10))


def test_runner_close_finishes_then_aborts():
    """close(timeout): requests in flight finish if they can by the deadline; after it they are aborted."""
    from bullet.server.runner import EngineDead, EngineRunner

    sched, ex, kv = setup("chunked")
    eng = Engine(sched, ex, stream=True)
    got: list = []
    runner = EngineRunner(eng, got.extend, window_s=0.001)
    runner.start()
    runner.submit(Request(0, 0.0, 10, 5))
    runner.close(0.0)  # the deadline is now: whatever is held when the thread looks is aborted
    assert runner.join(30)
    (end,) = [u for u in got if u.finished]
    assert end.reason in ("abort", "length")  # it may have finished before the thread saw the deadline
    assert kv.num_free == kv.num_blocks
    with pytest.raises(EngineDead):
        runner.submit(Request(1, 0.0, 10, 5))


def test_runner_ends_stalled_requests_instead_of_spinning():
    from bullet.server.runner import EngineRunner

    sched, ex, _ = setup("chunked")
    sched.schedule = lambda lane, now, horizon: None
    got: list = []
    done = threading.Event()
    runner = EngineRunner(Engine(sched, ex, stream=True), lambda ups: (got.extend(ups), done.set()), window_s=0.001)
    runner.start()
    runner.submit(Request(0, 0.0, 10, 10))
    assert done.wait(30)
    (u,) = got
    assert u.finished and u.reason == "abort" and "stalled" in u.request.error and not sched.waiting
    runner.close(0.0)
    assert runner.join(30)


def test_step_plans_to_the_horizon_and_waits_to_until():
    """``Engine.step(until, horizon=h)``: the policy plans with ``h`` and the executor waits to ``until``; without
    ``horizon`` both are ``until``."""
    sched, ex, _ = setup("chunked")
    planned, waited = [], []
    schedule, wait = sched.schedule, ex.wait
    sched.schedule = lambda lane, now, horizon: planned.append(horizon) or schedule(lane, now, horizon)
    ex.wait = lambda until: waited.append(until) or wait(until)
    eng = Engine(sched, ex)
    eng.add(Request(0, 0.0, 100, 50))
    eng.step(0.5, horizon=0.01)
    assert (planned, waited) == ([0.01], [0.5])
    eng.step(0.7)
    assert (planned[-1], waited[-1]) == (0.7, 0.7)


@pytest.mark.parametrize("policy", POLICIES)
def test_live_window_plans_as_the_live_engine(policy):
    """serve(live_window=w) plans as bullet run's engine thread: no fused launch is planned past ``w`` ahead of
    its start (beyond one step, the shortest a launch can be), and on the whole GPU a launch that samples a
    first token is one step. Every request still gets all its tokens."""
    w = 0.02
    sched, ex, _ = setup(policy)
    launches = []
    reqs = make_requests(60, seed=4)
    done = serve(reqs, sched, ex, on_step=launches.append, live_window=w)
    assert sorted(r.id for r in done) == list(range(60)) and all(r.num_output == r.max_new_tokens for r in done)
    fused = [res for res in launches if res.batch.steps > 1]
    assert fused  # decode still fuses
    for res in fused:  # a fused stretch ends within the window, give or take its own last step
        assert res.step_ends[-2] - res.start <= w + 1e-12, (res.start, res.step_ends)
    if "all" in sched.lanes:
        firsts = [res for res in launches if any(c.sample and c.num_tokens > 1 for c in res.batch.chunks)]
        assert firsts and all(res.batch.steps == 1 for res in firsts)
