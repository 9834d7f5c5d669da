"""Where the engine's host stalls go while serving a trace on the real executor.

    python bench/host_stalls.py --runs arxiv:12 --policies bullet chunked-8192 --repeat 2 [--gc-unfreeze] [--keep-steps]

Serves each (trace, rate, policy) ``--repeat`` times in one process (the first run of a process pays what the
warm-up left undone) and prints, per run: its length, the GPU's idle gaps between launches over ``--gap-ms``,
the launches that took over 1.15x their prediction and 3 ms more, host pieces (one ``GpuExecutor._advance``:
a layer of an eager launch, a graph replay) over ``--piece-ms`` with the Python stack where a watchdog thread
found the engine thread stuck (and, while no lane has work enqueued for over ``--gap-ms``, where the engine
thread is instead), garbage collections over 2 ms by generation, Triton compiles, and the CUDA
allocators' counters. Found on the H200 (bench/RESULTS.md, twenty-second session): host pieces of 110-190 ms in
the first run of a process, and a 178 ms idle gap between two decode launches of a later run; with the lanes
taking turns on the whole GPU each such stall lengthens the run (arxiv, where bullet and chunked prefill tie).

The executor's start-up ends with ``gc.freeze()`` (``freeze_heap``: what it made is out of the collector's
reach); ``--gc-unfreeze`` undoes it before serving, the A/B of that freeze; ``--keep-steps`` keeps every launch's result across runs, as bench/policy_real.py does (its heap grows,
and with it what a full collection walks).
"""

from __future__ import annotations

import argparse
import collections
import gc
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from policy_real import check_runs, policy_cfg, slo_for

from bullet.config import resolve_gpu, resolve_model
from bullet.engine import serve
from bullet.kvcache import BlockManager
from bullet.perfmodel.base import CachedLatency
from bullet.policies import make_scheduler
from bullet.traces import load_trace
from bullet.validate import launch_errors, launch_of
from simulator.run import latency_model

WATCH_S = 0.005  # the watchdog's period


class Watch:
    """Slow host pieces, with stack samples of the engine thread while one runs; GC pauses; Triton compiles."""

    def __init__(self, ex, piece_s: float, gap_s: float) -> None:
        self.ex, self.piece_s, self.gap_s = ex, piece_s, gap_s
        self.serving = False  # set around serve(): the engine thread's stack is sampled while no lane has work
        self.idle_stacks: collections.Counter = collections.Counter()
        self.pieces: list[tuple[str, float, float]] = []  # (lane, ms, executor time)
        self.gcs: list[tuple[int, float]] = []  # (generation, ms)
        self.compiles: list[tuple[str, float]] = []
        self.stacks: collections.Counter = collections.Counter()
        self._t0: float | None = None
        self._gc_t = 0.0
        self._main = threading.get_ident()
        advance = ex._advance

        def timed(f) -> None:
            t = self._t0 = time.perf_counter()
            try:
                advance(f)
            finally:
                self._t0 = None
            d = time.perf_counter() - t
            if d > self.piece_s:
                self.pieces.append((f.batch.lane, 1e3 * d, ex.now()))

        ex._advance = timed
        gc.callbacks.append(self._on_gc)
        self._hook_triton()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        idle_since = None
        while True:
            time.sleep(WATCH_S)
            now = time.perf_counter()
            t = self._t0
            if t is not None and now - t > self.piece_s:
                self._sample(self.stacks)
            if self.serving and not self.ex._inflight:  # no lane has anything enqueued: the GPU idles
                idle_since = idle_since or now
                if now - idle_since > self.gap_s:
                    self._sample(self.idle_stacks, skip_wait=True)
            else:
                idle_since = None

    def _sample(self, into: collections.Counter, skip_wait: bool = False) -> None:
        frame = sys._current_frames().get(self._main)
        if frame is not None:
            tail = traceback.extract_stack(frame)[-5:]
            if skip_wait and tail[-1].name == "wait":  # sleeping to the next arrival: idle with nothing to do
                return
            into[" < ".join(f"{Path(x.filename).name}:{x.lineno} {x.name}" for x in reversed(tail))] += 1

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t = time.perf_counter()
        elif (d := time.perf_counter() - self._gc_t) > 2e-3:
            self.gcs.append((info["generation"], 1e3 * d))

    def _hook_triton(self) -> None:
        try:
            from triton import knobs
        except ImportError:  # no Triton (the CPU) or one without knobs
            return
        started: dict[str, float] = {}

        def pre(**kw):
            started[str(kw.get("key"))] = time.perf_counter()
            return False  # (a true value would skip the compile)

        def post(**kw):
            t = started.pop(str(kw.get("key")), None)
            fn = kw.get("fn")
            self.compiles.append((getattr(fn, "name", None) or getattr(fn, "__name__", "?"),
                                  1e3 * (time.perf_counter() - t) if t else float("nan")))
            return False

        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = pre, post

    def reset(self) -> None:
        self.pieces.clear()
        self.gcs.clear()
        self.compiles.clear()
        self.stacks.clear()
        self.idle_stacks.clear()


def counters(torch, cuda: bool) -> dict[str, float]:
    if not cuda:
        return {}
    out = {f"dev.{k}": v for k, v in torch.cuda.memory_stats().items()
           if k in ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")}
    for k, v in torch.cuda.host_memory_stats().items():
        if isinstance(v, (int, float)) and ("alloc" in k or "free" in k) and "." not in k:
            out[f"host.{k}"] = v
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--gpu", default="h200")
    ap.add_argument("--runs", nargs="+", default=["arxiv:12"], help="TRACE:RATE,RATE,...")
    ap.add_argument("--policies", nargs="+", default=["bullet", "chunked-8192"])
    ap.add_argument("--num-requests", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=2, help="runs of each (trace, rate, policy) in the process")
    ap.add_argument("--latency", default="profiles/h200/llama-3.1-8b/model.json")
    ap.add_argument("--piece-ms", type=float, default=20.0, help="a host piece slower than this is listed")
    ap.add_argument("--gap-ms", type=float, default=5.0, help="an idle GPU gap between launches longer than this")
    ap.add_argument("--gc-unfreeze", action="store_true",
                    help="gc.unfreeze() after start-up: the collector walks start-up's objects again (the A/B of "
                         "the executor's freeze_heap)")
    ap.add_argument("--keep-steps", action="store_true", help="keep every launch's result across runs")
    args = ap.parse_args()
    check_runs(ap, args.runs)
    if args.repeat < 1:
        ap.error(f"--repeat must be at least 1, got {args.repeat}")

    import torch

    from bullet.gpu.executor import GpuExecutor, prepare_graphs

    spec, gpu = resolve_model(args.model), resolve_gpu(args.gpu)
    latency = latency_model(args.latency, spec, gpu)
    cuda = args.device.startswith("cuda")
    ex = GpuExecutor(spec, "dummy", args.device, num_blocks=None if cuda else 4096, gpu_memory_utilization=0.85)
    if cuda:
        ex.warmup()
        for name in args.policies:
            prepare_graphs(ex, policy_cfg(name, None, None), gpu)
        torch.cuda.synchronize()
    if args.gc_unfreeze:
        gc.unfreeze()
    watch = Watch(ex, args.piece_ms / 1e3, args.gap_ms / 1e3)
    kept: list = []
    table = []
    for spec_run in args.runs:
        trace, rates = spec_run.split(":")
        for rate in (float(x) for x in rates.split(",")):
            for name in args.policies:
                for rep in range(args.repeat):
                    cfg = policy_cfg(name, None, None)
                    reqs = load_trace(trace, num_requests=args.num_requests, rate=rate)
                    shift = ex.now() + 0.05
                    for r in reqs:
                        r.arrival += shift
                    kv = BlockManager(ex.kv.num_blocks, ex.kv.block_size, False)
                    sched = make_scheduler(cfg, spec, gpu, kv, CachedLatency(latency), slo=slo_for(trace, "paper"))
                    steps: list = []
                    c0 = counters(torch, cuda)
                    watch.reset()
                    watch.serving = True
                    done = serve(reqs, sched, ex, on_step=steps.append)
                    watch.serving = False
                    c1 = counters(torch, cuda)
                    steps.sort(key=lambda s: s.start)
                    length = max(r.finish_time for r in done) - min(r.arrival for r in done)
                    gaps, end = [], steps[0].end
                    for s in steps[1:]:
                        if s.start - end > args.gap_ms / 1e3:
                            gaps.append((s.start - shift, 1e3 * (s.start - end)))
                        end = max(end, s.end)
                    rows: list[dict] = []
                    launch_errors([launch_of(s, spec.num_layers) for s in steps], latency, spec.num_layers, rows=rows)
                    slow = [r for r in rows if r["measured_ms"] > 1.15 * r["predicted_ms"] and
                            r["measured_ms"] - r["predicted_ms"] > 3]
                    print(f"\n== {trace} {rate:g} req/s {name} run {rep + 1}: {length:.3f} s, {len(steps)} launches")
                    for t, ms in gaps:
                        print(f"  idle gap {ms:.1f} ms before the launch at {t:.3f} s")
                    for r in slow:
                        print(f"  slow launch at {r['start_s'] - shift:.3f} s {r['kind']} {r['tokens']} tokens "
                              f"{r['seqs']} seqs: {r['measured_ms']:.1f} ms, predicted {r['predicted_ms']:.1f}")
                    for lane, ms, t in watch.pieces:
                        print(f"  host piece {ms:.1f} ms on {lane} at {t - shift:.3f} s")
                    for stack, n in watch.stacks.most_common(8):
                        print(f"    stack x{n} ({n * WATCH_S * 1e3:.0f} ms): {stack}")
                    for stack, n in watch.idle_stacks.most_common(8):
                        print(f"    idle stack x{n} ({n * WATCH_S * 1e3:.0f} ms): {stack}")
                    for g, ms in watch.gcs:
                        print(f"  gc generation {g}: {ms:.1f} ms")
                    for fn, ms in watch.compiles:
                        print(f"  triton compile {fn}: {ms:.1f} ms")
                    moved = {k: c1[k] - c0.get(k, 0) for k in c1 if c1[k] != c0.get(k, 0)}
                    if moved:
                        print(f"  allocator counters moved: {moved}")
                    table.append((trace, rate, name, rep + 1, length, len(steps), sum(ms for _, ms in gaps),
                                  len(watch.pieces), sum(ms for _, ms, _ in watch.pieces),
                                  sum(ms for g, ms in watch.gcs if g == 2), len(watch.compiles)))
                    if args.keep_steps:
                        kept.append(steps)
    ex.close()
    print("\n| trace | rate | policy | run | length s | launches | idle gaps ms | slow pieces | their ms "
          "| gen-2 gc ms | compiles |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for t in table:
        print(f"| {t[0]} | {t[1]:g} | {t[2]} | {t[3]} | {t[4]:.3f} | {t[5]} | {t[6]:.0f} | {t[7]} | {t[8]:.0f} "
              f"| {t[9]:.0f} | {t[10]} |")


if __name__ == "__main__":
    main()
