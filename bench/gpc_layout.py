"""Does it matter which GPCs a split's two lanes share? The driver's group order against a GPC-aligned one (issue 9).

On a GPU: ``python3 bench/gpc_layout.py [--pairs 36 44 68 92] [--seconds 0.4]``.

The nested menu's 8-SM groups are half-GPCs, and the driver's order takes the first halves of the GPCs before any
second half (bench/sm_topology.py), so a split such as 44 / 88 leaves four GPCs half prefill, half decode. Any
order of the groups keeps every legal pair disjoint (prefill takes them from one end, decode from the other), so a
GPC-aligned order -- both halves of a GPC next to each other -- shares at most one GPC. This script makes the menu
both ways (``PartitionMenu.create(order=...)``) and, on each split p / (132 - p), times a prefill-like GEMM
(4096 x 4096 x 14336 bf16) on the prefill side and a decode-like one (64 x 4096 x 57344, memory-bound) on the decode
side: each alone, then both at once (the middle half of each loop, timed with CUDA events). Prints each side's time
alone and its slowdown beside the other, per order. Results are checked against a float32 reference first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sm_topology import gpc_map, smids


def group_sets(menu) -> list[set[int]]:
    """The SMs of each group of ``menu``'s split, in the order prefill takes them (the remainder is in the first)."""
    sizes = sorted(n for n in menu.prefill if n < menu.num_sms)
    sets, prev = [], set()
    for n in sizes:
        s = smids(menu.prefill[n].stream)
        sets.append(s - prev)
        prev = s
    last = smids(menu.decode[min(menu.decode)].stream)
    sets.append(last)
    return sets


def gpc_order(sets: list[set[int]], gpc_of: dict[int, int]) -> tuple[int, ...]:
    """Groups sorted by GPC (GPCs in order of first appearance), the driver's order within one."""
    first: dict[int, int] = {}
    key = []
    for i, s in enumerate(sets):
        g = max({gpc_of.get(sm, -1) for sm in s} - {-1}, default=-1) if i == 0 else gpc_of.get(min(s), -1)
        first.setdefault(g, len(first))
        key.append((first[g], i))
    return tuple(i for _, i in sorted(key))


def timed(torch, stream, fn, iters: int) -> float:
    """Seconds an iteration of ``fn`` takes on ``stream`` (one warm-up call, then ``iters``)."""
    with torch.cuda.stream(stream):
        fn()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3 / iters


def together(torch, sp, fp, np_, sd, fd, nd) -> tuple[float, float]:
    """Both loops at once, enqueued in turn; each side's seconds an iteration over the middle half of its loop."""
    ev = {k: torch.cuda.Event(enable_timing=True) for k in ("p0", "p1", "d0", "d1")}
    for i in range(max(np_, nd)):
        for lane, stream, fn, n in (("p", sp, fp, np_), ("d", sd, fd, nd)):
            if i < n:
                with torch.cuda.stream(stream):
                    if i == n // 4:
                        ev[lane + "0"].record()
                    fn()
                    if i == 3 * n // 4 - 1:
                        ev[lane + "1"].record()
    torch.cuda.synchronize()
    return (ev["p0"].elapsed_time(ev["p1"]) / 1e3 / (3 * np_ // 4 - np_ // 4),
            ev["d0"].elapsed_time(ev["d1"]) / 1e3 / (3 * nd // 4 - nd // 4))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, nargs="+", default=[28, 36, 44, 52, 60, 68, 76, 84, 92, 100],
                    help="prefill sizes (decode has the rest)")
    ap.add_argument("--seconds", type=float, default=0.4, help="length of each co-run loop")
    ap.add_argument("--repeats", type=int, default=3, help="passes over both orders (alternating); medians printed")
    args = ap.parse_args()
    import torch

    from bullet.gpu.partitions import PartitionMenu

    gpcs = gpc_map(120, 8 * 16)
    gpc_of = {sm: i for i, g in enumerate(gpcs) for sm in g}
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 57344, device="cuda", dtype=torch.bfloat16)
    op, od = torch.empty(4096, 14336, device="cuda", dtype=torch.bfloat16), torch.empty(64, 57344, device="cuda",
                                                                                          dtype=torch.bfloat16)

    def fp():
        torch.matmul(a, b, out=op)

    def fd():
        torch.matmul(x, w, out=od)

    ref_p = (a[:256].float() @ b.float())
    ref_d = x.float() @ w.float()
    menu = PartitionMenu.create()
    sets = group_sets(menu)
    menu.close()
    orders = {"driver": None, "gpc-aligned": gpc_order(sets, gpc_of)}
    print("groups by GPC (driver's order):", [sorted({gpc_of.get(sm, -1) for sm in s}) for s in sets])
    print("gpc-aligned order:", orders["gpc-aligned"])
    rows = defaultdict(lambda: defaultdict(list))
    for _ in range(args.repeats):
        for name, order in orders.items():
            menu = PartitionMenu.create(order=order)
            try:
                for p in args.pairs:
                    d = menu.num_sms - p
                    sp, sd = menu.prefill[p].stream, menu.decode[d].stream
                    with torch.cuda.stream(sp):
                        fp()
                    with torch.cuda.stream(sd):
                        fd()
                    torch.cuda.synchronize()
                    ep = float((op[:256].float() - ref_p).abs().max() / ref_p.abs().max())
                    ed = float((od.float() - ref_d).abs().max() / ref_d.abs().max())
                    assert ep < 2e-2 and ed < 2e-2, (name, p, ep, ed)
                    tp, td = timed(torch, sp, fp, 20), timed(torch, sd, fd, 50)
                    cp, cd = together(torch, sp, fp, max(8, int(args.seconds / tp)), sd, fd,
                                      max(8, int(args.seconds / td)))
                    shared = len({gpc_of.get(s, -1) for s in smids(sp)} & {gpc_of.get(s, -1) for s in smids(sd)})
                    rows[p][name].append((tp, td, cp / tp, cd / td, shared))
            finally:
                menu.close()
    print(f"\n{args.repeats} passes: medians, slowdowns with their range over the passes")
    print("| split | order | GPCs shared | prefill GEMM alone ms | TFLOP/s | decode GEMM alone ms | TB/s | "
          "prefill slowed | decode slowed |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    flops, wbytes = 2 * 4096 * 4096 * 14336, 4096 * 57344 * 2
    for p in args.pairs:
        for name, runs in rows[p].items():
            tp, td, sp_, sd_ = (statistics.median(r[k] for r in runs) for k in range(4))
            rp, rd = [f"{100 * (min(r[k] for r in runs) - 1):+.1f}..{100 * (max(r[k] for r in runs) - 1):+.1f}"
                      for k in (2, 3)]
            print(f"| {p} / {132 - p} | {name} | {runs[0][4]} | {tp * 1e3:.3f} | {flops / tp / 1e12:.0f} | "
                  f"{td * 1e3:.3f} | {wbytes / td / 1e12:.2f} | {100 * (sp_ - 1):+.1f} % ({rp}) | "
                  f"{100 * (sd_ - 1):+.1f} % ({rd}) |")


if __name__ == "__main__":
    main()
