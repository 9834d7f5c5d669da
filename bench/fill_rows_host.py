"""Host microseconds of ``fill_rows`` (the attention metadata of a prefill graph's or an eager launch's rows) for a
mixed launch: ``--rows`` decode rows at ``--context`` tokens plus one fresh prompt, block size 16. Block ids as the
block manager's lists (``table=None``), through the executor's per-request int32 copies when they hit (the same
requests' lists launch after launch, as in serving), and when they miss (new lists every launch, as in
``bench/host_overhead.py``, whose launches are all fresh requests). CPU only; no GPU needed.

    python3 bench/fill_rows_host.py [--rows 48] [--context 2048] [--reps 300]
    git show 5036a56:bullet/gpu/attention.py > bullet/gpu/attention.py && python3 bench/fill_rows_host.py; \
        git checkout bullet/gpu/attention.py   # the same launch before the change (its lists row only)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bullet.batch import Chunk
from bullet.config import MODELS
from bullet.gpu.attention import fill_rows
from bullet.gpu.executor import GpuExecutor

B = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--reps", type=int, default=300)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    lists = [[int(x) for x in rng.integers(0, 40000, args.context // B + 1)] for _ in range(args.rows)]
    prompt_blocks = list(range(-(-args.prompt // B)))

    def chunks(fresh: bool) -> list[Chunk]:
        return [Chunk(i, args.context, 1, list(ids) if fresh else ids, True) for i, ids in enumerate(lists)] + \
            [Chunk(args.rows, 0, args.prompt, list(prompt_blocks) if fresh else prompt_blocks, True)]

    T, n = args.rows + args.prompt, args.rows + 1
    W = -(-(args.context // B + 1) // 16) * 16
    out = (np.zeros(T, np.int32), np.zeros(T, np.int32), np.zeros(n + 1, np.int32), np.zeros(n, np.int32),
           np.zeros(n, np.int32), np.zeros((n, W), np.int32))
    ex = GpuExecutor(MODELS["tiny-llama"], "dummy", "cpu", block_size=B, num_blocks=64)
    same = chunks(False)
    cases = {"block ids as lists (table=None)": (False, None),
             "int32 copies, hits (GpuExecutor._block_table)": (False, ex._block_table),
             "int32 copies, misses (new lists each launch)": (True, ex._block_table)}
    print(f"fill_rows: {args.rows} decode rows at {args.context} tokens + a {args.prompt}-token prompt "
          f"(median of {args.reps})")
    print("| block ids | host us |")
    print("|---|---:|")
    for name, (fresh, table) in cases.items():
        ts = []
        for _ in range(args.reps):
            cs = chunks(True) if fresh else same
            t = time.perf_counter()
            try:
                fill_rows(cs, B, *out) if table is None else fill_rows(cs, B, *out, table=table)
            except TypeError:  # an older tree's fill_rows (before 6daa15d: no table argument)
                break
            ts.append(time.perf_counter() - t)
        print(f"| {name} | {statistics.median(ts) * 1e6:.0f} |" if ts else f"| {name} | (no table argument) |")


if __name__ == "__main__":
    main()
