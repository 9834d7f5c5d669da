"""Host and GPU time of the causal prefill attention call (``F.scaled_dot_product_attention`` as
bullet/gpu/attention.py calls it: ``[1, H, n, D]`` queries, unexpanded KV heads with ``enable_gqa``) per SDPA
backend. An eager prefill enqueues one such call per layer per prompt, so its host time is paid 32 times per
prompt by the engine thread; py-spy of a live `bullet run` on the H200 found the engine thread in this call
for 15 % of its samples (bench/RESULTS.md, twelfth session).

Host time: calls enqueued while the GPU is held busy by a long sleep kernel (so the host never waits on a full
queue), median per call. GPU time: CUDA events around 20 calls after warm-up. Each backend's output is checked
against a float32 reference first; a backend that cannot run the shape is reported as such.

Then the serving conditions, default backend at ``--cond-length`` (+ 8) tokens: one call's time to its end for
a length new to the process, again, and on a new thread (torch keeps cuDNN's attention plans per thread); the
host time of the call on the main thread or on a
worker thread (the live server's engine thread), on the default stream, on one nested-menu prefill partition's
green-context stream, or alternating over four of them (bullet changes its prefill size slice by slice).
py-spy of the live engine thread attributed about 0.4 ms to each such call (15 % of its samples) where the
first table's conditions give 20-30 us: which condition costs it is what the second table is for.

    python3 bench/sdpa_host.py [--lengths 256 1024 2048 4096] [--model llama-3.1-8b] [--cond-length 1024]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def sdpa(q, k, v, backend):
    """The causal call as bullet/gpu/attention.py makes it, on ``backend`` (None: torch's own choice)."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    if backend is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048, 4096])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--cond-length", type=int, default=1024, help="prompt length of the serving-conditions table")
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend

    from bullet.config import resolve_model

    warnings.filterwarnings("ignore", category=UserWarning)  # SDPA explains each backend it cannot use
    if not torch.cuda.is_available():
        sys.exit("bench/sdpa_host.py needs a CUDA GPU")
    spec = resolve_model(args.model)
    H, KVH, D = spec.heads_per_gpu, spec.kv_heads_per_gpu, spec.head_dim
    dev = torch.device("cuda")
    backends = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    print("| n | backend | host us / call (median) | GPU ms / call | max abs err vs fp32 |")
    print("|---:|---|---:|---:|---:|")
    for n in args.lengths:
        g = torch.Generator(device=dev).manual_seed(n)
        q = torch.randn((1, H, n, D), device=dev, dtype=torch.bfloat16, generator=g)
        k = torch.randn((1, KVH, n, D), device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn((1, KVH, n, D), device=dev, dtype=torch.bfloat16, generator=g)
        rep = H // KVH
        ref = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(rep, 1),
                                             v.float().repeat_interleave(rep, 1), is_causal=True)
        for name, be in backends.items():
            try:
                out = sdpa(q, k, v, be)
                torch.cuda.synchronize()
            except RuntimeError as e:
                print(f"| {n} | {name} | cannot run: {str(e).splitlines()[0][:60]} | | |")
                continue
            err = (out.float() - ref).abs().max().item()

            for _ in range(3):
                sdpa(q, k, v, be)
            torch.cuda.synchronize()
            torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU work ahead of the calls
            host = []
            for _ in range(50):
                t = time.perf_counter()
                sdpa(q, k, v, be)
                host.append(time.perf_counter() - t)
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(20):
                sdpa(q, k, v, be)
            b.record()
            torch.cuda.synchronize()
            print(f"| {n} | {name} | {statistics.median(host) * 1e6:.0f} | {a.elapsed_time(b) / 20:.3f} | "
                  f"{err:.3g} |", flush=True)


    conditions(spec, args.cond_length)


def host_times(q, k, v, streams, calls: int = 64) -> list[float]:
    """Seconds of host time per call, enqueued behind a long sleep kernel on each stream (cycled per call)."""
    import torch

    for st in streams:  # warm each stream (its allocator pool, cuDNN's handle on it)
        with torch.cuda.stream(st):
            sdpa(q, k, v, None)
    torch.cuda.synchronize()
    for st in streams:
        with torch.cuda.stream(st):
            torch.cuda._sleep(1_000_000_000)
    out = []
    for i in range(calls):
        with torch.cuda.stream(streams[i % len(streams)]):
            t = time.perf_counter()
            sdpa(q, k, v, None)
            out.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return out


def first_calls(q, k, v, dev) -> None:
    """Milliseconds of one call to its end (host and GPU) for a sequence length: its first call on this
    thread, again, then the first and second calls on a new thread (torch keeps cuDNN's attention plans per
    thread: a length warmed on one thread is new to another)."""
    import threading

    import torch

    def timed() -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        sdpa(q, k, v, None)
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3

    rows = [("main", "first call of the length", timed()), ("main", "second call", timed())]

    def work() -> None:
        torch.cuda.set_device(dev)
        rows.append(("new thread", "first call (length warm on main)", timed()))
        rows.append(("new thread", "second call", timed()))

    t = threading.Thread(target=work)
    t.start()
    t.join()
    print(f"\n| thread | call | ms to its end |   (n = {q.shape[2]}, default backend)")
    print("|---|---|---:|")
    for where, what, ms in rows:
        print(f"| {where} | {what} | {ms:.2f} |", flush=True)


def conditions(spec, n: int) -> None:
    """The second table: host time per call by thread and stream (see the module's docstring)."""
    import threading

    import torch

    from bullet.gpu.partitions import PartitionMenu

    H, KVH, D = spec.heads_per_gpu, spec.kv_heads_per_gpu, spec.head_dim
    dev = torch.device("cuda", torch.cuda.current_device())
    q = torch.randn((1, H, n + 8, D), device=dev, dtype=torch.bfloat16)  # a length the first table did not run
    k = torch.randn((1, KVH, n + 8, D), device=dev, dtype=torch.bfloat16)
    v = torch.randn((1, KVH, n + 8, D), device=dev, dtype=torch.bfloat16)
    first_calls(q, k, v, dev)
    menu = PartitionMenu.create(dev.index or 0)
    try:
        sizes = [x for x in menu.prefill if x < menu.num_sms]
        picks = [menu.prefill[x].stream for x in sizes[len(sizes) // 4::max(1, len(sizes) // 4)][:4]]
        cases = {"default stream": [torch.cuda.current_stream()], "one green stream": picks[:1],
                 "4 green streams, alternating": picks}
        print(f"\n| thread | stream | host us / call p50 | p90 |   (n = {n}, default backend)")
        print("|---|---|---:|---:|")
        for where in ("main", "worker"):
            for name, streams in cases.items():
                got: list[float] = []
                if where == "main":
                    got = host_times(q, k, v, streams)
                else:
                    def work(streams=streams, got=got):
                        torch.cuda.set_device(dev)
                        got.extend(host_times(q, k, v, streams))
                    t = threading.Thread(target=work)
                    t.start()
                    t.join()
                xs = sorted(got)
                print(f"| {where} | {name} | {statistics.median(xs) * 1e6:.0f} | {xs[int(0.9 * len(xs))] * 1e6:.0f} |",
                      flush=True)
    finally:
        menu.close()


if __name__ == "__main__":
    main()
