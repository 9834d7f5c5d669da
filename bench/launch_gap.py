"""What a host gap between launches would do to a simulation: `bullet simulate` with ``g`` seconds added to every
launch's first step (the host time a real engine spends between one launch's end and the next one's start:
results, planning, input preparation), for each gap and policy. Prints TTFT and TPOT means.

The simulator plans in zero time and has no host time between launches (a decode graph's input preparation is
inside the fitted first step; the engine's results, planning and bookkeeping are not); on the H200, in-process serving showed 0.53-1.06 ms (median) between back-to-back decode launches
(`bullet validate --policy static-split`, `launches.csv`; bench/RESULTS.md, eleventh session).

    python3 bench/launch_gap.py [--gaps-ms 0 0.6 0.9] [--policies chunked static-split bullet] \\
        [-- SIMULATE ARGS]   (default: --trace sharegpt --num-requests 60 --request-rate 4 --fuse-window-ms 10
                              --no-prefix-caching, as bench/serve_vs_sim.py's simulations)
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import redirect_stdout
from io import StringIO
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

POLICY_ARGS = {"chunked": ["--policy", "chunked", "--max-num-batched-tokens", "2048"],
               "static-split": ["--policy", "static-split", "--prefill-sms", "92"],
               "bullet": ["--policy", "bullet", "--decode-sizes", "16,32,48,64,80,96,112"],  # as serve_vs_sim
               "prefill-first": ["--policy", "prefill-first"], "naive-concurrent": ["--policy", "naive-concurrent"]}
DEFAULT_ARGS = ["--trace", "sharegpt", "--num-requests", "60", "--request-rate", "4", "--fuse-window-ms", "10",
                "--no-prefix-caching"]


class Gapped:
    """A latency model whose launches each take ``gap`` seconds longer (added to the first step)."""

    def __init__(self, inner, gap: float) -> None:
        self.inner, self.gap = inner, gap

    def predict(self, work, num_sms, co=None, co_sms=0):
        return self.inner.predict(work, num_sms, co, co_sms) + self.gap

    def decode_steps(self, work, steps, num_sms, co=None, co_sms=0):
        out = np.array(self.inner.decode_steps(work, steps, num_sms, co, co_sms), dtype=np.float64)
        if len(out):
            out[0] += self.gap
        return out

    def decode_step_ends(self, work, steps, num_sms, co=None, co_sms=0):
        times = self.decode_steps(work, steps, num_sms, co, co_sms)
        return times, times.cumsum()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def run(gap: float, args: list[str]) -> dict:
    import simulator.run as sim_run
    from bullet.cli import app

    real = sim_run.latency_model
    sim_run.latency_model = lambda *a, **k: Gapped(real(*a, **k), gap)
    out = StringIO()
    try:
        with redirect_stdout(out):
            app(["simulate", "--json", *args], standalone_mode=False)
    finally:
        sim_run.latency_model = real
    if not out.getvalue().strip():
        sys.exit(f"bullet simulate {' '.join(args)}: failed (its error is above)")
    return json.loads(out.getvalue())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gaps-ms", type=float, nargs="+", default=[0.0, 0.6, 0.9])
    ap.add_argument("--policies", nargs="+", default=["chunked", "static-split", "bullet"], choices=POLICY_ARGS)
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="after --: arguments of `bullet simulate`")
    a = ap.parse_args()
    rest = [x for x in a.rest if x != "--"] or DEFAULT_ARGS
    print("| gap ms | " + " | ".join(f"{p} TTFT / TPOT mean ms" for p in a.policies) + " |")
    print("|---:|" + "---:|" * len(a.policies))
    for g in a.gaps_ms:
        cells = []
        for p in a.policies:
            s = run(g / 1e3, rest + POLICY_ARGS[p])
            cells.append(f"{s['ttft_ms']['mean']:.1f} / {s['tpot_ms']['mean']:.2f}")
        print(f"| {g:g} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
