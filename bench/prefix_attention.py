"""Prefill attention over a cached prefix (a later chunk of chunked prefill, or a prefix-cache hit), as the
executor runs it (`bullet.gpu.attention._prefill_one` with `ctx` set: K/V of the whole context, heads
expanded, causal from the lower right), against the dense boolean mask it used before. Llama-3.1-8B heads
(32 query, 8 KV, dim 128), bf16. Each point is checked against a float32 reference on random data first, then
timed with CUDA events after warm-up (median of 20, `bench/gpu_kernels.timeit`). Prints a table.

    python3 bench/prefix_attention.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_kernels import timeit
from bullet.gpu.attention import _prefill_one

H, KVH, D = 32, 8, 128
POINTS = [(512, 4096), (2048, 8192), (2048, 16384), (8192, 16384), (8192, 32768), (512, 32768)]


def dense_mask(q, k, v, ctx, scale):
    """The earlier path: heads expanded, an n x ctx boolean mask."""
    n = q.shape[0]
    k, v = k.repeat_interleave(H // KVH, dim=1), v.repeat_interleave(H // KVH, dim=1)
    mask = torch.arange(ctx, device=q.device)[None, :] <= torch.arange(ctx - n, ctx, device=q.device)[:, None]
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       attn_mask=mask, scale=scale)
    return o[0].transpose(0, 1)


def main() -> None:
    torch.manual_seed(0)
    scale = D ** -0.5
    print(f"{torch.cuda.get_device_name()} · torch {torch.__version__}")
    print("new tokens | context | max err vs fp32 (lower-right / mask) | mask ms | lower-right ms | speed-up | "
          "lower-right TFLOP/s")
    print("|".join(["---"] * 7))
    for n, ctx in POINTS:
        q = torch.randn(n, H, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(ctx, KVH, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(ctx, KVH, D, device="cuda", dtype=torch.bfloat16)
        ref = dense_mask(q.float(), k.float(), v.float(), ctx, scale)
        new = _prefill_one(q, k, v, ctx, scale, {})
        old = dense_mask(q, k, v, ctx, scale)
        err_new, err_old = ((x.float() - ref).abs().max().item() for x in (new, old))
        assert err_new < 0.05, f"lower-right causal attention is off by {err_new} at n={n}, ctx={ctx}"
        t_old = timeit(lambda q=q, k=k, v=v, ctx=ctx: dense_mask(q, k, v, ctx, scale))
        t_new = timeit(lambda q=q, k=k, v=v, ctx=ctx: _prefill_one(q, k, v, ctx, scale, {}))
        pairs = n * (ctx - n) + n * (n + 1) / 2  # query-key pairs under the causal-with-prefix mask
        flops = 4 * pairs * H * D
        print(f"{n} | {ctx} | {err_new:.4f} / {err_old:.4f} | {t_old * 1e3:.2f} | {t_new * 1e3:.2f} | "
              f"{t_old / t_new:.1f}x | {flops / t_new / 1e12:.0f}")
        del q, k, v, ref, new, old
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
