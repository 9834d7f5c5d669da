"""Does a launch take the same time back to back (as `bullet profile` times it) and in serving's rhythm?
(issue 9: chunked's 2,048-token steps were predicted ~11 % too long in `bullet validate`, while the profile's
launches of that kind fit within 3 %.)

One chunked-like step (a fresh prompt beside decode rows, whole GPU) is timed under four conditions, with the
GPU's SM clock and power read (NVML) just before each timed launch:

- ``back-to-back``: the step again and again, each drained before the next (the profile's protocol);
- ``sustained``: the same after ~10 s of it (the GPU at its power cap);
- ``after-decode``: each step right after a fused stretch of decode steps (memory-bound: serving's rhythm);
- ``after-idle``: each step after ``--idle-ms`` of idle GPU (one condition per gap given);
- ``profiler``: `bullet profile`'s own measurement of the same shape (its median over ``--reps``).

    python3 bench/launch_conditions.py [--prompt 1984 --rows 64 --context 2048 --reps 15]
    python3 bench/launch_conditions.py --device cpu --model tiny-llama --prompt 48 --rows 4 --context 32 --reps 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from bullet.batch import Batch, Chunk, Partition
from bullet.config import GPUS, SchedulerConfig, resolve_model
from bullet.kvcache import BlockManager


class Nvml:
    """SM clock (MHz) and power (W) of one GPU; None where NVML is missing (the CPU)."""

    def __init__(self, index: int | None) -> None:
        self.h = None
        if index is None:
            return
        try:
            import pynvml
        except ImportError:  # no NVML: clocks are not reported
            return
        try:
            pynvml.nvmlInit()
            self.nv, self.h = pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
        except pynvml.NVMLError:
            self.h = None

    def read(self) -> tuple[float | None, float | None]:
        if self.h is None:
            return None, None
        return (float(self.nv.nvmlDeviceGetClockInfo(self.h, self.nv.NVML_CLOCK_SM)),
                self.nv.nvmlDeviceGetPowerUsage(self.h) / 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt", type=int, default=1984, help="fresh prompt tokens of the timed step")
    ap.add_argument("--rows", type=int, default=64, help="decode rows beside it")
    ap.add_argument("--context", type=int, default=2048, help="context of each decode row")
    ap.add_argument("--decode-rows", type=int, default=128, help="rows of the decode stretch (after-decode)")
    ap.add_argument("--decode-steps", type=int, default=4, help="steps of the decode stretch (after-decode)")
    ap.add_argument("--idle-ms", type=float, nargs="+", default=[300.0],
                    help="idle gaps before each step of the after-idle condition(s), one condition per value")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--sustain-s", type=float, default=10.0)
    ap.add_argument("--ids", choices=("random", "constant"), default="random",
                    help="prompt token ids: seeded random (as serving's synthetic ids) or all 1")
    ap.add_argument("--latency", help="a model JSON (`bullet fit`): print its prediction of the step too")
    ap.add_argument("--json", type=Path, help="write the table as JSON here")
    args = ap.parse_args()

    from bullet.gpu.executor import GpuExecutor, prepare_graphs
    from bullet.perfmodel import work_of

    spec = resolve_model(args.model)
    cuda = args.device.startswith("cuda")
    ex = GpuExecutor(spec, "dummy", args.device, num_blocks=None if cuda else 4096, gpu_memory_utilization=0.85)
    gpu = GPUS["h200"]
    n_sms = ex.menu.num_sms if cuda else gpu.num_sms
    if cuda:
        ex.warmup()
        prepare_graphs(ex, SchedulerConfig(policy="chunked"), gpu, prefill=False)
    nv = Nvml((ex.device.index or 0) if cuda else None)
    kv = BlockManager(ex.kv.num_blocks, ex.kv.block_size)
    rid = iter(range(1 << 40, 1 << 41))
    L = spec.num_layers

    def decode_rows(n: int, ctx: int, steps: int) -> list[Chunk]:
        out = []
        for _ in range(n):
            r = next(rid)
            out.append(Chunk(r, ctx - 1, 1, kv.allocate(r, ctx + steps), True, (int(rng.integers(spec.vocab_size)),)))
        return out

    def run(chunks: list[Chunk], steps: int = 1):
        ex.launch(Batch(Partition("all", n_sms), range(L), tuple(chunks), steps))
        out = []
        while ex.busy("all"):
            out.extend(ex.wait(None))
        for c in chunks:
            kv.free(c.req_id)
            ex.release(c.req_id)
        return out[-1]

    rng = np.random.default_rng(0)

    def step_chunks() -> list[Chunk]:
        r = next(rid)
        rows = decode_rows(args.rows, args.context, 1)
        ids = (1,) * args.prompt if args.ids == "constant" else \
            tuple(int(x) for x in rng.integers(0, spec.vocab_size, args.prompt))
        return rows + [Chunk(r, 0, args.prompt, kv.allocate(r, args.prompt), True, ids)]

    def timed(before=None) -> dict:
        if before is not None:
            before()
        clock, power = nv.read()
        res = run(step_chunks())
        return {"ms": (res.end - res.start) * 1e3, "clock": clock, "power": power}

    for _ in range(3):  # warm-up
        run(step_chunks())
    conditions: dict[str, list[dict]] = {}
    conditions["back-to-back"] = [timed() for _ in range(args.reps)]
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < args.sustain_s:
        run(step_chunks())
    conditions["sustained"] = [timed() for _ in range(args.reps)]
    conditions["after-decode"] = [
        timed(lambda: run(decode_rows(args.decode_rows, args.context, args.decode_steps), args.decode_steps))
        for _ in range(args.reps)]
    for idle in args.idle_ms:
        name = "after-idle" if len(args.idle_ms) == 1 else f"after-idle {idle:g} ms"
        conditions[name] = [timed(lambda s=idle / 1e3: time.sleep(s)) for _ in range(args.reps)]
    # the profiler's own protocol on the same executor: `bullet profile`'s measurement of this very shape
    from bullet.gpu.profile import Point, Profiler, Shape

    prof = Profiler(ex, reps=args.reps)
    pt = Point(Shape(((args.prompt, 0),), (args.context,) * args.rows), "all", n_sms)
    row = prof.measure(pt)
    conditions["profiler"] = [{"ms": row["gpu_s"] * 1e3, "clock": None, "power": None}]

    pred = None
    if args.latency:
        from bullet.perfmodel.fitted import FittedModel

        probe = step_chunks()
        w = work_of(Batch(Partition("all", n_sms), range(L), tuple(probe)), L)
        for c in probe:
            kv.free(c.req_id)
        pred = FittedModel.load(args.latency, spec, gpu).predict(w, n_sms) * 1e3
    ex.close()

    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else float("nan")

    print(f"{args.prompt}-token prompt ({args.ids} ids) + {args.rows} decode rows of {args.context} "
          f"({spec.name}, {args.device})"
          + (f"; model predicts {pred:.2f} ms" if pred is not None else ""))
    print("| condition | step ms p50 | p10 | p90 | SM MHz p50 | W p50 |")
    print("|---|---:|---:|---:|---:|---:|")
    table = {}
    for name, rows in conditions.items():
        ms = sorted(r["ms"] for r in rows)
        q = statistics.quantiles(ms, n=10, method="inclusive") if len(ms) > 1 else [ms[0]] * 9
        table[name] = {"ms_p50": med(ms), "ms_p10": q[0], "ms_p90": q[-1], "clock_mhz": med([r["clock"] for r in rows]),
                       "power_w": med([r["power"] for r in rows])}
        t = table[name]
        print(f"| {name} | {t['ms_p50']:.2f} | {t['ms_p10']:.2f} | {t['ms_p90']:.2f} | {t['clock_mhz']:.0f} | "
              f"{t['power_w']:.0f} |")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "predicted_ms": pred,
                                         "conditions": table, "runs": conditions}, indent=1, default=str))


if __name__ == "__main__":
    main()
