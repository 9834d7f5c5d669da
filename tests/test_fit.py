"""The fitted latency model: `bullet fit` recovers known coefficients, its JSON round-trips to identical
predictions, it refuses another GPU or model, a damaged profile is named by file, line and field, and on the
real H200 profile it predicts points it was not fitted on."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sklearn")

from typer.testing import CliRunner

from bullet.cli import app
from bullet.config import GPUS, MODELS, ConfigError
from bullet.perfmodel import FittedModel, ModelMismatch, Work
from bullet.perfmodel.fit import (
    COLUMNS,
    co_work_of_row,
    decode_mid,
    end_sizes,
    evaluate,
    failures,
    fit_model,
    fit_profile,
    folds,
    load_profile,
    pass_spread,
    predictions,
    read_gemm,
    work_of_row,
    write_model,
)
from bullet.perfmodel.fitted import DEFAULT_KERNELS, Quantities

ROOT = Path(__file__).resolve().parents[1]
H200_PROFILE = ROOT / "profiles/h200/llama-3.1-8b"
LLAMA = MODELS["llama-3.1-8b"]
runner = CliRunner()

# A small, well-identified term set with known coefficients (the truth the synthetic profile is made from).
TRUE = {
    "decode_step": [(("weights", "k64"), 0.25), (("weights", "full"), 0.05), (("weights_gemv", "k48"), 0.3),
                    (("kv", "k48"), 0.4), (("longest", "one"), 0.002), (("launch", "one"), 0.5)],
    "decode_first": [(("weights", "k64"), 0.26), (("weights_gemv", "k48"), 0.32), (("kv", "k48"), 0.41),
                     (("rows", "one"), 0.004), (("launch", "one"), 0.9)],
    "eager": [(("gemm_flops", "k64"), 1.6e-3), (("gemm_flops", "full"), 2.0e-4), (("attn", "k132"), 2.5e-3),
              (("prefix_attn", "k96"), 9e-3), (("weights", "k32"), 0.02), (("weights", "part"), 0.01),
              (("eager_tokens", "k64"), 0.4), (("layers", "one"), 0.1)],
    "host": [(("layers", "one"), 0.3), (("tokens", "one"), 0.5), (("launch", "one"), 1.0)],
    "co_eager": [(("co_bw", "one"), 0.05), (("co_sm_share", "one"), 0.2), (("own_bw_co_bw", "one"), 0.03)],
    "co_decode": [(("co_bw", "one"), 0.02), (("co_sm_share", "one"), 0.3), (("sm_bw_co_sm", "one"), 0.05)],
}
TERMS = {fam: [t for t, _ in v] for fam, v in TRUE.items()}


def truth_model() -> FittedModel:
    fams = {fam: {"terms": [list(t) for t, _ in v], "coef": [c for _, c in v]} for fam, v in TRUE.items()}
    spec = {k: getattr(LLAMA, k) for k in ("name", "num_layers", "hidden_size", "num_heads", "num_kv_heads",
                                          "head_dim", "intermediate_size", "vocab_size", "dtype_bytes", "tp",
                                          "qkv_bias", "qk_norm")}
    # the profile's prefill-graph limits: graphed launches pay no host time and compute their bucket's rows
    graphs = json.loads((H200_PROFILE / "metadata.json").read_text()).get("prefill_graphs")
    data = {"format": "bullet-fitted-latency", "version": 1, "model_spec": spec,
            "gpu": {"name": "h200", "num_sms": 132}, "families": fams, "prefill_graphs": graphs}
    return FittedModel(data, host=True)


def synthetic_profile(folder: Path, fm: FittedModel | None = None) -> Path:
    """The real profile's shapes with times made by the truth model (host below GPU time on purpose)."""
    folder.mkdir(parents=True)
    shutil.copy(H200_PROFILE / "metadata.json", folder / "metadata.json")
    fm = fm or truth_model()
    with (H200_PROFILE / "points.csv").open() as f:
        rows = list(csv.DictReader(f))
    real = load_profile(H200_PROFILE).rows
    for raw, r in zip(rows, real):
        n, w = r["sms"], work_of_row(r)
        if r["kind"] == "decode":
            steps = r["steps"]
            first = fm.decode_steps(w, 1, n)[0]
            if r["co_kind"]:
                step = float(fm.decode_steps(decode_mid(w, 2.0 * (steps / 2 + 1)), 2, n, co_work_of_row(r),
                                             r["co_sms"])[1])
            else:
                step = fm.f["decode_step"].scalar(fm.q.decode(decode_mid(w, steps), n), n)  # the mean step
            raw.update(first_s=first, step_s=step, gpu_s=first + (steps - 1) * step)
        else:
            gpu = fm.gpu_time(w, n)
            if r["co_kind"]:  # (the slowed prefill's own HBM demand and FLOP rate: from its stand-alone time)
                gpu = fm.eager_next_to(w, gpu, n, co_work_of_row(r), r["co_sms"])
                raw["overlap"] = 1.0
            host = fm.host_time(w) or gpu / 20  # a graph replay's host time: small, and not fitted
            raw.update(gpu_s=gpu, first_s=gpu, step_s=gpu, host_s=min(host, gpu / 2))
    with (folder / "points.csv").open("w", newline="") as f:
        out = csv.DictWriter(f, fieldnames=COLUMNS)
        out.writeheader()
        out.writerows(rows)
    return folder


@pytest.fixture(scope="module")
def real():
    return load_profile(H200_PROFILE)


@pytest.fixture(scope="module")
def real_model(real, tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "model.json"
    model = fit_model(real, real.rows)
    model.update(fitted="test", profile={}, errors={})
    write_model(model, path)
    return path


def test_columns_agree_with_the_profiler():
    from bullet.gpu.profile import COLUMNS as PROFILE_COLUMNS

    assert COLUMNS == PROFILE_COLUMNS


# ---------------------------------------------------------------- recovering known coefficients
def test_fitting_a_synthetic_profile_recovers_the_coefficients(tmp_path):
    prof = load_profile(synthetic_profile(tmp_path / "synthetic"))
    model = fit_model(prof, prof.rows, TERMS)
    for fam, truth in TRUE.items():
        got = model["families"][fam]["coef"]
        assert got == pytest.approx([c for _, c in truth], rel=1e-4, abs=1e-9), fam
    # and so predicts what the truth does on shapes it never saw
    fm, truth = FittedModel(model), truth_model()
    rng = np.random.default_rng(1)
    for _ in range(50):
        n = int(rng.integers(8, 133))
        t, s = int(rng.integers(2, 9000)), int(rng.integers(0, 9000))
        pre = Work(32, t, 1, t * s + t * (t + 1) / 2, t + s, 1, True, t + s)
        b = int(rng.integers(1, 257))
        dec = Work(32, b, b, float(b * 900), b * 900, b, True, 900)
        assert fm.predict(pre, n) == pytest.approx(truth.predict(pre, n), rel=1e-6)
        assert fm.predict(dec, n) == pytest.approx(truth.predict(dec, n), rel=1e-6)
        if n < 120:
            assert fm.predict(pre, n, dec, 132 - n) == pytest.approx(truth.predict(pre, n, dec, 132 - n), rel=1e-6)


def test_one_term_by_hand():
    """A model of one term gives that term's formula: 0.4 x L x kv x kv_bytes x 1e-9 x N / min(n, 48)."""
    fm = truth_model()
    w = Work(32, 64, 64, 64 * 1000.0, 64 * 1000, 64, True, 1000)
    q = Quantities(LLAMA, 132, fm.kernels)
    kv_bytes = 2 * 8 * 128 * 2
    assert q.decode(w, 20)["kv"] == pytest.approx(32 * 64000 * kv_bytes * 1e-9)
    one = {"terms": [["kv", "k48"]], "coef": [0.4]}
    zero = {"terms": [["launch", "one"]], "coef": [0.0]}
    fams = {fam: zero for fam in TRUE}
    fams["decode_first"] = one
    fm1 = FittedModel({**fm.data, "families": fams})
    for n in (8, 20, 48, 100, 132):
        assert fm1.predict(w, n) == pytest.approx(0.4 * 32 * 64000 * kv_bytes * 1e-9 * 132 / min(n, 48), rel=1e-12)


def test_part_and_eager_tokens_terms_by_hand():
    """``part`` is 1 on a green context and 0 on the whole GPU; ``eager_tokens`` counts only launches no
    prefill graph serves (the profile's limits: <= 512 tokens and <= 64 chunks)."""
    fm = truth_model()
    zero = {"terms": [["launch", "one"]], "coef": [0.0]}
    fams = {fam: zero for fam in TRUE}
    fams["eager"] = {"terms": [["tokens", "part"], ["eager_tokens", "one"]], "coef": [2.0, 3.0]}
    fm1 = FittedModel({**fm.data, "families": fams}, host=False)
    big = Work(32, 1000, 1, 1000 * 1001 / 2, 1000, 1, True, 1000)  # eager: 1000 tokens
    small = Work(32, 256, 1, 256 * 257 / 2, 256, 1, True, 256)  # graphed: its bucket is 256 rows
    for n in (20, 64, 124):
        assert fm1.predict(big, n) == pytest.approx((2.0 + 3.0) * 32 * 1000 * 1e-6, rel=1e-12)
        assert fm1.predict(small, n) == pytest.approx(2.0 * 32 * 256 * 1e-6, rel=1e-12)
    assert fm1.predict(big, 132) == pytest.approx(3.0 * 32 * 1000 * 1e-6, rel=1e-12)
    assert fm1.predict(small, 132) == 0.0


def test_ramp_basis_by_hand():
    """``r<first>_<knot>_<next>``: first/n below the smallest measured size, 1 up to the knot, linear in 1/n
    down to 0 at the next size, 0 beyond and on the whole GPU; without a next size, 1 up to the whole GPU."""
    from bullet.perfmodel.fitted import basis_table

    r = basis_table("r20_36_52", 132)
    assert r[10] == pytest.approx(2.0) and r[20] == 1.0 and r[28] == 1.0 and r[36] == 1.0
    assert r[44] == pytest.approx(9 / 22, rel=1e-12)  # (1/44 - 1/52) / (1/36 - 1/52) = (1/286) / (1/117)
    assert r[52] == 0.0 and r[100] == 0.0 and r[132] == 0.0
    top = basis_table("r20_116_0", 132)
    assert top[5] == pytest.approx(4.0) and top[116] == 1.0 and top[131] == 1.0 and top[132] == 0.0
    for bad in ("r36_20_52", "r20_36_36", "r20_36_140"):
        with pytest.raises(ValueError, match="knots must rise"):
            basis_table(bad, 132)


def test_grid_basis_by_hand():
    """``grid``: the rounds a grid of 132 blocks, one a SM, takes on n SMs: ceil(132 / n)."""
    from bullet.perfmodel.fitted import basis_table

    g = basis_table("grid", 132)
    assert [g[n] for n in (1, 20, 36, 43, 44, 52, 65, 66, 68, 116, 131, 132)] == [132, 7, 4, 4, 3, 3, 3, 2, 2, 2, 2, 1]


def test_grid_term_by_hand():
    """0.5 x gemm_flops x grid: 0.5 x L t x 2 (h (q + 2 kv) + q h + 2 f h + f h) x 1e-12 / 132 x ceil(132 / n), with
    Llama-3.1-8B's h = q = 4096, kv = 1024, f = 14336 (one token, one layer: 436,207,616 FLOPs)."""
    fm = truth_model()
    zero = {"terms": [["launch", "one"]], "coef": [0.0]}
    fams = {fam: zero for fam in TRUE}
    fams["eager"] = {"terms": [["gemm_flops", "grid"]], "coef": [0.5]}
    fm1 = FittedModel({**fm.data, "version": 6, "families": fams}, host=False)
    w = Work(32, 1000, 1, 1000 * 1001 / 2, 1000, 1, True, 1000)  # eager: no graph pads it
    flops = 32 * 1000 * 436_207_616 * 1e-12 / 132
    for n, rounds in ((20, 7), (52, 3), (68, 2), (116, 2), (132, 1)):
        assert fm1.predict(w, n) == pytest.approx(0.5 * flops * rounds, rel=1e-12)


def test_fitting_recovers_the_grid_coefficient(tmp_path):
    """A synthetic profile whose eager launches also take 4e-4 x gemm_flops x grid: the fit recovers it and the
    truth's other coefficients; the default terms have it where the profile measured partitions."""
    truth = {**TRUE, "eager": [*TRUE["eager"], (("gemm_flops", "grid"), 4e-4)]}
    fams = {fam: {"terms": [list(t) for t, _ in v], "coef": [c for _, c in v]} for fam, v in truth.items()}
    fm = FittedModel({**truth_model().data, "version": 6, "families": fams})
    prof = load_profile(synthetic_profile(tmp_path / "synthetic", fm))
    model = fit_model(prof, prof.rows, {fam: [t for t, _ in v] for fam, v in truth.items()})
    assert model["families"]["eager"]["coef"] == pytest.approx([c for _, c in truth["eager"]], rel=1e-4, abs=1e-9)
    assert ["gemm_flops", "grid"] in fit_model(prof, prof.rows)["families"]["eager"]["terms"]


def test_ramp_terms_by_hand():
    """A model of two ramp terms: 2 x tokens x r20_36_52 + 3 x tokens x r20_52_0 (tokens = L t 1e-6; a
    1000-token launch is eager, no prefill graph pads it)."""
    fm = truth_model()
    zero = {"terms": [["launch", "one"]], "coef": [0.0]}
    fams = {fam: zero for fam in TRUE}
    fams["eager"] = {"terms": [["tokens", "r20_36_52"], ["tokens", "r20_52_0"]], "coef": [2.0, 3.0]}
    fm1 = FittedModel({**fm.data, "version": 2, "families": fams}, host=False)
    w = Work(32, 1000, 1, 1000 * 1001 / 2, 1000, 1, True, 1000)
    tok = 32 * 1000 * 1e-6
    assert fm1.predict(w, 10) == pytest.approx((2.0 + 3.0) * 2.0 * tok, rel=1e-12)
    assert fm1.predict(w, 36) == pytest.approx((2.0 + 3.0) * tok, rel=1e-12)
    assert fm1.predict(w, 44) == pytest.approx((2.0 * 9 / 22 + 3.0) * tok, rel=1e-12)
    assert fm1.predict(w, 124) == pytest.approx(3.0 * tok, rel=1e-12)
    assert fm1.predict(w, 132) == 0.0


def test_eager_ramps_sit_on_the_measured_partition_sizes(real):
    """The eager family's ramps are the training rows' partition sizes: a fold without 52 SMs has no knot
    there (52 is interpolated between 36 and 68), and the fitted weight of every quantity falls with SMs."""
    from bullet.perfmodel.fit import ramp_bases

    assert ramp_bases([36, 20, 68, 36]) == ["r20_20_36", "r20_36_68", "r20_68_0"]
    rows = [r for r in real.rows if r["sms"] != 52]
    model = fit_model(real, rows)
    bases = {b for _, b in model["families"]["eager"]["terms"] if b.startswith("r")}
    sizes = sorted({r["sms"] for r in rows if not r["co_kind"] and r["kind"] != "decode"} - {real.num_sms})
    assert 52 not in sizes and bases == set(ramp_bases(sizes))
    below, above = max(s for s in sizes if s < 52), min(s for s in sizes if s > 52)
    assert f"r20_{below}_{above}" in bases  # (the shipped profile: 44 and 60)
    lin = FittedModel(model).f["eager"]
    for q, tab in zip(lin.quantities, lin.lists):
        assert np.all(np.diff(tab[1:132]) <= 0), q  # partitions 1..131; the whole GPU has its own terms


def test_other_model_versions(real_model):
    """Version 1 and 2 files (k<K> bases only; no victim contention terms) still load; an unknown version asks
    for a refit."""
    data = json.loads(real_model.read_text())
    assert data["version"] == 12
    FittedModel(truth_model().data)  # version 1
    FittedModel({**data, "version": 3, "gemm_table": None})  # version 3: no GEMM table
    shipped = json.loads((H200_PROFILE / "model.json").read_text())  # version 4 or 5: no power terms in version 4
    FittedModel.load(H200_PROFILE / "model.json", LLAMA, GPUS["h200"])
    if shipped["version"] == 4:
        assert "own_flops_co_sm" not in {q for q, _ in shipped["families"]["co_eager"]["terms"]}
    FittedModel({**data, "version": 5})  # version 5: the shipped files' (no grid basis)
    FittedModel({**data, "version": 6})  # version 6: no tensor-core co-runner term
    FittedModel({**data, "version": 7})  # version 7: no small_gemm_flops, no co_gemm_half (the shipped files')
    FittedModel({**data, "version": 8})  # version 8: no co_split_factor
    FittedModel({**data, "version": 9})  # version 9: no longest_extra
    FittedModel({**data, "version": 10})  # version 10: no attn_extra
    FittedModel({**data, "version": 11})  # version 11: no attn_tiles
    with pytest.raises(ConfigError,
                       match=r"version 13, this bullet reads versions 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12: refit"):
        FittedModel({**data, "version": 13})
    with pytest.raises(ConfigError, match="co_split_factor"):
        FittedModel({**data, "co_split_factor": {"36": 0.0}})


# ---------------------------------------------------------------- the JSON and the protocol
def test_json_round_trip_gives_identical_predictions(real, real_model):
    a = FittedModel(json.loads(real_model.read_text()))
    b = FittedModel.load(real_model, LLAMA, GPUS["h200"])
    menu = np.array([20, 28, 60, 92, 124, 132])
    for r in real.rows[::7]:
        w = work_of_row(r)
        assert a.predict(w, r["sms"]) == b.predict(w, r["sms"])
        assert np.array_equal(a.predict(w, menu), b.predict(w, menu))
        assert np.array_equal(a.decode_steps(w, 9, r["sms"]), b.decode_steps(w, 9, r["sms"]))


def test_array_path_equals_scalar_path(real_model):
    fm = FittedModel.load(real_model)
    menu = np.arange(8, 133, 4)
    dec = Work(32, 96, 96, 96 * 3000.0, 96 * 3000, 96, True, 3000)
    pre = Work(32, 3000, 2, 2e6, 5000, 2, True, 4000)
    for w in (dec, pre):
        arr = fm.predict(w, menu)
        assert arr.tolist() == [fm.predict(w, int(n)) for n in menu]
    co = fm.predict(pre, menu, dec, 132 - menu)
    assert co.tolist() == [fm.predict(pre, int(n), dec, 132 - int(n)) for n in menu]
    assert all(co >= fm.predict(pre, menu))  # a co-runner never speeds a launch up


def test_decode_steps_grow_with_context_and_first_step_differs(real_model):
    fm = FittedModel.load(real_model)
    w = Work(32, 64, 64, 64 * 2048.0, 64 * 2048, 64, True, 2048)
    steps = fm.decode_steps(w, 40, 68)
    assert steps[0] == fm.predict(w, 68)  # a one-step launch is the first step
    assert np.all(np.diff(steps[1:]) >= 0)  # later steps read more KV every step
    later = w._replace(kv_read=w.kv_read + 4 * 64, attn_pairs=w.attn_pairs + 4 * 64, max_kv=w.max_kv + 4)
    assert steps[5] == pytest.approx(fm.decode_steps(later, 2, 68)[1], rel=1e-12)  # step 5 = 4 steps later's 1


def test_host_time_switch(real_model):
    small = Work(32, 256, 1, 256 * 257 / 2, 256, 1, True, 256)
    with_host = FittedModel.load(real_model).predict(small, 132)
    without = FittedModel.load(real_model, host=False).predict(small, 132)
    fm = FittedModel.load(real_model)
    assert with_host == max(fm.host_time(small), fm.gpu_time(small, 132))
    assert without == fm.gpu_time(small, 132) <= with_host


def test_graphed_launches_have_no_host_term(real_model):
    """A model fitted on a profile that ran prefill graphs (its limits recorded) leaves the host term out of
    launches within the limits, and keeps it beyond them."""
    data = json.loads(Path(real_model).read_text())
    data["prefill_graphs"] = {"max_tokens": 512, "max_seqs": 64}
    fm, plain = FittedModel(data), FittedModel({**data, "prefill_graphs": None})
    small = Work(32, 256, 1, 256 * 257 / 2, 256, 1, True, 256)
    many = Work(32, 512, 65, 65 * 8 * 9 / 2, 520, 65, True, 8)  # 65 chunks: over max_seqs
    big = Work(32, 1024, 1, 1024 * 1025 / 2, 1024, 1, True, 1024)
    assert fm.graphed(small) and not fm.graphed(many) and not fm.graphed(big)
    assert fm.host_time(small) == 0.0 and fm.predict(small, 132) == fm.gpu_time(small, 132)
    assert plain.host_time(small) > 0.0 and plain.predict(small, 132) == max(plain.host_time(small),
                                                                            plain.gpu_time(small, 132))
    for w in (many, big):
        assert fm.host_time(w) == plain.host_time(w) > 0.0 and fm.predict(w, 132) == plain.predict(w, 132)


def test_another_gpu_or_model_is_refused_naming_both(real_model):
    with pytest.raises(ModelMismatch, match=r"h200.*h100"):
        FittedModel.load(real_model, LLAMA, GPUS["h100"])
    with pytest.raises(ModelMismatch, match=r"llama-3.1-8b.*qwen3-8b"):
        FittedModel.load(real_model, MODELS["qwen3-8b"], GPUS["h200"])


def test_core_predicts_without_scikit_learn(real_model):
    code = textwrap.dedent(f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('sklearn', 'scipy', 'torch'):
                    raise ImportError('blocked ' + name)
        sys.meta_path.insert(0, Block())
        from bullet.perfmodel import FittedModel, Work
        fm = FittedModel.load({str(real_model)!r})
        print(fm.predict(Work(32, 4096, 1, 4096 * 4097 / 2, 4096, 1, True, 4096), 92) > 0)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


# ---------------------------------------------------------------- damaged profiles
def copy_profile(tmp_path: Path) -> Path:
    folder = tmp_path / "prof"
    shutil.copytree(H200_PROFILE, folder, ignore=shutil.ignore_patterns("model.json"))
    return folder


def test_truncated_points_csv_names_file_line_and_field(tmp_path):
    folder = copy_profile(tmp_path)
    lines = (folder / "points.csv").read_text().splitlines(keepends=True)
    (folder / "points.csv").write_text("".join(lines[:-1]) + lines[-1][:60])
    with pytest.raises(ConfigError, match=rf"points.csv: line {len(lines)}: truncated .*field '\w+'"):
        load_profile(folder)


@pytest.mark.parametrize("column, value, message", [
    ("gpu_s", "fast", r"line 3, field 'gpu_s': not a number: 'fast'"),
    ("sms", "12.5", r"line 3, field 'sms': expected a count"),
    ("kind", "prefil", r"line 3, field 'kind': 'prefil' is not one of"),
    ("host_s", "-1", r"line 3, field 'host_s': must be > 0"),
])
def test_edited_points_csv_names_line_and_field(tmp_path, column, value, message):
    folder = copy_profile(tmp_path)
    path = folder / "points.csv"
    rows = list(csv.reader(path.read_text().splitlines()))
    rows[2][rows[0].index(column)] = value
    with path.open("w", newline="") as f:
        csv.writer(f).writerows(rows)
    with pytest.raises(ConfigError, match=r"points.csv: " + message):
        load_profile(folder)


def test_missing_or_extra_column_is_named(tmp_path):
    folder = copy_profile(tmp_path)
    path = folder / "points.csv"
    rows = list(csv.reader(path.read_text().splitlines()))
    i = rows[0].index("kv_read")
    with path.open("w", newline="") as f:
        csv.writer(f).writerows([r[:i] + r[i + 1:] for r in rows])
    with pytest.raises(ConfigError, match=r"points.csv: line 1: missing column\(s\) kv_read"):
        load_profile(folder)
    with path.open("w", newline="") as f:
        csv.writer(f).writerows([r + ["x"] for r in rows])
    with pytest.raises(ConfigError, match=r"unknown column\(s\) x"):
        load_profile(folder)


def test_edited_metadata_names_field(tmp_path):
    folder = copy_profile(tmp_path)
    path = folder / "metadata.json"
    meta = json.loads(path.read_text())
    meta["model_spec"]["hidden_size"] = "big"
    path.write_text(json.dumps(meta, indent=2))
    with pytest.raises(ConfigError, match=r"metadata.json: line \d+: field 'model_spec.hidden_size'"):
        load_profile(folder)
    del meta["num_sms"]
    meta["model_spec"]["hidden_size"] = 4096
    path.write_text(json.dumps(meta, indent=2))
    with pytest.raises(ConfigError, match=r"metadata.json: field 'num_sms' is missing"):
        load_profile(folder)
    path.write_text(path.read_text()[:200])
    with pytest.raises(ConfigError, match=r"metadata.json: line \d+: not valid JSON"):
        load_profile(folder)


# ---------------------------------------------------------------- accuracy on points not fitted on
def test_held_out_accuracy_on_the_h200_profile(real):
    """Points of each partition size predicted by a model fitted without that size, and a random 20 %
    predicted by a model fitted on the rest. Bounds: the issue's 5 % for whole launches; per family the
    figures this quick profile reaches (bench/RESULTS.md: the 2026-11-30 16:31 profile, measured with the
    one-call prefill attention and prefill graphs), which are above the issue's 3 %."""
    table = evaluate(real, seed=0)
    loso, rand = ({fam: s[split] for fam, s in table.items()} for split in ("loso", "random"))
    assert loso["launch"]["n"] == sum(1 for r in real.rows if r["sms"] != 132)
    assert loso["launch"]["mean"] < 0.05 and rand["launch"]["mean"] < 0.06
    assert loso["prefill"]["mean"] < 0.04 and rand["prefill"]["mean"] < 0.035  # ramps: 3.6 and 2.9 %
    for fam in ("decode step", "decode first"):
        assert loso[fam]["mean"] < 0.05 and rand[fam]["mean"] < 0.04, fam


def test_interior_loso_never_holds_out_an_end_size(real):
    """Interior loso holds out what loso does at each SM count, except a lane's smallest and largest size
    (on the shipped profile, measured on every menu size: prefill 20 and 124, decode 8 and 112), which it never
    holds out; the whole GPU is held out by neither."""
    ends = end_sizes(real.rows)
    assert ends == {"prefill": {20, 124}, "decode": {8, 112}}
    loso = {name: held for name, split, held in folds(real) if split == "loso"}
    interior = {name: held for name, split, held in folds(real) if split == "interior"}
    assert set(interior) == {f"{n} (interior)" for n in loso} - {f"{s} SMs (interior)" for s in (8, 20, 112, 124)}
    for name, held in interior.items():
        rows = [r for r, h in zip(real.rows, held) if h]
        assert rows and all(r["sms"] not in ends[r["lane"]] for r in rows), name
        assert held == loso[name.removesuffix(" (interior)")]  # (end sizes are the lanes' own on the H200 menu)
    table = evaluate(real, seed=0)
    n = {fam: s["interior"]["n"] for fam, s in table.items()}
    assert n["launch"] == sum(1 for r in real.rows if r["lane"] != "all" and r["sms"] not in ends[r["lane"]])


def test_the_gate_reads_the_random_and_interior_splits():
    """A family over 3 % only on plain loso (an end size held out) passes; over 3 % on interior loso or the
    random split, it fails, named with its split."""
    def table(rand, loso, interior):
        return {"prefill": {"random": {"n": 9, "mean": rand, "p95": 0.05}, "loso": {"n": 9, "mean": loso, "p95": 0.05},
                            "interior": {"n": 9, "mean": interior, "p95": 0.05}}}

    assert failures(table(0.02, 0.09, 0.025)) == []
    assert failures(table(0.02, 0.02, 0.031)) == ["prefill (interior): mean 3.1 % > 3 %"]
    assert failures(table(0.04, 0.02, 0.02)) == ["prefill (random): mean 4.0 % > 3 %"]


def test_a_profile_with_co_run_passes_fits_as_one_without(tmp_path, real):
    """corun_passes.csv is read only for the spread between passes: the same points.csv fits to identical
    coefficients with and without it (an old profile has none), and the spread is the hand figure: two passes
    at t and 1.04 t, (max - min) / median = 0.04 / 1.02, one pass's sd 0.04 t / sqrt(2) / 1.02 t."""
    folder = copy_profile(tmp_path)
    (folder / "corun_passes.csv").unlink(missing_ok=True)  # (the shipped profile's own: replaced by a hand-made one)
    plain = fit_model(real, real.rows)
    co = [r for r in csv.DictReader((folder / "points.csv").open()) if r["co_kind"]]
    with (folder / "corun_passes.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["pass", *co[0]])
        w.writeheader()
        for r in co:
            col = "step_s" if r["kind"] == "decode" else "gpu_s"
            w.writerow({"pass": 1, **r})
            w.writerow({"pass": 2, **r, col: repr(float(r[col]) * 1.04)})
    again = load_profile(folder)
    assert again.rows == real.rows
    assert json.dumps(fit_model(again, again.rows), sort_keys=True) == json.dumps(plain, sort_keys=True)
    model = fit_profile(folder)
    spread = model["profile"]["corun_passes"]
    assert spread["points"] == len(co) and spread["passes"] == 2
    assert spread["spread_mean"] == pytest.approx(0.04 / 1.02) and spread["pass_sd"] == pytest.approx(0.04 / 2**0.5 / 1.02)
    assert [c for fam in model["families"].values() for c in fam["coef"]] == \
        [c for fam in plain["families"].values() for c in fam["coef"]]
    # the median of t and 1.04 t is no row's time: every co-run row is a pass, not the median
    assert (spread["not_median"], spread["no_row"]) == (len(co), 0)


def test_the_fit_counts_co_run_rows_that_are_not_the_median_of_their_passes(tmp_path, real):
    """Rows that are the median of three passes (0.98 t, t, 1.05 t) count as such; a point with passes and no row
    (a passes run stopped before writing it) is counted, and one row changed away from its median too."""
    folder = copy_profile(tmp_path)
    co = [r for r in csv.DictReader((folder / "points.csv").open()) if r["co_kind"]]
    with (folder / "corun_passes.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["pass", *co[0]])
        w.writeheader()
        for r in co + [dict(co[0], id="a point with no row")]:
            col = "step_s" if r["kind"] == "decode" else "gpu_s"
            for k, x in enumerate((0.98, 1.0, 1.05), 1):
                w.writerow({"pass": k, **r, col: repr(float(r[col]) * x)})
    rows = load_profile(folder).rows
    spread = pass_spread(folder / "corun_passes.csv", rows)
    assert (spread["points"], spread["passes"], spread["not_median"], spread["no_row"]) == (len(co) + 1, 3, 0, 1)
    moved = [dict(r, gpu_s=r["gpu_s"] * 1.01) if r["id"] == co[0]["id"] else r for r in rows]
    assert pass_spread(folder / "corun_passes.csv", moved)["not_median"] == 1


def test_held_out_points_are_not_fitted_on(real):
    """The folds really hold points out: a model fitted without 52 SMs predicts them, and fitting with them
    changes those predictions (if the held-out rows leaked, both would be the same fit)."""
    held = [r for r in real.rows if r["sms"] == 52]
    without = FittedModel(fit_model(real, [r for r in real.rows if r["sms"] != 52]))
    with_ = FittedModel(fit_model(real, real.rows))
    a = [predictions(without, r)["launch"][0] for r in held]
    b = [predictions(with_, r)["launch"][0] for r in held]
    assert a != b


# ---------------------------------------------------------------- the commands
def test_fit_help():
    res = runner.invoke(app, ["fit", "--help"])
    assert res.exit_code == 0 and "PROFILE_DIR" in res.output and "--force" in res.output


def test_fit_command_writes_only_within_thresholds_or_forced(tmp_path):
    folder = copy_profile(tmp_path)
    out = tmp_path / "m.json"
    res = runner.invoke(app, ["fit", str(folder), "--out", str(out)], env={"COLUMNS": "80"})
    assert "held-out MAPE" in res.output and "launch" in res.output
    # the table fits an 80-column terminal: no cell cut short, no row wrapped
    assert "…" not in res.output and all(len(line) <= 80 for line in res.output.splitlines())
    if res.exit_code == 1:
        assert "not written" in res.output and not out.exists()
        res = runner.invoke(app, ["fit", str(folder), "--out", str(out), "--force"])
        assert res.exit_code == 0, res.output
        assert json.loads(out.read_text())["forced"] is True
    else:
        assert res.exit_code == 0 and json.loads(out.read_text())["forced"] is False
    model = json.loads(out.read_text())
    rows = len((folder / "points.csv").read_text().splitlines()) - 1  # counted from the file itself
    assert model["profile"]["points"] == rows and model["errors"]["held_out"]["launch"]["loso"]["n"] > 0


def test_fit_command_notes_co_runs_of_an_older_protocol(tmp_path):
    """The shipped Llama profile's co-run points were measured by the current protocol: no note. The same points
    under metadata without a protocol (profiles from before it was recorded) get a note naming the flag."""
    folder = copy_profile(tmp_path)
    res = runner.invoke(app, ["fit", str(folder), "--out", str(tmp_path / "a.json"), "--force"])
    assert res.exit_code == 0 and "--redo-coruns" not in res.output, res.output
    meta = json.loads((folder / "metadata.json").read_text())
    del meta["corun_protocol"]
    (folder / "metadata.json").write_text(json.dumps(meta))
    res = runner.invoke(app, ["fit", str(folder), "--out", str(tmp_path / "b.json"), "--force"])
    assert res.exit_code == 0 and "'single burst'" in res.output and "--redo-coruns" in res.output, res.output


def test_fit_command_bad_profile_exits_2(tmp_path):
    res = runner.invoke(app, ["fit", str(tmp_path / "nope")])
    assert res.exit_code == 2 and "not a profile folder" in res.output and "Traceback" not in res.output
    folder = copy_profile(tmp_path)
    (folder / "points.csv").write_text("id,kind\n")
    res = runner.invoke(app, ["fit", str(folder)])
    assert res.exit_code == 2 and "points.csv: line 1: missing column(s)" in res.output


def test_simulate_with_a_fitted_model_path(real_model):
    args = ["simulate", "--num-requests", "60", "--json", "--latency"]
    res = runner.invoke(app, [*args, str(real_model)])
    assert res.exit_code == 0, res.output
    fitted = json.loads(res.stdout[res.stdout.index("{"):])
    assert fitted["latency_model"].startswith("fitted: ") and fitted["latency_model"].endswith("model.json")
    assert fitted["requests"] == 60
    res = runner.invoke(app, [*args, "roofline"])
    roof = json.loads(res.stdout[res.stdout.index("{"):])
    assert roof["latency_model"] == "roofline"
    assert fitted["ttft_ms"]["mean"] != roof["ttft_ms"]["mean"]  # the model really was swapped
    res = runner.invoke(app, ["simulate", "--num-requests", "5", "--latency", str(real_model)])
    assert res.exit_code == 0 and "latency model" in res.output


def test_simulate_refuses_a_model_of_another_gpu(real_model):
    res = runner.invoke(app, ["simulate", "--num-requests", "5", "--gpu", "h100", "--latency", str(real_model)])
    assert res.exit_code == 2 and "h200" in res.output and "h100" in res.output
    assert "Traceback" not in res.output
    res = runner.invoke(app, ["simulate", "--num-requests", "5", "--model", "qwen2.5-7b", "--latency", "fitted"])
    assert res.exit_code == 2 and "no fitted model for qwen2.5-7b" in res.output


def test_both_shipped_profiles_load_for_their_model():
    """issue 9's shipped profiles: Llama-3.1-8B and Qwen3-8B on the H200 (Qwen3's q/k norm included)."""
    for name in ("llama-3.1-8b", "qwen3-8b"):
        res = runner.invoke(app, ["simulate", "--num-requests", "5", "--model", name, "--json"])
        assert res.exit_code == 0, res.output
        summary = json.loads(res.stdout[res.stdout.index("{"):])
        assert summary["latency_model"] == f"fitted: profiles/h200/{name}/model.json"


def test_short_decode_stretches_in_plain_floats_equal_the_numpy_path(real_model):
    """decode_step_ends (plain floats for up to SHORT_STRETCH steps) gives decode_steps and its cumsum to the bit,
    alone and next to a co-runner, on random batches."""
    fm = FittedModel.load(real_model, LLAMA, GPUS["h200"])
    rng = np.random.default_rng(7)
    for _ in range(300):
        b = int(rng.integers(1, 300))
        ctx = rng.integers(1, 9000, b)
        w = Work(32, b, b, float(ctx.sum()), int(ctx.sum()), b, True, int(ctx.max()))
        n, steps = int(rng.choice([8, 16, 40, 64, 112, 132])), int(rng.integers(1, 25))
        co, cs = None, 0
        if n < 132 and rng.random() < 0.5:
            t = int(rng.integers(100, 8000))
            co, cs = Work(8, t, 1, t * (t + 1) / 2, t, 1, True, t), 132 - n
        times, ends = fm.decode_step_ends(w, steps, n, co, cs)
        ref = fm.decode_steps(w, steps, n, co, cs)
        assert np.array_equal(np.asarray(times), ref) and np.array_equal(ends, ref.cumsum())


def test_a_scaled_model_is_the_card_factor_times_its_gpu_time(tmp_path):
    """``scaled(a, b)``: a launch with prompt rows takes ``a`` times the GPU time, a decode-only launch ``b``
    times (beside a co-runner too, to the slowdown's change); host time is not scaled; the
    factors compose, round-trip through the JSON file, and a bad one is named."""
    fm = FittedModel(truth_model().data, host=False)
    card = fm.scaled(0.9, 1.2, card="test")
    dec = Work(32, 64, 64, 64 * 2000.0, 64 * 2000, 64, True, 2000)
    pre = Work(32, 2048, 1, 2048 * 2049 / 2, 2048, 1, True, 2048)
    for n in (40, 92, 132):
        assert card.predict(pre, n) == pytest.approx(0.9 * fm.predict(pre, n), rel=1e-12)
        assert card.predict(dec, n) == pytest.approx(1.2 * fm.predict(dec, n), rel=1e-12)
        assert card.decode_steps(dec, 5, n) == pytest.approx(1.2 * fm.decode_steps(dec, 5, n), rel=1e-12)
    # beside a co-runner: the slowdown reads the co-runner's bandwidth from its (scaled) time, so the factor
    # holds to the slowdown's small change, not exactly
    assert card.predict(pre, 92, dec, 40) == pytest.approx(0.9 * fm.predict(pre, 92, dec, 40), rel=1e-4)
    assert card.host_time(pre) == fm.host_time(pre)
    assert "x0.900/1.200" in card.name and card.data["scale"]["card"] == "test"
    back = card.scaled(1 / 0.9, 1 / 1.2)
    assert back.predict(pre, 132) == pytest.approx(fm.predict(pre, 132), rel=1e-12)
    path = tmp_path / "card.json"
    path.write_text(json.dumps(card.data))
    again = FittedModel.load(path)
    assert again.predict(dec, 132) == card.predict(dec, 132) and again.scale == (0.9, 1.2)
    for bad, field in (({"prefill": 0, "decode": 1}, "scale.prefill"), ({"prefill": 1}, "scale.decode"),
                       ({"prefill": 1, "decode": "x"}, "scale.decode"), ([1, 2], "scale: not an object")):
        path.write_text(json.dumps({**fm.data, "scale": bad}))
        with pytest.raises(ConfigError, match=f"{path}.*{field}"):
            FittedModel.load(path)


# ---------------------------------------------------------------- the measured GEMM table (gemm.csv)
GEMM = {"sms": [8, 16, 32], "rows": [2, 64, 128],
        "layer_s": [[4e-4, 2.4e-4, 1.6e-4],    # 2 rows
                    [6e-4, 3.0e-4, 3.2e-4],    # 64 rows: measured slower on 32 SMs than on 16
                    [1.0e-3, 5.0e-4, 3.0e-4]]}  # 128 rows


def test_gemm_table_by_hand():
    """Rows: measured, linear between counts and past the largest; SMs: the running minimum over the table's
    counts (never slower with more SMs), linear in 1/n between them, 1/n below the smallest, flat above."""
    from bullet.perfmodel.fitted import GemmTable

    g = GemmTable.of(GEMM)
    assert g.at_rows(64) == [6e-4, 3.0e-4, 3.0e-4]  # 3.2e-4 on 32 SMs taken at 16 SMs' 3.0e-4
    # halfway between 64 and 128 rows, as measured (3.2e-4 on 32 SMs), then the running minimum (none binds)
    assert g.at_rows(96) == pytest.approx([8e-4, 4.0e-4, 3.1e-4], rel=1e-12)
    # 256 rows: 128's + the 64-to-128 slope x 2: 1.0 + 2 x 0.4 = 1.8; 0.5 + 2 x 0.2 = 0.9; on 32 SMs
    # 0.30 + 2 x (0.30 - 0.32) = 0.26, held at 128 rows' 0.30 (more rows never faster)
    assert g.at_rows(256) == pytest.approx([1.8e-3, 9.0e-4, 3.0e-4], rel=1e-12)
    col = g.column(128, 132)
    assert col[4] == pytest.approx(2e-3, rel=1e-12)  # 1/n below 8 SMs
    assert col[8] == 1.0e-3 and col[16] == 5.0e-4 and col[32] == 3.0e-4
    # 24 SMs: a = (1/24 - 1/32) / (1/16 - 1/32) = 1/3 -> 5e-4 / 3 + 3e-4 x 2/3
    assert col[24] == pytest.approx(5e-4 / 3 + 2e-4, rel=1e-12)
    assert col[100] == 3.0e-4 and col[132] == 3.0e-4
    assert all(a >= b for a, b in zip(g.column(64, 132)[1:], g.column(64, 132)[2:]))
    with pytest.raises(ValueError, match="positive time"):
        GemmTable.of({**GEMM, "layer_s": GEMM["layer_s"][:2]})


def test_gemm_table_term_by_hand():
    """One term, 0.9 x gemm_table: 0.9 x L x the table's seconds at the graph bucket's rows (a batch of 100 runs
    the 128-row bucket); a batch of one takes the GEMV path (no GEMM term); the array path gives the same."""
    fm = truth_model()
    zero = {"terms": [["launch", "one"]], "coef": [0.0]}
    fams = {fam: zero for fam in TRUE}
    fams["decode_first"] = {"terms": [["gemm_table", "one"]], "coef": [0.9]}
    fm1 = FittedModel({**fm.data, "version": 4, "families": fams, "gemm_table": GEMM})
    w = Work(32, 100, 100, 100 * 500.0, 100 * 500, 100, True, 500)
    assert fm1.predict(w, 16) == pytest.approx(0.9 * 32 * 5.0e-4, rel=1e-12)
    assert fm1.predict(w, 24) == pytest.approx(0.9 * 32 * (5e-4 / 3 + 2e-4), rel=1e-12)
    assert fm1.predict(Work(32, 1, 1, 500.0, 500, 1, True, 500), 16) == 0.0
    n = np.array([4, 8, 16, 24, 32, 132])
    assert fm1.predict(w, n).tolist() == [fm1.predict(w, int(k)) for k in n]
    assert FittedModel({**fm1.data, "gemm_table": None}).predict(w, 16) == 0.0  # no table: no term


def write_gemm_csv(path: Path, table: dict) -> None:
    """A gemm.csv whose taken kernels sum, per layer, to ``table``: qkv, o and down 10 % each, gate-up 70 %; the
    down product taken from the skinny column (the other kernel's time, 2x, is not the one summed)."""
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["sms", "rows", "product", "cublas_s", "skinny_s", "taken"])
        for i, r in enumerate(table["rows"]):
            for j, s in enumerate(table["sms"]):
                t = table["layer_s"][i][j]
                for p, share in (("qkv", 0.1), ("o", 0.1), ("gate_up", 0.7), ("down", 0.1)):
                    cub, sk = (share * t, 2 * share * t) if p != "down" else (2 * share * t, share * t)
                    out.writerow([s, r, p, repr(cub), repr(sk), "skinny" if p == "down" else "cublas"])


def test_fitting_recovers_the_gemm_table_coefficient(tmp_path):
    """A synthetic profile whose decode steps are 0.8 x gemm_table + the truth's other terms, with its gemm.csv:
    the fit reads the table (summing the taken kernels) and recovers every coefficient."""
    truth = {**TRUE, "decode_step": [*TRUE["decode_step"], (("gemm_table", "one"), 0.8)],
             "decode_first": [*TRUE["decode_first"], (("gemm_table", "one"), 0.7)]}
    table = {"sms": [8, 24, 40, 56, 72, 88, 104, 132], "rows": [2, 8, 32, 64, 128, 256],
             "layer_s": [[(1 + 0.01 * r) * 1e-3 * 8 / min(s, 60) * (1.05 if s == 104 else 1.0) for s in
                          [8, 24, 40, 56, 72, 88, 104, 132]] for r in [2, 8, 32, 64, 128, 256]]}
    fams = {fam: {"terms": [list(t) for t, _ in v], "coef": [c for _, c in v]} for fam, v in truth.items()}
    fm = FittedModel({**truth_model().data, "version": 4, "families": fams, "gemm_table": table})
    folder = synthetic_profile(tmp_path / "synthetic", fm)
    write_gemm_csv(folder / "gemm.csv", table)
    prof = load_profile(folder)
    assert np.asarray(prof.gemm["layer_s"]) == pytest.approx(np.asarray(table["layer_s"]), rel=1e-12)
    terms = {fam: [t for t, _ in v] for fam, v in truth.items()}
    model = fit_model(prof, prof.rows, terms)
    for fam in ("decode_step", "decode_first"):
        assert model["families"][fam]["coef"] == pytest.approx([c for _, c in truth[fam]], rel=1e-4, abs=1e-9)
    assert np.asarray(model["gemm_table"]["layer_s"]) == pytest.approx(np.asarray(table["layer_s"]), rel=1e-12)
    # the default terms take the table where the profile has one
    assert ["gemm_table", "one"] in fit_model(prof, prof.rows)["families"]["decode_step"]["terms"]


def test_power_terms_by_hand():
    """``own_flops_co_sm``: the prefill's own FLOP rate (its FLOPs over its stand-alone time, PFLOP/s) x the
    co-runner's SM share; ``co_gemm_co_sm``: the decode co-runner's GEMM-table seconds over its stand-alone step x
    its SM share (0 beside a one-row step, whose GEMV has no table term, and without a table). Array path = scalar."""
    fm = truth_model()
    fams = {fam: {"terms": [list(t) for t, _ in v], "coef": [c for _, c in v]} for fam, v in TRUE.items()}
    pre = Work(32, 3000, 1, 3000 * 3001 / 2, 3000, 1, True, 3000)
    dec = Work(32, 100, 100, 100 * 500.0, 100 * 500, 100, True, 500)
    one = Work(32, 1, 1, 500.0, 500, 1, True, 500)
    q = fm.q
    flops = 32 * (3000 * q.layer_flops_per_token + 3000 * 3001 / 2 * q.attn_flops_per_pair)
    fm1 = FittedModel({**fm.data, "version": 5, "gemm_table": GEMM,
                       "families": {**fams, "co_eager": {"terms": [["own_flops_co_sm", "one"]], "coef": [0.8]}}})
    alone = fm1.predict(pre, 100)
    assert fm1.predict(pre, 100, dec, 32) == pytest.approx(alone * (1 + 0.8 * flops / alone * 1e-15 * 32 / 132),
                                                           rel=1e-12)
    fm2 = FittedModel({**fm.data, "version": 5, "gemm_table": GEMM,
                       "families": {**fams, "co_eager": {"terms": [["co_gemm_co_sm", "one"]], "coef": [0.3]}}})
    alone, dec_alone = fm2.predict(pre, 100), fm2.predict(dec, 32)
    g = 32 * 3.0e-4 / dec_alone  # 100 rows take the 128-row bucket: 3.0e-4 s a layer on 32 SMs
    assert fm2.predict(pre, 100, dec, 32) == pytest.approx(alone * (1 + 0.3 * g * 32 / 132), rel=1e-12)
    assert fm2.predict(pre, 100, one, 32) == alone  # the GEMV path: no GEMM term
    assert FittedModel({**fm2.data, "gemm_table": None}).predict(pre, 100, dec, 32) == alone
    for m in (fm1, fm2):
        menu = np.array([20, 60, 92, 100, 124])
        assert m.predict(pre, menu, dec, 132 - menu).tolist() == [m.predict(pre, int(n), dec, 132 - int(n))
                                                                  for n in menu]


def test_tensor_core_co_runner_term_by_hand():
    """``co_tc_co_sm`` (format version 7): 1 beside a decode step of 2 rows or more (tensor-core GEMMs) x the
    co-runner's SM share; 0 beside a one-row step (the fused GEMV) or an eager launch. Array path = scalar."""
    fm = truth_model()
    fams = {fam: {"terms": [list(t) for t, _ in v], "coef": [c for _, c in v]} for fam, v in TRUE.items()}
    pre = Work(32, 3000, 1, 3000 * 3001 / 2, 3000, 1, True, 3000)
    two = Work(32, 2, 2, 2 * 500.0, 2 * 500, 2, True, 500)
    one = Work(32, 1, 1, 500.0, 500, 1, True, 500)
    fm1 = FittedModel({**fm.data, "version": 7,
                       "families": {**fams, "co_eager": {"terms": [["co_tc_co_sm", "one"]], "coef": [0.2]}}})
    alone = fm1.predict(pre, 100)
    assert fm1.predict(pre, 100, two, 32) == pytest.approx(alone * (1 + 0.2 * 32 / 132), rel=1e-12)
    assert fm1.predict(pre, 100, one, 32) == alone
    assert fm1.predict(pre, 100, pre, 32) == alone  # an eager co-runner has no decode GEMMs
    menu = np.array([20, 60, 92, 100, 124])
    for co in (one, two):
        assert fm1.predict(pre, menu, co, 132 - menu).tolist() == [fm1.predict(pre, int(n), co, 132 - int(n))
                                                                   for n in menu]


def test_fitting_recovers_the_tensor_core_term_without_a_gemm_table(tmp_path):
    """A synthetic profile without gemm.csv whose co-run prefills slow by known weights, the tensor-core term among
    them: the default terms take ``co_tc_co_sm`` in place of ``co_gemm_co_sm`` (0 without a table), and the fit
    recovers the weights."""
    truth = {**TRUE, "co_eager": [(("co_bw", "one"), 0.02), (("own_bw_co_bw", "one"), 0.03),
                                  (("own_flops_co_sm", "one"), 0.9), (("co_tc_co_sm", "one"), 0.2)]}
    fams = {fam: {"terms": [list(t) for t, _ in v], "coef": [c for _, c in v]} for fam, v in truth.items()}
    fm = FittedModel({**truth_model().data, "version": 7, "families": fams})
    prof = load_profile(synthetic_profile(tmp_path / "synthetic", fm))
    assert prof.gemm is None
    model = fit_model(prof, prof.rows, {fam: [t for t, _ in v] for fam, v in truth.items()})
    assert model["families"]["co_eager"]["coef"] == pytest.approx([c for _, c in truth["co_eager"]], rel=1e-4,
                                                                  abs=1e-9)
    terms = [tuple(t) for t in fit_model(prof, prof.rows)["families"]["co_eager"]["terms"]]
    assert ("co_tc_co_sm", "one") in terms and ("co_gemm_co_sm", "one") not in terms


def fit_with_gemm_table(tmp_path, gemm_term: str, version: int):
    """A synthetic profile with a GEMM table whose co-run prefills slow by known weights of ``gemm_term`` and three
    other co-run terms, fitted on those terms: the fit recovers the weights. Returns (profile, model)."""
    truth = {**TRUE, "co_eager": [(("co_bw", "one"), 0.02), (("own_bw_co_bw", "one"), 0.03),
                                  (("own_flops_co_sm", "one"), 0.9), ((gemm_term, "one"), 0.25)]}
    table = {"sms": [8, 24, 40, 56, 72, 88, 104, 132], "rows": [2, 8, 32, 64, 128, 256],
             "layer_s": [[(1 + 0.01 * r) * 1e-4 * 8 / min(s, 60) for s in [8, 24, 40, 56, 72, 88, 104, 132]]
                         for r in [2, 8, 32, 64, 128, 256]]}
    fams = {fam: {"terms": [list(t) for t, _ in v], "coef": [c for _, c in v]} for fam, v in truth.items()}
    fm = FittedModel({**truth_model().data, "version": version, "families": fams, "gemm_table": table})
    folder = synthetic_profile(tmp_path / "synthetic", fm)
    write_gemm_csv(folder / "gemm.csv", table)
    prof = load_profile(folder)
    model = fit_model(prof, prof.rows, {fam: [t for t, _ in v] for fam, v in truth.items()})
    assert model["families"]["co_eager"]["coef"] == pytest.approx([c for _, c in truth["co_eager"]], rel=1e-4,
                                                                  abs=1e-9)
    return prof, model


def test_fitting_recovers_the_power_terms(tmp_path, real):
    """A synthetic profile whose co-run prefills slow by known weights of the version-5 power terms (with a GEMM
    table, so that co_gemm_co_sm is not 0) beside the older ones: the fit (weighted to relative error) recovers
    them, and the model's JSON round-trips to identical co-run predictions, scalar and array."""
    prof, model = fit_with_gemm_table(tmp_path, "co_gemm_co_sm", 5)
    # the default terms carry them (with a table: its GEMM share, not the tensor-core indicator)
    terms = fit_model(prof, prof.rows)["families"]["co_eager"]["terms"]
    assert ["own_flops_co_sm", "one"] in terms and ["co_tc_co_sm", "one"] not in terms
    path = tmp_path / "model.json"
    write_model({**model, "fitted": "test", "profile": {}, "errors": {}}, path)
    a, b = FittedModel(model), FittedModel.load(path, LLAMA, GPUS["h200"])
    menu = np.array([20, 28, 60, 92, 124])
    for r in [r for r in real.rows if r["co_kind"] == "decode"][::3]:
        w, co = work_of_row(r), co_work_of_row(r)
        assert a.predict(w, r["sms"], co, r["co_sms"]) == b.predict(w, r["sms"], co, r["co_sms"]) \
            > b.predict(w, r["sms"])
        assert np.array_equal(a.predict(w, menu, co, 132 - menu), b.predict(w, menu, co, 132 - menu))


def test_a_cublas_only_gemm_csv_sums_the_cublas_times(tmp_path):
    """``bench/skinny_gemm.py --cublas-only`` writes no skinny time (an empty field) and takes cuBLAS everywhere:
    the table is the cuBLAS times summed per layer (by hand: 1 + 2 + 3 + 4 us at each cell), and a cell that says
    it takes the skinny kernel without a skinny time is refused with the field named."""
    path = tmp_path / "gemm.csv"
    lines = ["sms,rows,product,cublas_s,skinny_s,taken"]
    for sms in (8, 132):
        for rows in (2, 64):
            lines += [f"{sms},{rows},{p},{k}e-06,,cublas" for k, p in enumerate(("qkv", "o", "gate_up", "down"), 1)]
    path.write_text("\n".join(lines) + "\n")
    table = read_gemm(path, 132)
    assert table["sms"] == [8, 132] and table["rows"] == [2, 64]
    assert np.allclose(table["layer_s"], [[10e-6, 10e-6], [10e-6, 10e-6]], rtol=1e-12, atol=0)
    path.write_text("\n".join([lines[0], lines[1].replace("cublas", "skinny"), *lines[2:]]) + "\n")
    with pytest.raises(ConfigError, match=r"gemm.csv: line 2, field 'skinny_s': not a number"):
        read_gemm(path, 132)


@pytest.mark.parametrize("edit, message", [
    (lambda rows: rows[:-1], r"no down at 128 rows on 32 SMs"),
    (lambda rows: [*rows[:1], [*rows[1][:2], "lm_head", *rows[1][3:]], *rows[2:]], r"line 2, field 'product'"),
    (lambda rows: [*rows[:1], [*rows[1][:5], "cutlass"], *rows[2:]], r"line 2, field 'taken'"),
    (lambda rows: [*rows[:1], [*rows[1][:3], "fast", *rows[1][4:]], *rows[2:]], r"line 2, field 'cublas_s'"),
    (lambda rows: [*rows[:1], ["140", *rows[1][1:]], *rows[2:]], r"line 2, field 'sms': 140"),
])
def test_bad_gemm_csv_names_file_line_and_field(tmp_path, edit, message):
    folder = copy_profile(tmp_path)
    path = folder / "gemm.csv"
    write_gemm_csv(path, GEMM)
    rows = list(csv.reader(path.read_text().splitlines()))
    with path.open("w", newline="") as f:
        csv.writer(f).writerows(edit(rows))
    with pytest.raises(ConfigError, match=message) as e:
        load_profile(folder)
    assert "gemm.csv" in str(e.value)


# ---------------------------------------------------------------- format version 8
def test_small_gemm_flops_by_hand():
    """``small_gemm_flops``: the FLOPs of the layer GEMMs with fewer than 2 x 132 output tiles of 128 x 256. Llama-3.1-8B
    (h = q = 4096, kv = 1024, f = 14336): QKV 6144 x 4096 (24 column tiles), O 4096 x 4096 (16), gate-up 28672 x 4096
    (112), down 4096 x 14336 (16). 1,000 tokens (8 row tiles: 192, 128, 896, 128 tiles): QKV, O and down, 2 x
    (6144 x 4096 + 4096 x 4096 + 4096 x 14336) = 201,326,592 FLOPs a token; 2,048 (16 row tiles: 384, 256, 1792,
    256): O and down, 150,994,944; 8,192 (64): none. A one-term model, 0.5 x small_gemm_flops x grid."""
    fm = truth_model()
    zero = {"terms": [["launch", "one"]], "coef": [0.0]}
    fams = {fam: zero for fam in TRUE}
    fams["eager"] = {"terms": [["small_gemm_flops", "grid"]], "coef": [0.5]}
    fm1 = FittedModel({**fm.data, "version": 8, "families": fams}, host=False)
    for tokens, per_token in ((1000, 201_326_592), (2048, 150_994_944), (8192, 0)):
        w = Work(32, tokens, 1, tokens * (tokens + 1) / 2, tokens, 1, True, tokens)  # eager: no graph pads it
        for n, rounds in ((20, 7), (52, 3), (68, 2), (132, 1)):
            assert fm1.predict(w, n) == pytest.approx(0.5 * 32 * tokens * per_token * 1e-12 / 132 * rounds,
                                                      rel=1e-12, abs=1e-15)
        menu = np.array([20, 52, 68, 132])
        assert fm1.predict(w, menu).tolist() == [fm1.predict(w, int(n)) for n in menu]


def test_fitting_recovers_the_small_gemm_term(tmp_path):
    """A synthetic profile whose eager launches take 3e-4 x small_gemm_flops x grid beside 2e-4 x gemm_flops x grid
    and the truth's other terms: the fit recovers both, and the default terms (ramps) carry both grid terms."""
    truth = {**TRUE, "eager": [*TRUE["eager"], (("gemm_flops", "grid"), 2e-4), (("small_gemm_flops", "grid"), 3e-4)]}
    fams = {fam: {"terms": [list(t) for t, _ in v], "coef": [c for _, c in v]} for fam, v in truth.items()}
    fm = FittedModel({**truth_model().data, "version": 8, "families": fams})
    prof = load_profile(synthetic_profile(tmp_path / "synthetic", fm))
    model = fit_model(prof, prof.rows, {fam: [t for t, _ in v] for fam, v in truth.items()})
    assert model["families"]["eager"]["coef"] == pytest.approx([c for _, c in truth["eager"]], rel=1e-4, abs=1e-9)
    terms = fit_model(prof, prof.rows)["families"]["eager"]["terms"]
    assert ["small_gemm_flops", "grid"] in terms and ["gemm_flops", "grid"] in terms


def test_ramp_penalty_by_hand():
    """The curvature penalty's rows: sizes 20, 40, 80 (1/n = 0.05, 0.025, 0.0125); the weight at 40 less the line
    in 1/n through 20 and 80 (W_20 / 3 + 2 W_80 / 3), times the strength and the mean of (a row's ramp columns) / y
    (here 1). Per-size weights W = (3, 2, 1.5) lie on a line in 1/n (1 + 40 / n): 0; W = (3, 2.5, 1.5): 0.5."""
    from bullet.perfmodel.fit import ramp_penalty

    terms = [("tokens", "r20_20_40"), ("tokens", "r20_40_80"), ("tokens", "r20_80_0"), ("layers", "one")]
    X = np.array([[1.0, 2.0, 1.0, 5.0], [0.0, 1.0, 1.0, 7.0]])
    y = np.array([4.0, 2.0])
    P = ramp_penalty(terms, X, y, strength=2.0)
    assert P.shape == (1, 4)
    # W = (c1 + c2 + c3, c2 + c3, c3): W = (3, 2, 1.5) is c = (1, 0.5, 1.5); W = (3, 2.5, 1.5) is c = (0.5, 1, 1.5)
    assert (P @ [1.0, 0.5, 1.5, 9.0])[0] == pytest.approx(0.0, abs=1e-12)
    assert (P @ [0.5, 1.0, 1.5, 9.0])[0] == pytest.approx(2.0 * 0.5, rel=1e-12)
    assert ramp_penalty(terms[2:], X[:, 2:], y).shape == (0, 2)  # under 3 sizes: nothing to bend


def test_ramp_smoothing_keeps_a_truth_linear_in_one_over_n(tmp_path, real):
    """A synthetic profile whose eager launches are tokens x a per-size weight linear in 1/n (W(s) = 0.2 + 30 / s at
    the measured sizes, on ramps) plus layers: the penalty is 0 at the truth, so the fit with it still recovers the
    truth's coefficients."""
    sizes = sorted({r["sms"] for r in real.rows if not r["co_kind"] and r["kind"] != "decode"} - {132})
    from bullet.perfmodel.fit import ramp_bases

    bases = ramp_bases(sizes)
    W = [0.2 + 30.0 / s for s in sizes]
    c = [W[i] - (W[i + 1] if i + 1 < len(W) else 0.0) for i in range(len(W))]
    eager = [(("tokens", b), x) for b, x in zip(bases, c)] + [(("tokens", "full"), 0.3), (("layers", "one"), 0.1)]
    truth = {**TRUE, "eager": eager}
    fams = {fam: {"terms": [list(t) for t, _ in v], "coef": [x for _, x in v]} for fam, v in truth.items()}
    fm = FittedModel({**truth_model().data, "version": 8, "families": fams})
    prof = load_profile(synthetic_profile(tmp_path / "synthetic", fm))
    model = fit_model(prof, prof.rows, {fam: [t for t, _ in v] for fam, v in truth.items()})
    assert model["families"]["eager"]["coef"] == pytest.approx([x for _, x in eager], rel=1e-4, abs=1e-9)


def test_gemm_half_term_by_hand():
    """``co_gemm_half``: the decode co-runner's GEMM-table seconds over its stand-alone step (as ``co_gemm_co_sm``) x
    min(its SMs, 66) / 132: 32 SMs count 32, 100 count 66. 0 beside a one-row step and without a table. Array path =
    scalar."""
    fm = truth_model()
    fams = {fam: {"terms": [list(t) for t, _ in v], "coef": [c for _, c in v]} for fam, v in TRUE.items()}
    pre = Work(32, 3000, 1, 3000 * 3001 / 2, 3000, 1, True, 3000)
    dec = Work(32, 100, 100, 100 * 500.0, 100 * 500, 100, True, 500)
    one = Work(32, 1, 1, 500.0, 500, 1, True, 500)
    fm1 = FittedModel({**fm.data, "version": 8, "gemm_table": GEMM,
                       "families": {**fams, "co_eager": {"terms": [["co_gemm_half", "one"]], "coef": [0.3]}}})
    for n, m, counted in ((100, 32, 32), (32, 100, 66)):
        alone, dec_alone = fm1.predict(pre, n), fm1.predict(dec, m)
        g = 32 * 3.0e-4 / dec_alone  # 100 rows take the 128-row bucket: 3.0e-4 s a layer on 32 SMs and more
        assert fm1.predict(pre, n, dec, m) == pytest.approx(alone * (1 + 0.3 * g * counted / 132), rel=1e-12)
        assert fm1.predict(pre, n, one, m) == alone  # the GEMV path: no GEMM term
    assert FittedModel({**fm1.data, "gemm_table": None}).predict(pre, 100, dec, 32) == fm1.predict(pre, 100)
    menu = np.array([20, 60, 92, 100, 124])
    assert fm1.predict(pre, menu, dec, 132 - menu).tolist() == [fm1.predict(pre, int(n), dec, 132 - int(n))
                                                                for n in menu]


def test_fitting_recovers_the_gemm_half_term(tmp_path):
    """A synthetic profile with a GEMM table whose co-run prefills slow by known weights, ``co_gemm_half`` among them:
    the fit recovers them, and the default terms with a table take ``co_gemm_half`` and no term linear in the
    co-runner's SMs (``co_sm_share``, ``co_gemm_co_sm``)."""
    prof, _ = fit_with_gemm_table(tmp_path, "co_gemm_half", 8)
    terms = fit_model(prof, prof.rows)["families"]["co_eager"]["terms"]
    assert ["co_gemm_half", "one"] in terms
    assert ["co_sm_share", "one"] not in terms and ["co_gemm_co_sm", "one"] not in terms


# ---------------------------------------------------------------- per-split co-run factor (version 9)
def test_shrunk_means_by_hand():
    """Empirical Bayes by hand. Groups (0.3, 0.1) and (-0.3, -0.1): means +-0.2, within variance (4 x 0.01) / 2 =
    0.02, tau^2 = 0.04 - 0.02 / 2 = 0.03, share 2 x 0.03 / (0.06 + 0.02) = 0.75: +-0.15. Groups (0.2, 0) and
    (-0.2, 0): means +-0.1, sigma^2 0.02, tau^2 = max(0, 0.01 - 0.01) = 0: no shift. No scatter within groups: the
    means as they are."""
    from bullet.perfmodel.fit import shrunk_means

    got = shrunk_means({36: [0.3, 0.1], 44: [-0.3, -0.1]})
    assert got[36] == pytest.approx(0.15) and got[44] == pytest.approx(-0.15)
    assert shrunk_means({36: [0.2, 0.0], 44: [-0.2, 0.0]}) == {36: 0.0, 44: 0.0}
    got = shrunk_means({36: [0.1, 0.1], 44: [-0.05], 68: [0.0, 0.0, 0.0]})
    assert got == pytest.approx({36: 0.1, 44: -0.05, 68: 0.0})


def test_a_split_factor_multiplies_the_co_run_time_on_its_size_only(real_model):
    """co_split_factor {36: 1.25}: a prefill on 36 SMs next to decode takes 1.25x the version-8 time (scalar and
    array paths alike); on other sizes, and alone, nothing changes."""
    data = json.loads(real_model.read_text())
    plain = FittedModel({**data, "co_split_factor": {}})
    scaled = FittedModel({**data, "co_split_factor": {"36": 1.25}})
    pre = Work(32, 2048, 1, 2048 * 2049 / 2, 2048, 1, True, 2048)
    dec = Work(32, 8, 8, 8 * 2048.0, 8 * 2048, 8, True, 2048)
    assert scaled.predict(pre, 36, dec, 96) == pytest.approx(1.25 * plain.predict(pre, 36, dec, 96), rel=1e-12)
    assert scaled.predict(pre, 44, dec, 88) == plain.predict(pre, 44, dec, 88)
    assert scaled.predict(pre, 36) == plain.predict(pre, 36)
    sms = np.array([36, 44, 68])
    assert scaled.predict(pre, sms, dec, 132 - sms) == pytest.approx(
        plain.predict(pre, sms, dec, 132 - sms) * np.array([1.25, 1.0, 1.0]), rel=1e-12)


def test_fitting_learns_a_split_factor_where_the_smooth_slowdown_misses(tmp_path):
    """The synthetic truth (exactly recoverable terms) with the co-run prefills on 36 SMs at 1.1x the smooth
    slowdown's time (every point exact). Without the factors the fit misses those points by several % (the
    smooth terms spread part of the offset over every size); with them they are within 1 %, 36 SMs' factor stands
    over every other size's by more than 5 %, and the co-run prefill points of the other sizes are predicted no
    worse (their factors undo what the smooth terms took from the offset)."""
    base = truth_model()
    truth = FittedModel({**base.data, "version": 9, "co_split_factor": {"36": 1.1}}, host=True)
    prof = load_profile(synthetic_profile(tmp_path / "synthetic", truth))
    model = fit_model(prof, prof.rows, TERMS)
    got = {int(k): v for k, v in model["co_split_factor"].items()}
    assert all(got[36] > v * 1.05 for k, v in got.items() if k != 36)
    with_f, without = FittedModel(model), FittedModel({**model, "co_split_factor": {}})

    def mape(fm, at36):
        errs = [abs(p / m - 1) for r in prof.rows if r["co_kind"] and r["kind"] != "decode" and (r["sms"] == 36) == at36
                for p, m in [predictions(fm, r)["co-run prefill"]]]
        return float(np.mean(errs))

    assert mape(without, True) > 0.03 and mape(with_f, True) < 0.01
    assert mape(with_f, False) <= mape(without, False) + 1e-9


def test_longest_extra_is_the_longest_program_beyond_its_even_share():
    """Format version 10's ``longest_extra``, by hand for one 8,192-token row beside 255 of 512 (bucket 256: one
    attention slice, 1024 target programs / (256 rows x 8 KV heads) rounded up): the longest program reads 8,192
    tokens; all programs read 8 x (8192 + 255 x 512) = 1,110,016, over 32 x 4 slots 8,672 each (past the longest:
    0), over 104 x 4 slots 2,668.3 each (8192 - 1110016 / 416 = 5523.69 beyond it). Quantities are per layer in
    thousands of tokens, times 32 layers."""
    q = Quantities(LLAMA, 132, dict(DEFAULT_KERNELS))
    kv = 8192 + 255 * 512
    w = Work(32, 256, 256, float(kv), kv, 256, True, 8192)
    assert q.decode(w, 32)["longest_extra"] == 0.0
    assert q.decode(w, 104)["longest_extra"] == pytest.approx(32 * (8192 - 1110016 / 416) * 1e-3, rel=1e-12)
    assert q.decode(w, 104)["longest"] == pytest.approx(32 * 8.192, rel=1e-12)
    # on an array of SM counts, element by element the same
    got = q.decode(w, np.array([32, 104]))["longest_extra"]
    assert got[0] == 0.0 and got[1] == q.decode(w, 104)["longest_extra"]


def test_decode_passes_spread_reads_the_first_step_and_checks_solo_decode_rows(tmp_path, real):
    """decode_passes.csv (``bullet profile --decode-passes``): the spread of the column asked for (first_s: passes at
    0.97 t and 1.03 t of a row's first step, (max - min) / median 6 %), checked against the solo decode rows (their
    first step is the median of the two passes: none off), not the co-run rows."""
    folder = copy_profile(tmp_path)
    dec = [r for r in csv.DictReader((folder / "points.csv").open()) if r["kind"] == "decode" and not r["co_kind"]]
    with (folder / "decode_passes.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["pass", *dec[0]])
        w.writeheader()
        for r in dec[:10]:
            for k, x in enumerate((0.97, 1.03), 1):
                w.writerow({"pass": k, **r, "first_s": repr(float(r["first_s"]) * x)})
    spread = pass_spread(folder / "decode_passes.csv", load_profile(folder).rows, "first_s", solo=True)
    assert (spread["points"], spread["passes"], spread["not_median"], spread["no_row"]) == (10, 2, 0, 0)
    assert spread["spread_mean"] == pytest.approx(0.06)
    # step_s is the same in both passes: no spread
    assert pass_spread(folder / "decode_passes.csv", load_profile(folder).rows, solo=True)["spread_mean"] == 0.0


def test_attn_extra_is_a_single_chunks_longest_prefill_program_beyond_its_even_share():
    """Format version 11's ``attn_extra``, by hand: 256 new tokens after an 8,192-token prefix on Llama-3.1-8B (32 q
    heads over 8 KV heads: 4 a KV head, 128 / 4 = 32 new tokens a program, so 8 tiles x 8 KV heads = 64 programs).
    Query-key pairs 256 x 8192 + 256 x 257 / 2 = 2,130,048; all programs read 8 x 2130048 / 32 = 532,512 keys, over 36
    SMs x 1 slot 14,792 each (more than the longest program's 8,448 keys: 0), over 116 SMs 4,590.6 each (8448 -
    532512 / 116 = 3857.4 beyond it). Per layer in thousands of keys, times 32 layers. A launch of two chunks, or a
    mixed one, has none."""
    q = Quantities(LLAMA, 132, dict(DEFAULT_KERNELS))
    pairs = 256 * 8192 + 256 * 257 / 2
    w = Work(32, 256, 1, pairs, 8192 + 256, 1, True, 8192 + 256)
    assert q.eager(w, 36)["attn_extra"] == 0.0
    assert q.eager(w, 116)["attn_extra"] == pytest.approx(32 * (8448 - 8 * pairs / 32 / 116) * 1e-3, rel=1e-12)
    assert q.eager(w, 116)["attn_extra"] == pytest.approx(32 * 3.85741, rel=1e-5)
    got = q.eager(w, np.array([36, 116]))["attn_extra"]
    assert got[0] == 0.0 and got[1] == q.eager(w, 116)["attn_extra"]
    two = Work(32, 512, 2, 2 * pairs, 2 * (8192 + 256), 2, True, 8192 + 256)
    assert q.eager(two, 116)["attn_extra"] == 0.0


def test_attn_tiles_counts_the_attention_flops_the_tile_kernel_runs():
    """Format version 12's ``attn_tiles``, by hand (Llama-3.1-8B: 32 q heads x 128 dims, 4 FLOPs a pair and dim:
    16,384 FLOPs a query-key pair per layer): ``attention`` hands a lone fresh prompt of 2,048 tokens or more to SDPA
    (0) and runs every other multi-token launch in the tile kernel (its attention FLOPs, as ``attn``): a 2,047-token
    prompt, a chunk after a cached prefix, two prompts, a prompt beside decode rows."""
    q = Quantities(LLAMA, 132, dict(DEFAULT_KERNELS))

    def flops(pairs):  # per launch, in TFLOP over the GPU's 132 SMs, 32 layers
        return 32 * pairs * 16384 * 1e-12 / 132

    lone = Work(32, 4096, 1, 4096 * 4097 / 2, 4096, 1, True, 4096)
    assert q.eager(lone, 64)["attn_tiles"] == 0.0 and q.eager(lone, 64)["attn"] == pytest.approx(flops(lone.attn_pairs))
    short = Work(32, 2047, 1, 2047 * 2048 / 2, 2047, 1, True, 2047)
    prefix = Work(32, 256, 1, 256 * 8192 + 256 * 257 / 2, 8448, 1, True, 8448)
    two = Work(32, 4096, 2, 2 * 2048 * 2049 / 2, 4096, 2, True, 2048)
    mixed = Work(32, 4112, 17, 4096 * 4097 / 2 + 16 * 1025, 4096 + 16 * 1025, 17, True, 4096)
    for w in (short, prefix, two, mixed):
        assert q.eager(w, 64)["attn_tiles"] == pytest.approx(flops(w.attn_pairs), rel=1e-12)
        assert q.eager(w, 64)["attn_tiles"] == q.eager(w, 64)["attn"]
    assert q.eager(short, 64)["attn_tiles"] == pytest.approx(32 * 2096128 * 16384e-12 / 132, rel=1e-12)
    assert Quantities(LLAMA, 132, {**DEFAULT_KERNELS, "sdpa_from": 1 << 30}).eager(lone, 64)["attn_tiles"] > 0.0
