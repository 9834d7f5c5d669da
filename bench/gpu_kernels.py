"""Kernel and model-step benchmark on one GPU, Llama-3.1-8B shapes, dummy weights (issue #3 acceptance).

    PYTHONPATH=. python bench/gpu_kernels.py [--out DIR]

Measures the copy / matmul ceilings, then: prefill of 4096 tokens (FLOP/s of linear + attention vs 791
TFLOP/s), a decode step of 128 requests x 1024 context ((weights + KV read) / time vs 4.3 TB/s), and a decode
step at batch 1 vs the weight-read bound; decode steps are CUDA graphs captured on DecodeBuffers (eager too,
for comparison). Also sweeps the paged decode kernel's launch options at 128 x 1024 on one layer and uses the
best for the model steps. Times: CUDA events, median of repeats after warm-up. Prints a table last; writes
JSON to ``--out`` when given.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from bullet.batch import Chunk
from bullet.config import MODELS
from bullet.gpu.attention import DecodeBuffers, build_meta
from bullet.gpu.graphs import LaneGraphs
from bullet.gpu.kernels.decode_attention import paged_decode_attention
from bullet.gpu.kernels.gemv import GEMV_DEFAULT, gemv
from bullet.gpu.kvcache import PagedKvCache
from bullet.gpu.model import Model
from bullet.gpu.sampling import sample
from bullet.gpu.weights import load_weights

COPY_CEILING = 4.3e12  # bytes/s, device copy (reads + writes), measured on the H200 (docs/background.md)
MATMUL_CEILING = 791e12  # bf16 8192^3, measured


def timeit(fn, warmup: int = 3, reps: int = 20) -> float:
    """Median seconds of ``fn`` over ``reps`` runs, each timed with CUDA events around it. The GPU waits for the
    host while ``fn`` enqueues, so this counts the host's launch time too: right for eager paths (what a launch
    costs), wrong for one short kernel (use :func:`graph_time`)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def graph_time(fn, stream=None, reps: int = 20) -> float:
    """Median seconds of one replay of a CUDA graph of ``fn``, captured and replayed on ``stream`` (default:
    the current one; a graph keeps the SMs of the partition it was captured on). Unlike :func:`timeit`
    this leaves out the host's launch work: a Triton launch costs 20-40 us of Python, and a kernel timed
    between two events right after it was launched on an idle GPU counts that as GPU time (the paged decode
    attention at 128 x 1024 read 2.8-3.3 TB/s so against 4.05-4.19 under Nsight Compute, bench/RESULTS.md)."""
    stream = stream or torch.cuda.Stream()  # (capture needs a stream other than the default one)
    with torch.cuda.stream(stream):
        fn()
        fn()
        stream.synchronize()
        g = torch.cuda.CUDAGraph()
        g.capture_begin(capture_error_mode="thread_local")
        try:
            fn()
        finally:
            g.capture_end()
    return replay_time(g, stream, reps)


def replay_time(g, stream, reps: int = 20) -> float:
    """Median seconds of one replay of the CUDA graph ``g`` on ``stream``, after three warm-up replays."""
    with torch.cuda.stream(stream):
        for _ in range(3):
            g.replay()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(stream)
            g.replay()
            b.record(stream)
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def capture(fn):
    """A CUDA graph of ``fn`` (warmed up on a side stream first); returns (graph, output)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def copy_ceiling(n: int = 1 << 30) -> float:
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)  # 2 GiB
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / timeit(lambda: dst.copy_(src), 3, 10)


def matmul_ceiling(n: int = 8192) -> float:
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n**3 / timeit(lambda: x @ y, 3, 10)


def ceilings() -> dict:
    return {"copy_bw": copy_ceiling(), "matmul_flops": matmul_ceiling()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--kv-layout", default="hnd", choices=["hnd", "nhd"], help="KV pool layout (PagedKvCache)")
    ap.add_argument("--quick", action="store_true",
                    help="skip most of the launch-option sweeps (decode attention: 4 configs; GEMV: the default)")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    rows: list[tuple[str, str, str, str]] = []
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        import triton

        res["triton"] = triton.__version__
    except ImportError:
        pass
    c = ceilings()
    res.update(c)
    rows.append(("copy ceiling (2 GiB d2d)", f"{c['copy_bw'] / 1e12:.2f} TB/s", "", ""))
    rows.append(("matmul ceiling (8192^3 bf16)", f"{c['matmul_flops'] / 1e12:.0f} TFLOP/s", "", ""))

    spec = MODELS["llama-3.1-8b"]
    L, H, KVH, D, hid = spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size
    w = load_weights(spec, "dummy", dev, torch.bfloat16, seed=0)
    model = Model(spec, w, dev)
    del w
    torch.cuda.empty_cache()
    B = 16
    T_PRE, BS, CTX = 4096, 128, 1024
    pre_blocks = T_PRE // B
    dec_blocks = BS * CTX // B
    kv = PagedKvCache(spec, dec_blocks + pre_blocks + 1, B, dev, layout=args.kv_layout)
    res["kv_layout"] = args.kv_layout
    kv.k.normal_()
    kv.v.normal_()
    weight_read = spec.weight_bytes - spec.vocab_size * hid * spec.dtype_bytes  # embedding: a few rows only
    res["weight_read_bytes"] = weight_read

    # --- paged decode kernel alone, one layer, 128 x 1024: sweep launch options -------------------------
    perm = torch.randperm(dec_blocks)
    tables = perm.view(BS, CTX // B).to(torch.int32)
    q = torch.randn(BS, H, D, device=dev, dtype=torch.bfloat16)
    bt = tables.to(dev)
    cl = torch.full((BS,), CTX, dtype=torch.int32, device=dev)
    attn_bytes = BS * CTX * KVH * D * 2 * 2
    sweep = {}
    configs = [{"block_n": bn, "num_warps": nw, "num_stages": st, "num_splits": 1, "head_first": hf,
                "offsets32": o32}
               for o32 in (True, False) for hf in (True, False) for bn in (64, 128) for nw in (4, 8) for st in (2, 3)]
    configs += [{"block_n": 64, "num_warps": 4, "num_stages": 3, "num_splits": sp, "head_first": True}
                for sp in (2, 4)]
    if args.quick:
        configs = [c for c in configs if c["num_splits"] == 1 and c["block_n"] == 64 and c["num_warps"] == 4
                   and c["head_first"]]
    for cfg in configs:
        try:
            t = graph_time(lambda cfg=cfg: paged_decode_attention(q, kv.k[0], kv.v[0], bt, cl, D**-0.5, CTX,
                                                                    **cfg), reps=10)
        except Exception as e:  # noqa: BLE001 - a config may not fit (shared memory); report and go on
            print("config", cfg, "failed:", type(e).__name__, str(e)[:200])
            continue
        sweep[json.dumps(cfg)] = attn_bytes / t
    best = max(sweep, key=sweep.get)
    default_bw = attn_bytes / graph_time(lambda: paged_decode_attention(q, kv.k[0], kv.v[0], bt, cl, D**-0.5, CTX))
    res["attn_sweep"] = sweep
    res["attn_default_bw"] = default_bw
    rows.append(("decode attn kernel 128x1024, 1 layer, default", f"{default_bw / 1e12:.2f} TB/s",
                 f"{default_bw / COPY_CEILING:.0%} of 4.3", ""))
    rows.append((f"  best of sweep {best}", f"{sweep[best] / 1e12:.2f} TB/s",
                 f"{sweep[best] / COPY_CEILING:.0%} of 4.3", ""))
    best_cfg = json.loads(best)
    best_cfg.pop("num_splits")
    model.decode_config = best_cfg
    res["decode_config"] = best_cfg

    # --- prefill attention alone: SDPA variants at 4096 tokens (causal, no prefix) -----------------------
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qp = torch.randn(1, H, T_PRE, D, device=dev, dtype=torch.bfloat16)
    kp = torch.randn(1, KVH, T_PRE, D, device=dev, dtype=torch.bfloat16)
    vp = torch.randn(1, KVH, T_PRE, D, device=dev, dtype=torch.bfloat16)
    attn_flops = 4 * H * D * T_PRE * (T_PRE + 1) / 2
    variants = {"default": {}, "flash": {"backends": [SDPBackend.FLASH_ATTENTION]},
                "cudnn": {"backends": [SDPBackend.CUDNN_ATTENTION]},
                "gqa": {"enable_gqa": True}, "gqa+flash": {"enable_gqa": True, "backends": [SDPBackend.FLASH_ATTENTION]},
                "gqa+cudnn": {"enable_gqa": True, "backends": [SDPBackend.CUDNN_ATTENTION]}}

    def sdpa(cfg):
        gqa = cfg.get("enable_gqa", False)
        kk = kp if gqa else kp.repeat_interleave(H // KVH, dim=1)
        vv = vp if gqa else vp.repeat_interleave(H // KVH, dim=1)
        kw = {"enable_gqa": True} if gqa else {}
        if not cfg.get("backends"):
            return torch.nn.functional.scaled_dot_product_attention(qp, kk, vv, is_causal=True, **kw)
        with sdpa_kernel(cfg["backends"]):
            return torch.nn.functional.scaled_dot_product_attention(qp, kk, vv, is_causal=True, **kw)

    sdpa_times = {}
    for name, cfg in variants.items():
        try:
            sdpa_times[name] = timeit(lambda cfg=cfg: sdpa(cfg), 2, 10)
        except Exception as e:  # noqa: BLE001 - a backend may not take these inputs
            print("sdpa", name, "failed:", type(e).__name__, str(e)[:200])
    best_sdpa = min(sdpa_times, key=sdpa_times.get)
    res["sdpa_s"] = sdpa_times
    for name, t in sdpa_times.items():
        rows.append((f"prefill attn 4096 causal, 1 layer, SDPA {name}", f"{t * 1e3:.3f} ms",
                     f"{attn_flops / t / 1e12:.0f} TFLOP/s", "<- used" if name == best_sdpa else ""))
    model.prefill_config = {k: v for k, v in variants[best_sdpa].items()}
    res["prefill_config"] = best_sdpa
    # linear layers alone at 4096 tokens (cuBLAS), all 32 layers
    xa = torch.randn(T_PRE, hid, device=dev, dtype=torch.bfloat16)
    xf = torch.randn(T_PRE, spec.ffn_per_gpu, device=dev, dtype=torch.bfloat16)
    xq = torch.randn(T_PRE, spec.q_size, device=dev, dtype=torch.bfloat16)

    def gemms(xa=xa, xf=xf, xq=xq):
        F = torch.nn.functional
        for layer in model.layers:
            F.linear(xa, layer.wqkv)
            F.linear(xq, layer.wo)
            F.linear(xa, layer.w_gate_up)
            F.linear(xf, layer.w_down)

    t_gemm = timeit(gemms, 2, 5)
    lin_flops = 2 * T_PRE * L * (hid * (spec.q_size + 2 * spec.kv_size) + spec.q_size * hid
                                 + 3 * hid * spec.ffn_per_gpu)
    res["prefill_gemms_s"] = t_gemm
    rows.append(("prefill 4096: the 4 GEMMs x 32 layers alone", f"{t_gemm * 1e3:.2f} ms",
                 f"{lin_flops / t_gemm / 1e12:.0f} TFLOP/s", ""))
    del xa, xf, xq

    # --- prefill 4096 tokens ----------------------------------------------------------------------------
    chunk = Chunk(0, 0, T_PRE, tuple(range(dec_blocks, dec_blocks + pre_blocks)), True)
    meta = build_meta([chunk], B, dev)
    x = torch.randint(0, spec.vocab_size, (T_PRE,), device=dev)
    layers = range(L)

    def prefill():
        return model.logits(model.forward(x, layers, meta, kv), meta.sample_rows)

    t_pre = timeit(prefill, 2, max(5, args.reps // 2))
    lin_params = L * (hid * (spec.q_size + 2 * spec.kv_size) + spec.q_size * hid + 3 * hid * spec.ffn_per_gpu)
    flops = 2 * T_PRE * lin_params + 4 * L * H * D * T_PRE * (T_PRE + 1) / 2 + 2 * hid * spec.vocab_size
    res["prefill_s"], res["prefill_flops"] = t_pre, flops / t_pre
    rate = flops / t_pre
    vs = f"{rate / 1e12:.0f} TFLOP/s = {rate / MATMUL_CEILING:.0%} of 791, {rate / c['matmul_flops']:.0%} of this run's"
    rows.append((f"prefill {T_PRE} tokens (full forward + logits)", f"{t_pre * 1e3:.2f} ms", vs, ">= 80%"))

    # --- decode 128 x 1024 ----------------------------------------------------------------------------
    chunks = [Chunk(i, CTX - 1, 1, tuple(tables[i].tolist()), True) for i in range(BS)]

    def decode_step(n: int, max_blocks: int):
        bufs = DecodeBuffers(n, max_blocks, B, dev)
        bufs.fill(chunks[:n])
        bufs.input_ids.copy_(torch.randint(0, spec.vocab_size, (n,), device=dev))
        m = bufs.meta(n)

        def step():
            h = model.forward(bufs.input_ids, layers, m, kv)
            return sample(model.logits(h, m.sample_rows), None)

        t_eager = timeit(step, 2, max(5, args.reps // 2))
        g, _ = capture(step)
        t_graph = timeit(g.replay, 3, args.reps)
        return t_eager, t_graph

    def gemm_only(n: int, cfg: dict | None = None) -> float:
        F = torch.nn.functional
        xa = torch.randn(n, hid, device=dev, dtype=torch.bfloat16)
        xf = torch.randn(n, spec.ffn_per_gpu, device=dev, dtype=torch.bfloat16)

        def lin(x, w):
            return F.linear(x, w) if cfg is None else gemv(x, w, **cfg)

        def run():
            for layer in model.layers:
                lin(xa, layer.wqkv)
                lin(xa, layer.wo)
                lin(xa, layer.w_gate_up)
                lin(xf, layer.w_down)
            return lin(xa, model.lm_head)

        g, _ = capture(run)
        return timeit(g.replay, 3, args.reps)

    for n in (1, BS):
        t = gemm_only(n)
        res[f"decode{n}_gemms_graph_s"] = t
        rows.append((f"decode {n}: GEMMs only (32 x 4 + lm_head), cuBLAS, graph", f"{t * 1e3:.2f} ms",
                     f"{weight_read / t / 1e12:.2f} TB/s", ""))
    t_cublas1 = res["decode1_gemms_graph_s"]
    gemv_sweep = {}
    options = [dict(GEMV_DEFAULT)] if args.quick else \
        [{"block_n": bn, "block_k": bk, "num_warps": nw, "pdl": pdl}
         for bn, bk, nw, pdl in itertools.product((2, 4, 8), (512, 1024, 2048), (4, 8), (False, True))]
    for cfg in options:
        try:
            gemv_sweep[json.dumps(cfg)] = gemm_only(1, cfg)
        except Exception as e:  # noqa: BLE001 - report and go on
            print("gemv", cfg, "failed:", type(e).__name__, str(e)[:200])
    res["gemv_sweep_s"] = gemv_sweep
    for name, t in sorted(gemv_sweep.items(), key=lambda kv: kv[1])[:6]:
        rows.append((f"decode 1: GEMVs only, Triton {name}", f"{t * 1e3:.2f} ms",
                     f"{weight_read / t / 1e12:.2f} TB/s", f"cuBLAS {t_cublas1 * 1e3:.2f} ms"))
    best_gemv = json.loads(min(gemv_sweep, key=gemv_sweep.get))

    t_eager, t_graph = decode_step(BS, CTX // B)
    kv_read = BS * CTX * spec.kv_bytes_per_token
    bw = (weight_read + kv_read) / t_graph
    res.update(decode128_eager_s=t_eager, decode128_graph_s=t_graph, decode128_bw=bw, decode128_kv_bytes=kv_read)
    rows.append((f"decode {BS} x {CTX} ctx, graph", f"{t_graph * 1e3:.2f} ms",
                 f"{bw / 1e12:.2f} TB/s = {bw / COPY_CEILING:.0%} of 4.3, {bw / c['copy_bw']:.0%} of this run's",
                 ">= 80%"))
    rows.append((f"decode {BS} x {CTX} ctx, eager", f"{t_eager * 1e3:.2f} ms",
                 f"{(weight_read + kv_read) / t_eager / 1e12:.2f} TB/s", ""))
    # --- decode batch 1: the cuBLAS path, then the fused GEMV path with the best and the default options ---
    bound = weight_read / COPY_CEILING
    res["decode1_bound_s"] = bound
    variants = {"cuBLAS + unfused": (None, None), f"fused GEMV, best {json.dumps(best_gemv)}": (best_gemv, None),
                "fused GEMV, default": (dict(GEMV_DEFAULT), None)}
    variants.update({f"fused GEMV, default, {sp} attention splits": (dict(GEMV_DEFAULT), sp)
                     for sp in (4, 8, 32, 64)})
    for name, (cfg, splits) in variants.items():
        model.gemv_config = cfg
        model.decode_config = {**best_cfg, **({"num_splits": splits} if splits else {})}
        t1_eager, t1_graph = decode_step(1, CTX // B)
        res[f"decode1 {name}"] = {"eager_s": t1_eager, "graph_s": t1_graph}
        rows.append((f"decode 1 x {CTX} ctx, graph, {name}", f"{t1_graph * 1e3:.2f} ms",
                     f"{t1_graph / bound:.2f}x the weight-read bound {bound * 1e3:.2f} ms", "<= 1.2x"))
        rows.append((f"decode 1 x {CTX} ctx, eager, {name}", f"{t1_eager * 1e3:.2f} ms",
                     f"{t1_eager / bound:.2f}x", ""))

    # --- batch 1 as the executor serves it: the lane's decode graph (capacity 16384 tokens of context, so
    # the attention split is sized for that), greedy sampling and the in-graph advance, replayed back to back
    model.gemv_config, model.decode_config = dict(GEMV_DEFAULT), {}
    lg = LaneGraphs(model, kv, dev, buckets=(1,), max_context=16384)
    graph = lg.capture(SimpleNamespace(key="bench", stream=torch.cuda.Stream()), 1, True)
    table = np.zeros((1, lg.max_blocks), np.int32)
    n_blocks = CTX // B + 8  # room for the replays' growth
    table[0, :n_blocks] = perm[:n_blocks].numpy()
    lg.prepare(np.array([CTX - 1]), table, torch.tensor([7], device=dev), 1, True)
    t_lane = timeit(graph.replay, 3, args.reps)  # the context grows by one token a replay: ~1024 throughout
    res["decode1_lane_graph_s"] = t_lane
    rows.append((f"decode 1 x {CTX} ctx, the executor's lane graph (sampling + advance)", f"{t_lane * 1e3:.2f} ms",
                 f"{t_lane / bound:.2f}x the weight-read bound {bound * 1e3:.2f} ms", "<= 1.2x"))

    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        tmp = args.out / "gpu_kernels.json.tmp"
        tmp.write_text(json.dumps(res, indent=1))
        os.replace(tmp, args.out / "gpu_kernels.json")
    print(f"\n{res['gpu']}, torch {res['torch']}, triton {res.get('triton')}, {res['date']}")
    print(f"Llama-3.1-8B shapes, dummy bf16 weights; weights read per step {weight_read / 1e9:.2f} GB, "
          f"KV read at 128x1024 {kv_read / 1e9:.2f} GB")
    width = max(len(r[0]) for r in rows)
    print(f"{'measurement':<{width}}  {'time / rate':>14}  {'vs ceiling':<44} target")
    for name, val, vs, target in rows:
        print(f"{name:<{width}}  {val:>14}  {vs:<44} {target}")


if __name__ == "__main__":
    main()
