"""Policies on the shared core, driven by serve() on the simulator: token conservation and order, the
token budget, KV capacity, progress under KV pressure, determinism, queueing sanity."""

import math

import numpy as np
import pytest

from bullet.batch import StepResult
from bullet.config import GPUS, MODELS, SchedulerConfig, SloConfig
from bullet.engine import serve
from bullet.kvcache import BlockManager
from bullet.policies import make_scheduler
from bullet.request import Request
from simulator import SimExecutor, simulate
from tests.latency import LinearLatency

MODEL = MODELS["llama-3.1-8b"]
GPU = GPUS["h200"]
POLICIES = ["chunked", "prefill-first", "static-split", "naive-concurrent", "bullet"]


class EchoExecutor(SimExecutor):
    """The simulator, plus token ids: the id sampled at position p is p, so order is checkable."""

    def wait(self, until):
        out = []
        for res in super().wait(until):
            toks = np.full((res.batch.steps, len(res.batch.chunks)), -1, np.int64)
            for j, c in enumerate(res.batch.chunks):
                if c.sample:
                    toks[:, j] = c.start + c.num_tokens + np.arange(res.batch.steps)
            out.append(StepResult(res.batch, res.start, res.end, res.step_ends, toks))
        return out


def make_requests(n, seed=0, rate=20.0, prompt=(16, 3000), output=(1, 300)):
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, n))
    return [Request(i, float(t[i]), int(rng.integers(*prompt)), int(rng.integers(*output))) for i in range(n)]


def run(policy, reqs, num_blocks=None, checks=None, **cfg):
    sched_cfg = SchedulerConfig(policy=policy, **cfg)
    lat = LinearLatency(MODEL.num_layers)
    kv = BlockManager(num_blocks or 6000, 16)  # 96k tokens: room for the load, cheap to check()
    sched = make_scheduler(sched_cfg, MODEL, GPU, kv, lat)
    ex = EchoExecutor(lat, MODEL.num_layers, GPU)
    steps = []

    def on_step(res):
        steps.append(res)
        kv.check()
        if checks:
            checks(res, sched)

    done = serve(reqs, sched, ex, on_step=on_step)
    return done, steps, sched


@pytest.mark.parametrize("policy", POLICIES)
def test_conserves_tokens_in_order(policy):
    reqs = make_requests(200, seed=1)
    done, _steps, sched = run(policy, reqs, layers_per_step=8 if "split" in policy else None)
    assert len(done) == len(reqs)
    for r in done:
        assert r.num_output == r.max_new_tokens
        assert r.output_ids == list(range(r.prompt_len, r.prompt_len + r.max_new_tokens))
        times = np.asarray(r.token_times)
        assert len(times) == r.max_new_tokens
        assert np.all(np.diff(times) >= 0) and times[0] >= r.arrival
        assert r.finish_time == pytest.approx(times[-1])
    assert sched.kv.num_free == sched.kv.num_blocks  # everything returned
    assert not sched.running and not sched.waiting


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("budget", [512, 2048])
def test_respects_token_budget(policy, budget):
    reqs = make_requests(80, seed=2)

    def check(res, sched):
        # bullet never chunks: a prompt longer than the budget runs whole, alone
        alone = policy == "bullet" and len(res.batch.chunks) == 1 and res.batch.lane == "prefill"
        assert res.batch.num_tokens <= budget or alone
        assert len(res.batch.chunks) <= sched.cfg.max_num_seqs

    done, steps, _ = run(policy, reqs, checks=check, max_batched_tokens=budget, max_num_seqs=32)
    assert len(done) == 80
    assert any(s.batch.num_tokens > 1 for s in steps)


@pytest.mark.parametrize("policy", POLICIES)
def test_progress_under_kv_pressure(policy):
    """A pool of 200 blocks (3,200 tokens) for requests of up to 3,300 tokens: preemption, no deadlock."""
    reqs = make_requests(60, seed=3, rate=100.0, prompt=(200, 2500), output=(50, 800))

    def check(res, sched):
        held = sum(sched.kv.held.values())  # (named blocks and reserved ones)
        assert held <= sched.kv.num_blocks
        sched.kv.check()
        for r in sched.running:  # every running request's table covers what it has computed
            assert sched.kv.held.get(r.id, 0) * 16 >= r.num_computed

    done, _steps, sched = run(policy, reqs, num_blocks=220, checks=check)
    assert len(done) == 60
    assert sched.num_preemptions > 0
    for r in done:
        assert r.output_ids == list(range(r.prompt_len, r.prompt_len + r.max_new_tokens))


def test_oversized_request_is_rejected_alone_with_a_message():
    """A request that can never be served (more KV than the whole pool, or more positions than the model)
    comes back at once with its reason; the others are served as if it had not been there."""
    ok = [Request(1, 0.0, 100, 10), Request(3, 0.2, 50, 5)]
    reqs = [Request(0, 0.0, 5000, 10), ok[0], Request(2, 0.1, 190000, 10000), ok[1]]
    done, _steps, _ = run("chunked", reqs, num_blocks=100)
    by_id = {r.id: r for r in done}
    assert "needs 5010 tokens" in by_id[0].error and by_id[0].finish_time == 0.0
    assert "needs 200000 positions" in by_id[2].error and by_id[2].num_output == 0
    alone, _, _ = run("chunked", [Request(1, 0.0, 100, 10), Request(3, 0.2, 50, 5)], num_blocks=100)
    for r in alone:
        assert by_id[r.id].error is None and by_id[r.id].token_times == r.token_times
    slo = SloConfig(ttft=10.0, tpot=10.0)
    from bullet.metrics import request_columns, summarize

    s = summarize(done, slo)
    assert s["requests"] == 2 and s["rejected"] == 2 and s["slo_attainment"] == 0.5
    assert list(request_columns(done, slo)["id"]) == [1, 3]


@pytest.mark.parametrize("policy", POLICIES)
def test_identical_inputs_identical_results(policy):
    a = simulate(make_requests(150, seed=4), MODEL, GPU, SchedulerConfig(policy=policy),
                 latency=LinearLatency(MODEL.num_layers))
    b = simulate(make_requests(150, seed=4), MODEL, GPU, SchedulerConfig(policy=policy),
                 latency=LinearLatency(MODEL.num_layers))
    for k in ("ttft", "tpot", "e2e", "finish"):
        assert np.array_equal(a.columns[k], b.columns[k], equal_nan=True)
    assert a.timeline.rows.__len__() == b.timeline.rows.__len__()


def test_lone_request_matches_the_latency_model_by_hand():
    """One request, nothing else: TTFT is one prefill, then each token one decode step of a growing
    context, all on the whole GPU."""
    lat = LinearLatency(MODEL.num_layers)
    req = Request(0, 1.0, 1000, 5)
    res = simulate([req], MODEL, GPU, SchedulerConfig(policy="chunked"), latency=lat)
    prefill = lat.base + lat.per_token * 1000 + lat.per_kv * 1000
    decode = [lat.base + lat.per_token + lat.per_kv * (1000 + i + 1) for i in range(4)]
    r = res.requests[0]
    assert r.first_token_time == pytest.approx(1.0 + prefill)
    assert r.finish_time == pytest.approx(1.0 + prefill + sum(decode))
    assert res.columns["tpot"][0] == pytest.approx(sum(decode) / 4)


def test_fused_stretch_equals_single_steps():
    """Fusing decode steps between events is only a speed-up: max_decode_steps=1 gives the same times."""
    reqs = make_requests(120, seed=5)
    kw = {"latency": LinearLatency(MODEL.num_layers)}
    fused = simulate(reqs, MODEL, GPU, SchedulerConfig(policy="chunked"), **kw)
    single = simulate(make_requests(120, seed=5), MODEL, GPU,
                      SchedulerConfig(policy="chunked", max_decode_steps=1), **kw)
    assert len(single.timeline.rows) > len(fused.timeline.rows)
    for k in ("ttft", "e2e"):
        np.testing.assert_allclose(fused.columns[k], single.columns[k], rtol=1e-9, atol=1e-9)


def test_md1_queue_waiting_time_and_utilisation():
    """One request at a time, identical requests, Poisson arrivals: an M/D/1 queue. Mean wait before
    service must match Pollaczek-Khinchine, W_q = rho S / (2 (1 - rho)), and busy fraction rho."""
    lat = LinearLatency(MODEL.num_layers)
    prompt, out = 500, 20
    service = (lat.base + lat.per_token * prompt + lat.per_kv * prompt
               + sum(lat.base + lat.per_token + lat.per_kv * (prompt + i + 1) for i in range(out - 1)))
    rho = 0.6
    rng = np.random.default_rng(7)
    n = 4000
    t = np.cumsum(rng.exponential(service / rho, n))
    reqs = [Request(i, float(t[i]), prompt, out) for i in range(n)]
    res = simulate(reqs, MODEL, GPU, SchedulerConfig(policy="prefill-first", max_num_seqs=1), latency=lat)
    wait = res.columns["e2e"] - service
    expected = rho * service / (2 * (1 - rho))
    assert wait.mean() == pytest.approx(expected, rel=0.1)
    busy = res.summary["lane_busy_s"]["all"] / res.summary["duration_s"]
    assert busy == pytest.approx(rho, rel=0.05)
    # Little's law on the same run: the number in system, averaged over 20,000 instants of the run,
    # equals arrival rate x mean time in system (M/D/1: L = rho + rho^2 / (2 (1 - rho)) = 1.05)
    arrivals, finishes = np.sort(res.columns["arrival"]), np.sort(res.columns["finish"])
    t = np.linspace(arrivals[0], finishes[-1], 20_000, endpoint=False)
    in_system = np.searchsorted(arrivals, t, side="right") - np.searchsorted(finishes, t, side="right")
    assert in_system.min() >= 0 and in_system.max() <= n
    span = finishes[-1] - arrivals[0]
    little = n / span * res.columns["e2e"].mean()
    assert in_system.mean() == pytest.approx(little, rel=0.03)
    assert little == pytest.approx(rho + rho**2 / (2 * (1 - rho)), rel=0.1)


def test_split_policies_use_their_partitions():
    reqs = make_requests(50, seed=8)
    _, steps, _ = run("static-split", reqs, prefill_sms=92, layers_per_step=8)
    lanes = {(s.batch.partition.lane, s.batch.partition.num_sms) for s in steps}
    assert lanes == {("prefill", 92), ("decode", 40)}
    assert {len(s.batch.layers) for s in steps if s.batch.lane == "prefill"} == {8}
    _, steps, _ = run("naive-concurrent", make_requests(50, seed=8))
    assert {(s.batch.partition.lane, s.batch.partition.num_sms) for s in steps} == {("prefill", 132),
                                                                                   ("decode", 132)}


def test_split_lanes_overlap_in_time():
    reqs = make_requests(100, seed=9, rate=50.0)
    _, steps, _ = run("static-split", reqs)
    pre = [(s.start, s.end) for s in steps if s.batch.lane == "prefill"]
    dec = [(s.start, s.end) for s in steps if s.batch.lane == "decode"]
    overlap = sum(max(0.0, min(a1, b1) - max(a0, b0)) for a0, a1 in pre for b0, b1 in dec)
    assert overlap > 0


def test_bad_static_split_is_a_config_error():
    from bullet.config import ConfigError

    with pytest.raises(ConfigError, match="not a prefill size"):
        run("static-split", make_requests(2), prefill_sms=96)


def test_contention_slows_co_running_lanes():
    reqs = make_requests(100, seed=10, rate=50.0)
    cfg = SchedulerConfig(policy="static-split")
    calm = simulate(reqs, MODEL, GPU, cfg, latency=LinearLatency(MODEL.num_layers, contention=1.0))
    busy = simulate(make_requests(100, seed=10, rate=50.0), MODEL, GPU, cfg,
                    latency=LinearLatency(MODEL.num_layers, contention=1.3))
    assert busy.columns["e2e"].mean() > calm.columns["e2e"].mean()


def test_slo_config_per_token():
    slo = SloConfig(ttft=None, tpot=0.1, ttft_per_token=0.001)
    assert slo.ttft_target(500) == pytest.approx(0.5)
    assert math.isclose(SloConfig().ttft_target(10), 3.0)


def test_inline_work_equals_work_of():
    """The policy's inline Work of a fused launch's first step equals work_of() of that step, so the
    simulator's re-ask hits the latency cache."""
    from bullet.perfmodel import work_of

    seen = []

    class Spy(LinearLatency):
        def decode_steps(self, work, steps, num_sms, co=None, co_sms=0):
            seen.append(work)
            return super().decode_steps(work, steps, num_sms, co, co_sms)

    lat = Spy(MODEL.num_layers)
    kv = BlockManager(6000, 16)
    sched = make_scheduler(SchedulerConfig(policy="chunked"), MODEL, GPU, kv, lat)
    steps = []
    serve(make_requests(60, seed=11), sched, SimExecutor(lat, MODEL.num_layers, GPU), on_step=steps.append)
    works = {work_of(s.batch, MODEL.num_layers) for s in steps if s.batch.steps > 1}
    assert works and works <= set(seen) | {w for w in works if w.tokens != w.seqs}


@pytest.mark.parametrize("policy", POLICIES)
def test_end_of_sequence_ends_a_request(policy):
    """EchoExecutor samples token p at position p. With the end-of-sequence id 130, a request with a 100-token
    prompt ends after its 31st token (ids 100..130) wherever that token falls: a single step, inside a fused
    stretch or at a stretch's end (the last case ran on to max_new_tokens before)."""
    from bullet.request import SamplingParams

    stop = SamplingParams(ignore_eos=False)
    lat = LinearLatency(MODEL.num_layers)
    for max_steps in (1, 2, 3, 7, 31, 1 << 30):
        reqs = [Request(0, 0.0, 100, 200, sampling=stop), Request(1, 0.0, 90, 200, sampling=stop),
                Request(2, 0.0, 50, 20)]  # request 2 ignores it (and never samples 130 anyway)
        kv = BlockManager(600, 16)
        cfg = SchedulerConfig(policy=policy, max_decode_steps=max_steps)
        sched = make_scheduler(cfg, MODEL, GPU, kv, lat, eos_token_id=130)
        done = {r.id: r for r in serve(reqs, sched, EchoExecutor(lat, MODEL.num_layers, GPU))}
        assert done[0].output_ids == list(range(100, 131)), max_steps
        assert done[1].output_ids == list(range(90, 131)), max_steps
        assert done[2].output_ids == list(range(50, 70))
        assert len(done[0].token_times) == 31 and done[0].finish_time == done[0].token_times[-1]
        assert kv.num_free == 600
