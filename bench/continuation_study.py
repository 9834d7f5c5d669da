"""What continuing a fused decode stretch in place would change: a proposal's measurement (issue 13 part 3).

    python bench/continuation_study.py [--policy static-split naive-concurrent bullet] [--trace sharegpt ...]

The two-lane policies end a decode stretch at the other lane's events (an arrival, the end of a prefill launch
or layer slice) and then often launch the very same requests on the very same SMs again at once: a launch
boundary that only re-plans. Continuing the stretch in place (the executor told to run more steps of the
launch in flight) would remove those launches from a simulation, and on a GPU the boundary's cost: the
engine's host gap before the launch and the first step's input preparation (the ``decode_first`` family).

This simulates each such relaunch as a continuation -- its lane's last launch had the same requests in the same
order on the same SMs and ended at this launch's start; no host gap, every step timed as a later step of a
stretch -- and prints how many launches that is and how the run's TTFT and TPOT means and SLO attainment
(default SLOs) move. The policies still decide as they do today (they size stretches with a first step), so
this is the result change of the proposal, not its implementation.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bullet.config import CacheConfig, SchedulerConfig, SloConfig, resolve_gpu, resolve_model
from bullet.perfmodel import Work
from bullet.perfmodel.base import step_ends
from bullet.traces import load_trace
from simulator import run
from simulator.executor import SimExecutor

AZURE = Path(__file__).resolve().parents[2] / "shared/traces/raw/AzureLLMInferenceTrace_conv.csv"


class ContinuingSim(SimExecutor):
    """A SimExecutor that times a decode relaunch of its lane's last requests on the same SMs, at the instant
    that launch ended, as a continuation of it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.last: dict[str, tuple[tuple[int, ...], int, float]] = {}  # lane -> (request ids, SMs, end)
        self.cont: set[int] = set()  # id() of the flights that continue
        self.continued = 0
        self._next_cont = False

    def launch(self, batch) -> None:
        lane = batch.partition.lane
        prev = self.last.get(lane)
        ids = tuple(c.req_id for c in batch.chunks)
        cont = (lane == "decode" and prev is not None and prev[:2] == (ids, batch.partition.num_sms)
                and prev[2] == self._now and all(c.num_tokens == 1 for c in batch.chunks))
        gap, self._next_cont = self.host_gap, cont
        if cont:
            self.host_gap = (0.0, 0.0)
            self.continued += 1
        try:
            super().launch(batch)
        finally:
            self.host_gap, self._next_cont = gap, False

    def _time(self, lane, f, now, co, co_sms) -> None:
        if self._next_cont and not f.token:  # the flight just launched
            self.cont.add(id(f))
        if id(f) not in self.cont:
            return super()._time(lane, f, now, co, co_sms)
        w = f.work  # its steps as the 2nd.. of a stretch that started a step earlier
        before = Work(w.num_layers, w.tokens, w.seqs, w.attn_pairs - w.seqs, w.kv_read - w.seqs, w.samples,
                      w.embed, w.max_kv - 1)
        ends = np.asarray(step_ends(self.latency, before, f.steps + 1, f.sms, co, co_sms))
        cum = ends[1:] - ends[0]
        duration = float(cum[-1])
        if f.cum is None:
            f.cum = cum
        self._run_at(lane, f, now, duration)  # (a continuation has no host gap)

    def _finish(self, lane, token) -> None:
        f = self._flights.get(lane)
        if f is not None and f.token == token:
            self.last[lane] = (tuple(c.req_id for c in f.batch.chunks), f.sms, self._now)
            self.cont.discard(id(f))
        super()._finish(lane, token)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", nargs="+", default=["static-split", "naive-concurrent", "bullet"])
    ap.add_argument("--trace", nargs="+", default=["sharegpt", "azure-code", "arxiv", str(AZURE)])
    args = ap.parse_args()
    model, gpu = resolve_model("llama-3.1-8b"), resolve_gpu("h200")
    latency = run.latency_model("auto", model, gpu)
    print("trace | policy | launches | continuations | TTFT mean ms today / continued | TPOT mean ms | attainment")
    try:
        for trace in args.trace:
            reqs = load_trace(trace)
            for policy in args.policy:
                out = {}
                for mode in ("today", "continued"):
                    made: list[ContinuingSim] = []

                    def continuing(*a, made: list[ContinuingSim] = made, **k) -> ContinuingSim:
                        made.append(ContinuingSim(*a, **k))
                        return made[-1]

                    run.SimExecutor = continuing if mode == "continued" else SimExecutor
                    s = run.simulate(reqs, model, gpu, SchedulerConfig(policy=policy), CacheConfig(), SloConfig(),
                                     latency=latency, timeline=False).summary
                    out[mode] = (s["ttft_ms"]["mean"], s["tpot_ms"]["mean"], s["slo_attainment"], s["launches"],
                                 made[0].continued if made else 0)
                a, b = out["today"], out["continued"]
                print(f"{Path(trace).stem} | {policy} | {a[3]:,} | {b[4]:,} ({100 * b[4] / a[3]:.1f} %) | "
                      f"{a[0]:.1f} / {b[0]:.1f} ({100 * (b[0] / a[0] - 1):+.2f} %) | {a[1]:.2f} / {b[1]:.2f} "
                      f"({100 * (b[1] / a[1] - 1):+.2f} %) | {a[2]:.4f} / {b[2]:.4f}", flush=True)
    finally:
        run.SimExecutor = SimExecutor


if __name__ == "__main__":
    main()
