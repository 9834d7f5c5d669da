"""Is a prefill next to decode as slow in serving as `bullet profile` measured it? (issue 9: in `bullet validate`
of static-split on sharegpt, prefills of 4-9k tokens on 92 SMs beside decode on 40 were ~8 % slower than the
fitted model says, while the same launches alone were predicted within 1 %, and the profile's own co-run
points agree with the model.)

One prefill (``--prompt`` fresh tokens, all layers) on ``--prefill-sms`` SMs, timed under four conditions, with
the SM clock and power (NVML) read before each timed prefill:

- ``alone``: on its partition, the other lane idle (the profile's solo protocol);
- ``profiler``: `bullet profile`'s own co-run measurement of this shape (its ``CORUN_PROTOCOL``: since the
  eleventh session both lanes relaunched without a pause for 2 s before the timed runs; before it, one decode
  stretch sized to outlast the prefill, both enqueued at once, which measured 3-5 % short: bench/RESULTS.md);
- ``co-run``: as static-split serves: the decode lane relaunches fused stretches of ``--decode-steps`` steps of
  ``--rows`` rows at ``--context`` on the other SMs without a pause, the prefill is relaunched back to back;
- ``co-run sustained``: the same after ``--sustain-s`` seconds of it (the GPU at its power cap).

The decode steps that ran entirely beside a prefill are timed too. With ``--latency``, the fitted model's
predictions (alone, and next to the decode stretch) are printed beside them.

    python3 bench/corun_conditions.py [--prompt 6144 --prefill-sms 92 --rows 160 --context 1536 --reps 8]
    python3 bench/corun_conditions.py --device cpu --model tiny-llama --prompt 48 --prefill-sms 92 --rows 4 \\
        --context 32 --reps 2 --sustain-s 0.2
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch_conditions import Nvml


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt", type=int, default=6144, help="fresh prompt tokens of the timed prefill")
    ap.add_argument("--prefill-sms", type=int, default=92, help="SMs of the prefill partition (decode: the rest)")
    ap.add_argument("--rows", type=int, default=160, help="decode rows on the other partition")
    ap.add_argument("--context", type=int, default=1536, help="context of each decode row")
    ap.add_argument("--decode-steps", type=int, default=8, help="fused decode steps per decode launch (co-run)")
    ap.add_argument("--reps", type=int, default=8, help="timed prefills per condition")
    ap.add_argument("--sustain-s", type=float, default=10.0,
                    help="seconds of co-running before the timed prefills of the sustained condition")
    ap.add_argument("--latency", help="a model JSON (`bullet fit`): print its predictions too")
    ap.add_argument("--json", type=Path, help="write the table as JSON here")
    args = ap.parse_args()
    gpu = GPUS["h200"]
    if args.prefill_sms not in gpu.prefill_sizes[:-1] or gpu.num_sms - args.prefill_sms not in gpu.decode_sizes:
        ap.error(f"--prefill-sms {args.prefill_sms}: not a split of {gpu.name}'s nested menu (prefill sizes "
                 f"{', '.join(map(str, gpu.prefill_sizes[:-1]))})")

    from bullet.gpu.executor import GpuExecutor, prepare_graphs
    from bullet.gpu.profile import Point, Profiler, Shape
    from bullet.perfmodel import work_of

    spec = resolve_model(args.model)
    cuda = args.device.startswith("cuda")
    ex = GpuExecutor(spec, "dummy", args.device, num_blocks=None if cuda else 4096, gpu_memory_utilization=0.85)
    n_sms = ex.menu.num_sms if cuda else gpu.num_sms
    p_sms, d_sms = args.prefill_sms, n_sms - args.prefill_sms
    if cuda:
        ex.warmup()
        prepare_graphs(ex, SchedulerConfig(policy="static-split", prefill_sms=p_sms), gpu, prefill=False)
    nv = Nvml((ex.device.index or 0) if cuda else None)
    kv = BlockManager(ex.kv.num_blocks, ex.kv.block_size)
    rid = iter(range(1 << 40, 1 << 41))
    rng = np.random.default_rng(0)
    L = spec.num_layers

    def prefill_batch() -> Batch:
        r = next(rid)
        ids = tuple(int(x) for x in rng.integers(0, spec.vocab_size, args.prompt))
        return Batch(Partition("prefill", p_sms), range(L), (Chunk(r, 0, args.prompt, kv.allocate(r, args.prompt),
                                                                      True, ids),))

    def decode_batch(steps: int) -> Batch:
        rows = []
        for _ in range(args.rows):
            r = next(rid)
            rows.append(Chunk(r, args.context - 1, 1, kv.allocate(r, args.context + steps), True,
                              (int(rng.integers(spec.vocab_size)),)))
        return Batch(Partition("decode", d_sms), range(L), tuple(rows), steps)

    def release(batch: Batch) -> None:
        for c in batch.chunks:
            kv.free(c.req_id)
            ex.release(c.req_id)

    def alone(reps: int) -> list[dict]:
        out = []
        for _ in range(reps):
            b = prefill_batch()
            clock, power = nv.read()
            ex.launch(b)
            while ex.busy("prefill"):
                for res in ex.wait(None):
                    out.append({"ms": (res.end - res.start) * 1e3, "clock": clock, "power": power})
            release(b)
        return out

    def corun(seconds: float, reps: int) -> tuple[list[dict], list[float]]:
        """Both lanes busy without a pause for ``seconds``, then ``reps`` timed prefills; returns the timed
        prefills and the decode steps that ran entirely beside one of them."""
        pre: list[dict] = []
        windows: list[tuple[float, float]] = []
        decode_runs = []
        t0 = time.perf_counter()
        pending: dict[str, Batch] = {}
        reading = (None, None)
        while len(pre) < reps or "prefill" in pending:
            if "decode" not in pending:
                pending["decode"] = decode_batch(args.decode_steps)
                ex.launch(pending["decode"])
            if "prefill" not in pending and len(pre) < reps:
                reading = nv.read()
                pending["prefill"] = prefill_batch()
                ex.launch(pending["prefill"])
            for res in ex.wait(None):
                lane = res.batch.partition.lane
                release(pending.pop(lane))
                if lane == "decode":
                    decode_runs.append(res)
                elif time.perf_counter() - t0 >= seconds:
                    pre.append({"ms": (res.end - res.start) * 1e3, "clock": reading[0], "power": reading[1]})
                    windows.append((res.start, res.end))
        while ex.busy("decode"):  # let the last stretch end
            for res in ex.wait(None):
                release(pending.pop(res.batch.partition.lane))
        steps = []
        for d in decode_runs:
            ends = np.asarray(d.step_ends)
            starts = np.concatenate(([d.start], ends[:-1]))
            for s, e in zip(starts, ends):
                if any(a <= s and e <= b for a, b in windows):
                    steps.append((e - s) * 1e3)
        return pre, steps

    alone(2)  # warm-up: attention plans, kernels
    conditions: dict[str, list[dict]] = {"alone": alone(args.reps)}
    prof = Profiler(ex, reps=args.reps)
    pshape, dshape = Shape(((args.prompt, 0),)), Shape((), (args.context,) * args.rows, steps=args.decode_steps)
    prof.measure(Point(pshape, "prefill", p_sms))  # the solo times the profiler sizes its decode stretch by
    prof.measure(Point(dshape, "decode", d_sms))
    row = prof.measure(Point(pshape, "prefill", p_sms, dshape, d_sms))
    conditions["profiler"] = [{"ms": row["gpu_s"] * 1e3, "clock": None, "power": None}]
    steps: dict[str, list[float]] = {}
    conditions["co-run"], steps["co-run"] = corun(0.0, args.reps)
    conditions["co-run sustained"], steps["co-run sustained"] = corun(args.sustain_s, args.reps)

    pred = {}
    if args.latency:
        from bullet.perfmodel.fitted import FittedModel

        fm = FittedModel.load(args.latency, spec, gpu)
        pb, db = prefill_batch(), decode_batch(1)
        pw, dw = work_of(pb, L), work_of(db, L)
        release(pb)
        release(db)
        pred = {"prefill alone": fm.predict(pw, p_sms) * 1e3, "prefill co-run": fm.predict(pw, p_sms, dw, d_sms) * 1e3,
                "decode step alone": float(fm.decode_steps(dw, 2, d_sms)[1]) * 1e3,
                "decode step co-run": float(fm.decode_steps(dw, 2, d_sms, pw, p_sms)[1]) * 1e3}
    ex.close()

    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else float("nan")

    print(f"{args.prompt}-token prefill on {p_sms} SMs beside {args.rows} decode rows of {args.context} on {d_sms} SMs, "
          f"{args.decode_steps} steps a launch ({spec.name}, {args.device})")
    if pred:
        print("model predicts: " + ", ".join(f"{k} {v:.2f} ms" for k, v in pred.items()))
    print("| condition | prefill ms p50 | p10 | p90 | decode step ms p50 (n) | SM MHz p50 | W p50 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    table = {}
    for name, rows in conditions.items():
        ms = sorted(r["ms"] for r in rows)
        q = statistics.quantiles(ms, n=10, method="inclusive") if len(ms) > 1 else [ms[0]] * 9
        st = steps.get(name, [])
        table[name] = {"ms_p50": med(ms), "ms_p10": q[0], "ms_p90": q[-1],
                       "step_ms_p50": med(st), "steps": len(st),
                       "clock_mhz": med([r["clock"] for r in rows]), "power_w": med([r["power"] for r in rows])}
        t = table[name]
        step = f"{t['step_ms_p50']:.2f} ({t['steps']})" if st else "-"
        print(f"| {name} | {t['ms_p50']:.2f} | {t['ms_p10']:.2f} | {t['ms_p90']:.2f} | {step} | "
              f"{t['clock_mhz']:.0f} | {t['power_w']:.0f} |")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "predicted_ms": pred,
                                         "conditions": table, "runs": conditions}, indent=1, default=str))


if __name__ == "__main__":
    main()
