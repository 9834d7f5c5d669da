"""Speed shortcuts that must not change a number: a fused decode stretch sized from a partial timing
(``Scheduler._steps_before``) ends where the full timing says, and a simulation with the shortcut disabled
gives the same times and launches to the bit."""

import numpy as np
import pytest

from bullet.config import GPUS, MODELS, CacheConfig, SchedulerConfig
from bullet.kvcache import BlockManager
from bullet.perfmodel import Work
from bullet.perfmodel.base import CachedLatency, step_ends
from bullet.perfmodel.roofline import RooflineModel
from bullet.policies import make_scheduler
from bullet.policies.base import Scheduler
from simulator import simulate
from simulator.run import default_latency_model
from tests.test_scheduler import make_requests

MODEL = MODELS["llama-3.1-8b"]
GPU = GPUS["h200"]


def full_answer(latency, work, extra, budget, sms, co, co_sms):
    """The stretch timed to its end, as ``_fused`` did before the shortcut."""
    cum = np.cumsum(latency.decode_steps(work, extra + 1, sms, co, co_sms))
    return min(extra, int(cum.searchsorted(budget)))


@pytest.mark.parametrize("model", ["roofline", "default"])
def test_steps_before_equals_the_full_timing(model):
    base = RooflineModel(MODEL, GPU) if model == "roofline" else default_latency_model(MODEL, GPU)
    latency = CachedLatency(base)
    sched = make_scheduler(SchedulerConfig(policy="chunked"), MODEL, GPU, BlockManager(100, 16), latency)
    rng = np.random.default_rng(3)
    co = Work(MODEL.num_layers, 3000, 2, 4.5e6, 3000, 2, True, 2000)
    checked = set()
    for _ in range(400):
        n = int(rng.integers(1, 64))
        kv = int(rng.integers(n, 4000 * n))
        work = Work(MODEL.num_layers, n, n, float(kv), kv, n, True, kv // n + 1)
        extra = int(rng.integers(1, 300))
        sms, pair = (132, (None, 0)) if rng.random() < 0.5 else (40, (co, 92))
        step = float(base.decode_steps(work, 1, sms, *pair)[0])
        budget = step * float(rng.choice([-1.0, 0.0, 0.5, 1.0, 3.0, 7.5, 30.0, 400.0]))
        guess = sched._step_s = step * float(rng.choice([0.0, 0.1, 0.9, 1.0, 1.1, 10.0]))  # good and bad
        want = full_answer(base, work, extra, budget, sms, *pair)
        got = sched._steps_before(work, extra, budget, sms, *pair)
        assert got == want, (work, extra, budget, sms)
        # the executor then times the chosen steps from what the sizing cached: the same ends
        cum = step_ends(latency, work, got + 1, sms, *pair)
        assert np.array_equal(cum, np.cumsum(base.decode_steps(work, got + 1, sms, *pair)))
        checked.add((got < extra, guess > 0))
    assert checked == {(True, True), (False, True), (True, False), (False, False)}  # every path taken


def test_simulation_without_the_shortcut_is_identical(monkeypatch):
    """Every request's times and the launch count, with stretches always timed to the end."""
    reqs = make_requests(400, seed=11, rate=25.0)
    cfgs = [SchedulerConfig(policy=p) for p in ("chunked", "prefill-first", "static-split", "bullet")]
    fast = [simulate(reqs, MODEL, GPU, c, CacheConfig()) for c in cfgs]

    def always_full(self, work, extra, budget, num_sms, co, co_sms):
        cum = step_ends(self.latency, work, extra + 1, num_sms, co, co_sms)
        return min(extra, int(np.searchsorted(cum, budget)))

    monkeypatch.setattr(Scheduler, "_steps_before", always_full)
    for cfg, a in zip(cfgs, fast):
        b = simulate(reqs, MODEL, GPU, cfg, CacheConfig())
        assert a.summary["launches"] == b.summary["launches"]
        key = {r.id: (r.first_token_time, r.finish_time) for r in b.requests}
        assert {r.id: (r.first_token_time, r.finish_time) for r in a.requests} == key
