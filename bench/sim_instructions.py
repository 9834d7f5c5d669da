"""Simulator cost in instructions, the figure that holds on a shared machine: ``bullet simulate`` in-process on the
first N requests of the Azure 2023 conversation trace under callgrind, minus the same on 1 request (start-up,
imports, trace and model loading). Needs valgrind. Prints one row per policy.

    python3 bench/sim_instructions.py [--policy chunked ...] [--num-requests 3000]

Run on a byte-compiled tree (``python3 -m compileall -q bullet simulator``) when PYTHONDONTWRITEBYTECODE is set:
compiling changed modules costs ~100M instructions, which the subtraction removes only when both runs pay it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared/traces/raw/AzureLLMInferenceTrace_conv.csv"
# the CLI in-process as the `bullet` script runs it, with rich's refresh thread off (its wake-ups would be counted)
RUN = """import sys, rich.progress
_init = rich.progress.Progress.__init__
rich.progress.Progress.__init__ = lambda self, *a, **k: _init(self, *a, **{**k, "auto_refresh": False})
sys.argv = ["bullet", "simulate", "--json", *sys.argv[1:]]
from bullet.cli import main  # (the console script's entry: it builds the one command and freezes the heap)
try:
    main()
except SystemExit:
    pass
"""


def instructions(args: list[str]) -> int:
    """Instructions callgrind counts for ``bullet simulate ARGS`` in-process."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
        subprocess.run(["setarch", "-R", "valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                        sys.executable, "-c", RUN, *args], cwd=ROOT, env=env, check=True, capture_output=True)
        for line in out.read_text().splitlines():
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
    raise RuntimeError("callgrind wrote no totals")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", nargs="+", default=["chunked", "prefill-first", "static-split", "naive-concurrent",
                                                    "bullet"])
    ap.add_argument("--num-requests", type=int, default=3000)
    ap.add_argument("--trace", default=str(TRACE))
    args = ap.parse_args()
    print("| policy | instructions, N requests | setup (1 request) | simulation |")
    print("|---|---:|---:|---:|")
    for policy in args.policy:
        base = ["--trace", args.trace, "--policy", policy, "--num-requests"]
        total, setup = instructions([*base, str(args.num_requests)]), instructions([*base, "1"])
        print(f"| {policy} | {total / 1e6:,.1f}M | {setup / 1e6:,.1f}M | {(total - setup) / 1e6:,.1f}M |", flush=True)


if __name__ == "__main__":
    main()
