"""``bullet run``'s HTTP server on the real executor's CPU path (tiny-llama, dummy weights): the official openai
client streams completions and chats with usage; 50 concurrent streams get exactly their tokens (greedy ones
equal the float64 reference forward, seeded ones equal the same request served alone); a disconnect frees the
request's KV; a burst of 10x the request limit gets only 200s (each complete) and 429s; fuzzed malformed bodies
get 4xx, never 5xx; limits name themselves; /metrics parses; shutdown drains, aborts what is left and exits 0."""

from __future__ import annotations

import asyncio
import csv
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from bullet.config import MODELS, CacheConfig, ConfigError, SchedulerConfig
from bullet.gpu.model import reference_forward
from bullet.gpu.weights import load_weights
from bullet.server import build_server
from bullet.server.tokenizer import ByteTokenizer, simple_chat
from bullet.validate import LAUNCH_COLUMNS

SPEC = MODELS["tiny-llama"]
BYTES = ByteTokenizer(SPEC.vocab_size)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def weights():
    return load_weights(SPEC, "dummy", "cpu", torch.float32, seed=0)  # what build_server loads (seed 0)


def greedy(weights, prompt: list[int], n: int, spec=SPEC) -> list[int]:
    ids, out = list(prompt), []
    for _ in range(n):
        out.append(int(reference_forward(spec, weights, [ids], dtype=torch.float64)[0][-1].argmax()))
        ids.append(out[-1])
    return out


class Live:
    """A BulletServer under uvicorn in a thread, on a free loopback port."""

    def __init__(self, **kw) -> None:
        kw.setdefault("cache", CacheConfig(num_blocks=256))
        kw.setdefault("sched", SchedulerConfig(max_num_seqs=64, max_decode_steps=8))
        self.server = build_server(kw.pop("model", "tiny-llama"), device=kw.pop("device", "cpu"), **kw)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.uv = uvicorn.Server(uvicorn.Config(self.server.app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.uv.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.01)

    @property
    def kv(self):
        return self.server.engine.scheduler.kv

    def idle(self, timeout=60.0) -> None:
        """Wait until every accepted request has ended in the engine (bounded; not a timing assertion)."""
        deadline = time.monotonic() + timeout
        while self.server.outstanding or self.server.engine.held:
            assert time.monotonic() < deadline, "requests still held"
            time.sleep(0.01)

    def metrics(self) -> dict:
        text = httpx.get(self.url + "/metrics").text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
        return out

    def stop(self) -> None:
        self.uv.should_exit = True
        self.thread.join(60)
        self.server.engine.executor.close()


@pytest.fixture(scope="module")
def live():
    s = Live()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def small():
    """Two running seats, two waiting: at most 4 requests outstanding; a 1024-token KV cache."""
    s = Live(cache=CacheConfig(num_blocks=64), sched=SchedulerConfig(max_num_seqs=2, max_decode_steps=8),
             max_waiting=2)
    yield s
    s.stop()


def sse(lines) -> list:
    """``data:`` payloads of an event stream, JSON-decoded; ends at [DONE] (which must come)."""
    out = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            return out
        out.append(json.loads(data))
    raise AssertionError("the stream ended without data: [DONE]")


# ---- the official client ------------------------------------------------------------------------------
def test_openai_client_streams_with_usage(live, weights):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="none")
    want = greedy(weights, BYTES.encode("Hello"), 7)
    chunks = list(client.completions.create(model="tiny-llama", prompt="Hello", max_tokens=7, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == BYTES.decode(want)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.prompt_tokens == 5 and chunks[-1].usage.completion_tokens == 7
    assert chunks[-1].usage.total_tokens == 12

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    prompt = BYTES.encode(simple_chat(messages))
    want = greedy(weights, prompt, 6)
    chunks = list(client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == BYTES.decode(want)
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(prompt), 6)

    whole = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=6, temperature=0)
    assert whole.choices[0].message.content == BYTES.decode(want) and whole.usage.completion_tokens == 6
    whole = client.completions.create(model="tiny-llama", prompt=[72, 105], max_tokens=3, temperature=0)
    assert whole.choices[0].text == BYTES.decode(greedy(weights, [72, 105], 3))
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]


# ---- concurrency --------------------------------------------------------------------------------------
async def _stream(client, url, body) -> tuple[list[int], str, dict]:
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        events = sse([line async for line in r.aiter_lines()])
    ids = [t for e in events if e.get("choices") for t in e["choices"][0]["token_ids"]]
    text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
    return ids, text, events[-1]["usage"]


def stream_all(url: str, bodies: list[dict]) -> list[tuple[list[int], str, dict]]:
    """Send every body at once as a streaming completion; each one's (ids, text, usage)."""
    async def all_at_once():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=len(bodies) + 10)) as client:
            return await asyncio.gather(*(_stream(client, url, b) for b in bodies))

    return asyncio.run(all_at_once())


def test_fifty_concurrent_streams_get_exactly_their_tokens(live, weights):
    rng = np.random.default_rng(11)
    bodies = []
    for i in range(50):
        prompt = [int(x) for x in rng.integers(0, SPEC.vocab_size, int(rng.integers(2, 40)))]
        body = {"prompt": prompt, "max_tokens": int(rng.integers(4, 13)), "stream": True, "return_token_ids": True,
                "stream_options": {"include_usage": True}, "temperature": 0.0}
        if i % 2:
            body.update(temperature=0.9, top_p=0.95, seed=1000 + i)
        bodies.append(body)

    results = stream_all(live.url, bodies)
    for body, (ids, text, usage) in zip(bodies, results):
        assert len(ids) == body["max_tokens"] == usage["completion_tokens"]
        assert usage["prompt_tokens"] == len(body["prompt"])
        assert text == BYTES.decode(ids)
        if body["temperature"] == 0:
            assert ids == greedy(weights, body["prompt"], body["max_tokens"])
        else:  # seeded sampling does not depend on the batch: the same request alone gives the same ids
            alone = httpx.post(live.url + "/v1/completions", json={**body, "stream": False}, timeout=60).json()
            assert ids == alone["choices"][0]["token_ids"]
    live.idle()
    assert live.kv.num_free == live.kv.num_blocks


@pytest.mark.parametrize("policy,extra", [("prefill-first", {}), ("static-split", {"layers_per_step": 1}),
                                          ("naive-concurrent", {}), ("bullet", {"layers_per_step": 1}),
                                          ("chunked", {"async_scheduling": True}),
                                          ("prefill-first", {"async_scheduling": True})])
def test_every_policy_serves_concurrent_streams_exactly(weights, policy, extra):
    s = Live(sched=SchedulerConfig(policy=policy, max_num_seqs=8, max_decode_steps=8, **extra))
    try:
        rng = np.random.default_rng(3)
        bodies = [{"prompt": [int(x) for x in rng.integers(0, SPEC.vocab_size, int(rng.integers(2, 60)))],
                   "max_tokens": int(rng.integers(3, 12)), "stream": True, "return_token_ids": True,
                   "temperature": 0, "stream_options": {"include_usage": True}} for _ in range(12)]
        for body, (ids, _, _) in zip(bodies, stream_all(s.url, bodies)):
            assert ids == greedy(weights, body["prompt"], body["max_tokens"])
        s.idle()
        assert s.kv.num_free == s.kv.num_blocks
        lanes = {dict(lab)["lane"] for name, lab in s.metrics() if name == "bullet:lane_sms"}
        assert lanes == ({"all"} if policy in ("chunked", "prefill-first") else {"prefill", "decode"})
    finally:
        s.stop()


def test_disconnect_frees_the_kv_under_async_scheduling():
    """A client that hangs up mid-stream: its request is held back from planning, dropped once the launches
    holding it (one in flight, one queued) have returned, and its KV freed."""
    s = Live(sched=SchedulerConfig(max_num_seqs=64, max_decode_steps=2, async_scheduling=True))
    try:
        body = {"prompt": "a long one", "max_tokens": 1500, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", s.url + "/v1/completions", timeout=60, json=body) as r:
            got = 0
            for line in r.iter_lines():
                got += line.startswith("data: ")
                if got == 3:
                    break
            assert s.server.engine.held
        s.idle()
        assert not s.kv.tables and s.kv.num_free == s.kv.num_blocks
        s.kv.check()
        assert s.metrics()[("vllm:request_success_total", (("finished_reason", "abort"),))] == 1
    finally:
        s.stop()


def test_a_launch_that_samples_a_first_token_ends_with_it(weights):
    """A fused launch's tokens come out when it ends: live, a launch that samples a request's first token is
    one step, so the token reaches the client when it is sampled (the time TTFT counts); decode launches of
    requests that have their first token still fuse. (Chunked fuses decode steps after a step that completes
    prompts; the split policies never fuse a prefill launch.)"""
    s = Live(sched=SchedulerConfig(max_num_seqs=8, max_decode_steps=8))
    launched = []
    eng = s.server.engine
    record = eng.on_launch

    def on_launch(batch):
        launched.append(batch)
        record(batch)

    eng.on_launch = on_launch
    try:
        rng = np.random.default_rng(5)
        bodies = [{"prompt": [int(x) for x in rng.integers(0, SPEC.vocab_size, int(rng.integers(2, 60)))],
                   "max_tokens": 20, "stream": True, "return_token_ids": True, "temperature": 0,
                   "ignore_eos": True, "stream_options": {"include_usage": True}} for _ in range(6)]
        for body, (ids, _, _) in zip(bodies, stream_all(s.url, bodies)):
            assert ids == greedy(weights, body["prompt"], body["max_tokens"])
        s.idle()
    finally:
        s.stop()
    firsts = [b for b in launched if any(c.sample and c.num_tokens > 1 for c in b.chunks)]
    assert firsts and all(b.steps == 1 for b in firsts)
    assert any(b.steps > 1 for b in launched)  # decode launches still fuse


@pytest.mark.parametrize("device", ["foo", "tpu:0", ""])
def test_an_unknown_device_is_refused_by_name(device):
    with pytest.raises(ConfigError, match="--device"):
        build_server("tiny-llama", device=device)


@pytest.mark.parametrize("sched", [SchedulerConfig(policy="static-split", layers_per_step=8),
                                   SchedulerConfig(policy="chunked", async_scheduling=True)])
def test_device_sim_paces_an_h200_without_a_model(sched):
    """``--device sim``: Llama-3.1-8B on a simulated H200 (no weights, no torch work): streams complete with
    their usage, the placeholder ids are each position's letter, the KV is freed, the policy's lanes were used
    (with async scheduling too: launches queued behind the one in flight)."""
    s = Live(model="llama-3.1-8b", device="sim", sched=sched)
    try:
        prompt = list(range(65, 65 + 40))
        bodies = [{"prompt": prompt, "max_tokens": 6, "stream": True, "return_token_ids": True,
                   "stream_options": {"include_usage": True}} for _ in range(4)]
        for ids, text, usage in stream_all(s.url, bodies):
            # positions 40..45 of each request: 'a' + position % 26
            assert ids == [97 + p % 26 for p in range(40, 46)] and text == "opqrst"
            assert usage == {"prompt_tokens": 40, "completion_tokens": 6, "total_tokens": 46}
        s.idle()
        assert s.kv.num_free == s.kv.num_blocks
        lanes = {dict(lab)["lane"] for name, lab in s.metrics() if name == "bullet:lane_sms"}
        assert lanes == ({"all"} if sched.policy == "chunked" else {"prefill", "decode"})
        if sched.async_scheduling:
            assert s.server.engine.scheduler.ahead.planned > 0
    finally:
        s.stop()


def test_launch_log_holds_every_launch_of_both_lanes(tmp_path):
    """``keep_launches`` (``bullet run --launch-log``) on the simulated device with static-split: one row per
    launch the server measured (its /metrics count, per lane), in start order, each lane on its own SMs, the
    overlapped fraction in [0, 1]."""
    s = Live(model="llama-3.1-8b", device="sim", sched=SchedulerConfig(policy="static-split", layers_per_step=8),
             keep_launches=True)
    try:
        bodies = [{"prompt": [65 + i] * 300, "max_tokens": 12, "stream": True, "return_token_ids": True,  # distinct
                   "stream_options": {"include_usage": True}} for i in range(6)]
        stream_all(s.url, bodies)
        s.idle()
        counts = {dict(lab)["lane"]: v for (name, lab), v in s.metrics().items()
                  if name == "bullet:launch_measured_seconds_count"}
        n = s.server.metrics.write_launch_log(tmp_path / "launches.csv")
    finally:
        s.stop()
    with (tmp_path / "launches.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert n == len(rows) == sum(counts.values())
    by_lane = {lane: [r for r in rows if r["kind"].startswith(lane + "/")] for lane in ("prefill", "decode")}
    assert {lane: len(v) for lane, v in by_lane.items()} == counts
    assert {r["sms"] for r in by_lane["prefill"]} == {"92"} and {r["sms"] for r in by_lane["decode"]} == {"40"}
    starts = [float(r["start_s"]) for r in rows]
    assert starts == sorted(starts)
    assert all(0.0 <= float(r["overlap"]) <= 1.0 for r in rows)
    assert sum(int(r["tokens"]) for r in by_lane["prefill"]) == 6 * 300 * 4  # 4 slices of 8 layers each


def test_a_first_token_is_handed_over_before_the_next_launch():
    """The engine thread hands a step's updates to the event loop after launching the idle lanes, except when
    they carry a request's first token: those go right after the step, so TTFT does not wait for the next
    launch's host work. Steps, launches and deliveries are logged in order on the simulated device."""
    s = Live(model="llama-3.1-8b", device="sim", sched=SchedulerConfig(policy="static-split", layers_per_step=8))
    eng, runner, order = s.server.engine, s.server.runner, []
    step, launch_idle, deliver = eng.step, eng.launch_idle, runner.deliver

    def logged(name, fn):
        def call(*a, **kw):
            order.append(name)
            return fn(*a, **kw)
        return call

    def logged_deliver(ups):
        first = any(u.token_times and u.token_times[0] == u.request.first_token_time for u in ups)
        order.append("deliver first" if first else "deliver")
        deliver(ups)

    eng.step, eng.launch_idle, runner.deliver = logged("step", step), logged("launch", launch_idle), logged_deliver
    try:
        bodies = [{"prompt": [70 + i] * 200, "max_tokens": 8, "stream": True, "return_token_ids": True,
                   "stream_options": {"include_usage": True}}
                  for i in range(4)]  # distinct prompts (no prefix hits), 8 tokens each: never idle at a first
        stream_all(s.url, bodies)
        s.idle()
    finally:
        s.stop()
    firsts = [i for i, e in enumerate(order) if e == "deliver first"]
    assert firsts and all(order[i - 1] == "step" for i in firsts)
    assert all(order[i + 1] == "launch" for i in firsts)
    last_step = max(i for i, e in enumerate(order) if e == "step")  # after it, the idle engine's last updates
    others = [i for i, e in enumerate(order) if e == "deliver" and i < last_step]
    assert others and all(order[i - 1] == "launch" for i in others)


def test_first_tokens_wake_their_streams_before_the_others():
    """A step's updates reach the event loop together; the streams getting their first token are woken first
    (each woken stream costs the loop tens of us: behind 60 others, a first token waited ~3 ms on a 2-core VM),
    the others in the engine's order. Metrics count every update once."""
    from bullet.engine import Update
    from bullet.request import Request

    s = build_server("llama-3.1-8b", device="sim")
    woken: list[int] = []

    class Gen:
        def __init__(self, rid):
            self.queue = type("Q", (), {"put_nowait": lambda _self, u, rid=rid: woken.append(rid)})()

    reqs = [Request(i, 0.0, 10, 5) for i in range(5)]
    for r in reqs:
        s.streams[r.id] = Gen(r.id)
    s._last_token.update({0: 0.010, 2: 0.010, 4: 0.010})  # 0, 2 and 4 streamed before; 1 and 3 are new
    s._dispatch([Update(r, (7,), (0.020,)) for r in reqs])
    assert woken == [1, 3, 0, 2, 4]
    assert all(s._last_token[r.id] == 0.020 for r in reqs)
    s._dispatch([Update(r, (8,), (0.030,)) for r in reversed(reqs)])  # nobody new: the engine's order
    assert woken[5:] == [4, 3, 2, 1, 0]


def test_warm_up_runs_on_the_engine_thread_before_the_server_starts():
    """torch keeps cuDNN's attention plans per thread: the executor warms up on the engine thread, the one that
    serves, and the server answers only after it has; a warm-up that fails stops the start-up with its error
    (run_http raises it; `bullet run` prints it as one line)."""
    from bullet.server.app import run_http

    server = build_server("tiny-llama", device="cpu", cache=CacheConfig(num_blocks=256))
    ex, seen = server.runner._wait.inner, []
    ex.warmup = lambda: seen.append(threading.current_thread().name) or time.sleep(0.2)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(server.app, log_level="warning", lifespan="on"))
    t = threading.Thread(target=uv.run, kwargs={"sockets": [s]}, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 60
        while not uv.started:
            assert time.monotonic() < deadline and t.is_alive(), "the server did not start"
            time.sleep(0.001)
        assert seen == ["bullet-engine"]  # ran, once, on the engine thread, before the server started
    finally:
        uv.should_exit = True
        t.join(60)
        ex.close()

    bad = build_server("tiny-llama", device="cpu", cache=CacheConfig(num_blocks=256))
    bad_ex = bad.runner._wait.inner

    def broken():
        raise RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED")

    bad_ex.warmup = broken
    try:
        with pytest.raises(RuntimeError, match="start-up failed: RuntimeError: CUBLAS_STATUS_EXECUTION_FAILED"):
            run_http(bad, port=free_port(), log_level="critical")
    finally:
        bad_ex.close()
    assert bad.runner.join(5)


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_frees_the_kv(live, stream):
    before = live.metrics().get(("vllm:request_success_total", (("finished_reason", "abort"),)), 0.0)
    body = {"prompt": "a long one", "max_tokens": 1500, "stream": stream, "ignore_eos": True}
    if stream:
        with httpx.stream("POST", live.url + "/v1/completions", timeout=60, json=body) as r:
            lines = r.iter_lines()
            got = 0
            for line in lines:
                got += line.startswith("data: ")
                if got == 2:
                    break
            assert live.server.engine.held  # it is being generated
    else:  # the client hangs up while the whole answer is being generated
        data = json.dumps(body).encode()
        host, port = live.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
            deadline = time.monotonic() + 60
            while not live.server.engine.held:
                assert time.monotonic() < deadline, "the request never reached the engine"
                time.sleep(0.005)
    live.idle()  # the client went away: the engine aborted it (bounded wait, see Live.idle)
    kv = live.kv
    assert not kv.tables and kv.num_free == kv.num_blocks
    kv.check()
    after = live.metrics()[("vllm:request_success_total", (("finished_reason", "abort"),))]
    assert after == before + 1


def test_burst_gets_only_200_and_429(small, weights):
    """Two long streams hold two of the four places; a burst of 40 (10x the limit) then gets 200s (complete,
    exact) and 429s with Retry-After, nothing else."""
    prompt = [5, 6, 7]
    want = greedy(weights, prompt, 8)

    async def burst():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=50)) as client:
            holders = []
            for _ in range(2):
                cm = client.stream("POST", small.url + "/v1/completions", json={
                    "prompt": "hold", "max_tokens": 1000, "stream": True, "ignore_eos": True})
                r = await cm.__aenter__()
                assert r.status_code == 200
                lines = r.aiter_lines()
                async for line in lines:
                    if line.startswith("data: "):
                        break
                holders.append(cm)

            async def one(i):
                body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True,
                        "stream": bool(i % 2)}
                if not body["stream"]:
                    r = await client.post(small.url + "/v1/completions", json=body)
                    return r.status_code, r.headers, (r.json()["choices"][0]["token_ids"]
                                                      if r.status_code == 200 else None)
                async with client.stream("POST", small.url + "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        await r.aread()
                        return r.status_code, r.headers, None
                    events = sse([line async for line in r.aiter_lines()])
                    return 200, r.headers, [t for e in events for t in e["choices"][0]["token_ids"]]

            out = await asyncio.gather(*(one(i) for i in range(40)))
            for cm in holders:
                await cm.__aexit__(None, None, None)
            return out

    out = asyncio.run(burst())
    codes = [c for c, _, _ in out]
    assert set(codes) <= {200, 429} and codes.count(429) >= 1 and codes.count(200) >= 1
    for code, headers, ids in out:
        if code == 200:
            assert ids == want
        else:
            assert int(headers["retry-after"]) >= 1
    small.idle()
    assert small.kv.num_free == small.kv.num_blocks


# ---- bad input ----------------------------------------------------------------------------------------
def post(live, path, body, **kw):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(live.url + path, content=data, headers={"content-type": "application/json"}, timeout=60, **kw)


def error_of(r) -> tuple[int, str, str | None]:
    e = r.json()["error"]
    return r.status_code, e["message"], e["param"]


def test_limits_and_malformed_fields_are_named(small):
    code, msg, param = error_of(post(small, "/v1/completions", {"prompt": [1] * 2049, "max_tokens": 1}))
    assert code == 400 and "maximum context length is 2048" in msg and param == "prompt"
    code, msg, param = error_of(post(small, "/v1/completions", {"prompt": [1] * 900, "max_tokens": 200}))
    assert code == 400 and "KV cache holds 1024 tokens" in msg and param == "max_tokens"
    code, msg, _ = error_of(post(small, "/v1/chat/completions", {"messages": [{"role": "user",
                                                                               "content": "x" * 1100}]}))
    assert code == 400 and "KV cache holds 1024" in msg
    cases = [
        (b"{not json", 400, None, "not valid JSON"),
        ([1, 2], 400, None, "JSON object"),
        ({"prompt": 5}, 400, "prompt", "prompt"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
        ({"prompt": "x", "max_tokens": "3"}, 400, "max_tokens", "max_tokens"),
        ({"prompt": "x", "temperature": "hot"}, 400, "temperature", "temperature"),
        ({"prompt": "x", "top_p": 0}, 400, "top_p", "top_p"),
        ({"prompt": "x", "n": 2}, 400, "n", "n:"),
        ({"prompt": "x", "logprobs": 3}, 400, "logprobs", "logprobs"),
        ({"prompt": [1, 999]}, 400, "prompt", "vocabulary"),
        ({"prompt": []}, 400, "prompt", "empty"),
        ({"prompt": "x", "stop": [""]}, 400, "stop", "stop"),
        ({"prompt": "x", "model": "gpt-9"}, 404, "model", "does not exist"),
        ({"prompt": "x", "stream_options": {"include_usage": 1}}, 400, "stream_options.include_usage", "include"),
    ]
    for body, status, param, text in cases:
        code, msg, got_param = error_of(post(small, "/v1/completions", body))
        assert (code, got_param) == (status, param) and text in msg, (body, code, msg)
    code, msg, param = error_of(post(small, "/v1/chat/completions", {"messages": []}))
    assert code == 400 and param == "messages"
    code, msg, param = error_of(post(small, "/v1/chat/completions", {"messages": [{"role": "king", "content": "x"}]}))
    assert code == 400 and param == "messages[0].role"
    code, msg, _ = error_of(post(small, "/v1/chat/completions",
                                 {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}))
    assert code == 400 and "text parts" in msg
    assert post(small, "/detokenize", {"tokens": [-1]}).status_code == 400
    assert post(small, "/tokenize", {"prompt": "\ud800"}).status_code == 400
    r = post(small, "/tokenize", {"messages": []})  # found by the fuzz test below: it was a 500
    assert r.status_code == 400 and "messages" in r.text


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)
FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop",
          "stop_token_ids", "ignore_eos", "n", "stream", "stream_options", "model", "logprobs", "return_token_ids",
          "tokens", "add_special_tokens"]
VALID = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "tokens": [1, 2]}


@st.composite
def bodies(draw):
    """Mostly-valid bodies with some fields replaced by arbitrary JSON, or arbitrary bytes."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=64))
    body = {k: v for k, v in VALID.items() if draw(st.booleans())}
    for key in draw(st.lists(st.sampled_from(FIELDS) | st.text(max_size=6), max_size=4)):
        body[key] = draw(JSON)
    for key in ("max_tokens", "max_completion_tokens"):  # keep valid generations short (the KV holds 1024)
        if isinstance(body.get(key), int) and not isinstance(body[key], bool) and 4 < body[key] <= 1024:
            body[key] = 4
    if not isinstance(body.get("max_tokens"), int) and "messages" in body:
        body.setdefault("max_completion_tokens", 4)
    return body


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]), body=bodies())
def test_fuzzed_bodies_never_get_a_5xx(small, path, body):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(small.url + path, content=data, headers={"content-type": "application/json"}, timeout=120)
    assert r.status_code < 500, (body, r.text)
    if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
        events = sse(r.text.splitlines())
        assert events and all("choices" in e or "error" in e for e in events)
    elif r.status_code == 200 and path.startswith("/v1"):
        out = r.json()
        assert out["usage"]["completion_tokens"] >= 1 and out["choices"][0]["finish_reason"] in ("stop", "length")
    elif r.status_code >= 400:
        assert r.json()["error"]["code"] == r.status_code
    assert small.server.runner.alive


def test_api_key(weights):
    s = Live(api_key="sekrit")
    try:
        r = httpx.get(s.url + "/v1/models")
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        assert httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer sekrit"}).status_code == 200
        assert httpx.get(s.url + "/health").status_code == 200
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 401
    finally:
        s.stop()


# ---- text: stops ----------------------------------------------------------------------------------------
def test_stop_token_ids_and_stop_strings(live, weights):
    prompt = [40, 41, 42, 43]
    ref = greedy(weights, prompt, 24)
    k = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i])
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "return_token_ids": True,
            "stop_token_ids": [ref[k]]}
    out = post(live, "/v1/completions", body).json()
    choice = out["choices"][0]
    assert choice["token_ids"] == ref[:k] and choice["finish_reason"] == "stop" and choice["stop_reason"] == ref[k]
    assert out["usage"]["completion_tokens"] == k + 1 and choice["text"] == BYTES.decode(ref[:k])

    text = BYTES.decode(ref)
    j = next(i for i in range(3, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    stop = text[j:j + 2]
    for stream in (False, True):
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "stop": ["never-seen", stop], "stream": stream}
        r = post(live, "/v1/completions", body)
        if stream:
            events = sse(r.text.splitlines())
            got = "".join(e["choices"][0]["text"] for e in events)
            choice = events[-1]["choices"][0]
        else:
            choice = r.json()["choices"][0]
            got = choice["text"]
        assert got == text[:text.find(stop)] and choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    live.idle()


# ---- a model folder: tokenizer.json, chat template, end ids ---------------------------------------------
def make_folder(tmp: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=280, special_tokens=["<s>", "</s>", "<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    tok.save(str(tmp / "tokenizer.json"))
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 300,
           "max_position_embeddings": 512, "rope_theta": 10000.0, "eos_token_id": 1}
    (tmp / "config.json").write_text(json.dumps(cfg))
    template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}"
                "{{ raise_exception('no tools here') }}{% endif %}[{{ m['role'] }}] {{ m['content'] }}\n"
                "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")
    (tmp / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"},
                                                           "chat_template": template}))
    (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    return tmp


def test_model_folder_tokenizer_and_chat_template(tmp_path):
    folder = make_folder(tmp_path)
    s = Live(model=str(folder), cache=CacheConfig(num_blocks=64))
    try:
        tok = s.server.tokenizer
        assert tok.eos_token_id == 1 and tok.stop_token_ids == {1, 2}
        assert s.server.engine.scheduler.eos_token_id == 1
        r = post(s, "/tokenize", {"messages": [{"role": "user", "content": "the fox"}]}).json()
        rendered = "<s>[user] the fox\n[assistant] "
        assert r["tokens"] == tok.encode(rendered, add_special_tokens=False) and r["tokens"][0] == 0
        assert post(s, "/detokenize", {"tokens": tok.encode("lazy dog")}).json()["prompt"] == "lazy dog"
        code, msg, _ = error_of(post(s, "/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}))
        assert code == 400 and "no tools here" in msg
        out = post(s, "/v1/chat/completions", {"messages": [{"role": "user", "content": "the fox"}], "max_tokens": 5,
                                                "temperature": 0, "return_token_ids": True}).json()
        ids = out["choices"][0]["token_ids"]
        spec = s.server.engine.scheduler.model
        ref_w = load_weights(spec, "dummy", "cpu", torch.float32, seed=0)
        ref = greedy(ref_w, r["tokens"], 5, spec)
        cut = next((i for i, t in enumerate(ref) if t in (1, 2)), None)  # an end id stops it early
        assert ids == (ref if cut is None else ref[:cut])
        assert out["choices"][0]["message"]["content"] == tok.decode(ids)
    finally:
        s.stop()


# ---- metrics ------------------------------------------------------------------------------------------
def test_metrics_parse_with_vllm_names(live):
    post(live, "/v1/completions", {"prompt": "abc", "max_tokens": 5})
    live.idle()
    m = live.metrics()
    names = {name for name, _ in m}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:generation_tokens_total",
                 "bullet:launch_predicted_seconds_count", "bullet:launch_measured_seconds_count",
                 "bullet:request_intake_seconds_count", "bullet:first_token_delivery_seconds_count"):
        assert name in names, name
    assert m[("bullet:lane_sms", (("lane", "all"),))] == 132  # chunked: lane "all", the whole H200
    lane = (("lane", "all"),)
    assert m[("bullet:launch_predicted_seconds_count", lane)] == m[("bullet:launch_measured_seconds_count", lane)] > 0
    assert m[("vllm:num_requests_running", ())] == 0 and m[("vllm:kv_cache_usage_perc", ())] == 0
    served = sum(v for (n, lab), v in m.items() if n == "vllm:request_success_total"
                 and dict(lab)["finished_reason"] in ("stop", "length"))
    assert m[("vllm:e2e_request_latency_seconds_count", ())] == served
    assert m[("vllm:time_to_first_token_seconds_count", ())] >= served  # aborted ones may have had a token
    # every first token's delivery is timed; every request the engine took, its intake
    assert m[("bullet:first_token_delivery_seconds_count", ())] == m[("vllm:time_to_first_token_seconds_count", ())]
    assert m[("bullet:request_intake_seconds_count", ())] >= served


# ---- shutdown -----------------------------------------------------------------------------------------
def test_shutdown_finishes_in_flight_and_refuses_new(weights):
    s = Live()
    try:
        with httpx.stream("POST", s.url + "/v1/completions", timeout=60, json={
                "prompt": [1, 2, 3], "max_tokens": 300, "temperature": 0, "stream": True,
                "return_token_ids": True}) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            s.server.begin_shutdown(60.0)
            refused = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert refused.status_code == 503 and httpx.get(s.url + "/health").status_code == 503
            events = sse([first, *lines])
        ids = [t for e in events for t in e["choices"][0]["token_ids"]]
        assert events[-1]["choices"][0]["finish_reason"] == "length" and len(ids) == 300
    finally:
        s.stop()
    assert s.server.runner.join(5) and not s.thread.is_alive()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_sigterm_aborts_what_is_left_and_exits_zero(tmp_path):
    """`bullet run` as a process, --drain-timeout 0: SIGTERM ends the stream in flight with finish_reason
    "abort" and an error event, and the process exits 0, having written its --launch-log: the one request's
    prompt's launch and then one-token steps, each of that one sequence, on the chunked policy's one lane."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    log = tmp_path / "launches.csv"
    proc = subprocess.Popen([sys.executable, "-m", "bullet.cli", "run", "--model", "tiny-llama", "--device", "cpu",
                             "--port", str(port), "--drain-timeout", "0", "--log-level", "warning",
                             "--launch-log", str(log)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        events = stream_then(url, lambda: proc.send_signal(signal.SIGTERM))
        assert events[-1]["choices"][0]["finish_reason"] == "abort"
        assert any("error" in e and "shut down" in e["error"]["message"] for e in events)
        assert proc.wait(60) == 0
        with log.open() as f:
            rows = list(csv.DictReader(f))
        assert tuple(rows[0]) == LAUNCH_COLUMNS
        assert len(rows) >= 2 and all(r["kind"].startswith("all/") for r in rows)  # (a 2-token prompt reads
        assert all(r["tokens"] == "1" for r in rows[1:])  # as a decode-like launch too)
        assert all(r["seqs"] == "1" and float(r["measured_ms"]) > 0 and r["overlap"] == "0.0" for r in rows)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def stream_then(url: str, act) -> list:
    """Start a long stream, ``act()`` after its first event, return all its events."""
    with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
            "prompt": "x", "max_tokens": 2000, "stream": True, "ignore_eos": True}) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        act()
        return sse([first, *lines])


def test_sigint_in_the_main_thread_drains_and_returns():
    """run_http in this (main) thread: SIGINT begins the drain (new requests 503), the stream in flight
    finishes within --drain-timeout, and run_http returns normally (the command then exits 0)."""
    from bullet.server.app import run_http

    server = build_server("tiny-llama", device="cpu", cache=CacheConfig(num_blocks=256),
                          sched=SchedulerConfig(max_decode_steps=8))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    seen: dict = {}

    def client():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)

        def interrupt():
            os.kill(os.getpid(), signal.SIGINT)
            while not server.closing:
                time.sleep(0.01)
            try:
                seen["late"] = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code
            except httpx.TransportError:
                seen["late"] = "refused"  # the listening socket is closed: no new connections

        with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                "prompt": "x", "max_tokens": 200, "stream": True, "ignore_eos": True}) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            interrupt()
            seen["events"] = sse([first, *lines])

    t = threading.Thread(target=client, daemon=True)
    t.start()
    try:
        run_http(server, port=port, drain_timeout=60.0, log_level="warning")
    finally:
        server.engine.executor.close()
    t.join(30)
    assert seen["late"] in (503, "refused")
    assert seen["events"][-1]["choices"][0]["finish_reason"] == "length"
    assert server.runner.join(5)


def test_launch_gap_counts_back_to_back_launches_of_the_same_requests():
    """``bullet:launch_gap_seconds``: from a lane's launch end to its next launch's start, only when that launch
    goes on with some of the same requests (by hand: 0.3 ms once; a launch of other requests is not a gap)."""
    from bullet.batch import Batch, Chunk, Partition, StepResult
    from bullet.server.metrics import ServerMetrics
    from tests.latency import LinearLatency

    sm = ServerMetrics("m", LinearLatency(2), 2)
    part = Partition("decode", 40)

    def res(ids, start, end):
        batch = Batch(part, range(2), tuple(Chunk(i, 10, 1, (0,), True) for i in ids))
        return StepResult(batch, start, end, [end], None)

    for r in (res((1, 2), 0.0, 1.0), res((2, 3), 1.0003, 1.5), res((9,), 2.0, 2.5)):
        sm.on_step(r)
    get = sm.registry.get_sample_value
    labels = {"model_name": "m", "lane": "decode"}
    assert get("bullet:launch_gap_seconds_count", labels) == 1
    assert get("bullet:launch_gap_seconds_sum", labels) == pytest.approx(3e-4)


def test_policy_events_exported_from_the_schedulers_counters():
    """``bullet:policy_events{event}``: what the policy counts of its own decisions (bullet: prefill jobs set
    aside, requests deferred under overload), set from ``Scheduler.counters()`` after each engine step."""
    from types import SimpleNamespace

    from bullet.server.metrics import ServerMetrics
    from tests.latency import LinearLatency

    sm = ServerMetrics("m", LinearLatency(2), 2)
    kv = SimpleNamespace(num_free=30, num_blocks=40)
    sched = SimpleNamespace(running=[1, 2], waiting=[3], kv=kv,
                            counters=lambda: {"jobs_set_aside": 2, "requests_deferred": 7})
    sm.after_step(SimpleNamespace(scheduler=sched))
    get = sm.registry.get_sample_value
    assert get("bullet:policy_events", {"model_name": "m", "event": "requests_deferred"}) == 7
    assert get("bullet:policy_events", {"model_name": "m", "event": "jobs_set_aside"}) == 2
    assert get("vllm:kv_cache_usage_perc", {"model_name": "m"}) == pytest.approx(0.25)
