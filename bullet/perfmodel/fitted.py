"""A latency model fitted to a measured profile (``bullet fit``), loaded from JSON without scikit-learn.

A launch's time is a non-negative linear combination of physical terms, one coefficient set per kernel
family. A term is a *quantity* of the launch (bytes, FLOPs, wave-quantized FLOPs, rows, context tokens,
layers) times an *SM basis* function of the partition's SM count ``n``:

* ``k<K>``: ``N / min(n, K)`` for a knot ``K`` (``N`` = the GPU's SMs). A non-negative sum of these is
  continuous and non-increasing in ``n``: time that falls as ``1/n`` on small partitions (bandwidth and
  compute linear in SMs) and levels off past each knot (HBM saturated, the power cap binding).
* ``one``: 1 (the quantity already depends on ``n``, e.g. GEMM waves = ceil(tiles / n) x tile FLOPs, or
  does not scale with SMs: per-kernel overheads, the longest decode-attention program).
* ``r<F>_<K>_<H>``: a ramp on the partition sizes a profile measured (``F`` the smallest, ``H`` the one after
  ``K``; 0: none): ``F / n`` below ``F``, 1 from ``F`` to ``K``, falling linearly in ``1/n`` to 0 at ``H``;
  0 on the whole GPU. A non-negative sum of the ramps of every measured size is any non-increasing weight
  per measured size, interpolated linearly in ``1/n`` in between: fitted nearly freely at each size, yet
  monotone (more SMs never slower, which the bullet policy's bisections assume). The eager family uses
  them: its time's knee in ``n`` moves with the launch's size (a 256-token prefill is flat from 68 SMs up,
  an 8192-token one keeps falling), which no fixed ``k<K>`` sum follows.
* ``grid``: ``ceil(N / n)``, the rounds a grid of ``N`` blocks (one a SM, sized for the whole GPU) takes on
  ``n`` SMs: 2 from 66 to 131 SMs, 3 from 44 to 65, 1 on the whole GPU. A green context does not change the SM
  count a library reads off the device, so a kernel that sizes its grid by it (cuBLAS's split and persistent
  GEMMs at few row tiles) runs in whole rounds of ``n``: on the H200 profiles an eager launch's time falls
  faster than ``1/n`` from 52 to 68 SMs (a 400-token prefill: 25.7 -> 18.7 ms) and hardly at all from 68 to
  116 (17.4 ms), which ramps interpolated in ``1/n`` between 52 and 84 miss by +6 % at 68. The eager family
  takes ``gemm_flops`` on it (format version 6) and ``small_gemm_flops``, the FLOPs of the GEMMs with few output
  tiles (version 8: a big launch's GEMMs run in ordinary waves).
* ``full``: 1 on the whole GPU (an ordinary stream: cuBLAS and the graphs see all SMs), 0 on a green
  context; ``part``: the reverse. Small launches on any green context run ~1.5x longer than on the whole
  GPU (a 256-token prefill: 11.3-11.9 ms on 84-116 SMs, 7.7 ms on all 132), a step no ``k<K>`` sum can
  make: ``part`` terms carry it.

Families (what is fitted to what in ``points.csv``; ``bullet/perfmodel/fit.py``):

* ``decode_step``: one later step of a fused decode launch (CUDA graph replay), fitted to ``step_s``;
  The decode families' attention terms: ``kv`` (the KV bytes every program reads, over the SMs' bandwidth),
  ``longest`` (the longest program's tokens) and ``longest_extra`` (format version 10): the longest program's
  tokens beyond its even share of all programs' tokens over the partition's program slots, ``max(0, longest -
  kv_heads x KV tokens / (n x slots))``. The attention kernel's time is about the larger of the even share and
  the longest program (one 8,192-token row beside 255 of 512 tokens: the share on few SMs, the longest program on
  many), which a sum of the first two terms cannot follow: it missed such skewed batches by +14 % near the
  crossing and -8 % past it on the H200 Llama-3.1-8B profile (bench/RESULTS.md, "A decode step's longest
  attention program beyond its share");
* ``decode_first``: the first step of a decode launch (it also pays the graph inputs' preparation),
  fitted to ``first_s``; both decode families take, where the profile has one (``gemm.csv``), the measured time
  of one layer's GEMMs at the graph bucket's rows on ``n`` SMs (``gemm_table``, :class:`GemmTable`, stored in the
  model): the skinny kernel or cuBLAS is chosen per (partition, rows) cell, which no smooth term follows;
* ``eager``: the GPU time of an eager prefill or mixed launch, fitted to ``gpu_s`` where the launch was
  GPU-bound (``gpu_s`` clearly above ``host_s``);
* ``host``: the host time of an eager launch (``host_s``: Python, kernel launches, per-sequence attention
  calls);
* ``co_eager`` / ``co_decode``: the slowdown of an eager launch / a decode step while the other lane runs:
  ``t = t_alone * (1 + s)``, ``s`` a non-negative combination of the co-runner's HBM demand (its bytes over
  its own stand-alone time) and SM share, and of the slowed lane's own streaming (:data:`CO_EAGER_Q`,
  :data:`CO_DECODE_Q`).

How ``predict`` combines them:

* a decode launch (``tokens == seqs``): GPU time only (``decode_first``; ``decode_steps`` gives the first
  step then ``decode_step`` for the rest): graph launches return to the host long before the GPU is done,
  so host time never shows;
* an eager launch (prefill, mixed): ``max(host, gpu)``, because the CUDA events around it measure the GPU
  waiting for a host that enqueues more slowly than the GPU computes, and that is what the profile measured
  (a 256-token prefill on the whole GPU: 12.4 ms of host time, 12.3 ms between the events);
* a prefill or mixed launch that a prefill graph serves (``prefill_graphs``: the limits the profile ran
  with, up to ``max_tokens`` tokens and ``max_seqs`` chunks): GPU time only, like a decode launch (the
  executor uses such a graph where one was captured for the partition and layers; serving captures them at
  start-up for the partitions its policy uses), with the GEMM and elementwise terms at the token bucket's
  row count (``buckets``: the graph computes its padding rows too).
  ``FittedModel(..., host=False)`` leaves host time out (the GPU time alone: an executor that captured its
  prefill in graphs).

Co-running lanes that overlap (both on the whole GPU: naive concurrency) split the SMs they share in
proportion to sqrt(tokens) of each launch, the roofline's assumption (not measured by the profile).

Everything SM-dependent is a per-SM-count table built at load time (index = SM count), so the scalar path
(plain Python floats, the simulator's hot path) and the array path (numpy, ``num_sms`` an array) do the same
IEEE operations in the same order and give identical numbers.
"""

from __future__ import annotations

import json
import math
import re
from bisect import bisect_left
from dataclasses import fields
from itertools import accumulate, repeat
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ..config import ConfigError, GpuSpec, ModelSpec
from .base import Work, check_sms, new_work, shared_sms

FORMAT = "bullet-fitted-latency"
FORMAT_VERSION = 12  # 2: the ``r<first>_<knot>_<next>`` SM basis; 3: the victim's contention terms (CO_EAGER_Q,
# CO_DECODE_Q); 4: the measured GEMM table of the decode products (``gemm_table``); 5: the power terms of a prefill's
# slowdown (``own_flops_co_sm``, ``co_gemm_co_sm``); 6: the ``grid`` SM basis (``ceil(N / n)``); 7: a prefill's
# slowdown beside a tensor-core co-runner (``co_tc_co_sm``); 8: the FLOPs of the GEMMs with few output tiles
# (``small_gemm_flops``) and the co-runner's GEMM share up to half the GPU (``co_gemm_half``); 9: a co-run
# prefill's factor per prefill partition size (``co_split_factor``); 10: the decode families' ``longest_extra`` (the
# kernels' ``attn_slots_per_sm``); 11: the eager family's ``attn_extra`` (a single chunk's longest prefill-attention
# program beyond its even share; the kernels' ``prefill_block_m``, ``prefill_attn_slots_per_sm``); 12: the eager
# family's ``attn_tiles`` (attention FLOPs the tile kernel runs, not SDPA; the kernels' ``sdpa_from``); older files
# read unchanged
READS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12)

# Decode graphs pad a batch to the next bucket (bullet/gpu/graphs.py DEFAULT_BUCKETS) and size their
# attention split for GRAPH_CONTEXT tokens; the split rule is decode_attention.decode_splits'. They are
# stored in the JSON with the model, so a model stays tied to the executor it was measured on.
DEFAULT_KERNELS = {
    "graph_buckets": [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256],
    "graph_context": 16384,
    "attn_target_programs": 1024,
    "attn_max_splits": 32,
    "attn_block_n": 64,
    # decode-attention programs an SM runs at once, for ``longest_extra``'s even share: held-out decode MAPE on the
    # H200 Llama-3.1-8B profile over 10 random splits, first step / later steps, 3.04 / 2.49 % without the term,
    # with it at 1: 2.98 / 2.42, 2: 2.78 / 2.29, 4: 2.72 / 2.22, 8: 2.82 / 2.29 (bench/RESULTS.md). (Its shared
    # memory, three stages of a 64-token K and V tile, leaves room for two; the share is a fitted scale.)
    "attn_slots_per_sm": 4,
    # the prefill-attention kernel's rows a program (bullet/gpu/kernels/prefill_attention.py: BLOCK_Q new tokens x
    # the q heads of one KV head, padded to a power of two) and its programs an SM runs at once, for ``attn_extra``:
    # its shared memory (a 128-row Q tile and three stages of 64-token K and V tiles, 128-wide, bf16: ~130 KB) fits
    # one. Held-out MAPE over 10 random splits, prefill / mixed / co-run prefill / whole launches, Llama-3.1-8B on
    # the H200: without the term 2.73 / 3.09 / 2.70 / 2.48 %, slots 0.5: 2.82 / 3.01 / 2.70 / 2.50, 1: 2.54 / 2.74 /
    # 2.64 / 2.39, 2: 2.55 / 2.76 / 2.60 / 2.39, 4: 2.61 / 2.79 / 2.59 / 2.41; Qwen3-8B without 3.33 / 3.38 / 3.24 /
    # 3.09, 1: 3.19 / 3.55 / 3.19 / 3.05 (`bench/corun_residuals.py --seeds 10 --kernel prefill_attn_slots_per_sm=S`;
    # bench/RESULTS.md)
    "prefill_block_m": 128,
    "prefill_attn_slots_per_sm": 1,
    # a lone fresh prompt of at least this many tokens runs its attention in SDPA, every other multi-token launch in
    # the tile kernel over the KV pool (bullet/gpu/attention.py ``SDPA_FROM``; ``attn_tiles``)
    "sdpa_from": 2048,
    "tile_m": 128,
    "tile_n": 256,
}

FAMILIES = ("decode_step", "decode_first", "eager", "host", "co_eager", "co_decode")
EAGER_HOSTED = True  # default of FittedModel(host=...)
# decode_step_ends: stretches up to this many steps in plain floats (about 0.2 us a step against numpy's
# ~13 us a call; beyond it numpy is the cheaper)
FLOAT_STRETCH = 64

# quantities each family may use (computed by Quantities below)
DECODE_Q = ("weights", "weights_gemv", "kv", "longest", "longest_extra", "rows", "gemm_waves", "gemm_table", "layers", "launch")
# the layer products a decode step's GEMMs run (a profile's gemm.csv: their measured seconds by SM count and rows)
GEMM_PRODUCTS = ("qkv", "o", "gate_up", "down")
EAGER_Q = ("gemm_flops", "gemm_waves", "weights", "attn", "prefix_attn", "prefix_kv", "kv", "tokens", "seq_layers",
           "samples", "layers", "launch")
HOST_Q = ("layers", "seq_layers", "tokens", "prefix_tokens", "launch")
# what Quantities.eager computes, in its order (eager_tokens besides EAGER_Q: a later term)
EAGER_KEYS = ("gemm_flops", "gemm_waves", "weights", "attn", "prefix_attn", "prefix_kv", "kv", "tokens", "eager_tokens",
              "seq_layers", "samples", "layers", "launch", "small_gemm_flops", "attn_extra", "attn_tiles")
# ``attn_extra`` (format version 11): the prefill-attention kernel runs one program per (tile of new tokens, KV
# head), each over its tile's keys (the cached prefix and the causal part), so a short chunk after a long prefix is a
# few long programs: its time is about the longest program's once the programs' even share over the SMs' slots drops
# below it, and plain FLOPs / n keeps falling with SMs where the kernel does not. The term is the longest program's
# keys beyond that share, for a launch of one chunk (a mixed launch's decode rows run in another kernel, and a
# launch of several prompts orders its tiles longest first).
# ``attn_tiles`` (format version 12): the attention FLOPs (``attn``'s) of a launch whose attention runs in the tile kernel
# (bullet/gpu/kernels/prefill_attention.py: keys and values read from the paged pool), 0 for a lone fresh prompt of
# ``sdpa_from`` tokens or more, which runs in SDPA on its contiguous keys. One 8,192-token prompt beside 16 decode
# rows took 232.7 ms against 216.7 alone (Llama-3.1-8B on the whole H200; Qwen3-8B 240.5 against 212.8): the same
# FLOPs in the other kernel. Held out over ten random splits, prefill 2.59 -> 2.43 % (Llama-3.1-8B), 3.03 -> 2.96
# (Qwen3-8B); mixed 2.47 -> 2.46, 3.91 -> 3.83 (bench/RESULTS.md).
# ``small_gemm_flops`` (format version 8): the FLOPs of the layer GEMMs that have fewer output tiles (tile_m x tile_n)
# than SMALL_GEMM_TILES x the GPU's SMs. The ``grid`` rounds (``ceil(N / n)``) are a property of kernels whose grid
# is sized for the device, which cuBLAS launches for GEMMs with few tiles (split-K, stream-K); a GEMM of thousands
# of tiles runs in ordinary waves on any partition. On the H200 profile a 1,024-token prefill's SM-seconds rise
# 0.87 -> 0.96 -> 0.85 (of the whole GPU's) on 52, 60 and 68 SMs, an 8,192-token one's 0.72 -> 0.73 -> 0.74
# (bench/RESULTS.md, "Co-run prefill and the eager ramps").
SMALL_GEMM_TILES = 2
CO_Q = ("co_bw", "co_bw_share", "co_sm_share")
# The slowed lane's side of contention, measured on the H200's continuous co-run points (bench/RESULTS.md, eleventh
# session): a prefill that streams more bytes a second (a short, memory-bound prompt) loses more to the co-runner's
# HBM demand (``own_bw_co_bw``: its own stand-alone demand x the co-runner's), and a decode step loses more to the
# co-runner's SMs the more its own partition streams (``sm_bw_co_sm``: what a reference decode step, 64 rows at
# context 1024, pulls on that many SMs x the co-runner's SM share). `bullet fit profiles/h200/llama-3.1-8b`, each SM
# count held out: co-run prefill 6.5 -> 5.3 %, co-run decode 5.7 -> 4.5 % (docs/perfmodel.md).
# Version 5 adds two terms of a prefill's slowdown that read the co-runner's SMs as power drawn under the board's cap
# rather than HBM demand (bench/RESULTS.md, "Co-run prefill fit"): ``own_flops_co_sm``, the prefill's own stand-alone
# FLOP rate (PFLOP/s) x the co-runner's SM share, and ``co_gemm_co_sm``, the share of the decode co-runner's
# stand-alone step spent in its tensor-core GEMMs (the profile's measured GEMM table at its graph bucket and SMs;
# 0 for a one-row step, whose fused GEMV runs on the CUDA cores, and without a table) x its SM share. On the shipped
# Llama-3.1-8B H200 profile, with the fit weighted to relative error: co-run prefill held out, random 20 % / each
# SM count, 4.5 / 4.2 -> 2.7 / 3.3 % (40 random splits: 4.0 -> 3.4 %); co_bw's weight falls to ~0.
# Version 7: ``co_tc_co_sm``, 1 beside a decode co-runner of 2 rows or more (its GEMMs run on the tensor cores; a
# one-row step runs the fused GEMV on the CUDA cores) x its SM share: what ``co_gemm_co_sm`` tells without a GEMM
# table (the fit takes one or the other). The H200 Qwen3-8B profile (no gemm.csv; 2 of its 28 co-run prefills beside
# a one-row step, predicted 7-24 % slow): co-run prefill held out, interior 4.00 -> 3.46 %, random over 20 seeds
# 4.26 -> 3.21 % (bench/RESULTS.md, "Co-run prefill on the re-measured profile").
# Version 8: ``co_gemm_half``, the co-runner's GEMM share (as ``co_gemm_co_sm``) x its SMs up to half the GPU,
# min(co_sms, N/2) / N: a prefill's slowdown beside a decode step rises with the decode lane's SMs up to about 56 of
# the H200's 132 and is flat beyond (measured over each shape's twin, mean by decode SMs: 0.04 on 8, 0.18 on 32, 0.29
# on 48, 0.35-0.43 on 56-96, 0.30 on 104), as the decode lane's HBM stream saturates; a term linear in its SMs keeps
# rising (bench/RESULTS.md, "Co-run prefill and the eager ramps").
CO_EAGER_Q = CO_Q + ("own_bw_co_bw", "own_flops_co_sm", "co_gemm_co_sm", "co_tc_co_sm", "co_gemm_half")
CO_DECODE_Q = CO_Q + ("sm_bw_co_sm",)
# every contention quantity (FittedModel.co_features), in the order FittedModel._co_scalar builds them
CO_FEATURES = CO_Q + ("own_bw_co_bw", "sm_bw_co_sm", "own_flops_co_sm", "co_gemm_co_sm", "co_tc_co_sm", "co_gemm_half")
SM_BW_REF = (64, 1024)  # rows, context of the reference decode step of ``sm_bw_co_sm``


def tensor_cores(co: Work) -> float:
    """1 for a decode step of 2 rows or more, whose GEMMs run on the tensor cores (the skinny kernel or cuBLAS); 0
    for a one-row step (the fused GEMV, on the CUDA cores) or an eager launch (``co_tc_co_sm``)."""
    return 1.0 if co.tokens == co.seqs and co.seqs >= 2 else 0.0


class ModelMismatch(ConfigError):
    """A fitted model used for another GPU or model than it was fitted for."""


def spec_dict(spec: ModelSpec) -> dict:
    return {f.name: (getattr(spec, f.name) if f.name != "rope_scaling" else None) for f in fields(ModelSpec)
            if f.name in ("name", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                          "intermediate_size", "vocab_size", "dtype_bytes", "tp", "qkv_bias", "qk_norm")}


SHAPE_KEYS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
              "vocab_size", "dtype_bytes", "tp", "qkv_bias", "qk_norm")


class GemmTable(NamedTuple):
    """The measured seconds of one layer's decode GEMMs (:data:`GEMM_PRODUCTS`, each with the kernel the executor
    takes: the skinny kernel where its table chose it, else cuBLAS) by row count and SM count: a profile's
    ``gemm.csv``, summed over the products, stored in the model as ``gemm_table``. ``layer_s[i][j]``: ``rows[i]``
    rows on ``sms[j]`` SMs."""

    sms: tuple[int, ...]
    rows: tuple[int, ...]
    layer_s: tuple[tuple[float, ...], ...]

    @classmethod
    def of(cls, entry: dict | None) -> GemmTable | None:
        if not entry:
            return None
        if not isinstance(entry, dict):
            raise TypeError("gemm_table: not an object")
        sms, rows = tuple(int(x) for x in entry["sms"]), tuple(int(x) for x in entry["rows"])
        layer_s = tuple(tuple(float(x) for x in r) for r in entry["layer_s"])
        if list(sms) != sorted(set(sms)) or list(rows) != sorted(set(rows)) or not sms or len(rows) < 2 \
                or sms[0] < 1 or rows[0] < 2:
            raise ValueError("gemm_table: sms and rows must be ascending and distinct (rows >= 2, two at least)")
        if len(layer_s) != len(rows) or any(len(r) != len(sms) for r in layer_s) or \
                not all(0.0 < x < math.inf for r in layer_s for x in r):
            raise ValueError("gemm_table: layer_s must hold a positive time for every rows x sms")
        return cls(sms, rows, layer_s)

    def at_rows(self, rows: int) -> list[float]:
        """Seconds at ``rows`` rows on each of :attr:`sms`: measured where the table has the count, linear in the
        rows between two counts and past the largest (never below the largest's), non-increasing in SMs (the
        running minimum over the table's SM counts: a GEMM that the table measured slower on more SMs is taken
        at the fewer SMs' time, so that more SMs never predict a slower step, which the bullet policy's
        bisections assume)."""
        rs, ts = self.rows, self.layer_s
        if rows in rs:
            col = list(ts[rs.index(rows)])
        else:
            i = next((k for k, r in enumerate(rs) if r > rows), len(rs) - 1)
            i = max(i, 1)
            a = (rows - rs[i - 1]) / (rs[i] - rs[i - 1])
            col = [lo + a * (hi - lo) for lo, hi in zip(ts[i - 1], ts[i])]
            if rows > rs[-1]:
                col = [max(x, hi) for x, hi in zip(col, ts[-1])]
        out, low = [], math.inf
        for x in col:
            low = min(low, x)
            out.append(low)
        return out

    def column(self, rows: int, num_sms: int) -> list[float]:
        """Seconds at ``rows`` rows on every SM count 0..num_sms (index; 0 unused): :meth:`at_rows`, linear in
        1/n between the table's SM counts, as 1/n below the smallest (bandwidth linear in SMs) and flat above the
        largest."""
        sms, t = self.sms, self.at_rows(rows)
        out = [0.0] * (num_sms + 1)
        for n in range(1, num_sms + 1):
            if n <= sms[0]:
                out[n] = t[0] * sms[0] / n
            elif n >= sms[-1]:
                out[n] = t[-1]
            else:
                j = next(k for k, s in enumerate(sms) if s >= n)
                if sms[j] == n:
                    out[n] = t[j]
                else:
                    a = (1.0 / n - 1.0 / sms[j]) / (1.0 / sms[j - 1] - 1.0 / sms[j])
                    out[n] = a * t[j - 1] + (1.0 - a) * t[j]
        return out


class Quantities:
    """The physical quantities of a launch, from the model's shapes. Every method works on plain numbers
    and, where an argument is a numpy array (SM counts, or KV tokens over fused steps), element-wise with
    the very same operations."""

    def __init__(self, spec: ModelSpec, num_sms: int, kernels: dict, gemm: GemmTable | None = None) -> None:
        m, dt = spec, spec.dtype_bytes
        h, q, kv, f = m.hidden_size, m.q_size, m.kv_size, m.ffn_per_gpu
        self.N = num_sms
        self.k = kernels
        # layer GEMMs (n_out, k_in): QKV, O, gate-up, down
        self.gemms = ((q + 2 * kv, h), (h, q), (2 * f, h), (h, f))
        self.layer_weight_bytes = float(m.layer_params * dt)
        self.layer_flops_per_token = 2.0 * sum(a * b for a, b in self.gemms)
        self.kv_bytes = float(2 * kv * dt)  # K and V of one token, one layer
        self.attn_flops_per_pair = 4.0 * m.head_dim * m.heads_per_gpu
        self.kv_heads = m.kv_heads_per_gpu
        g = max(1, m.heads_per_gpu // max(1, m.kv_heads_per_gpu))  # q heads a KV head serves, padded to a power of 2
        self.group_pow2 = 1 << (g - 1).bit_length()
        tm, tn = kernels["tile_m"], kernels["tile_n"]
        self.tile_m = tm
        self.col_tiles = [float(-(-a // tn)) for a, _ in self.gemms]
        self.wave_flops = [2.0 * tm * tn * b for _, b in self.gemms]  # one tile, one SM
        self.gemm_flops_tok = [2.0 * a * b for a, b in self.gemms]  # FLOPs of each layer GEMM, a token
        self._small: dict[int, float] = {}  # row tiles -> FLOPs a token of the GEMMs with few tiles (small_gemm_flops)
        self.buckets = tuple(kernels["graph_buckets"])
        self.per_block = kernels["attn_block_n"]
        self.gemm = gemm
        self._gemm_cols: dict[int, tuple[list[float], np.ndarray]] = {}  # rows -> gemm.column, as list and array

    # ---------------------------------------------------------------- helpers
    def bucket(self, seqs: int) -> int:
        for b in self.buckets:
            if seqs <= b:
                return b
        return seqs

    def gemm_waves(self, rows: float, n) -> Any:
        """sum over the layer GEMMs of waves x tile FLOPs: ceil(row tiles x column tiles / n) x 2 tm tn K.
        (FLOPs one SM does, wave quantization included.)"""
        rt = float(-(-int(rows) // self.tile_m))
        out = 0.0
        if isinstance(n, np.ndarray):
            for ct, wf in zip(self.col_tiles, self.wave_flops):
                out = out + np.ceil(rt * ct / n) * wf
        else:
            for ct, wf in zip(self.col_tiles, self.wave_flops):
                out = out + math.ceil(rt * ct / n) * wf
        return out

    def small_gemm_flops(self, rows: int) -> float:
        """FLOPs a token of one layer's GEMMs that have fewer than ``SMALL_GEMM_TILES x N`` output tiles at ``rows``
        rows (``small_gemm_flops``: the GEMMs a library runs on a grid sized for the device)."""
        rt = -(-int(rows) // self.tile_m)
        out = self._small.get(rt)
        if out is None:
            lim = SMALL_GEMM_TILES * self.N
            out = self._small[rt] = sum(f for f, ct in zip(self.gemm_flops_tok, self.col_tiles) if rt * ct < lim)
        return out

    def gemm_layer(self, rows: int, n) -> Any:
        """Measured seconds of one layer's decode GEMMs at ``rows`` rows on ``n`` SMs (:class:`GemmTable`); 0
        without a table."""
        if self.gemm is None:
            return 0.0 * n
        col = self._gemm_cols.get(rows)
        if col is None:
            if len(self._gemm_cols) >= 1024:
                self._gemm_cols.clear()
            c = self.gemm.column(rows, self.N)
            col = self._gemm_cols[rows] = (c, np.asarray(c))
        return col[1][n] if isinstance(n, np.ndarray) else col[0][n]

    def graph_splits(self, seqs: int) -> float:
        """Attention slices per (sequence, KV head) of a decode graph of ``seqs`` rows (its bucket)."""
        return float(self.splits(self.bucket(seqs), self.k["graph_context"]))

    def splits(self, seqs: int, max_context: int) -> int:
        k = self.k
        want = -(-k["attn_target_programs"] // max(1, seqs * self.kv_heads))
        return max(1, min(want, k["attn_max_splits"], -(-max(1, max_context) // k["attn_block_n"])))

    # ---------------------------------------------------------------- per family
    def decode(self, w: Work, n, kv=None, max_kv=None) -> dict:
        """One decode step of ``w`` (``kv``/``max_kv`` override its KV tokens: arrays over fused steps)."""
        out = self.decode_static(w, n)
        out["kv"], out["longest"], out["longest_extra"] = self.decode_var(w, n, kv, max_kv)
        return out

    def decode_static(self, w: Work, n) -> dict:
        """The quantities of a decode step that do not change from step to step."""
        L = float(w.num_layers)
        b = self.bucket(w.seqs)
        gemv = w.seqs == 1
        return {
            "weights": 0.0 if gemv else L * self.layer_weight_bytes * 1e-9,
            "weights_gemv": L * self.layer_weight_bytes * 1e-9 if gemv else 0.0,
            "rows": L * b * 1e-3,
            "gemm_waves": 0.0 if gemv else L * self.gemm_waves(b, n) * 1e-12,
            "gemm_table": 0.0 if gemv else L * self.gemm_layer(b, n),
            "layers": L * 1e-3,
            "launch": 1e-3,
        }

    def decode_var(self, w: Work, n, kv=None, max_kv=None, splits: float | None = None) -> tuple:
        """(``kv``, ``longest``, ``longest_extra``) of a decode step on ``n`` SMs: KV bytes read, the tokens of
        the longest attention program, ceil(ceil(max_kv / splits) / block_n) * block_n (the graph's split for its
        capacity), and those beyond the programs' even share (:meth:`share`)."""
        L = float(w.num_layers)
        kv = float(w.kv_read) if kv is None else kv
        mk = float(w.max_kv or (w.kv_read / max(1, w.seqs))) if max_kv is None else max_kv
        per_block = self.k["attn_block_n"]
        s = self.graph_splits(w.seqs) if splits is None else splits
        g = self.share(n)
        if isinstance(mk, np.ndarray) or isinstance(kv, np.ndarray) or isinstance(g, np.ndarray):
            longest = np.ceil(np.ceil(mk / s) / per_block) * per_block
            extra = np.maximum(0.0, longest - kv * g)
        else:
            longest = float(math.ceil(math.ceil(mk / s) / per_block) * per_block)
            extra = max(longest - kv * g, 0.0)
        return L * kv * self.kv_bytes * 1e-9, L * longest * 1e-3, L * extra * 1e-3

    def share(self, n):
        """A KV token's share of one program slot on ``n`` SMs: ``kv_heads / (n x attn_slots_per_sm)`` (every
        KV head of a row reads its tokens in programs of its own)."""
        return self.kv_heads / (n * float(self.k["attn_slots_per_sm"]))

    @staticmethod
    def prefix(w: Work) -> float:
        """Cached-prefix tokens of the longest chunk: max_kv - tokens (exact for one prompt; a mixed launch's
        one-token decode rows, whose KV the paged decode kernel reads, count only through ``kv``)."""
        _, tokens, seqs, _, kv, _, _, mk = w
        mk = mk or kv // max(1, seqs)
        p = (mk if mk < kv else kv) - tokens  # noqa: FURB136 -- min(kv, mk), max(0, p): the builtins parse arguments
        return float(p) if p > 0 else 0.0

    def eager(self, w: Work, n, graphed: bool = False) -> dict:
        """An eager or graphed prefill/mixed launch; ``eager_tokens`` are the tokens of one no prefill graph
        serves (eager launches run each kernel slower than a graph replay of the same kernels)."""
        return dict(zip(EAGER_KEYS, self.eager_values(w, n, graphed)))

    def eager_values(self, w: Work, n, graphed: bool = False) -> tuple:
        """:meth:`eager`'s quantities in ``EAGER_KEYS`` order."""
        L, t = float(w.num_layers), float(w.tokens)
        p = self.prefix(w)
        return (L * t * self.layer_flops_per_token * 1e-12 / self.N, L * self.gemm_waves(t, n) * 1e-12,
                L * self.layer_weight_bytes * 1e-9, L * w.attn_pairs * self.attn_flops_per_pair * 1e-12 / self.N,
                L * t * p * self.attn_flops_per_pair * 1e-12 / self.N, L * p * self.kv_bytes * 1e-9,
                L * w.kv_read * self.kv_bytes * 1e-9, L * t * 1e-6, 0.0 if graphed else L * t * 1e-6,
                L * w.seqs * 1e-3, w.samples * 1e-3, L * 1e-3, 1e-3,
                L * t * self.small_gemm_flops(w.tokens) * 1e-12 / self.N,
                0.0 if w.seqs != 1 else L * self.attn_extra(w, n) * 1e-3,
                L * w.attn_pairs * self.attn_flops_per_pair * 1e-12 / self.N if self.tiled(w) else 0.0)

    def tiled(self, w: Work) -> bool:
        """The launch's attention runs in the tile kernel: anything but one fresh prompt (no cached prefix) of
        ``sdpa_from`` tokens or more, which ``attention`` hands to SDPA."""
        return w.seqs != 1 or w.kv_read != w.tokens or w.tokens < self.k.get("sdpa_from", 2048)

    def attn_extra(self, w: Work, n) -> Any:
        """Keys of a one-chunk launch's longest prefill-attention program (its whole context, ``max_kv``) beyond the
        programs' even share over ``n x prefill_attn_slots_per_sm`` slots: ``kv_heads x pairs / block_q`` keys in
        all, ``block_q`` new tokens a program; 0 for a launch of several chunks or of one token."""
        if w.seqs != 1 or w.tokens < 2:
            return 0.0 * n
        k = self.k
        bq = max(1, k.get("prefill_block_m", 128) // self.group_pow2)
        total = self.kv_heads * w.attn_pairs / bq
        share = total / (n * float(k.get("prefill_attn_slots_per_sm", 1)))
        longest = float(w.max_kv or w.kv_read)
        if isinstance(share, np.ndarray):
            return np.maximum(0.0, longest - share)
        return longest - share if longest > share else 0.0

    def host(self, w: Work) -> dict:
        return dict(zip(HOST_Q, self.host_values(w)))

    def host_values(self, w: Work) -> tuple:
        """:meth:`host`'s quantities in ``HOST_Q`` order."""
        L = float(w.num_layers)
        return L * 1e-3, L * w.seqs * 1e-3, w.tokens * 1e-6, self.prefix(w) * 1e-6, 1e-3

    def flops_of(self, w: Work) -> float:
        """FLOPs of a launch's layer GEMMs and attention (unpadded rows; the LM head left out)."""
        return float(w.num_layers) * (w.tokens * self.layer_flops_per_token + w.attn_pairs * self.attn_flops_per_pair)

    def bytes_of(self, w: Work) -> float:
        """HBM bytes a launch moves: weights once, KV read, activations (for the co-runner's demand)."""
        L = float(w.num_layers)
        return L * (self.layer_weight_bytes + w.kv_read * self.kv_bytes + w.tokens * 8.0 * self.kv_bytes)


def basis_table(name: str, num_sms: int) -> np.ndarray:
    """Values of an SM basis function for SM counts 0..num_sms (index 0 unused, finite)."""
    n = np.arange(num_sms + 1, dtype=np.float64)
    n[0] = 1.0
    if name == "one":
        return np.ones(num_sms + 1)
    if name == "full":
        out = np.zeros(num_sms + 1)
        out[num_sms] = 1.0
        return out
    if name == "grid":  # rounds of a grid of num_sms blocks on n SMs (index 0: num_sms, finite)
        return np.ceil(num_sms / n)
    if name == "part":  # a green-context partition (any SM count below the whole GPU)
        out = np.ones(num_sms + 1)
        out[num_sms] = 0.0
        return out
    if name.startswith("k") and name[1:].isdigit():
        return num_sms / np.minimum(n, float(int(name[1:])))
    m = _RAMP.fullmatch(name)
    if m:
        first, k, hi = (int(x) for x in m.groups())
        if not (0 < first <= k < num_sms and (hi == 0 or k < hi < num_sms)):
            raise ValueError(f"SM basis {name!r}: knots must rise and stay below the GPU's {num_sms} SMs")
        return _ramp(n, first, k, hi, num_sms)
    raise ValueError(f"unknown SM basis {name!r} (one, full, part, grid, k<knot> or "
                     f"r<first>_<knot>_<next>)")


_RAMP = re.compile(r"r(\d+)_(\d+)_(\d+)")


def _ramp(n: np.ndarray, first: int, k: int, hi: int, num_sms: int) -> np.ndarray:
    """``first / n`` below ``first`` (time linear in 1/n on partitions smaller than any measured), 1 from
    ``first`` to ``k``, falling linearly in 1/n to 0 at the next measured size ``hi`` and 0 beyond it; 0 on the
    whole GPU. ``hi == 0`` (``k`` is the largest size measured): 1 up to the whole GPU, flat, because holding
    out the largest measured size and extrapolating to it as 1/n instead raised the eager family's
    leave-one-SM-count-out error from 3.3 to 4.4 % (Llama-3.1-8B H200 profile, unconstrained weights)."""
    out = np.where(n < first, first / n, 1.0)
    if hi:
        x = 1.0 / n
        out = np.where(n > k, np.clip((x - 1.0 / hi) / (1.0 / k - 1.0 / hi), 0.0, 1.0), out)
    out[num_sms] = 0.0
    return out


VARYING = ("kv", "longest", "longest_extra")  # the decode quantities that change from one fused step to the next


class Linear:
    """One family: ``sum_i coef_i * quantity_i * basis_i(n)``, folded at load into one per-SM-count weight
    table per quantity (``table[q][n] = sum of coef * basis(n) over q's terms``). Quantities are summed in
    a fixed order, those in VARYING last, so a decode step is ``const + kv * w_kv + longest * w_longest +
    longest_extra * w_extra`` with ``const`` memoisable; every path does the same operations in the same order (a
    zero ``longest_extra`` is not added: ``x + 0.0`` is ``x``)."""

    def __init__(self, terms: list[tuple[str, str]], coef: list[float], num_sms: int) -> None:
        if len(terms) != len(coef):
            raise ValueError(f"{len(terms)} terms but {len(coef)} coefficients")
        self.terms, self.coef = [tuple(t) for t in terms], [float(c) for c in coef]
        tables: dict[str, np.ndarray] = {}
        for (q, b), c in zip(self.terms, self.coef):
            if c:
                tables[q] = tables.get(q, np.zeros(num_sms + 1)) + c * basis_table(b, num_sms)
        order = [q for q in tables if q not in VARYING] + [q for q in VARYING if q in tables]
        self.quantities = tuple(order)
        self.arrays = [tables[q] for q in order]
        self.lists = [a.tolist() for a in self.arrays]
        self.static = [(q, t) for q, t in zip(order, self.lists) if q not in VARYING]
        zero = [0.0] * (num_sms + 1)
        self.w_kv = tables["kv"].tolist() if "kv" in tables else zero
        self.w_longest = tables["longest"].tolist() if "longest" in tables else zero
        self.w_extra = tables["longest_extra"].tolist() if "longest_extra" in tables else zero

    def scalar(self, qv: dict, n: int) -> float:
        out = 0.0
        for q, tab in zip(self.quantities, self.lists):
            out += qv[q] * tab[n]
        return out

    def array(self, qv: dict, n: np.ndarray) -> np.ndarray:
        out = np.zeros(n.shape if isinstance(n, np.ndarray) else ())
        for q, tab in zip(self.quantities, self.arrays):
            out = out + qv[q] * tab[n]
        return out

    def parts(self, qv: dict, n: int) -> tuple[float, float, float, float]:
        """(sum of the non-varying terms, weight of kv, of longest, of longest_extra) on ``n`` SMs."""
        out = 0.0
        for q, tab in self.static:
            out += qv[q] * tab[n]
        return out, self.w_kv[n], self.w_longest[n], self.w_extra[n]


class GraphLimits(NamedTuple):
    """The prefill graphs a profile ran with (its metadata's ``prefill_graphs``): launches of up to
    ``max_tokens`` tokens and ``max_seqs`` chunks replay one, computing every row of their token bucket."""

    max_tokens: int
    max_seqs: int
    buckets: tuple[int, ...]

    @classmethod
    def of(cls, g: dict | None) -> GraphLimits | None:
        if not g:
            return None
        return cls(int(g["max_tokens"]), int(g["max_seqs"]), tuple(sorted(int(b) for b in g.get("buckets", ()))))

    def serves(self, work: Work) -> bool:
        """A prefill or mixed launch within the limits (decode launches have their own graphs)."""
        return work.tokens != work.seqs and work.tokens <= self.max_tokens and work.seqs <= self.max_seqs

    def padded(self, work: Work) -> Work:
        """The Work a served launch really computes: its bucket's rows through the GEMMs and elementwise
        kernels (attention only over the real ones)."""
        if not self.buckets or not self.serves(work):
            return work
        buckets = self.buckets  # (sorted: the first at or above its tokens; _replace's cost without it)
        return new_work(Work, (work[0], buckets[bisect_left(buckets, work.tokens)], *work[2:]))


def host_gap_of(entry: dict | None, field: str = "host_gap") -> tuple[float, float] | None:
    """(seconds, seconds per request) of a model's ``host_gap`` entry (``bullet fit`` from ``gaps.csv``) or
    ``serving_gap`` entry (``bullet validate --save-scaled``, from serving's launches): the engine's host time
    between a launch's end and the next launch's start; None where the model has none."""
    if entry is None:
        return None
    if not isinstance(entry, dict):
        raise TypeError(f"{field}: not an object")
    a, b = entry.get("fixed_s"), entry.get("per_request_s")
    if not all(isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < 1 for v in (a, b)):
        raise ValueError(f"{field}: fixed_s {a!r} and per_request_s {b!r} must be seconds in [0, 1)")
    return float(a), float(b)


def scale_of(scale: dict | None) -> tuple[float, float]:
    """A model file's optional ``scale`` object, ``{"prefill": a, "decode": b, ...}`` (``bullet validate
    --save-scaled`` writes it: the launch speed of the card it ran on), as ``(a, b)``; (1, 1) without one."""
    if scale is None:
        return 1.0, 1.0
    if not isinstance(scale, dict):
        raise TypeError("scale: not an object")
    out = []
    for key in ("prefill", "decode"):
        v = scale.get(key)
        if isinstance(v, bool) or not isinstance(v, int | float) or not (0 < v < math.inf):
            raise ValueError(f"scale.{key}: must be a positive number, got {v!r}")
        out.append(float(v))
    return out[0], out[1]


class FittedModel:
    """The fitted latency model: ``FittedModel.load(path, model=spec, gpu=gpu)``, or from the dict that
    ``bullet fit`` wrote. Implements :class:`~bullet.perfmodel.base.LatencyModel`; ``host=False`` leaves the
    host time of eager launches out (see the module docstring)."""

    # slots: its 30 attributes are read on every prediction (a dict-backed instance's read is a keyed lookup)
    __slots__ = ("_co_last", "_co_terms", "_dsetup", "_eager", "_eager_terms", "_gemm_fams", "_gemm_s", "_host",
                 "_host_terms", "_own", "_own_fl", "_own_last", "_parts", "_raw", "_setup_by_sms", "_share", "_slow",
                 "_sm_bw_table", "_sm_only", "_split", "_split_arr", "data", "f", "gpu_name", "graphs", "host",
                 "host_gap", "kernels", "num_sms", "profile_gap", "q", "scale", "serving_gap", "source", "spec")

    def __init__(self, data: dict, host: bool = EAGER_HOSTED, source: str = "<dict>") -> None:
        self.data, self.source, self.host = data, source, host
        try:
            if data.get("format") != FORMAT:
                raise ValueError(f"not a {FORMAT} file (format={data.get('format')!r})")
            if data.get("version") not in READS:
                raise ValueError(f"version {data.get('version')!r}, this bullet reads versions "
                                 f"{', '.join(map(str, READS))}: refit it with this bullet (bullet fit PROFILE_DIR)")
            ms = data["model_spec"]
            self.spec = ModelSpec(**{k: ms[k] for k in ("name", *SHAPE_KEYS)})
            self.gpu_name = str(data["gpu"]["name"])
            self.num_sms = N = int(data["gpu"]["num_sms"])
            self.kernels = {**DEFAULT_KERNELS, **data.get("kernels", {})}
            self.q = Quantities(self.spec, N, self.kernels, GemmTable.of(data.get("gemm_table")))
            fam = data["families"]
            self.f = {name: Linear(fam[name]["terms"], fam[name]["coef"], N) for name in FAMILIES}
            self.graphs = GraphLimits.of(data.get("prefill_graphs"))
            # the engine's host time between launches: serving's (measured by bullet validate) where the file
            # has it, else the profile's (bullet fit, gaps.csv)
            self.profile_gap = host_gap_of(data.get("host_gap"))
            self.serving_gap = host_gap_of(data.get("serving_gap"), "serving_gap")
            self.host_gap = self.serving_gap or self.profile_gap
            self.scale = scale_of(data.get("scale"))
            # a co-run prefill's time on each prefill size measured, over what the smooth slowdown terms give
            # (version 9: the slowdown zigzags with the split, bench/RESULTS.md, twenty-eighth session); 1 elsewhere
            self._split = {int(k): float(v) for k, v in data.get("co_split_factor", {}).items()}
            if any(not (0 < k <= N and 0.0 < v < 10.0) for k, v in self._split.items()):
                raise ValueError(f"co_split_factor: {data['co_split_factor']} has a size or factor out of range")
            self._split_arr = np.ones(N + 1)
            for k, v in self._split.items():
                self._split_arr[k] = v
            for names, k in (("eager",), self.scale[0]), (("decode_first", "decode_step"), self.scale[1]):
                for name in names:  # a card's speed: the GPU-time families times its factor (host time as is)
                    if k != 1.0:
                        self.f[name] = Linear(self.f[name].terms, [c * k for c in self.f[name].coef], N)
        except (KeyError, TypeError, ValueError) as e:
            what = f"missing field {e}" if isinstance(e, KeyError) else str(e)
            raise ConfigError(f"{source}: not a valid fitted latency model: {what}") from None
        self._co_last: tuple | None = None  # _co_of's last (co-runner, its SMs, (HBM demand TB/s, GEMM share))
        self._gemm_s: dict[tuple, float] = {}  # _gemm_seconds by what it reads: (layers, tokens, rows, SMs)
        self._parts: dict[tuple, tuple[float, float, float]] = {}
        self._eager: dict[tuple, float] = {}  # (work, SMs) -> stand-alone GPU seconds of an eager launch
        self._slow: dict[tuple, float] = {}  # (family, SMs, co-runner, its SMs, own) -> slowdown (scalar path)
        self._sm_bw_table: list[float] | None = None
        used = {q for (q, _), c in zip(self.f["co_eager"].terms, self.f["co_eager"].coef) if c}
        self._own = "own_bw_co_bw" in used  # (older models: no such term, no division to make)
        self._own_fl = "own_flops_co_sm" in used  # (version 5)
        # families whose fitted terms read only the SM counts, not the co-runner's HBM demand (the shipped H200
        # fit's co_decode: its co_bw terms fitted to 0): their slowdown is memoised by SM counts alone, and the
        # co-runner's stand-alone time (a latency prediction of its own) is never computed for them
        self._sm_only = {name for name in ("co_decode", "co_eager")
                         if not set(self.f[name].quantities) & {"co_bw", "co_bw_share", "own_bw_co_bw",
                                                                 "own_flops_co_sm", "co_gemm_co_sm", "co_tc_co_sm",
                                                                 "co_gemm_half"}}
        # co_decode reads SM counts alone: a decode stretch's setup (_decode_setup) then depends on its co-runner
        # only through their SM split (_setup_co), not on the co-runner itself
        self._setup_by_sms = "co_decode" in self._sm_only
        # the co families' terms as (index in CO_FEATURES, weight): Linear.scalar's sum without a dict of features
        self._co_terms = {name: tuple((CO_FEATURES.index(q), tab[0]) for q, tab in zip(lin.quantities, lin.lists))
                          for name, lin in ((n, self.f[n]) for n in ("co_decode", "co_eager"))
                          if set(lin.quantities) <= set(CO_FEATURES)}
        self._gemm_fams = {name for name in ("co_decode", "co_eager")
                           if {"co_gemm_co_sm", "co_gemm_half"} & set(self.f[name].quantities)}
        # the eager family's terms on each SM count as (index in EAGER_KEYS, weight), in the family's order:
        # Linear.scalar's sum without a dict of quantities (an eager launch new to the model: ~10 % of bullet's
        # simulation)
        eager = self.f["eager"]
        self._eager_terms = ([[(EAGER_KEYS.index(q), tab[n]) for q, tab in zip(eager.quantities, eager.lists)]
                              for n in range(self.num_sms + 1)] if set(eager.quantities) <= set(EAGER_KEYS) else None)
        self._host: dict[Work, float] = {}  # host seconds of an eager launch
        host = self.f["host"]  # its terms as (index in HOST_Q, weight), in the family's order (as _eager_terms)
        self._host_terms = ([(HOST_Q.index(q), tab[0]) for q, tab in zip(host.quantities, host.lists)]
                            if set(host.quantities) <= set(HOST_Q) else None)
        self._own_last: tuple[Work, float, float, float] | None = None  # eager_next_to's last (work, alone, own terms)
        self._raw: tuple[Work, int, list[float]] | None = None  # decode_step_ends' last stretch, unscaled
        self._dsetup: dict[tuple, tuple] = {}  # decode_step_ends' per-(layers, batch, SMs, co-runner) setup
        self._share: dict[tuple, tuple[int, int]] = {}  # shared_sms by (SMs, co-runner's SMs, their tokens)

    # ---------------------------------------------------------------- loading
    @classmethod
    def load(cls, path: str | Path, model: ModelSpec | None = None, gpu: GpuSpec | None = None,
             host: bool = EAGER_HOSTED) -> FittedModel:
        """Read a model JSON; with ``model``/``gpu`` given, refuse one fitted for another model or GPU."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except OSError as e:
            raise ConfigError(f"{path}: cannot read the fitted model: {e.strerror or e}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: line {e.lineno}: not JSON: {e.msg}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: not a valid fitted latency model: the top level is not an object")
        out = cls(data, host, str(path))
        out.check(model, gpu)
        return out

    def check(self, model: ModelSpec | None, gpu: GpuSpec | None) -> None:
        """Raise ModelMismatch naming both sides when this model was fitted for another model or GPU."""
        if gpu is not None and (gpu.name.lower() != self.gpu_name.lower() or gpu.num_sms != self.num_sms):
            raise ModelMismatch(f"{self.source}: fitted for GPU {self.gpu_name} ({self.num_sms} SMs), "
                                f"not for {gpu.name} ({gpu.num_sms} SMs)")
        if model is not None:
            mine = {k: getattr(self.spec, k) for k in SHAPE_KEYS}
            theirs = {k: getattr(model, k) for k in SHAPE_KEYS}
            if mine != theirs:
                diff = ", ".join(f"{k} {mine[k]} vs {theirs[k]}" for k in SHAPE_KEYS if mine[k] != theirs[k])
                raise ModelMismatch(f"{self.source}: fitted for model {self.spec.name}, not for {model.name} "
                                    f"(shapes differ: {diff})")

    @property
    def name(self) -> str:
        card = "" if self.scale == (1.0, 1.0) else f" x{self.scale[0]:.3f}/{self.scale[1]:.3f}"
        return f"fitted {self.spec.name}@{self.gpu_name}{card}"

    def scaled(self, prefill: float, decode: float, **note) -> FittedModel:
        """This model with its GPU time multiplied by ``prefill`` for launches with prompt rows and by
        ``decode`` for decode-only launches (on top of any scale it has): a model of a card that runs the
        launches that much slower (> 1) or faster. ``note`` goes into the file's ``scale`` object (where and
        how the factors were measured)."""
        a, b = self.scale
        data = {**self.data, "scale": {**note, "prefill": a * prefill, "decode": b * decode}}
        return FittedModel(data, self.host, self.source)

    # ---------------------------------------------------------------- the LatencyModel protocol
    def predict(self, work: Work, num_sms, co: Work | None = None, co_sms=0):
        """Seconds for ``work`` on ``num_sms`` SMs (int, or an array -> array) while ``co`` runs on
        ``co_sms`` other SMs (None / 0: alone)."""
        if work.tokens < 1:
            raise ValueError(f"a launch needs at least one token, got {work!r}")
        if type(num_sms) is int and 0 < num_sms <= self.num_sms:  # the simulator's case, checked at once
            n, arr = num_sms, False
        else:
            n, arr = check_sms(num_sms, self.num_sms)
        if co is not None and not arr and co_sms and (type(co_sms) is not int or co_sms < 0
                                                      or n + co_sms > self.num_sms):  # (disjoint: kept as given)
            n, co_sms = self._shared_sms(n, int(co_sms), work, co)
        if work.tokens == work.seqs:  # a decode launch: graph replays, GPU time
            if arr:
                t = self.f["decode_first"].array(self.q.decode(work, n), n)
            else:
                t = self._decode_step("decode_first", work, n)
            if co is not None and (np.any(co_sms) if arr else co_sms):
                t = t * (1.0 + self._slowdown("co_decode", n, co, co_sms, arr))
            return t
        if arr:
            t = self.f["eager"].array(self.q.eager(self.padded(work), n, self.graphed(work)), n)
        else:
            t = self._eager_alone(work, n)
        if co is not None and (np.any(co_sms) if arr else co_sms):
            t = self.eager_next_to(work, t, n, co, co_sms, arr)
        if self.host:
            h = self.host_time(work)
            t = np.maximum(t, h) if arr else (h if h > t else t)  # noqa: FURB136 -- max() parses its arguments
        return t

    def decode_steps(self, work: Work, steps: int, num_sms, co: Work | None = None, co_sms=0) -> np.ndarray:
        """Seconds of each of ``steps`` fused decode steps: the first (``decode_first``), then the later ones
        (``decode_step``) with every sequence one token longer each step."""
        n, arr = check_sms(num_sms, self.num_sms)
        if arr:
            raise ValueError("decode_steps takes one SM count")
        if work.tokens < 1:
            raise ValueError(f"a launch needs at least one token, got {work!r}")
        if co is not None and co_sms:
            n, co_sms = self._shared_sms(n, int(co_sms), work, co)
        out = np.empty(steps)
        if steps < 1:
            return out
        out[0] = self._decode_step("decode_first", work, n)
        if steps > 1:
            i = np.arange(1, steps, dtype=np.float64)
            mk = float(work.max_kv or (work.kv_read / max(1, work.seqs)))
            const, w_kv, w_longest, w_extra, splits, g = self._decode_parts("decode_step", work, n)
            kv, longest, _ = self.q.decode_var(work, n, work.kv_read + i * work.seqs, mk + i, splits)
            out[1:] = const + kv * w_kv + longest * w_longest
            if w_extra:  # longest_extra's term, as e0 - i * d (decode_step_ends' form: two operations a step)
                a = float(work.num_layers) * 1e-3 * w_extra
                ga = g * a
                lt = np.ceil(np.ceil((mk + i) / splits) / self.q.per_block) * self.q.per_block
                out[1:] += np.maximum(lt * a - work.kv_read * ga - i * (work.seqs * ga), 0.0)
        if co is not None and co_sms:
            out *= 1.0 + self._slowdown("co_decode", n, co, co_sms, False)
        return out

    def decode_step_ends(self, work: Work, steps: int, num_sms, co: Work | None = None,
                         co_sms=0) -> tuple[list[float] | np.ndarray, list[float] | np.ndarray]:
        """``(decode_steps(...), np.cumsum of it)``, the same numbers. A short stretch (up to
        ``FLOAT_STRETCH`` steps: most fused launches) is computed in plain floats, element by element as
        :meth:`decode_steps` does it and summed in order as ``cumsum`` does (numpy's per-call cost is the
        larger there); both come as lists then, and stay lists through the policy's sizing, the simulator's
        timing and the launch's result (``StepResult.step_ends``)."""
        if steps > FLOAT_STRETCH or steps < 1 or type(num_sms) is not int:
            times = self.decode_steps(work, steps, num_sms, co, co_sms)
            return times, times.cumsum()
        L, tokens, seqs, _, kv0, _, _, max_kv = work
        of_co = co if co is None or not self._setup_by_sms else self._setup_co(work, co, num_sms, co_sms)
        key = (L, tokens, seqs, num_sms, of_co, co_sms, type(co_sms))
        setup = self._dsetup.get(key)
        if setup is None:
            setup = self._decode_setup(work, num_sms, co, co_sms, key)
        c1, wk1, wl1, wx1, s1, g, c, w_kv, w_longest, w_x, splits, _, f, n, unit = setup
        raw = self._raw
        kvb, per_block = self.q.kv_bytes, self.q.per_block
        L = float(L)
        mk = float(max_kv or (kv0 / max(1, seqs)))
        if raw is not None and raw[1] == n and raw[0] == work:
            # the same stretch as last asked, on the same SMs, next to another co-runner (or none): the
            # co-runner scales every step by one factor, so the unscaled steps are those computed then; asked
            # for more steps (a policy's growing guess), the stretch goes on from where it stopped
            times = raw[2]
            if len(times) >= steps:
                times = times[:steps] if f is None else [x * f for x in times[:steps]]
                return times, list(accumulate(times))
            i = len(times)
        else:
            # the first step: decode_var's operations (kv read as a float), then _decode_step's sum
            lt = float(math.ceil(math.ceil(mk / s1) / per_block) * per_block)
            t = c1 + L * float(kv0) * kvb * 1e-9 * wk1 + L * lt * 1e-3 * wl1
            if wx1 and (e := lt - float(kv0) * g) > 0.0:
                t += L * e * 1e-3 * wx1
            times, i = [t], 1
        # the later steps: the longest program's blocks, ceil(ceil((mk + i) / splits) / block_n), are a
        # non-decreasing step function of i (each operation is monotone), so each run of equal blocks is
        # found by bisection on that very expression and its term is one number across the run
        fs = float(seqs)  # i * 1.0 * seqs == i * fs: one rounding of the same exact operands
        # Step k's KV term is L * (kv0 + k * fs) * kvb * 1e-9 * w_kv; its first three operations act on integers
        # (kvb, the bytes of a token's K and V, is one too) and are exact below 2**53, so they are the integers
        # unit * (kv0 + k * seqs) made floats, and so are their float sums step by step (every one an integer
        # below 2**53): the same numbers at four float operations a step instead of seven, the KV tokens by
        # float additions in C instead of a big integer and its conversion each
        exact = unit and unit * (kv0 + steps * seqs) < 2 ** 53  # (unit: L * kvb as an integer, 0 if it is none)
        while i < steps:
            m = math.ceil(math.ceil((mk + i) / splits) / per_block)
            j = steps
            if math.ceil(math.ceil((mk + (steps - 1)) / splits) / per_block) != m:
                lo, j = i, steps - 1  # blocks(lo) == m != blocks(j)
                while j - lo > 1:
                    mid = (lo + j) // 2
                    if math.ceil(math.ceil((mk + mid) / splits) / per_block) == m:
                        lo = mid
                    else:
                        j = mid
            lt = float(m * per_block)
            b = L * lt * 1e-3 * w_longest
            # longest_extra's term, e0 - k * d as decode_steps computes it: positive up to the first step whose even
            # share reaches the longest program (non-increasing in k: found by bisection), 0 (not added) from there
            x_end = i
            if w_x:
                a = L * 1e-3 * w_x
                ga = g * a
                e0, d = lt * a - kv0 * ga, fs * ga
                if e0 - i * d > 0.0:
                    x_end = j
                    if e0 - (j - 1) * d <= 0.0:
                        lo = i
                        while x_end - lo > 1:
                            mid = (lo + x_end) // 2
                            if e0 - mid * d > 0.0:
                                lo = mid
                            else:
                                x_end = mid
            if exact:
                kv = accumulate(repeat(float(unit * seqs), j - i - 1), initial=float(unit * (kv0 + i * seqs)))
                if x_end > i:  # (the range first in zip: it stops without drawing from kv a step after x_end's)
                    times += [c + x * 1e-9 * w_kv + b + (e0 - k * d) for k, x in zip(range(i, x_end), kv)]
                times += [c + x * 1e-9 * w_kv + b for x in kv]
            else:
                times += [c + L * (kv0 + k * fs) * kvb * 1e-9 * w_kv + b + (e0 - k * d) for k in range(i, x_end)]
                times += [c + L * (kv0 + k * fs) * kvb * 1e-9 * w_kv + b for k in range(x_end, j)]
            i = j
        self._raw = (work, n, times)  # unscaled: (each step) * f is the step next to the co-runner
        if f is not None:
            times = [x * f for x in times]
        else:
            times = times[:]
        return times, list(accumulate(times))

    def _setup_co(self, work: Work, co: Work, num_sms: int, co_sms) -> int | tuple[int, int]:
        """What of the co-runner a decode stretch's setup reads when co_decode reads SM counts alone: nothing on
        disjoint SMs (-1), else the SMs the two launches get (naive concurrency's split, :meth:`_shared_sms`)."""
        if 0 <= co_sms and num_sms + co_sms <= self.num_sms:
            return -1
        return self._shared_sms(num_sms, int(co_sms), work, co)

    def _decode_setup(self, work: Work, num_sms: int, co: Work | None, co_sms, key: tuple) -> tuple:
        """What a short decode stretch needs that depends only on (layers, batch, SMs, co-runner), memoised
        under ``key``: both families' (const, w_kv, w_longest, splits), the co-runner's slowdown factor
        (None: none), the SMs and the KV term's integer unit, layers x a token's KV bytes (0: not an integer)."""
        n, _ = check_sms(num_sms, self.num_sms)
        if work.tokens < 1:
            raise ValueError(f"a launch needs at least one token, got {work!r}")
        if co is not None and co_sms:
            n, co_sms = self._shared_sms(n, int(co_sms), work, co)
        f = 1.0 + self._slowdown("co_decode", n, co, co_sms, False) if co is not None and co_sms else None
        if len(self._dsetup) >= 65536:
            self._dsetup.clear()
        kvi = int(self.q.kv_bytes)
        unit = int(work.num_layers) * kvi if kvi == self.q.kv_bytes and work.seqs > 0 else 0
        out = self._dsetup[key] = (*self._decode_parts("decode_first", work, n),
                                   *self._decode_parts("decode_step", work, n), f, n, unit)
        return out

    # ---------------------------------------------------------------- parts
    def _shared_sms(self, n: int, co_sms: int, work: Work, co: Work) -> tuple[int, int]:
        """:func:`~bullet.perfmodel.base.shared_sms`, memoised: it depends on the launches' token counts alone."""
        if 0 <= co_sms and n + co_sms <= self.num_sms:  # disjoint lanes keep their SMs (no lookup)
            return n, co_sms
        key = (n, co_sms, work.tokens, co.tokens)
        out = self._share.get(key)
        if out is None:
            if len(self._share) >= 65536:
                self._share.clear()
            out = self._share[key] = shared_sms(n, co_sms, work, co, self.num_sms)
        return out

    def _decode_parts(self, family: str, work: Work, n: int) -> tuple[float, float, float, float, float, float]:
        """(const, w_kv, w_longest, w_extra, splits, share), memoised: decode launches repeat (layers, batch,
        SMs)."""
        key = (family, work.num_layers, work.seqs, n)
        parts = self._parts.get(key)
        if parts is None:
            if len(self._parts) >= 65536:
                self._parts.clear()
            parts = self._parts[key] = (*self.f[family].parts(self.q.decode_static(work, n), n),
                                        self.q.graph_splits(work.seqs), self.q.share(n))
        return parts

    def _decode_step(self, family: str, work: Work, n: int) -> float:
        layers, _, seqs, _, kv, _, _, max_kv = work  # (one unpacking: a NamedTuple field read is a generic lookup)
        parts = self._parts.get((family, layers, seqs, n))  # (_decode_parts' memo, read here first)
        const, w_kv, w_longest, w_extra, splits, g = parts if parts is not None else \
            self._decode_parts(family, work, n)
        # decode_var(work, n, splits=splits)'s operations, inline (policies ask this for every candidate SM count)
        q, L = self.q, float(layers)
        per_block, mk = q.per_block, float(max_kv or (kv / max(1, seqs)))
        lt = float(math.ceil(math.ceil(mk / splits) / per_block) * per_block)
        t = const + L * float(kv) * q.kv_bytes * 1e-9 * w_kv + L * lt * 1e-3 * w_longest
        if w_extra and (e := lt - float(kv) * g) > 0.0:
            t += L * e * 1e-3 * w_extra
        return t

    def padded(self, work: Work) -> Work:
        """The Work a launch really computes (see :meth:`GraphLimits.padded`)."""
        return work if self.graphs is None else self.graphs.padded(work)

    def graphed(self, work: Work) -> bool:
        """A prefill or mixed launch a prefill graph serves (the profile's limits)."""
        return self.graphs is not None and self.graphs.serves(work)

    def host_time(self, work: Work) -> float:
        """Host seconds of an eager launch (``GpuExecutor.launch``); 0 for one a prefill graph serves (its
        replay returns to the host long before the GPU is done)."""
        h = self._host.get(work)
        if h is None:  # memoised: a policy's searches over SM counts ask for the same launch again and again
            if len(self._host) >= 65536:
                self._host.clear()
            if self.graphed(work):
                h = 0.0
            elif self._host_terms is None:
                h = self.f["host"].scalar(self.q.host(work), 0)
            else:  # Linear.scalar's sum without a dict of quantities, as _eager_alone's
                x, h = self.q.host_values(work), 0.0
                for i, w in self._host_terms:
                    h += x[i] * w
            self._host[work] = h
        return h

    def gpu_time(self, work: Work, n: int) -> float:
        """Stand-alone GPU seconds (no host time, no co-runner)."""
        if work.tokens == work.seqs:
            raw = self._raw  # the stretch decode_step_ends last timed: its first step is this, unscaled
            if raw is not None and raw[1] == n and raw[0] == work:
                return raw[2][0]
            return self._decode_step("decode_first", work, n)
        return self._eager_alone(work, n)

    def _eager_alone(self, work: Work, n: int) -> float:
        """Stand-alone GPU seconds of an eager (or graphed) prefill or mixed launch, memoised: a policy's
        searches over SM counts and the simulator's re-times ask for the same launch again and again."""
        key = (work, n)
        t = self._eager.get(key)
        if t is None:
            if len(self._eager) >= 65536:
                self._eager.clear()
            terms = self._eager_terms
            if terms is None:
                t = self.f["eager"].scalar(self.q.eager(self.padded(work), n, self.graphed(work)), n)
            else:  # Linear.scalar's sum: 0.0 plus each quantity x its weight, in the family's order
                x = self.q.eager_values(self.padded(work), n, self.graphed(work))
                t = 0.0
                for i, w in terms[n]:
                    t += x[i] * w
            self._eager[key] = t
        return t

    def co_features(self, n, co: Work, co_sms, arr: bool, own=0.0, own_fl=0.0) -> dict:
        """The contention quantities of a lane on ``n`` SMs next to ``co`` on ``co_sms``; ``own``: the lane's
        own stand-alone HBM demand (TB/s), ``own_fl`` its FLOP rate (PFLOP/s; both :data:`CO_EAGER_Q`)."""
        N, sm_bw = self.num_sms, self._sm_bw()
        if arr or isinstance(co_sms, np.ndarray):
            csm = np.broadcast_to(np.asarray(co_sms, dtype=np.intp), np.shape(n))
            on = csm > 0  # no co-runner where it has no SMs: no slowdown
            c1 = np.maximum(csm, 1)
            alone = self._co_alone_array(co, c1)
            u = np.where(on, self.q.bytes_of(co) / alone * 1e-12, 0.0)
            g = np.where(on, self._gemm_seconds(co, c1) / alone, 0.0)
            return {"co_bw": u, "co_bw_share": u * (n / N), "co_sm_share": csm / N, "own_bw_co_bw": own * u,
                    "sm_bw_co_sm": np.asarray(sm_bw)[n] * (csm / N), "own_flops_co_sm": own_fl * (csm / N),
                    "co_gemm_co_sm": g * (csm / N), "co_tc_co_sm": tensor_cores(co) * (csm / N),
                    "co_gemm_half": g * (np.minimum(csm, N / 2) / N)}
        u, g = self._co_of(co, co_sms)
        return {"co_bw": u, "co_bw_share": u * (n / N), "co_sm_share": co_sms / N, "own_bw_co_bw": own * u,
                "sm_bw_co_sm": sm_bw[n] * (co_sms / N), "own_flops_co_sm": own_fl * (co_sms / N),
                "co_gemm_co_sm": g * (co_sms / N), "co_tc_co_sm": tensor_cores(co) * (co_sms / N),
                "co_gemm_half": g * (min(co_sms, N / 2) / N)}

    def _gemm_seconds(self, co: Work, co_sms):
        """Seconds a decode co-runner's layers spend in the measured GEMM table's products on ``co_sms`` SMs (int
        or array): 0 for an eager co-runner, a one-row step (the fused GEMV) or a model without a table."""
        if co.tokens != co.seqs or co.seqs < 2 or self.q.gemm is None:
            return 0.0 * co_sms
        return float(co.num_layers) * self.q.gemm_layer(self.q.bucket(co.seqs), co_sms)

    def _co_gemm_share(self, co: Work, co_sms: int) -> float:
        """The share of a co-runner's stand-alone time in its GEMMs (:meth:`_gemm_seconds`)."""
        return self._co_of(co, co_sms)[1]

    def _co_demand(self, co: Work, co_sms: int) -> float:
        """The co-runner's stand-alone HBM demand on ``co_sms`` SMs, TB/s."""
        return self._co_of(co, co_sms)[0]

    def _co_of(self, co: Work, co_sms: int) -> tuple[float, float]:
        """(:meth:`_co_demand`, :meth:`_co_gemm_share`), from one stand-alone time of the co-runner, memoised for
        the last co-runner: asked again at once when at all (a memo of the last 64 hit 1 of ~6,000 asks more on
        the Azure conversation trace: bench/RESULTS.md, tenth and fourteenth speed passes)."""
        last = self._co_last
        if last is not None and last[1] == co_sms and last[0] == co:
            return last[2]
        key = (co.num_layers, co.tokens, co.seqs, co_sms)  # (every decode co-runner is new: its KV grows)
        s = self._gemm_s.get(key)
        if s is None:
            if len(self._gemm_s) >= 65536:
                self._gemm_s.clear()
            s = self._gemm_s[key] = self._gemm_seconds(co, co_sms)
        alone = self.gpu_time(co, co_sms)
        out = (self.q.bytes_of(co) / alone * 1e-12, s / alone if s else 0.0)
        self._co_last = (co, co_sms, out)
        return out

    def _co_scalar(self, family: str, n: int, co: Work, co_sms, own: float, own_fl: float = 0.0) -> float:
        """``self.f[family].scalar(self.co_features(n, co, co_sms, False, own, own_fl), 0)``: the same features,
        summed in the family's order, without building their dict."""
        terms = self._co_terms.get(family)
        if terms is None:
            return self.f[family].scalar(self.co_features(n, co, co_sms, False, own, own_fl), 0)
        (u, g), N = self._co_of(co, co_sms), self.num_sms
        m = co_sms / N
        gf = family in self._gemm_fams
        x = (u, u * (n / N), m, own * u, (self._sm_bw_table or self._sm_bw())[n] * m, own_fl * m,
             g * m if gf else 0.0, tensor_cores(co) * m, g * (min(co_sms, N / 2) / N) if gf else 0.0)
        s = 0.0
        for i, w in terms:
            s += x[i] * w
        return s

    def _sm_bw(self) -> list[float]:
        """TB/s a reference decode step (:data:`SM_BW_REF`) pulls on each SM count (index), from the model's
        own ``decode_first`` family; made once."""
        if self._sm_bw_table is None:
            rows, ctx = SM_BW_REF
            ref = Work(self.spec.num_layers, rows, rows, float(rows * ctx), rows * ctx, rows, True, ctx)
            b = self.q.bytes_of(ref) * 1e-12
            self._sm_bw_table = [0.0] + [b / t if (t := self._decode_step("decode_first", ref, n)) > 0 else 0.0
                                         for n in range(1, self.num_sms + 1)]
        return self._sm_bw_table

    def eager_next_to(self, work: Work, alone, n, co: Work, co_sms, arr: bool = False):
        """An eager launch's time on ``n`` SMs next to ``co`` on ``co_sms``, from its stand-alone time(s)
        ``alone`` (its own HBM demand is a contention term only where the model has one: older files do not)."""
        last = self._own_last  # (a prefill launch is re-timed next to each new decode co-runner: the same own terms)
        if not arr and last is not None and last[0] is work and last[1] == alone:
            own, own_fl = last[2], last[3]
        else:
            own = self.own_bw(work, alone) if self._own else 0.0
            own_fl = self.own_flops(work, alone) if self._own_fl else 0.0
            if not arr:
                self._own_last = (work, alone, own, own_fl)
        t = alone * (1.0 + self._slowdown("co_eager", n, co, co_sms, arr, own, own_fl))
        if self._split:
            return t * (self._split_arr[n] if arr else self._split.get(n, 1.0))
        return t

    def own_bw(self, work: Work, alone):
        """``work``'s stand-alone HBM demand, TB/s, given its stand-alone time(s) ``alone``."""
        return self.q.bytes_of(work) / alone * 1e-12

    def own_flops(self, work: Work, alone):
        """``work``'s stand-alone FLOP rate, PFLOP/s, given its stand-alone time(s) ``alone``."""
        return self.q.flops_of(work) / alone * 1e-15

    def _co_alone_array(self, co: Work, csm: np.ndarray) -> np.ndarray:
        if co.tokens == co.seqs:
            return self.f["decode_first"].array(self.q.decode(co, csm), csm)
        return self.f["eager"].array(self.q.eager(self.padded(co), csm, self.graphed(co)), csm)

    def _slowdown(self, family: str, n, co: Work, co_sms, arr: bool, own=0.0, own_fl=0.0):
        if arr:
            return self.f[family].array(self.co_features(n, co, co_sms, arr, own, own_fl),
                                        np.zeros(np.shape(n), dtype=np.intp))
        if family in self._sm_only:
            key = (family, n, co_sms, type(co_sms))  # the type too: an int and a numpy int give other types
            s = self._slow.get(key)
            if s is None:  # the features this family reads, as co_features computes them
                if len(self._slow) >= 65536:
                    self._slow.clear()
                N = self.num_sms
                s = self._slow[key] = self.f[family].scalar(
                    {"co_sm_share": co_sms / N, "sm_bw_co_sm": self._sm_bw()[n] * (co_sms / N)}, 0)
            return s
        if family == "co_eager":  # not memoised: an eager launch's co-runner is a decode stretch, a new Work each
            # step (0-10 % of asks hit such a memo, each within two asks: bench/RESULTS.md, tenth speed pass)
            return self._co_scalar(family, n, co, co_sms, own, own_fl)
        key = (family, n, co, co_sms, type(co_sms), own, own_fl)  # the type too: an int and a numpy int differ
        s = self._slow.get(key)
        if s is None:  # memoised: the same co-runner is asked about step after step
            if len(self._slow) >= 65536:
                self._slow.clear()
            s = self._slow[key] = self._co_scalar(family, n, co, co_sms, own, own_fl)
        return s
