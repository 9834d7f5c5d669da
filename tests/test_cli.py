"""`bullet simulate` end to end: outputs and their units, vLLM's flag names, settings that reproduce a run,
and every bad input as one line with exit code 2, no traceback and no file left behind."""

import csv
import itertools
import json
import math
import os
import shlex
import stat
import sys

import pytest
from typer.testing import CliRunner

from bullet import __version__
from bullet.cli import app, expand_goodput

runner = CliRunner()


def run(*args, **kw):
    return runner.invoke(app, ["simulate", *args], **kw)


def summary_of(res) -> dict:
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout[res.stdout.index("{"):], parse_constant=lambda c: pytest.fail(f"JSON has {c}"))


def rows(path):
    return list(csv.DictReader(path.open()))


def test_simulate_writes_outputs(tmp_path):
    out = tmp_path / "run"
    res = run("--num-requests", "60", "--out", str(out))
    assert res.exit_code == 0, res.output
    assert "TTFT" in res.output and "goodput" in res.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"] == 60
    reqs = rows(out / "requests.csv")
    assert len(reqs) == 60
    assert list(reqs[0]) == ["id", "arrival_s", "prompt_tokens", "output_tokens", "cached_tokens", "first_token_s",
                             "finish_s", "ttft_ms", "tpot_ms", "e2e_ms", "ttft_slo_ms", "attained", "preemptions"]
    for r in reqs:  # the units the names say: latencies in ms, times in s
        assert float(r["ttft_ms"]) == pytest.approx(1e3 * (float(r["first_token_s"]) - float(r["arrival_s"])),
                                                    abs=2e-3)
        assert float(r["e2e_ms"]) == pytest.approx(1e3 * (float(r["finish_s"]) - float(r["arrival_s"])), abs=2e-3)
        assert float(r["ttft_slo_ms"]) == pytest.approx(3.0 * int(r["prompt_tokens"]))  # paper-sharegpt
    steps = rows(out / "timeline.csv")
    assert list(steps[0]) == ["lane", "state", "sms", "layer_start", "layer_stop", "tokens", "seqs",
                              "cached_tokens", "start_s", "end_s", "waiting_reqs", "running_reqs", "kv_used_blocks",
                              "kv_used_pct"]
    runs = [s for s in steps if s["state"] == "run"]
    assert all(float(s["end_s"]) >= float(s["start_s"]) for s in steps)
    # one row per step: every prompt token and every output token but the last is fed through once
    assert summary["preemptions"] == 0
    fed = sum(int(r["prompt_tokens"]) + int(r["output_tokens"]) - 1 for r in reqs)
    assert sum(int(s["tokens"]) for s in steps) == fed
    busy = sum(float(s["end_s"]) - float(s["start_s"]) for s in runs)
    assert busy == pytest.approx(summary["lane_busy_s"]["all"], rel=1e-6)
    # run and idle rows tile the lane's time from 0 to its last launch, in order
    assert float(steps[0]["start_s"]) == 0.0
    for a, b in itertools.pairwise(steps):
        assert float(b["start_s"]) == pytest.approx(float(a["end_s"]), abs=2e-6)
    for s in runs:
        assert 0 <= float(s["kv_used_pct"]) <= 100 and int(s["running_reqs"]) >= 1
    assert not list(out.glob(".*"))  # no temporary files left


def test_output_files_are_world_readable(tmp_path):
    pytest.importorskip("matplotlib")
    old = os.umask(0o022)
    try:
        res = run("--num-prompts", "20", "--out", str(tmp_path / "run"), "--plot")
    finally:
        os.umask(old)
    assert res.exit_code == 0, res.output
    for f in (tmp_path / "run").iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f.name


def test_timeline_queue_kv_and_idle_gaps(tmp_path):
    """Three requests: two at 0 s (one running at a time: the second waits), one at 5 s after an idle gap.
    Each launch holds the KV of the positions it writes: prompt + output - 1 tokens, in 16-token blocks."""
    trace = tmp_path / "t.csv"
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0,160,3\n0,40,2\n5,100,4\n")
    res = run("--trace", str(trace), "--max-num-seqs", "1", "--num-gpu-blocks-override", "100", "--out",
              str(tmp_path / "run"), "--host-gap", "off")  # (with a host gap, each launch starts after it:
    assert res.exit_code == 0, res.output               # the GPU idles meanwhile, rows of their own)
    steps = rows(tmp_path / "run" / "timeline.csv")
    launches = [s for s in steps if s["state"] == "run" and int(s["tokens"]) > 1]  # each request's first step
    assert [int(s["tokens"]) for s in launches] == [160, 40, 100]
    assert [int(s["waiting_reqs"]) for s in launches] == [1, 0, 0]
    assert [int(s["running_reqs"]) for s in launches] == [1, 1, 1]
    assert [int(s["kv_used_blocks"]) for s in launches] == [math.ceil((p + o - 1) / 16)
                                                            for p, o in ((160, 3), (40, 2), (100, 4))]
    assert [float(s["kv_used_pct"]) for s in launches] == [11.0, 3.0, 7.0]
    idle = [s for s in steps if s["state"] == "idle"]
    assert len(idle) == 1 and float(idle[0]["end_s"]) == pytest.approx(5.0)
    assert int(idle[0]["tokens"]) == 0 and idle[0]["sms"] == "0"


@pytest.mark.parametrize("policy", ["chunked", "prefill-first", "static-split", "naive-concurrent", "bullet"])
def test_simulate_json(policy):
    s = summary_of(run("--num-requests", "40", "--policy", policy, "--json", "--slo-ttft-per-token", "3"))
    assert s["policy"] == policy and s["requests"] == 40
    assert s["slo"]["ttft_per_token_ms"] == 3.0
    assert 0 <= s["slo_attainment"] <= 1


def test_json_is_valid_where_metrics_are_undefined(tmp_path):
    """One output token each: no TPOT anywhere. The summary says null, never NaN (not JSON)."""
    trace = tmp_path / "t.csv"
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0,100,1\n1,50,1\n")
    s = summary_of(run("--trace", str(trace), "--json", "--out", str(tmp_path / "run")))
    assert s["tpot_ms"]["mean"] is None
    json.loads((tmp_path / "run" / "summary.json").read_text(), parse_constant=lambda c: pytest.fail(c))


def test_default_slos_tell_something_on_the_default_job():
    """The default job (bundled ShareGPT-like trace, its own timing, chunked prefill) under the default SLOs,
    the Bullet paper's ShareGPT ones: neither everyone nor no one attains."""
    s = summary_of(run("--num-prompts", "1000", "--json"))
    assert s["slo"] == {"ttft_ms": None, "ttft_per_token_ms": 3.0, "tpot_ms": 150.0}
    assert s["settings"]["slo"] == "paper-sharegpt"
    assert 0.5 < s["slo_attainment"] < 1.0


@pytest.mark.parametrize("name, slo", [
    ("paper-sharegpt", {"ttft_ms": None, "ttft_per_token_ms": 3.0, "tpot_ms": 150.0}),
    ("paper-azure-code", {"ttft_ms": None, "ttft_per_token_ms": 1.5, "tpot_ms": 200.0}),
    ("paper-arxiv", {"ttft_ms": None, "ttft_per_token_ms": 1.5, "tpot_ms": 175.0}),
    ("tight", {"ttft_ms": 500.0, "ttft_per_token_ms": None, "tpot_ms": 50.0}),
    ("none", {"ttft_ms": None, "ttft_per_token_ms": None, "tpot_ms": None}),
])
def test_slo_sets_by_name(name, slo):
    s = summary_of(run("--num-prompts", "30", "--slo", name, "--json"))
    assert s["slo"] == slo
    if name == "none":
        assert s["slo_attainment"] == 1.0


def test_slo_flags_replace_the_sets_values():
    s = summary_of(run("--num-prompts", "30", "--slo", "tight", "--slo-tpot", "80", "--json"))
    assert s["slo"] == {"ttft_ms": 500.0, "ttft_per_token_ms": None, "tpot_ms": 80.0}
    s = summary_of(run("--num-prompts", "30", "--slo-ttft", "700", "--json"))  # absolute replaces per token
    assert s["slo"] == {"ttft_ms": 700.0, "ttft_per_token_ms": None, "tpot_ms": 150.0}


# ---------------------------------------------------------------------------------------------- vLLM's names
def test_vllm_names_for_the_workload(tmp_path):
    s = summary_of(run("--num-prompts", "25", "--request-rate", "4", "--out", str(tmp_path / "a"), "--json"))
    assert s["requests"] == 25
    arrivals = sorted(float(r["arrival_s"]) for r in rows(tmp_path / "a" / "requests.csv"))
    assert (len(arrivals) - 1) / (arrivals[-1] - arrivals[0]) == pytest.approx(4.0)  # rescaled to 4 req/s
    s = summary_of(run("--num-prompts", "25", "--request-rate", "inf", "--out", str(tmp_path / "b"), "--json"))
    assert all(float(r["arrival_s"]) == 0.0 for r in rows(tmp_path / "b" / "requests.csv"))
    assert s["settings"]["request_rate"] == "inf"


def test_burstiness_is_gamma_arrivals(tmp_path):
    """vLLM's --burstiness B: gamma-distributed gaps of shape B, i.e. CV 1/sqrt(B)."""
    trace = tmp_path / "lengths.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n" + "".join(f"{100 + i},{5 + i % 7}\n"
                                                                        for i in range(40)))
    a = summary_of(run("--trace", str(trace), "--request-rate", "5", "--burstiness", "0.25", "--json"))
    b = summary_of(run("--trace", str(trace), "--request-rate", "5", "--arrival", "gamma", "--cv", "2", "--json"))
    assert a["settings"]["arrival"] == "gamma" and a["settings"]["cv"] == 2.0
    assert a["ttft_ms"] == b["ttft_ms"] and a["duration_s"] == b["duration_s"]


def test_goodput_as_vllm_writes_it():
    """--goodput ttft:500 tpot:50 (two values after one flag) sets exactly those SLOs: the same attainment as
    the tight set, which has those values."""
    s = summary_of(run("--num-prompts", "60", "--goodput", "ttft:500", "tpot:50", "--json"))
    assert s["slo"] == {"ttft_ms": 500.0, "ttft_per_token_ms": None, "tpot_ms": 50.0}
    tight = summary_of(run("--num-prompts", "60", "--slo", "tight", "--json"))
    assert s["slo_attainment"] == tight["slo_attainment"] and s["goodput"] == tight["goodput"]
    only_ttft = summary_of(run("--num-prompts", "60", "--goodput", "ttft:500", "--json"))
    assert only_ttft["slo"]["tpot_ms"] is None


def test_expand_goodput():
    assert expand_goodput(["simulate", "--goodput", "ttft:1", "tpot:2", "--json"]) == [
        "simulate", "--goodput", "ttft:1", "--goodput", "tpot:2", "--json"]
    assert expand_goodput(["--goodput=ttft:1", "TPOT:2"]) == ["--goodput=ttft:1", "--goodput", "TPOT:2"]
    assert expand_goodput(["--trace", "tpot:2"]) == ["--trace", "tpot:2"]  # only right after --goodput
    assert expand_goodput(["--goodput", "ttft:1", "--", "tpot:2"]) == ["--goodput", "ttft:1", "--", "tpot:2"]


def test_vllm_names_for_the_engine(tmp_path):
    s = summary_of(run("--num-prompts", "30", "--max-num-batched-tokens", "512", "--num-gpu-blocks-override",
                       "3000", "--out", str(tmp_path / "run"), "--json"))
    assert s["config"]["scheduler"]["max_batched_tokens"] == 512 and s["kv_blocks"] == 3000
    assert max(int(r["tokens"]) for r in rows(tmp_path / "run" / "timeline.csv")) <= 512
    for flag in ("-tp", "--tensor-parallel-size", "--tp"):
        s = summary_of(run("--num-prompts", "10", "--model", "llama-3.1-70b", flag, "4", "--json"))
        assert s["config"]["tp"] == 4 and s["settings"]["tensor_parallel_size"] == 4


def test_max_concurrency_and_percentiles(tmp_path):
    s = summary_of(run("--num-prompts", "40", "--request-rate", "inf", "--max-concurrency", "3",
                       "--metric-percentiles", "25,99.9", "--out", str(tmp_path / "run"), "--json"))
    assert set(s["ttft_ms"]) == {"mean", "p25", "p99.9"} and s["config"]["max_concurrency"] == 3
    steps = [r for r in rows(tmp_path / "run" / "timeline.csv") if r["state"] == "run"]
    assert max(int(r["waiting_reqs"]) + int(r["running_reqs"]) for r in steps) <= 3
    text = run("--num-prompts", "20", "--metric-percentiles", "75")
    assert text.exit_code == 0 and "p75" in text.output


def test_version_and_short_help():
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output.strip() == f"bullet {__version__}"
    res = runner.invoke(app, ["-h"])
    assert res.exit_code == 0 and "simulate" in res.output
    res = run("-h")
    assert res.exit_code == 0 and "--request-rate" in res.output


def test_help_fits_80_columns():
    res = run("--help", env={"COLUMNS": "80"}, terminal_width=80)
    assert res.exit_code == 0
    assert max(len(line) for line in res.output.splitlines()) <= 80
    for flag in ("--num-prompts", "--num-requests", "--max-num-batched-tokens", "--num-gpu-blocks-override",
                 "--tensor-parallel-size", "--gpu-memory-utilization", "--admission-control", "--skip-oversized",
                 "--metric-percentiles", "--max-concurrency", "--goodput", "--burstiness"):
        assert flag in res.output, flag  # whole, not cut short


@pytest.mark.parametrize(("args", "command"), [(["--help"], "whatif"), (["trace", "--help"], "stats")])
def test_group_help_wraps_each_command_summary_as_one_paragraph(args, command):
    """The command list fills its lines: a summary line followed by more of the same summary leaves no more room
    than the next word would need (docstring line breaks once left lines half empty mid-sentence)."""
    res = runner.invoke(app, args, env={"COLUMNS": "80"}, terminal_width=80)
    assert res.exit_code == 0
    lines = res.output.splitlines()
    first = next(i for i, line in enumerate(lines) if "Commands" in line) + 1
    panel = [line.strip("│╰─╯ ") for line in lines[first:] if line.startswith("│")]
    inner = [line for line in lines[first:] if line.startswith("│")]
    assert len(panel) > 3 and any(p.startswith(command) for p in panel)
    for line, nxt, text_next in zip(inner, inner[1:], panel[1:]):
        if nxt[1:].startswith(" " * 10) and text_next:  # no command name: the same summary goes on
            body = line.rstrip("│")
            padding = len(body) - len(body.rstrip())
            assert padding <= len(text_next.split()[0]) + 2, (line, text_next)


@pytest.mark.parametrize("command", [["validate"], ["whatif"], ["profile"], ["fit"], ["run"], ["bench"],
                                     ["trace", "stats"], ["trace", "generate"]])
def test_every_command_help_fits_80_columns_with_its_flags_whole(command):
    res = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert res.exit_code == 0
    assert max(len(line) for line in res.output.splitlines()) <= 80
    if command == ["trace", "generate"]:
        assert "--arrival <poisson|gamma|constant>" in res.output  # the choices whole, on the flag's line


# ---------------------------------------------------------------------------------------------- reproduction
def test_summary_records_a_command_that_reproduces_the_run(tmp_path):
    trace = tmp_path / "lengths.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n" + "".join(f"{200 + 13 * i},{3 + i % 11}\n"
                                                                        for i in range(50)))
    first = summary_of(run("--trace", str(trace), "--request-rate", "6", "--arrival", "gamma", "--cv", "1.5",
                           "--seed", "7", "--policy", "static-split", "--prefill-sms", "84", "--layers-per-step",
                           "4", "--slo", "tight", "--slo-tpot", "40", "--num-gpu-blocks-override", "4000",
                           "--metric-percentiles", "50,95", "--json"))
    st = first["settings"]
    assert (st["seed"], st["arrival"], st["cv"], st["prefill_sms"], st["layers_per_step"]) == (7, "gamma", 1.5, 84, 4)
    assert st["trace_file"] == str(trace) and len(st["trace_sha256"]) == 64
    # the default latency model is the one shipped for Llama-3.1-8B on the H200
    assert st["latency_model"] == "fitted: profiles/h200/llama-3.1-8b/model.json"
    assert st["bullet_version"] == __version__ and st["gpu"] == "h200"
    argv = shlex.split(st["command"])
    assert argv[:2] == ["bullet", "simulate"]
    again = summary_of(runner.invoke(app, [*argv[1:], "--json"]))
    for key in ("requests", "duration_s", "slo_attainment", "ttft_ms", "tpot_ms", "e2e_ms", "slo", "launches"):
        assert again[key] == first[key], key
    assert again["settings"]["command"] == st["command"]


# ---------------------------------------------------------------------------------------------- bad input
def assert_one_red_line(res, message):
    assert res.exit_code == 2, res.output
    assert message in res.output, res.output
    assert "Traceback" not in res.output
    assert len([line for line in res.output.splitlines() if line.strip()]) == 1, res.output



@pytest.mark.parametrize("args, message", [
    (["--model", "gpt-5"], "unknown model"),
    (["--gpu", "b300"], "unknown GPU"),
    (["--trace", "no-such-trace"], "no-such-trace"),
    (["--policy", "static-split", "--prefill-sms", "96"], "not a prefill size"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be a positive number"),
    (["--slo-tpot", "-1"], "--slo-tpot must be a positive number of milliseconds"),
    (["--slo-tpot", "nan"], "--slo-tpot must be a finite number"),
    (["--slo-tpot", "inf"], "--slo-tpot must be a finite number"),
    (["--slo-ttft", "inf"], "--slo-ttft must be a finite number"),
    (["--slo-ttft-per-token", "nan"], "--slo-ttft-per-token must be a finite number"),
    (["--request-rate", "nan"], "--request-rate must be a finite number"),
    (["--request-rate", "0"], "--request-rate must be a positive number"),
    (["--gpu-memory-utilization", "nan"], "--gpu-memory-utilization must be a finite number"),
    (["--prefill-sms", "92"], "--prefill-sms does not apply to --policy chunked"),
    (["--policy", "bullet", "--prefill-sms", "92"], "--prefill-sms does not apply to --policy bullet"),
    (["--layers-per-step", "4"], "--layers-per-step does not apply to --policy chunked"),
    (["--policy", "static-split", "--layers-per-step", "33"], "more than the 32 layers of llama-3.1-8b"),
    (["--slo-margin", "0.2"], "--slo-margin does not apply to --policy chunked"),
    (["--policy", "static-split", "--admission-control"], "--admission-control does not apply"),
    (["--decode-sizes", "8,16"], "--decode-sizes does not apply to --policy chunked"),
    (["--arrival", "gamma"], "--arrival shape generated arrivals, but"),
    (["--cv", "2"], "--cv shape generated arrivals, but"),
    (["--burstiness", "0.5"], "--burstiness shape generated arrivals, but"),
    (["--burstiness", "0"], "--burstiness must be positive"),
    (["--goodput", "ttft"], "--goodput takes ttft:MS and tpot:MS"),
    (["--goodput", "e2el:100"], "end-to-end latency SLO is not supported"),
    (["--goodput", "ttft:-3"], "expected a positive number of milliseconds"),
    (["--goodput", "ttft:100", "--slo-tpot", "50"], "give --goodput or --slo-tpot, not both"),
    (["--slo-ttft", "100", "--slo-ttft-per-token", "2"], "not both"),
    (["--metric-percentiles", "50,abc"], "--metric-percentiles takes comma-separated numbers"),
    (["--metric-percentiles", "0"], "--metric-percentiles takes comma-separated numbers"),
    (["--max-concurrency", "0"], "--max-concurrency"),
    (["--num-prompts", "x"], "--num-prompts"),
    (["--no-such-flag"], "No such option: --no-such-flag"),
    (["--num-prompts", "999999"], "asked for 999999 requests"),
])
def test_bad_input_exits_2_in_one_line_without_output(tmp_path, args, message):
    out = tmp_path / "run"
    res = run("--num-requests", "5", "--out", str(out), *args)
    assert_one_red_line(res, message)
    assert not out.exists()


def test_request_rate_inf_refuses_arrival_flags(tmp_path):
    trace = tmp_path / "lengths.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n100,5\n200,6\n")
    assert_one_red_line(run("--trace", str(trace), "--request-rate", "inf", "--arrival", "constant"),
                        "--request-rate inf sends every request at once")
    assert_one_red_line(run("--trace", str(trace)), "give --request-rate")
    assert_one_red_line(run("--trace", str(trace), "--request-rate", "2", "--cv", "2"),
                        "--cv applies to --arrival gamma")


def test_out_must_be_a_writable_folder(tmp_path):
    a_file = tmp_path / "taken.json"
    a_file.write_text("keep me")
    assert_one_red_line(run("--num-prompts", "5", "--out", str(a_file)), "exists and is not a folder")
    assert a_file.read_text() == "keep me"
    assert_one_red_line(run("--num-prompts", "5", "--out", str(a_file / "run")), "is a file, not a folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken.json"]


def test_missing_optional_dependencies_are_found_before_simulating(tmp_path, monkeypatch):
    for module, flag in (("matplotlib", "--plot"), ("pandas", "--parquet"), ("pyarrow", "--parquet")):
        with monkeypatch.context() as m:
            m.setitem(sys.modules, module, None)  # import fails as if not installed
            res = run("--num-prompts", "5", "--out", str(tmp_path / "run"), flag)
        assert_one_red_line(res, f"{flag} needs {module}")
        assert not (tmp_path / "run").exists()
    assert_one_red_line(run("--num-prompts", "5", "--plot"), "--plot needs --out")
    assert_one_red_line(run("--num-prompts", "5", "--parquet"), "--parquet needs --out")


def test_bad_trace_row_names_file_line_field(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,10,5\n0.5,ten,5\n")
    res = run("--trace", str(bad))
    assert_one_red_line(res, "bad.csv:3")
    assert "num_prefill_tokens" in res.output


def test_oversized_request_names_the_trace_line(tmp_path):
    """Rows out of time order: the request too long for the model (131,072 positions) is the second to
    arrive but on line 4; the error names that line. --skip-oversized leaves it out and counts it."""
    trace = tmp_path / "long.csv"
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n5,100,10\n\n0,200,10\n1,200000,10\n"
                     "2,300,10\n")
    out = tmp_path / "run"
    res = run("--trace", str(trace), "--out", str(out))
    assert_one_red_line(res, f"{trace}:5: 200000 prompt + 10 output tokens need 200010 positions")
    assert "--skip-oversized" in res.output and not out.exists()
    s = summary_of(run("--trace", str(trace), "--skip-oversized", "--json"))
    assert s["requests"] == 3 and s["skipped_oversized"] == 1 and s["rejected"] == 0
    text = run("--trace", str(trace), "--skip-oversized")
    assert "left out (--skip-oversized)" in text.output


def test_request_larger_than_the_kv_cache_names_the_line(tmp_path):
    trace = tmp_path / "m.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 100, "output_length": 5}\n'
                     '{"timestamp": 10, "input_length": 900, "output_length": 5}\n')
    res = run("--trace", str(trace), "--num-gpu-blocks-override", "40")
    assert_one_red_line(res, f"{trace}:2: 900 prompt + 5 output tokens need 57 KV blocks of 16 tokens, more "
                             "than the whole cache holds (40")
    s = summary_of(run("--trace", str(trace), "--num-gpu-blocks-override", "40", "--skip-oversized", "--json"))
    assert s["requests"] == 1 and s["skipped_oversized"] == 1


def test_hf_config_model(tmp_path):
    cfg = {"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 4, "hidden_size": 256,
           "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 512,
           "vocab_size": 1000, "rope_theta": 1e6, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    s = summary_of(run("--num-requests", "10", "--model", str(tmp_path), "--json"))
    assert s["model"] == tmp_path.name and s["settings"]["model"] == str(tmp_path)


def test_simulate_parquet(tmp_path):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    res = run("--num-requests", "30", "--out", str(tmp_path), "--parquet")
    assert res.exit_code == 0, res.output
    df = pd.read_parquet(tmp_path / "requests.parquet")
    assert len(df) == 30 and df["output_tokens"].gt(0).all()
    assert (df["e2e_ms"] >= df["ttft_ms"]).all()
    assert not list(tmp_path.glob(".*"))


@pytest.mark.parametrize("policy", ["chunked", "static-split"])
def test_simulate_plots(tmp_path, policy):
    pytest.importorskip("matplotlib")
    res = run("--num-requests", "40", "--policy", policy, "--out", str(tmp_path), "--plot")
    assert res.exit_code == 0, res.output
    for name in ("latency.png", "timeline.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert not list(tmp_path.glob(".*"))


def test_the_table_names_the_shipped_model_in_80_columns():
    res = run("--num-prompts", "20", env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    assert "fitted (shipped, h200/llama-3.1-8b)" in res.output
    assert max(len(line) for line in res.output.splitlines()) <= 80


def test_fuse_window_plans_as_a_live_server_and_is_recorded():
    """--fuse-window-ms: launches end a window ahead instead of at the next arrival, so a loaded run makes more
    (shorter) launches; the setting is recorded and in the reproducing command; bad values are refused."""
    args = ("--num-prompts", "40", "--request-rate", "4", "--policy", "chunked", "--latency", "roofline", "--json")
    plain = summary_of(run(*args))
    live = summary_of(run(*args, "--fuse-window-ms", "10"))
    assert live["launches"] > plain["launches"]
    assert live["settings"]["fuse_window_ms"] == 10.0 and "--fuse-window-ms 10.0" in live["settings"]["command"]
    assert plain["settings"]["fuse_window_ms"] is None and "--fuse-window-ms" not in plain["settings"]["command"]
    for bad in ("0", "-1", "nan"):
        res = run("--fuse-window-ms", bad)
        assert res.exit_code == 2 and "--fuse-window-ms" in res.output and "Traceback" not in res.output


def test_plain_values_are_typer_coercions():
    """Where ``plain_value`` answers without typer's pydantic coercion, it answers what that coercion does, for
    every option of every command and values of each kind (defaults, digits, decimals, choices, bad ones);
    and ``main()`` on a command builds that command alone, with the whole group's behaviour."""
    import typer

    from bullet.cli import _TYPER, plain_value

    cli = typer.main.get_command(app)
    commands = [c for c in cli.commands.values() if not hasattr(c, "commands")]
    commands += [c for g in cli.commands.values() for c in getattr(g, "commands", {}).values()]
    values = [None, "", "0", "1", "007", "12", "1_0", "-3", "2.5", "0.25", "7.", ".5", "1e3", "inf", "nan", "x",
              "static-split", "bullet", "poisson", "gamma", "paper-sharegpt", "123456789012345678901", 0, 3, -1,
              0.5, 1.0, True, False, math.inf, math.nan]
    checked = 0
    for command in commands:
        ctx = typer.Context(command)
        for param in command.get_params(ctx):
            if not hasattr(param, "type_descriptor"):
                continue
            for value in [*values, param.default, *getattr(param.type_descriptor.annotation, "__members__", {})]:
                got = plain_value(value, param, ctx)
                if got is _TYPER:
                    continue
                param._runtime_param = None
                want = param.get_runtime_param().coerce(value, param=param, ctx=ctx)
                assert type(got) is type(want) and (got == want), (command.name, param.name, value, got, want)
                checked += 1
    assert checked > 1000


def test_main_builds_the_invoked_command_alone(monkeypatch, capsys):
    """``bullet COMMAND ...`` builds COMMAND's click command only; its help, errors and exit codes are those of
    the whole group, which ``bullet`` alone, a mistyped command and ``--help`` still get."""
    import typer

    from bullet import cli

    monkeypatch.setattr(cli.gc, "freeze", lambda: None)  # (main() freezes the heap of the process it ends)
    built = []
    real = typer.main.get_command_from_info
    monkeypatch.setattr(typer.main, "get_command_from_info",
                        lambda command_info, **kw: built.append(command_info.callback.__name__)
                        or real(command_info=command_info, **kw))

    def output(entry) -> tuple:
        built.clear()
        with pytest.raises(SystemExit) as exit_:
            entry()
        out = capsys.readouterr()
        return exit_.value.code or 0, out.out, out.err

    for args, names in ((["simulate", "--help"], ["simulate"]), (["simulate", "--bogus"], ["simulate"]),
                        (["simulate", "--num-requests", "x"], ["simulate"]), (["fit", "--help"], ["fit"]),
                        (["--help"], None), (["simulat"], None), (["trace", "--help"], ["stats", "generate"])):
        monkeypatch.setattr(sys, "argv", ["bullet", *args])
        got = output(cli.main)
        assert sorted(built) == sorted(names) if names else len(built) > 5, args
        assert got == output(app), args
