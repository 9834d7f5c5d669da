"""Metrics against hand-computed examples (vllm bench serve definitions)."""

import numpy as np
import pytest

from bullet.config import SloConfig
from bullet.metrics import inter_token_latencies, request_columns, summarize
from bullet.request import Request


def finished(rid, arrival, prompt, times):
    r = Request(rid, arrival, prompt, len(times))
    r.token_times = list(times)
    r.num_output = len(times)
    r.first_token_time, r.finish_time = times[0], times[-1]
    return r


def test_hand_computed():
    a = finished(0, 0.0, 100, [0.5, 0.6, 0.8, 1.1])  # TTFT 0.5, E2E 1.1, TPOT 0.2, ITL .1 .2 .3
    b = finished(1, 1.0, 1000, [2.0])  # one token: TTFT 1.0, no TPOT, no ITL
    c = finished(2, 2.0, 10, [2.1, 2.2])  # TTFT 0.1, TPOT 0.1
    slo = SloConfig(ttft=0.6, tpot=0.15)
    cols = request_columns([c, a, b], slo)
    assert list(cols["id"]) == [0, 1, 2]
    np.testing.assert_allclose(cols["ttft"], [0.5, 1.0, 0.1])
    np.testing.assert_allclose(cols["e2e"], [1.1, 1.0, 0.2])
    np.testing.assert_allclose(cols["tpot"], [0.2, np.nan, 0.1])
    assert list(cols["attained"]) == [False, False, True]  # a: TPOT .2 > .15; b: TTFT 1.0 > .6
    np.testing.assert_allclose(np.sort(inter_token_latencies([a, b, c])), [0.1, 0.1, 0.2, 0.3])

    s = summarize([a, b, c], slo, {"all": 1.1})
    assert s["duration_s"] == pytest.approx(2.2)  # first arrival 0.0 to last token 2.2
    assert s["request_throughput"] == pytest.approx(3 / 2.2)
    assert s["output_throughput"] == pytest.approx(7 / 2.2)
    assert s["total_token_throughput"] == pytest.approx(1117 / 2.2)
    assert s["slo_attainment"] == pytest.approx(1 / 3)
    assert s["goodput"] == pytest.approx(1 / 2.2)
    assert s["ttft_ms"]["mean"] == pytest.approx(1600 / 3)
    assert s["ttft_ms"]["p50"] == pytest.approx(500)
    assert s["tpot_ms"]["mean"] == pytest.approx(150)  # mean of 200 and 100; b excluded
    assert s["itl_ms"]["mean"] == pytest.approx(175)
    assert s["e2e_ms"]["p99"] == pytest.approx(np.percentile([1100, 1000, 200], 99))
    assert s["lane_busy_frac"]["all"] == pytest.approx(0.5)


def test_per_token_ttft_slo():
    a = finished(0, 0.0, 100, [0.25, 0.3])  # 2.5 ms per prompt token
    b = finished(1, 0.0, 1000, [1.0, 1.1])  # 1.0 ms per prompt token
    cols = request_columns([a, b], SloConfig(ttft=None, tpot=1.0, ttft_per_token=0.0015))
    assert list(cols["attained"]) == [False, True]
    np.testing.assert_allclose(cols["ttft_target"], [0.15, 1.5])


def test_no_slo_means_everyone_attains():
    a = finished(0, 0.0, 100, [5.0, 9.0])
    cols = request_columns([a], SloConfig(ttft=None, tpot=None))
    assert cols["attained"].all()
