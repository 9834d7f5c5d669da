"""``bullet bench`` (bullet/loadgen.py, bullet/cli_bench.py) against a stub server whose token timing and
failures are set by construction, and against a real ``bullet run`` server on the tiny model; and the flags that
``bullet simulate``, ``bullet run`` and ``bullet bench`` share (one definition each)."""

from __future__ import annotations

import asyncio
import csv
import json
import socket
import threading
import time

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from bullet.cli import app
from bullet.config import SloConfig
from bullet.request import Request

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("httpx")  # the tests talk to servers with it
pytest.importorskip("aiohttp")
from fastapi.responses import JSONResponse, StreamingResponse

from bullet import loadgen

runner = CliRunner()
FIRST_DELAY, GAP = 0.05, 0.02  # the stub's sleep before its first chunk and between chunks (seconds)
# prompt length -> what the stub does with that request
FAILS = {7: (500, "the stub broke"), 9: (429, "the stub is full")}
BROKEN = 11  # the stream stops after one chunk, without data: [DONE]
EARLY = 1e-6  # asyncio may end a sleep up to its clock resolution early


def free_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


class Stub:
    """An OpenAI-shaped streaming server in a thread: each chunk carries ``per_chunk`` tokens after the
    sleeps above; ``usage``: cumulative usage in every chunk (continuous_usage_stats) or only at the end."""

    def __init__(self, per_chunk: int = 2, usage: bool = True, api_key: str | None = None) -> None:
        self.per_chunk, self.usage, self.api_key = per_chunk, usage, api_key
        self.bodies: list[dict] = []
        api = fastapi.FastAPI()

        @api.get("/v1/models")
        async def models(request: fastapi.Request):
            if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
                return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
            return {"object": "list", "data": [{"id": "stub", "object": "model"}]}

        @api.post("/v1/completions")
        async def completions(request: fastapi.Request):
            body = await request.json()
            self.bodies.append(body)
            plen = len(body["prompt"])
            if plen in FAILS:
                status, message = FAILS[plen]
                return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)
            return StreamingResponse(self.events(plen, body["max_tokens"]), media_type="text/event-stream")

        self.sock = free_socket()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.uv = uvicorn.Server(uvicorn.Config(api, log_level="warning"))
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uv.started:
            assert time.monotonic() < deadline, "the stub did not start"
            time.sleep(0.01)

    async def events(self, plen: int, n: int):
        sent = 0
        await asyncio.sleep(FIRST_DELAY)
        while sent < n:
            k = min(self.per_chunk, n - sent)
            sent += k
            chunk = {"choices": [{"index": 0, "text": "ab"[:k], "finish_reason": "length" if sent == n else None}]}
            if self.usage:
                chunk["usage"] = {"prompt_tokens": plen, "completion_tokens": sent, "total_tokens": plen + sent}
            yield f"data: {json.dumps(chunk)}\n\n"
            if plen == BROKEN:
                return
            if sent < n:
                await asyncio.sleep(GAP)
        final = {"choices": [], "usage": {"prompt_tokens": plen, "completion_tokens": n, "total_tokens": plen + n}}
        yield f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n"

    def stop(self) -> None:
        self.uv.should_exit = True
        self.thread.join(30)


@pytest.fixture
def stub():
    s = Stub()
    yield s
    s.stop()


def write_trace(path, rows) -> str:
    """A Vidur-format trace: (arrival s, prompt tokens, output tokens) per row."""
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n"
                    + "".join(f"{a},{p},{o}\n" for a, p, o in rows))
    return str(path)


def records_for(rows, fmt="ids") -> list[loadgen.Record]:
    reqs = [Request(i, a, p, o, prompt_ids=tuple(range(p))) for i, (a, p, o) in enumerate(rows)]
    return loadgen.make_records(reqs, fmt)


def bench(*args):
    return runner.invoke(app, ["bench", *args])


def one_red_line(res, code: int = 2) -> str:
    assert res.exit_code == code, res.output
    assert "Traceback" not in res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert lines[-1].startswith("error: "), res.output
    return lines[-1]


# ---- client-side times -----------------------------------------------------------------------------------
def test_summary_is_made_from_the_client_recorded_token_times(stub):
    """Outputs of 4, 5, 6 tokens in chunks of 2 (usage in every chunk): each chunk's tokens share its arrival
    time, so 7 of the 12 gaps are zeros (within chunks: 2 + 2 + 3); every TTFT is at least FIRST_DELAY and every
    E2E at least FIRST_DELAY + GAP per later chunk; the summary's TTFT/E2E/TPOT are the means of the recorded times."""
    rows = [(0.0, 3, 4), (0.0, 4, 5), (0.0, 5, 6)]
    recs = records_for(rows)
    cfg = loadgen.BenchConfig(base_url=stub.url, model="stub")
    asyncio.run(loadgen.run_records(recs, cfg))
    reqs = [r.request for r in recs]
    assert [r.error for r in reqs] == [None] * 3
    assert [r.num_output for r in reqs] == [4, 5, 6]
    chunks = [[2, 2], [2, 2, 1], [2, 2, 2]]
    for r, sizes in zip(reqs, chunks):
        starts = np.cumsum([0, *sizes[:-1]])
        for s, k in zip(starts, sizes):
            assert r.token_times[s:s + k] == [r.token_times[s]] * k  # one chunk, one time
        # the stub sleeps before each chunk it sends: a lower bound, whatever the machine's load
        assert r.first_token_time - r.arrival >= FIRST_DELAY - EARLY
        assert r.finish_time - r.arrival >= FIRST_DELAY + (len(sizes) - 1) * GAP - EARLY
    gaps = np.concatenate([np.diff(r.token_times) for r in reqs])
    assert gaps.size == 12 and (gaps == 0).sum() == 7

    s = loadgen.bench_summary(recs, SloConfig(ttft=None, tpot=None))
    ttft = [r.token_times[0] - r.arrival for r in reqs]
    e2e = [r.token_times[-1] - r.arrival for r in reqs]
    tpot = [(r.token_times[-1] - r.token_times[0]) / (r.num_output - 1) for r in reqs]
    assert s["ttft_ms"]["mean"] == pytest.approx(1e3 * np.mean(ttft))
    assert s["ttft_ms"]["p50"] == pytest.approx(1e3 * sorted(ttft)[1])
    assert s["e2e_ms"]["mean"] == pytest.approx(1e3 * np.mean(e2e))
    assert s["tpot_ms"]["mean"] == pytest.approx(1e3 * np.mean(tpot))
    assert s["itl_ms"]["p50"] == 0.0  # 7 of the 12 gaps are 0
    assert s["output_tokens"] == 15 and s["input_tokens"] == 12 and s["requests"] == 3 and s["failed"] == 0
    assert s["slo_attainment"] == 1.0


def test_tokens_counted_from_the_final_usage_when_chunks_do_not_say():
    """One token per chunk and usage only at the end (vLLM without continuous usage): 1 token per chunk
    with text, and the total is the usage's."""
    s = Stub(per_chunk=1, usage=False)
    try:
        recs = records_for([(0.0, 3, 5)])
        asyncio.run(loadgen.run_records(recs, loadgen.BenchConfig(base_url=s.url, model="stub")))
    finally:
        s.stop()
    r = recs[0].request
    assert r.error is None and r.num_output == 5 and len(set(r.token_times)) == 5


def test_request_body_asks_for_the_trace_lengths(stub):
    recs = records_for([(0.0, 3, 4)])
    asyncio.run(loadgen.run_records(recs, loadgen.BenchConfig(base_url=stub.url, model="stub")))
    body = stub.bodies[0]
    assert body["prompt"] == [0, 1, 2] and body["max_tokens"] == 4 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"]["include_usage"] is True
    assert loadgen.payload(records_for([(0.0, 3, 4)], "text")[0], loadgen.BenchConfig(
        base_url="", model="m", endpoint="/v1/chat/completions"))["messages"] == [
            {"role": "user", "content": "the of and"}]


# ---- failures ----------------------------------------------------------------------------------------------
def test_failures_are_counted_and_written(stub, tmp_path):
    """Five requests: prompt 7 gets a 500, prompt 9 a 429, prompt 11 a stream cut before [DONE]; the other two
    complete. With no SLO, attainment is 2 served of 5 sent = 0.4; the CSV has a row per request, the errors
    in it; the JSON has vLLM's keys."""
    trace = write_trace(tmp_path / "t.csv", [(0.0, 3, 4), (0.0, 7, 4), (0.0, 9, 4), (0.0, BROKEN, 4), (0.0, 5, 6)])
    out, js = tmp_path / "requests.csv", tmp_path / "result.json"
    res = bench("--base-url", stub.url, "--trace", trace, "--request-rate", "inf", "--slo", "none",
                "--out", str(out), "--json", str(js))
    assert res.exit_code == 0, res.output
    assert "failed requests" in res.output
    rows = list(csv.DictReader(out.open()))
    assert [int(r["id"]) for r in rows] == [0, 1, 2, 3, 4]
    assert [r["error"] for r in rows[1:4]] == ["HTTP 500: the stub broke", "HTTP 429: the stub is full",
                                               "the stream ended before data: [DONE]"]
    assert rows[0]["error"] == rows[4]["error"] == ""
    assert [int(r["output_tokens"]) for r in rows] == [4, 0, 0, 2, 6]  # the cut stream got one chunk
    assert [r["attained"] for r in rows] == ["True", "False", "False", "False", "True"]
    result = json.loads(js.read_text())
    for key in ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
                "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
                "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms",
                "p99_e2el_ms", "input_lens", "output_lens", "ttfts", "itls", "errors", "model_id", "max_concurrency"):
        assert key in result, key
    assert result["completed"] == 2 and result["failed"] == 3
    assert result["total_input_tokens"] == 3 + 5 and result["total_output_tokens"] == 4 + 6
    assert result["output_lens"] == [4, 0, 0, 0, 6] and result["errors"][0] == ""
    assert result["bullet"]["slo_attainment"] == pytest.approx(0.4)
    assert result["model_id"] == "stub"


def test_all_failed_is_one_line_and_exit_1(stub, tmp_path):
    trace = write_trace(tmp_path / "t.csv", [(0.0, 7, 4), (0.0, 9, 4)])
    line = one_red_line(bench("--base-url", stub.url, "--trace", trace), code=1)
    assert "all 2 requests failed" in line and "HTTP 500" in line


# ---- bad input ---------------------------------------------------------------------------------------------
def test_bad_input_is_one_line_exit_2(stub, tmp_path):
    trace = write_trace(tmp_path / "t.csv", [(0.0, 3, 4)])
    closed = free_socket()
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    assert "cannot reach the server" in one_red_line(bench("--base-url", f"http://127.0.0.1:{port}",
                                                           "--trace", trace))
    assert "expected http://HOST:PORT" in one_red_line(bench("--base-url", "localhost:8000", "--trace", trace))
    bad = tmp_path / "bad.csv"
    bad.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0,x,3\n")
    assert f"{bad}:2" in one_red_line(bench("--base-url", stub.url, "--trace", str(bad)))
    assert "no such trace" in one_red_line(bench("--base-url", stub.url, "--trace", str(tmp_path / "none.csv")))
    assert "serves stub" in one_red_line(bench("--base-url", stub.url, "--trace", trace, "--model", "other"))
    assert "needs --endpoint /v1/completions" in one_red_line(bench(
        "--base-url", stub.url, "--trace", trace, "--endpoint", "/v1/chat/completions", "--prompt-format", "ids"))
    assert "--request-rate must be a positive" in one_red_line(bench("--trace", trace, "--request-rate", "0"))
    assert "is a folder" in one_red_line(bench("--base-url", stub.url, "--trace", trace, "--out", str(tmp_path)))
    assert stub.bodies == []  # nothing was sent for any of them


def test_api_key_refused_up_front(tmp_path):
    s = Stub(api_key="k")
    try:
        trace = write_trace(tmp_path / "t.csv", [(0.0, 3, 4)])
        assert "give --api-key" in one_red_line(bench("--base-url", s.url, "--trace", trace))
        assert bench("--base-url", s.url, "--trace", trace, "--api-key", "k").exit_code == 0
    finally:
        s.stop()


def test_help_explains_every_flag():
    cmd = typer.main.get_command(app).commands["bench"]
    for p in cmd.params:
        if p.name != "help":
            assert p.help, p.name
    res = runner.invoke(app, ["bench", "--help"])
    assert res.exit_code == 0 and "--request-rate" in res.output and "--max-concurrency" in res.output


# ---- a real server -------------------------------------------------------------------------------------
def test_bench_against_bullet_run_on_the_tiny_model(tmp_path):
    """Six requests, all at once, at most 3 in flight, against `bullet run`'s server (tiny-llama on the CPU):
    every one completes with exactly the trace's prompt and output lengths (ignore_eos), and the server
    ends holding no KV."""
    pytest.importorskip("torch")
    from tests.test_server import Live

    rows = [(0.0, 5, 3), (0.1, 17, 8), (0.2, 40, 1), (0.3, 16, 12), (0.4, 33, 5), (0.5, 64, 20)]
    trace = write_trace(tmp_path / "t.csv", rows)
    live = Live()
    try:
        out, js = tmp_path / "r.csv", tmp_path / "r.json"
        res = bench("--base-url", live.url, "--trace", trace, "--request-rate", "inf", "--max-concurrency", "3",
                    "--out", str(out), "--json", str(js))
        assert res.exit_code == 0, res.output
        live.idle()
        assert live.kv.num_free == live.kv.num_blocks
    finally:
        live.stop()
    got = list(csv.DictReader(out.open()))
    assert [r["error"] for r in got] == [""] * 6
    assert [(int(r["prompt_tokens"]), int(r["output_tokens"])) for r in got] == [(p, o) for _, p, o in rows]
    result = json.loads(js.read_text())
    assert result["completed"] == 6 and result["failed"] == 0 and result["model_id"] == "tiny-llama"
    assert result["total_input_tokens"] == 175 and result["total_output_tokens"] == 49


# ---- one definition of the shared flags ----------------------------------------------------------------
SHARED = {
    ("simulate", "run"): ("policy", "max_num_seqs", "max_batched_tokens", "prefill_sms", "layers_per_step",
                          "slo_margin", "admission_control", "decode_sizes", "model", "gpu", "latency",
                          "block_size", "num_blocks", "gpu_memory_utilization", "prefix_caching"),
    ("simulate", "run", "bench"): ("slo", "slo_ttft", "slo_ttft_per_token", "slo_tpot", "goodput"),
    ("simulate", "bench"): ("trace", "trace_format", "num_requests", "request_rate", "arrival", "cv", "burstiness",
                            "seed", "max_concurrency", "hash_block_size", "metric_percentiles"),
}


@pytest.mark.parametrize("commands, names", SHARED.items())
def test_shared_flags_are_one_definition(commands, names):
    cli = typer.main.get_command(app)
    params = {c: {p.name: p for p in cli.commands[c].params} for c in commands}
    for name in names:
        first = params[commands[0]][name]
        for c in commands[1:]:
            p = params[c][name]
            assert p is not first
            assert shape(p, cli.commands[c]) == shape(first, cli.commands[commands[0]]), (c, name)


def shape(p, command) -> tuple:
    """Names, help, default, bounds and the help line (type and default as shown) of an option."""
    return (p.opts, p.secondary_opts, p.help, p.default, p.rich_help_panel, p.min, p.max,
            p.get_help_record(typer.Context(command)))


def test_run_reads_the_slo_flags_as_simulate_does():
    """bullet run refuses what simulate refuses, with the same words, before any model is loaded."""
    for args, words in ((["--slo-tpot", "nan"], "--slo-tpot must be a finite number"),
                        (["--goodput", "ttft:100", "--slo-tpot", "50"], "give --goodput or --slo-tpot, not both"),
                        (["--prefill-sms", "20"], "--prefill-sms does not apply to --policy chunked")):
        for cmd in ("simulate", "run"):
            line = one_red_line(runner.invoke(app, [cmd, "--model", "tiny-llama", *args]))
            assert words in line, (cmd, line)
