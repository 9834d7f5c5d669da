"""Does pulling weights into L2 ahead of a batch-1 GEMV pay, and how long is the attention phase it would hide
behind? Llama-3.1-8B o-projection shapes (4096 x 4096 bf16, 32 MiB per layer, 32 layers), one H200.

1. One o-projection GEMV with a cold L2 (a 512 MiB memset in between), after a bulk L2 prefetch of its
   weights (``kernels.prefetch``), after a per-line ``prefetch.global.L2`` of them, and after reading them
   (the upper bound of what L2 can give).
2. CUDA graphs over the 32 layers, PDL launches as in the one-token path: attention alone (split + merge),
   attention + o GEMV with and without the prefetch from the merge launch, and the o GEMVs alone.

    python bench/l2_prefetch.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton
import triton.language as tl

from bullet.gpu.kernels.decode_attention import paged_decode_attention
from bullet.gpu.kernels.gemv import GEMV_DEFAULT, gemv
from bullet.gpu.kernels.prefetch import prefetch_args, prefetch_l2


@triton.jit
def _lines_kernel(PF, nbytes, T: tl.constexpr):
    """Per-line prefetch: program p walks its share of 128-byte lines, T lines per step."""
    p = tl.program_id(0)
    per = tl.cdiv(tl.cdiv(nbytes, 128), tl.num_programs(0))
    for i in range(p * per, tl.minimum(p * per + per, tl.cdiv(nbytes, 128)), T):
        line = i + tl.arange(0, T)
        addr = PF + tl.minimum(line, tl.cdiv(nbytes, 128) - 1).to(tl.int64) * 128
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [addr],
                                  dtype=tl.int32, is_pure=False, pack=1)


def events_time(fn, reps: int = 20, before=None) -> float:
    """Median ms of ``fn`` between CUDA events, ``before()`` (untimed) ahead of each rep."""
    times = []
    for _ in range(reps + 3):
        if before:
            before()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times = sorted(times[3:])
    return times[len(times) // 2]


def graph_time(fn, reps: int = 20) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        fn()
    return events_time(g.replay, reps)


def main() -> None:
    torch.manual_seed(0)
    dev = "cuda"
    L, hid, H, KVH, D, page, ctx = 32, 4096, 32, 8, 128, 16, 1024
    W = [torch.randn(hid, hid, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(L)]
    x = torch.randn(1, hid, device=dev, dtype=torch.bfloat16)
    h = torch.randn(1, hid, device=dev, dtype=torch.bfloat16)
    flush = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
    cfg = dict(GEMV_DEFAULT)
    mb = W[0].numel() * 2 / 2**20
    rows = []

    def cold():
        flush.zero_()

    def after(pf):
        def run():
            flush.zero_()
            pf()
            torch.cuda.synchronize()
        return run

    pf, nbytes = prefetch_args(W[0])
    ways = {"cold L2": cold, "bulk prefetch (32 programs)": after(lambda: prefetch_l2(W[0], 32)),
            "bulk prefetch (132 programs)": after(lambda: prefetch_l2(W[0], 132)),
            "line prefetch (132 programs)": after(lambda: _lines_kernel[(132,)](pf, nbytes, T=128, num_warps=4)),
            "read first (W.sum())": after(lambda: W[0].sum())}
    for name, before in ways.items():
        t = events_time(lambda: gemv(x, W[0], **cfg), 30, before)
        rows.append((f"o GEMV, {name}", t, f"{mb * 2**20 / t / 1e9:.2f} TB/s"))

    # attention of one token over 1024 context, per layer pools
    blocks = ctx // page
    kc = torch.randn(L, blocks, KVH, page, D, device=dev, dtype=torch.bfloat16).transpose(2, 3)
    vc = torch.randn(L, blocks, KVH, page, D, device=dev, dtype=torch.bfloat16).transpose(2, 3)
    bt = torch.arange(blocks, dtype=torch.int32, device=dev)[None]
    cl = torch.tensor([ctx], dtype=torch.int32, device=dev)
    q = torch.randn(1, H, D, device=dev, dtype=torch.bfloat16)
    out = torch.empty(1, H, D, device=dev, dtype=torch.bfloat16)

    def attn(i, prefetch=None):
        return paged_decode_attention(q, kc[i], vc[i], bt, cl, D ** -0.5, ctx, out=out, pdl=True, prefetch=prefetch)

    chains = {
        "32 x attention (split + merge)": lambda: [attn(i) for i in range(L)],
        "32 x o GEMV": lambda: [gemv(x, W[i], residual=h, **cfg) for i in range(L)],
        "32 x (attention + o GEMV)": lambda: [gemv(attn(i).view(1, -1), W[i], residual=h, **cfg) for i in range(L)],
        "32 x (attention + o GEMV), o prefetched by the merge":
            lambda: [gemv(attn(i, W[i]).view(1, -1), W[i], residual=h, **cfg) for i in range(L)],
    }
    for name, fn in chains.items():
        t = graph_time(fn)
        rows.append((f"graph: {name}", t, f"{t / L * 1e3:.1f} us per layer"))

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    w = max(len(r[0]) for r in rows)
    for name, t, note in rows:
        print(f"{name:<{w}}  {t:8.4f} ms  {note}")


if __name__ == "__main__":
    main()
