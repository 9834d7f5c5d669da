"""`bullet profile --device cpu` on the tiny model: the same code path as on a GPU, end to end, writing a
profile that can be resumed."""

import csv
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from typer.testing import CliRunner

from bullet.cli import app
from bullet.config import GPUS, MODELS, gpu_short_name
from bullet.gpu.profile import (
    COLUMNS,
    DECODE_PASSES_FILE,
    PASSES_FILE,
    Profiler,
    _grid_options,
    grid,
    read_gaps,
    read_passes,
    read_points,
    sampled_mixed,
    swept_coruns,
    twin,
)

SHIPPED = Path(__file__).resolve().parents[1] / "profiles/h200/llama-3.1-8b"
KV_H200 = 700_000  # KV tokens of the executor that measured the shipped profile (its grid's ids, exactly)


def run(out, *flags):
    res = CliRunner().invoke(app, ["profile", "--device", "cpu", "--model", "tiny-llama", "--out", str(out), *flags])
    assert res.exit_code == 0, res.output
    return res.output


def test_profile_on_the_cpu_writes_every_point_and_resumes(tmp_path, monkeypatch):
    out = tmp_path / "prof"
    run(out)
    rows = read_points(out / "points.csv")
    ids = [p.id for p in grid(MODELS["tiny-llama"], (GPUS["h200"].prefill_sizes, GPUS["h200"].decode_sizes), True, cpu=True)]
    assert [r["id"] for r in rows] == ids
    assert list(rows[0]) == list(COLUMNS)
    by = {r["id"]: r for r in rows}
    # features by hand: 16 new tokens after a 32-token prefix: 16 * 32 + 16 * 17 / 2 = 648 query-key pairs,
    # 48 KV tokens read; a decode launch of 4 rows at context 32: 4 tokens, 128 KV tokens, 4 fused steps
    pre = by["prefill[16@32||Lall|s1]@all132"]
    assert (int(pre["tokens"]), float(pre["attn_pairs"]), int(pre["kv_read"]), int(pre["samples"])) == (16, 648, 48, 1)
    dec = by["decode[|4x32|Lall|s4]@all132"]
    assert (int(dec["tokens"]), int(dec["seqs"]), int(dec["kv_read"]), int(dec["steps"])) == (4, 4, 128, 4)
    co = [r for r in rows if r["co_kind"]]
    assert {r["kind"] for r in co} == {"prefill", "decode"} and all(int(r["co_sms"]) > 0 for r in co)
    for r in rows:
        assert int(r["reps"]) == 3 and float(r["gpu_s"]) > 0 and float(r["host_s"]) > 0
        assert float(r["gpu_s_min"]) <= float(r["gpu_s"]) <= float(r["gpu_s_max"])
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["model"] == "tiny-llama" and meta["grid"] == "quick" and meta["points"] == len(ids)
    for key in ("date", "torch", "bullet", "commit", "gpu", "finished", "model_spec"):
        assert key in meta
    # every shape a fitted model is checked against, the q/k norm and qkv bias flags included (a Qwen3 profile
    # without them was fitted as a model without a q/k norm and refused for qwen3-8b)
    tiny = MODELS["tiny-llama"]
    assert meta["model_spec"] == {k: getattr(tiny, k) for k in ("num_layers", "hidden_size", "num_heads",
                                  "num_kv_heads", "head_dim", "intermediate_size", "vocab_size", "dtype_bytes",
                                  "tp", "qkv_bias", "qk_norm")}
    assert meta["prefill_graphs"] == {"max_tokens": 512, "max_seqs": 64, "buckets": [16, 32, 64, 128, 256, 512]}
    assert meta["skinny_table"] is None  # (the CPU executor takes no skinny table)
    assert len(meta["source_sha256"]) == 16 and int(meta["source_sha256"], 16) >= 0  # names the code, .git or not
    # the engine's host time between launches, per decode batch size (the CPU grid's sizes): 32 tokens each,
    # the first from the prefill, then 31 one-step decode launches of every request: 30 gaps between them
    gaps = read_gaps(out / "gaps.csv")
    assert [g["seqs"] for g in gaps] == [1, 4, 16]
    for g in gaps:
        assert g["launches"] == 30 and 0 < g["gap_p10_s"] <= g["gap_s"] <= g["gap_p90_s"]
    # an interrupted write leaves a torn last line: it is dropped and that point measured again
    text = (out / "points.csv").read_text().splitlines(keepends=True)
    (out / "points.csv").write_text("".join(text[:-1]) + text[-1][:20])
    gaps_meta = meta["gaps"]
    assert "measured 1 points (8 already there)" in run(out)
    assert [r["id"] for r in read_points(out / "points.csv")] == ids
    # a resumed profile keeps the record of its gaps.csv (measured once; the resume dropped it)
    assert json.loads((out / "metadata.json").read_text())["gaps"] == gaps_meta
    with (out / "points.csv").open() as f:
        assert sum(1 for _ in csv.reader(f)) == len(ids) + 1
    # a resume stopped before it ends (a device call's time limit) keeps that record too: gaps.csv is not
    # measured again, so its metadata must survive the first rewrite, not only the last
    text = (out / "points.csv").read_text().splitlines(keepends=True)
    (out / "points.csv").write_text("".join(text[:-1]))

    def stopped(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr("bullet.gpu.profile._append", stopped)
    res = CliRunner().invoke(app, ["profile", "--device", "cpu", "--model", "tiny-llama", "--out", str(out)])
    assert res.exit_code != 0
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["gaps"] == gaps_meta and "finished" not in meta


def test_gpu_folder_names():
    assert gpu_short_name("NVIDIA H200") == "h200"
    assert gpu_short_name("NVIDIA A100-SXM4-80GB") == "a100"
    assert gpu_short_name("NVIDIA H100 80GB HBM3") == "h100"


def test_profile_without_cuda_says_so(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    res = CliRunner().invoke(app, ["profile", "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and "no CUDA device" in res.output


@pytest.mark.parametrize("quick, opts", [(True, {}), (False, {}),
                                         (True, {"sizes": "all", "twins": True, "corun_min": 4}),
                                         (True, {"sizes": "all", "twins": True, "corun_min": 3,
                                                 "corun_sweep": True})])
def test_every_gpu_grid_point_is_a_legal_launch(quick, opts):
    """The H200 grids (quick and full, random launches and co-runs included): each point's partition is on the
    nested menu (prefill sizes on the prefill lane, decode sizes on the decode lane, the whole GPU on 'all'),
    a co-run pair leaves the two lanes disjoint (p + d <= 132), every chunk fits the model's positions and every
    layer slice its layers, and the random points are the same on every call (seeded)."""
    gpu, spec = GPUS["h200"], MODELS["llama-3.1-8b"]
    menu = {"prefill": set(gpu.prefill_sizes), "decode": set(gpu.decode_sizes), "all": {gpu.num_sms}}
    pts = grid(spec, (gpu.prefill_sizes, gpu.decode_sizes), quick, kv_tokens=800_000, **opts)
    assert [p.id for p in pts] == [p.id for p in grid(spec, (gpu.prefill_sizes, gpu.decode_sizes), quick,
                                                        kv_tokens=800_000, **opts)]
    assert len({p.id for p in pts}) == len(pts)
    for p in pts:
        assert p.sms in menu[p.lane], p.id
        if p.co is not None:
            other = "decode" if p.lane == "prefill" else "prefill"
            assert p.co_sms in menu[other] and p.sms + p.co_sms <= gpu.num_sms, p.id
        for shape in (p.shape, p.co) if p.co else (p.shape,):
            assert all(n + pre <= spec.max_position for n, pre in shape.prefill), p.id
            assert all(c + shape.steps <= spec.max_position for c in shape.decode), p.id
            assert shape.layers is None or 1 <= shape.layers <= spec.num_layers, p.id
    assert sum(p.co is not None for p in pts) >= (32 if quick else 100)
    # chunked steps at a 2,048-token budget: decode rows plus prompt chunks fill the budget exactly
    mixed = sampled_mixed(gpu.num_sms, 16, 800_000)
    assert all(m.id in {p.id for p in pts} for m in mixed)
    for m in mixed:
        assert len(m.shape.decode) + sum(n for n, _ in m.shape.prefill) == 2048, m.id
        assert 2 <= len(m.shape.decode) <= 80 and all(256 <= c <= 4096 for c in m.shape.decode), m.id


def test_a_profile_of_another_corun_protocol_is_resumed_only_with_redo_coruns(tmp_path):
    """Co-run points measured by another protocol (here: the metadata of a profile from before the protocol was
    recorded) are not mixed with new ones: resuming refuses, naming the flag; --redo-coruns measures exactly the
    co-run points again and records the protocol."""
    out = tmp_path / "prof"
    run(out)
    rows = read_points(out / "points.csv")
    co = {r["id"] for r in rows if r["co_kind"]}
    assert co
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["corun_protocol"] == {"name": "continuous", "sustain_s": 2.0}
    del meta["corun_protocol"]
    (out / "metadata.json").write_text(json.dumps(meta))
    res = CliRunner().invoke(app, ["profile", "--device", "cpu", "--model", "tiny-llama", "--out", str(out)])
    assert res.exit_code == 2 and "--redo-coruns" in res.output and "single burst" in res.output, res.output
    res = CliRunner().invoke(app, ["profile", "--device", "cpu", "--model", "tiny-llama", "--out", str(out),
                                   "--redo-coruns"])
    assert res.exit_code == 0, res.output
    assert f"measured {len(co)} points ({len(rows) - len(co)} already there)" in res.output
    after = read_points(out / "points.csv")
    assert sorted(r["id"] for r in after) == sorted(r["id"] for r in rows)
    assert [r["id"] for r in after[-len(co):]] == [r["id"] for r in rows if r["id"] in co]  # appended again
    assert json.loads((out / "metadata.json").read_text())["corun_protocol"]["name"] == "continuous"


def test_co_run_coverage_by_hand():
    """The fraction of a step (or prefill) inside the other lane's launches, and which decode steps the timed
    prefills covered: windows and steps chosen so each answer is a hand sum."""
    from bullet.batch import StepResult
    from bullet.gpu.profile import _cover, _covered

    # [0, 10] inside windows [2, 4] and [6, 12]: 2 + 4 = 6 of 10
    assert _cover(0.0, 10.0, [(2.0, 4.0), (6.0, 12.0)]) == pytest.approx(0.6)
    assert _cover(5.0, 6.0, [(2.0, 4.0)]) == 0.0
    assert _cover(3.0, 3.5, [(0.0, 9.0)]) == 1.0
    # a decode launch from 0 with steps ending at 1, 2, 3, 4; timed prefills over [0.95, 2.9] and [2.95, 3.5]
    res = StepResult(None, 0.0, 4.0, [1.0, 2.0, 3.0, 4.0], None)
    prefills = [(StepResult(None, 0.95, 2.9, [2.9], None), 0.0), (StepResult(None, 2.95, 3.5, [3.5], None), 0.0)]
    steps, cover = _covered([res], prefills)
    # step [0, 1]: 0.05 covered; [1, 2]: all; [2, 3]: 0.9 + 0.05 = 0.95; [3, 4]: 0.5 -> the middle two count
    assert steps == pytest.approx([1.0, 1.0]) and cover == pytest.approx([1.0, 0.95])
    assert _covered([res], prefills, at_least=0.96)[0] == pytest.approx([1.0])


def test_the_quick_grid_with_every_size_twins_and_more_co_runs():
    """The quick grid with --sizes all --twins --corun-min 4 on the H200: solo points on every menu size of both
    lanes, the quick grid's 426 points among its points (same ids: resuming measures only the new ones; the
    shipped profile, resumed with --sizes all --twins --corun-min 3, holds the quick grid and lies within its own),
    each co-run shape also alone on its partition before the co-runs, and 4 co-run pairs at least on every
    decode size the co-runs use, each pair seen from both sides."""
    gpu, spec = GPUS["h200"], MODELS["llama-3.1-8b"]
    menu = (gpu.prefill_sizes, gpu.decode_sizes)
    shipped = {r["id"] for r in read_points(SHIPPED / "points.csv")}
    quick = {p.id for p in grid(spec, menu, True, kv_tokens=KV_H200)}
    opts = json.loads((SHIPPED / "metadata.json").read_text()).get("grid_options", {})
    assert quick <= shipped <= {p.id for p in grid(spec, menu, True, kv_tokens=KV_H200, **opts)}  # (a resumed grid)
    assert [p.id for p in grid(spec, menu, True, kv_tokens=KV_H200, sizes="alternate")] == \
        [p.id for p in grid(spec, menu, True, kv_tokens=KV_H200)]
    pts = grid(spec, menu, True, kv_tokens=KV_H200, sizes="all", twins=True, corun_min=4)
    ids = [p.id for p in pts]
    assert quick < set(ids)
    for lane, sizes in (("prefill", gpu.prefill_sizes[:-1]), ("decode", gpu.decode_sizes[:-1])):
        assert {p.sms for p in pts if p.lane == lane and p.co is None} == set(sizes), lane
    # each line of the quick grid (a shape on all 7 alternate sizes of its lane) is on all 14 sizes now
    def lines(points):
        return Counter((p.shape.key(), p.lane) for p in points if p.co is None and p.lane != "all")

    old = lines(grid(spec, menu, True, kv_tokens=KV_H200))
    new = lines(pts)
    assert sum(n == 7 for n in old.values()) == 15 + 20  # prefill lines, decode lines (the KV fits)
    assert all(new[k] == 14 for k, n in old.items() if n == 7)
    co = [p for p in pts if p.co is not None]
    first_co = min(ids.index(p.id) for p in co)
    for p in co:
        assert twin(p).id in ids and ids.index(twin(p).id) < first_co, p.id
        assert (twin(p).shape, twin(p).lane, twin(p).sms, twin(p).co) == (p.shape, p.lane, p.sms, None)
    pairs = Counter(p.co_sms for p in co if p.lane == "prefill")
    used = {p.co_sms for p in grid(spec, menu, True, kv_tokens=KV_H200) if p.co is not None and p.lane == "prefill"}
    assert set(pairs) == used and min(pairs.values()) >= 4
    assert Counter(p.sms for p in co if p.lane == "decode") == pairs  # each pair from both sides
    assert len(co) == 74 + 2 * sum(max(0, 4 - n) for n in Counter(
        p.co_sms for p in grid(spec, menu, True, kv_tokens=KV_H200) if p.co is not None and p.lane == "prefill"
    ).values())


def test_corun_all_splits_fills_every_decode_size_and_keeps_the_grid(tmp_path):
    """--corun-min 3 --corun-all-splits on the H200: 3 pairs at least beside every decode size of the menu (8 .. 112),
    each on the largest prefill size beside it, so prefill 20 and 108 (none in the quick grid) get co-runs; the grid
    with --corun-min 3 alone keeps its ids (a resume measures only the new splits' pairs)."""
    gpu, spec = GPUS["h200"], MODELS["llama-3.1-8b"]
    menu = (gpu.prefill_sizes, gpu.decode_sizes)
    base = grid(spec, menu, True, kv_tokens=KV_H200, corun_min=3)
    pts = grid(spec, menu, True, kv_tokens=KV_H200, corun_min=3, corun_splits=True)
    assert {p.id for p in base} < {p.id for p in pts}
    pre = [p for p in pts if p.co is not None and p.lane == "prefill"]
    pairs = Counter(p.co_sms for p in pre)
    assert set(pairs) == set(gpu.decode_sizes[:-1]) and min(pairs.values()) >= 3
    assert {p.sms for p in pre} >= {20, 108}
    for p in pre:
        assert p.sms + p.co_sms <= gpu.num_sms
    assert Counter(p.sms for p in pts if p.co is not None and p.lane == "decode") == pairs  # both sides
    assert _grid_options({"corun_splits": True, "corun_min": 3}, None, False, 0) == {
        "sizes": None, "twins": False, "corun_min": 3, "corun_splits": True}  # a resume keeps both
    # without --corun-min (here or in the profile): one line, exit code 2, before the executor starts (an 8B model
    # on the CPU would not even fit: the default model is left on purpose) and nothing written
    res = CliRunner().invoke(app, ["profile", "--device", "cpu", "--out", str(tmp_path / "p"), "--corun-all-splits"])
    assert res.exit_code == 2 and "--corun-min N" in res.output, res.output
    assert not (tmp_path / "p").exists()


def test_the_corun_sweep_adds_its_pairs_to_the_shipped_grid():
    """--corun-sweep on the H200: the shipped profile's points keep their ids; 4 splits (prefill 36, 44, 68, 92 SMs
    beside decode 96, 88, 64, 40) x (8 row counts beside a 2,048-token prompt + 5 prompts beside 8 rows) = 52
    pairs, each from both sides, 104 co-run points, every decode row at a 2,048-token context; with --twins each
    shape also alone on its partition, before the co-runs."""
    gpu, spec = GPUS["h200"], MODELS["llama-3.1-8b"]
    menu = (gpu.prefill_sizes, gpu.decode_sizes)
    opts = json.loads((SHIPPED / "metadata.json").read_text()).get("grid_options", {})
    base = grid(spec, menu, True, kv_tokens=KV_H200, **opts)
    pts = grid(spec, menu, True, kv_tokens=KV_H200, **{**opts, "corun_sweep": True})
    ids = [p.id for p in pts]
    assert {p.id for p in base} <= set(ids)
    sweep = swept_coruns(gpu.prefill_sizes[:-1], gpu.decode_sizes[:-1], gpu.num_sms)
    assert len(sweep) == 104 and {p.id for p in sweep} <= set(ids)
    pre = [p for p in sweep if p.lane == "prefill"]
    assert Counter((p.sms, p.co_sms) for p in pre) == {(36, 96): 13, (44, 88): 13, (68, 64): 13, (92, 40): 13}
    assert Counter((p.shape.prefill[0][0], len(p.co.decode)) for p in pre) == Counter(
        {**{(2048, r): 4 for r in (1, 2, 4, 8, 16, 32, 64, 128)},
         **{(n, 8): 4 for n in (256, 512, 1024, 4096, 8192)}})
    assert all(set(p.co.decode) == {2048} and p.co.steps == 8 and p.shape.layers is None for p in pre)
    dec = [p for p in sweep if p.lane == "decode"]
    assert sorted((p.co.key(), p.co_sms, p.shape.key(), p.sms) for p in dec) == \
        sorted((p.shape.key(), p.sms, p.co.key(), p.co_sms) for p in pre)
    first_co = min(ids.index(p.id) for p in pts if p.co is not None)
    assert all(ids.index(twin(p).id) < first_co for p in sweep)


def test_co_runs_in_passes_are_the_median_of_their_passes_and_resume(tmp_path):
    """--corun-passes 2 (and --twins) on the CPU: the solo points, then two passes over the co-run points; every
    pass's row in corun_passes.csv, points.csv's co-run rows their median, the pass count and grid options in the
    metadata; a rerun (without the flags: the profile keeps them) measures nothing; a torn pass is measured again,
    and only it."""
    out = tmp_path / "prof"
    assert "measured 13 points (0 already there)" in run(out, "--corun-passes", "2", "--twins")
    rows = {r["id"]: r for r in read_points(out / "points.csv")}
    passes = read_passes(out / PASSES_FILE)
    co = [pid for pid, r in rows.items() if r["co_kind"]]
    assert len(rows) == 11 and len(co) == 2 and set(passes) == set(co)
    for pid in co:
        assert [p["pass"] for p in passes[pid]] == ["1", "2"]
        for col in ("gpu_s", "first_s", "step_s", "host_s"):
            a, b = (float(p[col]) for p in passes[pid])
            assert float(rows[pid][col]) == pytest.approx((a + b) / 2, rel=1e-8), (pid, col)
        assert float(rows[pid]["gpu_s_min"]) == min(float(p["gpu_s_min"]) for p in passes[pid])
        assert float(rows[pid]["gpu_s_max"]) == max(float(p["gpu_s_max"]) for p in passes[pid])
        assert int(rows[pid]["reps"]) == sum(int(p["reps"]) for p in passes[pid])
        assert twin_of(pid) in rows  # measured alone too
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["corun_passes"] == 2 and meta["grid_options"] == {"sizes": None, "twins": True, "corun_min": 0}
    assert meta["points"] == 11
    before = (out / "points.csv").read_text()
    assert "measured 0 points (11 already there)" in run(out)
    assert (out / "points.csv").read_text() == before
    lines = (out / PASSES_FILE).read_text().splitlines(keepends=True)
    (out / PASSES_FILE).write_text("".join(lines[:-1]) + lines[-1][:30])
    assert "measured 1 points (10 already there)" in run(out)
    assert [len(v) for v in read_passes(out / PASSES_FILE).values()] == [2, 2]
    # a third pass asked for: one more run of each co-run point, and the median of three
    assert "measured 2 points (9 already there)" in run(out, "--corun-passes", "3")
    rows = {r["id"]: r for r in read_points(out / "points.csv")}
    for pid, ps in read_passes(out / PASSES_FILE).items():
        assert [p["pass"] for p in ps] == ["1", "2", "3"]
        assert float(rows[pid]["gpu_s"]) == pytest.approx(float(np.median([float(p["gpu_s"]) for p in ps])), rel=1e-8)
    assert json.loads((out / "metadata.json").read_text())["corun_passes"] == 3


def test_decode_points_in_passes_alternate_their_order_and_keep_the_median(tmp_path):
    """--decode-passes 2 on the CPU, on a profile measured in one pass: its decode rows are pass 1, pass 2 runs over
    the solo decode points in the reverse order, points.csv holds the mean of the two (the median of two), the
    metadata the count; a rerun measures nothing and a torn pass only itself; co-run points stay out of it."""
    out = tmp_path / "prof"
    run(out)
    first = {r["id"]: r for r in read_points(out / "points.csv")}
    dec = [pid for pid, r in first.items() if r["kind"] == "decode" and not r["co_kind"]]
    assert len(dec) >= 2 and not (out / DECODE_PASSES_FILE).exists()
    assert f"measured {len(dec)} points" in run(out, "--decode-passes", "2")
    with (out / DECODE_PASSES_FILE).open(newline="") as f:
        lines = list(csv.DictReader(f))
    one, two = ([r["id"] for r in lines if r["pass"] == k] for k in ("1", "2"))
    assert one == dec and two == dec[::-1]  # pass 1: the old rows in grid order; pass 2 reversed
    rows = {r["id"]: r for r in read_points(out / "points.csv")}
    for r in lines[:len(dec)]:
        assert float(r["first_s"]) == pytest.approx(float(first[r["id"]]["first_s"]), rel=1e-8)
    for pid in dec:
        for col in ("first_s", "step_s", "gpu_s"):
            a, b = (float(r[col]) for r in lines if r["id"] == pid)
            assert float(rows[pid][col]) == pytest.approx((a + b) / 2, rel=1e-8), (pid, col)
        assert int(rows[pid]["reps"]) == 2 * int(first[pid]["reps"])
    assert all(rows[pid] == first[pid] for pid in first if pid not in dec)  # the rest untouched
    assert json.loads((out / "metadata.json").read_text())["decode_passes"] == 2
    assert "measured 0 points" in run(out)  # the profile keeps its count
    text = (out / DECODE_PASSES_FILE).read_text().splitlines(keepends=True)
    (out / DECODE_PASSES_FILE).write_text("".join(text[:-1]) + text[-1][:20])
    assert "measured 1 points" in run(out)
    assert all(len(v) == 2 for v in read_passes(out / DECODE_PASSES_FILE).values())


def test_a_run_stopped_inside_a_pass_leaves_points_csv_the_median_of_the_passes_measured(tmp_path, monkeypatch):
    """A run stopped inside a pass (a device call's time limit): points.csv already holds every pass measured, each
    co-run point's row the median of its passes so far, a point new to the grid included (before, the medians were
    written only at the end: the shipped H200 profile kept its first pass's rows and lacked 18 new points)."""
    out = tmp_path / "prof"
    real, calls = Profiler.measure, []

    def stops_at_the_second_co_run(self, pt):
        if pt.co is not None:
            calls.append(pt.id)
            if len(calls) == 2:
                raise RuntimeError("time limit")
        return real(self, pt)

    monkeypatch.setattr(Profiler, "measure", stops_at_the_second_co_run)
    res = CliRunner().invoke(app, ["profile", "--device", "cpu", "--model", "tiny-llama", "--out", str(out),
                                   "--corun-passes", "2"])
    assert isinstance(res.exception, RuntimeError)
    rows = {r["id"]: r for r in read_points(out / "points.csv")}
    assert calls[0] in rows and calls[1] not in rows  # the co-run point measured has its row, pass 1 alone
    assert rows[calls[0]]["gpu_s"] == read_passes(out / PASSES_FILE)[calls[0]][0]["gpu_s"]
    monkeypatch.setattr(Profiler, "measure", real)
    run(out, "--corun-passes", "2")  # finished
    calls.clear()
    monkeypatch.setattr(Profiler, "measure", stops_at_the_second_co_run)
    res = CliRunner().invoke(app, ["profile", "--device", "cpu", "--model", "tiny-llama", "--out", str(out),
                                   "--corun-passes", "3"])
    assert isinstance(res.exception, RuntimeError)
    rows, passes = {r["id"]: r for r in read_points(out / "points.csv")}, read_passes(out / PASSES_FILE)
    assert [len(passes[pid]) for pid in calls] == [3, 2]
    for pid in calls:  # the median of 3 where the third pass was measured, of 2 where the run stopped
        med = float(np.median([float(p["gpu_s"]) for p in passes[pid]]))
        assert float(rows[pid]["gpu_s"]) == pytest.approx(med, rel=1e-8), pid
        assert int(rows[pid]["reps"]) == sum(int(p["reps"]) for p in passes[pid])


def twin_of(pid: str) -> str:
    return pid.split(" || ")[0]


def test_a_one_pass_profile_resumed_in_passes_keeps_its_rows_as_the_first(tmp_path):
    """A profile measured in one pass, resumed with --corun-passes 2: its co-run rows become pass 1 as they are,
    one more pass is measured for each co-run point and nothing else, and the points stay where they were."""
    out = tmp_path / "prof"
    run(out)
    first = read_points(out / "points.csv")
    co = {r["id"]: r for r in first if r["co_kind"]}
    assert f"measured {len(co)} points ({len(first) - len(co)} already there)" in run(out, "--corun-passes", "2")
    passes = read_passes(out / PASSES_FILE)
    assert set(passes) == set(co)
    for pid, r in co.items():
        assert {k: passes[pid][0][k] for k in COLUMNS} == r and passes[pid][0]["pass"] == "1"
    after = read_points(out / "points.csv")
    assert [r["id"] for r in after] == [r["id"] for r in first]
    assert [r for r in after if not r["co_kind"]] == [r for r in first if not r["co_kind"]]
