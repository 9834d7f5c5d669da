"""Triton kernels with torch fallbacks of the same semantics (used on the CPU, or where Triton is missing).

Triton is imported under a guard: the CPU path needs neither Triton nor CUDA. ``TRITON_INTERPRET=1`` runs the
Triton kernels on CPU tensors through Triton's interpreter (slow; for checking kernels without a GPU).
"""

from __future__ import annotations

import os

import torch

try:  # guarded: CI machines have no Triton
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the machine
    HAVE_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """Run the Triton kernel for tensor ``t``: on CUDA, or on the CPU under Triton's interpreter."""
    return HAVE_TRITON and (t.is_cuda or INTERPRET)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def pdl_launch(pdl: bool) -> dict:
    """Launch options of a programmatic dependent launch (Hopper and newer, CUDA only): the kernel may start
    while the previous one finishes, and must ``gdc_wait`` before it reads that kernel's outputs."""
    return {"launch_pdl": True} if pdl else {}
