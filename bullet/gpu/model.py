"""Llama-3.x / Qwen2.5 / Qwen3 decoder forward over a layer range, on the paged KV pool.

The residual adds ride on the o and down products (``residual + x @ W.T`` in one GEMM, rounded once), so
the stream between layers is one tensor and the norms read it once: on a 4096-token prefill that spares
the delta's write and re-read around 64 norms. A forward over ``range(0, 8)`` then ``range(8, 32)`` gives
bit-for-bit the result of ``range(0, 32)``.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import ModelSpec
from .attention import AttnMeta, attention
from .kernels.activation import silu_mul
from .kernels.decode_attention import launch_defaults
from .kernels.gemv import RopeStore, gemv
from .kernels.norm import rms_norm
from .kernels.prefill_attention import block_q
from .kernels.rope import rope_and_store
from .kernels.skinny import SkinnyConfig, Table, skinny_linear
from .kvcache import PagedKvCache
from .weights import check_weights


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """float64 ``[head_dim / 2]`` inverse frequencies, with Llama-3 scaling where ``spec.rope_scaling``."""
    d = spec.head_dim
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    r = spec.rope_scaling
    if r is None:
        return inv
    wavelen = 2 * math.pi / inv
    low_wavelen = r.original_max_position / r.low_freq_factor  # longer than this: divided by factor
    high_wavelen = r.original_max_position / r.high_freq_factor  # shorter than this: unchanged
    smooth = (r.original_max_position / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
    mid = (1 - smooth) * inv / r.factor + smooth * inv
    return torch.where(wavelen > low_wavelen, inv / r.factor, torch.where(wavelen < high_wavelen, inv, mid))


def rope_cache(spec: ModelSpec, device: torch.device | str, max_position: int | None = None) -> torch.Tensor:
    """float32 ``[max_position, head_dim]``: row ``p`` is ``[cos(p f) | sin(p f)]``."""
    n = max_position or spec.max_position
    angles = torch.arange(n, dtype=torch.float64)[:, None] * rope_inv_freq(spec)[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=1).to(device=device, dtype=torch.float32)


def finish(gen):
    """Run a generator to its end; its return value."""
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


@dataclass(slots=True)
class _Layer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    wqkv: torch.Tensor  # [q + 2 kv, hidden]
    bqkv: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    wo: torch.Tensor
    w_gate_up: torch.Tensor  # [2 ffn, hidden]
    w_down: torch.Tensor


class Model:
    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], device: torch.device | str,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        if spec.tp != 1:
            raise NotImplementedError(f"Model: tensor parallelism (tp={spec.tp}) is not implemented")
        check_weights(spec, weights)
        self.spec, self.device, self.dtype = spec, torch.device(device), dtype

        def get(name: str) -> torch.Tensor:
            return weights[name].to(device=self.device, dtype=dtype)

        def cat(*names: str) -> torch.Tensor:
            return torch.cat([get(n) for n in names], dim=0).contiguous()

        self.embed = get("model.embed_tokens.weight")
        self.lm_head = self.embed if spec.tie_embeddings else get("lm_head.weight")
        self.norm = get("model.norm.weight")
        self.layers: list[_Layer] = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            self.layers.append(_Layer(
                ln1=get(p + "input_layernorm.weight"), ln2=get(p + "post_attention_layernorm.weight"),
                wqkv=cat(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                bqkv=cat(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias") if spec.qkv_bias else None,
                q_norm=get(a + "q_norm.weight") if spec.qk_norm else None,
                k_norm=get(a + "k_norm.weight") if spec.qk_norm else None,
                wo=get(a + "o_proj.weight").contiguous(),
                w_gate_up=cat(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                w_down=get(p + "mlp.down_proj.weight").contiguous()))
        self.cos_sin = rope_cache(spec, self.device)
        self.scale = spec.head_dim ** -0.5
        self.decode_config: dict = {}  # launch options of the paged decode kernel (bench-tuned; override all)
        self.num_sms: int | None = None  # SMs of the partition launches go to now (None: whole GPU; see on_sms)
        # options of the prefill attention: {"sdpa": True} for SDPA per sequence, "tiles" for the one-call kernel
        self.prefill_config: dict = {}
        # one-token forwards: the fused GEMV path with these options (``kernels.gemv``); None: cuBLAS
        self.gemv_config: dict | None = None
        # products of multi-row forwards on (self.num_sms, rows) that take the skinny kernel with the given
        # config instead of cuBLAS (``kernels.skinny.load_table``; empty: cuBLAS everywhere)
        self.skinny: Table = {}

    @property
    def block_q(self) -> int | None:
        """New tokens per tile of the one-call prefill attention, for ``build_meta`` (None: SDPA per sequence,
        where ``prefill_config["sdpa"]``)."""
        if self.prefill_config.get("sdpa"):
            return None
        return block_q(self.spec.heads_per_gpu // self.spec.kv_heads_per_gpu)

    @contextmanager
    def on_sms(self, num_sms: int | None):
        """Launches inside run on a partition of ``num_sms`` SMs: kernels take that size's launch options."""
        prev, self.num_sms = self.num_sms, num_sms
        try:
            yield self
        finally:
            self.num_sms = prev

    def forward(self, x: torch.Tensor, layers: range, meta: AttnMeta, kv: PagedKvCache) -> torch.Tensor:
        """``x``: token ids ``[T]`` when ``layers.start == 0``, else the hidden state ``[T, hidden]`` the
        previous slice returned. Returns the hidden state after the slice, final norm applied where
        ``layers.stop == num_layers``. Writes the new tokens' k/v into ``kv`` at ``meta.slot_mapping``."""
        return finish(self.forward_iter(x, layers, meta, kv))

    def forward_iter(self, x: torch.Tensor, layers: range, meta: AttnMeta, kv: PagedKvCache):
        """``forward`` as a generator that yields after enqueueing each layer (of a multi-token forward) and
        returns the hidden state: the executor enqueues a long eager launch a layer at a time, so that it can
        serve the other lane between layers instead of after the whole launch's host time."""
        spec = self.spec
        if not 0 <= layers.start <= layers.stop <= spec.num_layers or layers.step != 1:
            raise ValueError(f"Model.forward: layers {layers} is not a slice of 0..{spec.num_layers}")
        # the residual stream is updated in place: a copy of the caller's hidden state
        residual = F.embedding(x, self.embed) if layers.start == 0 else x.clone()
        eps = spec.rms_norm_eps
        if self.gemv_config is not None and residual.shape[0] == 1:
            return self._forward_one(residual, layers, meta, kv)
        sk = self._skinny_for(residual.shape[0])
        for i in layers:
            layer = self.layers[i]
            residual = self._attention(i, layer, rms_norm(residual, layer.ln1, eps), meta, kv, residual, sk)
            residual = self._mlp(layer, rms_norm(residual, layer.ln2, eps), residual, sk)
            yield
        if layers.stop == spec.num_layers:
            return rms_norm(residual, self.norm, eps)
        return residual

    def _forward_one(self, h: torch.Tensor, layers: range, meta: AttnMeta, kv: PagedKvCache) -> torch.Tensor:
        """One token (batch-1 decode): four fused GEMVs per layer (norm into the q/k/v and gate/up products,
        RoPE and the k/v store into q/k/v, SiLU into gate/up, the residual adds into o and down), ``h``
        updated in place. Rounds as ``forward`` except that the normalised rows feeding the q/k/v and gate/up
        products stay fp32 (``kernels.gemv``)."""
        spec, cfg, eps = self.spec, self.gemv_config, self.spec.rms_norm_eps
        pdl = bool(cfg.get("pdl"))  # then every kernel of the step is a programmatic dependent launch
        H, KVH, D = spec.heads_per_gpu, spec.kv_heads_per_gpu, spec.head_dim
        bn = cfg.get("block_n", 4)
        fuse_rope = not spec.qk_norm and D % bn == 0 and bn >= 2  # Qwen3's q/k norm needs whole heads
        for i in layers:
            layer = self.layers[i]
            rope = RopeStore(meta.positions, self.cos_sin, *kv.layer(i), meta.slot_mapping, H, KVH, D) \
                if fuse_rope else None
            qkv = gemv(h, layer.wqkv, layer.bqkv, norm=layer.ln1, eps=eps, rope=rope, **cfg)
            o = self._attend(i, layer, qkv, meta, kv, pdl, stored=fuse_rope)
            gemv(o, layer.wo, residual=h, **cfg)
            act = gemv(h, layer.w_gate_up, norm=layer.ln2, eps=eps, swiglu=True, **cfg)
            gemv(act, layer.w_down, residual=h, **cfg)
        if layers.stop == spec.num_layers:
            return rms_norm(h, self.norm, eps, pdl=pdl)
        return h

    def _skinny_for(self, rows: int) -> dict[str, SkinnyConfig]:
        """The products that take the skinny kernel at ``rows`` rows on the current partition."""
        return self.skinny.get((self.num_sms, rows), {}) if self.skinny else {}

    def _attention(self, i: int, layer: _Layer, xn: torch.Tensor, meta: AttnMeta, kv: PagedKvCache,
                   residual: torch.Tensor, sk: dict[str, SkinnyConfig]) -> torch.Tensor:
        """``residual`` += the attention block's output, the add in the o product's epilogue."""
        c = sk.get("qkv") if layer.bqkv is None else None
        qkv = skinny_linear(xn, layer.wqkv, config=c) if c else F.linear(xn, layer.wqkv, layer.bqkv)
        o = self._attend(i, layer, qkv, meta, kv)
        if c := sk.get("o"):
            return skinny_linear(o, layer.wo, residual=residual, config=c)
        return residual.addmm_(o, layer.wo.t())  # in place: out-of-place addmm copies the residual first

    def _attend(self, i: int, layer: _Layer, qkv: torch.Tensor, meta: AttnMeta, kv: PagedKvCache,
                pdl: bool = False, stored: bool = False) -> torch.Tensor:
        """RoPE, the k/v store and attention on the q/k/v projection ``[T, (H + 2 KVH) D]``: ``[T, H D]``.
        ``stored``: the projection already did RoPE and the store (the fused GEMV)."""
        spec = self.spec
        H, KVH, D = spec.heads_per_gpu, spec.kv_heads_per_gpu, spec.head_dim
        T = qkv.shape[0]
        k_cache, v_cache = kv.layer(i)
        if not stored:
            rope_and_store(qkv, meta.positions, self.cos_sin, k_cache, v_cache, meta.slot_mapping, H, KVH, D,
                           layer.q_norm, layer.k_norm, spec.rms_norm_eps, pdl=pdl)
        q = qkv[:, :H * D].view(T, H, D)
        k = qkv[:, H * D:(H + KVH) * D].view(T, KVH, D)
        v = qkv[:, (H + KVH) * D:].view(T, KVH, D)
        dcfg = {**launch_defaults(self.num_sms), **self.decode_config, **({"pdl": True} if pdl else {})}
        o = attention(q, k, v, meta, k_cache, v_cache, self.scale, dcfg, self.prefill_config)
        return o.reshape(T, H * D)

    def _mlp(self, layer: _Layer, xn: torch.Tensor, residual: torch.Tensor,
             sk: dict[str, SkinnyConfig]) -> torch.Tensor:
        c = sk.get("gate_up")
        act = skinny_linear(xn, layer.w_gate_up, swiglu=True, config=c) if c else silu_mul(F.linear(xn, layer.w_gate_up))
        if c := sk.get("down"):
            return skinny_linear(act, layer.w_down, residual=residual, config=c)
        return residual.addmm_(act, layer.w_down.t())

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor, pad: bool = False) -> torch.Tensor:
        """float32 ``[len(rows), vocab]`` from the final hidden state's ``rows``. One row goes through the
        GEMV path (fp32 straight out of the product) where ``gemv_config`` is set. ``pad`` (eager launches,
        whose row counts vary): several rows run at :func:`logits_rows` rows (the padding rows read hidden
        row 0 and are sliced off), so serving meets only the product shapes the warm-up ran: cuBLAS sets up
        each new shape's kernel once, and on the H200 that first call waited for the whole GPU to drain, 240 ms
        with the other lane busy (bench/RESULTS.md, twenty-third session). Graphs have fixed row counts and do
        not pad."""
        n = rows.numel()
        one = hidden.shape[0] == 1 and n == 1  # then rows is [0]: no gather
        if pad and not one and (m := logits_rows(n)) > n:
            rows = F.pad(rows, (0, m - n), value=0)
        x = hidden if one else hidden.index_select(0, rows)
        if self.gemv_config is not None and x.shape[0] == 1:
            return gemv(x, self.lm_head, out_dtype=torch.float32, **self.gemv_config)
        if c := self._skinny_for(x.shape[0]).get("lm_head"):
            return skinny_linear(x, self.lm_head, config=c)[:n].float()
        return F.linear(x, self.lm_head)[:n].float()


def logits_rows(n: int) -> int:
    """The rows the lm_head product of ``n`` sampled rows runs at: a power of two up to 128, then a multiple
    of 128 (at most 127 rows more than asked; the product reads the 1 GB weight either way at these sizes)."""
    return 1 << max(0, n - 1).bit_length() if n <= 128 else -(-n // 128) * 128


# --- reference: plain torch, no paging, no fusion (for tests) --------------------------------------------


def reference_forward(spec: ModelSpec, weights: dict[str, torch.Tensor], token_ids_per_seq: list[list[int]],
                      dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
                      ) -> list[torch.Tensor]:
    """Logits ``[len(ids), vocab]`` (float32) of every position of every sequence, full causal attention."""
    device = torch.device(device) if device is not None else next(iter(weights.values())).device
    W = {n: t.to(device=device, dtype=dtype) for n, t in weights.items()}
    H, KVH, D = spec.num_heads // spec.tp, spec.num_kv_heads // spec.tp, spec.head_dim
    eps = spec.rms_norm_eps
    inv = rope_inv_freq(spec)

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([-x2, x1], dim=-1)

    outs = []
    for ids in token_ids_per_seq:
        n = len(ids)
        ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None, :]
        ang = torch.cat([ang, ang], dim=-1)
        cos, sin = ang.cos().to(device, dtype)[:, None, :], ang.sin().to(device, dtype)[:, None, :]
        h = W["model.embed_tokens.weight"][torch.tensor(ids, device=device)]
        causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            x = norm(h, W[p + "input_layernorm.weight"])
            q = F.linear(x, W[a + "q_proj.weight"], W.get(a + "q_proj.bias")).view(n, H, D)
            k = F.linear(x, W[a + "k_proj.weight"], W.get(a + "k_proj.bias")).view(n, KVH, D)
            v = F.linear(x, W[a + "v_proj.weight"], W.get(a + "v_proj.bias")).view(n, KVH, D)
            if spec.qk_norm:
                q, k = norm(q, W[a + "q_norm.weight"]), norm(k, W[a + "k_norm.weight"])
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            k = k.repeat_interleave(H // KVH, dim=1)
            v = v.repeat_interleave(H // KVH, dim=1)
            s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
            s = s.masked_fill(~causal, float("-inf"))
            o = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v).reshape(n, H * D)
            h = h + F.linear(o, W[a + "o_proj.weight"])
            x = norm(h, W[p + "post_attention_layernorm.weight"])
            h = h + F.linear(F.silu(F.linear(x, W[p + "mlp.gate_proj.weight"])) * F.linear(x, W[p + "mlp.up_proj.weight"]),
                             W[p + "mlp.down_proj.weight"])
        h = norm(h, W["model.norm.weight"])
        head = W["model.embed_tokens.weight"] if spec.tie_embeddings else W["lm_head.weight"]
        outs.append(F.linear(h, head).float())
    return outs
