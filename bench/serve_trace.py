"""Where a live request's time to first token goes: `bullet run` and `bullet bench` with timestamps on every
stage of the first token's path, per request, on one clock (time.perf_counter, shared by the two processes of
one machine), averaged over the requests served.

Stages: the client sends; the HTTP handler stamps the request (its arrival, where the server's TTFT starts);
the engine thread takes it from the queue; the first launch that samples it starts; the first token is
sampled (where the server's TTFT ends, and the simulator's); that launch returns; the update reaches the event
loop; the client reads the first token. The timestamps come from wrappers around the server's and the load
generator's functions (this script only: nothing in bullet is changed), so the figures carry their small cost.

    python3 bench/serve_trace.py --device cpu --model tiny-llama --num-requests 24 --rate 4

``--out`` keeps the server's log and both sides' timestamps (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

STAGES = [("send", "arrival", "client send -> request stamped (HTTP, parsing)"),
          ("arrival", "add", "stamped -> taken by the engine thread"),
          ("add", "launch", "taken -> first launch sampling it starts"),
          ("launch", "tok0", "launch starts -> first token sampled"),
          ("tok0", "launch_end", "first token sampled -> its launch returns"),
          ("launch_end", "dispatch", "launch returns -> update on the event loop"),
          ("dispatch", "cfirst", "event loop -> client reads the token"),
          ("arrival", "tok0", "server-side TTFT (its /metrics)"),
          ("send", "cfirst", "client TTFT")]


def server_side() -> None:
    """`bullet run` with timestamps written to $TRACE_OUT at exit."""
    import atexit

    from bullet import engine as E
    from bullet.gpu import executor as X
    from bullet.server import app as A
    from bullet.server import runner as R

    pc, ev, rid_key, pending = time.perf_counter, {}, {}, {}

    def stamp(rid, name, t):
        if rid in rid_key:
            ev[rid_key[rid]].setdefault(name, t)

    make_app, generate, submit = A.BulletServer._make_app, A.BulletServer._generate, R.EngineRunner.submit
    add, launch, dispatch = E.Engine.add, X.GpuExecutor.launch, A.BulletServer._dispatch

    def _make_app(self):
        self.runner._server = self
        return make_app(self)

    async def _generate(self, http, body, ids, max_tokens, chat):
        pending[id(self)] = tuple(ids[:16])
        return await generate(self, http, body, ids, max_tokens, chat)

    def _submit(self, req):
        key = pending[id(self._server)]
        rid_key[req.id] = key
        ev[key] = {"arrival": req.arrival + self._server.engine.executor._t0}
        submit(self, req)

    def _add(self, req):
        stamp(req.id, "add", pc())
        return add(self, req)

    def _launch(self, batch):
        t0 = pc()
        launch(self, batch)
        t1 = pc()  # on the CPU the launch runs here; on a GPU this is when it was queued
        for c in batch.chunks:
            if c.sample:
                stamp(c.req_id, "launch", t0)
                stamp(c.req_id, "launch_end_cpu", t1)

    def _dispatch(self, updates):
        t, t0 = pc(), self.engine.executor._t0
        for u in updates:
            if u.token_times:
                stamp(u.request.id, "dispatch", t)
                stamp(u.request.id, "tok0", u.token_times[0] + t0)
        return dispatch(self, updates)

    on_step = A.ServerMetrics.on_step

    def _on_step(self, res):
        t0 = X.GpuExecutor._trace_t0
        for c in res.batch.chunks:
            if c.sample:
                stamp(c.req_id, "launch_end", res.end + t0)
        return on_step(self, res)

    init = X.GpuExecutor.__init__

    def _init(self, *a, **k):
        init(self, *a, **k)
        X.GpuExecutor._trace_t0 = self._t0

    A.BulletServer._make_app, A.BulletServer._generate, R.EngineRunner.submit = _make_app, _generate, _submit
    E.Engine.add, X.GpuExecutor.launch, A.BulletServer._dispatch = _add, _launch, _dispatch
    A.ServerMetrics.on_step, X.GpuExecutor.__init__ = _on_step, _init
    atexit.register(lambda: Path(os.environ["TRACE_OUT"]).write_text(
        json.dumps([{"key": list(k), **v} for k, v in ev.items()])))
    from bullet.cli import main

    sys.argv = ["bullet", *sys.argv[2:]]
    main()


def client_side() -> None:
    """`bullet bench` with each request's send and first-token times written to $TRACE_OUT at exit."""
    import atexit

    from bullet import loadgen

    out, send = [], loadgen.send

    async def _send(client, cfg, rec, now):
        t = time.perf_counter()
        await send(client, cfg, rec, now)
        r = rec.request
        if r.error is None and r.token_times:
            out.append({"key": list(rec.prompt[:16]), "send": t, "cfirst": t + r.token_times[0] - r.arrival})

    loadgen.send = _send
    atexit.register(lambda: Path(os.environ["TRACE_OUT"]).write_text(json.dumps(out)))
    from bullet.cli import main

    sys.argv = ["bullet", *sys.argv[2:]]
    main()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--policy", default="chunked")
    ap.add_argument("--trace", default="sharegpt")
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--port", type=int, default=8131)
    ap.add_argument("--run-args", default="", help="more flags for bullet run, one string")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out" / "serve_trace")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    root = str(Path(__file__).resolve().parents[1])  # this tree's bullet, whatever is installed
    path = {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    env = {**os.environ, **path, "TRACE_OUT": str(args.out / "server.json")}
    with (args.out / "server.log").open("w") as log:
        proc = subprocess.Popen([sys.executable, __file__, "--server-side", "run", "--model", args.model, "--device",
                                 args.device, "--policy", args.policy, "--no-prefix-caching", "--port",
                                 str(args.port), "--log-level", "warning", *args.run_args.split()],
                                stdout=log, stderr=log, env=env)
        for _ in range(600):
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None:
                    sys.exit((args.out / "server.log").read_text()[-3000:])
                time.sleep(0.5)
        load = os.getloadavg()[0]
        subprocess.run([sys.executable, __file__, "--client-side", "bench", "--base-url", url, "--trace", args.trace,
                        "--num-requests", str(args.num_requests), "--request-rate", str(args.rate)],
                       env={**os.environ, **path, "TRACE_OUT": str(args.out / "client.json")}, capture_output=True,
                       check=False)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    server = {tuple(e["key"]): e for e in json.loads((args.out / "server.json").read_text())}
    rows = [{**server[tuple(c["key"])], **c} for c in json.loads((args.out / "client.json").read_text())
            if tuple(c["key"]) in server]
    for r in rows:
        r.setdefault("launch_end", r.get("launch_end_cpu"))
    print(f"{len(rows)} requests served, load average {load:.2f} at the start\n")
    print("| stage | mean ms | median ms |\n|---|---:|---:|")
    for a, b, name in STAGES:
        v = [1e3 * (r[b] - r[a]) for r in rows if r.get(a) is not None and r.get(b) is not None]
        if v:
            print(f"| {name} | {statistics.mean(v):.1f} | {statistics.median(v):.1f} |")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--server-side"]:
        server_side()
    elif sys.argv[1:2] == ["--client-side"]:
        client_side()
    else:
        main()
