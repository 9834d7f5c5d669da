"""`bullet simulate` end to end: outputs, JSON, errors without tracebacks."""

import csv
import json

import pytest
from typer.testing import CliRunner

from bullet.cli import app

runner = CliRunner()


def test_simulate_writes_outputs(tmp_path):
    out = tmp_path / "run"
    res = runner.invoke(app, ["simulate", "--num-requests", "60", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "TTFT" in res.output and "goodput" in res.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"] == 60
    rows = list(csv.DictReader((out / "requests.csv").open()))
    assert len(rows) == 60 and {"ttft", "tpot", "e2e", "attained"} <= set(rows[0])
    steps = list(csv.DictReader((out / "timeline.csv").open()))
    assert {"lane", "sms", "tokens", "seqs", "start", "end"} <= set(steps[0])
    assert all(float(s["end"]) >= float(s["start"]) for s in steps)
    # one row per step: every prompt token and every output token but the last is fed through once
    assert summary["preemptions"] == 0
    fed = sum(int(r["prompt_tokens"]) + int(r["output_tokens"]) - 1 for r in rows)
    assert sum(int(s["tokens"]) for s in steps) == fed
    busy = sum(float(s["end"]) - float(s["start"]) for s in steps)
    assert busy == pytest.approx(summary["lane_busy_s"]["all"], rel=1e-6)
    assert not list(out.glob(".*"))  # no temporary files left


@pytest.mark.parametrize("policy", ["chunked", "prefill-first", "static-split", "naive-concurrent"])
def test_simulate_json(policy):
    res = runner.invoke(app, ["simulate", "--num-requests", "40", "--policy", policy, "--json",
                              "--slo-ttft-per-token", "3"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout[res.stdout.index("{"):])
    assert summary["policy"] == policy and summary["requests"] == 40
    assert summary["slo"]["ttft_per_token_ms"] == 3.0
    assert 0 <= summary["slo_attainment"] <= 1


@pytest.mark.parametrize("args, message", [
    (["--model", "gpt-5"], "unknown model"),
    (["--gpu", "b300"], "unknown GPU"),
    (["--trace", "no-such-trace"], "no-such-trace"),
    (["--policy", "static-split", "--prefill-sms", "96"], "not a prefill size"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be a positive number"),
    (["--slo-tpot", "-1"], "--slo-tpot must be a positive number of milliseconds"),
])
def test_bad_input_exits_2_without_traceback(args, message):
    res = runner.invoke(app, ["simulate", "--num-requests", "5", *args])
    assert res.exit_code == 2
    assert message in res.output
    assert "Traceback" not in res.output


def test_bad_trace_row_names_file_line_field(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,10,5\n0.5,ten,5\n")
    res = runner.invoke(app, ["simulate", "--trace", str(bad)])
    assert res.exit_code == 2
    assert "bad.csv:3" in res.output and "num_prefill_tokens" in res.output


def test_hf_config_model(tmp_path):
    cfg = {"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 4, "hidden_size": 256,
           "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 512,
           "vocab_size": 1000, "rope_theta": 1e6, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    res = runner.invoke(app, ["simulate", "--num-requests", "10", "--model", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout[res.stdout.index("{"):])["model"] == tmp_path.name


def test_simulate_parquet(tmp_path):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    res = runner.invoke(app, ["simulate", "--num-requests", "30", "--out", str(tmp_path), "--parquet"])
    assert res.exit_code == 0, res.output
    df = pd.read_parquet(tmp_path / "requests.parquet")
    assert len(df) == 30 and df["output_tokens"].gt(0).all()
    assert (df["e2e"] >= df["ttft"]).all()


@pytest.mark.parametrize("policy", ["chunked", "static-split"])
def test_simulate_plots(tmp_path, policy):
    pytest.importorskip("matplotlib")
    res = runner.invoke(app, ["simulate", "--num-requests", "40", "--policy", policy, "--out", str(tmp_path),
                              "--plot"])
    assert res.exit_code == 0, res.output
    for name in ("latency.png", "timeline.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_needs_out():
    res = runner.invoke(app, ["simulate", "--num-requests", "5", "--plot"])
    assert res.exit_code == 2 and "--plot needs --out" in res.output
