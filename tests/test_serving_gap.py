"""The engine's host time between launches as serving pays it (``bullet.validate.back_to_back``,
``serving_gap``), and the model file's ``serving_gap`` entry that ``bullet validate --save-scaled`` writes.
Expected values by hand."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from bullet.config import GPUS, MODELS, ConfigError, SchedulerConfig
from bullet.perfmodel import FittedModel, Work
from bullet.traces import load_trace
from bullet.validate import back_to_back, fit_gap, serving_gap
from simulator.run import simulate

SHIPPED = Path(__file__).parents[1] / "profiles/h200/llama-3.1-8b/model.json"


def row(start_ms: float, lane: str, seqs: int, ms: float) -> dict:
    """A launches.csv row as csv.DictReader gives it (strings)."""
    return {"start_s": str(start_ms / 1e3), "kind": f"{lane}/decode", "seqs": str(seqs), "measured_ms": str(ms)}


# chunked: one lane fed by arrivals. Gaps 0.5 ms (4 requests), 0.8 ms (8), then 100 ms: idle until an arrival
CHUNKED = [row(0.0, "all", 4, 10.0), row(10.5, "all", 4, 10.0), row(21.3, "all", 8, 10.0), row(131.3, "all", 1, 5.0)]
# static-split: the prefill lane (fed by arrivals) 0.6 ms then 119.4 ms idle; the decode lane 0.7 ms, then 8 ms
# with no prefill ending inside (its requests were running: the host was busy, a gap), then 41.5 ms across the
# prefill's end at 80.6 ms (waiting for the requests that prefill hands over: not a gap)
SPLIT = [row(0.0, "prefill", 1, 50.0), row(1.0, "decode", 2, 10.0), row(11.7, "decode", 2, 10.0),
         row(29.7, "decode", 2, 10.0), row(50.6, "prefill", 2, 30.0), row(81.2, "decode", 3, 10.0),
         row(200.0, "prefill", 1, 30.0)]


def spans(rows):
    return [(r["kind"].split("/")[0], float(r["start_s"]), float(r["start_s"]) + float(r["measured_ms"]) / 1e3,
             int(r["seqs"])) for r in rows]


def test_back_to_back_counts_the_engines_gaps_not_waits_for_work():
    got = sorted((round(g * 1e3, 6), n) for g, n in back_to_back(spans(CHUNKED)))
    assert got == [(0.5, 4), (0.8, 8)]
    # async scheduling: a launch queued behind the one before starts 10 us after it: no host time between them
    queued = CHUNKED + [row(136.31, "all", 1, 5.0)]
    assert sorted((round(g * 1e3, 6), n) for g, n in back_to_back(spans(queued))) == [(0.5, 4), (0.8, 8)]
    got = sorted((round(g * 1e3, 6), n) for g, n in back_to_back(spans(SPLIT)))
    assert got == [(0.6, 2), (0.7, 2), (8.0, 2)]


def test_serving_gap_fits_a_plus_b_requests_on_the_gaps():
    # two points: the line through them, 0.2 ms + 0.075 ms a request
    g = serving_gap([CHUNKED])
    assert g["fixed_s"] == pytest.approx(2e-4) and g["per_request_s"] == pytest.approx(7.5e-5)
    assert g["gaps"] == 2 and g["mean_s"] == pytest.approx(6.5e-4) and g["median_s"] == pytest.approx(6.5e-4)
    # one batch size: the mean, (0.6 + 0.7 + 8.0) / 3 = 3.1 ms (the slow gap counts: the simulator sums gaps)
    g = serving_gap([SPLIT])
    assert g["fixed_s"] == pytest.approx(3.1e-3) and g["per_request_s"] == 0.0 and g["median_s"] == pytest.approx(7e-4)
    # runs pooled, each run's gaps taken within it (the second run's clock starts again at 0)
    assert serving_gap([CHUNKED, SPLIT])["gaps"] == 5
    with pytest.raises(ValueError, match="no gaps"):
        serving_gap([CHUNKED[:1]])


def test_fit_gap_keeps_both_terms_non_negative():
    # falling with the batch: b = 0 leaves 2 x 0.25^2 against 0.89 through the origin; a = the mean, 0.75 ms
    assert fit_gap([(1e-3, 1), (0.5e-3, 10)]) == pytest.approx((7.5e-4, 0.0))
    # a gap proportional to the batch is fitted through the origin
    assert fit_gap([(1e-4, 1), (1e-3, 10)]) == pytest.approx((0.0, 1e-4))


def shipped() -> dict:
    return json.loads(SHIPPED.read_text())


def test_a_serving_gap_round_trips_through_the_model_file(tmp_path):
    data = shipped()
    profile = (data["host_gap"]["fixed_s"], data["host_gap"]["per_request_s"])
    data["serving_gap"] = {**serving_gap([CHUNKED]), "card": "NVIDIA H200 GPU-x", "runs": ["sharegpt@9"]}
    path = tmp_path / "card.json"
    path.write_text(json.dumps(data))
    m = FittedModel.load(path, MODELS["llama-3.1-8b"], GPUS["h200"])
    assert m.host_gap == pytest.approx((2e-4, 7.5e-5)) and m.serving_gap == m.host_gap
    assert m.profile_gap == profile  # kept, not used
    assert m.scaled(0.97, 0.98).host_gap == m.host_gap  # a rescaled model keeps it
    for bad, why in (({"fixed_s": -1e-4, "per_request_s": 0.0}, "serving_gap: fixed_s"),
                     ({"fixed_s": "0.3", "per_request_s": 0.0}, "serving_gap: fixed_s"),
                     ({"per_request_s": 0.0}, "serving_gap: fixed_s None"), ([1e-4, 0.0], "serving_gap: not an object")):
        path.write_text(json.dumps({**data, "serving_gap": bad}))
        with pytest.raises(ConfigError, match=f"card.json: not a valid fitted latency model: {why}"):
            FittedModel.load(path)


def test_a_model_without_a_serving_gap_simulates_as_before():
    """No ``serving_gap``: the profile's gap, and the same predictions and simulation as a model that has one
    equal to it (so the field changes the gap and nothing else)."""
    spec, gpu = MODELS["llama-3.1-8b"], GPUS["h200"]
    plain = FittedModel(shipped())
    assert plain.serving_gap is None and plain.host_gap == plain.profile_gap
    data = shipped()
    data["serving_gap"] = copy.deepcopy(data["host_gap"])
    same = FittedModel(data)
    w = Work(32, 512, 8, 300_000.0, 4096, 8, True, 1024)
    assert same.predict(w, 132) == plain.predict(w, 132) and same.predict(w, 92, w, 40) == plain.predict(w, 92, w, 40)
    reqs = load_trace("sharegpt", num_requests=40, rate=8.0, seed=0)
    runs = [simulate(reqs, spec, gpu, SchedulerConfig(policy="static-split", prefill_sms=92), latency=m,
                     timeline=False).summary for m in (plain, same)]
    assert runs[0]["config"]["host_gap_s"] == list(plain.profile_gap)
    assert runs[0]["ttft_ms"] == runs[1]["ttft_ms"] and runs[0]["tpot_ms"] == runs[1]["tpot_ms"]
    # and a larger serving gap (host time before every launch) makes requests take longer end to end and the run
    # longer; not necessarily their mean TPOT: longer gaps also regroup the decode stretches (on the version 12
    # model a 1 ms gap gave 11.030 ms against 11.044 at the profile's 0.2 ms, E2E 5,572 against 5,561 ms)
    data["serving_gap"] = {"fixed_s": 1e-3, "per_request_s": 5e-6}
    slower = simulate(reqs, spec, gpu, SchedulerConfig(policy="static-split", prefill_sms=92),
                      latency=FittedModel(data), timeline=False).summary
    assert slower["config"]["host_gap_s"] == [1e-3, 5e-6]
    assert slower["e2e_ms"]["mean"] > runs[0]["e2e_ms"]["mean"] and slower["duration_s"] > runs[0]["duration_s"]
