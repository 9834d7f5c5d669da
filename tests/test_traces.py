"""Trace loading, synthetic arrivals, the bundled traces and ``bullet trace``."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
import typer
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from bullet.cli_trace import trace_app
from bullet.request import Request
from bullet.traces import (
    BUILTIN_TRACES,
    TraceError,
    _Clock,
    arrivals,
    load_trace,
    read_table,
    resolve_trace,
    save_trace,
    synthesize,
    trace_stats,
    traces_dir,
)

REPO = Path(__file__).resolve().parents[1]
RAW = Path(__file__).resolve().parents[2] / "shared/traces/raw"
CONV = RAW / "AzureLLMInferenceTrace_conv.csv"
CODE = RAW / "AzureLLMInferenceTrace_code.csv"
SPLIT_CONV = RAW / "splitwise_conv.csv"
SPLIT_CODE = RAW / "splitwise_code.csv"
SHAREGPT = RAW / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"
ARXIV = RAW / "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv"
MOONCAKE = RAW / "mooncake_synthetic_trace.jsonl"

needs_raw = pytest.mark.skipif(not CONV.is_file(), reason=f"public traces not found in {RAW}")


def write(tmp_path: Path, text: str, name: str = "trace.csv") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def cli() -> typer.Typer:
    app = typer.Typer()
    app.add_typer(trace_app, name="trace")
    return app


# ------------------------------------------------------------------------------------ the public files


@needs_raw
@pytest.mark.parametrize(("path", "fmt", "count", "span"), [
    (CONV, "azure", 19_366, 3501.72),
    (CODE, "azure", 8_819, 3435.95),
    (SPLIT_CONV, "vidur", 19_366, 3501.72),
    (SPLIT_CODE, "vidur", 8_819, 3435.95),
    (MOONCAKE, "mooncake", 3_993, 1022.03),
])
def test_timed_public_traces(path, fmt, count, span):
    table = read_table(path)
    assert table.format == fmt and len(table) == count
    reqs = load_trace(path)
    assert len(reqs) == count
    assert [r.id for r in reqs[:3]] == [0, 1, 2] and reqs[0].arrival == 0.0
    s = trace_stats(reqs, block_size=512)  # the Mooncake replay at 16-token blocks takes seconds
    assert s["count"] == count
    assert s["span_s"] == pytest.approx(span, abs=0.01)
    assert all(a.arrival <= b.arrival for a, b in itertools.pairwise(reqs))
    if fmt == "mooncake":  # every row names its 512-token blocks
        assert all(len(r.hash_ids) == -(-r.prompt_len // 512) and r.hash_block == 512 for r in reqs)
        assert 0.0 < s["prefix_hit_rate_ideal"] < 1.0
    else:
        assert table.hash_ids is None and all(r.hash_ids is None for r in reqs)
        assert s["prefix_hit_rate_ideal"] is None


@needs_raw
def test_azure_timestamps_and_statistics_match_sources():
    reqs = load_trace(CONV)
    # 18:15:46.6805900 -> 18:15:50.9951690: 7 fractional digits kept.
    assert reqs[1].arrival == pytest.approx(4.314579, abs=1e-9)
    s = trace_stats(reqs)
    assert s["rate"] == pytest.approx(5.53, abs=0.01)
    assert s["interarrival_cv"] == pytest.approx(1.09, abs=0.01)
    assert (round(s["input_mean"]), s["input_p50"], s["input_p99"]) == (1155, 1020, 4142)
    assert (round(s["output_mean"]), s["output_p50"], s["output_p99"]) == (211, 129, 601)
    assert trace_stats(load_trace(CODE))["interarrival_cv"] == pytest.approx(13.15, abs=0.01)


@needs_raw
@pytest.mark.parametrize(("azure", "vidur"), [(CONV, SPLIT_CONV), (CODE, SPLIT_CODE)])
def test_azure_and_splitwise_copies_agree(azure, vidur):
    a, v = read_table(azure), read_table(vidur)
    np.testing.assert_array_equal(a.prompt_lens, v.prompt_lens)
    np.testing.assert_array_equal(a.output_lens, v.output_lens)
    np.testing.assert_allclose(a.arrivals, v.arrivals, atol=1e-6)


@needs_raw
@pytest.mark.parametrize(("path", "count", "max_total"), [(SHAREGPT, 30_731, 8192), (ARXIV, 28_257, 4096)])
def test_length_only_public_traces(path, count, max_total):
    table = read_table(path)
    assert table.format == "lengths" and table.arrivals is None and len(table) == count
    assert table.hash_ids is None and trace_stats(table)["prefix_hit_rate_ideal"] is None
    assert int((table.prompt_lens + table.output_lens).max()) <= max_total
    with pytest.raises(TraceError, match="rate"):
        load_trace(path)
    reqs = load_trace(path, rate=10.0, seed=3)
    assert len(reqs) == count
    assert trace_stats(reqs)["rate"] == pytest.approx(10.0, rel=0.03)
    np.testing.assert_array_equal([r.prompt_len for r in reqs], table.prompt_lens)


@needs_raw
def test_rate_rescaling_keeps_the_burst_shape():
    base = load_trace(SPLIT_CODE, num_requests=2000)
    fast = load_trace(SPLIT_CODE, num_requests=2000, rate=20.0)
    assert trace_stats(fast)["rate"] == pytest.approx(20.0, rel=1e-12)
    t0 = np.array([r.arrival for r in base])
    t1 = np.array([r.arrival for r in fast])
    np.testing.assert_allclose(t1, t0 * (t1[-1] / t0[-1]), rtol=1e-12, atol=1e-12)
    assert trace_stats(fast)["interarrival_cv"] == pytest.approx(trace_stats(base)["interarrival_cv"])


# ------------------------------------------------------------------------------------ formats and options


def test_mooncake_jsonl(tmp_path):
    rows = [
        {"timestamp": 5000, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]},
        {"timestamp": 2000, "input_length": 200, "output_length": 20, "hash_ids": [1]},
        {"timestamp": 2500, "input_length": 300, "output_length": 30},
    ]
    path = write(tmp_path, "\n".join(json.dumps(r) for r in rows) + "\n\n", "trace.jsonl")
    assert read_table(path).format == "mooncake"
    reqs = load_trace(path)
    assert [(r.id, r.arrival, r.prompt_len, r.max_new_tokens, r.hash_ids) for r in reqs] == [
        (0, 0.0, 200, 20, (1,)), (1, 0.5, 300, 30, None), (2, 3.0, 600, 10, (1, 2))]


def test_vidur_extra_columns_reordered_and_unsorted(tmp_path):
    path = write(tmp_path, "\ufeffnum_decode_tokens,extra,arrived_at,num_prefill_tokens\n"
                           "5,x,2.5,50\n7,y,1.0,70\n9,z,1.0,90\n\n")
    reqs = load_trace(path)
    assert [(r.arrival, r.prompt_len, r.max_new_tokens) for r in reqs] == [
        (0.0, 70, 7), (0.0, 90, 9), (1.5, 50, 5)]  # stable sort, rebased to the first arrival


def test_azure_timestamps_cross_midnight_and_iso_forms(tmp_path):
    path = write(tmp_path, "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                           "2023-11-16 23:59:59.9000000,1,1\n"
                           "2023-11-17 00:00:00.1000000,2,2\n"
                           "2023-11-17T00:00:01,3,3\n"
                           "2023-11-17 01:00:01.5+01:00,4,4\n")
    times = [r.arrival for r in load_trace(path)]
    assert times == pytest.approx([0.0, 0.2, 1.1, 1.6])


def test_fixed_width_timestamps_cross_midnight_and_bad_dates(tmp_path):
    path = write(tmp_path, HEADER + "2023-11-16 23:59:59.9000000,1,1\n2023-11-17 00:00:00.1000000,2,2\n")
    assert [r.arrival for r in load_trace(path)] == pytest.approx([0.0, 0.2])
    path = write(tmp_path, HEADER + ROW + "2023-02-30 18:15:46.6805900,1,1\n")
    with pytest.raises(TraceError) as e:
        load_trace(path)
    assert (e.value.line, e.value.field) == (3, "TIMESTAMP")


@settings(max_examples=30, deadline=None)
@given(st.lists(st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2099, 12, 31)),
                min_size=1, max_size=30), st.integers(0, 9_999_999))
def test_fast_and_general_timestamp_parsers_agree(tmp_path_factory, stamps, tick):
    lines = [f"{s:%Y-%m-%d %H:%M:%S}.{(s.microsecond * 10 + tick) % 10**7:07d},1,1" for s in sorted(stamps)]
    path = tmp_path_factory.mktemp("ts") / "t.csv"
    path.write_text(HEADER + "\n".join(lines) + "\n")
    fast = read_table(path).arrivals
    clock = _Clock()
    general = np.array([clock.seconds(line.split(",")[0], "t", 0, "f") for line in lines])
    np.testing.assert_allclose(fast, general - general.min(), rtol=0, atol=1e-6)


def test_format_can_be_forced(tmp_path):
    path = write(tmp_path, "arrived_at,num_prefill_tokens,num_decode_tokens\n0,10,1\n3,20,2\n")
    reqs = load_trace(path, format="lengths", rate=1.0, arrival_process="constant")
    assert [r.arrival for r in reqs] == [0.0, 1.0]
    with pytest.raises(TraceError) as e:
        load_trace(path, format="azure")
    assert (e.value.line, e.value.field) == (1, "TIMESTAMP")


def test_start_num_requests_time_scale(tmp_path):
    path = write(tmp_path, "arrived_at,num_prefill_tokens,num_decode_tokens\n"
                 + "".join(f"{i * 2},{i + 1},1\n" for i in range(10)))
    reqs = load_trace(path, start=3, num_requests=4, time_scale=0.5)
    assert [(r.id, r.arrival, r.prompt_len) for r in reqs] == [(0, 0.0, 4), (1, 1.0, 5), (2, 2.0, 6), (3, 3.0, 7)]
    with pytest.raises(TraceError, match="not both"):
        load_trace(path, rate=1.0, time_scale=2.0)
    with pytest.raises(TraceError, match="trace has 10"):
        load_trace(path, start=5, num_requests=6)
    with pytest.raises(TraceError, match="trace has 10"):
        load_trace(path, start=10)


# ------------------------------------------------------------------------------------ malformed input

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
ROW = "2023-11-16 18:15:46.6805900,374,44\n"


@pytest.mark.parametrize(("text", "line", "field", "words"), [
    (HEADER + ROW * 15 + "2023-11-16 18:15:47.0,abc,3\n", 17, "ContextTokens",
     "expected a positive integer, got 'abc'"),
    (HEADER + ROW + "2023-11-16 18:15:47.0,5,-3\n", 3, "GeneratedTokens", "got '-3'"),
    (HEADER + ROW + "2023-11-16 18:15:47.0,0,3\n", 3, "ContextTokens", "got '0'"),
    (HEADER + ROW + "2023-11-16 18:15:47.0,1.5,3\n", 3, "ContextTokens", "got '1.5'"),
    (HEADER + ROW + "yesterday,5,3\n", 3, "TIMESTAMP", "expected a timestamp"),
    (HEADER + ROW + "2023-11-16 18:15:47.0,5\n", 3, "GeneratedTokens", "missing value"),
    ("TIMESTAMP,ContextTokens\n" + ROW, 1, "GeneratedTokens", "missing column"),
    ("arrived_at,num_prefill_tokens,num_decode_tokens\n0,1,1\nnan,1,1\n", 3, "arrived_at", "non-negative"),
    ("arrived_at,num_prefill_tokens,num_decode_tokens\n0,1,1\n-1,1,1\n", 3, "arrived_at", "non-negative"),
    ("", 1, None, "empty file"),
    ("\n\n", 1, None, "empty file"),
    (HEADER, 2, None, "no requests"),
    ("time,in,out\n1,2,3\n", 1, None, "unknown trace header"),
    ('{"timestamp": 1, "input_length": 2, "output_length": 3}\n{"timestamp": 2, "input_length": 2,\n',
     2, None, "invalid JSON"),
    ('{"timestamp": 1, "input_length": 2, "output_length": 3}\n\n{"timestamp": 2, "input_length": 2}\n',
     3, "output_length", "missing"),
    (('{"timestamp": 1, "input_length": 2, "output_length": 3}\n{"timestamp": 2, "input_length": 0, '
     '"output_length": 3}\n'), 2, "input_length", "positive integer"),
    ('{"timestamp": "x", "input_length": 2, "output_length": 3}\n', 1, "timestamp", "milliseconds"),
    ("[1, 2]\n", 1, None, "unknown trace header"),
])
def test_malformed_inputs_name_line_and_field(tmp_path, text, line, field, words):
    path = write(tmp_path, text)
    with pytest.raises(TraceError) as e:
        load_trace(path)
    err = e.value
    assert (err.path, err.line, err.field) == (str(path), line, field)
    message = str(err)
    assert message.startswith(f"{path}:{line}: ")
    assert words in message
    if field is not None:
        assert f"field {field!r}" in message


def test_error_message_format(tmp_path):
    path = write(tmp_path, HEADER + ROW * 15 + "2023-11-16 18:15:47.0,abc,3\n")
    with pytest.raises(TraceError) as e:
        load_trace(path)
    assert str(e.value) == f"{path}:17: field 'ContextTokens': expected a positive integer, got 'abc'"


def test_missing_file_and_unknown_names(tmp_path):
    with pytest.raises(TraceError, match="sharegpt, azure-code, azure-conv, arxiv"):
        resolve_trace("no-such-trace")
    with pytest.raises(TraceError, match="no such trace file"):
        load_trace(tmp_path / "absent.csv")
    with pytest.raises(TraceError, match="not a regular file"):
        load_trace(tmp_path)
    with pytest.raises(TraceError, match="unknown format"):
        load_trace(write(tmp_path, HEADER + ROW), format="parquet")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------ synthetic arrivals


def test_arrivals_processes():
    a = arrivals(1000, 4.0, "poisson", seed=7)
    assert a[0] == 0.0 and np.all(np.diff(a) >= 0)
    np.testing.assert_array_equal(a, arrivals(1000, 4.0, "poisson", seed=7))
    np.testing.assert_array_equal(a, arrivals(1000, 4.0, "gamma", cv=1.0, seed=7))  # poisson == gamma, cv 1
    assert not np.array_equal(a, arrivals(1000, 4.0, "poisson", seed=8))
    np.testing.assert_allclose(arrivals(5, 2.0, "constant"), [0.0, 0.5, 1.0, 1.5, 2.0])
    assert len(arrivals(0, 1.0)) == 0 and arrivals(1, 1.0).tolist() == [0.0]


@pytest.mark.parametrize("cv", [0.5, 1.0, 3.0])
def test_gamma_arrivals_have_requested_cv_and_rate(cv):
    for seed in range(3):
        gaps = np.diff(arrivals(200_001, 5.0, "gamma", cv=cv, seed=seed))
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)
        assert 1.0 / gaps.mean() == pytest.approx(5.0, rel=0.03)


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"n": 10, "rate": 0.0}, "rate"),
    ({"n": 10, "rate": float("inf")}, "rate"),
    ({"n": -1, "rate": 1.0}, "non-negative integer"),
    ({"n": 10, "rate": 1.0, "process": "weibull"}, "unknown arrival process"),
    ({"n": 10, "rate": 1.0, "process": "gamma", "cv": 0.0}, "cv"),
    ({"n": 10, "rate": 1.0, "process": "poisson", "cv": 2.0}, "only to gamma"),
])
def test_arrival_options_are_checked(kwargs, words):
    with pytest.raises(TraceError, match=words):
        arrivals(**kwargs)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 300), rate=st.floats(0.01, 1000.0), cv=st.floats(0.1, 8.0),
       process=st.sampled_from(["poisson", "gamma", "constant"]), seed=st.integers(0, 2**32 - 1))
def test_arrivals_properties(n, rate, cv, process, seed):
    cv = cv if process == "gamma" else 1.0
    a = arrivals(n, rate, process, cv, seed)
    assert a.shape == (n,) and a.dtype == np.float64
    assert np.all(np.isfinite(a)) and np.all(np.diff(a) >= 0)
    if n:
        assert a[0] == 0.0
    np.testing.assert_array_equal(a, arrivals(n, rate, process, cv, seed))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1e5), st.integers(1, 10**6), st.integers(1, 10**5)),
                min_size=1, max_size=40))
def test_save_load_round_trip(tmp_path_factory, rows):
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    reqs = [Request(i, t - t0, p, o) for i, (t, p, o) in enumerate(rows)]
    path = tmp_path_factory.mktemp("rt") / "t.csv"
    save_trace(reqs, path)
    back = load_trace(path)
    assert [(r.prompt_len, r.max_new_tokens) for r in back] == [(r.prompt_len, r.max_new_tokens) for r in reqs]
    np.testing.assert_allclose([r.arrival for r in back], [r.arrival for r in reqs], atol=2e-6)


def test_synthesize_lengths():
    reqs = synthesize(4000, 2.0, seed=5, input_mean=1000, input_cv=0.5, output_mean=100, output_cv=0.0,
                      max_total=1500)
    p = np.array([r.prompt_len for r in reqs])
    o = np.array([r.max_new_tokens for r in reqs])
    assert np.all(o == 100) and np.all(p + o <= 1500) and np.all(p >= 1)
    # Redrawing above the cap truncates the lognormal at 1400: mean 1000 * Phi(z - s) / Phi(z) = 824.
    assert p.mean() == pytest.approx(824, rel=0.03)
    free = np.array([r.prompt_len for r in synthesize(20_000, 2.0, seed=1, input_mean=1000, input_cv=0.5)])
    assert free.mean() == pytest.approx(1000, rel=0.02)
    assert free.std() / free.mean() == pytest.approx(0.5, rel=0.05)
    again = synthesize(4000, 2.0, seed=5, input_mean=1000, input_cv=0.5, output_mean=100, output_cv=0.0,
                       max_total=1500)
    assert [r.prompt_len for r in again] == p.tolist()


# ------------------------------------------------------------------------------------ bundled traces


@pytest.mark.parametrize("name", list(BUILTIN_TRACES))
def test_bundled_traces(name):
    assert resolve_trace(name) == traces_dir() / BUILTIN_TRACES[name]
    assert traces_dir() == REPO / "traces"
    reqs = load_trace(name)
    s = trace_stats(reqs)
    assert s["count"] == 3000
    total = max(r.prompt_len + r.max_new_tokens for r in reqs)
    assert total <= {"sharegpt": 8192, "arxiv": 4096}.get(name, 10**9)
    if name == "azure-code":
        assert s["rate"] == pytest.approx(10.0) and s["interarrival_cv"] > 5  # bursty
    else:
        assert s["interarrival_cv"] == pytest.approx(1.0, abs=0.1)  # Poisson


def test_traces_module_needs_no_cli_or_dataframe_libraries():
    code = ("import sys; import bullet.traces; "
            "bad = [m for m in ('typer', 'rich', 'pandas', 'torch') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# ------------------------------------------------------------------------------------ CLI


def test_cli_stats(tmp_path):
    path = write(tmp_path, "arrived_at,num_prefill_tokens,num_decode_tokens\n"
                 + "".join(f"{i * 0.5},{100 + i},{10 + i}\n" for i in range(37)))
    result = CliRunner().invoke(cli(), ["trace", "stats", str(path)])
    assert result.exit_code == 0, result.output
    assert "37" in result.output and "vidur" in result.output and "2.000" in result.output
    result = CliRunner().invoke(cli(), ["trace", "stats", str(path), "--json"])
    assert result.exit_code == 0
    s = json.loads(result.output)
    assert (s["count"], s["format"], s["span_s"], s["rate"], s["input_max"]) == (37, "vidur", 18.0, 2.0, 136)


def test_cli_errors_exit_2_without_traceback(tmp_path):
    path = write(tmp_path, HEADER + ROW + "2023-11-16 18:15:47.0,abc,3\n")
    result = CliRunner().invoke(cli(), ["trace", "stats", str(path)])
    assert result.exit_code == 2
    assert ":3: field 'ContextTokens'" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(cli(), ["trace", "generate", str(tmp_path / "o.csv"), "--rate", "1",
                                        "--lengths-from", "arxiv", "--input-mean", "3"])
    assert result.exit_code == 2 and "--input-mean" in result.output
    assert not (tmp_path / "o.csv").exists()


def test_cli_generate_round_trip(tmp_path):
    out = tmp_path / "gen.csv"
    args = ["trace", "generate", str(out), "-n", "500", "--rate", "4", "--arrival", "gamma", "--cv", "2",
            "--seed", "11", "--input-mean", "800", "--output-mean", "64", "--max-total", "2048"]
    result = CliRunner().invoke(cli(), args)
    assert result.exit_code == 0, result.output
    reqs = load_trace(out)
    expected = synthesize(500, 4.0, arrival_process="gamma", cv=2.0, seed=11, input_mean=800,
                          output_mean=64, max_total=2048)
    assert [(r.prompt_len, r.max_new_tokens) for r in reqs] == [(r.prompt_len, r.max_new_tokens) for r in expected]
    np.testing.assert_allclose([r.arrival for r in reqs], [r.arrival for r in expected], atol=1e-6)
    assert all(r.prompt_len + r.max_new_tokens <= 2048 for r in reqs)

    out2 = tmp_path / "gen2.csv"
    result = CliRunner().invoke(cli(), ["trace", "generate", str(out2), "-n", "300", "--rate", "2",
                                        "--lengths-from", "arxiv"])
    assert result.exit_code == 0, result.output
    pool = set(zip(read_table("arxiv").prompt_lens.tolist(), read_table("arxiv").output_lens.tolist()))
    assert {(r.prompt_len, r.max_new_tokens) for r in load_trace(out2)} <= pool
