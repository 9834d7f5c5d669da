"""Prompt hashes in traces: Mooncake ``hash_ids``, the CSV ``hash_ids`` column, the ideal prefix hit rate in
``trace_stats`` / ``bullet trace stats``, and :func:`materialize_prompt_ids`."""

from __future__ import annotations

import json
import math
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
    TraceError,
    _mix64,
    load_trace,
    materialize_prompt_ids,
    read_table,
    save_trace,
    trace_stats,
)

RAW = Path(__file__).resolve().parents[2] / "shared/traces/raw"
MOONCAKE = RAW / "mooncake_synthetic_trace.jsonl"
VIDUR_HEADER = "arrived_at,num_prefill_tokens,num_decode_tokens"

# Six rows at 4 tokens per hash id, out of arrival order; line 4 has no hash_ids key. Arrival order:
# line 2 (0 s), 3 (1 s), 4 and 6 (2 s, kept in file order), 1 (3 s), 5 (4 s).
SMALL_ROWS = [
    {"timestamp": 3000, "input_length": 12, "output_length": 1, "hash_ids": [1, 2, 3]},
    {"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1, 2, 5]},
    {"timestamp": 1000, "input_length": 8, "output_length": 3, "hash_ids": [1, 2]},
    {"timestamp": 2000, "input_length": 6, "output_length": 4},
    {"timestamp": 4000, "input_length": 9, "output_length": 5, "hash_ids": [7, 8, 9]},
    {"timestamp": 2000, "input_length": 13, "output_length": 6, "hash_ids": [1, 2, 3, 4]},
]
SMALL_IN_ARRIVAL_ORDER = [(1, 2, 5), (1, 2), None, (1, 2, 3, 4), (1, 2, 3), (7, 8, 9)]
SMALL_PROMPT_TOKENS = 12 + 10 + 8 + 6 + 9 + 13  # 58

# Ideal hit tokens, replaying in arrival order. A request may reuse a KV block only if it is full in an
# earlier prompt, and never its own last prompt token: at most (prompt_len - 1) // block_size blocks.
#   block 4 (one hash id per block):
#     10 [1,2,5]: first, 0.  8 [1,2]: blocks [1],[2] seen, cap 7 // 4 = 1 -> 4.  6 tokens, no ids: 0.
#     13 [1,2,3,4]: [1],[2] seen, [3] new -> 8.  12 [1,2,3]: all 3 seen, cap 11 // 4 = 2 -> 8.  [7,8,9]: 0.
#     20 / 58
#   block 2 (half a hash id per block; block k lies in id k // 2):
#     10 [1,2,5]: caches 5 blocks (ids 1,1,2,2,5).  8 [1,2]: 4 seen, cap 7 // 2 = 3 -> 6.
#     13 [1,2,3,4]: 4 seen (1,1,2,2), then 3 new -> 8.  12 [1,2,3]: 6 seen (the 13-token prompt cached
#     3,3), cap 11 // 2 = 5 -> 10.  [7,8,9]: 0.   24 / 58
#   block 8 (two ids per block):
#     10: caches (1,2).  8: (1,2) seen but cap 7 // 8 = 0 -> 0.  13: (1,2) seen, cap 12 // 8 = 1 -> 8.
#     12: (1,2) seen, cap 11 // 8 = 1 -> 8.  [7,8,9]: 0.   16 / 58
SMALL_HIT_RATE = {4: 20 / 58, 2: 24 / 58, 8: 16 / 58}


def write(tmp_path: Path, text: str, name: str = "trace.csv") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def jsonl(tmp_path: Path, rows: list[dict], name: str = "trace.jsonl") -> Path:
    return write(tmp_path, "".join(json.dumps(r) + "\n" for r in rows), name)


def cli() -> typer.Typer:
    app = typer.Typer()
    app.add_typer(trace_app, name="trace")
    return app


# ------------------------------------------------------------------------------------ Mooncake hash_ids


def test_mooncake_hashes_follow_arrival_order(tmp_path):
    path = jsonl(tmp_path, SMALL_ROWS)
    table = read_table(path, hash_block_size=4)
    assert table.hash_ids == [(1, 2, 3), (1, 2, 5), (1, 2), None, (7, 8, 9), (1, 2, 3, 4)]  # file order
    assert table.hash_block == 4
    reqs = load_trace(path, hash_block_size=4)
    assert [r.hash_ids for r in reqs] == SMALL_IN_ARRIVAL_ORDER
    assert [r.prompt_len for r in reqs] == [10, 8, 6, 13, 12, 9]
    assert {r.hash_block for r in reqs} == {4}
    assert [r.arrival for r in reqs] == [0.0, 1.0, 2.0, 2.0, 3.0, 4.0]


def test_hashes_survive_trimming_and_rescaling(tmp_path):
    path = jsonl(tmp_path, SMALL_ROWS)
    window = load_trace(path, hash_block_size=4, start=1, num_requests=3)
    assert [(r.id, r.arrival, r.hash_ids) for r in window] == [(0, 0.0, (1, 2)), (1, 1.0, None),
                                                               (2, 1.0, (1, 2, 3, 4))]
    fast = load_trace(path, hash_block_size=4, rate=10.0)  # 5 gaps over 4 s -> 0.5 s, times x 1/8
    assert [r.arrival for r in fast] == pytest.approx([0.0, 0.125, 0.25, 0.25, 0.375, 0.5])
    assert [r.hash_ids for r in fast] == SMALL_IN_ARRIVAL_ORDER
    slow = load_trace(path, hash_block_size=4, time_scale=2.0)
    assert [r.hash_ids for r in slow] == SMALL_IN_ARRIVAL_ORDER


def test_mooncake_without_hashes_and_hash_block_option(tmp_path):
    rows = [{k: v for k, v in r.items() if k != "hash_ids"} for r in SMALL_ROWS]
    path = jsonl(tmp_path, rows)
    assert read_table(path).hash_ids is None
    assert all(r.hash_ids is None for r in load_trace(path))
    assert trace_stats(read_table(path))["prefix_hit_rate_ideal"] is None
    for bad in (0, -4, True, 2.5):
        with pytest.raises(TraceError, match="hash_block_size"):
            load_trace(path, hash_block_size=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(("block", "rate"), sorted(SMALL_HIT_RATE.items()))
def test_ideal_hit_rate_matches_hand_count(tmp_path, block, rate):
    path = jsonl(tmp_path, SMALL_ROWS)
    assert trace_stats(load_trace(path, hash_block_size=4), block_size=block)["prefix_hit_rate_ideal"] == \
        pytest.approx(rate, rel=1e-12)
    # The table (file order, not yet sorted) gives the same: the replay goes by arrival.
    assert trace_stats(read_table(path, hash_block_size=4), block_size=block)["prefix_hit_rate_ideal"] == \
        pytest.approx(rate, rel=1e-12)


def test_ideal_hit_rate_default_block_and_options():
    # Two 40-token prompts with the same 8 ids of 5 tokens: the second reuses 2 whole 16-token blocks (32
    # tokens; a third would hold its last token). 32 / 80.
    reqs = [Request(i, float(i), 40, 1, hash_ids=tuple(range(8)), hash_block=5) for i in range(2)]
    assert trace_stats(reqs)["prefix_hit_rate_ideal"] == pytest.approx(32 / 80)
    assert trace_stats([Request(0, 0.0, 40, 1)])["prefix_hit_rate_ideal"] is None
    with pytest.raises(TraceError, match="block_size"):
        trace_stats(reqs, block_size=0)


M = '{"timestamp": 1, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]}\n'  # valid at 512


@pytest.mark.parametrize(("text", "line", "words"), [
    (M + '{"timestamp": 2, "input_length": 2, "output_length": 3, "hash_ids": "0 1"}\n', 2, "expected a list"),
    (M + '{"timestamp": 2, "input_length": 2, "output_length": 3, "hash_ids": null}\n', 2, "expected a list"),
    (M + '{"timestamp": 2, "input_length": 2, "output_length": 3, "hash_ids": {"0": 1}}\n', 2, "expected a list"),
    (M + M + '{"timestamp": 2, "input_length": 2, "output_length": 3, "hash_ids": [-1]}\n', 3, "got -1 at index 0"),
    (M + '{"timestamp": 2, "input_length": 600, "output_length": 3, "hash_ids": [4, true]}\n', 2,
     "got True at index 1"),
    (M + '{"timestamp": 2, "input_length": 2, "output_length": 3, "hash_ids": [1.0]}\n', 2, "got 1.0 at index 0"),
    (M + '{"timestamp": 2, "input_length": 2, "output_length": 3, "hash_ids": ["7"]}\n', 2, "got '7' at index 0"),
    (M + '{"timestamp": 2, "input_length": 2, "output_length": 3, "hash_ids": [9223372036854775808]}\n', 2,
     "below 2**63"),
    (M + '{"timestamp": 2, "input_length": 1025, "output_length": 3, "hash_ids": [0, 1]}\n', 2,
     "the row has 2 hash ids, but its 1025-token prompt has 3 blocks of 512 tokens"),
    (M + '{"timestamp": 2, "input_length": 5, "output_length": 3, "hash_ids": []}\n', 2,
     "the row has 0 hash ids, but its 5-token prompt has 1 block of 512 tokens"),
])
def test_bad_mooncake_hashes_name_line_and_field(tmp_path, text, line, words):
    path = write(tmp_path, text, "trace.jsonl")
    with pytest.raises(TraceError) as e:
        load_trace(path)
    err = e.value
    assert (err.path, err.line, err.field) == (str(path), line, "hash_ids")
    assert str(err).startswith(f"{path}:{line}: field 'hash_ids': ")
    assert words in str(err)


def test_wrong_hash_block_size_hints_at_the_flag(tmp_path):
    path = jsonl(tmp_path, SMALL_ROWS)
    with pytest.raises(TraceError) as e:
        load_trace(path, hash_block_size=8)  # line 1: 12 tokens are 2 blocks of 8, the row has 3 ids
    assert str(e.value) == (f"{path}:1: field 'hash_ids': the row has 3 hash ids, but its 12-token prompt has "
                            "2 blocks of 8 tokens (is the hash block size right? set it with --hash-block-size)")


# ------------------------------------------------------------------------------------ CSV hash_ids column


def test_csv_round_trip_keeps_hashes(tmp_path):
    reqs = [Request(0, 0.0, 10, 2, hash_ids=(1, 2, 5), hash_block=4),
            Request(1, 0.5, 6, 4),
            Request(2, 1.25, 4, 1, hash_ids=(9223372036854775807,), hash_block=4)]
    path = tmp_path / "h.csv"
    save_trace(reqs, path)
    assert path.read_text() == (f"{VIDUR_HEADER},hash_ids\n"
                                "0.000000,10,2,1 2 5\n"
                                "0.500000,6,4,\n"
                                "1.250000,4,1,9223372036854775807\n")
    back = load_trace(path, hash_block_size=4)
    assert [(r.arrival, r.prompt_len, r.max_new_tokens, r.hash_ids, r.hash_block) for r in back] == [
        (0.0, 10, 2, (1, 2, 5), 4), (0.5, 6, 4, None, 4), (1.25, 4, 1, (9223372036854775807,), 4)]
    with pytest.raises(TraceError, match=r"h\.csv:2: field 'hash_ids': the row has 3 hash ids"):
        load_trace(path)  # at 512 the 10-token prompt has one block


def test_csv_without_hashes_is_written_as_before(tmp_path):
    path = tmp_path / "plain.csv"
    save_trace([Request(0, 0.0, 10, 2), Request(1, 1.5, 7, 1)], path)
    assert path.read_bytes() == f"{VIDUR_HEADER}\n0.000000,10,2\n1.500000,7,1\n".encode()
    # A bundled trace (written by save_trace before hashes existed) comes back byte for byte.
    again = tmp_path / "azure-conv.csv"
    save_trace(load_trace("azure-conv"), again)
    assert again.read_bytes() == Path(read_table("azure-conv").path).read_bytes()


def test_cannot_save_mixed_hash_blocks(tmp_path):
    reqs = [Request(0, 0.0, 8, 1, hash_ids=(1, 2), hash_block=4), Request(1, 0.0, 8, 1, hash_ids=(1,), hash_block=8)]
    with pytest.raises(TraceError, match=r"different block sizes \(\[4, 8\]\)"):
        save_trace(reqs, tmp_path / "x.csv")
    assert not (tmp_path / "x.csv").exists()


def test_csv_hash_column_in_both_formats_and_quoted(tmp_path):
    lengths = write(tmp_path, "num_prefill_tokens,hash_ids,num_decode_tokens\n5,3 4,1\n4, ,2\n3,3,1\n")
    table = read_table(lengths, hash_block_size=4)
    assert table.format == "lengths" and table.hash_ids == [(3, 4), None, (3,)]
    quoted = write(tmp_path, f'{VIDUR_HEADER},hash_ids\n0,5,1,"3 4"\n1,4,1,""\n', "q.csv")
    assert read_table(quoted, hash_block_size=4).hash_ids == [(3, 4), None]
    empty = write(tmp_path, f"{VIDUR_HEADER},hash_ids\n0,5,1,\n1,4,1,\n", "e.csv")
    assert read_table(empty).hash_ids is None  # a column of empty cells: no hashes at all
    azure = write(tmp_path, "TIMESTAMP,ContextTokens,GeneratedTokens,hash_ids\n"
                            "2023-11-16 18:15:46.6805900,5,1,x\n", "a.csv")
    assert read_table(azure).hash_ids is None  # the Azure format has no hash column: ignored like any extra


@pytest.mark.parametrize(("rows", "line", "words"), [
    ("0,5,1,1 2\n1,5,1,1  2\n", 3, "separated by single spaces, got '1  2'"),
    ("0,5,1,-1 2\n", 2, "got '-1 2'"),
    ("0,5,1,1 2\n1,5,1,+1 2\n", 3, "got '+1 2'"),
    ("0,5,1,1 x\n", 2, "got '1 x'"),
    ("0,5,1,1.0 2\n", 2, "got '1.0 2'"),
    ("0,5,1,1 9223372036854775808\n", 2, "below 2**63"),
    ("0,5,1,1 2\n1,5,1,1 2 3\n", 3, "the row has 3 hash ids, but its 5-token prompt has 2 blocks of 4 tokens"),
    ("0,5,1,1 2\n1,5,1\n", 3, "missing value"),
])
def test_bad_csv_hashes_name_line_and_field(tmp_path, rows, line, words):
    path = write(tmp_path, f"{VIDUR_HEADER},hash_ids\n" + rows)
    with pytest.raises(TraceError) as e:
        load_trace(path, hash_block_size=4)
    err = e.value
    assert (err.path, err.line, err.field) == (str(path), line, "hash_ids")
    assert str(err).startswith(f"{path}:{line}: field 'hash_ids': ")
    assert words in str(err)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 16), st.lists(st.tuples(st.floats(0, 1e4), st.integers(1, 100), st.integers(1, 50),
                                              st.booleans(), st.integers(0, 2**63 - 101)), min_size=1, max_size=20))
def test_hash_round_trip_property(tmp_path_factory, block, rows):
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    reqs = [Request(i, t - t0, p, o, hash_ids=tuple(range(x, x + math.ceil(p / block))) if has else None,
                    hash_block=block)
            for i, (t, p, o, has, x) in enumerate(rows)]
    path = tmp_path_factory.mktemp("hrt") / "t.csv"
    save_trace(reqs, path)
    back = load_trace(path, hash_block_size=block)
    assert [r.hash_ids for r in back] == [r.hash_ids for r in reqs]


# ------------------------------------------------------------------------------------ CLI


def _hit_cell(output: str) -> str:
    """The last cell of the table's 'requests' row: the ideal prefix hit rate."""
    row = next(line for line in output.splitlines() if "requests" in line)
    return [c.strip() for c in row.split("│") if c.strip()][-1]


def test_cli_stats_shows_the_ideal_hit_rate(tmp_path):
    path = jsonl(tmp_path, SMALL_ROWS)
    args = ["trace", "stats", str(path), "--hash-block-size", "4", "--block-size", "4"]
    result = CliRunner().invoke(cli(), args)
    assert result.exit_code == 0, result.output
    assert "prefix hit rate" in result.output and "infinite cache" in result.output
    assert _hit_cell(result.output) == "34.5%"  # 20 / 58
    result = CliRunner().invoke(cli(), [*args, "--json"])
    assert json.loads(result.output)["prefix_hit_rate_ideal"] == pytest.approx(20 / 58)
    result = CliRunner().invoke(cli(), ["trace", "stats", str(path), "--hash-block-size", "4", "--json"])
    assert json.loads(result.output)["prefix_hit_rate_ideal"] == 0.0  # no prompt has a full 16-token block


def test_cli_stats_without_hashes_shows_a_dash(tmp_path):
    path = write(tmp_path, f"{VIDUR_HEADER}\n" + "".join(f"{i},{20 + i},3\n" for i in range(5)))
    result = CliRunner().invoke(cli(), ["trace", "stats", str(path)])
    assert result.exit_code == 0, result.output
    assert _hit_cell(result.output) == "-"
    result = CliRunner().invoke(cli(), ["trace", "stats", str(path), "--json"])
    s = json.loads(result.output)
    assert "prefix_hit_rate_ideal" in s and s["prefix_hit_rate_ideal"] is None


def test_cli_stats_wrong_hash_block_size_exits_2(tmp_path):
    path = jsonl(tmp_path, SMALL_ROWS)
    result = CliRunner().invoke(cli(), ["trace", "stats", str(path)])  # 512 per id: 3 ids for 12 tokens
    assert result.exit_code == 2
    assert ":1: field 'hash_ids'" in result.output and "--hash-block-size" in result.output
    assert "Traceback" not in result.output
    result = CliRunner().invoke(cli(), ["trace", "stats", str(path), "--hash-block-size", "0"])
    assert result.exit_code == 2


# ------------------------------------------------------------------------------------ prompt ids


def test_mixer_is_splitmix64():
    # SplitMix64 seeded with 0 outputs mix(1 * golden), mix(2 * golden), ...: 0xe220a8397b1dcdaf,
    # 0x6e789e6aa1b965f4, 0x06c45d188009454f (the published reference sequence).
    golden = 0x9E3779B97F4A7C15
    states = np.array([golden, 2 * golden % 2**64, 3 * golden % 2**64], dtype=np.uint64)
    assert _mix64(states).tolist() == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_materialize_prompt_ids_follows_the_hashes():
    vocab = 32_000
    a = Request(0, 0.0, 12, 3, hash_ids=(1, 2, 3), hash_block=4)
    b = Request(1, 0.1, 11, 3, hash_ids=(1, 2, 9), hash_block=4)
    c = Request(2, 0.2, 4, 3, hash_ids=(3,), hash_block=4)  # id 3 first, where a has it third
    d = Request(3, 0.3, 8, 3)
    e = Request(4, 0.4, 8, 3)
    f = Request(5, 0.5, 4, 3, hash_ids=(5,), hash_block=4)
    reqs = [a, b, c, d, e, f]
    out = materialize_prompt_ids(reqs, vocab)
    ma, mb, mc, md, me, mf = (r.prompt_ids for r in out)
    assert [len(ids) for ids in (ma, mb, mc, md, me, mf)] == [12, 11, 4, 8, 8, 4]
    assert ma[:8] == mb[:8]  # ids 1, 2 shared
    assert ma[8:11] != mb[8:11]  # id 3 against id 9: the whole block differs
    assert ma[8:12] == mc  # a token depends on (hash id, offset in its block), not on the position
    assert mc != mf  # ids 3 and 5
    assert md[:4] != me[:4] and md[4:] != me[4:]  # no hashes: nothing shared
    assert len(set(ma[:4])) > 1  # not one token repeated
    assert all(0 <= t < vocab for ids in (ma, mb, mc, md, me, mf) for t in ids)
    assert all(type(t) is int for t in ma)
    assert [r.prompt_ids for r in materialize_prompt_ids(reqs, vocab)] == [r.prompt_ids for r in out]
    assert [r.prompt_ids for r in materialize_prompt_ids(reqs, vocab, seed=1)] != [r.prompt_ids for r in out]
    small = materialize_prompt_ids(reqs, 3)
    assert {t for r in small for t in r.prompt_ids} <= {0, 1, 2}
    assert {t for r in materialize_prompt_ids(reqs, 1) for t in r.prompt_ids} == {0}


def test_materialize_prompt_ids_leaves_inputs_alone():
    a = Request(7, 1.5, 9, 3, hash_ids=(4, 5, 6), hash_block=4)
    a.output_ids.append(11)
    b = Request(8, 2.0, 5, 2)
    (ma, mb) = materialize_prompt_ids([a, b], 100, seed=3)
    assert a.prompt_ids is None and b.prompt_ids is None and a.output_ids == [11]
    assert ma is not a and mb is not b
    assert (ma.id, ma.arrival, ma.prompt_len, ma.max_new_tokens, ma.hash_ids, ma.hash_block) == \
        (7, 1.5, 9, 3, (4, 5, 6), 4)
    assert ma.output_ids == [11] and ma.output_ids is not a.output_ids
    assert ma.token_times is not a.token_times
    assert (mb.id, mb.prompt_len, mb.hash_ids) == (8, 5, None)
    with pytest.raises(TraceError, match="vocab_size"):
        materialize_prompt_ids([a], 0)


# ------------------------------------------------------------------------------------ the public Mooncake file


def _reference_hit_tokens(rows: list[dict], block: int) -> int:
    """Hit tokens when KV blocks equal hash blocks, by a trie over hash-id prefixes (independent of
    bullet.kvcache): an earlier prompt caches its full blocks; a prompt reuses its longest cached prefix of
    whole blocks, at most (prompt_len - 1) // block of them."""
    trie: dict[tuple[int, int], int] = {}  # (parent node, hash id) -> node
    hit = 0
    for r in sorted(rows, key=lambda r: r["timestamp"]):  # stable: ties keep file order
        full, cap = r["input_length"] // block, (r["input_length"] - 1) // block
        node, cached = -1, 0  # cached: leading blocks found in the trie
        for k, h in enumerate(r["hash_ids"][:full]):
            if (node, h) in trie and cached == k:
                cached = k + 1
            node = trie.setdefault((node, h), len(trie))
        hit += block * min(cached, cap)
    return hit


@pytest.mark.skipif(not MOONCAKE.is_file(), reason=f"{MOONCAKE} not found")
def test_public_mooncake_hashes():
    rows = [json.loads(line) for line in MOONCAKE.read_text().splitlines() if line.strip()]
    table = read_table(MOONCAKE)
    assert table.format == "mooncake" and len(table) == len(rows) == 3993
    assert table.hash_ids == [tuple(r["hash_ids"]) for r in rows]
    assert [len(h) for h in table.hash_ids] == [-(-r["input_length"] // 512) for r in rows]
    reqs = load_trace(MOONCAKE)
    assert all(r.hash_block == 512 and len(r.hash_ids) == math.ceil(r.prompt_len / 512) for r in reqs)
    assert sum(len(r.hash_ids) for r in reqs) == sum(len(r["hash_ids"]) for r in rows)
    total = sum(r["input_length"] for r in rows)
    rate = trace_stats(table, block_size=512)["prefix_hit_rate_ideal"]
    assert rate == pytest.approx(_reference_hit_tokens(rows, 512) / total, rel=1e-12)
    with pytest.raises(TraceError) as e:
        read_table(MOONCAKE, hash_block_size=256)
    assert e.value.line == 1 and "79 hash ids" in str(e.value) and "157 blocks of 256" in str(e.value)
