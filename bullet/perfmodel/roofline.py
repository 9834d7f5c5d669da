"""An analytic, per-kernel roofline latency model, scaled by SM count, with co-runner contention.

A launch is a fixed list of kernels per layer -- QKV, O, gate-up and down GEMMs, attention, two fused
residual-add RMSNorms, RoPE + KV store, SiLU*mul (and q/k RMSNorm for Qwen3) -- plus the once-per-launch
ones (embedding; final norm, LM head and sampler when tokens are sampled) and, for ``tp > 1``, two ring
all-reduces per layer. Each kernel takes::

    T = max(T_compute, T_memory) + kernel_overhead

* ``T_compute``: the work is cut into tiles -- GEMM output tiles of ``tile_m x tile_n`` (``tile_m_small``
  rows when M is small), split along K (split-K / stream-K) while the tiles cannot fill the partition
  (the fp32 partial sums stay in L2 and are not counted as HBM bytes);
  attention tiles of ``ATTN_TILE_PAIRS`` query-key pairs of one head -- that run in waves of
  ``n * blocks_per_sm``: ``waves = ceil(tiles / (n * bps))`` (wave quantization). A wave takes
  ``bps * tile_flops / c(u)`` where ``u = ceil(tiles / (waves * bps))`` are the SMs kept busy and
  ``c(u) = c0 * min(1 + partition_boost, (N / u) ** (1/3))`` the per-SM rate of a power-capped clock: with
  fewer SMs drawing power the clock runs higher, which is what the H200 8192^3 scaling shows (0.54 of
  full speed on 64 of 132 SMs). Counting busy rather than partition SMs keeps time non-increasing in SMs.
  ``c0 = gemm_efficiency * gpu.peak_flops / N``.
* ``T_memory = bytes / D(n)``, ``D(n) = D_max * x / (1 + x^p) ** (1/p)``, ``x = n * sm_bandwidth / D_max``:
  linear in SMs (``sm_bandwidth`` each), saturating at ``D_max = hbm_efficiency * gpu.hbm_bandwidth`` after
  the knee ``n_d = D_max / sm_bandwidth``; ``p = knee_sharpness``.
* Efficiencies are fractions of each GPU's own datasheet peaks (``GpuSpec.peak_flops``, ``hbm_bandwidth``),
  at most 1, and ``gemm_efficiency * (1 + partition_boost) <= 1``: no prediction is faster than the datasheet
  allows, on any GPU and any partition (tested for every preset).
* Contention: a co-runner ``co`` on ``co_sms`` other SMs draws ``u = bytes(co) / T(co alone)`` of HBM
  bandwidth (share ``rho = u / D_max``, load ``q = rho / (1 - rho)`` as in a queue). This launch then gets
  a proportional share of HBM once both demands exceed it, ``D(n) * min(1, D_max / (D(n) + u))``, further
  divided by ``1 + bw_interference * q`` (queueing, row-buffer and L2 conflicts), and its compute rate
  is divided by ``1 + compute_interference * q`` (longer load latencies and L2 misses stalling the GEMM
  main loop). ``u`` is the co-runner's stand-alone demand (no fixed point): deterministic and cheap.

Nothing is collapsed that changes a per-kernel max(): the memory-only kernels (norms, RoPE, activation,
embedding, sampler) have negligible FLOPs, so their bytes are summed into one term (exact), and all
layers of a slice are identical (one layer computed, times the layer count). One implementation serves a
scalar SM count (plain Python floats: the simulator's hot path) and an array of them (numpy, the same
operations element-wise), so both give identical numbers. Constants and calibration: docs/perfmodel.md.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from itertools import accumulate
from math import ceil
from numbers import Real

import numpy as np

from ..config import GpuSpec, ModelSpec
from .base import Work, check_sms, shared_sms

# Attention work unit: 128 query rows x 64 key columns of one head (a FlashAttention-style tile).
ATTN_TILE_PAIRS = 128 * 64
# The co-runner's HBM share is capped here in the queueing term rho / (1 - rho) (a bound, never reached
# by a co-runner that respects D(n) <= D_max: its stand-alone demand is at most D(N) / D_max ~ 0.78).
RHO_CAP = 0.9
# Dynamic power ~ f * V^2 with V ~ f: the clock a power cap allows scales as (power share) ** (1/3).
CLOCK_POWER_EXPONENT = 1.0 / 3.0
# Split-K never cuts K below this many elements per split (cuBLAS/CUTLASS split-K heuristics).
MIN_SPLIT_K = 512
# decode_step_ends: stretches up to this many steps in plain floats (below it numpy's per-call cost dominates)
SHORT_STRETCH = 24


@dataclass(frozen=True, slots=True)
class RooflineConstants:
    """The model's named constants. The first eight are fitted by bench/perfmodel_calibration.py to the
    measurements on our H200 (docs/background.md); the rest are assumed, kernel-design or datasheet values;
    each one's source is in docs/perfmodel.md. Efficiencies are fractions of the GPU's datasheet peaks."""

    # fitted (H200, Llama-3.1-8B shapes; bench/perfmodel_calibration.py --fit)
    gemm_efficiency: float = 0.8149  # c0 = gemm_efficiency * gpu.peak_flops / num_sms: per-SM GEMM rate
    partition_boost: float = 0.1166  # max per-SM clock gain when few SMs are busy (power headroom)
    hbm_efficiency: float = 1.0  # D_max = hbm_efficiency * gpu.hbm_bandwidth (fitted at its bound, the datasheet)
    sm_bandwidth: float = 58.07e9  # bytes/s one SM streams while HBM is not saturated
    knee_sharpness: float = 1.5341  # p of the smooth min(n * sm_bandwidth, D_max)
    kernel_overhead: float = 5.40e-6  # s per kernel: launch gap, prologue and tail
    bw_interference: float = 1.4026  # memory slowdown per unit of co-runner load rho / (1 - rho)
    compute_interference: float = 0.2513  # compute slowdown per unit of co-runner load rho / (1 - rho)
    # assumed (not identifiable from the H200 figures: only the 4096 prefill total constrains it)
    attn_efficiency: float = 0.6  # attention FLOP rate / GEMM FLOP rate (FlashAttention-2-class kernels)
    # kernel design (not fitted)
    tile_m: int = 128  # GEMM tile rows (cuBLAS sm90 bf16 kernels: 128x256 and 64x256 tiles)
    tile_m_small: int = 64  # ... when the GEMM has at most this many rows
    tile_n: int = 256
    blocks_per_sm: int = 1  # resident GEMM tiles per SM (large-shared-memory Hopper kernels run one)
    sample_passes: float = 3.0  # passes over the fp32 logits by the sampler (softmax, top-k/p, pick)
    # interconnect (datasheet-derived; used only when tp > 1)
    allreduce_bandwidth: float = 360e9  # NCCL bus bandwidth, bytes/s (NVLink4: ~0.8 x 450 GB/s)
    allreduce_latency: float = 10e-6  # s per all-reduce

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            may_be_zero = f.name in ("partition_boost", "bw_interference", "compute_interference")
            if not isinstance(v, Real) or not (v >= 0 if may_be_zero else v > 0):
                raise ValueError(f"RooflineConstants.{f.name} must be {'>= 0' if may_be_zero else '> 0'}, "
                                 f"got {v!r}")
        for name in ("tile_m", "tile_m_small", "tile_n", "blocks_per_sm"):
            if not isinstance(getattr(self, name), int):
                raise TypeError(f"RooflineConstants.{name} must be an int")
        # fractions of the datasheet peaks: a kernel cannot beat them, not even on a boosted partition
        for name in ("hbm_efficiency", "attn_efficiency"):
            if getattr(self, name) > 1:
                raise ValueError(f"RooflineConstants.{name} must be <= 1 (a fraction of the datasheet peak), "
                                 f"got {getattr(self, name)!r}")
        if self.gemm_efficiency * (1 + self.partition_boost) > 1:
            raise ValueError("RooflineConstants.gemm_efficiency * (1 + partition_boost) must be <= 1 (an SM at "
                             f"its boosted clock cannot beat the datasheet rate), got {self.gemm_efficiency!r} * "
                             f"(1 + {self.partition_boost!r})")


# Fitted on the H200 by bench/perfmodel_calibration.py (table and date in docs/perfmodel.md).
H200_CONSTANTS = RooflineConstants()

# Per GPU. The efficiencies fitted on the H200 are fractions of the H200's datasheet peaks, and every other GPU
# applies them to its own datasheet peaks (GpuSpec.peak_flops, hbm_bandwidth): a what-if across GPUs never
# predicts above a GPU's peak, and GPUs with the same compute (H100, H200) get the same compute times. What is a
# property of the part itself is set here, with its source; a GPU not listed gets the H200's constants.
GPU_CONSTANTS: dict[str, RooflineConstants] = {
    "h200": H200_CONSTANTS,
    # H100 SXM: the H200's GH100 die, SMs, clocks (1980 MHz boost) and 700 W limit, with HBM3 at 3.35 TB/s
    # instead of HBM3e at 4.8: everything per SM is the H200's; only D_max differs (through GpuSpec).
    "h100": H200_CONSTANTS,
    # A100 SXM: per-SM streaming rate scaled from the H200's fitted 58.07 GB/s by the boost clocks, 1410 / 1980
    # MHz (assumed: an SM's loads in flight per clock alike; not measured). NVLink3: 300 GB/s per direction,
    # ~0.8 of it as NCCL bus bandwidth. The power-capped clock (partition_boost) is assumed like the H200's.
    "a100": replace(H200_CONSTANTS, sm_bandwidth=58.07e9 * 1410 / 1980, allreduce_bandwidth=240e9),
}


class _Gemm:
    """One GEMM of the launch: ``(M x K) @ (K x N)`` with M = tokens (or samples for the LM head)."""

    __slots__ = ("k", "max_split", "n", "n_tiles", "row_bytes", "wave_flops", "weight_bytes")

    def __init__(self, n: int, k: int, bm: int, c: RooflineConstants, dtype_bytes: int,
                 bias: bool = False) -> None:
        self.n_tiles = -(-n // c.tile_n)
        self.k, self.n = k, n
        self.wave_flops = c.blocks_per_sm * 2.0 * bm * c.tile_n * k  # one wave, one SM, no split
        self.max_split = max(1, k // MIN_SPLIT_K)
        self.weight_bytes = (n * k + n * bias) * dtype_bytes  # read once per launch
        self.row_bytes = (k + n) * dtype_bytes  # activations in and out, per row


class _Shapes:
    """Everything per tile height (``tile_m`` for big M, ``tile_m_small`` for small M)."""

    __slots__ = (
        "bm",
        "layer_gemms",
        "lm_head",
        "max_split",
        "n_tiles",
        "row_bytes",
        "wave_flops",
        "weight_bytes",
    )

    def __init__(self, bm: int, layer_gemms: tuple[_Gemm, ...], lm_head: _Gemm) -> None:
        self.bm, self.layer_gemms, self.lm_head = bm, layer_gemms, lm_head

        def col(name: str) -> np.ndarray:  # the layer GEMMs stacked, for the vectorised path
            return np.array([float(getattr(g, name)) for g in layer_gemms])[:, None]

        self.n_tiles, self.wave_flops, self.max_split = col("n_tiles"), col("wave_flops"), col("max_split")
        self.weight_bytes, self.row_bytes = col("weight_bytes"), col("row_bytes")


class RooflineModel:
    """Analytic per-kernel roofline: ``RooflineModel(model, gpu, **constants)``.

    ``constants`` override :class:`RooflineConstants` fields; the defaults are ``GPU_CONSTANTS[gpu.name]``
    (the H200's for a GPU not listed). Implements :class:`~bullet.perfmodel.base.LatencyModel`; extras:
    :meth:`gemm_time` (one raw GEMM), :meth:`breakdown` (seconds per kernel kind).
    """

    def __init__(self, model: ModelSpec, gpu: GpuSpec, **constants: float) -> None:
        names = {f.name for f in fields(RooflineConstants)}
        unknown = sorted(set(constants) - names)
        if unknown:
            raise TypeError(f"RooflineModel: unknown constant(s) {', '.join(unknown)}; "
                            f"known: {', '.join(sorted(names))}")
        self.model, self.gpu = model, gpu
        self.constants = c = replace(GPU_CONSTANTS.get(gpu.name, H200_CONSTANTS), **constants)
        N = self.num_sms = gpu.num_sms
        self.bps = c.blocks_per_sm
        # Per-SM-count tables, index = SM count (0 unused but finite).
        n = np.arange(N + 1, dtype=np.float64)
        n[0] = 1.0
        c0 = c.gemm_efficiency * gpu.peak_flops / N
        self.inv_c = 1.0 / (c0 * np.minimum(1.0 + c.partition_boost, (N / n) ** CLOCK_POWER_EXPONENT))
        self.d_max = c.hbm_efficiency * gpu.hbm_bandwidth
        x = n * c.sm_bandwidth / self.d_max
        self.bw = self.d_max * x / (1.0 + x ** c.knee_sharpness) ** (1.0 / c.knee_sharpness)
        self.inv_bw = 1.0 / self.bw
        self._slots = n * self.bps  # float: the vectorised path divides in floats
        self._slots[0] = self.bps
        self._inv_c_list = self.inv_c.tolist()
        self._inv_c_max = float(self.inv_c.max())  # the slowest per-SM rate
        self._bw_list = self.bw.tolist()
        self._inv_bw_list = self.inv_bw.tolist()
        # Shapes, per GPU after tensor parallelism.
        m = model
        h, q, kv, f, dt = m.hidden_size, m.q_size, m.kv_size, m.ffn_per_gpu, m.dtype_bytes
        self._big, self._small = (
            _Shapes(bm, (_Gemm(q + 2 * kv, h, bm, c, dt, m.qkv_bias), _Gemm(h, q, bm, c, dt),
                         _Gemm(2 * f, h, bm, c, dt), _Gemm(h, f, bm, c, dt)),
                    _Gemm(m.vocab_size, h, bm, c, dt))
            for bm in (c.tile_m, c.tile_m_small))
        self._attn_tiles_per_pair = m.heads_per_gpu / ATTN_TILE_PAIRS
        self._attn_wave_flops = self.bps * 4.0 * m.head_dim * ATTN_TILE_PAIRS / c.attn_efficiency
        self._attn_kv_bytes = 2 * kv * dt  # K and V per cached token, per layer
        self._attn_row_bytes = 2 * q * dt  # query in, output out
        self._attn_kv_bytes_f = float(self._attn_kv_bytes)
        # Memory-only kernels, bytes per token per layer: 2 fused residual-add RMSNorms (read x and the
        # residual, write both), RoPE on q and k plus the K/V store, SiLU(gate) * up, q/k RMSNorm.
        self._elem_bytes = (2 * 4 * h + 2 * (q + kv) + 2 * 2 * kv + 3 * f + 2 * (q + kv) * m.qk_norm) * dt
        self._layer_kernels = 9 + m.qk_norm  # 4 GEMMs, attention, 2 norms, RoPE, SiLU*mul (+ q/k norm)
        self._sample_bytes_per_row = (4 * h * dt  # final norm
                                      + c.sample_passes * m.vocab_size * 4)  # fp32 logits
        self._embed_bytes_per_row = 2 * h * dt
        # Byte totals for work_bytes (the co-runner's demand): the same terms as the kernels'.
        gemms = self._big.layer_gemms
        self._layer_weight_bytes = float(sum(g.weight_bytes for g in gemms))
        self._layer_row_bytes = float(sum(g.row_bytes for g in gemms)) + self._attn_row_bytes + self._elem_bytes
        self._lm_weight_bytes = float(self._big.lm_head.weight_bytes)
        self._lm_row_bytes = self._big.lm_head.row_bytes + self._sample_bytes_per_row
        if m.tp > 1:  # two ring all-reduces per layer of tokens x hidden: 2 (tp-1)/tp of it crosses NVLink
            self._ar_fixed = 2 * c.allreduce_latency
            self._ar_per_token = 2 * 2 * (m.tp - 1) / m.tp * h * dt / c.allreduce_bandwidth
        else:
            self._ar_fixed = self._ar_per_token = 0.0
        self._demand: dict[tuple[Work, int], float | np.ndarray] = {}  # (co, co_sms or -1: all)
        self._rest_memo: dict[tuple, float] = {}
        self._cont: dict[tuple[int, Work, int], tuple[float, float]] = {}  # (SMs, co, co_sms) -> _contention
        self._terms: dict[tuple[int, int, int], tuple] = {}  # (tokens, samples, SMs) -> _launch_terms

    # ------------------------------------------------------------------ the LatencyModel protocol
    def predict(self, work: Work, num_sms, co: Work | None = None, co_sms=0):
        """Seconds for ``work`` on ``num_sms`` SMs (int, or an array -> array) while ``co`` runs on
        ``co_sms`` other SMs (int, or an array matching ``num_sms``; None / 0: alone)."""
        if type(num_sms) is int and 0 < num_sms <= self.num_sms:  # the simulator's case, checked at once
            n, arr = num_sms, False
        else:
            n, arr = check_sms(num_sms, self.num_sms)
        if work.tokens < 1:
            raise ValueError(f"a launch needs at least one token, got {work!r}")
        if not arr and co is not None and not (type(co_sms) is int and 0 <= co_sms <= self.num_sms - n):
            n, co_sms = shared_sms(n, co_sms, work, co, self.num_sms)  # (disjoint lanes keep their SMs)
        cf, inv_bw = self._contention(n, arr, co, co_sms)
        rest = self._rest(work, n, arr, cf, inv_bw)
        att = self._attention(work.attn_pairs, work.kv_read, work.tokens, n, arr, cf, inv_bw)
        out = rest + work.num_layers * att
        return out if arr else float(out)

    def decode_steps(self, work: Work, steps: int, num_sms, co: Work | None = None,
                     co_sms=0) -> np.ndarray:
        """Seconds of each of ``steps`` fused decode steps: step i has ``attn_pairs + i * seqs`` pairs and
        reads ``kv_read + i * seqs`` KV tokens; the rest is the same every step. Equal to ``predict`` on
        each step's Work (same operations, element-wise over the steps)."""
        n, cf, inv_bw, rest = self._decode_setup(work, num_sms, co, co_sms)
        # kv_read + i * seqs: integers, exact in floats however they are computed (one arange call)
        kv_read = np.arange(work.kv_read, work.kv_read + steps * work.seqs, work.seqs, dtype=np.float64)
        # Decode attention is nearly always memory-bound: when even the last step's compute time, at the
        # slowest per-SM rate and with a spare wave, stays below the first step's memory time, max() is
        # the memory time at every step and the compute term need not be evaluated (same numbers).
        # in place: the same operations, fewer arrays; integers as floats (exact; numpy converts a Python int
        # operand at a cost)
        att = self._attn_kv_bytes_f * kv_read
        att += float(self._attn_row_bytes * work.tokens)
        att *= inv_bw
        if not (steps and self._memory_bound(work, steps, n, cf, att[0])):
            grow = np.arange(steps, dtype=np.float64) * work.seqs
            att = self._attention(work.attn_pairs + grow, kv_read, work.tokens, n, True, cf, inv_bw)
        att *= float(work.num_layers)
        att += rest
        return att

    def decode_step_ends(self, work: Work, steps: int, num_sms, co: Work | None = None,
                         co_sms=0) -> tuple[list[float] | np.ndarray, list[float] | np.ndarray]:
        """``(decode_steps(...), np.cumsum of it)``, the same numbers. A short memory-bound stretch (up to
        ``SHORT_STRETCH`` steps: most fused launches) is computed in plain floats, element by element as
        :meth:`decode_steps` does it and summed in order as ``cumsum`` does: numpy's per-call cost is the
        larger there. Both come as lists then."""
        if steps > SHORT_STRETCH or steps < 1:
            times = self.decode_steps(work, steps, num_sms, co, co_sms)
            return times, times.cumsum()
        n, cf, inv_bw, rest = self._decode_setup(work, num_sms, co, co_sms)
        kvb, row, kv0, seqs = self._attn_kv_bytes_f, float(self._attn_row_bytes * work.tokens), work.kv_read, work.seqs
        if not self._memory_bound(work, steps, n, cf, (kvb * kv0 + row) * inv_bw):
            times = self.decode_steps(work, steps, num_sms, co, co_sms)
            return times, times.cumsum()
        L = float(work.num_layers)
        times = [((kvb * (kv0 + i * seqs) + row) * inv_bw) * L + rest for i in range(steps)]
        return times, list(accumulate(times))

    def _decode_setup(self, work: Work, num_sms, co: Work | None, co_sms) -> tuple[int, float, float, float]:
        """(SMs, compute slowdown, seconds per byte, everything but attention) of a decode step of ``work``."""
        if type(num_sms) is int and 0 < num_sms <= self.num_sms:
            n = num_sms
        else:
            n, arr = check_sms(num_sms, self.num_sms)
            if arr:
                raise ValueError("decode_steps takes one SM count")
        if work.tokens < 1:
            raise ValueError(f"a launch needs at least one token, got {work!r}")
        if co is not None and not (type(co_sms) is int and 0 <= co_sms <= self.num_sms - n):
            n, co_sms = shared_sms(n, co_sms, work, co, self.num_sms)
        cf, inv_bw = self._contention(n, False, co, co_sms)
        return n, cf, inv_bw, self._rest(work, n, False, cf, inv_bw)

    def _memory_bound(self, work: Work, steps: int, n: int, cf: float, first_memory: float) -> bool:
        """Every one of ``steps`` decode steps' attention is memory-bound: even the last step's compute time, at
        the slowest per-SM rate and with a spare wave, stays below the first step's memory time."""
        last_tiles = (work.attn_pairs + (steps - 1) * work.seqs) * self._attn_tiles_per_pair
        return (last_tiles / (n * self.bps) + 1.0) * self._attn_wave_flops * cf * self._inv_c_max < first_memory

    # ------------------------------------------------------------------ extras
    def gemm_time(self, m: int, n: int, k: int, num_sms, co: Work | None = None, co_sms=0):
        """Seconds for one bf16 ``(m x k) @ (k x n)`` GEMM on ``num_sms`` SMs (int or array), with the
        kernel overhead; the SM-scaling calibration points are such single GEMMs."""
        c = self.constants
        sms, arr = check_sms(num_sms, self.num_sms)
        cf, inv_bw = self._contention(sms, arr, co, co_sms)
        bm = c.tile_m_small if m <= c.tile_m_small else c.tile_m
        g = _Gemm(n, k, bm, c, self.model.dtype_bytes)
        if arr:
            cfs, invs = np.broadcast_to(cf, sms.shape), np.broadcast_to(inv_bw, sms.shape)
            return np.array([self._gemm(g, m, -(-m // bm), int(s), float(f), float(b)) + c.kernel_overhead
                             for s, f, b in zip(sms, cfs, invs)])
        return self._gemm(g, m, -(-m // bm), sms, cf, inv_bw) + c.kernel_overhead

    def breakdown(self, work: Work, num_sms: int) -> dict[str, float]:
        """Seconds per kernel kind over the whole launch, alone on ``num_sms`` SMs (for explaining)."""
        n, _ = check_sms(num_sms, self.num_sms)
        inv_bw = self._inv_bw_list[n]
        t, L = work.tokens, work.num_layers
        sh = self._small if t <= self._small.bm else self._big
        mt = -(-t // sh.bm)
        out = {name: L * self._gemm(g, t, mt, n, 1.0, inv_bw)
               for name, g in zip(("qkv", "o", "gate_up", "down"), sh.layer_gemms)}
        out["attention"] = L * self._attention(work.attn_pairs, work.kv_read, t, n, False, 1.0, inv_bw)
        out["memory_only"] = (L * self._elem_bytes * t + self._embed_bytes_per_row * t * bool(work.embed)
                              + self._sample_bytes_per_row * work.samples) * inv_bw
        s = work.samples
        out["lm_head"] = self._gemm(sh.lm_head, s, -(-s // sh.bm), n, 1.0, inv_bw) if s else 0.0
        out["overhead"] = self._kernels(work) * self.constants.kernel_overhead
        out["allreduce"] = L * (self._ar_fixed + self._ar_per_token * t) if self._ar_fixed else 0.0
        return out

    def work_bytes(self, work: Work) -> float:
        """HBM bytes the launch moves (weights once per launch, activations, KV reads)."""
        t, s = work.tokens, work.samples
        per_layer = self._layer_weight_bytes + self._layer_row_bytes * t + self._attn_kv_bytes * work.kv_read
        once = self._embed_bytes_per_row * t if work.embed else 0.0
        if s:
            once += self._lm_weight_bytes + self._lm_row_bytes * s
        return work.num_layers * per_layer + once

    # ------------------------------------------------------------------ internals
    def _contention(self, n, arr: bool, co: Work | None, co_sms):
        """(compute slowdown factor, seconds per byte) of this lane on ``n`` SMs next to ``co``; remembered for
        an int SM count (a launch in flight is the co-runner of every prediction until it ends)."""
        if arr or co is None or type(co_sms) is not int:
            return self._contention_of(n, arr, co, co_sms)
        key = (n, co, co_sms)
        out = self._cont.get(key)
        if out is None:
            if len(self._cont) >= 8192:
                self._cont.clear()
            out = self._cont[key] = self._contention_of(n, arr, co, co_sms)
        return out

    def _contention_of(self, n, arr: bool, co: Work | None, co_sms):
        scalar_co = isinstance(co_sms, (int, np.integer))
        if co is None or (scalar_co and co_sms == 0):
            return 1.0, (self.inv_bw[n] if arr else self._inv_bw_list[n])
        c = self.constants
        if scalar_co:
            if not 0 <= co_sms <= self.num_sms - (n if not arr else n.max(initial=0)):
                raise ValueError(f"co_sms={co_sms!r} with num_sms={n!r} exceeds the GPU's {self.num_sms} SMs")
            key = (co, int(co_sms))
            u = self._demand.get(key)
            if u is None:
                u = self._co_demand(co, key[1])
        else:
            co_n = np.asarray(co_sms, dtype=np.intp)
            if not arr or co_n.shape != n.shape:
                raise ValueError("an array co_sms needs an array num_sms of the same shape")
            if co_n.size and (co_n.min() < 0 or (co_n + n).max() > self.num_sms):
                raise ValueError(f"co_sms={co_sms!r} with num_sms={n!r} exceeds the GPU's {self.num_sms} SMs")
            key = (co, -1)
            table = self._demand.get(key)
            if table is None:
                table = self._co_demand_table(co)
            u = table[co_n]
        if arr:
            rho = np.minimum(u / self.d_max, RHO_CAP)
            q = rho / (1.0 - rho)  # queueing: waits grow as rho / (1 - rho) with the co-runner's load
            bw = self.bw[n]
            inv_bw = (1.0 + c.bw_interference * q) * np.maximum(1.0, (bw + u) / self.d_max) / bw
        else:
            rho = min(u / self.d_max, RHO_CAP)
            q = rho / (1.0 - rho)
            bw = self._bw_list[n]
            inv_bw = (1.0 + c.bw_interference * q) * max(1.0, (bw + u) / self.d_max) / bw
        return 1.0 + c.compute_interference * q, inv_bw

    def _co_demand(self, co: Work, co_sms: int) -> float:
        if len(self._demand) >= 8192:  # bounded: a simulator sees many distinct co-runners
            self._demand.clear()
        u = self.work_bytes(co) / self.predict(co, co_sms)
        self._demand[(co, co_sms)] = u
        return u

    def _co_demand_table(self, co: Work) -> np.ndarray:
        """The co-runner's demand on every SM count at once (index 0: no co-runner, no demand)."""
        if len(self._demand) >= 8192:
            self._demand.clear()
        table = np.zeros(self.num_sms + 1)
        table[1:] = self.work_bytes(co) / self.predict(co, np.arange(1, self.num_sms + 1))
        self._demand[(co, -1)] = table
        return table

    def _kernels(self, work: Work) -> int:
        hs = work.samples > 0
        return work.num_layers * self._layer_kernels + 3 * hs + bool(work.embed)

    def _gemm(self, g: _Gemm, rows: int, row_tiles: int, n: int, cf: float, inv_bw: float) -> float:
        """max(compute, memory) seconds of one GEMM launch of ``rows`` rows (M) on ``n`` SMs."""
        per_wave, flops, inv_c, nbytes = self._gemm_terms(g, rows, row_tiles, n)
        return max(nbytes * inv_bw, per_wave * (flops * cf) * inv_c)

    def _gemm_terms(self, g: _Gemm, rows: int, row_tiles: int, n: int) -> tuple[float, float, float, int]:
        """What of :meth:`_gemm` does not depend on contention: ``(waves / split, FLOPs of one tile wave,
        1 / per-SM rate of the SMs kept busy, bytes)``; the time is ``max(bytes * inv_bw, waves / split *
        (flops * cf) * inv_c)``."""
        tiles = row_tiles * g.n_tiles
        slots = n * self.bps
        split = min(max(slots // tiles, 1), g.max_split)
        units = tiles * split
        waves = -(-units // slots)
        busy = -(-units // (waves * self.bps))
        return waves / split, g.wave_flops, self._inv_c_list[busy], g.weight_bytes + g.row_bytes * rows

    def _launch_terms(self, t: int, s: int, n: int) -> tuple:
        """:meth:`_gemm_terms` of the four layer GEMMs for ``t`` rows and of the LM head for ``s`` (None if
        0) on ``n`` SMs, remembered: a simulation asks about the same (tokens, SMs) under ever new contention."""
        key = (t, s, n)
        terms = self._terms.get(key)
        if terms is None:
            if len(self._terms) >= 65536:
                self._terms.clear()
            sh = self._small if t <= self._small.bm else self._big
            mt = -(-t // sh.bm)
            lm = self._gemm_terms(sh.lm_head, s, -(-s // sh.bm), n) if s else None
            terms = self._terms[key] = (*(self._gemm_terms(g, t, mt, n) for g in sh.layer_gemms), lm)
        return terms

    def _gemms(self, sh: _Shapes, rows: int, row_tiles: int, n: np.ndarray, cf, inv_bw) -> np.ndarray:
        """The layer GEMMs of ``sh`` at once over an array of SM counts: the same per-element operations
        as :meth:`_gemm` (integers held exactly in floats), shape (gemms, len(n))."""
        tiles = row_tiles * sh.n_tiles
        slots = self._slots[n]
        split = np.minimum(np.maximum(np.floor(slots / tiles), 1.0), sh.max_split)
        units = tiles * split
        waves = np.ceil(units / slots)
        busy = np.ceil(units / (waves * self.bps)).astype(np.intp)
        t_c = waves / split * (sh.wave_flops * cf) * self.inv_c[busy]
        t_m = (sh.weight_bytes + sh.row_bytes * rows) * inv_bw
        return np.maximum(t_c, t_m)

    def _attention(self, pairs, kv_read, tokens: int, n, arr: bool, cf, inv_bw):
        """max(compute, memory) seconds of one layer's attention; ``pairs``/``kv_read`` may be arrays
        (decode steps) or ``n`` may be an array (a menu of SM counts), not both."""
        tiles = pairs * self._attn_tiles_per_pair
        slots = n * self.bps
        t_m = (self._attn_kv_bytes * kv_read + self._attn_row_bytes * tokens) * inv_bw
        if arr:
            waves = np.ceil(tiles / slots)
            busy = np.ceil(tiles / (np.maximum(waves, 1.0) * self.bps)).astype(np.intp)
            t_c = waves * (self._attn_wave_flops * cf) * self.inv_c[busy]
            return np.maximum(t_c, t_m)
        if tiles <= 0:
            return t_m
        waves = float(ceil(tiles / slots))  # the same float operations as np.ceil above
        busy = ceil(tiles / (waves * self.bps))
        t_c = waves * (self._attn_wave_flops * cf) * self._inv_c_list[busy]
        return max(t_m, t_c)

    def _rest(self, work: Work, n, arr: bool, cf, inv_bw):
        """Everything but attention: layer GEMMs, memory-only kernels, LM head, overheads, all-reduce.
        Scalar results are memoised: decode launches repeat the same (tokens, SMs, contention)."""
        if arr:
            return self._rest_of(work, n, True, cf, inv_bw)
        key = (work.tokens, work.num_layers, work.samples, work.embed, n, cf, inv_bw)
        out = self._rest_memo.get(key)
        if out is None:
            if len(self._rest_memo) >= 65536:
                self._rest_memo.clear()
            out = self._rest_memo[key] = self._rest_of(work, n, False, cf, inv_bw)
        return out

    def _rest_of(self, work: Work, n, arr: bool, cf, inv_bw):
        t, L, s = work.tokens, work.num_layers, work.samples
        sh = self._small if t <= self._small.bm else self._big
        mt = -(-t // sh.bm)
        lm = None
        if arr:
            if np.ndim(cf):
                cf = cf[None, :]
            gemms = self._gemms(sh, t, mt, n, cf, inv_bw).sum(axis=0)
        else:  # _gemm's arithmetic, unrolled; summed in the order numpy sums the stacked rows in
            (w0, f0, c0, b0), (w1, f1, c1, b1), (w2, f2, c2, b2), (w3, f3, c3, b3), lm = self._launch_terms(t, s, n)
            gemms = (((max(b0 * inv_bw, w0 * (f0 * cf) * c0) + max(b1 * inv_bw, w1 * (f1 * cf) * c1))
                      + max(b2 * inv_bw, w2 * (f2 * cf) * c2)) + max(b3 * inv_bw, w3 * (f3 * cf) * c3))
        layer = self._elem_bytes * t * inv_bw + gemms
        once = self._kernels(work) * self.constants.kernel_overhead
        if work.embed:
            once = once + self._embed_bytes_per_row * t * inv_bw
        if s:
            once = once + self._sample_bytes_per_row * s * inv_bw
            g = sh.lm_head
            if arr:
                once = once + np.array([self._gemm(g, s, -(-s // sh.bm), int(k), float(f), float(b))
                                        for k, f, b in np.broadcast(n, cf, inv_bw)])
            else:
                w, f, c, b = lm
                once = once + max(b * inv_bw, w * (f * cf) * c)
        if self._ar_fixed:
            once = once + L * (self._ar_fixed + self._ar_per_token * t)
        return L * layer + once
