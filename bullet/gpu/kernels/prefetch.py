"""Pull bytes into L2 ahead of the kernel that reads them (Hopper's bulk prefetch, a hint: nothing is written and
nothing waits for it).

At batch 1 the HBM idles while a layer's attention runs (a few MiB of KV against tens of MiB of weights per
product): the kernels of that phase pull the next product's weights into L2, so the product reads L2 instead."""

from __future__ import annotations

import torch

from . import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def l2_prefetch(PF, nbytes, p, P, T: tl.constexpr):
        """Program ``p`` of ``P`` issues its share of the ``nbytes`` (a multiple of 16) at byte pointer ``PF``:
        ``T`` bulk prefetches of 16-byte multiples, one per lane."""
        per = tl.cdiv(tl.cdiv(nbytes, P), 16 * T) * (16 * T)
        chunk = per // T
        offs = p.to(tl.int64) * per + tl.arange(0, T).to(tl.int64) * chunk
        size = tl.minimum(tl.maximum(nbytes - offs, 0), chunk).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred q; setp.gt.s32 q, $2, 0; @q cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [PF + offs, size], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_args(t: torch.Tensor | None) -> tuple[torch.Tensor | None, int]:
    """``(byte view, bytes)`` of the contiguous tensor ``t`` to prefetch, rounded down to 16 bytes; ``(None, 0)``
    for None or a CPU tensor (the interpreter has no inline assembly)."""
    if t is None or not t.is_cuda:
        return None, 0
    assert t.is_contiguous() and t.data_ptr() % 16 == 0, "l2 prefetch: a contiguous, 16-byte aligned tensor"
    return t.view(-1).view(torch.uint8), (t.numel() * t.element_size()) // 16 * 16


if HAVE_TRITON:

    @triton.jit
    def _prefetch_kernel(PF, nbytes, T: tl.constexpr):
        l2_prefetch(PF, nbytes, tl.program_id(0), tl.num_programs(0), T)


def prefetch_l2(t: torch.Tensor, programs: int = 32) -> None:
    """Pull the contiguous CUDA tensor ``t`` into L2 with one launch of ``programs`` programs (a hint)."""
    pf, nbytes = prefetch_args(t)
    if nbytes:
        _prefetch_kernel[(programs,)](pf, nbytes, T=128, num_warps=4)
