"""Issue 9's co-runner sweep on a GPU: ``bullet profile``'s resume of a profile folder with ``--corun-sweep``
(:func:`bullet.gpu.profile.swept_coruns`; the points it already holds are skipped), with the SM clock, memory
clock, board power and temperature sampled through NVML all the while, so that each point's measurement can be
read beside the clocks it ran at (the 700 W cap throttles the SM clock under load: ../bench/RESULTS.md).

    python3 bench/corun_sweep.py [--profile profiles/h200/llama-3.1-8b] [--passes N] [--log DIR]

Writes ``DIR/nvml.csv`` (time s, sm MHz, mem MHz, power W, temperature C, every 50 ms) and ``DIR/points.csv``
(each point's id, the pass it was measured in, its start and end time on the same clock), then prints, per
kind of co-run point, the median SM clock and power while it was measured. Resumable like the profile: run it
again to measure what an interrupted run left.
"""

from __future__ import annotations

import argparse
import csv
import signal
import statistics
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path


def sampler(stop: threading.Event, rows: list, period: float = 0.05) -> None:
    """NVML samples of GPU 0 into ``rows`` until ``stop`` is set (nothing where NVML is missing)."""
    try:
        import pynvml
    except ImportError:
        return
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    while not stop.is_set():
        rows.append((time.perf_counter(), pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                     pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM),
                     pynvml.nvmlDeviceGetPowerUsage(h) / 1e3,
                     pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)))
        stop.wait(period)
    pynvml.nvmlShutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", type=Path, default=Path("profiles/h200/llama-3.1-8b"))
    ap.add_argument("--passes", type=int, default=None, help="co-run passes (default: the profile's own)")
    ap.add_argument("--log", type=Path, default=Path("corun_sweep"))
    ap.add_argument("--device", default="cuda", help="'cuda', or 'cpu' (the tiny model's profile: the code path)")
    args = ap.parse_args()
    if not (args.profile / "metadata.json").exists():
        ap.error(f"{args.profile}: no metadata.json (a profile folder from `bullet profile`)")
    if args.passes is not None and args.passes < 1:
        ap.error("--passes must be >= 1")

    import json

    from bullet.config import resolve_model
    from bullet.gpu.executor import GpuExecutor
    from bullet.gpu.profile import run_profile

    meta = json.loads((args.profile / "metadata.json").read_text())
    opts = meta.get("grid_options", {})
    args.log.mkdir(parents=True, exist_ok=True)
    # `timeout`'s SIGTERM ends the run through the finally below (the logs written), not at once
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    ex = GpuExecutor(resolve_model(meta["model"]), "dummy", args.device, gpu_memory_utilization=0.85,
                     num_blocks=4096 if args.device == "cpu" else None)
    ex.warmup()
    samples: list = []
    stop = threading.Event()
    thread = threading.Thread(target=sampler, args=(stop, samples), daemon=True)
    thread.start()
    times: list[tuple[str, int, float, float]] = []  # id, pass, start, end
    seen: Counter[str] = Counter()
    last = [time.perf_counter()]

    def on_point(done: int, total: int, pid: str) -> None:
        now = time.perf_counter()
        seen[pid] += 1
        if now - last[0] > 0.05:  # (a point already measured reports at once)
            times.append((pid, seen[pid], last[0], now))
            print(f"{done}/{total} {now - last[0]:6.2f} s {pid}", flush=True)
        last[0] = now

    try:
        measured, skipped = run_profile(ex, args.profile, "dummy", meta.get("grid") == "quick", int(meta["reps"]),
                                        on_point, bool(meta.get("prefill_graphs")), False, opts.get("sizes"),
                                        bool(opts.get("twins")), int(opts.get("corun_min", 0)), args.passes,
                                        corun_sweep=True)
    finally:  # the logs first: a run stopped mid-launch may not close the executor cleanly
        stop.set()
        thread.join()
        with (args.log / "nvml.csv").open("a", newline="") as f:
            csv.writer(f).writerows(samples)
        with (args.log / "points.csv").open("a", newline="") as f:
            csv.writer(f).writerows(times)
        ex.close()
    print(f"measured {measured}, skipped {skipped}")
    by: dict[str, list] = defaultdict(list)
    for pid, _, a, b in times:
        if " || " not in pid:
            continue
        inside = [s for s in samples if a <= s[0] <= b]
        if inside:
            head = pid.split(" || ")[0]
            kind = head.split("[")[0] + "@" + head.rsplit("@", 1)[1]  # e.g. prefill@prefill36
            by[kind].append((statistics.median(s[1] for s in inside), statistics.median(s[3] for s in inside)))
    print("| co-run points | n | SM clock MHz (median of points) | power W |")
    print("|---|---:|---:|---:|")
    for kind, v in sorted(by.items()):
        print(f"| {kind} | {len(v)} | {statistics.median(x for x, _ in v):.0f} | {statistics.median(y for _, y in v):.0f} |")


if __name__ == "__main__":
    main()
