"""Skinny matrix products for decode batches: ``y = x @ W.T`` with few rows in ``x`` (M = 2..256).

A decode step's products read every weight once for a handful of rows, so they are bound by the weight
stream (below about 180 rows on the H200: 791 TFLOP/s over 4.3 TB/s). cuBLAS read the weights of a
128-row decode step at 3.12-3.3 TB/s where the one-row GEMV reads them at 4.2 (bench/RESULTS.md, issue 12).
This kernel streams ``W`` in ``[block_n, block_k]`` tiles and multiplies each by the whole of ``x`` (the
tensor cores see ``W``'s rows as the long side: ``acc[block_n, M] += W_tile @ x_tile.T``, "swap AB"), so
every weight byte is read once from memory and ``x`` (at most 256 x K) is re-read from L2 by each
program. Where ``N / block_n`` programs would not fill the GPU, K is split across programs (``splits``):
each writes fp32 partial sums and a second launch adds them in a fixed order (deterministic) and applies
the epilogue.

Epilogues, as the unfused path computes them (fp32 accumulation, rounded where it rounds):

- ``residual``: ``residual += x @ W.T`` in place, rounded once (as ``addmm_``);
- ``swiglu``: ``W`` is ``[gate; up]`` (``2I x K``); each program takes matching gate and up rows and writes
  ``silu(gate) * up`` (``I`` outputs), both products rounded to the model dtype first (as ``F.linear``
  followed by ``silu_mul``).

Measured on the H200 (``bench/skinny_gemm.py``, bench/RESULTS.md, eighteenth session): on the whole GPU it ties
cuBLAS (the gate/up product and the LM head 3-10 % faster, the three smaller products slower: their K split
costs a second pass); on a 40-SM decode partition, where cuBLAS picks tiles for all 132 SMs, the products of a
16-64-row step take 8-12 % less time. Both are bound by L2 at 128 rows (Nsight Compute).

Which kernel wins depends on the partition and the batch, so ``Model`` takes a **table** (``load_table``):
for each (SMs, rows) the products where a measured skinny config beat cuBLAS, with that config; every other
product, and every row count not in it, stays on cuBLAS. ``bench/skinny_gemm.py --table`` measures it on a GPU
(decode partitions x graph batch buckets) and the executor loads the one shipped next to the fitted profile
(``profiles/<gpu>/<model>/skinny.json``), so decode graphs, which always run a bucket's row count on one
partition, take the faster kernel product by product.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ...config import ConfigError, ModelSpec
from . import HAVE_TRITON, next_pow2, pdl_launch, use_triton

MAX_ROWS = 256  # rows of x the kernel takes (its tile holds them all)
SMEM_BYTES = 200 * 1024  # shared memory a launch's pipeline may take (Hopper has 228 KB per SM)


class SkinnyConfig(NamedTuple):
    block_n: int = 64
    block_k: int = 128
    splits: int = 1
    num_warps: int = 4
    num_stages: int = 4

    def fitted(self, rows: int, swiglu: bool) -> SkinnyConfig:
        """This config with fewer pipeline stages (at least 2), then narrower K tiles, until a launch's
        tiles (W's, twice with ``swiglu``, and x's ``rows`` padded to a power of two) fit SMEM_BYTES."""
        bm, c = max(16, next_pow2(rows)), self

        def need(c: SkinnyConfig) -> int:
            return (c.block_n * (2 if swiglu else 1) + bm) * c.block_k * 2 * c.num_stages

        while need(c) > SMEM_BYTES and c.num_stages > 2:
            c = c._replace(num_stages=c.num_stages - 1)
        while need(c) > SMEM_BYTES and c.block_k > 32:
            c = c._replace(block_k=c.block_k // 2)
        return c


if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _swiglu(gate, up, DTYPE: tl.constexpr):
        """silu(gate) * up of the fp32 sums, each rounded to the model dtype first (as the unfused path)."""
        g = gate.to(DTYPE).to(tl.float32)
        u = up.to(DTYPE).to(tl.float32)
        return g / (1.0 + tl.exp(-g)) * u

    @triton.jit
    def _skinny_kernel(X, W, Y, R, P, M, N, K, k_per, stride_xm, stride_wn, stride_ym, stride_rm, stride_pk,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SWIGLU: tl.constexpr,
                       RESIDUAL: tl.constexpr, PARTIAL: tl.constexpr, EVEN: tl.constexpr, PRECISION: tl.constexpr,
                       PDL: tl.constexpr):
        pid_n = tl.program_id(0)
        sk = tl.program_id(1)
        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_m = tl.arange(0, BM)
        offs_k = tl.arange(0, BK)
        nmask = offs_n < N
        mmask = offs_m < M
        k_lo = sk * k_per
        wp = W + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
        xp = X + offs_m[:, None] * stride_xm + offs_k[None, :]
        acc = tl.zeros([BN, BM], tl.float32)
        acc_up = tl.zeros([BN, BM], tl.float32)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        for i in range(k_per // BK):  # (the last slice may pass K: masked)
            k = k_lo + i * BK
            if EVEN:  # N a multiple of BN, K of the slice (a multiple of BK): no masks in the loop
                w = tl.load(wp + k, eviction_policy="evict_first")
                x = tl.load(xp + k, mask=mmask[:, None], other=0.0)
            else:
                kmask = (k + offs_k) < K
                w = tl.load(wp + k, mask=nmask[:, None] & kmask[None, :], other=0.0, eviction_policy="evict_first")
                x = tl.load(xp + k, mask=mmask[:, None] & kmask[None, :], other=0.0)
            xt = tl.trans(x)
            acc = tl.dot(w, xt, acc, input_precision=PRECISION)
            if SWIGLU:
                if EVEN:
                    wu = tl.load(wp + N * stride_wn + k, eviction_policy="evict_first")
                else:
                    wu = tl.load(wp + N * stride_wn + k, mask=nmask[:, None] & kmask[None, :], other=0.0,
                                 eviction_policy="evict_first")
                acc_up = tl.dot(wu, xt, acc_up, input_precision=PRECISION)
        omask = nmask[:, None] & mmask[None, :]
        if PARTIAL:  # fp32 partial sums of this K slice: [splits, M, N] (SWIGLU: [splits, M, 2N], gate then up)
            pp = P + sk * stride_pk + offs_m[None, :] * (2 * N if SWIGLU else N) + offs_n[:, None]
            tl.store(pp, acc, mask=omask)
            if SWIGLU:
                tl.store(pp + N, acc_up, mask=omask)
        else:
            y = acc
            if SWIGLU:
                y = _swiglu(acc, acc_up, Y.dtype.element_ty)
            if RESIDUAL:
                y += tl.load(R + offs_m[None, :] * stride_rm + offs_n[:, None], mask=omask, other=0.0).to(tl.float32)
            tl.store(Y + offs_m[None, :] * stride_ym + offs_n[:, None], y.to(Y.dtype.element_ty), mask=omask)

    @triton.jit
    def _skinny_reduce_kernel(P, Y, R, N, splits, stride_pk, stride_ym, stride_rm, SWIGLU: tl.constexpr,
                              RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        m = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        row = P + m * (2 * N if SWIGLU else N) + offs
        acc = tl.zeros([BLOCK], tl.float32)
        acc_up = tl.zeros([BLOCK], tl.float32)
        for s in range(splits):  # in split order: the same sum whatever order the programs ran in
            acc += tl.load(row + s * stride_pk, mask=mask, other=0.0)
            if SWIGLU:
                acc_up += tl.load(row + s * stride_pk + N, mask=mask, other=0.0)
        y = acc
        if SWIGLU:
            y = _swiglu(acc, acc_up, Y.dtype.element_ty)
        if RESIDUAL:
            y += tl.load(R + m * stride_rm + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + m * stride_ym + offs, y.to(Y.dtype.element_ty), mask=mask)


def skinny_linear(x: torch.Tensor, w: torch.Tensor, *, residual: torch.Tensor | None = None, swiglu: bool = False,
                  config: SkinnyConfig | None = None, pdl: bool = False) -> torch.Tensor:
    """``x``: ``[M, K]`` (unit last stride, M <= MAX_ROWS); ``w``: ``[N, K]`` (unit last stride).

    Returns ``[M, N]`` (``[M, N / 2]`` with ``swiglu``); with ``residual`` (``[M, N]``, unit last stride) the
    sum is written into ``residual`` and that is returned. ``config``: tile sizes and the K split (default
    ``SkinnyConfig()``; fewer stages or narrower K tiles where it would not fit in shared memory); ``pdl``: programmatic dependent launches (see ``kernels.gemv``)."""
    M, K = x.shape
    N = w.shape[0]
    if swiglu:
        assert N % 2 == 0 and residual is None, "skinny_linear: swiglu takes [gate; up] weights, no residual"
        N //= 2
    if not use_triton(x):
        return _skinny_torch(x, w, residual, swiglu)
    assert M <= MAX_ROWS and x.stride(1) == 1 and w.stride(1) == 1 and w.shape[1] == K
    out = residual if residual is not None else torch.empty((M, N), device=x.device, dtype=x.dtype)
    assert out.shape == (M, N) and out.stride(1) == 1
    if M == 0:
        return out
    c = (config or SkinnyConfig()).fitted(M, swiglu)
    splits = max(1, min(c.splits, K // c.block_k))
    k_per = triton.cdiv(triton.cdiv(K, splits), c.block_k) * c.block_k
    splits = triton.cdiv(K, k_per)
    pdl = pdl and x.is_cuda
    even = N % c.block_n == 0 and K % k_per == 0
    part = None
    if splits > 1:
        part = torch.empty((splits, M, 2 * N if swiglu else N), device=x.device, dtype=torch.float32)
    _skinny_kernel[(triton.cdiv(N, c.block_n), splits)](
        x, w, out, out, part if part is not None else out, M, N, K, k_per, x.stride(0), w.stride(0), out.stride(0),
        out.stride(0), part.stride(0) if part is not None else 0,
        BM=max(16, next_pow2(M)), BN=c.block_n, BK=c.block_k, SWIGLU=swiglu, RESIDUAL=residual is not None,
        PARTIAL=part is not None, EVEN=even,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", PDL=pdl, num_warps=c.num_warps, num_stages=c.num_stages,
        **pdl_launch(pdl))
    if part is not None:
        block = 1024
        _skinny_reduce_kernel[(M, triton.cdiv(N, block))](
            part, out, out, N, splits, part.stride(0), out.stride(0), out.stride(0), SWIGLU=swiglu,
            RESIDUAL=residual is not None, BLOCK=block, PDL=pdl, num_warps=4, **pdl_launch(pdl))
    return out


def _skinny_torch(x, w, residual, swiglu) -> torch.Tensor:
    """The same semantics from torch ops (the CPU path)."""
    if swiglu:
        g, u = F.linear(x, w).chunk(2, dim=-1)
        return (F.silu(g.float()) * u.float()).to(x.dtype)
    if residual is not None:
        return residual.addmm_(x, w.t())
    return F.linear(x, w)


# --- the per-(partition, batch) choice ---------------------------------------------------------------------

PRODUCTS = ("qkv", "o", "gate_up", "down", "lm_head")
TABLE_VERSION = 1
Table = dict[tuple[int, int], dict[str, SkinnyConfig]]  # (SMs, rows) -> product -> config (absent: cuBLAS)


def decode_products(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """(N, K) of each product of a decode step on one GPU: ``y[M, N] = x[M, K] @ W.T``."""
    H, KVH, D, h = spec.heads_per_gpu, spec.kv_heads_per_gpu, spec.head_dim, spec.hidden_size
    return {"qkv": ((H + 2 * KVH) * D, h), "o": (h, H * D), "gate_up": (2 * spec.ffn_per_gpu, h),
            "down": (h, spec.ffn_per_gpu), "lm_head": (spec.vocab_size, h)}


def load_table(path: str | Path, spec: ModelSpec, gpu_name: str) -> Table:
    """The choices of a table written by ``bench/skinny_gemm.py --table``, checked against the model's product
    shapes and the GPU (ConfigError naming the file and the field, or both models / GPUs)."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot read the skinny GEMM table: {e}") from None

    def field(obj, key, kind, where):
        if not isinstance(obj, dict) or key not in obj or not isinstance(obj[key], kind) \
                or (kind is int and isinstance(obj[key], bool)):
            raise ConfigError(f"{path}: {where}{key} is missing or not {kind.__name__}")
        return obj[key]

    if field(doc, "version", int, "") != TABLE_VERSION:
        raise ConfigError(f"{path}: version {doc['version']}, this bullet reads version {TABLE_VERSION}")
    if field(doc, "gpu", str, "") != gpu_name:
        raise ConfigError(f"{path}: measured on {doc['gpu']}, this GPU is {gpu_name}")
    want = {k: list(v) for k, v in decode_products(spec).items()}
    if field(doc, "products", dict, "") != want:
        raise ConfigError(f"{path}: products {doc['products']} are not {spec.name}'s {want}")
    table: Table = {}
    for i, c in enumerate(field(doc, "choices", list, "")):
        where = f"choices[{i}]."
        sms, rows = field(c, "sms", int, where), field(c, "rows", int, where)
        name = field(c, "product", str, where)
        if name not in PRODUCTS:
            raise ConfigError(f"{path}: {where}product {name!r} is not one of {', '.join(PRODUCTS)}")
        if not 1 <= rows <= MAX_ROWS or sms < 1:
            raise ConfigError(f"{path}: {where}rows must be 1..{MAX_ROWS} and sms positive")
        cfg = field(c, "config", dict, where)
        try:
            conf = SkinnyConfig(**cfg)
        except TypeError:
            raise ConfigError(f"{path}: {where}config {cfg} has fields other than {SkinnyConfig._fields}") from None
        if not all(isinstance(v, int) and v > 0 for v in conf):
            raise ConfigError(f"{path}: {where}config {cfg} must hold positive integers")
        table.setdefault((sms, rows), {})[name] = conf
    return table
