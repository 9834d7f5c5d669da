"""Prefix caching end to end in the simulator: a small Mooncake-format trace with hash ids, hits counted by
hand, and the time they save checked against the latency model by hand."""

import csv
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from bullet.cli import app
from bullet.config import GPUS, MODELS, CacheConfig, SchedulerConfig, SloConfig
from bullet.traces import load_trace
from simulator import simulate
from tests.latency import LinearLatency

MODEL, GPU = MODELS["llama-3.1-8b"], GPUS["h200"]

# Hash blocks of 32 tokens, KV blocks of 16; requests 10 s apart, so each runs alone. Hits by hand:
#   0: 64 tokens, ids [1, 2]       first: nothing cached                               0
#   1: 80 tokens, ids [1, 2, 3]    [1, 2] = 64 tokens = 4 KV blocks cached by 0         64
#   2: 40 tokens, ids [1, 9]       [1] = 32 tokens; its tokens 32-39 are no full block  32
#   3: 64 tokens, ids [5, 2]       differs in the first id                              0
#   4: 64 tokens, ids [1, 2]       all 64 cached, but one token must be computed: 3 blocks  48
# hits 144 of 64 + 80 + 40 + 64 + 64 = 312 prompt tokens
ROWS = [(0, 64, [1, 2]), (10_000, 80, [1, 2, 3]), (20_000, 40, [1, 9]), (30_000, 64, [5, 2]), (40_000, 64, [1, 2])]
HITS = [0, 64, 32, 0, 48]


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "prefixes.jsonl"
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": 4, "hash_ids": h}) + "\n"
                            for t, n, h in ROWS))
    return path


def run(trace, caching, latency):
    reqs = load_trace(trace, hash_block_size=32)
    return simulate(reqs, MODEL, GPU, SchedulerConfig(), CacheConfig(num_blocks=64, prefix_caching=caching),
                    SloConfig(), latency)


def test_hits_and_the_time_they_save(trace):
    """With LinearLatency a prefill of n new tokens after a cached prefix costs per_token * n less than
    computing the whole prompt (its KV reads are the same), so each request's TTFT and end-to-end time drop
    by exactly per_token * its hit tokens, and the run's GPU time by per_token * 144."""
    lat = LinearLatency(MODEL.num_layers)
    on, off = run(trace, True, lat), run(trace, False, lat)
    assert on.columns["cached_tokens"].tolist() == HITS
    assert on.summary["prefix_cache_hit_tokens"] == 144 and on.summary["prefix_cache_query_tokens"] == 312
    assert on.summary["prefix_cache_hit_rate"] == pytest.approx(144 / 312)
    assert off.summary["prefix_cache_hit_tokens"] == 0 and off.columns["cached_tokens"].sum() == 0
    saved = lat.per_token * np.array(HITS)
    np.testing.assert_allclose(off.columns["ttft"] - on.columns["ttft"], saved, rtol=0, atol=1e-12)
    np.testing.assert_allclose(off.columns["e2e"] - on.columns["e2e"], saved, rtol=0, atol=1e-12)
    busy_on, busy_off = on.summary["lane_busy_s"]["all"], off.summary["lane_busy_s"]["all"]
    assert busy_off - busy_on == pytest.approx(lat.per_token * 144, rel=1e-9)


def test_cli_reports_hits_per_request_and_per_launch(trace, tmp_path):
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["simulate", "--trace", str(trace), "--hash-block-size", "32", "--num-blocks",
                                   "64", "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["prefix_caching"] is True and summary["prefix_cache_hit_tokens"] == 144
    rows = list(csv.DictReader((out / "requests.csv").open()))
    assert [int(r["cached_tokens"]) for r in rows] == HITS
    launches = list(csv.DictReader((out / "timeline.csv").open()))
    assert sum(int(r["cached_tokens"]) for r in launches) == 144
    res = CliRunner().invoke(app, ["simulate", "--trace", str(trace), "--hash-block-size", "32", "--num-blocks",
                                   "64", "--no-prefix-caching", "--json"])
    assert json.loads(res.stdout)["prefix_cache_hit_tokens"] == 0
    res = CliRunner().invoke(app, ["simulate", "--trace", str(trace), "--num-blocks", "64"])
    assert res.exit_code == 2 and "hash-block-size" in res.output  # 512-token hash blocks do not fit these rows


def test_text_summary_shows_the_hit_rate(trace):
    res = CliRunner().invoke(app, ["simulate", "--trace", str(trace), "--hash-block-size", "32", "--num-blocks",
                                   "64"])
    assert res.exit_code == 0 and "prefix cache hit rate" in res.output and "46.2 %" in res.output
