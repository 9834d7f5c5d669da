"""`bullet bench` against a live `bullet run`, next to `bullet simulate` on the same requests (issue 11's GPU
acceptance): for each policy a server is started (prefix caching off, as in the simulation: each rate sends the
same prompts again), each rate's requests are streamed to it by `bullet bench`
(the trace's arrivals rescaled to the rate, ignore_eos so every request generates its trace length), the
server is stopped, and `bullet simulate` runs the same trace, rate, policy and latency model, planning as the
server's engine does (`--fuse-window-ms`: launches end a window ahead, not at the next arrival). Prints failed
requests, TTFT / TPOT (mean, p50, p90) real (client side) vs simulated, and the server's own mean TTFT, ITL and
E2E over the run (its /metrics histograms: request received to token sampled, no HTTP delivery), which tells the
engine's delay from the server's, and the two delays of live serving the simulation does not have: intake
(request received to taken by the engine thread) and first-token delivery (sampled to handed to the event
loop: a launch's tokens come out when it ends); and the mean launch gap (`bullet:launch_gap_seconds`: a lane's
idle time between back-to-back launches of the same requests, the host's time between them), and the mean
launch time the server's latency model predicted against the measured one (`bullet:launch_predicted_seconds`
and `..._measured_seconds`): whether a gap to the simulation is in the launches or between them. Each server
writes `--launch-log` (``--out``/launches_POLICY.csv), summed per launch kind after its runs.

    python3 bench/serve_vs_sim.py --latency MODEL.json --policies chunked static-split bullet --rates 4 8
    python3 bench/serve_vs_sim.py --device cpu --model tiny-llama --policies chunked --rates 4 --num-requests 8 \\
        --skip-oversized
    python3 bench/serve_vs_sim.py --device sim --policies chunked static-split bullet --rates 4 8

``--device sim`` (no GPU): the server's launches take the latency model's time (simulator/paced.py), so what
differs from the simulation is the live path's own cost.

``--out`` gets the server logs, each rate's bench JSON, and results.json (every real and simulated summary).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CLI = [sys.executable, "-m", "bullet.cli"]
POLICY_FLAGS = {"chunked": ["--max-num-batched-tokens", "2048"], "static-split": ["--prefill-sms", "92"],
                "bullet": ["--decode-sizes", "16,32,48,64,80,96,112"],  # 8 sizes of decode graphs, not 15
                "prefill-first": [], "naive-concurrent": []}


SERVER_SIDE = {"ttft": "vllm:time_to_first_token_seconds", "itl": "vllm:inter_token_latency_seconds",
               "e2e": "vllm:e2e_request_latency_seconds", "intake": "bullet:request_intake_seconds",
               "delivery": "bullet:first_token_delivery_seconds", "gap": "bullet:launch_gap_seconds",
               "pred": "bullet:launch_predicted_seconds", "meas": "bullet:launch_measured_seconds"}


def scrape(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of the server's own latency histograms (seconds; its clock: request received to token
    sampled, no delivery), from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for key, name in SERVER_SIDE.items():
            if fam.name == name.removesuffix("_seconds") or fam.name == name:  # summed over labels (lanes)
                total = sum(x.value for x in fam.samples if x.name.endswith("_sum"))
                count = sum(x.value for x in fam.samples if x.name.endswith("_count"))
                out[key] = (total, count)
    return out


def server_means(before: dict, after: dict) -> dict[str, float]:
    """Mean ms of each server-side histogram over one bench run (the difference of two scrapes)."""
    out = {}
    for key in SERVER_SIDE:
        (s0, c0), (s1, c1) = before.get(key, (0.0, 0.0)), after.get(key, (0.0, 0.0))
        out[key] = 1e3 * (s1 - s0) / (c1 - c0) if c1 > c0 else float("nan")
    return out


def launch_summary(path: Path, policy: str, host_gap: tuple[float, float] | None = None) -> str:
    """The server's --launch-log, summed per launch kind (lane/kind, alone or beside the other lane for most of
    its time): launches, predicted and measured seconds; and each lane's gaps between back-to-back launches
    (`bullet.validate.back_to_back`) against the simulator's ``host_gap`` (a, b: a + b x requests)."""
    import csv

    from bullet.validate import back_to_back

    sums: dict[str, list[float]] = {}
    spans = []
    with path.open() as f:
        for r in csv.DictReader(f):
            key = r["kind"] + (" beside" if float(r["overlap"]) > 0.5 else " alone")
            acc = sums.setdefault(key, [0, 0.0, 0.0])
            acc[0] += 1
            acc[1] += float(r["predicted_ms"]) / 1e3
            acc[2] += float(r["measured_ms"]) / 1e3
            start = float(r["start_s"])
            spans.append((r["kind"].split("/")[0], start, start + float(r["measured_ms"]) / 1e3, int(r["seqs"])))
    a, b = host_gap or (0.0, 0.0)
    gaps = back_to_back(spans)
    gap = [len(gaps), sum(a + b * n for _, n in gaps), sum(g for g, _ in gaps)]
    lines = [f"{policy}: launches over all rates (--launch-log {path}), predicted / measured s"]
    for key, (n, p, m) in sorted(sums.items()):
        lines.append(f"  {key:<32} {n:>6} launches  {p:8.2f} / {m:8.2f} ({100 * (p / m - 1):+.1f} %)")
    if gap[0]:
        n, p, m = gap
        lines.append(f"  {'host gap (between launches)':<32} {n:>6} gaps      {p:8.2f} / {m:8.2f} "
                     f"({100 * (p / m - 1):+.1f} %)")
    return "\n".join(lines)


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            sys.exit(f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    proc.kill()
    sys.exit(f"the server was not ready in {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--latency", default="auto", help="latency model of the policies and the simulator")
    ap.add_argument("--policies", nargs="+", default=["chunked", "static-split", "bullet"],
                    help="policies (chunked, prefill-first, static-split, naive-concurrent, bullet); "
                         "'chunked+async', 'prefill-first+async': with --async-scheduling")
    ap.add_argument("--trace", default="sharegpt")
    ap.add_argument("--rates", type=float, nargs="+", default=[4.0, 8.0])
    ap.add_argument("--num-requests", type=int, default=100)
    ap.add_argument("--slo", default="paper-sharegpt")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--skip-oversized", action="store_true",
                    help="simulate without the requests the model cannot hold (the server answers them 400)")
    ap.add_argument("--fuse-window-ms", type=float, default=10.0,
                    help="bullet run --fuse-window-ms; the simulation plans with the same window (bullet simulate "
                         "--fuse-window-ms)")
    ap.add_argument("--sim-plans-to-arrivals", action="store_true",
                    help="simulate as a trace replay (planning to the next arrival) instead of with the server's "
                         "window")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out" / "serve_vs_sim",
                    help="folder for results.json, each run's bench JSON, the server's /metrics after each rate "
                         "(cumulative) and the server logs (git-ignored default)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    common = ["--model", args.model, "--latency", args.latency]
    work = ["--trace", args.trace, "--num-requests", str(args.num_requests), "--slo", args.slo]
    window = ["--fuse-window-ms", str(args.fuse_window_ms)]
    sim_window = [] if args.sim_plans_to_arrivals else window
    from bullet.config import resolve_gpu, resolve_model
    from simulator.run import latency_model

    model_gap = getattr(latency_model(args.latency, resolve_model(args.model), resolve_gpu("h200")), "host_gap", None)
    rows = []
    for policy in args.policies:
        base, _, mode = policy.partition("+")  # "chunked+async": with --async-scheduling
        flags = ["--policy", base, *POLICY_FLAGS.get(base, []), *(["--async-scheduling"] if mode == "async" else [])]
        name = policy.replace("+", "-")
        log = args.out / f"server_{name}.log"
        t0 = time.perf_counter()
        launches = args.out / f"launches_{name}.csv"
        with log.open("w") as lf:
            proc = subprocess.Popen([*CLI, "run", *common, *flags, "--device", args.device, "--slo", args.slo,
                                     "--port", str(args.port), "--log-level", "warning", "--launch-log",
                                     str(launches), "--no-prefix-caching", *window], stdout=lf, stderr=lf)
            wait_ready(url, proc, log, args.ready_timeout)
            print(f"{policy}: server ready in {time.perf_counter() - t0:.0f} s", flush=True)
            real = {}
            for rate in args.rates:
                path = args.out / f"bench_{name}_{rate:g}.json"
                before = scrape(url)
                res = subprocess.run([*CLI, "bench", "--base-url", url, *work, "--request-rate", str(rate),
                                      "--json", str(path)], check=False, capture_output=True, text=True)
                if res.returncode not in (0, 1) or not path.exists():
                    proc.send_signal(signal.SIGTERM)
                    sys.exit(f"bullet bench failed ({res.returncode}):\n{(res.stdout + res.stderr)[-2000:]}")
                real[rate] = json.loads(path.read_text())
                real[rate]["server_side_ms"] = server_means(before, scrape(url))
                with urllib.request.urlopen(url + "/metrics", timeout=10) as r:  # per lane, for a closer look
                    (args.out / f"metrics_{name}_{rate:g}.txt").write_bytes(r.read())
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
        if launches.exists():
            print(launch_summary(launches, policy, model_gap), flush=True)
        for rate in args.rates:
            skip = ["--skip-oversized"] if args.skip_oversized else []
            res = subprocess.run([*CLI, "simulate", *common, *flags, *work, *skip, *sim_window, "--request-rate",
                                  str(rate), "--json"], check=False, capture_output=True, text=True)
            if res.returncode:
                sys.exit(f"bullet simulate failed:\n{res.stderr[-2000:]}")
            sim = json.loads(res.stdout)
            rows.append((policy, rate, real[rate], sim))
    print("\n| policy | rate | failed | TTFT mean real / sim ms (err) | TTFT p50 | TTFT p90 | TPOT mean real / sim ms "
          "(err) | TPOT p50 | TPOT p90 | server-side TTFT / ITL / E2E mean ms | intake / first-token delivery mean ms | "
          "launch gap mean ms | launch predicted / measured mean ms (err) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|")
    (args.out / "results.json").write_text(json.dumps(
        [{"policy": p, "rate": r, "real": real, "sim": sim} for p, r, real, sim in rows], indent=1))
    for policy, rate, real, sim in rows:
        r, s = real["bullet"], sim
        cells = []
        for m in ("ttft_ms", "tpot_ms"):
            for q in ("mean", "p50", "p90"):
                a, b = r[m][q], s[m][q]
                cells.append(f"{a:.1f} / {b:.1f} ({100 * (b / a - 1):+.0f} %)")
        sv = real["server_side_ms"]
        cells.append(f"{sv['ttft']:.1f} / {sv['itl']:.1f} / {sv['e2e']:.1f}")
        cells.append(f"{sv['intake']:.2f} / {sv['delivery']:.2f}")
        cells.append(f"{sv.get('gap', float('nan')):.3f}")
        pm, mm = sv.get("pred", float("nan")), sv.get("meas", float("nan"))
        cells.append(f"{pm:.2f} / {mm:.2f} ({100 * (pm / mm - 1):+.1f} %)")
        print(f"| {policy} | {rate:g} | {real.get('failed', 0)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
