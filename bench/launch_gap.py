"""What a host gap between launches does to a simulation: `bullet simulate --host-gap G,0` (every launch's work
starts ``G`` ms after the launch: the host time a real engine spends between one launch's end and the next
one's start: results, planning, input preparation) for each gap and policy. Prints TTFT and TPOT means.

The fitted models carry a measured gap (``bullet profile``'s gaps.csv, fitted into model.json's ``host_gap``:
0.30 ms + 4.3 us a request for Llama-3.1-8B on the H200); ``G = auto`` uses it, ``off`` none. Live serving on the
H200 showed 0.5-1.0 ms between back-to-back launches (bench/RESULTS.md, thirteenth session).

    python3 bench/launch_gap.py [--gaps off 0.6 0.9 auto] [--policies chunked static-split bullet] \\
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

POLICY_ARGS = {"chunked": ["--policy", "chunked", "--max-num-batched-tokens", "2048"],
               "static-split": ["--policy", "static-split", "--prefill-sms", "92"],
               "bullet": ["--policy", "bullet", "--decode-sizes", "16,32,48,64,80,96,112"],  # as serve_vs_sim
               "prefill-first": ["--policy", "prefill-first"], "naive-concurrent": ["--policy", "naive-concurrent"]}
DEFAULT_ARGS = ["--trace", "sharegpt", "--num-requests", "60", "--request-rate", "4", "--fuse-window-ms", "10",
                "--no-prefix-caching"]


def gap_flag(gap: str) -> str:
    """'off' / 'auto' as they are; a number of ms as 'G,0' (no per-request term)."""
    return gap if gap in ("off", "auto") else f"{float(gap):g},0"


def run(gap: str, args: list[str]) -> dict:
    from bullet.cli import app

    out = StringIO()
    with redirect_stdout(out):
        app(["simulate", "--json", "--host-gap", gap_flag(gap), *args], standalone_mode=False)
    if not out.getvalue().strip():
        sys.exit(f"bullet simulate {' '.join(args)}: failed (its error is above)")
    return json.loads(out.getvalue())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gaps", nargs="+", default=["off", "0.6", "0.9", "auto"],
                    help="ms between launches, or off / auto (the fitted model's)")
    ap.add_argument("--policies", nargs="+", default=["chunked", "static-split", "bullet"], choices=POLICY_ARGS)
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="after --: arguments of `bullet simulate`")
    a = ap.parse_args()
    rest = [x for x in a.rest if x != "--"] or DEFAULT_ARGS
    print("| gap ms | " + " | ".join(f"{p} TTFT / TPOT mean ms" for p in a.policies) + " |")
    print("|---:|" + "---:|" * len(a.policies))
    for g in a.gaps:
        cells = []
        for p in a.policies:
            s = run(g, rest + POLICY_ARGS[p])
            cells.append(f"{s['ttft_ms']['mean']:.1f} / {s['tpot_ms']['mean']:.2f}")
        print(f"| {g} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
