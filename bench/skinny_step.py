"""Whole decode steps as the executor replays them (its lane graph: embedding, all layers, logits, greedy
sampling, the in-graph advance), with cuBLAS for every product against the skinny GEMM table
(``kernels.skinny``), on decode partitions of the nested menu and the whole GPU. Dummy bf16 weights.

    PYTHONPATH=. python3 bench/skinny_step.py --table profiles/h200/llama-3.1-8b/skinny.json \
        [--model llama-3.1-8b] [--sms 16,32,48,64,132] [--batch 16,32,64,128] [--context 1024]

Per (SMs, batch): both variants first run one eager step on the same inputs, and their logits are compared
with a float32 model's on the same (bf16-valued) weights and KV (relative error; the two bf16 paths sum in
different orders, so their rounding differs), then each lane graph is
captured on the partition's stream and timed (median of 20 replays after warm-up; the context grows by one
token a replay). Prints the two step times, the speed-up, and the products the table switched.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_kernels import replay_time
from bullet.batch import Chunk
from bullet.config import resolve_model
from bullet.gpu.attention import DecodeBuffers
from bullet.gpu.graphs import LaneGraphs
from bullet.gpu.kernels.skinny import load_table
from bullet.gpu.kvcache import PagedKvCache
from bullet.gpu.model import Model
from bullet.gpu.partitions import PartitionMenu
from bullet.gpu.weights import load_weights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", required=True, help="skinny GEMM table (bench/skinny_gemm.py --table)")
    ap.add_argument("--model", default="llama-3.1-8b", help="model preset")
    ap.add_argument("--sms", default="16,32,48,64,132", help="decode partition sizes (the whole GPU's count too)")
    ap.add_argument("--batch", default="16,32,64,128", help="batch sizes (graph buckets)")
    ap.add_argument("--context", type=int, default=1024, help="context length of every request")
    args = ap.parse_args()
    spec = resolve_model(args.model)
    dev = torch.device("cuda")
    table = load_table(args.table, spec, torch.cuda.get_device_name(dev))
    w = load_weights(spec, "dummy", dev, torch.bfloat16, seed=0)
    model = Model(spec, w, dev)
    ref = Model(spec, {k: v.float() for k, v in w.items()}, dev, torch.float32)  # the same values, in fp32
    del w
    batches = [int(b) for b in args.batch.split(",")]
    B, ctx, bmax = 16, args.context, max(batches)
    per = -(-(ctx + 64) // B)  # blocks per request, with room for the replays' growth
    kv = PagedKvCache(spec, bmax * per + 1, B, dev)
    kv.k.normal_()
    kv.v.normal_()
    kv32 = PagedKvCache(spec, bmax * per + 1, B, dev, torch.float32)
    kv32.k.copy_(kv.k)
    kv32.v.copy_(kv.v)
    perm = torch.randperm(bmax * per).view(bmax, per).to(torch.int32)
    menu = PartitionMenu.create()
    total = menu.num_sms
    print(f"{torch.cuda.get_device_name(dev)}, {spec.name}, context {ctx}, table {args.table}")
    print("| SMs | batch | cuBLAS ms | with table ms | speed-up | products on the skinny kernel | logits error "
          "vs fp32: cuBLAS / table |")
    print("|---:|---:|---:|---:|---:|---|---:|")
    for sms in (int(s) for s in args.sms.split(",")):
        side = menu.full if sms == total else menu.side("decode", sms)
        for bs in batches:
            chunks = [Chunk(i, ctx - 1, 1, tuple(perm[i].tolist()), True) for i in range(bs)]
            ids = torch.randint(0, spec.vocab_size, (bs,), device=dev)
            bufs = DecodeBuffers(bs, per, B, dev)
            bufs.fill(chunks)
            bufs.input_ids.copy_(ids)
            meta = bufs.meta(bs)
            logits, times = {}, {}
            with torch.cuda.stream(side.stream):
                want = ref.logits(ref.forward(bufs.input_ids, range(spec.num_layers), meta, kv32),
                                  meta.sample_rows).double()
                kv32.k.copy_(kv.k)  # (the step stored its new token's k/v: put the pool back)
                kv32.v.copy_(kv.v)
            for name, tab in (("cublas", {}), ("table", table)):
                model.skinny = tab
                with torch.cuda.stream(side.stream), model.on_sms(side.num_sms):
                    h = model.forward(bufs.input_ids, range(spec.num_layers), meta, kv)
                    logits[name] = model.logits(h, meta.sample_rows).double()
                    lg = LaneGraphs(model, kv, dev, buckets=(bs,), max_context=per * B)
                    g = lg.capture(SimpleNamespace(key=("bench", sms, name), stream=side.stream), bs, True)
                    lg.prepare(np.full(bs, ctx - 1), perm[:bs].numpy(), ids, bs, True)
                times[name] = replay_time(g, side.stream)
                del lg, g
            model.skinny = {}
            err = {n: float((v - want).norm() / want.norm()) for n, v in logits.items()}
            switched = ",".join(sorted(table.get((side.num_sms, bs), {}))) or "-"
            print(f"| {side.num_sms} | {bs} | {times['cublas'] * 1e3:.2f} | {times['table'] * 1e3:.2f} | "
                  f"{times['cublas'] / times['table']:.3f}x | {switched} | {err['cublas']:.2e} / {err['table']:.2e} |", flush=True)
            torch.cuda.empty_cache()
    menu.close()


if __name__ == "__main__":
    main()
