"""What one ``bullet`` decision costs on the host: 256 requests decoding and 64 queued (Llama-3.1-8B on an
H200, roofline or fitted latency model), timed with ``timeit`` over the pieces a launch decision runs:
the split for a prefill slice (TPOT step budgets, the decode size by bisection, the TTFT risk check and the
pause check), the queue order (EDF with lateness) and the decode lane's idle decoders. The split and the queue
order are timed as a launch meets them (a decode launch came back since the last view: the arrays advanced, the
view and the seat releases gathered afresh) and with the decoding requests unchanged (the gathered arrays reused).

The last rows time whole decisions, ``schedule(lane, ...)`` as ``serve()`` calls it, each on a state of its own
(another seed each: other prompts, outputs and deadlines), built, warmed up and then timed once: a decision changes
the state (it admits, launches), so it cannot be repeated on one. Warmed up: a twin of the state (the same seed)
decides just before, so the code is warm and the searches' warm starts and the per-token prefill speed are the
twin's answers (the last decision's); then a one-step decode launch of every decoding request comes back to the
state through ``on_result``, as the engine hands it over before the decision. Each repeat is the mean over the states; the table gives the best of 5 repeats, as for the pieces.
The pieces above run hot (one state, its data in the nearest caches): a whole decision costs more than its pieces.

    python3 bench/policy_decision.py [--latency roofline|fitted|PATH] [--running 256] [--waiting 64]
                                     [--states 30] [--rows all|pieces|decisions] [--callgrind]

``--callgrind`` counts instructions instead (needs valgrind; deterministic, so it holds on a shared machine): each
whole decision, and the queue order alone in the new job's state, under callgrind with collection toggled around
the ``schedule()`` (``_order``) call alone, on states 1..``--states``; the mean over the states from
``--callgrind-from`` (6: the first decisions fill the latency model's memos).
"""

from __future__ import annotations

import argparse
import gc
import math
import operator
import os
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bullet.batch import Batch, DecodeChunks, StepResult
from bullet.config import GPUS, MODELS, SchedulerConfig, SloConfig
from bullet.kvcache import BlockManager
from bullet.perfmodel import work_of
from bullet.perfmodel.base import CachedLatency
from bullet.policies import make_scheduler
from bullet.request import Request
from simulator.run import latency_model


def state(running: int, waiting: int, latency, seed: int = 0, seats: int = 256, job: bool = True):
    """``running`` requests decoding and ``waiting + 1`` queued, the first of which becomes the prefill job (its
    first slice not run) with ``job``; ``seats``: max_num_seqs."""
    model, gpu = MODELS["llama-3.1-8b"], GPUS["h200"]
    rng = np.random.default_rng(seed)
    sched = make_scheduler(SchedulerConfig(policy="bullet", max_num_seqs=seats), model, gpu, BlockManager(60_000, 16),
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
    if not job:
        return sched, now, None
    job = [sched.waiting[0]]
    sched._admit(job[0])  # (takes it off the queue)
    sched.kv.allocate(job[0].id, job[0].known)
    chunks = (sched._prefill_chunk(job[0], job[0].remaining),)
    sched.job = (chunks, job, 0)
    work = work_of(Batch(sched.whole_gpu, range(8), chunks), model.num_layers)
    return sched, now, work


def came_back(sched, now: float) -> None:
    """A one-step decode launch of every decoding request on the whole GPU came back just now, through
    ``on_result`` as the engine hands it over (every decoding request one token further, the decode arrays
    advanced, their gathered view and sorted tokens left dropped)."""
    sched._view(sched._decoding(), now)  # (makes the decode arrays and gathers the decoding slots)
    reqs = sched._one_step(sched._decoders())
    chunks = DecodeChunks(reqs, [r.num_computed for r in reqs], sched.kv)
    batch = sched._launch("decode", Batch(sched._part("decode", sched.N), sched.all_layers, chunks), reqs)
    sched._note_decode_end(batch, now, None, 0)
    sched.on_result(StepResult(batch, now - 0.01, now, [now], None))


def decision_states(running: int, waiting: int, latency, kind: str, seed: int, twin_latency=None):
    """A state (:func:`state`, seeded) for a whole decision of ``kind``, warmed up; returns (the scheduler,
    now, the lane to schedule, the twin). ``new-job``: ``running - 1`` decoding (a request finished in the launch
    that came back), its seat free, no job, ``waiting + 1`` queued; the prefill decision orders the queue and
    admits its head into the last seat (``waiting`` stay queued, the queue then blocked). ``slice``: seats full,
    the job's first slice came back, then the decode launch. ``blocked``: seats full, no job: the prefill
    decision orders the queue and finds nobody admissible. ``decode-beside``: the decode lane right after
    ``new-job``'s prefill decision (its first slice in flight). ``decode-whole``: the decode lane, prefill idle,
    seats full and nobody admissible: a stretch on the whole GPU. ``twin_latency``: the twin's model (another
    instance: the fitted model memoises parts of its predictions, and the twin's would be the timed decision's)."""
    n = running - 1 if kind in ("new-job", "decode-beside") else running  # (a request finished: its seat free)
    (sched, now, _), (twin, _, _) = [state(n, waiting, model, seed, running, job=kind == "slice")
                                     for model in (latency, twin_latency or latency)]
    lanes = {"decode-beside": ("prefill", "decode"), "decode-whole": ("decode",)}.get(kind, ("prefill",))
    for s in (twin, sched):  # the twin decides first: its answers warm-start the timed decision's searches
        if kind == "slice":
            s.job = (*s.job[:2], 8)  # (its first 8 layers done)
        came_back(s, now)
        if s is twin:
            for lane in lanes:
                twin.schedule(lane, now, None)
    sched._last.update(twin._last)
    sched._per_token.update(twin._per_token)
    sched._step_s = twin._step_s  # (a decode stretch's steps are first timed to a guess from the last one's)
    if kind == "decode-beside":
        sched.schedule("prefill", now, None)
    return sched, now, lanes[-1], twin


def time_decisions(running: int, waiting: int, latency, twin_latency, kind: str, states: int,
                   repeat: int = 5) -> float:
    """The best of ``repeat`` means over ``states`` seeded states of one ``schedule()`` call each (seconds), each
    timed right after its twin's decision (the twin alive until then). On this VM a decision run right after
    other code cost 2-10x: 3-6x just after a state's build, ~2x on states built first and decided in turn (their
    data out of the caches), ~2x again after freeing a twin; with the twin's decision just before, the code is
    warm and the state's data (built some 20 ms earlier) about as near as in a simulation, where a launch's
    results and the other lane's decision come between two decisions."""
    best = math.inf
    for _ in range(repeat):
        total = 0.0
        for seed in range(1, states + 1):
            sched, now, lane, twin = decision_states(running, waiting, latency, kind, seed, twin_latency)
            gc.disable()
            t0 = time.perf_counter()
            sched.schedule(lane, now, None)
            total += time.perf_counter() - t0
            gc.enable()
            del sched, twin
        best = min(best, total / states)
    return best


# callgrind counts only inside this C function (``--toggle-collect``), which nothing in a decision calls: the timed
# call goes through it and nothing else does
TOGGLE = "_operator_call"
KINDS = ("new-job", "slice", "blocked", "decode-beside", "decode-whole", "order")


def collect(running: int, waiting: int, latency, twin_latency, kind: str, states: int, first: int,
            within: str | None = None) -> None:
    """Under callgrind (:func:`instructions`): one decision of ``kind`` on each of states 1..``states``, called
    through ``operator.call`` (collected) from state ``first`` on. ``order``: ``_order`` alone in the new job's
    state (a decode launch came back: the seat releases gathered afresh). ``within`` (``Class.method``, a class of
    the scheduler's or the latency model's module): only the calls of that method inside the decision are
    collected (each goes through ``operator.call`` while the decision runs; a method that calls itself, or is
    reached twice on one stack, counts twice)."""
    owner = name = None
    if within is not None:
        cls_name, name = within.split(".")
        owner = _owner(cls_name)
    for seed in range(1, states + 1):
        sched, now, lane, twin = decision_states(running, waiting, latency,
                                                 "new-job" if kind == "order" else kind, seed, twin_latency)
        fn, args = (sched._order, (now,)) if kind == "order" else (sched.schedule, (lane, now, None))
        gc.disable()
        if seed >= first and owner is not None:
            orig = owner.__dict__[name]
            call = operator.call
            setattr(owner, name, _through(orig, call))
            try:
                fn(*args)
            finally:
                setattr(owner, name, orig)
        elif seed >= first:
            operator.call(fn, *args)
        else:
            fn(*args)
        gc.enable()
        del sched, twin


def _owner(cls_name: str) -> type | None:
    """The class named ``cls_name`` among the scheduler's, the block manager's and the latency models' modules."""
    import importlib
    for mod in ("bullet.policies.bullet", "bullet.policies.base", "bullet.kvcache", "bullet.perfmodel.fitted",
                "bullet.perfmodel.base", "bullet.perfmodel.roofline"):
        cls = getattr(importlib.import_module(mod), cls_name, None)
        if isinstance(cls, type):
            return cls
    return None


def _through(orig, call):
    """``orig`` (a function, staticmethod or property of a class) called through ``call``."""
    if isinstance(orig, staticmethod):
        f = orig.__func__
        return staticmethod(lambda *a, **k: call(f, *a, **k))
    if isinstance(orig, property):
        g = orig.fget
        return property(lambda self: call(g, self))
    return lambda *a, **k: call(orig, *a, **k)


def instructions(argv: list[str], kind: str, states: int, first: int) -> float:
    """Mean instructions of one decision of ``kind`` over states ``first``..``states`` (this script re-run under
    callgrind with ``--collect``; ``PYTHONHASHSEED=0`` and no address randomisation: the same count every run)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
        subprocess.run(["setarch", "-R", "valgrind", "--tool=callgrind", f"--toggle-collect={TOGGLE}",
                        f"--callgrind-out-file={out}", sys.executable, __file__, *argv, "--collect", kind],
                       env=env, check=True, capture_output=True)
        for line in out.read_text().splitlines():
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1]) / (states - first + 1)
    raise RuntimeError("callgrind wrote no totals")


def floor(running: int, blocks: int = 7) -> None:
    """The cost of the simplest per-request work a decision over ``running`` requests can do: one pass reading an
    attribute, one looking each block table up by id, and growing every table by ``blocks`` blocks
    (``BlockManager.grow``, a fresh pool each run: the best of 20)."""
    reqs = [Request(i, 0.0, 100 + i, 500) for i in range(running)]
    tables = {r.id: [0, 1, 2] for r in reqs}

    def best(fn) -> float:
        n, _ = timeit.Timer(fn).autorange()
        return min(timeit.repeat(fn, number=n, repeat=5)) / n

    def grow() -> float:
        out = math.inf
        for _ in range(20):
            kv = BlockManager(60_000, 16)
            for r in reqs:
                kv.allocate(r.id, r.prompt_len)
            wants = [(r.id, (len(kv.tables[r.id]) + blocks) * 16) for r in reqs]
            t0 = time.perf_counter()
            kv.grow(wants)
            out = min(out, time.perf_counter() - t0)
        return out

    print(f"per-request floor, {running} running requests\n")
    print("| pass | us |")
    print("|---|---:|")
    print(f"| one attribute of each ([r.num_computed for r in reqs]) | {best(lambda: [r.num_computed for r in reqs]) * 1e6:.1f} |")
    print(f"| each table by id ([tables[r.id] for r in reqs]) | {best(lambda: [tables[r.id] for r in reqs]) * 1e6:.1f} |")
    print(f"| BlockManager.grow of every table by {blocks} blocks | {grow() * 1e6:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--latency", default="roofline")
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--waiting", type=int, default=64)
    ap.add_argument("--states", type=int, default=30, help="seeded states per whole-decision row")
    ap.add_argument("--rows", choices=("all", "pieces", "decisions", "floor"), default="all",
                    help="floor: what plain Python passes over the running requests cost, for scale")
    ap.add_argument("--callgrind", action="store_true", help="instructions per whole decision (needs valgrind)")
    ap.add_argument("--callgrind-from", type=int, default=6, help="the first state counted (earlier ones: warm-up)")
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="--callgrind: the decisions")
    ap.add_argument("--within", metavar="CLASS.METHOD",
                    help="--callgrind: count only inside this method's calls (e.g. Bullet._order) in each decision")
    ap.add_argument("--collect", choices=KINDS, help=argparse.SUPPRESS)  # (the run under callgrind)
    args = ap.parse_args()
    for name in ("running", "waiting", "states", "callgrind_from"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: at least 1, got {getattr(args, name)}")
    if args.callgrind_from > args.states:
        ap.error(f"--callgrind-from {args.callgrind_from} is past --states {args.states}")
    if args.within is not None:
        cls_name, _, method = args.within.partition(".")
        owner = _owner(cls_name)
        if owner is None or not method or method not in owner.__dict__:
            ap.error(f"--within {args.within}: give CLASS.METHOD, a method defined on a class of the scheduler's, "
                     f"block manager's or latency models' modules (e.g. Bullet._order)")
    model, gpu = MODELS["llama-3.1-8b"], GPUS["h200"]
    latency = latency_model(args.latency, model, gpu)
    twin_latency = latency_model(args.latency, model, gpu)  # (the whole decisions' twins': see decision_states)
    R, W = args.running, args.waiting
    if args.collect:
        collect(R, W, latency, twin_latency, args.collect, args.states, args.callgrind_from, args.within)
        return
    if args.callgrind:
        argv = ["--latency", args.latency, "--running", str(R), "--waiting", str(W), "--states", str(args.states),
                "--callgrind-from", str(args.callgrind_from), *(("--within", args.within) if args.within else ())]
        inside = f", inside {args.within} alone" if args.within else ""
        print(f"bullet decision instructions: {R} running, {W} waiting, latency {args.latency}, mean of states "
              f"{args.callgrind_from}-{args.states}{inside}\n")
        print("| decision | instructions |")
        print("|---|---:|")
        for kind in args.kinds:
            print(f"| {kind} | {instructions(argv, kind, args.states, args.callgrind_from):,.0f} |", flush=True)
        return
    if args.rows == "floor":
        floor(R)
        return
    sched, now, work = state(args.running, args.waiting, latency)
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
    for name, fn in cases.items() if args.rows != "decisions" else ():
        n, _ = timeit.Timer(fn).autorange()
        best = min(timeit.repeat(fn, number=n, repeat=5)) / n
        print(f"| {name} | {best * 1e6:.1f} |")
    decisions = {
        f"whole decision, prefill lane: a new job after a decode launch came back ({R - 1} decoding, one seat "
        f"free, {W + 1} queued: schedule() orders the queue, admits the head, sizes its first slice)": "new-job",
        f"whole decision, prefill lane: the job's next slice after a decode launch came back (seats full, {W} "
        "queued)": "slice",
        f"whole decision, prefill lane: seats full, no job ({W + 1} queued: the order, nobody admissible)": "blocked",
        "whole decision, decode lane: beside the new job's first slice (right after the prefill decision)":
            "decode-beside",
        "whole decision, decode lane: prefill idle, the queue blocked (a stretch on the whole GPU)": "decode-whole",
    }
    for name, kind in decisions.items() if args.rows != "pieces" else ():
        print(f"| {name} | {time_decisions(R, W, latency, twin_latency, kind, args.states) * 1e6:.1f} |")


if __name__ == "__main__":
    main()
