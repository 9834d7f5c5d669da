"""Which GPCs each nested partition's SMs sit on (issue 9: the co-run prefill slowdown zigzags with the split).

On a GPU: ``python3 bench/sm_topology.py [--out topology.json] [--launches 200]``.

1. The SM -> GPC map, from thread-block clusters: the CTAs of one cluster always run on one GPC (CUDA programming
   guide, "Thread Block Clusters"). A small CUDA program (compiled here with nvcc) launches clusters of 8 and then of 16 CTAs
   (16: a non-portable size), one CTA per SM (each asks for most of an SM's shared memory), 1 to 16 clusters a launch so that placements vary, and
   records each CTA's ``%smid`` with its cluster; SMs seen in one cluster are joined (union-find), so each component is (part of) one GPC.
2. Each partition's SMs: ``%smid`` read in a Triton kernel on every prefill and decode partition of the menu the
   executor uses (``bullet.gpu.partitions.PartitionMenu``), as tests/test_partitions.py does.
3. A table per prefill size p beside decode 132 - p: how many GPCs each side touches and how many GPCs the two share,
   and the SMs of each side per GPC.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CUDA = r"""
#include <cstdio>
#include <cuda_runtime.h>
template <int C> __global__ void __cluster_dims__(C, 1, 1) probe(int *out, long spin) {
    extern __shared__ char pad[];
    unsigned sm, cl;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(cl));
    long t0 = clock64();
    while (clock64() - t0 < spin) { pad[threadIdx.x] = 1; }
    if (threadIdx.x == 0) { out[2 * blockIdx.x] = (int)sm; out[2 * blockIdx.x + 1] = (int)cl; }
}
template <int C> int run(int launches, int blocks, int first) {
    size_t shmem = 200 * 1024;  // one CTA per SM
    cudaFuncSetAttribute(probe<C>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shmem);
    if (C > 8) cudaFuncSetAttribute(probe<C>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    int *d, *h = (int *)malloc(sizeof(int) * 2 * blocks);
    cudaMalloc(&d, sizeof(int) * 2 * blocks);
    for (int k = 0; k < launches; k++) {
        int n = C * (1 + k % (blocks / C));  // 1, 2, ... clusters: placements vary from launch to launch
        probe<C><<<n, 128, shmem>>>(d, 20000 + 997 * (k % 13));
        cudaError_t e = cudaDeviceSynchronize();
        if (e != cudaSuccess) { fprintf(stderr, "cluster %d launch %d: %s\n", C, k, cudaGetErrorString(e)); return 1; }
        cudaMemcpy(h, d, sizeof(int) * 2 * blocks, cudaMemcpyDeviceToHost);
        for (int b = 0; b < n; b++) printf("%d %d %d %d\n", C, first + k, h[2 * b + 1], h[2 * b]);
    }
    cudaFree(d);
    return 0;
}
int main(int argc, char **argv) {
    int launches = atoi(argv[1]), blocks = atoi(argv[2]);
    int rc = run<8>(launches, blocks, 0);
    if (run<16>(launches, blocks, launches)) fprintf(stderr, "clusters of 16 failed: GPCs from clusters of 8 only\n");
    return rc;
}
"""


def gpc_map(launches: int, blocks: int) -> list[list[int]]:
    """SM ids grouped by GPC (components of SMs seen in one cluster), largest first."""
    with tempfile.TemporaryDirectory() as d:
        src, exe = Path(d) / "probe.cu", Path(d) / "probe"
        src.write_text(CUDA)
        subprocess.run(["nvcc", "-O2", "-arch=sm_90", "-o", str(exe), str(src)], check=True)
        res = subprocess.run([str(exe), str(launches), str(blocks)], check=True, capture_output=True, text=True)
        out = res.stdout
        sys.stderr.write(res.stderr)
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    clusters: dict[tuple[int, int], list[int]] = defaultdict(list)
    sizes: dict[int, set[int]] = defaultdict(set)
    for line in out.split("\n"):
        if line:
            c, k, cl, sm = map(int, line.split())
            clusters[k, cl].append(sm)
            sizes[c].add(sm)
    print("SMs reached by clusters of " + ", ".join(f"{c}: {len(s)}" for c, s in sorted(sizes.items())))
    for sms in clusters.values():
        for sm in sms[1:]:
            parent[find(sm)] = find(sms[0])
    comps: dict[int, list[int]] = defaultdict(list)
    for sm in list(parent):
        comps[find(sm)].append(sm)
    return sorted((sorted(c) for c in comps.values()), key=lambda c: (-len(c), c[0]))


def smids(stream, blocks: int = 4096) -> set[int]:
    from bullet.gpu.partitions import sm_ids

    return sm_ids(stream, blocks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launches", type=int, default=200)
    ap.add_argument("--out", type=Path, default=None, help="write the map and the partitions' SMs as JSON")
    args = ap.parse_args()
    from bullet.gpu.partitions import PartitionMenu

    gpcs = gpc_map(args.launches, 8 * 16)  # up to 16 clusters of 8 (128 SMs)
    print(f"{len(gpcs)} SM groups (GPCs) from clusters of 8 and 16: sizes {[len(g) for g in gpcs]}")
    for i, g in enumerate(gpcs):
        print(f"  gpc {i}: {g}")
    gpc_of = {sm: i for i, g in enumerate(gpcs) for sm in g}
    menu = PartitionMenu.create()
    try:
        pre = {n: smids(s.stream) for n, s in menu.prefill.items() if n < menu.num_sms}
        dec = {n: smids(s.stream) for n, s in menu.decode.items() if n < menu.num_sms}
    finally:
        menu.close()
    head = "| prefill / decode | prefill GPCs | decode GPCs | shared GPCs | SMs per GPC, prefill:decode |"
    print("\n" + head + "\n|---|---:|---:|---:|---|")
    for p in sorted(pre):
        d = menu.num_sms - p
        if d not in dec:
            continue
        gp = defaultdict(int)
        gd = defaultdict(int)
        for sm in pre[p]:
            gp[gpc_of.get(sm, -1)] += 1
        for sm in dec[d]:
            gd[gpc_of.get(sm, -1)] += 1
        shared = sorted(set(gp) & set(gd))
        per = " ".join(f"{g}:{gp.get(g, 0)}:{gd.get(g, 0)}" for g in sorted(set(gp) | set(gd)))
        print(f"| {p} / {d} | {len(gp)} | {len(gd)} | {len(shared)} | {per} |")
    if args.out:
        args.out.write_text(json.dumps({"gpcs": gpcs, "prefill": {n: sorted(s) for n, s in pre.items()},
                                        "decode": {n: sorted(s) for n, s in dec.items()}}, indent=1))


if __name__ == "__main__":
    main()
