"""Host time per launch of the GpuExecutor (issue 12): for each launch kind and request count, the host
seconds spent inside ``launch()``, the GPU seconds between the launch's own events, and where the host time
goes (cProfile over ``--profile-reps`` launches of one request count, top functions by own time, in microseconds
per launch). Then the host cost of single operations the
eager forward is made of (median of many calls, no sync between them).

    python3 bench/host_overhead.py [--counts 1 8 64] [--kinds prefill prefix mixed decode] [--reps 5]
    python3 bench/host_overhead.py --device cpu --model tiny-llama --counts 1 4 --reps 2
    python3 bench/host_overhead.py --kinds mixed --counts 8 48 --prefill-graphs --decode-rows --profile-count 48 \
        --profile-reps 50 [--steady]

Kinds: ``prefill`` n fresh prompts (``--prompt`` tokens each, at most ``--max-tokens`` in all);
``prefix`` n chunks of ``--prompt`` tokens over a cached context of ``--context`` tokens; ``mixed`` n
one-token decode rows (context ``--context``) plus one fresh prompt; ``decode`` n decode rows, eager
(graphs off) and through the decode graphs. ``--attention sdpa``: the SDPA-per-sequence prefill path.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bullet.batch import Batch, Chunk, Partition
from bullet.config import GPUS, resolve_model
from bullet.kvcache import BlockManager


def make_chunks(kind: str, n: int, kv: BlockManager, next_id, prompt: int, context: int, max_tokens: int,
                steady: list[int] | None = None, step: int = 0):
    """One launch's chunks. ``steady``: the decode rows are these requests (allocated by :func:`steady_rows`),
    one position further at each ``step``, as in serving, instead of new requests."""
    chunks = []
    if steady is not None and kind in ("mixed", "decode", "decode-graph"):
        chunks = [Chunk(rid, context + step, 1, kv.tables[rid], True, (1,)) for rid in steady]
        if kind == "mixed":
            rid = next_id()
            chunks.append(Chunk(rid, 0, prompt, kv.allocate(rid, prompt), True))
        return chunks
    if kind == "prefill":
        p = max(1, min(prompt, max_tokens // n))
        for _ in range(n):
            rid = next_id()
            chunks.append(Chunk(rid, 0, p, kv.allocate(rid, p), True))
    elif kind == "prefix":
        p = max(1, min(prompt, max_tokens // n))
        for _ in range(n):
            rid = next_id()
            chunks.append(Chunk(rid, context, p, kv.allocate(rid, context + p), True, tuple(range(p))))
    elif kind in ("mixed", "decode", "decode-graph"):
        for _ in range(n):
            rid = next_id()
            chunks.append(Chunk(rid, context, 1, kv.allocate(rid, context + 1), True, (1,)))
        if kind == "mixed":
            rid = next_id()
            chunks.append(Chunk(rid, 0, prompt, kv.allocate(rid, prompt), True))
    else:
        raise ValueError(kind)
    return chunks


def steady_rows(kv: BlockManager, n: int, next_id, context: int, steps: int) -> list[int]:
    """``n`` requests with KV for ``context + steps`` tokens, decoded launch after launch by ``--steady``."""
    ids = [next_id() for _ in range(n)]
    for rid in ids:
        kv.allocate(rid, context + steps + 1)
    return ids


def launch_at(ex, kv, part, args, kind, n, counter, steady, step, prof=None):
    """One launch of ``kind`` with ``n`` requests (``steady``'s decode rows at ``step``): host s, GPU s, tokens."""
    chunks = make_chunks(kind, n, kv, lambda: next(counter), args.prompt, args.context, args.max_tokens, steady,
                         step)
    h, g = one(ex, kv, Batch(part, range(ex.spec.num_layers), tuple(chunks)), prof, frozenset(steady or ()))
    return h, g, sum(c.num_tokens for c in chunks)


def one(ex, kv, batch: Batch, prof: cProfile.Profile | None = None, keep: frozenset = frozenset()):
    t = time.perf_counter()
    if prof:
        prof.enable()
    ex.launch(batch)
    ex.flush()  # the whole launch enqueued (launch() itself enqueues its first layer)
    if prof:
        prof.disable()
    host = time.perf_counter() - t
    (res,) = ex.wait(None)
    for c in batch.chunks:
        if c.req_id not in keep:
            ex.release(c.req_id)
            kv.free(c.req_id)
    return host, res.end - res.start


def top(prof: cProfile.Profile, k: int, launches: int) -> str:
    """The ``k`` functions with the most own time, per launch: calls, own us, cumulative us."""
    st = pstats.Stats(prof).stats
    rows = sorted(st.items(), key=lambda kv: -kv[1][2])[:k]
    out = ["| function | calls | own us | cumulative us |", "|---|---:|---:|---:|"]
    for (file, line, name), (_, calls, own, cum, _) in rows:
        where = f"{Path(file).name}:{line}({name})" if line else name
        out.append(f"| {where} | {calls / launches:.0f} | {own / launches * 1e6:.1f} | {cum / launches * 1e6:.1f} |")
    return "\n".join(out)


def op_costs(ex, device: str, reps: int = 200) -> list[tuple[str, float]]:
    """Median host microseconds of single calls the eager forward makes (no sync in between)."""
    import torch
    import torch.nn.functional as F

    from bullet.gpu.attention import _prefill_one
    from bullet.gpu.kernels.activation import silu_mul
    from bullet.gpu.kernels.norm import rms_norm
    from bullet.gpu.kernels.rope import rope_and_store

    spec, m = ex.spec, ex.model
    H, KVH, D = spec.heads_per_gpu, spec.kv_heads_per_gpu, spec.head_dim
    T = 64
    x = torch.randn(T, spec.hidden_size, device=device, dtype=ex.dtype)
    layer = m.layers[0]
    qkv = F.linear(x, layer.wqkv)
    pos = torch.arange(T, device=device, dtype=torch.int32)
    slots = torch.arange(T, device=device, dtype=torch.int32)
    kc, vc = ex.kv.layer(0)
    q, k, v = qkv[:, :H * D].view(T, H, D), qkv[:, H * D:(H + KVH) * D].view(T, KVH, D), \
        qkv[:, (H + KVH) * D:].view(T, KVH, D)
    gu = F.linear(x, layer.w_gate_up)
    ops = {
        "empty [T,H]": lambda: torch.empty_like(x),
        "F.linear qkv": lambda: F.linear(x, layer.wqkv),
        "addmm_ o": lambda: x.clone().addmm_(q.reshape(T, H * D), layer.wo.t()),
        "rms_norm (Triton)": lambda: rms_norm(x, layer.ln1, 1e-5),
        "silu_mul (Triton)": lambda: silu_mul(gu),
        "rope_and_store (Triton)": lambda: rope_and_store(qkv, pos, m.cos_sin, kc, vc, slots, H, KVH, D,
                                                          None, None, 1e-5),
        "SDPA causal one seq": lambda: _prefill_one(q, k, v, None, m.scale, {}),
    }
    out = []
    for name, fn in ops.items():
        for _ in range(10):
            fn()
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        if device == "cuda":
            torch.cuda.synchronize()
        out.append((name, statistics.median(ts) * 1e6))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--kinds", nargs="+", default=["prefill", "prefix", "mixed", "decode", "decode-graph"])
    ap.add_argument("--counts", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--attention", choices=["tiles", "sdpa"], default="tiles",
                    help="prefill attention: the one-call kernel over the pool, or SDPA per sequence")
    ap.add_argument("--prefill-graphs", action="store_true",
                    help="capture prefill graphs (every token bucket, all layers, greedy) for the whole GPU first")
    ap.add_argument("--decode-rows", action="store_true",
                    help="with --prefill-graphs: also capture the variant whose decode rows take the decode kernel "
                         "(as chunked's serving does), which mixed launches then replay")
    ap.add_argument("--token-buckets", default="",
                    help="token buckets of the prefill graphs, comma-separated (default: the executor's)")
    ap.add_argument("--profile-top", type=int, default=12, help="functions listed per profiled launch (0: none)")
    ap.add_argument("--profile-count", type=int, default=None,
                    help="request count profiled (default: the middle of --counts)")
    ap.add_argument("--profile-reps", type=int, default=20, help="launches profiled together (per kind)")
    ap.add_argument("--steady", action="store_true",
                    help="mixed/decode: the same decode requests launch after launch, one position further each "
                         "time, as in serving (the executor's per-request block-table copies then hit); default: "
                         "new requests every launch")
    args = ap.parse_args()

    from bullet.gpu.executor import GpuExecutor

    spec, gpu = resolve_model(args.model), GPUS["h200"]
    cuda = args.device == "cuda"
    buckets = {"token_buckets": [int(b) for b in args.token_buckets.split(",")]} if args.token_buckets else {}
    ex = GpuExecutor(spec, "dummy", args.device, num_blocks=None if cuda else 4096, gpu_memory_utilization=0.8,
                     **buckets)
    if args.attention == "sdpa":
        ex.model.prefill_config = {"sdpa": True}
    if cuda:
        ex.warmup(args.max_tokens)
    kv = BlockManager(ex.kv.num_blocks, ex.kv.block_size)
    if args.prefill_graphs:
        import torch

        free0 = torch.cuda.mem_get_info()[0] if cuda else 0
        t = time.perf_counter()
        n = ex.capture_prefill("all", gpu.num_sms if cuda else 1,
                               decode_rows=(False, True) if args.decode_rows else (False,))
        free1 = torch.cuda.mem_get_info()[0] if cuda else 0
        print(f"captured {n} prefill graphs (buckets {ex.prefill_graphs['all'].buckets}) in "
              f"{time.perf_counter() - t:.1f} s, {(free0 - free1) / 2**20:.0f} MiB")
    part = Partition("all", gpu.num_sms if cuda else 1)
    counter = iter(range(1, 10**9))
    rows, profiles = [], []
    for kind in args.kinds:
        ex.use_graphs = cuda and (kind == "decode-graph" or args.prefill_graphs)
        for n in args.counts:
            hosts, gpus = [], []
            reps = args.reps + 1 + args.profile_reps
            steady = steady_rows(kv, n, lambda: next(counter), args.context, reps) \
                if args.steady and kind != "prefill" and kind != "prefix" else None

            for rep in range(args.reps + 1):  # the first is warm-up
                h, g, tokens = launch_at(ex, kv, part, args, kind, n, counter, steady, rep)
                if rep:
                    hosts.append(h)
                    gpus.append(g)
            if args.profile_top and n == (args.profile_count or args.counts[len(args.counts) // 2]):
                prof = cProfile.Profile()
                for k in range(args.profile_reps):
                    launch_at(ex, kv, part, args, kind, n, counter, steady, args.reps + 1 + k, prof)
                profiles.append((kind, n, prof))
            for rid in steady or ():
                ex.release(rid)
                kv.free(rid)
            rows.append((kind, n, tokens, statistics.median(hosts) * 1e3, statistics.median(gpus) * 1e3))
    print("| kind | requests | tokens | host ms in launch() | GPU ms (events) | host / GPU |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind, n, tok, h, g in rows:
        print(f"| {kind} | {n} | {tok} | {h:.2f} | {g:.2f} | {h / g:.2f} |")
    for kind, n, p in profiles:
        print(f"\ncProfile of {args.profile_reps} {kind} launches with {n} requests, per launch (top "
              f"{args.profile_top} by own time; the profiler's own cost inflates small functions):")
        print(top(p, args.profile_top, args.profile_reps))
    print("\n| single call | host us (median) |")
    print("|---|---:|")
    for name, us in op_costs(ex, args.device):
        print(f"| {name} | {us:.1f} |")
    ex.close()


if __name__ == "__main__":
    main()
