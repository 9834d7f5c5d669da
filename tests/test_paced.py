"""PacedExecutor (simulator/paced.py): the simulator on a wall clock. On a fake clock (no sleeping, no timing):
launches end when the latency model says, a lane stays busy until its result is returned, sampled positions
get their placeholder ids, and a trace served through it gives the simulator's own times."""

from __future__ import annotations

import pytest

from bullet.batch import Batch, Chunk, Partition
from bullet.config import GPUS, MODELS, SchedulerConfig
from bullet.engine import serve
from bullet.kvcache import BlockManager
from bullet.policies import make_scheduler
from simulator import SimExecutor
from simulator.paced import TOKEN_BASE, PacedExecutor
from tests.latency import LinearLatency
from tests.test_engine import make_requests

MODEL, GPU = MODELS["llama-3.1-8b"], GPUS["h200"]


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0  # the executor counts from its creation

    def __call__(self) -> float:
        return self.t

    def sleep(self, d: float) -> None:
        self.t += d


def paced(lat):
    clock = FakeClock()
    return PacedExecutor(SimExecutor(lat, MODEL.num_layers, GPU), clock, clock.sleep), clock


def test_a_launch_ends_when_the_model_says_with_placeholder_tokens():
    lat = LinearLatency(MODEL.num_layers)  # 2 ms + 10 us a token + 0.1 us a KV token, whole GPU
    ex, _ = paced(lat)
    chunks = (Chunk(1, 0, 100, (0,) * 7, True), Chunk(2, 40, 1, (1,) * 3, True), Chunk(3, 0, 50, (2,) * 4, False))
    ex.launch(Batch(Partition("all", GPU.num_sms), range(MODEL.num_layers), chunks))
    # by hand: 151 tokens, KV read 100 + 41 + 50 = 191 tokens
    want = 2e-3 + 1e-5 * 151 + 1e-7 * 191
    assert ex.wait(want / 2) == [] and ex.now() == pytest.approx(want / 2) and ex.busy("all")
    (res,) = ex.wait(None)
    assert res.end == pytest.approx(want, rel=1e-12) and ex.now() == pytest.approx(want) and not ex.busy("all")
    # chunk 1 samples position 100, chunk 2 position 41 (after its 40 computed), chunk 3 does not sample
    assert res.tokens.tolist() == [[TOKEN_BASE + 100 % 26, TOKEN_BASE + 41 % 26, -1]]


def test_a_lane_stays_busy_until_its_result_is_returned():
    """A decode launch that ended while the engine was not waiting (the clock moved on) is still busy until
    ``wait`` hands its result over, as a GPU launch is until its events are read."""
    lat = LinearLatency(MODEL.num_layers)
    ex, clock = paced(lat)
    dec = Batch(Partition("decode", 40), range(MODEL.num_layers), (Chunk(1, 9, 1, (0,), True),))
    ex.launch(dec)
    clock.t += 1.0  # long past its end
    pre = Batch(Partition("prefill", 92), range(8), (Chunk(2, 0, 64, (1,) * 4, False),))
    ex.launch(pre)  # the clock catches up here: decode's launch ends inside the executor
    assert ex.busy("decode") and ex.busy("prefill")
    first = ex.wait(None)
    assert [r.batch.lane for r in first] == ["decode"] and not ex.busy("decode")


@pytest.mark.parametrize("policy", ["chunked", "static-split", "bullet"])
def test_serving_a_trace_through_it_gives_the_simulators_times(policy):
    """On a fake clock whose sleeps land exactly, pacing changes no time: every request's first and last token
    times equal those of the simulator alone (to rounding of the sleeps)."""
    cfg = SchedulerConfig(policy=policy, **({"layers_per_step": 8} if policy != "chunked" else {}))

    def run(ex):
        lat = ex.sim.latency if isinstance(ex, PacedExecutor) else ex.latency
        sched = make_scheduler(cfg, MODEL, GPU, BlockManager(4000, 16), lat)
        return {r.id: (r.first_token_time, r.finish_time) for r in serve(make_requests(40, seed=3), sched, ex)}

    lat = LinearLatency(MODEL.num_layers)
    alone = run(SimExecutor(lat, MODEL.num_layers, GPU))
    live = run(paced(lat)[0])
    assert alone.keys() == live.keys()
    for rid, (first, last) in alone.items():
        assert live[rid] == pytest.approx((first, last), abs=1e-9), rid
