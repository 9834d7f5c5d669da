"""How much launch-to-launch noise moves a simulated run's TTFT and TPOT: the runs of a saved ``bullet validate
--json`` report simulated again with every launch's predicted time multiplied by a seeded factor 1 + N(0, sigma)
(one per launch, kept when the launch is re-timed beside a new co-runner) that the policy does not see, as a
real card's launches differ from the model. Prints each run's error against the real run at each sigma (mean
over ``--seeds``): where a deterministic simulation's miss is within what such noise moves, the miss is not the
model's.

    python3 bench/launch_noise.py bench/data/h200-2026-12-02/validate_static.json --policy static-split \\
        [--prefill-sms 92] [--sigmas 0,0.03,0.06] [--seeds 4] [--num-requests 120]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import simulator.executor as sim_executor
from bullet.config import CacheConfig, SchedulerConfig, SloConfig, resolve_gpu, resolve_model
from bullet.traces import load_trace
from simulator.run import latency_model, simulate


class _Scaled:
    """A latency model's ``predict`` times a factor (what the executor times a noisy launch with)."""

    def __init__(self, model, factor: float) -> None:
        self.model, self.factor = model, factor

    def predict(self, *args, **kwargs):
        return self.factor * self.model.predict(*args, **kwargs)


def noisy_time(state: dict):
    """A replacement for ``SimExecutor._time`` that scales each launch by its own factor from ``state``."""
    plain = sim_executor.SimExecutor._time

    def _time(self, lane, f, now, co, co_sms):
        key = (lane, f.start)  # one launch (a lane's launches start one after another)
        factor = state["factors"].get(key)
        if factor is None:
            factor = state["factors"][key] = max(0.5, 1.0 + state["rng"].normal(0.0, state["sigma"]))
        latency, step_ends = self.latency, self._step_ends
        self.latency = _Scaled(latency, factor)
        self._step_ends = lambda *a, **k: [factor * x for x in step_ends(*a, **k)]
        try:
            return plain(self, lane, f, now, co, co_sms)
        finally:
            self.latency, self._step_ends = latency, step_ends

    return _time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report", type=Path, help="`bullet validate --json` output")
    ap.add_argument("--policy", required=True)
    ap.add_argument("--prefill-sms", type=int, default=92)
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--latency", default="profiles/h200/llama-3.1-8b/model.json")
    ap.add_argument("--num-requests", type=int, default=120, help="as the report's runs were served")
    ap.add_argument("--num-blocks", type=int, default=46390)
    ap.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=150.0)
    ap.add_argument("--sigmas", default="0,0.03,0.06")
    ap.add_argument("--seeds", type=int, default=4)
    args = ap.parse_args()
    try:
        runs = json.loads(args.report.read_text())["runs"]
    except (OSError, ValueError, KeyError) as e:
        ap.error(f"{args.report}: not a `bullet validate --json` report ({e})")
    spec, gpu = resolve_model("llama-3.1-8b"), resolve_gpu("h200")
    lat = latency_model(args.latency, spec, gpu)
    cfg = SchedulerConfig(policy=args.policy, prefill_sms=args.prefill_sms, max_batched_tokens=args.max_batched_tokens)
    slo = SloConfig(ttft=args.slo_ttft_ms / 1e3, tpot=args.slo_tpot_ms / 1e3)
    sigmas = [float(x) for x in args.sigmas.split(",")]
    state: dict = {}
    plain = sim_executor.SimExecutor._time
    print("| run | " + " | ".join(f"sigma {s:g}: TTFT mean / TPOT mean" for s in sigmas) + " |")
    print("|---|" + "---:|" * len(sigmas))
    for run in runs:
        reqs = load_trace(run["trace"], num_requests=args.num_requests, rate=run["rate"])
        real = run["real"]
        cells = []
        for sigma in sigmas:
            vals = []
            for seed in range(args.seeds if sigma else 1):
                state.update(sigma=sigma, rng=np.random.default_rng(seed), factors={})
                sim_executor.SimExecutor._time = noisy_time(state) if sigma else plain
                try:
                    s = simulate(reqs, spec, gpu, cfg, CacheConfig(num_blocks=args.num_blocks), slo, lat,
                                 timeline=False).summary
                finally:
                    sim_executor.SimExecutor._time = plain
                vals.append((s["ttft_ms"]["mean"] / real["ttft_ms"]["mean"] - 1,
                             s["tpot_ms"]["mean"] / real["tpot_ms"]["mean"] - 1))
            a = np.array(vals)
            cells.append(f"{100 * a[:, 0].mean():+.1f} % (sd {100 * a[:, 0].std():.1f}) / "
                         f"{100 * a[:, 1].mean():+.1f} % (sd {100 * a[:, 1].std():.1f})")
        print(f"| {run['trace']} @ {run['rate']:g} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
