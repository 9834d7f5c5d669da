"""What one ``bullet`` decision costs on the host: 256 requests decoding and 64 queued (Llama-3.1-8B on an
H200, roofline or fitted latency model), timed with ``timeit`` over the pieces a launch decision runs:
the split for a prefill slice (TPOT step budgets, the decode size by bisection, the TTFT risk check and the
pause check), the queue order (EDF with lateness) and the decode lane's idle decoders. The split and the queue
order are timed as a launch meets them (a decode launch came back since the last view: the arrays advanced, the
view and the seat releases gathered afresh) and with the decoding requests unchanged (the gathered arrays reused).

    python3 bench/policy_decision.py [--latency roofline|fitted|PATH] [--running 256] [--waiting 64]
"""

from __future__ import annotations

import argparse
import sys
import timeit
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bullet.batch import Batch
from bullet.config import GPUS, MODELS, SchedulerConfig, SloConfig
from bullet.kvcache import BlockManager
from bullet.perfmodel import work_of
from bullet.perfmodel.base import CachedLatency
from bullet.policies import make_scheduler
from bullet.request import Request
from simulator.run import latency_model


def state(running: int, waiting: int, latency):
    model, gpu = MODELS["llama-3.1-8b"], GPUS["h200"]
    rng = np.random.default_rng(0)
    sched = make_scheduler(SchedulerConfig(policy="bullet"), model, gpu, BlockManager(60_000, 16),
                           CachedLatency(latency), slo=SloConfig(ttft=None, ttft_per_token=0.003, tpot=0.15))
    now = 100.0
    for i in range(running):
        r = Request(i, now - float(rng.uniform(1, 20)), int(rng.integers(100, 3000)), 500)
        sched.add(r)
        sched._admit(r)
        out = int(rng.integers(1, 400))
        sched.kv.allocate(r.id, r.prompt_len + out)
        r.num_output, r.num_computed = out, r.prompt_len + out - 1
        r.first_token_time = r.arrival + 0.5
    for i in range(running, running + waiting + 1):  # the first becomes the prefill job: `waiting` stay queued
        sched.add(Request(i, now - float(rng.uniform(0, 1)), int(rng.integers(100, 3000)), 300))
    job = [sched.waiting[0]]
    sched._admit(job[0])  # (takes it off the queue)
    sched.kv.allocate(job[0].id, job[0].known)
    chunks = (sched._prefill_chunk(job[0], job[0].remaining),)
    sched.job = (chunks, job, 0)
    work = work_of(Batch(sched.whole_gpu, range(8), chunks), model.num_layers)
    return sched, now, work


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--latency", default="roofline")
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--waiting", type=int, default=64)
    args = ap.parse_args()
    model, gpu = MODELS["llama-3.1-8b"], GPUS["h200"]
    sched, now, work = state(args.running, args.waiting, latency_model(args.latency, model, gpu))
    view = sched._view(sched._decoding(), now)
    arrays = sched._arrays  # (None below ARRAYS_FROM running requests: the view is a Python pass)
    slots = arrays.slots(sched._decoders()) if arrays is not None else None

    def came_back():  # a decode launch came back: every decoding request advanced (0 steps: same state)
        if arrays is not None:
            arrays.advance(slots, 0)

    def split():
        return sched._prefill_want(now, work, sched._view(sched._decoding(), now))

    # a new prefill job each call (a prompt of another length each time: 200,000 of them): the latency model's
    # answers are not cached, as when a job forms; the searches start from the last decision's answers (warm)
    # or from nothing (cold)
    (chunk,), job_reqs, _ = sched.job
    nxt = iter(range(10**9))

    def new_job(cold: bool):
        k = next(nxt) % 200_000
        sched.job = ((chunk._replace(num_tokens=16 + k),), job_reqs, 0)
        if cold:
            sched._last.clear()
        return sched._prefill_want(now, sched._job_work(range(8)), view)

    cases = {
        "prefill slice split after a decode launch came back (advance + _view + _prefill_want)":
            lambda: (came_back(), split()),
        "prefill slice split, decoding requests unchanged since the last view": split,
        "  decoding requests and their step budget (advance + _view)":
            lambda: (came_back(), sched._view(sched._decoding(), now)),
        "  decode size (_decode_need)": lambda: sched._decode_need(view, work),
        f"a new prefill job, queue {'blocked' if not sched.admissible() else 'admissible'}: the split "
        "(_prefill_want), predictions not cached, searches warm-started": lambda: new_job(False),
        "  ... searches cold (no earlier answer)": lambda: new_job(True),
        f"queue order, {len(sched.waiting)} waiting (_order)": lambda: sched._order(now),
        "  ... after a decode launch came back (advance + _order: the seat releases gathered afresh)":
            lambda: (came_back(), sched._order(now)),
        "decode lane: idle decoders (_decoders)": sched._decoders,
    }
    print(f"bullet decision cost: {view.work.seqs} decoding, {len(sched.waiting)} waiting, latency "
          f"{args.latency}\n")
    print("| piece | us per call |")
    print("|---|---:|")
    for name, fn in cases.items():
        n, _ = timeit.Timer(fn).autorange()
        best = min(timeit.repeat(fn, number=n, repeat=5)) / n
        print(f"| {name} | {best * 1e6:.1f} |")


if __name__ == "__main__":
    main()
