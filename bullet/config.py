"""Frozen, validated configuration: the model's shapes, the GPU, the KV cache, the SLOs, the scheduler.

Every dataclass checks itself in ``__post_init__`` and raises :class:`ConfigError` naming the field, so a
bad flag or a bad config.json fails before any work starts.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

PROFILES_DIR = Path(__file__).resolve().parents[1] / "profiles"  # the shipped profiles: <gpu>/<model>/


def gpu_short_name(name: str) -> str:
    """'NVIDIA H200' -> 'h200', 'NVIDIA A100-SXM4-80GB' -> 'a100'; the folder name of a profile."""
    import re

    m = re.search(r"\b([A-Z]\d{2,3}[A-Z]?)\b", name.upper())
    return m.group(1).lower() if m else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field (and file, where there is one)."""


def _positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{type(obj).__name__}.{name} must be a positive number, got {value!r}")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama-3 style RoPE frequency scaling (``rope_type: llama3`` in config.json)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        _positive(self, "factor", "low_freq_factor", "high_freq_factor", "original_max_position")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError("RopeScaling.high_freq_factor must exceed low_freq_factor")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Shapes of a Llama/Qwen-family decoder, per GPU where tensor parallelism splits them."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2
    tp: int = 1
    qkv_bias: bool = False  # Qwen2.5
    qk_norm: bool = False  # Qwen3
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    max_position: int = 8192

    def __post_init__(self) -> None:
        _positive(self, "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                  "intermediate_size", "vocab_size", "dtype_bytes", "tp", "rope_theta", "rms_norm_eps",
                  "max_position")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"ModelSpec.num_heads ({self.num_heads}) must be a multiple of "
                              f"num_kv_heads ({self.num_kv_heads})")
        for name in ("num_heads", "num_kv_heads", "intermediate_size"):
            if getattr(self, name) % self.tp:
                raise ConfigError(f"ModelSpec.tp={self.tp} must divide {name} ({getattr(self, name)})")

    # Per-GPU shapes (tensor parallelism splits heads and the FFN; norms and embeddings are replicated).
    @property
    def heads_per_gpu(self) -> int:
        return self.num_heads // self.tp

    @property
    def kv_heads_per_gpu(self) -> int:
        return self.num_kv_heads // self.tp

    @property
    def ffn_per_gpu(self) -> int:
        return self.intermediate_size // self.tp

    @property
    def q_size(self) -> int:
        return self.heads_per_gpu * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads_per_gpu * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers, on one GPU."""
        return 2 * self.num_layers * self.kv_size * self.dtype_bytes

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer on one GPU (matrices, biases, norms)."""
        h = self.hidden_size
        qkv = h * (self.q_size + 2 * self.kv_size) + (self.q_size + 2 * self.kv_size) * self.qkv_bias
        return qkv + self.q_size * h + 3 * h * self.ffn_per_gpu + 2 * h + 2 * self.head_dim * self.qk_norm

    @property
    def weight_bytes(self) -> int:
        """All weights on one GPU (embeddings and LM head replicated here; vocab-parallel would halve them)."""
        embed = self.vocab_size * self.hidden_size
        lm_head = 0 if self.tie_embeddings else embed
        return (self.num_layers * self.layer_params + embed + lm_head + self.hidden_size) * self.dtype_bytes

    def with_tp(self, tp: int) -> ModelSpec:
        return replace(self, tp=tp)

    @classmethod
    def from_hf_config(cls, path: str | Path, name: str | None = None, tp: int = 1) -> ModelSpec:
        """Read a Hugging Face ``config.json`` (a file or a folder holding one) of a Llama/Qwen model."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        try:
            cfg = json.loads(file.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{file}: no such file") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{file}:{e.lineno}: not valid JSON ({e.msg})") from None

        def need(key: str):
            if key not in cfg:
                raise ConfigError(f"{file}: missing field {key!r}")
            return cfg[key]

        arch = " ".join(cfg.get("architectures") or [cfg.get("model_type", "")]).lower()
        if not any(k in arch for k in ("llama", "qwen2", "qwen3")):
            raise ConfigError(f"{file}: architectures {cfg.get('architectures')!r} is not Llama/Qwen2/Qwen3")
        heads = need("num_attention_heads")
        scaling = cfg.get("rope_scaling") or None
        rope = None
        if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
            rope = RopeScaling(float(scaling["factor"]), float(scaling["low_freq_factor"]),
                               float(scaling["high_freq_factor"]),
                               int(scaling["original_max_position_embeddings"]))
        try:
            return cls(
                name=name or cfg.get("_name_or_path") or file.parent.name,
                num_layers=need("num_hidden_layers"),
                hidden_size=need("hidden_size"),
                num_heads=heads,
                num_kv_heads=cfg.get("num_key_value_heads", heads),
                head_dim=cfg.get("head_dim") or need("hidden_size") // heads,
                intermediate_size=need("intermediate_size"),
                vocab_size=need("vocab_size"),
                dtype_bytes={"float32": 4}.get(cfg.get("torch_dtype", "bfloat16"), 2),
                tp=tp,
                qkv_bias=bool(cfg.get("attention_bias", "qwen2" in arch)),
                qk_norm="qwen3" in arch,
                tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                rope_theta=float(cfg.get("rope_theta", 10000.0)),
                rope_scaling=rope,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                max_position=int(cfg.get("max_position_embeddings", 8192)),
            )
        except ConfigError as e:
            raise ConfigError(f"{file}: {e}") from None


_LLAMA3_ROPE = RopeScaling(8.0, 1.0, 4.0, 8192)

# Shapes from the models' published config.json files.
MODELS: dict[str, ModelSpec] = {
    "llama-3.1-8b": ModelSpec("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256, rope_theta=500000.0,
                              rope_scaling=_LLAMA3_ROPE, max_position=131072),
    # 70B is served with tensor parallelism; tp=8 as in the Bullet paper's evaluation.
    "llama-3.1-70b": ModelSpec("llama-3.1-70b", 80, 8192, 64, 8, 128, 28672, 128256, tp=8,
                               rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE, max_position=131072),
    "qwen2.5-7b": ModelSpec("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064, qkv_bias=True,
                            rope_theta=1e6, rms_norm_eps=1e-6, max_position=32768),
    "qwen3-8b": ModelSpec("qwen3-8b", 36, 4096, 32, 8, 128, 12288, 151936, qk_norm=True,
                          rope_theta=1e6, rms_norm_eps=1e-6, max_position=40960),
    # A tiny Llama for CPU tests of the real executor path (not a real checkpoint).
    "tiny-llama": ModelSpec("tiny-llama", 2, 64, 4, 2, 16, 128, 256, rope_theta=10000.0, max_position=2048),
}


def resolve_model(name_or_path: str, tp: int | None = None) -> ModelSpec:
    """A preset name (case-insensitive) or a path to a config.json / model folder."""
    key = name_or_path.lower()
    if key in MODELS:
        spec = MODELS[key]
        return spec if tp is None else spec.with_tp(tp)
    path = Path(name_or_path)
    if path.exists():
        return ModelSpec.from_hf_config(path, tp=tp or 1)
    raise ConfigError(f"unknown model {name_or_path!r}: use one of {', '.join(MODELS)} or a config.json path")


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One GPU. ``peak_flops``, ``hbm_bandwidth``, ``memory_bytes`` and ``l2_bytes`` are vendor datasheet
    figures, the ceilings no prediction may beat (the roofline's efficiencies are fractions of them);
    ``*_measured`` fields are our own measurements, kept for reference (None where not measured)."""

    name: str
    num_sms: int
    sm_granule: int  # green-context partitions come in multiples of this many SMs
    sm_remainder: int  # SMs left over when the driver splits the device into granule groups (nested_sizes)
    peak_flops: float  # dense bf16 tensor-core FLOP/s, datasheet
    hbm_bandwidth: float  # bytes/s, datasheet
    memory_bytes: int
    l2_bytes: int
    matmul_flops_measured: float | None = None  # bf16 8192^3 GEMM, full GPU
    copy_bandwidth_measured: float | None = None  # device-to-device copy, reads + writes

    def __post_init__(self) -> None:
        _positive(self, "num_sms", "sm_granule", "peak_flops", "hbm_bandwidth", "memory_bytes", "l2_bytes")
        if self.sm_remainder < 0:
            raise ConfigError("GpuSpec.sm_remainder must be >= 0")
        for measured, peak in (("matmul_flops_measured", "peak_flops"), ("copy_bandwidth_measured", "hbm_bandwidth")):
            value = getattr(self, measured)
            if value is not None:
                _positive(self, measured)
                if value > getattr(self, peak):
                    raise ConfigError(f"GpuSpec.{measured} ({value:g}) exceeds the datasheet {peak} "
                                      f"({getattr(self, peak):g})")
        nested_sizes(self.num_sms, self.sm_granule, self.sm_remainder)  # validates the split

    @property
    def prefill_sizes(self) -> tuple[int, ...]:
        """SM counts a prefill launch may ask for (see :func:`nested_sizes`)."""
        return nested_sizes(self.num_sms, self.sm_granule, self.sm_remainder)[0]

    @property
    def decode_sizes(self) -> tuple[int, ...]:
        """SM counts a decode launch may ask for (see :func:`nested_sizes`)."""
        return nested_sizes(self.num_sms, self.sm_granule, self.sm_remainder)[1]


def nested_sizes(num_sms: int, granule: int, remainder: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The nested partition menu: ``(prefill sizes, decode sizes)``, each ascending and ending with the whole
    GPU. The device is split once into ``G`` groups of ``granule`` SMs plus ``remainder`` SMs; a prefill
    partition is the remainder plus groups taken from one end (``remainder + granule * k``), a decode
    partition groups from the other end (``granule * j``), ``1 <= k, j < G``. So any prefill size ``p`` and
    decode size ``d`` with ``p + d <= num_sms`` are disjoint (:func:`check_corun`). The remainder goes to
    prefill: skinny decode GEMMs gain nothing from it, big prefill GEMMs do (docs/background.md, measured on the
    H200), and alone it is too small to be worth a context (cuBLAS failed on the H200's 12-SM remainder).
    The whole GPU (``num_sms``) is an ordinary stream, not a green context."""
    groups = (num_sms - remainder) // granule
    if groups < 2 or remainder + groups * granule != num_sms:
        raise ConfigError(f"{num_sms} SMs do not split into groups of {granule} plus a {remainder}-SM remainder")
    prefill = tuple(remainder + granule * k for k in range(1, groups)) + (num_sms,)
    decode = tuple(granule * j for j in range(1, groups)) + (num_sms,)
    return prefill, decode


class PartitionError(ValueError):
    """A launch asked for a partition the menu does not have, or one that overlaps the other lane's."""


def check_corun(prefill_sms: int, decode_sms: int, num_sms: int) -> None:
    """Two launches may run at once on the nested menu only if their partitions are disjoint:
    ``prefill_sms + decode_sms <= num_sms``, or both lanes on the whole GPU (naive concurrency: two ordinary
    streams that the hardware scheduler shares out). Anything else would share SMs unknowingly."""
    if prefill_sms + decode_sms <= num_sms or prefill_sms == decode_sms == num_sms:
        return
    raise PartitionError(f"prefill on {prefill_sms} SMs and decode on {decode_sms} SMs overlap on a "
                         f"{num_sms}-SM GPU: disjoint partitions need prefill + decode <= {num_sms} (or both "
                         f"lanes on the whole GPU)")


GB = 10**9
# Sources. Datasheets: "NVIDIA H200 Tensor Core GPU" (H200 SXM: 989 TFLOP/s dense BF16 -- 1,979 with
# sparsity --, 4.8 TB/s HBM3e, 141 GB), "NVIDIA H100 Tensor Core GPU" (H100 SXM: 989 TFLOP/s dense BF16,
# 3.35 TB/s HBM3, 80 GB), "NVIDIA A100 Tensor Core GPU" (A100 SXM 80GB: 312 TFLOP/s dense BF16, 2,039 GB/s
# HBM2e, 80 GB). SM counts and L2 sizes: NVIDIA's Hopper and Ampere architecture whitepapers (H100 SXM5: 132
# SMs, 50 MB L2; A100: 108 SMs, 40 MB L2). Measured on our H200 (driver 580, CUDA 13.0; bench/RESULTS.md and
# docs/background.md): 132 SMs, 60 MB L2 (as reported by the device), 791 TFLOP/s bf16 8192^3 GEMM, ~4.3 TB/s
# device copy, 8-SM green-context granule, 15 groups of 8 plus a 12-SM remainder.
# Green-context granules: CUDA driver API docs of cuDevSmResourceSplitByCount (compute 9.x: multiples of 8 SMs;
# 8.x: multiples of 2, at least 4).
GPUS: dict[str, GpuSpec] = {
    "h200": GpuSpec("h200", 132, 8, 12, 989e12, 4.8e12, 141 * GB, 60 * 2**20, 791e12, 4.3e12),
    # H100 SXM 80 GB: datasheet and whitepaper figures only; the 15 x 8 + 12 split is assumed from the H200,
    # whose GH100 die has the same 132-SM configuration (not measured).
    "h100": GpuSpec("h100", 132, 8, 12, 989e12, 3.35e12, 80 * GB, 50 * 2**20),
    # A100 SXM 80 GB: datasheet and whitepaper figures only; 108 SMs assumed to split into 54 pairs with no
    # remainder (not measured).
    "a100": GpuSpec("a100", 108, 2, 0, 312e12, 2.039e12, 80 * GB, 40 * 2**20),
}


def resolve_gpu(name: str) -> GpuSpec:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown GPU {name!r}: use one of {', '.join(GPUS)}") from None


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_blocks: int | None = None  # fixed pool size; None sizes it from memory
    activation_bytes: int = 2 * GB  # workspace reserved for activations, graphs and partitions
    prefix_caching: bool = True  # reuse the KV of full prompt blocks another request computed (vLLM V1's default)

    def __post_init__(self) -> None:
        _positive(self, "block_size", "gpu_memory_utilization", "activation_bytes")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("CacheConfig.gpu_memory_utilization must be in (0, 1]")
        if self.num_blocks is not None:
            _positive(self, "num_blocks")

    def blocks_for(self, model: ModelSpec, gpu: GpuSpec) -> int:
        """KV blocks that fit after weights and the activation workspace."""
        if self.num_blocks is not None:
            return self.num_blocks
        free = gpu.memory_bytes * self.gpu_memory_utilization - model.weight_bytes - self.activation_bytes
        blocks = int(free // (model.kv_bytes_per_token * self.block_size))
        if blocks <= 0:
            raise ConfigError(f"model {model.name} (tp={model.tp}) leaves no memory for the KV cache on "
                              f"{gpu.name}: weights {model.weight_bytes / GB:.1f} GB")
        return blocks


@dataclass(frozen=True, slots=True)
class SloConfig:
    """Latency targets in seconds. TTFT is either absolute or per prompt token (as in the Bullet paper)."""

    ttft: float | None = 3.0
    tpot: float | None = 0.15
    ttft_per_token: float | None = None  # overrides ``ttft`` when set

    def __post_init__(self) -> None:
        for name in ("ttft", "tpot", "ttft_per_token"):
            if getattr(self, name) is not None:
                _positive(self, name)

    def ttft_target(self, prompt_len: int) -> float | None:
        return self.ttft_per_token * prompt_len if self.ttft_per_token is not None else self.ttft

    @property
    def absolute_ttft(self) -> bool:
        """Whether the TTFT target is the same for every prompt (not per token, and set)."""
        return self.ttft_per_token is None and self.ttft is not None


# SLO sets by name (``bullet simulate --slo``). The paper's are the Bullet paper's evaluation SLOs per workload
# (Lin et al., arXiv 2504.19516): TTFT per prompt token and TPOT. ``tight`` is an interactive target of this
# project's policy study (bench/policy_study.py): 500 ms to the first token, 50 ms per output token.
SLO_PRESETS: dict[str, SloConfig] = {
    "paper-sharegpt": SloConfig(ttft=None, ttft_per_token=3.0e-3, tpot=0.150),
    "paper-azure-code": SloConfig(ttft=None, ttft_per_token=1.5e-3, tpot=0.200),
    "paper-arxiv": SloConfig(ttft=None, ttft_per_token=1.5e-3, tpot=0.175),
    "tight": SloConfig(ttft=0.5, tpot=0.050),
}


PolicyName = Literal["chunked", "prefill-first", "static-split", "naive-concurrent", "bullet"]
POLICIES: tuple[str, ...] = ("chunked", "prefill-first", "static-split", "naive-concurrent", "bullet")
SINGLE_LANE: tuple[str, ...] = ("chunked", "prefill-first")  # policies that run every launch on the whole GPU


BULLET_LAYERS_PER_STEP = 8  # bullet's prefill slice when layers_per_step is not given


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    policy: PolicyName = "chunked"
    max_num_seqs: int = 256  # running requests at most
    max_batched_tokens: int = 8192  # token budget of one step (the chunk size for prefill-first)
    prefill_sms: int = 92  # static-split: SMs of the prefill lane (the nested menu's); decode gets the rest
    layers_per_step: int | None = None  # split lanes: prefill layers per launch (None: all; bullet: 8)
    max_decode_steps: int = 1 << 30  # cap on decode steps fused into one launch (between events)
    # bullet: a predicted decode step must fit each request's TPOT budget with this much to spare (model error)
    slo_margin: float = 0.1
    admission_control: bool = False  # bullet: reject at once a request predicted to miss its TTFT (else best-effort)
    # bullet: under overload, while seats are scarce, defer the costliest arrivals (ordered as late requests) until
    # arrivals lull (bench/RESULTS.md: sharegpt paper capacity 1.25x -> 1.33x the best baseline)
    overload_deferral: bool = True
    decode_sizes: tuple[int, ...] | None = None  # bullet: the decode partition sizes it may use (None: the menu)
    # plan each launch while the one before it runs (the engine's host time hidden); single-lane policies only
    async_scheduling: bool = False

    def prefill_layers(self, num_layers: int) -> int:
        """Layers of one prefill launch: ``layers_per_step``; unset, bullet's slice (:data:`BULLET_LAYERS_PER_STEP`)
        and every other policy's whole forward. The policy slices so, and the GPU executor captures its prefill
        graphs for those slices (``prepare_graphs``)."""
        if self.layers_per_step:
            return self.layers_per_step
        return BULLET_LAYERS_PER_STEP if self.policy == "bullet" else num_layers

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"SchedulerConfig.policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        _positive(self, "max_num_seqs", "max_batched_tokens", "prefill_sms", "max_decode_steps")
        if self.layers_per_step is not None:
            _positive(self, "layers_per_step")
        if not 0 <= self.slo_margin < 1:
            raise ConfigError("SchedulerConfig.slo_margin must be in [0, 1)")
        if self.decode_sizes is not None and not self.decode_sizes:
            raise ConfigError("SchedulerConfig.decode_sizes must name at least one size")
        if self.async_scheduling and self.policy not in SINGLE_LANE:
            raise ConfigError(f"async scheduling is built for the single-lane policies ({', '.join(SINGLE_LANE)}), "
                              f"not {self.policy}: its two lanes run side by side and would need ordering across "
                              "lanes")
