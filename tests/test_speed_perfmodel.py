"""The latency models' fast paths (plain floats, memoised setups) give the slow paths' numbers to the bit."""

from __future__ import annotations

import numpy as np
import pytest

from bullet.config import resolve_gpu, resolve_model
from bullet.perfmodel.base import CachedLatency, Work, step_times
from bullet.perfmodel.fitted import FLOAT_STRETCH
from simulator.run import latency_model

SPEC, GPU = resolve_model("llama-3.1-8b"), resolve_gpu("h200")
N = GPU.num_sms


def models():
    return {"fitted": latency_model("fitted", SPEC, GPU), "roofline": latency_model("roofline", SPEC, GPU)}


def random_decode(rng) -> Work:
    b = int(rng.choice([1, 2, 3, 8, 30, 64, 100, 128, 200, 256, 300]))
    ctx = rng.integers(1, 9000, b)
    if rng.random() < 0.3:  # near a block boundary of the longest attention program
        ctx[0] = 64 * int(rng.integers(1, 100)) - int(rng.integers(0, 3))
    max_kv = 0 if rng.random() < 0.1 else int(ctx.max())
    return Work(int(rng.choice([8, 16, 32])), b, b, float(ctx.sum()), int(ctx.sum()), b, True, max_kv)


def random_co(rng, n):
    """(co-runner, its SMs), or (None, 0); disjoint or overlapping, the SM count an int or a numpy int."""
    if rng.random() < 0.4:
        return None, 0
    t = int(rng.integers(1, 8000))
    co = Work(8, t, 1, t * (t + 1) / 2, t, 1, True, t) if rng.random() < 0.7 else \
        Work(32, 16, 16, 16 * 900.0, 16 * 900, 16, True, 900)
    cs = int(rng.integers(1, N + 1)) if rng.random() < 0.3 else max(1, N - n)
    return co, (np.int64(cs) if rng.random() < 0.2 else cs)


def test_fitted_decode_step_ends_equal_decode_steps_to_the_bit():
    fm = models()["fitted"]
    rng = np.random.default_rng(13)
    for _ in range(1500):
        w = random_decode(rng)
        n = int(rng.integers(1, N + 1))
        steps = int(rng.integers(1, FLOAT_STRETCH + 8))
        co, cs = random_co(rng, n)
        for _ in range(2):  # the second time from the memoised setup
            times, ends = fm.decode_step_ends(w, steps, n, co, cs)
            ref = fm.decode_steps(w, steps, n, co, cs)
            assert np.array_equal(np.asarray(times), ref), (w, steps, n, co, cs)
            assert np.array_equal(ends, ref.cumsum())


def test_fitted_decode_stretch_asked_for_more_steps_goes_on_to_the_bit():
    """A stretch asked again for more steps (a policy's growing guess) goes on from the steps computed before:
    the same numbers as a stretch computed whole."""
    fm = models()["fitted"]
    rng = np.random.default_rng(17)
    for _ in range(500):
        w = random_decode(rng)
        n = int(rng.integers(1, N + 1))
        co, cs = random_co(rng, n) if rng.random() < 0.5 else (None, 0)
        first = int(rng.integers(1, FLOAT_STRETCH))
        fm.decode_step_ends(w, first, n, co, cs)
        for steps in (first + int(rng.integers(1, 8)), FLOAT_STRETCH):
            times, ends = fm.decode_step_ends(w, steps, n, co, cs)
            ref = fm.decode_steps(w, steps, n, co, cs)
            assert np.array_equal(np.asarray(times), ref), (w, first, steps, n, co, cs)
            assert np.array_equal(ends, ref.cumsum())


@pytest.mark.parametrize("name", ["fitted", "roofline"])
def test_cached_step_ends_equal_the_cumsum_of_step_times(name):
    """CachedLatency.step_ends (the mixed first step's decode tail from the model's plain-float stretch) is
    np.cumsum(step_times(model, ...)), for prefill, mixed and decode first steps."""
    model = models()[name]
    cached = CachedLatency(model)
    rng = np.random.default_rng(5)
    for _ in range(800):
        if rng.random() < 0.5:
            first = random_decode(rng)
        else:  # a prompt chunk (fresh or over a prefix) beside a few decode rows
            p, pre = int(rng.integers(1, 2048)), int(rng.integers(0, 3000))
            d = rng.integers(1, 4000, int(rng.integers(0, 40)))
            kv = pre + p + int(d.sum()) + len(d)
            pairs = float(p * pre + p * (p + 1) / 2 + (d + 1).sum())
            first = Work(32, p + len(d), 1 + len(d), pairs, kv, 1 + len(d), True,
                         max(pre + p, int(d.max()) + 1 if len(d) else 0))
        n = int(rng.integers(1, N + 1))
        co, cs = random_co(rng, n)
        for steps in (int(rng.integers(1, 90)), int(rng.integers(1, 8))):
            ref = np.cumsum(step_times(model, first, steps, n, co, cs))
            assert np.array_equal(cached.step_ends(first, steps, n, co, cs), ref), (first, steps, n, co, cs)
            assert np.array_equal(cached.decode_steps(first, steps, n, co, cs) if first.tokens == first.seqs
                                  else step_times(cached, first, steps, n, co, cs), step_times(model, first, steps,
                                                                                               n, co, cs))


def test_fitted_memoised_predict_equals_a_fresh_model():
    """predict's memos (host time, co-runner slowdown) change no number, nor its type."""
    warm, rng = models()["fitted"], np.random.default_rng(3)
    cases = []
    for _ in range(400):
        p = int(rng.integers(1, 4096))
        w = Work(32, p, 1, p * (p + 1) / 2, p, 1, True, p) if rng.random() < 0.6 else random_decode(rng)
        n = int(rng.integers(1, N + 1))
        cases.append((w, n, *random_co(rng, n)))
    first = [warm.predict(*c) for c in cases]
    again = [warm.predict(*c) for c in cases]
    fresh = [latency_model("fitted", SPEC, GPU).predict(*c) for c in cases[:40]]
    assert [repr(x) for x in first] == [repr(x) for x in again]
    assert [repr(x) for x in first[:40]] == [repr(x) for x in fresh]


def test_executor_interp_is_numpys_to_the_bit():
    """The simulator's plain-float interp (a re-timed short stretch's step ends) gives np.interp's numbers,
    knots repeated (a re-time at the same instant) and at the ends included."""
    from simulator.executor import interp

    rng = np.random.default_rng(11)
    for _ in range(20000):
        k = int(rng.integers(0, 6))
        ps = np.sort(rng.random(k))
        if k and rng.random() < 0.2:
            ps[int(rng.integers(0, k))] = ps[0]
        if k and rng.random() < 0.1:
            ps[-1] = 1.0
        ps = [0.0, *np.sort(ps).tolist(), 1.0]
        start = float(rng.uniform(0, 4000))
        ts = [start, *np.sort(start + rng.random(k)).tolist(), start + float(rng.uniform(0.5, 1.5))]
        cum = np.cumsum(rng.uniform(0.004, 0.03, int(rng.integers(1, 70))))
        xs = cum / cum[-1]
        assert interp(xs.tolist(), ps, ts) == np.interp(xs, ps, ts).tolist(), (ps, ts)


def test_fitted_co_scalar_is_the_features_dict_summed():
    """The contention slowdown without its dict of features (FittedModel._co_scalar) is Linear.scalar over
    co_features, to the bit and in type (a numpy int co_sms gives numpy floats), for both co families."""
    fm, rng = latency_model("fitted", SPEC, GPU), np.random.default_rng(17)
    for _ in range(3000):
        n = int(rng.integers(1, N))
        co, cs = random_co(rng, n)
        if co is None:
            continue
        own = float(rng.uniform(0, 5)) if rng.random() < 0.7 else 0.0
        for family in ("co_eager", "co_decode"):
            want = fm.f[family].scalar(fm.co_features(n, co, cs, False, own), 0)
            assert repr(fm._co_scalar(family, n, co, cs, own)) == repr(want), (family, n, co, cs, own)


def test_fitted_stretch_setup_shared_by_co_runners_of_one_sm_split():
    """A decode stretch's setup is memoised by the co-runner's SM split alone where co_decode reads SM counts only
    (the shipped fit): next to many prefill co-runners in turn (disjoint SMs, and overlapping ones of several token
    counts: naive concurrency), every stretch is still decode_steps to the bit."""
    fm = models()["fitted"]
    assert fm._setup_by_sms  # (what this test is about: the shipped fit's co_decode reads SM counts alone)
    rng = np.random.default_rng(29)
    works = [random_decode(rng) for _ in range(4)]
    for _ in range(400):
        w = works[int(rng.integers(0, len(works)))]
        t = int(rng.choice([7, 300, 301, 2048, int(rng.integers(1, 8000))]))
        co = Work(32, t, 1, t * (t + 1) / 2, t, 1, True, t)
        n, cs = (40, 92) if rng.random() < 0.5 else (N, N)  # static split, or both lanes on the whole GPU
        steps = int(rng.integers(1, FLOAT_STRETCH + 1))
        times, ends = fm.decode_step_ends(w, steps, n, co, cs)
        ref = fm.decode_steps(w, steps, n, co, cs)
        assert np.array_equal(np.asarray(times), ref), (w, steps, n, co, cs)
        assert np.array_equal(ends, ref.cumsum())


def test_fitted_co_runner_terms_memoised_by_shape_are_a_fresh_models():
    """The co-runner's GEMM seconds are memoised by the shape they read (layers, tokens, rows, SMs): a prefill
    predicted next to a stream of decode co-runners of a few shapes (each one new: its KV grows), on int and numpy
    SM counts, gets the numbers a model asked nothing before gives, and the co-runner terms are its stand-alone
    demand and GEMM share computed directly."""
    fm = models()["fitted"]
    rng = np.random.default_rng(31)
    prefill = Work(32, 900, 1, 900 * 901 / 2, 900, 1, True, 900)
    for _ in range(300):
        b = int(rng.choice([1, 2, 10, 64]))
        kv = int(rng.integers(b, 40000))
        co = Work(32, b, b, float(kv), kv, b, True, kv // b + 1) if rng.random() < 0.9 else prefill
        cs = int(rng.choice([40, 56, 92]))
        cs = np.int64(cs) if rng.random() < 0.2 else cs
        fresh = models()["fitted"]
        assert fm.predict(prefill, N - int(cs), co, cs) == fresh.predict(prefill, N - int(cs), co, cs), (co, cs)
        alone, s = fresh.gpu_time(co, int(cs)), fresh._gemm_seconds(co, int(cs))
        assert fm._co_of(co, cs) == (fresh.q.bytes_of(co) / alone * 1e-12, s / alone if s else 0.0)
