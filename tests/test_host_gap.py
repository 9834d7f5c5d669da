"""The engine's host time between launches in the simulator (``SimExecutor(host_gap=...)``, ``simulate``'s
``host_gap``, ``bullet simulate --host-gap``) and its fit from a profile's gaps.csv. Expected values by hand
from tests/latency.py's linear model."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from bullet.batch import Batch, Chunk, Partition
from bullet.cli import app
from bullet.config import GPUS, MODELS, SchedulerConfig
from bullet.request import Request
from simulator import SimExecutor
from simulator.run import simulate
from tests.latency import LinearLatency

H200 = GPUS["h200"]
L = 32


def prefill(lane: str, sms: int, rid: int, tokens: int) -> Batch:
    return Batch(Partition(lane, sms), range(L), (Chunk(rid, 0, tokens, [0], True),))


def test_a_launch_starts_after_its_host_gap():
    # 100 tokens on the whole GPU: 2 ms + 100 x 10 us = 3 ms of work; gap 1 ms + 0.1 ms x 1 request
    ex = SimExecutor(LinearLatency(L, per_kv=0.0), L, H200, host_gap=(1e-3, 1e-4))
    ex.launch(prefill("all", 132, 1, 100))
    (res,) = ex.wait(None)
    assert res.start == pytest.approx(1.1e-3) and res.end == pytest.approx(1.1e-3 + 3e-3)


def test_a_co_runner_launched_during_the_gap_slows_the_launch_from_its_start():
    lat = LinearLatency(L, per_kv=0.0, contention=1.5)
    ex = SimExecutor(lat, L, H200, host_gap=(1e-3, 1e-4))
    ex.launch(prefill("prefill", 100, 1, 100))  # starts at 1.1 ms; 3 ms x 132/100 alone
    assert ex.wait(0.5e-3) == []
    ex.launch(Batch(Partition("decode", 32), range(L), (Chunk(2, 50, 1, [0], True),)))  # starts at 1.6 ms
    first, second = ex.wait(None), ex.wait(None)
    pre_co = 3e-3 * 132 / 100 * 1.5  # the prefill co-runs from its start: no work was done in its gap
    assert first[0].start == pytest.approx(1.1e-3) and first[0].end == pytest.approx(1.1e-3 + pre_co)
    dec_alone = (2e-3 + 1e-5) * 132 / 32
    t = 1.1e-3 + pre_co
    done = (t - 1.6e-3) / (dec_alone * 1.5)  # the decode's progress when the prefill ends
    assert second[0].start == pytest.approx(1.6e-3)
    assert second[0].end == pytest.approx(t + (1 - done) * dec_alone)


class GappedLatency(LinearLatency):
    host_gap = (2e-3, 1e-4)  # as a fitted model with a host_gap entry carries it


def test_simulate_takes_the_models_gap_unless_told_otherwise():
    spec = MODELS["llama-3.1-8b"]
    reqs = [Request(0, 0.0, 100, 1)]  # alone: its TTFT is the gap plus one 32-layer prefill of 100 tokens
    lat = GappedLatency(spec.num_layers, per_kv=0.0)
    runs = {g: simulate(reqs, spec, H200, SchedulerConfig(), latency=lat, host_gap=g) for g in (None, (0.0, 0.0))}
    assert runs[None].summary["config"]["host_gap_s"] == [2e-3, 1e-4]
    assert runs[(0.0, 0.0)].summary["ttft_ms"]["mean"] == pytest.approx(3.0)
    assert runs[None].summary["ttft_ms"]["mean"] == pytest.approx(3.0 + 2.1)


def test_fit_recovers_a_known_gap_and_leaves_each_size_out():
    pytest.importorskip("sklearn")
    from bullet.perfmodel.fit import fit_host_gap

    rows = [{"seqs": n, "gap_s": 4e-4 + 5e-6 * n} for n in (1, 8, 32, 64, 128, 256)]
    g = fit_host_gap(rows)
    assert g["fixed_s"] == pytest.approx(4e-4, rel=1e-6) and g["per_request_s"] == pytest.approx(5e-6, rel=1e-6)
    assert all(abs(e) < 1e-3 for e in g["loo_error_pct"])
    # a gap that falls with the batch: no negative per-request term
    assert fit_host_gap([{"seqs": 1, "gap_s": 1e-3}, {"seqs": 64, "gap_s": 0.9e-3}])["per_request_s"] == 0.0
    assert fit_host_gap(rows[:1]) is None


def test_a_bad_gaps_file_names_its_line_and_field(tmp_path):
    from bullet.gpu.profile import read_gaps

    path = tmp_path / "gaps.csv"
    path.write_text("seqs,gap_s,gap_p10_s,gap_p90_s,launches\n1,0.0005,0.0004,0.0006,30\n8,fast,0.1,0.2,30\n")
    with pytest.raises(ValueError, match=r"gaps.csv:3: field 'gap_s': 'fast' is not a number"):
        read_gaps(path)
    path.write_text("seqs,gap_s,gap_p10_s,gap_p90_s,launches\n1,-0.0005,0.0004,0.0006,30\n")
    with pytest.raises(ValueError, match=r"gaps.csv:2: field 'gap_s': '-0.0005' is out of range"):
        read_gaps(path)
    path.write_text("seqs,gap_s,gap_p10_s,gap_p90_s\n1,0.0005,0.0004,0.0006\n")
    with pytest.raises(ValueError, match=r"gaps.csv:2: field 'launches': None is not a number"):
        read_gaps(path)


def test_a_fitted_model_reads_its_gap_and_refuses_a_bad_one():
    import json
    from pathlib import Path

    from bullet.config import ConfigError
    from bullet.perfmodel.fitted import FittedModel

    data = json.loads((Path(__file__).parents[1] / "profiles/h200/llama-3.1-8b/model.json").read_text())
    data["host_gap"] = {"fixed_s": 4e-4, "per_request_s": 5e-6}
    assert FittedModel(data, source="m.json").host_gap == (4e-4, 5e-6)
    data["host_gap"] = {"fixed_s": -1.0, "per_request_s": 0.0}
    with pytest.raises(ConfigError, match="m.json: not a valid fitted latency model: host_gap"):
        FittedModel(data, source="m.json")
    del data["host_gap"]
    assert FittedModel(data).host_gap is None


@pytest.mark.parametrize("bad", ["1", "1,x", "-1,0", "nan,1", "1,2,3"])
def test_cli_refuses_a_bad_gap(bad):
    res = CliRunner().invoke(app, ["simulate", "--num-prompts", "5", "--host-gap", bad])
    assert res.exit_code == 2 and "--host-gap" in res.output


def test_cli_gap_moves_ttft_by_hand():
    import json

    def ttft(gap: str) -> float:
        res = CliRunner().invoke(app, ["simulate", "--num-prompts", "1", "--latency", "roofline", "--json",
                                       "--host-gap", gap])
        assert res.exit_code == 0, res.output
        return json.loads(res.output)["ttft_ms"]["mean"]

    # one request alone: its one prefill launch starts 1 ms + 0.5 ms x 1 request later
    assert ttft("1,0.5") == pytest.approx(ttft("off") + 1.5)
