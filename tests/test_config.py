"""Model and GPU presets, Hugging Face config.json loading, validation messages."""

import json

import pytest

from bullet.config import (
    GPUS,
    MODELS,
    CacheConfig,
    ConfigError,
    ModelSpec,
    SchedulerConfig,
    SloConfig,
    resolve_model,
)


def test_llama_8b_shapes():
    m = MODELS["llama-3.1-8b"]
    # 8.03 B parameters (published); our count: layers + embeddings + LM head + final norm
    params = m.weight_bytes / m.dtype_bytes
    assert params == pytest.approx(8.03e9, rel=0.01)
    assert m.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # 128 KiB per token


def test_qwen_shapes():
    assert MODELS["qwen2.5-7b"].weight_bytes / 2 == pytest.approx(7.62e9, rel=0.01)
    assert MODELS["qwen3-8b"].weight_bytes / 2 == pytest.approx(8.19e9, rel=0.01)


def test_70b_tensor_parallel():
    m = MODELS["llama-3.1-70b"]
    assert m.tp == 8 and m.heads_per_gpu == 8 and m.kv_heads_per_gpu == 1 and m.ffn_per_gpu == 3584
    with pytest.raises(ConfigError, match="tp=3 must divide num_heads"):
        m.with_tp(3)


def test_from_hf_config(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 32, "hidden_size": 4096,
           "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
           "vocab_size": 128256, "rope_theta": 500000.0, "max_position_embeddings": 131072,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = ModelSpec.from_hf_config(tmp_path, name="llama-3.1-8b")
    assert m == MODELS["llama-3.1-8b"]
    assert resolve_model(str(tmp_path / "config.json")).num_layers == 32


def test_from_hf_config_errors(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],\n "hidden_size": }')
    with pytest.raises(ConfigError, match=r"config.json:2: not valid JSON"):
        ModelSpec.from_hf_config(tmp_path)
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 64}')
    with pytest.raises(ConfigError, match="missing field 'num_attention_heads'"):
        ModelSpec.from_hf_config(tmp_path)
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ConfigError, match="not Llama"):
        ModelSpec.from_hf_config(tmp_path)


def test_kv_capacity_from_memory():
    m, g = MODELS["llama-3.1-8b"], GPUS["h200"]
    blocks = CacheConfig().blocks_for(m, g)
    free = 141e9 * 0.9 - m.weight_bytes - 2e9
    assert blocks == int(free // (m.kv_bytes_per_token * 16))
    with pytest.raises(ConfigError, match="no memory for the KV cache"):
        CacheConfig().blocks_for(MODELS["llama-3.1-70b"].with_tp(1), GPUS["a100"])


def test_validation_names_the_field():
    with pytest.raises(ConfigError, match="SchedulerConfig.max_batched_tokens"):
        SchedulerConfig(max_batched_tokens=0)
    with pytest.raises(ConfigError, match="policy"):
        SchedulerConfig(policy="fastest")
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=1.5)


def test_absolute_ttft_only_when_no_per_token_target_overrides_it():
    assert SloConfig().absolute_ttft and SloConfig(ttft=0.5, tpot=0.05).absolute_ttft
    assert not SloConfig(ttft_per_token=0.003).absolute_ttft  # (ttft keeps its 3 s default, overridden)
    assert not SloConfig(ttft=None, ttft_per_token=0.003).absolute_ttft
    assert not SloConfig(ttft=None).absolute_ttft
