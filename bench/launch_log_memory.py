"""Memory that `bullet run --launch-log` keeps per launch: a simulation (300 sharegpt requests at 8 req/s, the
server's 10 ms window) keeping every launch as the server does (a :class:`bullet.validate.Launch` record) or
as the whole StepResult (its Batch, chunks and block ids), against keeping nothing; traced memory retained at
the end over the number of launches. Prints a table.

    python3 bench/launch_log_memory.py [--policies chunked static-split bullet]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import sys
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bullet import engine as E
from bullet.cli import app
from bullet.validate import launch_of

ARGS = ["--trace", "sharegpt", "--num-requests", "300", "--request-rate", "8", "--fuse-window-ms", "10", "--json"]


def retained(policy: str, keep) -> tuple[int, int]:
    """Traced bytes left after one simulation whose engines keep ``keep(result)`` of every launch (None:
    nothing), and how many launches."""
    kept: list = []
    orig = E.Engine.__init__

    def init(self, *a, **kw):
        orig(self, *a, **kw)
        if keep is not None:
            prev = self.on_step

            def on_step(res, prev=prev):
                kept.append(keep(res))
                if prev is not None:
                    prev(res)
            self.on_step = on_step

    E.Engine.__init__ = init
    gc.collect()
    tracemalloc.start()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            app(["simulate", "--policy", policy, *ARGS], standalone_mode=False)
        gc.collect()
        cur = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
        E.Engine.__init__ = orig
    return cur, len(kept)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", nargs="+", default=["chunked", "static-split", "bullet"])
    args = ap.parse_args()
    print("| policy | launches | Launch record, bytes each | whole StepResult, bytes each |")
    print("|---|---:|---:|---:|")
    for policy in args.policies:
        retained(policy, None)  # warm every cache the simulation fills once, so the runs below differ by `kept`
        base, _ = retained(policy, None)
        rec, n = retained(policy, lambda r: launch_of(r, 32))
        whole, _ = retained(policy, lambda r: r)
        print(f"| {policy} | {n} | {(rec - base) / n:.0f} | {(whole - base) / n:.0f} |", flush=True)


if __name__ == "__main__":
    main()
