"""Where a live request's time to first token goes outside the engine: `bullet run` with timestamps on the
HTTP path (taken by monkeypatching the server in its own process, so the server code is what ships) under
`bullet bench` load, one request at a time matched by its send time. Stages (ms, mean / p50 / p90):

  send -> ASGI entry      the client's send (its arrival stamp) to uvicorn handing the request to the app
  ASGI entry -> arrival   body read, JSON and field checks, tokenization: the server's arrival stamp
  arrival -> sampled      the engine's TTFT (what `bullet simulate` models)
  sampled -> dispatched   the engine thread hands the token to the event loop
  dispatched -> piece     the request's stream wakes and makes its first chunk
  piece -> client         SSE write, the client's read and parse

    python3 bench/http_path.py [--device sim] [--policy chunked] [--rate 8] [--num-requests 120]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

STAGES = ("send -> ASGI entry", "ASGI entry -> arrival", "arrival -> sampled", "sampled -> dispatched",
          "dispatched -> piece", "piece -> client", "client TTFT")


def serve(log_path: str, run_args: list[str]) -> None:
    """The server with stamps (perf_counter, comparable across processes); written to ``log_path`` at exit."""
    import atexit

    import bullet.server.app as A
    import bullet.server.runner as R
    from bullet.cli import app

    log: dict = {"entry": [], "submit": {}, "dispatch": {}, "piece": {}}
    submit, dispatch, pieces, generate, make = (R.EngineRunner.submit, A.BulletServer._dispatch,
                                                A.Generation.pieces, A.BulletServer._generate,
                                                A.BulletServer._make_app)

    def _submit(self, req):
        log["submit"][req.id] = time.perf_counter()
        return submit(self, req)

    def _dispatch(self, updates):
        now = time.perf_counter()
        for u in updates:
            if u.token_times and u.request.id not in log["dispatch"]:
                log["dispatch"][u.request.id] = (now, now - (self.engine.executor.now() - u.token_times[0]),
                                                 now - (self.engine.executor.now() - u.request.arrival))
        return dispatch(self, updates)

    async def _pieces(self):
        first = True
        async for p in pieces(self):
            if first:
                log["piece"][self.req.id], first = time.perf_counter(), False
            yield p

    async def _generate(self, http, body, ids, max_tokens, chat):
        log["entry"].append(http.scope.get("stamp"))
        return await generate(self, http, body, ids, max_tokens, chat)

    def _make_app(self):
        inner = make(self)

        class Stamp:
            def __init__(self, app):
                self.app = app

            async def __call__(self, scope, receive, send):
                if scope["type"] == "http":
                    scope["stamp"] = time.perf_counter()
                return await self.app(scope, receive, send)

        inner.add_middleware(Stamp)
        return inner

    R.EngineRunner.submit, A.BulletServer._dispatch, A.Generation.pieces = _submit, _dispatch, _pieces
    A.BulletServer._generate, A.BulletServer._make_app = _generate, _make_app
    atexit.register(lambda: Path(log_path).write_text(json.dumps(log)))
    app(["run", *run_args], standalone_mode=False)


def client(rate: float, n: int, port: int) -> list[tuple[float, float]]:
    """``bullet bench``'s requests, each as (send, first token) in perf_counter seconds."""
    import bullet.loadgen as L
    from bullet.cli import app

    out: list[tuple[float, float]] = []
    send = L.send

    async def _send(cl, cfg, rec, now):
        await send(cl, cfg, rec, now)
        off = time.perf_counter() - now()
        if rec.request.first_token_time is not None:
            out.append((rec.request.arrival + off, rec.request.first_token_time + off))

    L.send = _send
    app(["bench", "--base-url", f"http://127.0.0.1:{port}", "--trace", "sharegpt", "--num-prompts", str(n),
         "--request-rate", str(rate), "--ignore-eos"], standalone_mode=False)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="sim")
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--policy", default="chunked")
    ap.add_argument("--rate", type=float, default=8.0)
    ap.add_argument("--num-requests", type=int, default=120)
    ap.add_argument("--port", type=int, default=8124)
    ap.add_argument("--serve", help=argparse.SUPPRESS)  # internal: the server process, logging to this path
    a = ap.parse_args()
    run_args = ["--model", a.model, "--device", a.device, "--policy", a.policy, "--port", str(a.port),
                "--log-level", "warning", "--no-prefix-caching"]
    if a.serve:
        serve(a.serve, run_args)
        return
    import urllib.request

    log = Path(tempfile.mkdtemp()) / "server.json"
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(log), "--device", a.device, "--model", a.model,
                             "--policy", a.policy, "--port", str(a.port)])
    deadline = time.monotonic() + 600
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{a.port}/health", timeout=2)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                sys.exit("the server did not start")
            time.sleep(0.5)
    sent = client(a.rate, a.num_requests, a.port)
    proc.send_signal(2)
    proc.wait(timeout=120)
    s = json.loads(log.read_text())
    subs = sorted((t, int(rid)) for rid, t in s["submit"].items())
    entries = sorted(e for e in s["entry"] if e is not None)
    rows = []
    for send, first in sorted(sent):  # the nearest server stamps not yet matched (requests come in send order)
        _, rid = subs.pop(min(range(len(subs)), key=lambda i: abs(subs[i][0] - send)))
        entry = entries.pop(min(range(len(entries)), key=lambda i: abs(entries[i] - send)))
        d, p = s["dispatch"].get(str(rid)), s["piece"].get(str(rid))
        if d is None or p is None:
            continue
        disp, sampled, arrival = d
        rows.append((entry - send, arrival - entry, sampled - arrival, disp - sampled, p - disp, first - p,
                     first - send))
    x = np.array(rows) * 1e3
    print(f"{a.policy} on {a.device}, {len(rows)} requests at {a.rate:g} req/s (ms)\n")
    print("| stage | mean | p50 | p90 |\n|---|---:|---:|---:|")
    for i, name in enumerate(STAGES):
        print(f"| {name} | {x[:, i].mean():.2f} | {np.median(x[:, i]):.2f} | {np.percentile(x[:, i], 90):.2f} |")


if __name__ == "__main__":
    main()
