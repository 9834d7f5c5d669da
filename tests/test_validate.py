"""``bullet validate``: error arithmetic by hand; a "real" executor timed by the simulator itself gives zero
error on every metric (the comparison adds nothing of its own); the command end to end on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from typer.testing import CliRunner

from bullet.cli import app
from bullet.config import GPUS, SchedulerConfig, SloConfig
from bullet.gpu.executor import GpuExecutor
from bullet.validate import GATED, HOST_GAP_KIND, compare, error, validate
from simulator import SimExecutor
from tests.latency import LinearLatency
from tests.test_gpu_executor import SEED, SPEC, SimTimed, make_requests

runner = CliRunner()


def test_error_by_hand():
    assert error(100.0, 110.0) == pytest.approx(0.10)
    assert error(200.0, 150.0) == pytest.approx(-0.25)
    assert error(0.0, 1.0) != error(0.0, 1.0)  # nan: no relative error against zero
    real = {f"{m}_ms": {"mean": 10.0, "p50": 10.0, "p90": 20.0, "p99": 40.0} for m in ("ttft", "tpot", "itl", "e2e")}
    real.update(output_throughput=100.0, duration_s=10.0, slo_attainment=0.5)
    sim = json.loads(json.dumps(real))
    sim["ttft_ms"]["p90"] = 23.0
    rows = {r["metric"]: r for r in compare(real, sim)}
    assert rows["TTFT p90 (ms)"]["error"] == pytest.approx(0.15) and rows["TTFT p90 (ms)"]["gated"]
    assert rows["TTFT p99 (ms)"]["error"] == 0 and not rows["TTFT p99 (ms)"]["gated"]
    assert sum(r["gated"] for r in rows.values()) == len(GATED) == 4


def staggered():
    """Nine requests with token ids, arriving 4 ms apart."""
    out = make_requests(9, seed=4, with_ids=True)
    for i, r in enumerate(out):
        r.arrival = 0.004 * i
    return out


@pytest.mark.parametrize("policy", ["chunked", "bullet"])
def test_simulator_timed_executor_has_zero_error(policy):
    gpu = GPUS["h200"]
    lat = LinearLatency(SPEC.num_layers, base=2e-3, per_token=1e-3)
    real = GpuExecutor(SPEC, "dummy", "cpu", block_size=4, num_blocks=64, seed=SEED)
    ex = SimTimed(real, SimExecutor(lat, SPEC.num_layers, gpu))

    cfg = SchedulerConfig(policy=policy, max_batched_tokens=48, layers_per_step=1 if policy == "bullet" else None)
    rep = validate(staggered, ex, SPEC, gpu, cfg, SloConfig(ttft=None, ttft_per_token=0.02, tpot=0.05), lat, 64, 4)
    real.close()
    assert rep.real["requests"] == rep.sim["requests"] == 9
    assert all(abs(r["error"]) < 1e-9 for r in rep.rows), [r for r in rep.rows if abs(r["error"]) >= 1e-9]
    assert rep.worst() < 1e-9
    # each launch took what the model said (the host-gap row: this executor has none, so its launches start
    # at once, queued-like, and are left out; what is left there are the policy's own waits)
    assert all(abs(k["error_pct_p50"]) < 1e-6 for k in rep.launches if k["kind"] != HOST_GAP_KIND)
    assert rep.speed == pytest.approx((1.0, 1.0)) and rep.worst(rep.speed_rows) < 1e-9


def test_a_uniformly_slower_card_is_its_launch_speed():
    """The "real" launches are timed by the model with every term 1.3x (a card 1.3x slower than the profiled
    one): every launch took 1.3x its prediction, so the launch speed is 1.3 for both kinds, and the run
    simulated again at that speed has the simulator-timed run's zero error back, although the plain
    simulation is far off."""
    gpu = GPUS["h200"]
    lat = LinearLatency(SPEC.num_layers, base=2e-3, per_token=1e-3)
    card = LinearLatency(SPEC.num_layers, base=2.6e-3, per_token=1.3e-3, per_kv=1.3e-7)
    real = GpuExecutor(SPEC, "dummy", "cpu", block_size=4, num_blocks=64, seed=SEED)
    ex = SimTimed(real, SimExecutor(card, SPEC.num_layers, gpu))

    cfg = SchedulerConfig(policy="chunked", max_batched_tokens=48)
    rep = validate(staggered, ex, SPEC, gpu, cfg, SloConfig(ttft=None, ttft_per_token=0.02, tpot=0.05), lat, 64, 4)
    real.close()
    assert rep.speed == pytest.approx((1.3, 1.3))
    assert rep.worst() > 0.15  # every latency ~1/1.3 of the real one
    assert rep.worst(rep.speed_rows) < 1e-6, [r for r in rep.speed_rows if abs(r["error"]) >= 1e-6]


def test_validate_command_on_the_cpu(tmp_path):
    trace = tmp_path / "short.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n30,4\n12,6\n50,3\n8,5\n25,2\n")
    args = ["validate", "--device", "cpu", "--model", "tiny-llama", "--trace", str(trace), "--num-requests", "5",
            "--rate", "50", "--latency", "roofline"]
    res = runner.invoke(app, [*args, "--json"])
    # the H200 roofline knows nothing of a CPU: far over the 5 % gate
    assert res.exit_code == 1, res.output
    report = json.loads(res.stdout)
    assert report["worst_gated_error"] > 0.05
    assert report["real"]["requests"] == report["sim"]["requests"] == 5
    assert report["sim"]["config"]["host_gap_s"] == [0.0, 0.0]  # the roofline has none
    res = runner.invoke(app, [*args, "--max-error", "1e9", "--out", str(tmp_path / "v"), "--host-gap", "0.5,0.01"])
    assert res.exit_code == 0, res.output
    assert "TTFT p90" in res.output and (tmp_path / "v" / "report.json").exists()
    assert json.loads((tmp_path / "v" / "report.json").read_text())["sim"]["config"]["host_gap_s"] == \
        pytest.approx([5e-4, 1e-5])
    import csv

    with open(tmp_path / "v" / "launches.csv") as f:
        launches = list(csv.DictReader(f))
    report = json.loads((tmp_path / "v" / "report.json").read_text())
    kinds = [k for k in report["launches"] if k["kind"] != HOST_GAP_KIND]  # (that row counts gaps)
    assert len(launches) == sum(k["launches"] for k in kinds) > 0
    assert all(float(r["measured_ms"]) > 0 and float(r["predicted_ms"]) > 0 for r in launches)
    # every prompt token goes through exactly one launch that is not a pure decode launch
    assert sum(int(r["tokens"]) for r in launches if r["kind"] != "all/decode") >= 30 + 12 + 50 + 8 + 25
    (tmp_path / "file").write_text("")
    for bad, msg in ((["--policy", "nope"], "--policy must be one of"), (["--out", str(tmp_path / "file")],
                                                                        "not a folder"),
                     (["--max-prompt", "5"], "no requests left"), (["--host-gap", "x"], "--host-gap 'x'")):
        res = runner.invoke(app, [*args, *bad])
        assert res.exit_code == 2 and msg in res.output and "Traceback" not in res.output


def test_validate_serves_several_traces_and_rates_on_one_executor(tmp_path):
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.write_text("num_prefill_tokens,num_decode_tokens\n30,4\n12,6\n50,3\n9,2\n")
    b.write_text("num_prefill_tokens,num_decode_tokens\n8,5\n25,2\n40,3\n")
    args = ["validate", "--device", "cpu", "--model", "tiny-llama", "--trace", f"{a},{b}", "--num-requests", "3",
            "--rate", "40, 80", "--latency", "roofline", "--max-error", "1e9"]
    res = runner.invoke(app, [*args, "--json"])
    assert res.exit_code == 0, res.output
    runs = json.loads(res.stdout)["runs"]
    assert [(Path(r["trace"]).name, r["rate"]) for r in runs] == [("a.csv", 40.0), ("a.csv", 80.0),
                                                                  ("b.csv", 40.0), ("b.csv", 80.0)]
    assert [r["real"]["requests"] for r in runs] == [3, 3, 3, 3]
    assert all(r["real"]["requests"] == r["sim"]["requests"] for r in runs)
    res = runner.invoke(app, [*args, "--out", str(tmp_path / "v")])
    assert res.exit_code == 0, res.output
    assert "simulator error per run" in res.output
    assert sorted(p.parent.name for p in (tmp_path / "v").glob("*/report.json")) == ["a@40", "a@80", "b@40",
                                                                                     "b@80"]
    for bad in ("x,2", "0", ","):
        res = runner.invoke(app, [*args[:-2], "--rate", bad])
        assert res.exit_code == 2 and "--rate" in res.output and "Traceback" not in res.output, res.output


def test_validate_load_scales_rates_by_the_simulated_capacity(tmp_path):
    """--load serves at fractions of the policy's simulated capacity; that capacity meets the SLOs for >= 90 %
    of the requests in the simulator and twice it does not (checked here with simulate() directly)."""
    from bullet.config import MODELS, CacheConfig
    from bullet.traces import load_trace
    from simulator.run import latency_model, simulate

    trace = tmp_path / "a.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n30,4\n12,6\n50,3\n9,2\n8,5\n25,2\n")
    args = ["validate", "--device", "cpu", "--model", "tiny-llama", "--trace", str(trace), "--num-requests", "6",
            "--latency", "roofline", "--max-error", "1e9", "--max-batched-tokens", "16", "--slo-tpot", "100"]
    res = runner.invoke(app, [*args, "--slo-ttft", "0.5", "--load", "0.5,0.9", "--json"])
    assert res.exit_code == 0, res.output
    runs = json.loads(res.stdout)["runs"]
    cap = runs[0]["capacity"]
    assert [r["rate"] for r in runs] == [round(0.5 * cap, 3), round(0.9 * cap, 3)]
    assert all(r["real"]["requests"] == 6 for r in runs)
    spec, gpu = MODELS["tiny-llama"], GPUS["h200"]
    cfg = SchedulerConfig(policy="chunked", max_batched_tokens=16)
    slo = SloConfig(ttft=0.5e-3, tpot=0.1)

    def attainment(rate):
        return simulate(load_trace(str(trace), num_requests=6, rate=rate), spec, gpu, cfg,
                        CacheConfig(num_blocks=4096, block_size=16), slo,
                        latency_model("roofline", spec, gpu)).summary["slo_attainment"]

    assert attainment(cap) >= 0.9 > attainment(2 * cap)
    for bad, msg in ((["--load", "0.5", "--rate", "3"], "not both"), (["--load", "0"], "--load must be"),
                     (["--load", "x"], "--load must be"),
                     (["--load", "0.5", "--slo-ttft", "0.01"], "< 90 % of requests at any rate"),
                     (["--load", "0.5", "--slo-ttft", "3000"], "every request at once"),
                     (["--rate", "3", "--prefill-graph-tokens", "1000"], "power of two in 16-8192")):
        res = runner.invoke(app, [*args, *bad])
        assert res.exit_code == 2 and msg in res.output and "Traceback" not in res.output, (bad, res.output)


def test_launch_errors_read_a_partial_overlap_as_the_fit_does():
    """A one-step decode launch over [0, 1.5] s that a prefill overlapped for [0.75, 1.5]: o = 0.5. With 1 s alone
    and 2 s next to a prefill, progress is 0.5 T / 1 + 0.5 T / 2 = 1, so T = 4/3 s (by hand); the prefill
    ([0.75, 3], overlapped 0.75 of its 2.25 s: o = 1/3, 3 s alone and 4.5 s beside decode) 1 / (2/3 / 3 + 1/3 /
    4.5) = 3.375 s."""
    from bullet.batch import Batch, Chunk, Partition, StepResult
    from bullet.validate import launch_errors, launch_of

    class Fake:
        def predict(self, w, n, co=None, co_sms=0):
            base = 1.0 if w.tokens == w.seqs else 3.0
            return base * (1.0 if co is None else 1.5 if w.tokens > w.seqs else 2.0)

        def decode_steps(self, w, steps, n, co=None, co_sms=0):
            return np.full(steps, self.predict(w, n, co, co_sms))

    L = SPEC.num_layers
    dec = Batch(Partition("decode", 40), range(L), (Chunk(1, 99, 1, (0,), True),))
    pre = Batch(Partition("prefill", 92), range(L), (Chunk(2, 0, 64, (1, 2, 3, 4), True),))
    results = [StepResult(dec, 0.0, 1.5, [1.5], None), StepResult(pre, 0.75, 3.0, [3.0], None)]
    rows: list[dict] = []
    kinds = {k["kind"]: k for k in launch_errors([launch_of(r, L) for r in results], Fake(), L, rows)}
    assert rows[0]["overlap"] == 0.5 and rows[0]["predicted_ms"] == pytest.approx(4000 / 3)
    # neither overlapped for most of its time: no "beside"; summed errors 4/3 vs 1.5 s and 3.375 vs 2.25 s
    assert set(kinds) == {"decode/decode", "prefill/prefill"}
    assert kinds["decode/decode"]["error_pct_sum"] == pytest.approx(100 * (4 / 3 / 1.5 - 1))
    assert kinds["prefill/prefill"]["error_pct_sum"] == pytest.approx(50.0)
    # a decode launch wholly inside a prefill is "beside": 2 s predicted for 1 s measured; the prefill, half
    # overlapped, 1 / (0.5 / 3 + 0.5 / 4.5) = 3.6 s for 2 s
    inside = [StepResult(dec, 0.0, 1.0, [1.0], None), StepResult(pre, 0.0, 2.0, [2.0], None)]
    kinds = {k["kind"]: k for k in launch_errors([launch_of(r, L) for r in inside], Fake(), L)}
    assert kinds["decode/decode beside"]["error_pct_sum"] == pytest.approx(100.0)
    assert kinds["prefill/prefill"]["error_pct_sum"] == pytest.approx(80.0)
    assert rows[1]["overlap"] == pytest.approx(1 / 3, abs=1e-4)
    assert rows[1]["predicted_ms"] == pytest.approx(1e3 / ((2 / 3) / 3 + (1 / 3) / 4.5))


def test_launch_errors_put_the_models_host_gap_against_back_to_back_launches():
    """Launches of 2 requests on the whole GPU ending at 1.000 s and restarting 1.0004 s, then 2.0004 -> 2.0010 s
    (0.4 and 0.6 ms gaps); one restarting 6 ms after an end is waiting for an arrival, not a gap. With host_gap 0.3 ms + 0.05 ms
    a request the model says 0.4 ms each: errors 0 % and -33.3 %, 0.8 against 1.0 ms summed (-20 %)."""
    from bullet.batch import Batch, Chunk, Partition, StepResult
    from bullet.validate import HOST_GAP_KIND, launch_errors, launch_of

    class Gapped:
        host_gap = (3e-4, 5e-5)

        def predict(self, w, n, co=None, co_sms=0):
            return 1.0

        def decode_steps(self, w, steps, n, co=None, co_sms=0):
            return np.full(steps, 1.0)

    L = SPEC.num_layers
    dec = Batch(Partition("all", 132), range(L), (Chunk(1, 99, 1, (0,), True), Chunk(2, 50, 1, (1,), True)))
    spans = [(0.0, 1.0), (1.0004, 2.0004), (2.0010, 3.0010), (3.0070, 4.0070)]
    launches = [launch_of(StepResult(dec, a, b, [b], None), L) for a, b in spans]
    gap = {k["kind"]: k for k in launch_errors(launches, Gapped(), L)}[HOST_GAP_KIND]
    assert gap["launches"] == 2 and gap["measured_ms_p50"] == pytest.approx(0.5)
    assert gap["error_pct_sum"] == pytest.approx(-20.0)
    assert gap["error_pct_p10"] == pytest.approx(-100 / 3 + 0.1 * 100 / 3)  # numpy's linear interpolation
    # a model without a host gap predicts none: -100 %
    del Gapped.host_gap
    assert {k["kind"]: k for k in launch_errors(launches, Gapped(), L)}[HOST_GAP_KIND]["error_pct_sum"] == -100.0


def test_stalls_name_launches_far_over_their_prediction():
    """A launch over 2x its prediction (scaled by the run's median measured / predicted) and 20 ms over it is a
    stall (the H200's mid-run compile: 680 ms against 65); a slow small launch (3x, +5 ms) is not. Where the
    model is another device's (the CPU run against the H200's model: every launch ~60x), only the outlier is."""
    from bullet.validate import stalls

    def row(measured, predicted, seqs=1):
        return {"kind": "all/prefill", "tokens": 2048, "seqs": seqs, "measured_ms": measured, "predicted_ms": predicted}

    normal = [row(50.0, 50.0)] * 10
    rows = [*normal, row(680.0, 65.0, 130), row(7.5, 2.5), row(106.0, 52.7, 10)]
    got = stalls(rows)
    assert [r["n"] for r in got] == [10, 12]  # median ratio 1: over 2x and 20 ms over
    assert got[0]["seqs"] == 130 and got[1]["measured_ms"] == 106.0
    cpu = [row(3000.0, 50.0)] * 10 + [row(30000.0, 50.0), row(6000.0, 50.0)]
    assert [r["n"] for r in stalls(cpu)] == [10]  # median 60x: 30 s is 10x that, 6 s only 2x (not over)
    assert stalls([]) == []


def test_launch_speed_by_hand():
    from bullet.validate import launch_speed

    rows = [{"tokens": 100, "seqs": 1, "measured_ms": 30.0, "predicted_ms": 20.0},  # with prompt rows
            {"tokens": 40, "seqs": 8, "measured_ms": 10.0, "predicted_ms": 20.0},  # mixed: prompt rows too
            {"tokens": 8, "seqs": 8, "measured_ms": 9.0, "predicted_ms": 10.0}]  # decode only
    assert launch_speed(rows) == pytest.approx((40 / 40, 9 / 10))
    assert launch_speed(rows[:2]) == pytest.approx((1.0, 1.0))  # no decode-only launch: 1.0
    assert launch_speed([]) == (1.0, 1.0)


def test_scaled_latency_scales_each_kind_by_its_factor():
    from bullet.perfmodel import Work
    from bullet.perfmodel.base import ScaledLatency

    lat = LinearLatency(SPEC.num_layers, base=2e-3, per_token=1e-3)
    prompt = Work(SPEC.num_layers, 64, 2, 2048.0, 64, 2, True, 32)
    decode = Work(SPEC.num_layers, 8, 8, 0.0, 800, 8, True, 100)
    s = ScaledLatency(lat, 1.5, 0.5)
    # LinearLatency by hand: (base + per_token * tokens + per_kv * kv_read) at 132 of 132 SMs
    assert s.predict(prompt, 132) == pytest.approx(1.5 * (2e-3 + 64e-3 + 64e-7))
    assert s.predict(decode, 66) == pytest.approx(0.5 * 2 * (2e-3 + 8e-3 + 800e-7))
    times, ends = s.decode_step_ends(decode, 3, 132)
    assert times == pytest.approx([0.5 * (2e-3 + 8e-3 + (800 + 8 * k) * 1e-7) for k in range(3)])
    assert ends == pytest.approx(np.cumsum(times))
    assert s.num_layers == SPEC.num_layers  # the rest is the wrapped model's
    for bad in ((0.0, 1.0), (1.0, float("nan")), (-1.0, 1.0), (float("inf"), 1.0)):
        with pytest.raises(ValueError, match="positive and finite"):
            ScaledLatency(lat, *bad)


def test_save_scaled_writes_the_model_at_the_runs_launch_speed(tmp_path):
    """``--save-scaled``: the fitted model with its scale = the launch speed pooled over every run's launches
    (recomputed here from launches.csv), which loads and predicts that much slower or faster; refused up front
    for a model that is not fitted."""
    import csv

    from bullet.config import MODELS
    from bullet.perfmodel import FittedModel, Work
    from tests.test_fit import truth_model

    data = truth_model().data
    tiny = MODELS["tiny-llama"]
    data["model_spec"] = {k: getattr(tiny, k) for k in data["model_spec"]}
    model = tmp_path / "tiny.json"
    model.write_text(json.dumps(data))
    trace = tmp_path / "short.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n30,4\n12,6\n50,3\n8,5\n25,2\n")
    args = ["validate", "--device", "cpu", "--model", "tiny-llama", "--trace", str(trace), "--num-requests", "5",
            "--rate", "50", "--max-error", "1e9"]
    out = tmp_path / "card.json"
    res = runner.invoke(app, [*args, "--latency", str(model), "--out", str(tmp_path / "v"), "--save-scaled", str(out)])
    assert res.exit_code == 0, res.output
    with open(tmp_path / "v" / "launches.csv") as f:
        rows = list(csv.DictReader(f))
    sums = {True: [0.0, 0.0], False: [0.0, 0.0]}
    for r in rows:
        s = sums[int(r["tokens"]) > int(r["seqs"])]
        s[0] += float(r["measured_ms"])
        s[1] += float(r["predicted_ms"])
    saved = json.loads(out.read_text())
    assert saved["scale"]["prefill"] == pytest.approx(sums[True][0] / sums[True][1], rel=1e-9)
    assert saved["scale"]["decode"] == pytest.approx(sums[False][0] / sums[False][1], rel=1e-9)
    assert saved["scale"]["launches"] == len(rows) and saved["scale"]["policy"] == "chunked"
    # the serving gap: the launches' own back-to-back gaps, fitted (bullet.validate.serving_gap), read back as the
    # model's host gap
    from bullet.validate import serving_gap

    expected = serving_gap([rows])
    assert {k: saved["serving_gap"][k] for k in expected} == pytest.approx(expected, rel=1e-9)
    assert saved["serving_gap"]["policy"] == "chunked" and saved["serving_gap"]["runs"] == saved["scale"]["runs"]
    assert FittedModel.load(out, tiny).host_gap == (expected["fixed_s"], expected["per_request_s"])
    before, after = FittedModel.load(model, tiny), FittedModel.load(out, tiny)
    dec = Work(2, 4, 4, 400.0, 400, 4, True, 100)
    assert after.predict(dec, 132) == pytest.approx(saved["scale"]["decode"] * before.predict(dec, 132))
    res = runner.invoke(app, [*args, "--latency", "roofline", "--save-scaled", str(tmp_path / "no.json")])
    assert res.exit_code == 2 and "--save-scaled scales a fitted latency model" in res.output
    assert not (tmp_path / "no.json").exists()
    res = runner.invoke(app, [*args, "--latency", str(model), "--save-scaled", str(tmp_path)])
    assert res.exit_code == 2 and "is a folder" in res.output


def test_saved_validate_runs_are_rebuilt_as_validate_simulated_them():
    """bench/validate_rescale.py at speed 1.0 on a saved H200 validate run prints the gated errors that
    `bullet validate` recorded on the GPU (its report.json): the requests, scheduler, KV pool and SLOs are
    rebuilt as the run had them, with the shipped latency model of that day (bench/data/validate-h200-2026-12-01/
    model.json; the shipped profile has been measured again since)."""
    import subprocess
    import sys

    run = Path(__file__).resolve().parents[1] / "bench/data/validate-h200-2026-12-01/gpu-944cc754/sharegpt@17.775"
    model = run.parents[1] / "model.json"
    out = subprocess.run([sys.executable, "bench/validate_rescale.py", str(run), "--factors", "1,1", "--latency", str(model)],
                         capture_output=True, text=True, check=True, cwd=run.parents[4]).stdout
    row = next(line for line in out.splitlines() if line.startswith("| sharegpt@17.775"))
    recorded = {r["metric"]: 100 * r["error"] for r in json.loads((run / "report.json").read_text())["errors"]}
    cells = [c.strip() for c in row.strip("|").split("|")][3:7]
    expected = [recorded[m] for m in ("TTFT mean (ms)", "TTFT p90 (ms)", "TPOT mean (ms)", "TPOT p90 (ms)")]
    assert [float(c.rstrip(" %")) for c in cells] == pytest.approx(expected, abs=0.051)
