"""The roofline latency model: invariants (monotone, vectorised == scalar, contention only slows), its
accuracy against the H200 calibration figures (docs/background.md; table in docs/perfmodel.md), and every GPU
preset against its datasheet bounds."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from bullet.config import GPUS, MODELS, ConfigError, GpuSpec
from bullet.perfmodel import GPU_CONSTANTS, LatencyModel, RooflineModel, Work

H200 = GPUS["h200"]
N = H200.num_sms
LLAMA8B = MODELS["llama-3.1-8b"]


@pytest.fixture(scope="module")
def model() -> RooflineModel:
    return RooflineModel(LLAMA8B, H200)


def prefill(p: int, layers: int = 32, sample: bool = False) -> Work:
    return Work(layers, p, 1, p * (p + 1) / 2, p, int(sample), sample)


def decode(batch: int, ctx: int, layers: int = 32) -> Work:
    return Work(layers, batch, batch, float(batch * ctx), batch * ctx, batch, True)


DECODE_CAL = Work(32, 128, 128, 128 * 1024.0, 128 * 1024, 0, False)  # the measured decode step
WORKS = [prefill(p) for p in (1, 17, 64, 65, 512, 4096, 8192)] + [
    decode(b, c) for b in (1, 7, 64, 128, 256) for c in (16, 1024, 8192)]


def test_implements_the_protocol(model):
    assert isinstance(model, RooflineModel)
    proto: LatencyModel = model  # static check of the signature; runtime: the methods exist
    assert callable(proto.predict) and callable(proto.decode_steps)


# ---------------------------------------------------------------- accuracy against the H200 figures
def test_prefill_4096_within_5_percent(model):
    assert model.predict(prefill(4096), N) == pytest.approx(89.6e-3, rel=0.05)


def test_decode_128x1024_within_5_percent(model):
    assert model.predict(DECODE_CAL, N) == pytest.approx(10.3e-3, rel=0.05)


def test_square_gemm_rate_and_sm_scaling(model):
    full = model.gemm_time(8192, 8192, 8192, N)
    assert 2 * 8192**3 / full == pytest.approx(791e12, rel=0.03)
    measured = {16: 0.14, 32: 0.28, 64: 0.54, 72: 0.61, 96: 0.80, 128: 0.91}
    for n, ratio in measured.items():  # 128 SMs: +10 % (cuBLAS picks another kernel on the full GPU)
        assert full / model.gemm_time(8192, 8192, 8192, n) == pytest.approx(ratio, rel=0.11), n


def test_skinny_gemm_sm_scaling(model):
    full = model.gemm_time(64, 57344, 8192, N)
    for n, ratio in {16: 0.24, 32: 0.44, 64: 0.70}.items():
        assert full / model.gemm_time(64, 57344, 8192, n) == pytest.approx(ratio, rel=0.05), n
    # 96 (0.72) and 128 (1.08) are cuBLAS kernel switches the smooth model cannot follow: documented
    # errors +23 % and -8 %; the model stays monotone instead.
    assert full / model.gemm_time(64, 57344, 8192, 128) == pytest.approx(1.08, rel=0.10)


def _corun(model, p: int, n_p: int):
    wp, n_d = prefill(p), N - n_p
    tp = model.predict(wp, n_p, DECODE_CAL, n_d)
    td = model.predict(DECODE_CAL, n_d, wp, n_p)
    seq = model.predict(wp, N) + tp / td * model.predict(DECODE_CAL, N)
    return seq / tp, tp / model.predict(wp, n_p) - 1, td / model.predict(DECODE_CAL, n_d) - 1


def test_corun_figures(model):
    speedup, _, _ = _corun(model, 8192, 88)
    assert speedup == pytest.approx(1.20, rel=0.06)  # measured 1.20x at 80-96 prefill SMs
    grid = [_corun(model, p, n) for p in (1024, 2048, 4096, 8192) for n in (64, 72, 80, 88, 96)]
    assert max(g[1] for g in grid) == pytest.approx(0.33, abs=0.03)  # prefill slowed by up to ~33 %
    for _, _, dec in grid:  # decode steps slowed by ~10-20 %
        assert 0.07 <= dec <= 0.22
    assert all(0.94 <= g[0] <= 1.25 for g in grid)  # measured range 0.94x-1.20x


# ---------------------------------------------------------------- invariants
@pytest.mark.parametrize("n", [1, 8, 36, 64, 96, 132])
def test_more_tokens_never_faster(model, n):
    t = [model.predict(prefill(p), n) for p in range(1, 9000, 11)]
    assert np.all(np.diff(t) >= 0)
    t = [model.predict(decode(b, 1024), n) for b in range(1, 400)]
    assert np.all(np.diff(t) >= 0)
    t = [model.predict(decode(64, c), n) for c in range(1, 20000, 97)]
    assert np.all(np.diff(t) >= 0)


@pytest.mark.parametrize("work", WORKS, ids=lambda w: f"t{w.tokens}kv{w.kv_read}")
def test_more_sms_never_slower(model, work):
    t = model.predict(work, np.arange(1, N + 1))
    assert np.all(np.diff(t) <= 0)


def test_array_of_sms_equals_scalar_calls(model):
    menu = np.array(H200.prefill_sizes[:-1])
    for w in WORKS:
        arr = model.predict(w, menu)
        assert isinstance(arr, np.ndarray) and arr.shape == menu.shape
        np.testing.assert_allclose(arr, [model.predict(w, int(n)) for n in menu], rtol=1e-12)
        co = [model.predict(w, int(n), DECODE_CAL, N - int(n)) for n in menu]
        np.testing.assert_allclose(model.predict(w, menu, DECODE_CAL, N - menu), co, rtol=1e-12)


@pytest.mark.parametrize("co", [None, prefill(4096), decode(32, 512)])
def test_decode_steps_equal_step_by_step_predict(model, co):
    for work in (decode(1, 5), decode(128, 1024), decode(200, 3000), DECODE_CAL):
        steps = model.decode_steps(work, 25, 40, co, 92 if co else 0)
        assert steps.shape == (25,)
        one_by_one = [model.predict(work._replace(attn_pairs=work.attn_pairs + i * work.seqs,
                                                  kv_read=work.kv_read + i * work.seqs), 40, co,
                                    92 if co else 0) for i in range(25)]
        np.testing.assert_allclose(steps, one_by_one, rtol=1e-12)
        assert np.all(np.diff(steps) >= 0)


@pytest.mark.parametrize("co", [None, prefill(4096), decode(32, 512)])
def test_decode_step_ends_are_decode_steps_and_their_running_sum(model, co):
    """The plain-float path for short stretches gives numpy's numbers to the bit (the simulator's results
    must not depend on which path timed a launch)."""
    for work in (decode(1, 5), decode(256, 16), decode(128, 1024), decode(200, 3000), DECODE_CAL):
        for steps in (0, 1, 2, 7, 24, 25, 60):
            times, ends = model.decode_step_ends(work, steps, 40, co, 92 if co else 0)
            ref = model.decode_steps(work, steps, 40, co, 92 if co else 0)
            assert np.array_equal(np.asarray(times, float), ref)
            assert np.array_equal(ends, np.cumsum(ref))


def test_decode_steps_edge_cases(model):
    assert model.decode_steps(DECODE_CAL, 0, 36).shape == (0,)
    one = model.decode_steps(DECODE_CAL, 1, np.int64(36))
    assert one.shape == (1,) and one[0] == pytest.approx(model.predict(DECODE_CAL, 36), rel=1e-12)
    with pytest.raises(ValueError, match="one SM count"):
        model.decode_steps(DECODE_CAL, 3, np.array([8, 16]))


def test_contention_slows_both_lanes_and_speeds_none(model):
    for p in (256, 2048, 8192):
        wp = prefill(p)
        for wd in (decode(8, 256), DECODE_CAL, decode(256, 4096)):
            for n_p in H200.prefill_sizes[:-1]:
                n_d = N - n_p
                alone_p, alone_d = model.predict(wp, n_p), model.predict(wd, n_d)
                assert model.predict(wp, n_p, wd, n_d) >= alone_p
                assert model.predict(wd, n_d, wp, n_p) >= alone_d
    # a heavy co-runner does slow the other lane measurably
    assert model.predict(DECODE_CAL, 36, prefill(8192), 96) > 1.05 * model.predict(DECODE_CAL, 36)
    assert model.predict(prefill(8192), 80, DECODE_CAL, 52) > 1.15 * model.predict(prefill(8192), 80)
    # no co-runner SMs, or no co-runner: alone
    assert model.predict(DECODE_CAL, 36, prefill(8192), 0) == model.predict(DECODE_CAL, 36)


def test_wave_quantization_one_tile_over_a_wave_costs_a_second_wave(model):
    # 64 SMs, one 128x256 tile per SM: 64 tiles are one wave, 65 tiles are two (compute-bound, K=8192)
    one_wave = model.gemm_time(4 * 128, 16 * 256, 8192, 64)  # 4 x 16 = 64 tiles
    two_waves = model.gemm_time(5 * 128, 13 * 256, 8192, 64)  # 5 x 13 = 65 tiles
    assert 1.8 < two_waves / one_wave < 2.05
    # ... whereas on 72 SMs both fit in one wave
    assert model.gemm_time(5 * 128, 13 * 256, 8192, 72) == pytest.approx(one_wave, rel=0.05)


def test_tp8_70b(model):
    m70 = RooflineModel(MODELS["llama-3.1-70b"], H200)
    assert m70.model.tp == 8
    w = decode(128, 1024, layers=80)
    t = m70.predict(w, N)
    assert 1e-3 < t < 50e-3
    assert m70.breakdown(w, N)["allreduce"] > 0
    no_ar = RooflineModel(MODELS["llama-3.1-70b"], H200, allreduce_bandwidth=1e30, allreduce_latency=1e-30)
    assert no_ar.predict(w, N) < t
    p = prefill(4096, layers=80)
    menu = np.array(H200.prefill_sizes[:-1])
    np.testing.assert_allclose(m70.predict(p, menu), [m70.predict(p, int(n)) for n in menu], rtol=1e-12)
    steps = m70.decode_steps(w, 10, 64, p, 68)
    assert steps.shape == (10,) and np.all(np.isfinite(steps)) and np.all(np.diff(steps) >= 0)


def test_other_gpus_use_their_own_peaks():
    w = prefill(4096)
    h200 = RooflineModel(LLAMA8B, H200).predict(w, N)
    a100 = RooflineModel(LLAMA8B, GPUS["a100"]).predict(w, GPUS["a100"].num_sms)
    assert a100 > 2.5 * h200  # compute-bound: 312 vs 989 TFLOP/s
    h100 = RooflineModel(LLAMA8B, GPUS["h100"]).predict(DECODE_CAL, N)
    assert h100 > RooflineModel(LLAMA8B, H200).predict(DECODE_CAL, N)  # 3.35 vs 4.8 TB/s


# ---------------------------------------------------------------- every GPU preset against its datasheet
def linear_flops(spec, w: Work) -> float:
    """FLOPs of a launch counted from the model's shapes (an independent count: the model pads GEMM tiles)."""
    h, q, kv, f = spec.hidden_size, spec.q_size, spec.kv_size, spec.ffn_per_gpu
    per_token = 2 * (h * (q + 2 * kv) + q * h + 2 * h * f + f * h)
    attention = 4 * spec.head_dim * spec.heads_per_gpu * w.attn_pairs
    return w.num_layers * (per_token * w.tokens + attention) + 2 * w.samples * h * spec.vocab_size


def least_bytes(spec, w: Work) -> float:
    """HBM bytes a launch cannot avoid: every layer's weight matrices once, the KV it reads, the LM head."""
    h, q, kv, f, dt = spec.hidden_size, spec.q_size, spec.kv_size, spec.ffn_per_gpu, spec.dtype_bytes
    weights = (h * (q + 2 * kv) + q * h + 3 * h * f) * dt
    lm_head = spec.vocab_size * h * dt if w.samples else 0
    return w.num_layers * (weights + w.kv_read * 2 * kv * dt) + lm_head


def preset_works(layers: int) -> list[Work]:
    return ([prefill(p, layers, sample=True) for p in (1, 64, 512, 4096, 8192, 16384)]
            + [decode(b, c, layers) for b in (1, 16, 128, 512) for c in (128, 2048, 32768)]
            + [Work(layers, 2048 + 64, 65, 2048 * 2049 / 2 + 64 * 4096.0, 2048 + 64 * 4096, 65, True)])  # mixed


@pytest.mark.parametrize("gpu", sorted(GPUS))
@pytest.mark.parametrize("model_name", ["llama-3.1-8b", "llama-3.1-70b", "qwen2.5-7b", "qwen3-8b"])
def test_no_prediction_beats_the_datasheet(gpu, model_name):
    """On every preset, every partition size, alone and next to a co-runner: no launch faster than its FLOPs
    at the datasheet's dense bf16 rate for its share of the SMs, nor than its unavoidable bytes at the
    datasheet's HBM bandwidth."""
    g, spec = GPUS[gpu], MODELS[model_name]
    m = RooflineModel(spec, g)
    sizes = np.array(sorted({1, *g.prefill_sizes, *g.decode_sizes}))
    co = decode(64, 1024, spec.num_layers)
    for w in preset_works(spec.num_layers):
        t = m.predict(w, sizes)
        assert np.all(t >= linear_flops(spec, w) / (g.peak_flops * sizes / g.num_sms)), w
        assert np.all(t >= least_bytes(spec, w) / g.hbm_bandwidth), w
        split = sizes[sizes < g.num_sms]
        t_co = m.predict(w, split, co, g.num_sms - split)
        assert np.all(t_co >= t[: split.size] * (1 - 1e-12))


@pytest.mark.parametrize("gpu", sorted(GPUS))
def test_single_gemms_stay_under_the_datasheet_peak(gpu):
    """The issue's case: an 8192^3 GEMM was predicted at 982 TFLOP/s on an H100 and 317 on an A100 (peak 312).
    Every GEMM shape on every SM count: at most the datasheet rate of those SMs, and no faster than its weights
    can be read at the datasheet bandwidth."""
    g = GPUS[gpu]
    m = RooflineModel(LLAMA8B, g)
    sizes = np.arange(1, g.num_sms + 1)
    for mm, nn, kk in [(8192, 8192, 8192), (4096, 4096, 4096), (64, 57344, 8192), (1, 4096, 4096),
                       (16384, 28672, 4096), (128, 128256, 4096)]:
        t = m.gemm_time(mm, nn, kk, sizes)
        assert np.all(2.0 * mm * nn * kk / t <= g.peak_flops * sizes / g.num_sms), (mm, nn, kk)
        assert np.all(t >= nn * kk * LLAMA8B.dtype_bytes / g.hbm_bandwidth), (mm, nn, kk)
    full = 2 * 8192**3 / m.gemm_time(8192, 8192, 8192, g.num_sms)
    assert 0.6 * g.peak_flops < full <= 0.85 * g.peak_flops  # the H200's fitted 0.80 of peak, on every GPU


def test_h100_and_h200_share_compute_and_differ_in_bandwidth():
    """The same GH100 compute with HBM3 (3.35 TB/s) instead of HBM3e (4.8): every launch on every SM count
    takes at least the H200's time and at most the H200's time times the bandwidth ratio; a long prefill
    (compute-bound) within a few per cent, a decode step (memory-bound) clearly slower. The issue's case was
    an 8192-token prefill at 161 ms on the H100 against 195 ms on the H200."""
    h100, h200 = RooflineModel(LLAMA8B, GPUS["h100"]), RooflineModel(LLAMA8B, H200)
    ratio = H200.hbm_bandwidth / GPUS["h100"].hbm_bandwidth
    sizes = np.arange(1, N + 1)
    for w in preset_works(32):
        a, b = h200.predict(w, sizes), h100.predict(w, sizes)
        assert np.all(b >= a * (1 - 1e-12)) and np.all(b <= ratio * a), w
    long_prefill = prefill(8192, sample=True)
    assert h100.predict(long_prefill, N) == pytest.approx(h200.predict(long_prefill, N), rel=0.05)
    assert h100.predict(long_prefill, N) >= h200.predict(long_prefill, N)
    assert h100.predict(decode(128, 1024), N) > 1.2 * h200.predict(decode(128, 1024), N)


def test_every_preset_has_its_own_constants_within_bounds():
    assert set(GPU_CONSTANTS) == set(GPUS)
    for name, c in GPU_CONSTANTS.items():
        assert c.gemm_efficiency * (1 + c.partition_boost) <= 1 and c.hbm_efficiency <= 1, name
    with pytest.raises(ValueError, match="gemm_efficiency"):
        RooflineModel(LLAMA8B, H200, gemm_efficiency=1.0)  # 1.0 * (1 + boost) > 1
    with pytest.raises(ValueError, match="hbm_efficiency"):
        RooflineModel(LLAMA8B, H200, hbm_efficiency=1.1)
    with pytest.raises(ConfigError, match="matmul_flops_measured"):
        GpuSpec("x", 132, 8, 12, 989e12, 4.8e12, 10**9, 10**6, matmul_flops_measured=1000e12)


def test_bad_input_is_named():
    m = RooflineModel(LLAMA8B, H200)
    with pytest.raises(ValueError, match="num_sms"):
        m.predict(DECODE_CAL, 0)
    with pytest.raises(ValueError, match="num_sms"):
        m.predict(DECODE_CAL, np.array([8, N + 1]))
    with pytest.raises(ValueError, match="co_sms"):
        m.predict(DECODE_CAL, 100, DECODE_CAL, N + 1)
    with pytest.raises(ValueError, match="co_sms"):
        m.predict(DECODE_CAL, np.array([8, 100]), DECODE_CAL, np.array([8, 40]))
    with pytest.raises(TypeError, match="bogus"):
        RooflineModel(LLAMA8B, H200, bogus=1.0)
    with pytest.raises(ValueError, match="kernel_overhead"):
        RooflineModel(LLAMA8B, H200, kernel_overhead=-1.0)


def test_overlapping_lanes_share_sms(model):
    """Naive concurrency (both lanes on all SMs): the big prefill keeps most SMs, the decode step starves,
    as measured on the H200 (bench/gpu_concurrency.py naive row: prefill 1.04x slower, decode 5.9x)."""
    prefill = Work(32, 8192, 1, 8192 * 8193 / 2, 8192, 1, True)
    decode = Work(32, 64, 64, 64 * 4097.0, 64 * 4097, 64, True)
    p_slow = model.predict(prefill, N, decode, N) / model.predict(prefill, N)
    d_slow = model.predict(decode, N, prefill, N) / model.predict(decode, N)
    assert 1.0 < p_slow < 1.2
    assert 4.0 < d_slow < 8.0
    # each lane is modelled on its share of the SMs: never faster than alone on them
    assert model.predict(decode, N, prefill, N) > model.predict(decode, 16)


def test_sampling_and_embedding_add_time(model):
    bare = Work(32, 64, 64, 64 * 512.0, 64 * 512, 0, False)
    full = bare._replace(samples=64, embed=True)
    assert model.predict(full, N) > model.predict(bare, N)
    assert model.predict(bare._replace(num_layers=4), N) < model.predict(bare, N)


def test_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from bullet.perfmodel import RooflineModel\n"
            "from bullet.config import MODELS, GPUS\n"
            "from bullet.perfmodel.base import Work\n"
            "print(RooflineModel(MODELS['llama-3.1-8b'], GPUS['h200']).predict(Work(1, 1, 1, 1.0, 1, 0, False), 8))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert float(out.stdout) > 0
