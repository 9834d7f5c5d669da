"""Where the batch-1 decode step's time goes, piece by piece. Llama-3.1-8B shapes, dummy bf16 weights, one
token over 1024 tokens of context, the fused one-token path (``Model._forward_one``), every chain a CUDA graph
of PDL launches over the 32 layers: the four plain GEMVs; the same with their fused prologues / epilogues
(RMSNorm, RoPE + k/v store, SiLU, residual), all and all but one; other launch options for the gate/up
product; plus attention; the whole forward; forward + LM head + greedy sampling (the step
`bench/gpu_kernels.py` reports).

    python bench/batch1_breakdown.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton

from bench.gpu_kernels import capture, timeit
from bullet.batch import Chunk
from bullet.config import MODELS
from bullet.gpu.attention import DecodeBuffers
from bullet.gpu.kernels.gemv import GEMV_DEFAULT, RopeStore, gemv
from bullet.gpu.kvcache import PagedKvCache
from bullet.gpu.model import Model
from bullet.gpu.sampling import sample
from bullet.gpu.weights import load_weights

COPY_CEILING = 4.3e12  # docs/background.md


def main() -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    spec = MODELS["llama-3.1-8b"]
    L, H, KVH, D = spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim
    model = Model(spec, load_weights(spec, "dummy", dev, torch.bfloat16, seed=0), dev)
    torch.cuda.empty_cache()
    page, ctx = 16, 1024
    kv = PagedKvCache(spec, ctx // page + 2, page, dev)
    kv.k.normal_()
    kv.v.normal_()
    bufs = DecodeBuffers(1, ctx // page, page, dev)
    bufs.fill([Chunk(0, ctx - 1, 1, tuple(range(1, ctx // page + 1)), True)])
    bufs.input_ids[:1] = 7
    meta = bufs.meta(1)
    cfg = dict(GEMV_DEFAULT)
    model.gemv_config = cfg
    hid, I = spec.hidden_size, spec.ffn_per_gpu
    x = torch.randn(1, hid, device=dev, dtype=torch.bfloat16)
    xf = torch.randn(1, I, device=dev, dtype=torch.bfloat16)
    h = torch.randn(1, hid, device=dev, dtype=torch.bfloat16)
    eps = spec.rms_norm_eps

    ALL = frozenset({"norm", "rope", "swiglu", "residual"})

    def layers(fused: frozenset = ALL, attend: bool = False, gu: dict | None = None, **opts):
        """The 32 layers' GEMVs with the ``fused`` ops (the others left out, not run separately)."""
        c = {**cfg, **opts}
        for i, ly in enumerate(model.layers):
            rope = RopeStore(meta.positions, model.cos_sin, *kv.layer(i), meta.slot_mapping, H, KVH, D) \
                if "rope" in fused else None
            norm = "norm" in fused
            qkv = gemv(h if norm else x, ly.wqkv, norm=ly.ln1 if norm else None, eps=eps, rope=rope, **c)
            o = model._attend(i, ly, qkv, meta, kv, True, stored=rope is not None) if attend else qkv[:, :H * D]
            res = h if "residual" in fused else None
            gemv(o, ly.wo, residual=res, **c)
            sw = "swiglu" in fused
            act = gemv(h if norm else x, ly.w_gate_up, norm=ly.ln2 if norm else None, eps=eps, swiglu=sw,
                       **{**c, **(gu or {})})
            gemv(act if sw else xf, ly.w_down, residual=res, **c)

    def forward():
        return model.forward(bufs.input_ids[:1], range(L), meta, kv)

    def step():
        return sample(model.logits(forward(), meta.sample_rows), None)

    layer_bytes = sum(t.numel() * 2 for t in (model.layers[0].wqkv, model.layers[0].wo,
                                              model.layers[0].w_gate_up, model.layers[0].w_down)) * L
    rows = []
    chains = {"4 plain GEMVs x 32": lambda: layers(frozenset()),
              "4 fused GEMVs x 32 (norm, RoPE + store, SiLU, residual)": lambda: layers(),
              "  without the norm": lambda: layers(ALL - {"norm"}),
              "  without RoPE + store": lambda: layers(ALL - {"rope"}),
              "  without SiLU": lambda: layers(ALL - {"swiglu"}),
              "  without the residual adds": lambda: layers(ALL - {"residual"}),
              "  only the norm": lambda: layers(frozenset({"norm"})),
              "  all, gate/up block_n 2": lambda: layers(gu={"block_n": 2}),
              "  all, block_n 2": lambda: layers(block_n=2),
              "  all, gate/up block_k 512": lambda: layers(gu={"block_k": 512}),
              "  all, gate/up block_k 2048": lambda: layers(gu={"block_k": 2048}),
              "  all, block_k 2048": lambda: layers(block_k=2048),
              "  plain, block_k 2048": lambda: layers(frozenset(), block_k=2048),
              "  + attention (split + merge)": lambda: layers(attend=True),
              "forward (embedding, layers, final norm)": forward,
              "step: forward + LM head + greedy sample": step}
    for name, fn in chains.items():
        g, _ = capture(fn)
        t = timeit(g.replay, 3, 30) * 1e3  # ms
        note = f"{t / L * 1e3:.1f} us/layer; layers' weights at {layer_bytes / t / 1e9:.2f} TB/s"
        rows.append((f"graph: {name}", t, note))

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"weight-read bound of a step {(layer_bytes + model.lm_head.numel() * 2) / COPY_CEILING * 1e3:.2f} ms")
    w = max(len(r[0]) for r in rows)
    for name, t, note in rows:
        print(f"{name:<{w}}  {t:8.4f} ms  {note}")


if __name__ == "__main__":
    main()
