"""Identity hash of `bullet simulate`'s outputs: a speed change must leave every simulated number as it was.

    python bench/sim_ident.py [--latency auto roofline] [--policy ...] [--trace ...]

Runs the whole command (``python -m bullet.cli simulate ... --out DIR``) for every policy on the default
bundled trace and on the first 3,000 requests of the Azure 2023 conversation trace, and hashes what it
writes: requests.csv and timeline.csv byte for byte, summary.json without its wall time and with the trace
file's path made ``<trace>`` (the only entries that differ between identical runs, or between worktrees: a
worktree outside /work reads the shared traces through another path). Prints one hash per run
and one per latency model (over its runs, in order); equal hashes before and after a change: same launches,
same metrics.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AZURE = ROOT.parent / "shared/traces/raw/AzureLLMInferenceTrace_conv.csv"
POLICIES = ("chunked", "prefill-first", "static-split", "naive-concurrent", "bullet")
TRACES = (("default", ()), ("azure-conv-3000", ("--trace", str(AZURE), "--num-requests", "3000")))


def run_hash(policy: str, latency: str, trace_args: tuple[str, ...]) -> str:
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, "-m", "bullet.cli", "simulate", *trace_args, "--policy", policy,
                        "--latency", latency, "--out", out], cwd=ROOT, check=True, capture_output=True)
        h = hashlib.sha256()
        for name in ("requests.csv", "timeline.csv"):
            h.update((Path(out) / name).read_bytes())
        summary = json.loads((Path(out) / "summary.json").read_text())
        del summary["sim_wall_s"]
        del summary["settings"]["trace_file"]  # (absolute: the worktree's bundled trace too)
        text = json.dumps(summary, sort_keys=True)
        if trace_args:  # the trace's path, in several entries (trace, settings, the command): one worktree's
            text = text.replace(json.dumps(trace_args[1])[1:-1], "<trace>")
        h.update(text.encode())
        return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--latency", nargs="+", default=["auto", "roofline"])
    ap.add_argument("--policy", nargs="+", default=list(POLICIES))
    ap.add_argument("--trace", nargs="+", default=[name for name, _ in TRACES])
    args = ap.parse_args()
    for latency in args.latency:
        total = hashlib.sha256()
        for name, trace_args in TRACES:
            if name not in args.trace:
                continue
            for policy in args.policy:
                digest = run_hash(policy, latency, trace_args)
                total.update(digest.encode())
                print(f"{latency} {name} {policy} {digest[:16]}", flush=True)
        print(f"{latency} all {total.hexdigest()}", flush=True)


if __name__ == "__main__":
    main()
