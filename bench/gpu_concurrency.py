"""Prefill next to decode on complementary green-context partitions, through the GpuExecutor, for every pair
of the partition menu: how much work gets done compared with running the two back to back on the whole GPU.

Llama-3.1-8B shapes, dummy weights. A prefill of ``--prefill-tokens`` tokens (one request, layer slices of
``--layers-per-step`` launched back to back) runs on the prefill half while decode steps (``--batch`` requests
x ``--context`` tokens of context, one CUDA graph per step captured on the decode half) run back to back on
the other. Per pair:

    ratio = (t_prefill_alone_full + n_decode * t_decode_alone_full) / t_concurrent

with ``t_concurrent`` the prefill's span, ``n_decode`` the decode steps completed inside it (the step
straddling its end counted by the fraction that fell inside), and the ``*_alone_full`` times measured on a
whole-GPU stream. ``naive`` is both lanes on ordinary whole-GPU streams (no partitioning).

    python bench/gpu_concurrency.py [--reps 2] [--out results.json]

Measured 2026-11-30 on one H200 (driver 580.159.04, torch 2.11.0+cu130, cuda.bindings 13.3.1, Triton 3.6),
`python3 bench/gpu_concurrency.py --reps 2` (slices of 4 layers, 4 decode steps per launch): menu of 13 pairs
(16/116 ... 112/20), 214 MiB of device memory, made in 0.38 s; whole GPU alone: prefill 215.9 ms, decode step
13.35 ms.

| pair P/D | prefill ms (alone on P) | concurrent ms | decode steps | step ms alone/co | prefill slow | ratio |
|---|---|---|---|---|---|---|
| 16/116 | 1323.1 | 1845.8 | 118.0 | 13.85 / 15.40 | 1.40x | 0.970 |
| 32/100 | 668.7 | 893.7 | 49.3 | 15.32 / 17.90 | 1.34x | 0.978 |
| 48/84 | 450.8 | 594.0 | 31.6 | 15.26 / 18.54 | 1.32x | 1.074 |
| 56/76 | 387.6 | 525.9 | 26.9 | 15.34 / 19.40 | 1.36x | 1.094 |
| 64/68 | 347.6 | 461.4 | 21.3 | 16.84 / 21.27 | 1.33x | 1.085 |
| 72/60 | 311.1 | 407.0 | 17.1 | 18.39 / 23.36 | 1.31x | 1.093 |
| 80/52 | 291.8 | 372.1 | 14.8 | 19.58 / 24.95 | 1.28x | 1.112 |
| 88/44 | 272.8 | 335.2 | 11.6 | 22.58 / 28.69 | 1.23x | 1.106 |
| 96/36 | 265.1 | 304.2 | 8.9 | 26.86 / 34.37 | 1.15x | 1.099 |
| 104/28 | 251.4 | 280.9 | 6.4 | 34.45 / 43.80 | 1.12x | 1.074 |
| 112/20 | 239.3 | 254.8 | 4.0 | 50.62 / 58.89 | 1.06x | 1.057 |
| naive | 217.5 | 253.7 | 3.2 | 13.38 / 79.71 | 1.17x | 1.020 |

Best 1.11x (80/52, 88/44): under the 1.2x target. Co-running slows both sides by 1.2-1.4x; without that
80/52 would give (215.9 + 291.8 / 19.58 * 13.35) / 291.8 = 1.42x. Whole prefill launches
(`--layers-per-step 32 --decode-steps 8`) gave the same (best 1.105x), and 128 x 1024 decode (docs/background.md's
shape) 1.054x. Why: the power cap. An nvidia-smi log (clocks.sm, power.draw, clocks_event_reasons every 50
ms; `--pairs 80,96 --reps 6`, ratio 1.115 / 1.100) shows the whole-GPU prefill already at the 700 W limit (SM
clock median 1582 MHz, reason 0x4 = software power cap); alone on 80 SMs the prefill runs at 1920 MHz and the
decode on 52 SMs at 1965 MHz, but together they draw 687-700 W and the clock drops to a median 1530 MHz
(min 1215): 1920 / 1530 = 1.25x, the slowdown both lanes show. So partitioning cannot add much work on a card
whose prefill alone is power-bound; the partition-alone times above are at boost clocks.

The energy columns (NVML's energy counter, when the ``nvidia-ml-py`` wheel is carried) settle it. On the
same card, 2026-11-30, alone on the whole GPU the prefill drew 654-670 W and the 64 x 4096 decode steps
703-715 W: both phases already run at the cap, so there is no idle power for a co-run to use. At the best
pairs the co-run spent 0.97-1.01x the joules of the same work done alone, drawing 703-737 W. Its gain, 1.10-1.12x,
is what lower clocks save in energy. The "cap ceiling" column is the ratio a co-run at 700 W would reach at the
alone runs' joules per unit of work: 1.00-1.03 for every pair.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bullet.batch import Batch, Chunk, Partition
from bullet.config import MODELS
from bullet.gpu.executor import GpuExecutor
from bullet.gpu.partitions import PartitionMenu


class EnergyMeter:
    """The GPU's energy counter through NVML (``nvidia-ml-py``), in joules; ``None`` readings where NVML is
    missing. The power cap makes energy the budget: at the cap, work per joule is what co-running can win."""

    def __init__(self, index: int = 0) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._h = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.cap_w = pynvml.nvmlDeviceGetEnforcedPowerLimit(self._h) / 1e3
        except Exception as e:  # noqa: BLE001 - no NVML (CPU smoke test, missing wheel): report, measure none
            print(f"energy: NVML unavailable ({type(e).__name__}: {e}); no energy columns")
            self._nvml, self.cap_w = None, None

    def joules(self) -> float | None:
        if self._nvml is None:
            return None
        torch.cuda.synchronize()
        return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._h) / 1e3

    def window(self, fn):
        """``(fn(), joules, seconds)`` over one call of ``fn`` (joules None without NVML)."""
        e0, t0 = self.joules(), time.perf_counter()
        out = fn()
        e1, t1 = self.joules(), time.perf_counter()
        return out, (None if e0 is None else e1 - e0), t1 - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--prefill-tokens", type=int, default=8192)
    ap.add_argument("--layers-per-step", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--decode-steps", type=int, default=4, help="decode steps fused into one launch")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--pairs", default="", help="comma-separated prefill SM counts (default: the whole menu)")
    ap.add_argument("--decode-config", default="", help="JSON launch options of the paged decode kernel "
                    "(Model.decode_config), e.g. '{\"block_n\": 64, \"num_stages\": 2}'")
    ap.add_argument("--out", default="")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (no partitions)")
    args = ap.parse_args()

    spec = MODELS[args.model]
    L, bs, B = spec.num_layers, 16, args.batch
    t0 = time.perf_counter()
    menu = PartitionMenu.create(0)
    t_menu = time.perf_counter() - t0
    S = args.decode_steps
    dec_blocks = -(-(args.context + S) // bs)
    pre_blocks = -(-args.prefill_tokens // bs)
    num_blocks = B * dec_blocks + pre_blocks + 64
    ex = GpuExecutor(spec, "dummy", args.device, block_size=bs, num_blocks=num_blocks, menu=menu, seed=0,
                     reserved_bytes=0)
    if args.decode_config:
        ex.model.decode_config = json.loads(args.decode_config)
    ex.kv.k.normal_(0, 1)  # no timing on zeros
    ex.kv.v.normal_(0, 1)
    full_sms = menu.num_sms
    gpu_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"

    rng = np.random.default_rng(0)
    tables = [tuple(range(1 + i * dec_blocks, 1 + (i + 1) * dec_blocks)) for i in range(B)]
    dec_chunks = tuple(Chunk(10_000 + i, args.context, 1, tables[i], True, (int(rng.integers(spec.vocab_size)),))
                       for i in range(B))
    pre_ids = tuple(int(x) for x in rng.integers(0, spec.vocab_size, args.prefill_tokens))
    pre_chunk = Chunk(1, 0, args.prefill_tokens, tuple(range(B * dec_blocks + 1, B * dec_blocks + 1 + pre_blocks)),
                      True, pre_ids)
    step = args.layers_per_step

    def prefill_batches(part: Partition) -> list[Batch]:
        return [Batch(part, range(i, min(i + step, L)), (pre_chunk,)) for i in range(0, L, step)]

    def decode_batch(part: Partition, steps: int = S) -> Batch:
        return Batch(part, range(L), dec_chunks, steps)

    def step_spans(r) -> list[tuple[float, float]]:
        ends = list(r.step_ends)
        return list(zip([r.start] + ends[:-1], ends))

    def prefill_alone(part: Partition) -> float:
        res = []
        for b in prefill_batches(part):
            ex.launch(b)
            res += ex.wait(None)
        return res[-1].end - res[0].start

    def decode_alone(part: Partition, n: int = 10) -> float:
        """Median time of one decode step (one graph replay) inside fused launches."""
        times = []
        for _ in range(n):
            ex.launch(decode_batch(part))
            (r,) = ex.wait(None)
            times += [b - a for a, b in step_spans(r)]
        return statistics.median(times)

    def concurrent(pp: Partition, dp: Partition) -> tuple[float, float, float, int]:
        """(t_concurrent, decode steps inside it, median decode step time, steps launched)"""
        slices = prefill_batches(pp)
        ex.launch(decode_batch(dp))
        ex.launch(slices.pop(0))
        pre: list = []
        dec: list = []
        while ex.busy("prefill") or ex.busy("decode"):
            for r in ex.wait(None):
                if r.batch.lane == "prefill":
                    pre.append(r)
                    if slices:
                        ex.launch(slices.pop(0))
                else:
                    dec.append(r)
                    if slices or ex.busy("prefill"):
                        ex.launch(decode_batch(dp))
        a, z = pre[0].start, pre[-1].end
        spans = [s for r in dec for s in step_spans(r)]
        n = sum(max(0.0, min(e, z) - max(s, a)) / (e - s) for s, e in spans)
        return z - a, n, statistics.median(e - s for s, e in spans), len(spans)

    # warm-up (kernels, cuBLAS handles, graphs) and the whole-GPU references
    full = Partition("all", full_sms)
    ex.capture("all", full_sms, [B])
    prefill_alone(full)
    decode_alone(full, 3)
    meter = EnergyMeter()
    wall_full = [time.time()]
    pf_runs, e_pf_all, s_pf_all = meter.window(lambda: [prefill_alone(full) for _ in range(max(3, args.reps + 1))])
    t_pf_full = statistics.median(pf_runs)
    wall_full.append(time.time())
    dec_launches = 20
    t_dec_full, e_dec_all, s_dec_all = meter.window(lambda: decode_alone(full, dec_launches))
    e_pf_full = e_pf_all / len(pf_runs) if e_pf_all is not None else None  # J per prefill
    e_dec_full = e_dec_all / (dec_launches * S) if e_dec_all is not None else None  # J per decode step

    def measure(p) -> dict:
        if p == "naive":
            pp, dp = Partition("prefill", full_sms), Partition("decode", full_sms)
            label = "naive"
        else:
            pp, dp = Partition("prefill", p), Partition("decode", full_sms - p)  # a complementary nested pair
            label = f"{pp.num_sms}/{dp.num_sms}"
        ex.capture("decode", dp.num_sms, [B])
        prefill_alone(pp)  # warm this stream
        wall = [time.time()]  # phase boundaries (epoch s), to line up with an external clock/power log
        t_pf_alone = prefill_alone(pp)
        wall.append(time.time())
        t_dec_alone = decode_alone(dp, 5)
        wall.append(time.time())
        runs, e_co, s_co = meter.window(lambda: [concurrent(pp, dp) for _ in range(args.reps)])
        wall.append(time.time())
        t_c = statistics.median(r[0] for r in runs)
        t_dec_c = statistics.median(r[2] for r in runs)
        row = {"pair": label, "prefill_sms": pp.num_sms, "decode_sms": dp.num_sms,
               "t_prefill_alone_part": t_pf_alone, "t_decode_alone_part": t_dec_alone, "t_concurrent": t_c,
               "decode_steps": statistics.median(r[1] for r in runs), "t_decode_concurrent": t_dec_c,
               "prefill_slowdown": t_c / t_pf_alone, "decode_slowdown": t_dec_c / t_dec_alone,
               "ratio": statistics.median((t_pf_full + r[1] * t_dec_full) / r[0] for r in runs),
               "ratios": [(t_pf_full + r[1] * t_dec_full) / r[0] for r in runs], "wall": wall}
        if e_co is not None:  # energy: the co-run window against the same work done alone on the whole GPU
            steps_all = sum(r[3] for r in runs)
            e_alone = args.reps * e_pf_full + steps_all * e_dec_full
            n = row["decode_steps"]
            row.update(corun_j=e_co, corun_w=e_co / s_co, corun_j_vs_alone=e_co / e_alone,
                       cap_ceiling=(t_pf_full + n * t_dec_full) / ((e_pf_full + n * e_dec_full) / meter.cap_w))
        print(f"  {label:>8}: prefill {t_pf_alone * 1e3:.1f} ms alone, {t_c * 1e3:.1f} co; decode step "
              f"{t_dec_alone * 1e3:.2f} alone, {t_dec_c * 1e3:.2f} co, {row['decode_steps']:.1f} steps; "
              f"ratio {row['ratio']:.3f} {' '.join(f'{x:.3f}' for x in row['ratios'])}", flush=True)
        return row

    sizes = [int(s) for s in args.pairs.split(",") if s] or [n for n in menu.prefill if n < full_sms]
    rows = []
    for p in sizes + ["naive"]:
        try:
            rows.append(measure(p))
        except RuntimeError as e:  # report and go on (a CUDA error may be sticky: later pairs then fail too)
            print(f"  pair {p}: FAILED {str(e).splitlines()[0]}", flush=True)

    best = max((r for r in rows if r["pair"] != "naive"), key=lambda r: r["ratio"])
    print()
    print(f"{spec.name}, dummy weights, {gpu_name}, torch {torch.__version__}; "
          f"prefill {args.prefill_tokens} tokens in slices of {step} layers; decode {B} x {args.context} "
          f"context, {S} steps per launch (graphs per partition)")
    print(f"partition menu: {menu.describe()}, green={menu.green}, {menu.memory_bytes / 2**20:.0f} MiB of "
          f"device memory, made in {t_menu:.2f} s")
    print(f"whole GPU alone: prefill {t_pf_full * 1e3:.1f} ms, decode step {t_dec_full * 1e3:.2f} ms")
    energy = e_pf_full is not None
    if energy:
        print(f"energy (NVML, power cap {meter.cap_w:.0f} W): prefill {e_pf_full:.1f} J at "
              f"{e_pf_all / s_pf_all:.0f} W mean; decode step {e_dec_full:.2f} J at {e_dec_all / s_dec_all:.0f} W "
              "mean. cap ceiling = the ratio if the co-run drew the cap at the alone runs' joules per unit of work")
    print()
    hdr = ("pair P/D", "prefill ms (alone on P)", "concurrent ms", "decode steps", "step ms alone/co",
           "prefill slow", "ratio") + (("co-run W", "co-run J / alone J", "cap ceiling") if energy else ())
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))
    for r in rows:
        extra = (f" {r['corun_w']:.0f} | {r['corun_j_vs_alone']:.3f} | {r['cap_ceiling']:.3f} |"
                 if "corun_w" in r else "")
        print(f"| {r['pair']} | {r['t_prefill_alone_part'] * 1e3:.1f} | {r['t_concurrent'] * 1e3:.1f} | "
              f"{r['decode_steps']:.1f} | {r['t_decode_alone_part'] * 1e3:.2f} / {r['t_decode_concurrent'] * 1e3:.2f} | "
              f"{r['prefill_slowdown']:.2f}x | {r['ratio']:.3f} |{extra}")
    print()
    print(f"best pair {best['pair']}: {best['ratio']:.3f}x the work of back-to-back whole-GPU runs "
          f"(acceptance >= 1.2x: {'PASS' if best['ratio'] >= 1.2 else 'FAIL'})")
    if args.out:
        out = {"model": spec.name, "device": gpu_name, "torch": torch.__version__,
                   "args": vars(args), "menu_pairs": menu.describe(), "menu_bytes": menu.memory_bytes,
                   "t_prefill_full": t_pf_full, "wall_prefill_full": wall_full, "t_decode_full": t_dec_full,
                   "e_prefill_full_j": e_pf_full, "e_decode_step_full_j": e_dec_full, "power_cap_w": meter.cap_w,
                   "rows": rows}
        tmp = Path(args.out + ".tmp")
        tmp.write_text(json.dumps(out, indent=1))
        tmp.rename(args.out)
    ex.close()
    menu.close()


if __name__ == "__main__":
    main()
