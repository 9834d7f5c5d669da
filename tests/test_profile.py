"""`bullet profile --device cpu` on the tiny model: the same code path as on a GPU, end to end, writing a
profile that can be resumed."""

import csv
import json

import pytest

pytest.importorskip("torch")

from typer.testing import CliRunner

from bullet.cli import app
from bullet.config import GPUS, MODELS, gpu_short_name
from bullet.gpu.profile import COLUMNS, grid, read_gaps, read_points, sampled_mixed


def run(out):
    res = CliRunner().invoke(app, ["profile", "--device", "cpu", "--model", "tiny-llama", "--out", str(out)])
    assert res.exit_code == 0, res.output
    return res.output


def test_profile_on_the_cpu_writes_every_point_and_resumes(tmp_path):
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


@pytest.mark.parametrize("quick", [True, False])
def test_every_gpu_grid_point_is_a_legal_launch(quick):
    """The H200 grids (quick and full, random launches and co-runs included): each point's partition is on the
    nested menu (prefill sizes on the prefill lane, decode sizes on the decode lane, the whole GPU on 'all'),
    a co-run pair leaves the two lanes disjoint (p + d <= 132), every chunk fits the model's positions and every
    layer slice its layers, and the random points are the same on every call (seeded)."""
    gpu, spec = GPUS["h200"], MODELS["llama-3.1-8b"]
    menu = {"prefill": set(gpu.prefill_sizes), "decode": set(gpu.decode_sizes), "all": {gpu.num_sms}}
    pts = grid(spec, (gpu.prefill_sizes, gpu.decode_sizes), quick, kv_tokens=800_000)
    assert [p.id for p in pts] == [p.id for p in grid(spec, (gpu.prefill_sizes, gpu.decode_sizes), quick,
                                                        kv_tokens=800_000)]
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
