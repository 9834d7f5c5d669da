"""Kernels against float64 references on fresh random data. On the CPU these check the torch fallbacks (or
the Triton kernels under ``TRITON_INTERPRET=1``); ``gpu`` tests check the Triton kernels on CUDA at real
shapes (decode attention: 1..256 ragged sequences, contexts up to 32k, 32q/8kv and 28q/4kv, head_dim 128)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from bullet.gpu.kernels.activation import silu_mul
from bullet.gpu.kernels.decode_attention import paged_decode_attention
from bullet.gpu.kernels.gemv import GEMV_DEFAULT, gemv
from bullet.gpu.kernels.norm import rms_norm
from bullet.gpu.kernels.prefill_attention import block_q, prefill_attention, tile_table
from bullet.gpu.kernels.rope import rope_and_store
from bullet.gpu.kernels.skinny import SkinnyConfig, skinny_linear


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert not torch.isnan(a).any()
    return float((a - b).norm() / b.norm())


def make_pool(ctx_lens: list[int], kvh: int, d: int, page: int, device, dtype, seed: int, layout: str = "nhd"):
    """A pool holding every sequence's context in scattered blocks; returns (k, v, block_tables). ``layout``
    "hnd": ``[blocks, page, kvh, d]`` views of ``[blocks, kvh, page, d]`` memory (PagedKvCache's default)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-c // page) for c in ctx_lens]
    total = sum(need) + 3
    perm = torch.randperm(total, generator=g)
    width = max(max(need), 1)
    bt = torch.zeros(len(ctx_lens), width, dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        bt[i, :n] = perm[at:at + n].to(torch.int32)
        at += n
    gd = torch.Generator(device=device).manual_seed(seed)
    k = torch.randn(total, page, kvh, d, generator=gd, device=device).to(dtype)
    v = torch.randn(total, page, kvh, d, generator=gd, device=device).to(dtype)
    if layout == "hnd":
        k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
    return k, v, bt.to(device)


def decode_reference(q, k, v, bt, ctx_lens, scale) -> torch.Tensor:
    """float64, one sequence at a time, gathering its tokens through its block table."""
    S, H, D = q.shape
    page, kvh = k.shape[1], k.shape[2]
    out = torch.zeros(S, H, D, dtype=torch.float64, device=q.device)
    for i, c in enumerate(ctx_lens):
        if c == 0:
            continue
        p = torch.arange(c, device=q.device)
        slots = bt[i].long()[p // page] * page + p % page
        ki = k.reshape(-1, kvh, D)[slots].double().repeat_interleave(H // kvh, dim=1)  # [c, H, D]
        vi = v.reshape(-1, kvh, D)[slots].double().repeat_interleave(H // kvh, dim=1)
        s = torch.einsum("hd,chd->hc", q[i].double(), ki) * scale
        out[i] = torch.einsum("hc,chd->hd", torch.softmax(s, dim=-1), vi)
    return out


def check_decode(ctx_lens, h, kvh, d, page, device, dtype, seed, tol, num_splits=None, layout="nhd", **options):
    k, v, bt = make_pool(ctx_lens, kvh, d, page, device, dtype, seed, layout)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(ctx_lens), h, d, generator=g).to(device=device, dtype=dtype)
    cl = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    scale = d ** -0.5
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    paged_decode_attention(q, k, v, bt, cl, scale, max(ctx_lens), num_splits=num_splits, out=out, **options)
    ref = decode_reference(q, k, v, bt, ctx_lens, scale)
    assert rel(out, ref) < tol, rel(out, ref)
    for i, c in enumerate(ctx_lens):
        if c == 0:
            assert torch.equal(out[i], torch.zeros_like(out[i]))
    return rel(out, ref)


@pytest.mark.parametrize("heads", [(4, 2), (8, 2), (7, 1)])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("layout", ["hnd", "nhd"])
def test_decode_attention_cpu_fp32(heads, num_splits, layout):
    ctx = [1, 5, 16, 17, 70, 0, 33]
    check_decode(ctx, heads[0], heads[1], 16, 4, "cpu", torch.float32, seed=sum(heads), tol=1e-5,
                 num_splits=num_splits, layout=layout)


def prefill_reference(q, k, v, bt, q_lens, ctx_lens, first, scale) -> torch.Tensor:
    """float64: sequence s's new tokens (rows in order) attend causally to its ctx_lens[s] pool tokens, the
    last q_lens[s] of which are the new ones; rows of sequences before ``first`` are zero."""
    T, H, D = q.shape
    page, kvh = k.shape[1], k.shape[2]
    out = torch.zeros(T, H, D, dtype=torch.float64, device=q.device)
    row = 0
    for s, (n, c) in enumerate(zip(q_lens, ctx_lens)):
        if s >= first:
            p = torch.arange(c, device=q.device)
            slots = bt[s].long()[p // page] * page + p % page
            ks = k.reshape(-1, kvh, D)[slots].double().repeat_interleave(H // kvh, dim=1)
            vs = v.reshape(-1, kvh, D)[slots].double().repeat_interleave(H // kvh, dim=1)
            sc = torch.einsum("nhd,khd->hnk", q[row:row + n].double(), ks) * scale
            qpos = torch.arange(c - n, c, device=q.device)
            sc = sc.masked_fill(p[None, None, :] > qpos[None, :, None], float("-inf"))
            out[row:row + n] = torch.einsum("hnk,khd->nhd", torch.softmax(sc, dim=-1), vs)
        row += n
    return out


def check_prefill(q_lens, prefix_lens, h, kvh, d, page, device, dtype, seed, tol, layout="hnd", first=0,
                  pad=0, **options):
    ctx_lens = [n + p for n, p in zip(q_lens, prefix_lens)]
    k, v, bt = make_pool(ctx_lens, kvh, d, page, device, dtype, seed, layout)
    g = torch.Generator().manual_seed(seed + 1)
    T = sum(q_lens)
    q = torch.randn(T, h, d, generator=g).to(device=device, dtype=dtype)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cl = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    table = tile_table(q_lens, ctx_lens, first, block_q(h // kvh))
    tiles = torch.from_numpy(tile_table(q_lens, ctx_lens, first, block_q(h // kvh), len(table) + pad)).to(device)
    out = torch.full_like(q, float("nan"))  # poisoned: rows of the tiles must be written, others not
    prefill_attention(q, k, v, bt, starts, cl, tiles, d ** -0.5, out, **options)
    ref = prefill_reference(q, k, v, bt, q_lens, ctx_lens, first, d ** -0.5)
    skip = int(starts[first])
    assert torch.isnan(out[:skip]).all()  # rows of the sequences before ``first`` untouched
    err = rel(out[skip:], ref[skip:])
    assert err < tol, err
    return err


def test_tile_table_by_hand():
    # seq 0: 1 token (decode, before first=1); seq 1: 5 new over a prefix of 3; seq 2: 2 new, no prefix; bq 2
    t = tile_table([1, 5, 2], [10, 8, 2], first=1, bq=2, pad_to=6)
    # tiles (seq, m0) with work prefix + min(m0 + 2, n): (1,0) 5, (1,2) 7, (1,4) 8, (2,0) 2; most first
    assert t.tolist() == [[1, 4], [1, 2], [1, 0], [2, 0], [-1, 0], [-1, 0]]
    with pytest.raises(ValueError, match="room for 3"):
        tile_table([1, 5, 2], [10, 8, 2], first=1, bq=2, pad_to=3)
    assert block_q(4) == 32 and block_q(7) == 16 and block_q(1) == 128


@pytest.mark.parametrize("heads", [(4, 2), (8, 2), (7, 1)])
@pytest.mark.parametrize("layout", ["hnd", "nhd"])
def test_prefill_attention_cpu_fp32(heads, layout):
    """Fresh prompts, chunks over a cached prefix (one crossing block boundaries), decode rows left alone,
    padded tile rows: one call."""
    check_prefill([1, 1, 37, 5, 70, 1], [9, 0, 0, 13, 33, 4], heads[0], heads[1], 16, 4, "cpu", torch.float32,
                  seed=sum(heads), tol=1e-5, layout=layout, first=2, pad=3)


def test_rms_norm():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 96, generator=g)
    w = torch.rand(96, generator=g) + 0.5
    xd = x.double()
    assert rel(rms_norm(x, w, 1e-6), xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()) < 1e-6


def rope_reference(x: torch.Tensor, pos: torch.Tensor, cos_sin: torch.Tensor, w=None, eps=1e-6) -> torch.Tensor:
    x = x.double()
    if w is not None:
        x = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    half = x.shape[-1] // 2
    cs = cos_sin.double()[pos.long()]
    cos = torch.cat([cs[:, :half], cs[:, :half]], -1)[:, None]
    sin = torch.cat([cs[:, half:], cs[:, half:]], -1)[:, None]
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


def check_rope(device, dtype, h, kvh, d, qk_norm, tol, layout="nhd"):
    g = torch.Generator().manual_seed(h + kvh)
    T, page, blocks = 9, 4, 8
    qkv = torch.randn(T, (h + 2 * kvh) * d, generator=g).to(device=device, dtype=dtype)
    orig = qkv.clone()
    pos = torch.randint(0, 500, (T,), generator=g).to(device=device, dtype=torch.int32)
    ang = torch.arange(512, dtype=torch.float64)[:, None] * torch.rand(d // 2, generator=g, dtype=torch.float64)
    cos_sin = torch.cat([ang.cos(), ang.sin()], 1).float().to(device)
    slots = torch.randperm(blocks * page, generator=g)[:T].to(torch.int32)
    slots[3] = -1
    slots = slots.to(device)
    if layout == "hnd":
        kc, vc = (torch.zeros(blocks, kvh, page, d, device=device, dtype=dtype).transpose(1, 2) for _ in range(2))
    else:
        kc, vc = (torch.zeros(blocks, page, kvh, d, device=device, dtype=dtype) for _ in range(2))
    qn = (torch.rand(d, generator=g) + 0.5).to(device=device, dtype=dtype) if qk_norm else None
    kn = (torch.rand(d, generator=g) + 0.5).to(device=device, dtype=dtype) if qk_norm else None
    rope_and_store(qkv, pos, cos_sin, kc, vc, slots, h, kvh, d, qn, kn, 1e-6)
    q_ref = rope_reference(orig[:, :h * d].view(T, h, d), pos, cos_sin, qn)
    k_ref = rope_reference(orig[:, h * d:(h + kvh) * d].view(T, kvh, d), pos, cos_sin, kn)
    assert rel(qkv[:, :h * d].view(T, h, d), q_ref) < tol
    assert rel(qkv[:, h * d:(h + kvh) * d].view(T, kvh, d), k_ref) < tol
    assert torch.equal(qkv[:, (h + kvh) * d:], orig[:, (h + kvh) * d:])  # v untouched
    kflat, vflat = kc.reshape(-1, kvh, d), vc.reshape(-1, kvh, d)  # logical order, either layout
    keep = slots.cpu() >= 0
    idx = slots.cpu().long()[keep].to(device)
    assert rel(kflat[idx], k_ref[keep.to(device)]) < tol
    assert torch.equal(vflat[idx], orig[:, (h + kvh) * d:].view(T, kvh, d)[keep.to(device)])
    written = torch.zeros(blocks * page, dtype=torch.bool)
    written[idx.cpu()] = True
    assert (kflat.cpu()[~written] == 0).all()  # nothing stored for slot -1


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("layout", ["hnd", "nhd"])
def test_rope_and_store_cpu(qk_norm, layout):
    check_rope("cpu", torch.float32, 4, 2, 16, qk_norm, 1e-6, layout)


def skinny_reference(x, w, mode, r=None):
    """float64: ``x @ w.T``, plus ``r`` (residual), or silu(gate) * up of the two halves (swiglu)."""
    y = x.double() @ w.double().T
    if mode == "swiglu":
        g, u = y.chunk(2, dim=-1)
        return g * torch.sigmoid(g) * u
    return y + r.double() if mode == "residual" else y


def check_skinny(device, dtype, M, N, K, mode, config, tol, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(device=device, dtype=dtype)
    w = (torch.randn(2 * N if mode == "swiglu" else N, K, generator=g) / K ** 0.5).to(device=device, dtype=dtype)
    r = torch.randn(M, N, generator=g).to(device=device, dtype=dtype) if mode == "residual" else None
    want = skinny_reference(x, w, mode, r)
    if mode == "residual":
        res = r.clone()
        out = skinny_linear(x, w, residual=res, config=config)
        assert out.data_ptr() == res.data_ptr()  # in place
    else:
        out = skinny_linear(x, w, swiglu=mode == "swiglu", config=config)
    assert out.shape == (M, N) and out.dtype == dtype
    assert rel(out, want) < tol, (M, N, K, mode, config, rel(out, want))


SKINNY_MODES = ["plain", "residual", "swiglu"]


@pytest.mark.parametrize("mode", SKINNY_MODES)
@pytest.mark.parametrize("config", [SkinnyConfig(32, 64, 1, 4, 2), SkinnyConfig(64, 128, 2, 4, 2),
                                    SkinnyConfig(32, 64, 3, 4, 2)])
def test_skinny_linear_cpu(mode, config):
    """On the CPU the torch fallback (the Triton kernel under TRITON_INTERPRET=1): shapes off every tile
    multiple, and K splits that do not divide K."""
    for M, N, K in ((5, 96, 256), (33, 200, 130), (1, 64, 64)):
        check_skinny("cpu", torch.float32, M, N, K, mode, config, 1e-5)


def test_skinny_config_fits_shared_memory():
    """A config whose tiles would not fit gives up pipeline stages first, then K width (hand-counted bytes)."""
    from bullet.gpu.kernels.skinny import SMEM_BYTES
    c = SkinnyConfig(64, 256, 1, 4, 4)
    assert c.fitted(16, False) == c  # (64 + 16) x 256 x 2 B x 4 stages = 160 KiB
    assert c.fitted(16, True) == c._replace(num_stages=2)  # (128 + 16) x 256 x 2 x 3 = 216 KiB: too much
    assert c.fitted(256, False) == c._replace(block_k=128, num_stages=2)  # 2 stages of 256-wide: 320 KiB; 128: 160
    for rows in (1, 16, 128, 256):
        for swiglu in (False, True):
            f = c.fitted(rows, swiglu)
            bm = max(16, 1 << (rows - 1).bit_length())
            assert (f.block_n * (2 if swiglu else 1) + bm) * f.block_k * 2 * f.num_stages <= SMEM_BYTES


def test_silu_mul_cpu():
    x = torch.randn(5, 2 * 40, generator=torch.Generator().manual_seed(1))
    xd = x.double()
    want = xd[:, :40] * torch.sigmoid(xd[:, :40]) * xd[:, 40:]
    assert rel(silu_mul(x), want) < 1e-6


# --- GPU ---------------------------------------------------------------------------------------------

DECODE_CASES = [  # (num_seqs, max context, seed)
    (1, 1, 0), (1, 32768, 1), (3, 32768, 2), (17, 4096, 3), (64, 8192, 4), (256, 1024, 5), (256, 2048, 6),
]


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(32, 8), (28, 4)])
@pytest.mark.parametrize("case", DECODE_CASES)
@pytest.mark.parametrize("layout", ["hnd", "nhd"])
def test_gpu_decode_attention_vs_float64(heads, case, layout):
    n, max_ctx, seed = case
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(1, max_ctx + 1, (n,), generator=g).tolist()
    ctx[0] = max_ctx  # the longest always present
    if n > 2:
        ctx[1] = 1
    check_decode(ctx, heads[0], heads[1], 128, 16, "cuda", torch.bfloat16, seed, tol=1e-2, layout=layout)


@pytest.mark.gpu
def test_gpu_decode_attention_padding_rows_and_fp32():
    check_decode([0, 5, 0, 300], 32, 8, 128, 16, "cuda", torch.bfloat16, 7, tol=1e-2)
    check_decode([1, 77, 1000, 4000], 32, 8, 128, 16, "cuda", torch.float32, 8, tol=1e-5)
    for splits in (1, 2, 7, 64):
        check_decode([3000, 17, 1], 28, 4, 128, 16, "cuda", torch.bfloat16, 9, tol=1e-2, num_splits=splits)
    for options in ({"head_first": False}, {"block_n": 128, "num_warps": 8}, {"block_n": 32, "num_stages": 2},
                    {"offsets32": True}, {"pdl": True, "num_splits": 3}, {"pdl": True, "num_splits": 1}):
        check_decode([5000, 1, 0, 77, 1024], 32, 8, 128, 16, "cuda", torch.bfloat16, 10, tol=1e-2, **options)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(32, 8), (28, 4)])
@pytest.mark.parametrize("layout", ["hnd", "nhd"])
def test_gpu_prefill_attention_vs_float64(heads, layout):
    h, kvh = heads
    check_prefill([4096], [0], h, kvh, 128, 16, "cuda", torch.bfloat16, 1, 1e-2, layout)
    check_prefill([1, 300, 1, 8193, 7], [50, 0, 99, 0, 0], h, kvh, 128, 16, "cuda", torch.bfloat16, 2, 1e-2,
                  layout, first=0, pad=5)
    check_prefill([1, 1, 512, 256, 1000], [700, 3, 4096, 17, 0], h, kvh, 128, 16, "cuda", torch.bfloat16, 3,
                  1e-2, layout, first=2)
    check_prefill([33, 200], [1000, 0], h, kvh, 128, 16, "cuda", torch.float32, 4, 1e-5, layout)
    for options in ({"block_n": 32}, {"block_n": 128, "num_stages": 3}, {"num_warps": 4}):
        check_prefill([64] * 20, [100] * 20, h, kvh, 128, 16, "cuda", torch.bfloat16, 5, 1e-2, layout, **options)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(32, 8), (28, 4)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_gpu_rope_and_store(heads, qk_norm):
    for layout in ("hnd", "nhd"):
        check_rope("cuda", torch.bfloat16, heads[0], heads[1], 128, qk_norm, 1e-2, layout)
        check_rope("cuda", torch.float32, heads[0], heads[1], 128, qk_norm, 1e-6, layout)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [3584, 4096])
def test_gpu_rms_norm_and_silu(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(33, n, generator=g).cuda().bfloat16()
    w = (torch.rand(n, generator=g) + 0.5).cuda().bfloat16()
    xd = x.double()
    assert rel(rms_norm(x, w, 1e-5), xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()) < 1e-2
    assert rel(rms_norm(x[:, 5:5 + n // 2], w[:n // 2], 1e-5),  # a strided view of the rows
               xd[:, 5:5 + n // 2] / torch.sqrt(xd[:, 5:5 + n // 2].pow(2).mean(-1, keepdim=True) + 1e-5)
               * w[:n // 2].double()) < 1e-2
    z = torch.randn(33, 2 * n, generator=g).cuda().bfloat16()
    zd = z.double()
    assert rel(silu_mul(z), zd[:, :n] * torch.sigmoid(zd[:, :n]) * zd[:, n:]) < 1e-2
    assert math.isfinite(float(silu_mul(z).float().sum()))


def check_gemv(device, dtype, n, k, bias, tol, fused=(), **options):
    """``gemv`` (with the ``fused`` ops: "norm", "swiglu", "residual") against a float64 composition."""
    g = torch.Generator(device=device).manual_seed(n + k)  # on the device: the big shapes fill fast
    out_n = n // 2 if "swiglu" in fused else n

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device)

    x = randn(1, k).to(dtype)
    w = (randn(n, k) / k**0.5).to(dtype)
    b = randn(n).to(dtype) if bias else None
    nw = (1 + torch.rand(k, generator=g, device=device)).to(dtype) if "norm" in fused else None
    r = randn(1, out_n).to(dtype) if "residual" in fused else None
    r0 = r.double().clone() if r is not None else None
    xd = x.double()
    if nw is not None:
        xd = xd / torch.sqrt(xd.pow(2).mean() + 1e-5) * nw.double()
    want = xd @ w.double().T + (b.double() if bias else 0)
    if "swiglu" in fused:
        want = want[:, :out_n] * torch.sigmoid(want[:, :out_n]) * want[:, out_n:]
    if r0 is not None:
        want = want + r0
    y = gemv(x, w, b, norm=nw, eps=1e-5, swiglu="swiglu" in fused, residual=r, **options)
    assert y.shape == (1, out_n) and rel(y, want) < tol
    if r is not None:
        assert y.data_ptr() == r.data_ptr()  # in place


FUSED = [(), ("norm",), ("residual",), ("norm", "swiglu"), ("swiglu", "residual")]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("fused", FUSED)
def test_gemv_cpu(bias, fused):
    if bias and "swiglu" in fused:
        pytest.skip("swiglu takes no bias")
    check_gemv("cpu", torch.float32, 38, 300, bias, 1e-5, fused, block_n=8, block_k=128)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 14336), (28672, 4096), (4608, 3584), (1000, 333)])
@pytest.mark.parametrize("options", [{"block_n": 8, "block_k": 512}, {"block_n": 16, "block_k": 256},
                                     GEMV_DEFAULT])
@pytest.mark.parametrize("fused", FUSED)
def test_gpu_gemv(shape, options, fused):
    bias = shape[0] == 4608 and "swiglu" not in fused
    check_gemv("cuda", torch.bfloat16, *shape, bias=bias, tol=1e-2, fused=fused, **options)
    check_gemv("cuda", torch.float32, *shape, bias=True and "swiglu" not in fused, tol=1e-5, fused=fused,
               **options)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 14336), (1000, 333)])
@pytest.mark.parametrize("mode", SKINNY_MODES)
def test_gpu_skinny_linear(shape, mode):
    """Decode products at Llama-3.1-8B's shapes (and one off every tile multiple) for 2..256 rows, with and
    without a K split, in bf16 against float64."""
    N, K = shape
    configs = [SkinnyConfig(32, 128, 1, 4, 4), SkinnyConfig(128, 64, 8, 8, 3)]
    for M in (2, 33, 256):
        for config in configs:
            check_skinny("cuda", torch.bfloat16, M, N, K, mode, config, 1e-2, seed=M)


@pytest.mark.gpu
def test_gpu_gemv_pdl_chain_in_a_graph_equals_plain_launches():
    """Dependent GEMVs launched with PDL, captured in a CUDA graph: each waits for its input (the previous
    product), so the chain gives exactly what plain launches give."""
    g = torch.Generator().manual_seed(0)
    ws = [(torch.randn(4096, 4096, generator=g) / 64).cuda().bfloat16() for _ in range(6)]
    nw = (1 + torch.rand(4096, generator=g)).cuda().bfloat16()
    x0 = torch.randn(1, 4096, generator=g).cuda().bfloat16()

    def chain(pdl: bool, h: torch.Tensor) -> torch.Tensor:
        for i, w in enumerate(ws):
            if i % 2:
                gemv(gemv(h, w, norm=nw, pdl=pdl), w, residual=h, pdl=pdl)
            else:
                h = gemv(h, w, pdl=pdl)
        return h

    want = chain(False, x0.clone())
    h = x0.clone()
    chain(True, h.clone())  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = chain(True, h)
    for _ in range(3):
        h.copy_(x0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)


def test_padded_length_buckets():
    from bullet.gpu.attention import padded_length

    assert [padded_length(n) for n in (1, 256, 257, 8192, 8193, 10000)] == [256, 256, 512, 8192, 10240, 10240]


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 255, 300, 1000, 8193])
def test_padded_causal_prefill_matches_reference(n):
    """Prompt attention is computed at a padded length on CUDA; the real rows must not see the padding."""
    from bullet.gpu.attention import _prefill_one

    g = torch.Generator(device="cuda").manual_seed(n)
    H, KVH, D = 32, 8, 128
    q = torch.randn((n, H, D), device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn((n, KVH, D), device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn((n, KVH, D), device="cuda", dtype=torch.bfloat16, generator=g)
    out = _prefill_one(q, k, v, None, D ** -0.5, {})
    assert out.shape == (n, H, D)
    qd, kd, vd = (t.double() for t in (q, k.repeat_interleave(H // KVH, 1), v.repeat_interleave(H // KVH, 1)))
    s = torch.einsum("qhd,khd->hqk", qd, kd) * D ** -0.5
    s = s.masked_fill(torch.ones(n, n, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("hqk,khd->qhd", s.softmax(-1), vd)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(32, 8), (28, 4)])
@pytest.mark.parametrize("layout", ["hnd", "nhd"])
@pytest.mark.parametrize("options", [{"block_n": 2, "block_k": 512}, {"block_n": 8, "block_k": 512}, GEMV_DEFAULT])
def test_gpu_gemv_rope_epilogue_equals_gemv_then_rope_and_store(heads, layout, options):
    """The q/k/v GEMV with RoPE and the k/v store fused gives what the product followed by rope_and_store
    gives: the row, and the pool."""
    from bullet.gpu.kernels.gemv import RopeStore

    h, kvh = heads
    d, page, blocks, k = 128, 16, 6, 3584 if h == 28 else 4096
    g = torch.Generator(device="cuda").manual_seed(h)
    x = torch.randn(1, k, generator=g, device="cuda").bfloat16()
    w = (torch.randn((h + 2 * kvh) * d, k, generator=g, device="cuda") / k**0.5).bfloat16()
    b = torch.randn((h + 2 * kvh) * d, generator=g, device="cuda").bfloat16() if h == 28 else None
    nw = (1 + torch.rand(k, generator=g, device="cuda")).bfloat16()
    ang = torch.arange(4096, dtype=torch.float64, device="cuda")[:, None] * torch.rand(
        d // 2, generator=g, device="cuda", dtype=torch.float64)
    cos_sin = torch.cat([ang.cos(), ang.sin()], 1).float()

    def pool():
        if layout == "hnd":
            return [torch.zeros(blocks, kvh, page, d, device="cuda").bfloat16().transpose(1, 2) for _ in range(2)]
        return [torch.zeros(blocks, page, kvh, d, device="cuda").bfloat16() for _ in range(2)]

    for p, slot in ((3000, 37), (5, -1)):
        pos = torch.tensor([p], dtype=torch.int32, device="cuda")
        slots = torch.tensor([slot], dtype=torch.int32, device="cuda")
        kc0, vc0 = pool()
        want = gemv(x, w, b, norm=nw, eps=1e-5, **options)
        rope_and_store(want, pos, cos_sin, kc0, vc0, slots, h, kvh, d)
        kc1, vc1 = pool()
        got = gemv(x, w, b, norm=nw, eps=1e-5, rope=RopeStore(pos, cos_sin, kc1, vc1, slots, h, kvh, d), **options)
        assert rel(got, want) < 5e-3  # the same arithmetic; FMA contraction may differ by an ulp
        if slot >= 0:
            assert rel(kc1, kc0) < 5e-3 and torch.equal(vc1, vc0)
        else:
            assert not kc1.any() and not vc1.any()


def advance_case(device):
    """Rows of DecodeBuffers: three live (one crossing into its next block), one padding."""
    from bullet.gpu.attention import _CTX, _NCOLS, _POS, _SLOT

    page, max_blocks = 4, 6
    buf = torch.zeros((4, _NCOLS + max_blocks), dtype=torch.int32)
    tables = torch.tensor([[7, 3, 9, 0, 0, 0], [2, 5, 0, 0, 0, 0], [11, 12, 13, 14, 15, 16], [0] * 6])
    buf[:, _NCOLS:] = tables
    buf[:, _POS] = torch.tensor([5, 3, 23, 0])  # row 1: position 3 -> 4 crosses into block 5
    buf[:, _CTX] = torch.tensor([6, 4, 24, 0])  # row 3: padding
    buf[:, _SLOT] = torch.tensor([3 * page + 1, 2 * page + 3, 16 * page + 3, -1])
    tok = torch.tensor([10, 20, 30, 40])
    return buf.to(device), tok.to(device), (_POS, _CTX, _SLOT, _NCOLS), page


def test_advance_moves_live_rows_one_token_on():
    from bullet.gpu.kernels.advance import advance

    buf, tok, cols, page = advance_case("cpu")
    out, ids, offs = torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64), torch.arange(4)
    advance(buf, tok, out, ids, offs, page, cols)
    pos_c, ctx_c, slot_c, _ = cols
    assert torch.equal(out, tok) and torch.equal(ids, tok) and torch.equal(offs, torch.arange(1, 5))
    assert buf[:, pos_c].tolist() == [6, 4, 24, 0] and buf[:, ctx_c].tolist() == [7, 5, 25, 0]
    # slot = table[pos // page] * page + pos % page; position 24 is past the 6-block table: clamped to its last
    assert buf[:, slot_c].tolist() == [3 * page + 2, 5 * page + 0, 16 * page + 0, -1]


@pytest.mark.gpu
def test_gpu_advance_kernel_equals_torch_ops():
    from bullet.gpu.kernels.advance import advance

    results = []
    for device in ("cpu", "cuda"):
        buf, tok, cols, page = advance_case(device)
        out, ids = torch.zeros(4, dtype=torch.int64, device=device), torch.zeros(4, dtype=torch.int64, device=device)
        offs = torch.arange(4, device=device)
        for _ in range(3):  # three fused steps
            advance(buf, tok, out, ids, offs, page, cols)
        results.append([t.cpu() for t in (buf, out, ids, offs)])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_fill_rows_by_hand_and_against_a_loop():
    """fill_rows writes positions, slots, starts, contexts, sample rows and block tables: checked by hand on a
    small launch, then token by token on random launches of decode rows, prompts and prefix chunks; bad chunks
    name the request. (A version vectorised over the chunks was tried: 50 against 12 us for one decode row and
    a prompt, 231 against 330 us for 48 rows; not kept.)"""
    import numpy as np

    from bullet.batch import Chunk
    from bullet.gpu.attention import fill_rows

    def arrays(T, S, W):
        return (np.full(T, -7, np.int32), np.full(T, -7, np.int32), np.zeros(S + 1, np.int32),
                np.full(S, -7, np.int32), np.full(S, -7, np.int32), np.full((S, W), -7, np.int32))

    # block size 4: a decode row at position 5 (blocks 9, 3), a fresh 3-token prompt (block 6), sampled both;
    # a 2-token chunk at 4 over a prefix (blocks 1, 2), not sampled
    chunks = [Chunk(0, 5, 1, (9, 3), True), Chunk(1, 0, 3, (6,), True), Chunk(2, 4, 2, (1, 2, 8), False)]
    pos, slot, starts, ctx, samp, bt = arrays(6, 3, 3)
    fill_rows(chunks, 4, pos, slot, starts, ctx, samp, bt)
    assert pos.tolist() == [5, 0, 1, 2, 4, 5]
    assert slot.tolist() == [3 * 4 + 1, 24, 25, 26, 2 * 4, 2 * 4 + 1]
    assert starts.tolist() == [0, 1, 4, 6] and ctx.tolist() == [6, 3, 6] and samp[:2].tolist() == [0, 3]
    assert bt.tolist() == [[9, 3, -7], [6, -7, -7], [1, 2, -7]]  # columns past a chunk's need untouched

    rng = np.random.default_rng(3)
    for _ in range(50):
        B, n, W = int(rng.choice([4, 16])), int(rng.integers(1, 12)), 40
        chunks = []
        for i in range(n):
            start, k = int(rng.integers(0, 60)), int(rng.choice([1, 1, int(rng.integers(1, 30))]))
            need = -(-(start + k) // B)
            extra = int(rng.integers(0, 3))
            chunks.append(Chunk(i, start, k, tuple(int(x) for x in rng.integers(0, 999, need + extra)),
                                bool(rng.integers(0, 2))))
        T = sum(c.num_tokens for c in chunks)
        got, want, mirrored = arrays(T, n, W), arrays(T, n, W), arrays(T, n, W)
        fill_rows(chunks, B, *got)
        # block ids from int32 copies, as the executor passes them (GpuExecutor._block_table)
        fill_rows(chunks, B, *mirrored, table=lambda c: np.asarray(c.block_ids, np.int32))
        pos, slot, starts, ctx, samp, bt = want
        row = k = 0
        for i, c in enumerate(chunks):  # the reference: one chunk, one token at a time
            need = -(-(c.start + c.num_tokens) // B)
            bt[i, :need] = c.block_ids[:need]
            for j in range(c.num_tokens):
                p = c.start + j
                pos[row], slot[row] = p, c.block_ids[p // B] * B + p % B
                row += 1
            starts[i + 1], ctx[i] = row, c.start + c.num_tokens
            if c.sample:
                samp[k] = row - 1
                k += 1
        for a, b, m in zip(got, want, mirrored):
            assert a.tolist() == b.tolist() == m.tolist()
    with pytest.raises(ValueError, match="request 7 has 1 blocks, too few for 6 tokens"):
        fill_rows([Chunk(7, 5, 1, (1,), True)], 4, *arrays(1, 1, 4))
    with pytest.raises(ValueError, match="request 8 needs 3 blocks, room for 2"):
        fill_rows([Chunk(8, 8, 2, (1, 2, 3), True)], 4, *arrays(2, 1, 2))
