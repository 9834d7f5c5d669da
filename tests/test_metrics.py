"""Metrics against hand-computed examples (vllm bench serve definitions)."""

import json
import os
import stat

import numpy as np
import pytest

from bullet.config import SloConfig
from bullet.metrics import (
    Timeline,
    TokenGaps,
    atomic_write,
    export_columns,
    inter_token_latencies,
    json_safe,
    request_columns,
    summarize,
    weighted_stats,
    write_json,
)
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


def test_token_gaps_hand_computed():
    """Per-token lists: a at 0.5 | 0.6 0.8 1.1 (one fused launch), b and c decode together at 1.0 | 1.2 1.5 1.9
    (b's previous token at 0.9, c's at 0.95), d a lone token. Gaps: a .1 .2 .3, b .3 .3 .4, c .25 .3 .4. The
    pooled form stores each launch's step gaps once with the count of its requests."""
    a = finished(0, 0.0, 10, [0.5, 0.6, 0.8, 1.1])
    b = finished(1, 0.0, 10, [0.9, 1.2, 1.5, 1.9])
    c = finished(2, 0.0, 10, [0.95, 1.2, 1.5, 1.9])
    d = finished(3, 0.0, 10, [3.0])
    gaps = TokenGaps()
    gaps.add(0.6 - 0.5, 1)  # a's first step after its first token
    gaps.add_steps(np.array([0.6, 0.8, 1.1]), 1)
    gaps.add(1.2 - 0.9, 1)  # b and c: gaps from their previous tokens to the launch's first step
    gaps.add(1.2 - 0.95, 1)
    gaps.add_steps(np.array([1.2, 1.5, 1.9]), 2)  # then .3 and .4, twice each
    values, counts = gaps.arrays()
    pooled = np.sort(np.repeat(values, counts))
    np.testing.assert_array_equal(pooled, np.sort(inter_token_latencies([a, b, c, d])))
    np.testing.assert_allclose(pooled, [0.1, 0.2, 0.25, 0.3, 0.3, 0.3, 0.3, 0.4, 0.4])
    slo = SloConfig(ttft=1.0, tpot=1.0)
    light = summarize([a, b, c, d], slo, gaps=gaps)["itl_ms"]
    full = summarize([a, b, c, d], slo)["itl_ms"]
    assert light["p50"] == full["p50"] == pytest.approx(300)
    assert light["p90"] == full["p90"] and light["p99"] == full["p99"]
    assert light["mean"] == pytest.approx(full["mean"], rel=1e-12) and full["mean"] == pytest.approx(2550 / 9)


def test_weighted_stats_are_numpys_percentiles_to_the_bit():
    rng = np.random.default_rng(0)
    ps = (0, 12.5, 50, 90, 99, 99.9, 100)
    for _ in range(300):
        k = int(rng.integers(1, 40))
        values, counts = rng.random(k) * 0.05, rng.integers(1, 20, k)
        full = np.repeat(values, counts)
        rng.shuffle(full)
        want = np.percentile(full, ps)
        got = weighted_stats(values, counts, ps)
        assert [got[f"p{p:g}"] for p in ps] == want.tolist()
        assert got["mean"] == pytest.approx(full.mean(), rel=1e-12)
    assert np.isnan(weighted_stats(np.zeros(0), np.zeros(0, np.int64))["p50"])


def test_stats_are_numpys_percentiles_to_the_bit():
    from bullet.metrics import _stats

    rng = np.random.default_rng(1)
    ps = (0, 12.5, 50, 90, 99, 99.9, 100)
    for _ in range(300):
        k = int(rng.integers(1, 400))
        x = np.round(rng.exponential(0.05, k), int(rng.integers(2, 17)))  # (ties, too)
        x[rng.random(k) < 0.05] = np.nan
        got, kept = _stats(x, ps), x[~np.isnan(x)]
        if not kept.size:
            assert np.isnan(got["p50"])
            continue
        assert [got[f"p{p:g}"] for p in ps] == np.percentile(kept, ps).tolist()
        assert got["mean"] == float(kept.mean())


def test_weighted_stats_mean_sums_in_the_stable_float_order():
    """The sort runs on the floats' bit patterns where no sign bit is set: the same permutation, so the same
    summation order and mean to the bit; with a negative value or -0.0 it sorts the floats."""
    rng = np.random.default_rng(1)
    for signed in (False, True):
        for _ in range(100):
            k = int(rng.integers(1, 60))
            values = rng.integers(0, 6, k) * 0.013 + rng.random(k) * 1e-3 * (rng.random(k) < 0.5)
            if signed:
                values[rng.integers(0, k)] = -0.0 if rng.random() < 0.5 else -0.02
            counts = rng.integers(1, 20, k)
            order = np.argsort(values, kind="stable")
            want = float(np.dot(values[order], counts[order]) / counts.sum())
            assert weighted_stats(values, counts)["mean"] == want


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


def test_percentiles_chosen():
    a = finished(0, 0.0, 100, [0.5, 0.6, 0.8, 1.1])
    b = finished(1, 1.0, 100, [1.2, 1.3])
    s = summarize([a, b], SloConfig(), percentiles=(25, 99.9))
    assert set(s["ttft_ms"]) == {"mean", "p25", "p99.9"}
    assert s["ttft_ms"]["p25"] == pytest.approx(np.percentile([500, 200], 25))


def test_rejected_requests_add_no_gaps():
    """A rejected request has no tokens; the gaps of the others are unchanged wherever it sits."""
    a = finished(0, 0.0, 100, [0.5, 0.6, 0.8])
    rejected = Request(1, 0.0, 100, 3)
    rejected.error = "too long"
    np.testing.assert_allclose(np.sort(inter_token_latencies([rejected, a])), [0.1, 0.2])
    np.testing.assert_allclose(np.sort(inter_token_latencies([a, rejected])), [0.1, 0.2])


def test_exported_columns_name_their_units():
    a = finished(0, 1.0, 100, [1.5, 1.6, 1.8])
    cols = request_columns([a], SloConfig(ttft=0.6, tpot=0.15))
    out = export_columns(cols)
    assert out["ttft_ms"][0] == pytest.approx(500) and out["e2e_ms"][0] == pytest.approx(800)
    assert out["tpot_ms"][0] == pytest.approx(150) and out["ttft_slo_ms"][0] == pytest.approx(600)
    assert out["arrival_s"][0] == 1.0 and out["finish_s"][0] == pytest.approx(1.8)
    assert all(name.endswith(("_s", "_ms", "_tokens")) or name in ("id", "attained", "preemptions")
               for name in out)


def test_json_safe_turns_nan_and_inf_into_null(tmp_path):
    obj = {"a": float("nan"), "b": [1.0, float("inf")], "c": {"d": np.float64("-inf"), "e": 2}}
    assert json_safe(obj) == {"a": None, "b": [1.0, None], "c": {"d": None, "e": 2}}
    write_json(obj, tmp_path / "s.json")
    assert json.loads((tmp_path / "s.json").read_text()) == json_safe(obj)


def test_written_files_get_the_umask_permissions(tmp_path):
    old = os.umask(0o027)
    try:
        write_json({"x": 1}, tmp_path / "a.json")
        with atomic_write(tmp_path / "b.csv") as f:
            f.write("x\n")
    finally:
        os.umask(old)
    for name in ("a.json", "b.csv"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.csv"]


def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    (tmp_path / "keep.csv").write_text("old\n")
    with pytest.raises(RuntimeError), atomic_write(tmp_path / "keep.csv") as f:
        f.write("half")
        raise RuntimeError("disk full")
    assert (tmp_path / "keep.csv").read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["keep.csv"]


def test_timeline_rows_with_idle_gaps():
    """Two lanes: prefill at [1, 2] and [4, 5]; decode a fused 3-step launch at [0, 3] (steps end 1, 2, 3).
    Rows come in start order, the gaps (prefill 0-1 and 2-4) as idle, each step of the fused launch alone."""
    from bullet.batch import Batch, Chunk, Partition, StepResult

    t = Timeline(lambda: (2, 1, 10), kv_blocks=40)
    pre = Batch(Partition("prefill", 92), range(32), (Chunk(0, 0, 50, [], True),))
    dec = Batch(Partition("decode", 40), range(32), (Chunk(1, 10, 1, [], True), Chunk(2, 7, 1, [], True)),
                steps=3)
    t.on_step(StepResult(pre, 1.0, 2.0, (2.0,), None))
    t.on_step(StepResult(dec, 0.0, 3.0, np.array([1.0, 2.0, 3.0]), None))
    t.on_step(StepResult(pre, 4.0, 5.0, (5.0,), None))
    got = [(r[0], r[1], r[5], float(r[8]), float(r[9])) for r in t.csv_rows()]
    assert got == [("decode", "run", 2, 0.0, 1.0), ("prefill", "idle", 0, 0.0, 1.0),
                   ("decode", "run", 2, 1.0, 2.0), ("prefill", "run", 50, 1.0, 2.0),
                   ("decode", "run", 2, 2.0, 3.0), ("prefill", "idle", 0, 2.0, 4.0),
                   ("prefill", "run", 50, 4.0, 5.0)]
    run_row = next(r for r in t.csv_rows() if r[1] == "run")
    assert run_row[10:] == (2, 1, 10, "25.00")
    assert t.busy == {"prefill": 2.0, "decode": 3.0}


@pytest.mark.parametrize("probe, kv_blocks", [(lambda: (2, 1, 10), 40), (None, None), (lambda: (0, 3, 7), None)])
def test_timeline_csv_is_what_csv_writer_writes_of_its_rows(tmp_path, probe, kv_blocks):
    """``write_csv`` formats its lines itself: byte for byte what ``csv.writer`` writes of :meth:`csv_rows` (times to
    the microsecond), over two lanes with idle gaps, a fused launch, a tie in start times across the lanes, with and
    without the server's state and the pool's size."""
    import csv
    import io

    from bullet.batch import Batch, Chunk, Partition, StepResult

    t = Timeline(probe, kv_blocks=kv_blocks)
    pre = Batch(Partition("prefill", 92), range(8), (Chunk(0, 0, 50, [], True), Chunk(3, 16, 30, [], False)),
                cached_tokens=16)
    dec = Batch(Partition("decode", 40), range(32), (Chunk(1, 10, 1, [], True), Chunk(2, 7, 1, [], True)),
                steps=4)
    t.on_step(StepResult(pre, 1.0, 2.0, (2.0,), None))
    t.on_step(StepResult(dec, 0.25, 3.0, np.array([1.0, 2.0, 2.5, 3.0]), None))
    t.on_step(StepResult(pre, 4.0, 5.123456789, (5.123456789,), None))
    t.on_step(StepResult(dec, 10 / 3, 11 / 3, (11 / 3,), None))
    want = io.StringIO(newline="")
    w = csv.writer(want)
    w.writerow(Timeline.HEADER)
    w.writerows((*row[:8], f"{row[8]:.6f}", f"{row[9]:.6f}", *row[10:]) for row in t.csv_rows())
    t.write_csv(tmp_path / "timeline.csv")
    assert (tmp_path / "timeline.csv").read_bytes() == want.getvalue().encode()
    Timeline().write_csv(tmp_path / "empty.csv")
    assert (tmp_path / "empty.csv").read_bytes() == b",".join(h.encode() for h in Timeline.HEADER) + b"\r\n"


def test_token_gaps_take_lists_and_arrays_in_order(monkeypatch):
    """Step ends given as lists and as arrays (a long stretch's), packed or not: the gaps between each launch's
    consecutive steps, in the order given, each with its launch's count."""
    import bullet.metrics as m

    monkeypatch.setattr(m, "PACK", 2)
    launches = [([0.0, 0.5, 1.5], 2), (np.array([2.0, 2.25]), 1), ([3.0, 3.5], 4), ([4.0, 4.125, 5.0], 1),
                (np.array([6.0, 7.0, 7.5, 9.0]), 3)]
    gaps = TokenGaps()
    gaps.add(0.75, 5)
    for ends, count in launches:
        gaps.add_steps(ends, count)
    values, counts = gaps.arrays()
    want = [0.75] + [g for ends, _ in launches for g in np.diff(ends)]
    assert values.tolist() == want
    assert counts.tolist() == [5] + [c for ends, c in launches for _ in range(len(ends) - 1)]
