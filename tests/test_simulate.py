"""``simulate()`` leaves the requests it is given untouched, so one list can be simulated again and again (a
sweep reuses its inputs): the issue's case was a request with max 5 tokens reporting 6 on the second run."""

from dataclasses import fields

import numpy as np
import pytest

from bullet.config import GPUS, MODELS, SchedulerConfig
from bullet.request import Request
from simulator import simulate

MODEL, GPU = MODELS["llama-3.1-8b"], GPUS["h200"]


def snapshot(reqs: list[Request]) -> list[tuple]:
    return [tuple(repr(getattr(r, f.name)) for f in fields(Request)) for r in reqs]


def requests() -> list[Request]:
    rng = np.random.default_rng(3)
    t = np.cumsum(rng.exponential(0.05, 40))
    out = [Request(i, float(t[i]), int(rng.integers(16, 900)), int(rng.integers(1, 40))) for i in range(40)]
    out.append(Request(40, float(t[-1]), 600, 5, hash_ids=(7, 8), hash_block=512))  # a prefix-hashed one
    out.append(Request(41, float(t[-1]), 700, 5, hash_ids=(7, 9), hash_block=512))
    return out


@pytest.mark.parametrize("policy", ["chunked", "static-split", "bullet"])
def test_inputs_untouched_and_reruns_identical(policy):
    reqs = requests()
    before = snapshot(reqs)
    cfg = SchedulerConfig(policy=policy)
    first = simulate(reqs, MODEL, GPU, cfg, token_times=True)
    assert snapshot(reqs) == before  # not one field of one input changed
    second = simulate(reqs, MODEL, GPU, cfg, token_times=True)
    assert snapshot(reqs) == before
    for k in ("ttft", "tpot", "e2e", "output_tokens"):
        np.testing.assert_array_equal(first.columns[k], second.columns[k])
    assert first.summary["duration_s"] == second.summary["duration_s"]
    # every request generates exactly its max_new_tokens, on both runs
    want = {r.id: r.max_new_tokens for r in reqs}
    for res in (first, second):
        assert {r.id: r.num_output for r in res.requests} == want
        assert all(len(r.token_times) == r.max_new_tokens for r in res.requests)
        assert not any(any(r is q for q in reqs) for r in res.requests)  # the results are copies


def test_progress_recorded_on_the_inputs_is_ignored():
    """Requests that already carry progress (say, from a real run) are simulated from their trace fields."""
    clean = requests()
    used = requests()
    for r in used:
        r.num_computed, r.num_output, r.token_times = r.prompt_len, 3, [0.1, 0.2, 0.3]
        r.first_token_time = 0.1
    cfg = SchedulerConfig(policy="chunked")
    a, b = simulate(clean, MODEL, GPU, cfg), simulate(used, MODEL, GPU, cfg)
    np.testing.assert_array_equal(a.columns["e2e"], b.columns["e2e"])
    assert used[0].num_output == 3  # and still untouched


def test_max_concurrency_one_serves_one_request_at_a_time():
    """``--max-concurrency 1`` (vllm bench serve's client limit): n identical requests all arriving at 0 are
    sent one after another, each when the previous finishes, and timed from when it is sent: every request's
    E2E is the service time S of one request alone (hand-computed from LinearLatency), request k finishes at
    (k + 1) S, and the run lasts n S."""
    from tests.latency import LinearLatency

    lat = LinearLatency(MODEL.num_layers)
    prompt, out, n = 300, 6, 8
    service = (lat.base + lat.per_token * prompt + lat.per_kv * prompt
               + sum(lat.base + lat.per_token + lat.per_kv * (prompt + i + 1) for i in range(out - 1)))
    reqs = [Request(i, 0.0, prompt, out) for i in range(n)]
    res = simulate(reqs, MODEL, GPU, SchedulerConfig(policy="chunked"), latency=lat, max_concurrency=1)
    np.testing.assert_allclose(res.columns["e2e"], service, rtol=1e-9)
    np.testing.assert_allclose(np.sort(res.columns["finish"]), service * np.arange(1, n + 1), rtol=1e-9)
    assert res.summary["duration_s"] == pytest.approx(n * service, rel=1e-9)
    assert max(row[10] for row in res.timeline.rows) == 1  # never more than one request running
    assert all(r.arrival == 0.0 for r in reqs)  # the inputs keep their arrivals
    # without the limit the same requests share launches and the run is much shorter
    free = simulate(reqs, MODEL, GPU, SchedulerConfig(policy="chunked"), latency=lat)
    assert free.summary["duration_s"] < n * service / 3


@pytest.mark.parametrize("limit", [2, 5])
def test_max_concurrency_bounds_requests_in_the_server(limit):
    reqs = requests()
    res = simulate(reqs, MODEL, GPU, SchedulerConfig(policy="static-split"), max_concurrency=limit)
    assert len(res.requests) == len(reqs)
    assert max(row[9] + row[10] for row in res.timeline.rows) <= limit  # waiting + running
    assert {r.id: r.num_output for r in res.requests} == {r.id: r.max_new_tokens for r in reqs}


@pytest.mark.parametrize("policy", ["chunked", "prefill-first", "static-split", "naive-concurrent", "bullet"])
def test_without_token_times_the_metrics_are_the_same(policy):
    """Without per-token times (the default) a request keeps its first and last token times and the run its
    pooled gaps: every column and the summary as with the per-token lists (the ITL mean to rounding)."""
    reqs = requests()
    cfg = SchedulerConfig(policy=policy)
    full = simulate(reqs, MODEL, GPU, cfg, token_times=True)
    light = simulate(reqs, MODEL, GPU, cfg)
    assert all(r.token_times == [] for r in light.requests)
    assert all(r.last_token_time == r.finish_time == r.token_times[-1] for r in full.requests)
    for k, v in full.columns.items():
        np.testing.assert_array_equal(light.columns[k], v)
    a, b = dict(full.summary), dict(light.summary)
    itl_a, itl_b = a.pop("itl_ms"), b.pop("itl_ms")
    for d in (a, b):
        d.pop("sim_wall_s")
    assert a == b
    assert itl_b["mean"] == pytest.approx(itl_a["mean"], rel=1e-12)
    assert {k: v for k, v in itl_a.items() if k != "mean"} == {k: v for k, v in itl_b.items() if k != "mean"}


def test_without_timeline_rows_the_summary_is_the_same():
    reqs, cfg = requests(), SchedulerConfig(policy="static-split")
    full, light = simulate(reqs, MODEL, GPU, cfg), simulate(reqs, MODEL, GPU, cfg, timeline=False)
    assert light.timeline.rows == [] and full.timeline.launches == len(full.timeline.rows)
    a, b = dict(full.summary), dict(light.summary)
    a.pop("sim_wall_s"), b.pop("sim_wall_s")
    assert a == b
