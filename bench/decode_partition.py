"""What a decode step's pieces reach on SM partitions: memory ceilings, the paged decode attention kernel
(both KV pool layouts, a sweep of launch options) and the batch GEMMs, on decode halves of the green-context
menu and on the whole GPU. Llama-3.1-8B shapes, dummy weights, bf16.

    PYTHONPATH=. python bench/decode_partition.py [--batch 64] [--context 4096] [--sms 36,52,68] [--out F]

Per partition size: device copy (reads + writes) and a read-only stream (the one-row GEMV over a 1 GiB
matrix), in TB/s; the decode attention kernel on one layer (``batch x context`` tokens, ``2 x kv_heads x
head_dim x 2`` bytes each) for each layout and option set, best first; the batch GEMMs of all 32 layers
(cuBLAS, weights read once). Every time is one replay of a CUDA graph (no host launch time). The last table sums up per
partition. Times: CUDA events on the partition's stream, median after warm-up.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_kernels import graph_time
from bullet.config import MODELS
from bullet.gpu.kernels.decode_attention import paged_decode_attention
from bullet.gpu.kernels.gemv import gemv
from bullet.gpu.partitions import PartitionMenu
from bullet.gpu.weights import load_weights


def timeit_on(stream, fn, warmup: int = 2, reps: int = 10) -> float:
    """Median seconds of ``fn`` on ``stream``: one replay of a CUDA graph of it (no host launch time)."""
    return graph_time(fn, stream, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--sms", default="40,56,72", help="decode-side SM counts from the menu (plus the whole GPU)")
    ap.add_argument("--quick", action="store_true", help="a smaller option sweep")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    spec = MODELS["llama-3.1-8b"]
    H, KVH, D, hid = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size
    BS, CTX, B = args.batch, args.context, 16
    nblocks = BS * CTX // B
    torch.manual_seed(0)

    menu = PartitionMenu.create()
    sides = [("whole", menu.full.stream, menu.num_sms)]
    for d in (int(s) for s in args.sms.split(",") if s):
        side = menu.side("decode", d)
        sides.append((f"d{side.num_sms}", side.stream, side.num_sms))

    # pools: one layer, both layouts (logical [blocks, page, KVH, D])
    pools = {"nhd": [torch.randn(nblocks, B, KVH, D, device=dev, dtype=torch.bfloat16) for _ in range(2)],
             "hnd": [torch.randn(nblocks, KVH, B, D, device=dev, dtype=torch.bfloat16).transpose(1, 2)
                     for _ in range(2)]}
    tables = torch.randperm(nblocks).view(BS, CTX // B).to(device=dev, dtype=torch.int32)
    cl = torch.full((BS,), CTX, dtype=torch.int32, device=dev)
    q = torch.randn(BS, H, D, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    attn_bytes = BS * CTX * KVH * D * 2 * 2
    # correctness first: both layouts and a split give the same output
    ref = paged_decode_attention(q, *pools["nhd"], tables, cl, D**-0.5, CTX, num_splits=1).float()
    for lay in ("nhd", "hnd"):
        k, v = pools[lay]
        if lay == "hnd":
            k.copy_(pools["nhd"][0])
            v.copy_(pools["nhd"][1])
        for sp in (1, 4):
            got = paged_decode_attention(q, k, v, tables, cl, D**-0.5, CTX, num_splits=sp).float()
            err = float((got - ref).norm() / ref.norm())
            assert err < 1e-2, (lay, sp, err)

    opts = {"block_n": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3, 4), "num_splits": (1, 2, 4, 8)}
    if args.quick:
        opts = {"block_n": (64, 128), "num_warps": (4, 8), "num_stages": (2, 3), "num_splits": (1, 2, 4)}
    configs = [("nhd", dict(zip(opts, v))) for v in itertools.product(*opts.values())]
    configs += [("hnd", c) for _, c in configs]

    w = load_weights(spec, "dummy", dev, torch.bfloat16, seed=0)
    mats = [w[f"model.layers.{i}.{n}"] for i in range(spec.num_layers)
            for n in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                      "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                      "mlp.down_proj.weight")]
    head = w["lm_head.weight"]
    xs = {k: torch.randn(BS, k, device=dev, dtype=torch.bfloat16) for k in (hid, spec.q_size, spec.ffn_per_gpu)}
    gemm_bytes = sum(m.numel() for m in mats) * 2
    x1 = torch.randn(1, hid, device=dev, dtype=torch.bfloat16)
    src = torch.randn(1 << 29, device=dev, dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)

    res: dict = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "batch": BS, "context": CTX, "sides": {}}
    for name, stream, sms in sides:
        r: dict = {"sms": sms}
        r["copy_tb_s"] = 2 * src.numel() * 2 / timeit_on(stream, lambda: dst.copy_(src)) / 1e12
        r["read_tb_s"] = head.numel() * 2 / timeit_on(stream, lambda: gemv(x1, head)) / 1e12
        attn = {}
        for lay, cfg in configs:
            k, v = pools[lay]
            try:
                t = timeit_on(stream, lambda k=k, v=v, cfg=cfg: paged_decode_attention(
                    q, k, v, tables, cl, D**-0.5, CTX, out=out, **cfg), 1, 5)
            except Exception as e:  # noqa: BLE001 - a config may not fit (shared memory): report, go on
                print(name, lay, cfg, "failed:", type(e).__name__, str(e)[:120])
                continue
            attn[json.dumps({"layout": lay, **cfg})] = attn_bytes / t / 1e12
        r["attn_tb_s"] = attn
        r["attn_default_tb_s"] = {lay: attn_bytes / timeit_on(stream, lambda k=k, v=v: paged_decode_attention(
            q, k, v, tables, cl, D**-0.5, CTX, out=out)) / 1e12 for lay, (k, v) in pools.items()}

        def gemms():
            for m in mats:
                torch.nn.functional.linear(xs[m.shape[1]], m)

        r["gemm_s"] = timeit_on(stream, gemms, 1, 5)
        res["sides"][name] = r
        best = sorted(attn.items(), key=lambda kv: -kv[1])[:5]
        print(f"\n{name} ({sms} SMs): copy {r['copy_tb_s']:.2f} TB/s, read (GEMV 1 GiB) {r['read_tb_s']:.2f} "
              f"TB/s; GEMMs x{BS} {r['gemm_s'] * 1e3:.2f} ms ({gemm_bytes / r['gemm_s'] / 1e12:.2f} TB/s); "
              f"attention default nhd {r['attn_default_tb_s']['nhd']:.2f} / hnd {r['attn_default_tb_s']['hnd']:.2f} "
              "TB/s; best:")
        for cfg, bw in best:
            print(f"  {bw:.2f} TB/s  {cfg}")
        for lay in ("nhd", "hnd"):
            lb = max((bw, c) for c, bw in attn.items() if f'"{lay}"' in c)
            print(f"  best {lay}: {lb[0]:.2f} TB/s {lb[1]}")

    print(f"\n{res['gpu']}, {res['date']}; decode {BS} x {CTX}, Llama-3.1-8B shapes")
    print("| side | SMs | copy TB/s | read TB/s | attn best TB/s (layout) | attn x32 ms | GEMMs ms (graph) |")
    print("|---|---:|---:|---:|---|---:|---:|")
    for name, r in res["sides"].items():
        cfg, bw = max(r["attn_tb_s"].items(), key=lambda kv: kv[1])
        attn_ms = spec.num_layers * attn_bytes / (bw * 1e12) * 1e3
        print(f"| {name} | {r['sms']} | {r['copy_tb_s']:.2f} | {r['read_tb_s']:.2f} | {bw:.2f} "
              f"({json.loads(cfg)['layout']}) | {attn_ms:.2f} | {r['gemm_s'] * 1e3:.2f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    menu.close()


if __name__ == "__main__":
    main()
