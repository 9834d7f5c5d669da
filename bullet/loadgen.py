"""Load generation against an OpenAI-compatible server (``bullet bench``): ours, vLLM, SGLang.

Each request of a trace is sent at its arrival time (or when a ``max_concurrency`` slot frees), streamed (SSE),
and recorded client-side as a :class:`~bullet.request.Request`: ``arrival`` is when it was sent, ``token_times``
when each output token reached the client. :mod:`bullet.metrics` then summarises those requests with the very
code ``bullet simulate`` uses; a failed request carries ``Request.error`` and counts as metrics.py counts a
rejected one (no latencies, against attainment).

Tokens per SSE chunk: a server may put several tokens in one chunk (ours streams a fused launch at once). The
count comes from the chunk's cumulative ``usage.completion_tokens`` (``stream_options.continuous_usage_stats``,
which vLLM, SGLang and ours send), else from its ``token_ids``, else one per chunk with text; the final usage
fixes the total (missing tokens are timed at the last chunk). Tokens of one chunk share its arrival time, so
they add inter-token gaps of 0: what the client saw.

Prompts: token ids (``"prompt": [ids]``, which /v1/completions accepts on vLLM, SGLang and ours: the length is
exact and needs no tokenizer), or text (required by /v1/chat/completions): one word per token id from a fixed
list, so equal ids give equal text; the prompt length is then the server's ``usage.prompt_tokens``.
"""

from __future__ import annotations

import asyncio
import csv
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from .config import SloConfig
from .metrics import (
    PERCENTILES,
    atomic_write,
    export_columns,
    inter_token_latencies,
    request_columns,
    summarize,
)
from .request import Request

Endpoint = Literal["/v1/completions", "/v1/chat/completions"]
PromptFormat = Literal["ids", "text"]
ENDPOINTS: tuple[str, ...] = ("/v1/completions", "/v1/chat/completions")
WORDS = ("the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not",
         "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "had", "they", "you",
         "were", "their", "one", "all", "we", "can", "her", "has", "there", "been", "if", "more", "when", "will",
         "would", "who", "so", "no", "time", "out", "up", "about", "into", "than", "them", "only", "new", "some",
         "could", "these", "may", "first", "other", "then")


class BenchError(ValueError):
    """Why the benchmark cannot run (unreachable server, bad URL, unknown model): one line for the user."""


@dataclass(frozen=True, slots=True)
class BenchConfig:
    base_url: str
    model: str
    endpoint: Endpoint = "/v1/completions"
    api_key: str | None = None
    ignore_eos: bool = True  # exactly max_tokens tokens, as the trace asks
    prompt_format: PromptFormat = "ids"
    temperature: float = 0.0
    max_concurrency: int | None = None
    timeout_s: float | None = 600.0  # per request


@dataclass(slots=True)
class Record:
    """One request as the client saw it; ``request.error`` is set when it failed."""

    request: Request
    scheduled: float  # when the trace sends it, seconds from the start
    prompt: list[int] | str = field(repr=False, default="")
    text: str = ""


def normalize_url(base_url: str) -> str:
    """``http://host:port`` without a trailing slash (or ``/v1``, as an OpenAI client's base URL has)."""
    url = base_url.rstrip("/")
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
        raise BenchError(f"--base-url {base_url!r}: expected http://HOST:PORT")
    return url.removesuffix("/v1")


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _error_text(status: int, body: bytes) -> str:
    """``HTTP 429: <the server's message>`` from an OpenAI-shaped (or any) error body, on one line."""
    text = body.decode(errors="replace").strip()
    try:
        err = json.loads(text)
        err = err.get("error", err) if isinstance(err, dict) else err
        text = err.get("message", text) if isinstance(err, dict) else str(err)
    except (json.JSONDecodeError, TypeError, AttributeError):
        pass
    return f"HTTP {status}: {' '.join(str(text).split())[:300]}"


def check_server(base_url: str, api_key: str | None = None, timeout: float = 10.0) -> list[str]:
    """The model ids the server lists (GET /v1/models; [] where it has no such route but /health answers
    200). BenchError naming why otherwise."""
    import urllib.error
    import urllib.request

    url = normalize_url(base_url)

    def get(path: str, headers: dict[str, str]) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(urllib.request.Request(url + path, headers=headers), timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    try:
        status, body = get("/v1/models", _headers(api_key))
        if status == 404 and get("/health", {})[0] == 200:
            return []
    except (OSError, ValueError) as e:  # URLError is an OSError
        why = getattr(e, "reason", None) or str(e) or type(e).__name__
        raise BenchError(f"cannot reach the server at {url}: {why}") from None
    if status in (401, 403):
        raise BenchError(f"{url}/v1/models refused the API key ({_error_text(status, body)}): give --api-key")
    if status != 200:
        raise BenchError(f"{url}/v1/models: {_error_text(status, body)}")
    try:
        return [str(m["id"]) for m in json.loads(body)["data"]]
    except (ValueError, KeyError, TypeError):
        raise BenchError(f"{url}/v1/models: not an OpenAI model list: {body[:200]!r}") from None


def ids_to_text(ids: Sequence[int]) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in ids)


def make_records(requests: Sequence[Request], prompt_format: PromptFormat) -> list[Record]:
    """One record per request (which must have ``prompt_ids``), ordered by id; the record's request is a fresh
    one (no ids kept: the served prompt length may differ for text)."""
    out = []
    for r in sorted(requests, key=lambda r: r.id):
        assert r.prompt_ids is not None, "make_records needs prompt ids (traces.materialize_prompt_ids)"
        prompt = list(r.prompt_ids) if prompt_format == "ids" else ids_to_text(r.prompt_ids)
        out.append(Record(Request(r.id, r.arrival, r.prompt_len, r.max_new_tokens), r.arrival, prompt))
    return out


def payload(rec: Record, cfg: BenchConfig) -> dict:
    body = {"model": cfg.model, "stream": True, "temperature": cfg.temperature, "ignore_eos": cfg.ignore_eos,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    n = rec.request.max_new_tokens
    if cfg.endpoint == "/v1/chat/completions":
        text = rec.prompt if isinstance(rec.prompt, str) else ids_to_text(rec.prompt)
        return {**body, "messages": [{"role": "user", "content": text}], "max_completion_tokens": n}
    return {**body, "prompt": rec.prompt, "max_tokens": n}


def _chunk_text(choice: dict) -> str:
    if "text" in choice:
        return choice.get("text") or ""
    return (choice.get("delta") or {}).get("content") or ""


async def _lines(resp) -> AsyncIterator[str]:
    """The response body's lines as they arrive (split here: aiohttp's own line reader caps a line at 64 KiB)."""
    buf = b""
    async for data in resp.content.iter_any():
        buf += data
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield line.decode("utf-8", "replace").rstrip("\r")
    if buf:
        yield buf.decode("utf-8", "replace")


async def send(session, cfg: BenchConfig, rec: Record, now: Callable[[], float]) -> None:
    """Send one request and stream its answer into ``rec`` (times from ``now``); a failure sets
    ``rec.request.error`` and never raises (except cancellation)."""
    import aiohttp

    req = rec.request
    body = json.dumps(payload(rec, cfg)).encode()  # before the clock starts: a long prompt's ids take a while
    headers = {**_headers(cfg.api_key), "content-type": "application/json"}
    req.arrival = now()
    times = req.token_times
    pieces: list[str] = []
    done, finish, usage = False, None, None
    try:
        async with session.post(cfg.base_url + cfg.endpoint, data=body, headers=headers) as resp:
            if resp.status != 200:
                req.error = _error_text(resp.status, await resp.read())
                return
            async for line in _lines(resp):
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                t = now()
                chunk = json.loads(data)
                if chunk.get("error"):
                    err = chunk["error"]
                    req.error = "server: " + (err.get("message", str(err)) if isinstance(err, dict) else str(err))
                    continue
                usage = chunk.get("usage") or usage
                choices = chunk.get("choices") or []
                new = 0
                for choice in choices:
                    pieces.append(_chunk_text(choice))
                    finish = choice.get("finish_reason") or finish
                    ids = choice.get("token_ids")
                    new += len(ids) if ids is not None else int(bool(_chunk_text(choice)))
                if chunk.get("usage") and chunk["usage"].get("completion_tokens") is not None:
                    new = chunk["usage"]["completion_tokens"] - len(times)
                times.extend([t] * max(new, 0))
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        req.error = f"{type(e).__name__}: {e}".rstrip(": ")
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError) as e:
        req.error = f"malformed stream: {type(e).__name__}: {e}"
    rec.text = "".join(pieces)
    if usage is not None and req.error is None:
        total = usage.get("completion_tokens")
        if isinstance(total, int) and total > len(times) and times:
            times.extend([times[-1]] * (total - len(times)))
        if isinstance(usage.get("prompt_tokens"), int) and usage["prompt_tokens"] > 0:
            req.prompt_len = usage["prompt_tokens"]
    if req.error is None:
        if finish == "abort":
            req.error = "aborted by the server"
        elif not done:
            req.error = "the stream ended before data: [DONE]"
        elif not times:
            req.error = "no output tokens"
    req.num_output = len(times)
    if req.error is not None:
        times.clear()  # a failed request has no latencies (metrics.py leaves it out of them, ITL included)
    elif times:
        req.first_token_time, req.finish_time = times[0], times[-1]


async def run_records(records: Sequence[Record], cfg: BenchConfig, on_done: Callable[[Record], None] | None = None,
                      clock: Callable[[], float] = time.perf_counter) -> None:
    """Send every record at ``scheduled`` seconds after the start (at most ``cfg.max_concurrency`` in flight;
    the others wait and are timed from when they are sent); times in ``records`` are seconds from the start."""
    import aiohttp

    slots = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s, connect=min(10.0, cfg.timeout_s or 10.0))
    # aiohttp, as `vllm bench serve`: under load its client costs ~1.5 ms less of each TTFT than httpx's did
    # (bench/RESULTS.md, thirteenth session)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as client:
        start = clock()

        def now() -> float:
            return clock() - start

        async def one(rec: Record) -> None:
            delay = rec.scheduled - now()
            if delay > 0:
                await asyncio.sleep(delay)
            if slots is None:
                await send(client, cfg, rec, now)
            else:
                async with slots:
                    await send(client, cfg, rec, now)
            if on_done is not None:
                on_done(rec)

        await asyncio.gather(*(one(r) for r in records))


def bench_summary(records: Sequence[Record], slo: SloConfig, percentiles: Sequence[float] = PERCENTILES) -> dict:
    """metrics.summarize over the client-side requests, plus ``failed`` (and an example error). ValueError
    when no request completed."""
    reqs = [r.request for r in records]
    summary = summarize(reqs, slo, percentiles=percentiles)
    summary["failed"] = summary["rejected"]
    summary["failed_example"] = summary["rejected_example"]
    return summary


def _ms_stats(prefix: str, stats: dict[str, float], values: np.ndarray) -> dict[str, float | None]:
    """vLLM's mean/median/std/pN keys of one metric (milliseconds) from the summary's entry."""
    values = values[~np.isnan(values)]
    out = {f"mean_{prefix}_ms": stats["mean"], f"median_{prefix}_ms": stats.get("p50"),
           f"std_{prefix}_ms": float(values.std() * 1e3) if values.size else None}
    out.update({f"{key}_{prefix}_ms": v for key, v in stats.items() if key != "mean"})
    return out


def vllm_result(records: Sequence[Record], summary: dict, slo: SloConfig) -> dict:
    """``vllm bench serve --save-result``'s keys (latencies in ms, per-request lists in seconds), filled from
    the summary; the caller adds the run's settings and our whole summary."""
    reqs = [r.request for r in records]
    cols = request_columns(reqs, slo)
    ok = [r for r in reqs if r.error is None]
    out: dict = {
        "duration": summary["duration_s"], "completed": summary["requests"], "failed": summary["failed"],
        "total_input_tokens": summary["input_tokens"], "total_output_tokens": summary["output_tokens"],
        "request_throughput": summary["request_throughput"], "request_goodput": summary["goodput"],
        "output_throughput": summary["output_throughput"],
        "total_token_throughput": summary["total_token_throughput"],
        "input_lens": [r.prompt_len for r in reqs],
        "output_lens": [r.num_output if r.error is None else 0 for r in reqs],
        "ttfts": [r.first_token_time - r.arrival if r.error is None else 0.0 for r in reqs],
        "itls": [list(np.diff(r.token_times)) if r.error is None else [] for r in reqs],
        "generated_texts": [rec.text for rec in records],
        "errors": [r.error or "" for r in reqs],
    }
    for name, key, values in (("ttft", "ttft_ms", cols["ttft"]), ("tpot", "tpot_ms", cols["tpot"]),
                              ("itl", "itl_ms", inter_token_latencies(ok)), ("e2el", "e2e_ms", cols["e2e"])):
        out.update(_ms_stats(name, summary[key], values))
    return out


CSV_COLUMNS = ("id", "scheduled_s", "arrival_s", "prompt_tokens", "output_tokens", "first_token_s", "finish_s",
               "ttft_ms", "tpot_ms", "e2e_ms", "ttft_slo_ms", "attained", "error")


def write_records_csv(records: Sequence[Record], slo: SloConfig, path) -> None:
    """One row per request, failures included (with their error): the served ones' values are metrics.py's
    per-request columns (``arrival_s`` is when the request was sent)."""
    table = export_columns(request_columns([r.request for r in records], slo))
    row_of = {int(i): k for k, i in enumerate(table["id"])}
    with atomic_write(path) as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for rec in records:
            r = rec.request
            k = row_of.get(r.id)
            if k is None:  # failed: what is known
                w.writerow([r.id, f"{rec.scheduled:.6f}", f"{r.arrival:.6f}", r.prompt_len, r.num_output,
                            "", "", "", "", "", "", False, r.error])
                continue
            vals = [table[c][k] for c in ("first_token_s", "finish_s", "ttft_ms", "tpot_ms", "e2e_ms", "ttft_slo_ms")]
            w.writerow([r.id, f"{rec.scheduled:.6f}", f"{r.arrival:.6f}", r.prompt_len, r.num_output,
                        *("" if np.isnan(v) or np.isinf(v) else f"{v:.6f}" for v in vals),
                        bool(table["attained"][k]), ""])
