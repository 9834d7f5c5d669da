"""One eager mixed step (B decodes of a given context plus one prompt of P tokens) on the whole GPU through the
GpuExecutor, three times per shape: host seconds inside launch(), GPU seconds (the executor's events), and the
roofline's prediction. Tells warm-up (the first repetition of a shape) from steady state.

    PYTHONPATH=. python3 bench/mixed_step.py [--prompts 300 1000 1700 3000 6000] [--decodes 0 32 64]
    python3 bench/mixed_step.py --device cpu --model tiny-llama --prompts 50 --decodes 4 --context 100
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bullet.batch import Batch, Chunk, Partition
from bullet.config import GPUS, resolve_model
from bullet.kvcache import BlockManager
from bullet.perfmodel import work_of
from bullet.perfmodel.roofline import RooflineModel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--prompts", type=int, nargs="+", default=[300, 1000, 1700, 3000, 6000])
    ap.add_argument("--decodes", type=int, nargs="+", default=[0, 32, 64])
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()

    from bullet.gpu.executor import GpuExecutor

    spec, gpu = resolve_model(args.model), GPUS["h200"]
    model = RooflineModel(spec, gpu)
    cuda = args.device == "cuda"
    ex = GpuExecutor(spec, "dummy", args.device, num_blocks=None if cuda else 2048,
                     gpu_memory_utilization=0.8)
    kv = BlockManager(ex.kv.num_blocks, ex.kv.block_size)
    part = Partition("all", gpu.num_sms)
    rid = 0
    print("prompt | decodes | rep | host ms in launch | GPU ms | roofline ms | GPU / roofline")
    for p in args.prompts:
        for b in args.decodes:
            for rep in range(args.reps):
                chunks = []
                for _ in range(b):
                    rid += 1
                    table = kv.allocate(rid, args.context + 1)
                    chunks.append(Chunk(rid, args.context, 1, table, True))
                rid += 1
                chunks.append(Chunk(rid, 0, p, kv.allocate(rid, p), True))
                batch = Batch(part, range(spec.num_layers), tuple(chunks))
                t = time.perf_counter()
                ex.launch(batch)
                ex.flush()  # the whole launch enqueued
                host = time.perf_counter() - t
                (res,) = ex.wait(None)
                pred = model.predict(work_of(batch, spec.num_layers), gpu.num_sms)
                gpu_s = res.end - res.start
                print(f"{p} | {b} | {rep} | {host * 1e3:.1f} | {gpu_s * 1e3:.2f} | {pred * 1e3:.2f} | "
                      f"{gpu_s / pred:.2f}")
                for c in chunks:
                    ex.release(c.req_id)
                    kv.free(c.req_id)
    ex.close()


if __name__ == "__main__":
    main()
