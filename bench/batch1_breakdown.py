"""Where the batch-1 decode step's time goes, piece by piece, and whether an L2 prefetch of weights pays.
Llama-3.1-8B shapes, dummy bf16 weights, one token over 1024 tokens of context, the fused one-token path
(``Model._forward_one``), every chain a CUDA graph of PDL launches.

1. Chains over the 32 layers, adding one piece at a time: the four plain GEMVs; the same with their fused
   prologues / epilogues (RMSNorm, RoPE + k/v store, SiLU, residual); plus attention; plus the L2 prefetch of
   the o weights from the attention's merge launch; the whole forward; forward + LM head + greedy sampling
   (the step `bench/gpu_kernels.py` reports).
2. One o-projection GEMV (32 MiB) with a cold L2, after a bulk L2 prefetch of its weights, after a per-line
   prefetch, after reading them: does the prefetch land at all.

    python bench/batch1_breakdown.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton
import triton.language as tl

from bullet.batch import Chunk
from bullet.config import MODELS
from bullet.gpu.attention import DecodeBuffers
from bullet.gpu.kernels.gemv import GEMV_DEFAULT, RopeStore, gemv
from bullet.gpu.kernels.prefetch import prefetch_args, prefetch_l2
from bullet.gpu.kvcache import PagedKvCache
from bullet.gpu.model import Model
from bullet.gpu.sampling import sample
from bullet.gpu.weights import load_weights

COPY_CEILING = 4.3e12  # BACKGROUND.md


@triton.jit
def _lines_kernel(PF, nbytes, T: tl.constexpr):
    """Per-line prefetch: program p walks its share of 128-byte lines, T lines per step."""
    p = tl.program_id(0)
    lines = tl.cdiv(nbytes, 128)
    per = tl.cdiv(lines, tl.num_programs(0))
    for i in range(p * per, tl.minimum(p * per + per, lines), T):
        addr = PF + tl.minimum(i + tl.arange(0, T), lines - 1).to(tl.int64) * 128
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [addr],
                                  dtype=tl.int32, is_pure=False, pack=1)


def events_time(fn, reps: int = 20, before=None) -> float:
    """Median ms of ``fn`` between CUDA events; ``before()`` is enqueued (untimed, no host sync) ahead of each."""
    times = []
    for _ in range(reps + 3):
        if before:
            before()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times = sorted(times[3:])
    return times[len(times) // 2]


def graph_time(fn, reps: int = 30) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        fn()
    g.replay()
    return events_time(g.replay, reps)


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

    def layers(fused: frozenset = ALL, attend: bool = False, prefetch: bool = False, gu: dict | None = None,
               **opts):
        """The 32 layers' GEMVs with the ``fused`` ops (the others left out, not run separately)."""
        model.prefetch_o = prefetch
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

    def forward(prefetch: bool):
        model.prefetch_o = prefetch
        return model.forward(bufs.input_ids[:1], range(L), meta, kv)

    def step(prefetch: bool):
        return sample(model.logits(forward(prefetch), meta.sample_rows), None)

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
              "  + attention, o weights prefetched by the merge": lambda: layers(attend=True, prefetch=True),
              "forward (embedding, layers, final norm)": lambda: forward(False),
              "step: forward + LM head + greedy sample": lambda: step(False)}
    for name, fn in chains.items():
        t = graph_time(fn)
        note = f"{t / L * 1e3:.1f} us/layer; layers' weights at {layer_bytes / t / 1e9:.2f} TB/s"
        rows.append((f"graph: {name}", t, note))

    W = model.layers[0].wo
    flush = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
    pf, nbytes = prefetch_args(W)
    gap = 200_000  # GPU cycles (~0.1 ms) between the prefetch and the timed GEMV, for the prefetch to land

    def then(fn):
        def run():
            flush.zero_()
            fn()
            torch.cuda._sleep(gap)
        return run

    ways = {"cold L2": then(lambda: None),
            "bulk prefetch, 32 programs": then(lambda: prefetch_l2(W, 32)),
            "bulk prefetch, 132 programs": then(lambda: prefetch_l2(W, 132)),
            "line prefetch, 132 programs": then(lambda: _lines_kernel[(132,)](pf, nbytes, T=128, num_warps=4)),
            "read first (W.sum())": then(lambda: W.sum())}
    for name, before in ways.items():
        t = events_time(lambda: gemv(x, W, **cfg), 30, before)
        rows.append((f"one o GEMV (32 MiB), {name}", t, f"{nbytes / t / 1e9:.2f} TB/s"))

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"weight-read bound of a step {(layer_bytes + model.lm_head.numel() * 2) / COPY_CEILING * 1e3:.2f} ms")
    w = max(len(r[0]) for r in rows)
    for name, t, note in rows:
        print(f"{name:<{w}}  {t:8.4f} ms  {note}")


if __name__ == "__main__":
    main()
