"""The same requests, the same policy code, served twice: on the real GpuExecutor and on the simulator.
Prints (1) the latency model's error on every real launch (measured duration vs the roofline's prediction
for that very batch) and (2) the run's metrics side by side.

    PYTHONPATH=. python3 bench/sim_vs_real.py [--policy chunked static-split] [--num-requests 200] [--rate 5]
    python3 bench/sim_vs_real.py --device cpu --model tiny-llama --num-requests 20   # smoke test of the script

Dummy weights (seeded random), every request generates exactly its trace output length. Prompt ids are
synthetic (per request) unless the trace has prompt hashes: then they are made from the hashes
(`materialize_prompt_ids`), so prompts that share hashed blocks share tokens and the prefix cache can hit.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bullet.config import GPUS, CacheConfig, SchedulerConfig, SloConfig, resolve_model
from bullet.engine import serve
from bullet.kvcache import BlockManager
from bullet.metrics import request_columns, summarize
from bullet.perfmodel import work_of
from bullet.perfmodel.base import step_times
from bullet.perfmodel.roofline import RooflineModel
from bullet.policies import make_scheduler
from bullet.traces import load_trace, materialize_prompt_ids
from simulator import simulate


def launch_errors(results, latency, num_layers):
    """Per launch: (kind, measured s, predicted s). Co-runner: the other lane's launch that overlapped most.
    A fused launch whose first step is not a decode step also gives a "first step" row and a "tail" row
    (its decode steps after the first, per step)."""
    rows = []
    for i, res in enumerate(results):
        b = res.batch
        w = work_of(b, num_layers)
        co, co_sms, best = None, 0, 0.0
        for other in results[max(0, i - 8):i + 8]:
            if other.batch.lane == b.lane:
                continue
            overlap = min(res.end, other.end) - max(res.start, other.start)
            if overlap > best:
                co, co_sms, best = work_of(other.batch, num_layers), other.batch.partition.num_sms, overlap
        sms = b.partition.num_sms
        if b.steps > 1 or b.layers.stop == num_layers:
            per_step = step_times(latency, w, b.steps, sms, co, co_sms)
            pred = float(per_step.sum())
        else:
            pred = float(latency.predict(w, sms, co, co_sms))
        kind = "decode" if w.tokens == w.seqs else ("prefill" if w.tokens > 4 * w.seqs else "mixed")
        rows.append((f"{b.lane}/{kind}", res.end - res.start, pred))
        if b.steps > 1 and w.tokens != w.seqs:
            ends = np.asarray(res.step_ends)
            rows.append((f"{b.lane}/{kind} first step", ends[0] - res.start, float(per_step[0])))
            rows.append((f"{b.lane}/{kind} tail per step", (ends[-1] - ends[0]) / (b.steps - 1),
                         float(per_step[1:].mean())))
    return rows


class HostTimed:
    """Wraps an executor; adds up the host seconds spent inside launch() per lane."""

    def __init__(self, ex) -> None:
        self.ex, self.host = ex, {}

    def __getattr__(self, name):
        return getattr(self.ex, name)

    def launch(self, batch) -> None:
        t = time.perf_counter()
        self.ex.launch(batch)
        self.host[batch.lane] = self.host.get(batch.lane, 0.0) + time.perf_counter() - t


def fresh(args, vocab_size: int):
    """The trace's requests (prompts over ``--max-prompt`` dropped); prompts with trace hashes get real token
    ids made from them, so that shared prefixes are shared tokens on the GPU too."""
    reqs = load_trace(args.trace, num_requests=args.num_requests, rate=args.rate, seed=args.seed,
                      start=args.start, hash_block_size=args.hash_block_size)
    reqs = [r for r in reqs if args.max_prompt is None or r.prompt_len <= args.max_prompt]
    if any(r.hash_ids is not None for r in reqs):
        reqs = materialize_prompt_ids(reqs, vocab_size, seed=args.seed)
    return reqs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policy", nargs="+", default=["chunked", "static-split"])
    ap.add_argument("--trace", default="sharegpt")
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--rate", type=float, default=5.0)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--prefill-sms", type=int, default=96)
    ap.add_argument("--layers-per-step", type=int, default=8)
    ap.add_argument("--max-decode-steps", type=int, default=16)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="")
    ap.add_argument("--start", type=int, default=0, help="skip this many trace rows first")
    ap.add_argument("--max-prompt", type=int, default=None, help="leave out prompts longer than this")
    ap.add_argument("--hash-block-size", type=int, default=512)
    ap.add_argument("--prefix-caching", choices=["on", "off", "both"], default="on",
                    help="run each policy with prefix caching on, off, or both")
    ap.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="build the prefill attention plans before serving (GpuExecutor.warmup)")
    args = ap.parse_args()

    import torch

    from bullet.gpu.executor import GpuExecutor

    spec, gpu = resolve_model(args.model), GPUS["h200"]
    latency = RooflineModel(spec, gpu)
    slo = SloConfig()
    cuda = args.device == "cuda"
    t0 = time.perf_counter()
    ex = GpuExecutor(spec, "dummy", args.device, num_blocks=None if cuda else 4096,
                     gpu_memory_utilization=0.85)
    if args.warmup:
        t1 = time.perf_counter()
        print(f"prefill attention warmed for {ex.warmup()} padded lengths in {time.perf_counter() - t1:.1f} s")
    print(f"executor ready in {time.perf_counter() - t0:.1f} s: {ex.kv.num_blocks} KV blocks"
          + (f", {torch.cuda.get_device_name()}" if cuda else ""))
    report = {}
    runs = [(p, c) for p in args.policy for c in ((True, False) if args.prefix_caching == "both"
                                                  else (args.prefix_caching == "on",))]
    for policy, caching in runs:
        cfg = SchedulerConfig(policy=policy, prefill_sms=args.prefill_sms, layers_per_step=args.layers_per_step
                              if policy != "chunked" else None, max_decode_steps=args.max_decode_steps)
        if cuda:
            t0 = time.perf_counter()
            buckets = [b for b in (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 256)]
            if policy == "chunked":
                ex.capture("all", gpu.num_sms, buckets)
            else:
                ex.capture("decode", gpu.num_sms - args.prefill_sms, buckets)
            torch.cuda.synchronize()
            print(f"{policy}: graphs captured in {time.perf_counter() - t0:.1f} s")
        reqs = fresh(args, spec.vocab_size)
        shift = ex.now() + 0.05  # the executor's clock started at its creation
        for r in reqs:
            r.arrival += shift
        kv = BlockManager(ex.kv.num_blocks, ex.kv.block_size, caching)
        sched = make_scheduler(cfg, spec, gpu, kv, latency)
        results = []
        t0 = time.perf_counter()
        timed = HostTimed(ex)
        done = serve(reqs, sched, timed, on_step=results.append)
        wall = time.perf_counter() - t0
        busy = {}
        for res in results:
            busy[res.batch.lane] = busy.get(res.batch.lane, 0.0) + res.end - res.start
        real = summarize(done, slo, busy, request_columns(done, slo))
        sim = simulate(fresh(args, spec.vocab_size), spec, gpu, cfg,
                       CacheConfig(num_blocks=ex.kv.num_blocks, prefix_caching=caching), slo, latency).summary
        real["prefix_cache_hit_rate"] = sched.hit_tokens / sched.query_tokens if sched.query_tokens else 0.0
        name = f"{policy}, prefix caching {'on' if caching else 'off'}"

        rows = launch_errors(results, latency, spec.num_layers)
        print(f"\n{name}: {len(done)} requests served in {wall:.1f} s wall, {len(results)} launches; host time "
              "in launch(): " + ", ".join(f"{k} {v:.1f} s" for k, v in timed.host.items())
              + "; GPU busy: " + ", ".join(f"{k} {v:.1f} s" for k, v in busy.items()))
        print("latency model on the real launches: kind | launches | median measured ms | median error % | "
              "p10 / p90 error %")
        for kind in sorted({k for k, _, _ in rows}):
            m = np.array([t for k, t, _ in rows if k == kind])
            p = np.array([q for k, _, q in rows if k == kind])
            err = 100 * (p - m) / m
            print(f"  {kind} | {len(m)} | {np.median(m) * 1e3:.2f} | {np.median(err):+.1f} | "
                  f"{np.percentile(err, 10):+.1f} / {np.percentile(err, 90):+.1f}")
        print("metric | real | simulated | sim error %")
        for metric, r_v, s_v in (
                ("TTFT mean ms", real["ttft_ms"]["mean"], sim["ttft_ms"]["mean"]),
                ("TTFT p99 ms", real["ttft_ms"]["p99"], sim["ttft_ms"]["p99"]),
                ("TPOT mean ms", real["tpot_ms"]["mean"], sim["tpot_ms"]["mean"]),
                ("TPOT p99 ms", real["tpot_ms"]["p99"], sim["tpot_ms"]["p99"]),
                ("E2E mean ms", real["e2e_ms"]["mean"], sim["e2e_ms"]["mean"]),
                ("output tok/s", real["output_throughput"], sim["output_throughput"]),
                ("duration s", real["duration_s"], sim["duration_s"]),
                ("prefix hit %", 100 * real["prefix_cache_hit_rate"], 100 * sim["prefix_cache_hit_rate"])):
            print(f"  {metric} | {r_v:.1f} | {s_v:.1f} | " + (f"{100 * (s_v - r_v) / r_v:+.1f}" if r_v else "-"))
        report[name] = {"real": real, "sim": sim, "wall_s": wall,
                          "launches": [(k, t, q) for k, t, q in rows]}
    ex.close()
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, default=float))


if __name__ == "__main__":
    main()
