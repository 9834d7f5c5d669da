"""Weights of a Llama/Qwen-family decoder under their Hugging Face names: seeded dummies or a local folder.

The returned dict is keyed by the checkpoint's own names (``model.layers.N.self_attn.q_proj.weight``, ...);
:class:`bullet.gpu.model.Model` fuses what it launches together (q/k/v, gate/up) when it is built.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..config import ModelSpec


class WeightError(ValueError):
    """A checkpoint does not match the model's shapes; the message names the tensors."""


# Tensors split by tensor parallelism: the output dimension (rows) or the input dimension (columns).
_ROW_SPLIT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_COL_SPLIT = ("o_proj", "down_proj")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def expected_shapes(spec: ModelSpec, per_gpu: bool = True) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, with its shape (per GPU under tensor parallelism, or whole)."""
    tp = spec.tp if per_gpu else 1
    h, d = spec.hidden_size, spec.head_dim
    q, kv, f = spec.num_heads * d // tp, spec.num_kv_heads * d // tp, spec.intermediate_size // tp
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, h),
                                          "model.norm.weight": (h,)}
    if not spec.tie_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
        })
        if spec.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if spec.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
    return shapes


def check_weights(spec: ModelSpec, weights: dict[str, torch.Tensor], per_gpu: bool = True,
                  where: str = "weights") -> None:
    """Raise :class:`WeightError` naming every missing, unexpected or mis-shaped tensor."""
    want = expected_shapes(spec, per_gpu)
    missing = [n for n in want if n not in weights]
    extra = [n for n in weights if n not in want and not _ignorable(spec, n)]
    bad = [f"{n}: expected {list(want[n])}, got {list(weights[n].shape)}"
           for n in want if n in weights and tuple(weights[n].shape) != want[n]]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): " + _names(missing, want))
    if extra:
        problems.append(f"unexpected {len(extra)} tensor(s): " + ", ".join(
            f"{n} {list(weights[n].shape)}" for n in extra[:8]) + (" ..." if len(extra) > 8 else ""))
    if bad:
        problems.append(f"{len(bad)} mis-shaped tensor(s): " + "; ".join(bad[:8]) + (" ..." if len(bad) > 8 else ""))
    if problems:
        raise WeightError(f"{where} do not fit model {spec.name}: " + " | ".join(problems))


def _names(names: list[str], shapes: dict[str, tuple[int, ...]]) -> str:
    shown = ", ".join(f"{n} {list(shapes[n])}" for n in names[:8])
    return shown + (" ..." if len(names) > 8 else "")


def _ignorable(spec: ModelSpec, name: str) -> bool:
    return name.endswith(_IGNORED_SUFFIXES) or (spec.tie_embeddings and name == "lm_head.weight")


def load_weights(spec: ModelSpec, source: str | Path, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.bfloat16, *, seed: int = 0, scale: float = 1.0,
                 rank: int = 0) -> dict[str, torch.Tensor]:
    """``source == "dummy"``: seeded random weights (matrices with std ``scale / sqrt(fan_in)``, norms near 1,
    small biases) made on ``device``; else a local Hugging Face folder (config.json + *.safetensors, single or
    sharded with model.safetensors.index.json). Under tensor parallelism (``spec.tp > 1``) a folder's
    tensors are cut to GPU ``rank``'s share."""
    if str(source) == "dummy":
        return dummy_weights(spec, device, dtype, seed=seed, scale=scale)
    return _load_folder(spec, Path(source), torch.device(device), dtype, rank)


def dummy_weights(spec: ModelSpec, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
                  *, seed: int = 0, scale: float = 1.0) -> dict[str, torch.Tensor]:
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(spec).items():
        t = torch.empty(shape, device=device, dtype=torch.float32)
        if name.endswith("norm.weight"):  # RMSNorm gains near 1
            t.normal_(1.0, 0.1, generator=gen)
        elif name.endswith(".bias"):
            t.normal_(0.0, 0.1 * scale, generator=gen)
        elif name == "model.embed_tokens.weight":
            t.normal_(0.0, 1.0, generator=gen)
        else:
            t.normal_(0.0, scale / math.sqrt(shape[1]), generator=gen)
        out[name] = t.to(dtype)
    return out


def _load_folder(spec: ModelSpec, folder: Path, device: torch.device, dtype: torch.dtype,
                 rank: int) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    if not folder.is_dir():
        raise WeightError(f"{folder}: not a folder (expected a Hugging Face model folder or 'dummy')")
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise WeightError(f"{index}: not a safetensors index ({e})") from None
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise WeightError(f"{folder}: no *.safetensors files")
    want = expected_shapes(spec, per_gpu=False)
    raw: dict[str, torch.Tensor] = {}
    for fname in files:
        path = folder / fname
        if not path.exists():
            raise WeightError(f"{index}: names shard {fname}, which does not exist")
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                if _ignorable(spec, name):
                    continue
                if name not in want:  # keep only its shape for the error message
                    raw[name] = torch.empty(f.get_slice(name).get_shape(), device="meta")
                    continue
                raw[name] = f.get_tensor(name)
    check_weights(spec, raw, per_gpu=False, where=str(folder))
    out = {}
    for name, t in raw.items():
        t = _shard(name, t, spec.tp, rank)
        out[name] = t.to(device=device, dtype=dtype, non_blocking=False).contiguous()
    return out


def _shard(name: str, t: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    if tp == 1:
        return t
    if any(f".{k}." in name for k in _ROW_SPLIT):
        return t.chunk(tp, dim=0)[rank]
    if any(f".{k}." in name for k in _COL_SPLIT):
        return t.chunk(tp, dim=1)[rank]
    return t


def load_tokenizer(folder: str | Path):
    """The folder's ``tokenizer.json`` as a :class:`tokenizers.Tokenizer`, or None where there is none."""
    path = Path(folder) / "tokenizer.json"
    if not path.exists():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def save_folder(spec: ModelSpec, weights: dict[str, torch.Tensor], folder: str | Path,
                shards: int = 1) -> Path:
    """Write ``weights`` as a Hugging Face-style folder (config.json + safetensors, sharded with an index
    when ``shards > 1``). For tests and for making small local checkpoints."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["Qwen3ForCausalLM" if spec.qk_norm else
                          "Qwen2ForCausalLM" if spec.qkv_bias else "LlamaForCausalLM"],
        "num_hidden_layers": spec.num_layers, "hidden_size": spec.hidden_size,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim, "intermediate_size": spec.intermediate_size, "vocab_size": spec.vocab_size,
        "rms_norm_eps": spec.rms_norm_eps, "rope_theta": spec.rope_theta,
        "max_position_embeddings": spec.max_position, "tie_word_embeddings": spec.tie_embeddings,
        "attention_bias": spec.qkv_bias, "torch_dtype": "bfloat16",
    }
    if spec.rope_scaling is not None:
        r = spec.rope_scaling
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": r.factor, "low_freq_factor": r.low_freq_factor,
                               "high_freq_factor": r.high_freq_factor,
                               "original_max_position_embeddings": r.original_max_position}
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    names = list(weights)
    cpu = {n: weights[n].detach().to("cpu").contiguous() for n in names}
    if shards == 1:
        save_file(cpu, str(folder / "model.safetensors"))
        return folder
    groups = [names[i::shards] for i in range(shards)]
    weight_map = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: cpu[n] for n in group}, str(folder / fname))
        weight_map.update({n: fname for n in group})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder
