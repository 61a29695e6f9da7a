"""LlamaConfig: HF config.json of transformers 4 and 5, our own JSON, named shapes, validation."""

from __future__ import annotations

import json

import pytest

from model.config import CONFIGS_DIR, LlamaConfig, RopeScaling, UnsupportedModelError
from model.families import config_by_name, from_hf_config, num_params

# Llama-3.1-8B's config.json as transformers 4 writes it: rope settings flat, `torch_dtype`.
HF4_LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}

# The same model as transformers 5 writes it: `rope_parameters` holds theta and scaling, `dtype`.
HF5_LLAMA31_8B = {
    k: v for k, v in HF4_LLAMA31_8B.items() if k not in ("rope_scaling", "rope_theta", "torch_dtype")
} | {
    "dtype": "bfloat16", "transformers_version": "5.0.0",
    "rope_parameters": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                        "original_max_position_embeddings": 8192, "rope_theta": 500000.0, "rope_type": "llama3"},
}

# Llama-3.2-1B-like, no rope scaling, tied head, fp32; transformers 4 and 5 variants.
HF4_SMALL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000, "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
             "rope_theta": 10000.0, "rope_scaling": None, "torch_dtype": "float32", "tie_word_embeddings": True,
             "rms_norm_eps": 1e-6, "eos_token_id": 2, "bos_token_id": 1}
HF5_SMALL = {k: v for k, v in HF4_SMALL.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")} | {
    "dtype": "float32", "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}

LLAMA31_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=8192)


@pytest.mark.parametrize("hf", [HF4_LLAMA31_8B, HF5_LLAMA31_8B], ids=["transformers4", "transformers5"])
def test_llama31_8b_both_layouts(hf):
    cfg = from_hf_config(hf)
    assert cfg == config_by_name("llama3-8b")
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == LLAMA31_SCALING
    assert cfg.dtype == "bfloat16"
    assert cfg.head_dim == 128 and cfg.num_kv_heads == 8
    assert cfg.eos_token_ids == (128001, 128008, 128009) and cfg.bos_token_id == 128000


@pytest.mark.parametrize("hf", [HF4_SMALL, HF5_SMALL], ids=["transformers4", "transformers5"])
def test_small_both_layouts(hf):
    cfg = from_hf_config(hf)
    assert cfg.rope_scaling is None
    assert cfg.rope_theta == 10000.0
    assert cfg.dtype == "float32"
    assert cfg.tie_word_embeddings
    assert cfg.head_dim == 16  # hidden / heads when head_dim is absent
    assert cfg.num_kv_heads == 1
    assert cfg.rms_norm_eps == 1e-6
    assert cfg.eos_token_ids == (2,)


def test_both_layouts_agree():
    assert from_hf_config(HF4_SMALL) == from_hf_config(HF5_SMALL)
    assert from_hf_config(HF4_LLAMA31_8B) == from_hf_config(HF5_LLAMA31_8B)


def test_transformers_written_config_matches():
    """The installed transformers' own serialisation (whichever major version) parses the same."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, rope_theta=500000.0, max_position_embeddings=4096,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}, tie_word_embeddings=True)
    cfg = from_hf_config(json.loads(hf.to_json_string()) | {"architectures": ["LlamaForCausalLM"]})
    assert cfg.head_dim == 24 and cfg.num_kv_heads == 2 and cfg.tie_word_embeddings
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)


def test_legacy_scaling_key_and_default_rope():
    legacy = dict(HF4_SMALL, rope_scaling={"type": "llama3", "factor": 2.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 2.0, "original_max_position_embeddings": 512})
    assert from_hf_config(legacy).rope_scaling == RopeScaling(2.0, 1.0, 2.0, 512)
    assert from_hf_config(dict(HF4_SMALL, rope_scaling={"rope_type": "default"})).rope_scaling is None
    no_theta = {k: v for k, v in HF4_SMALL.items() if k != "rope_theta"}
    assert from_hf_config(no_theta).rope_theta == 10000.0  # HF's default


def test_dtype_override_and_fallback():
    assert from_hf_config(HF4_LLAMA31_8B, dtype="float32").dtype == "float32"
    no_dtype = {k: v for k, v in HF4_SMALL.items() if k != "torch_dtype"}
    assert from_hf_config(no_dtype).dtype == "bfloat16"
    assert from_hf_config(dict(HF5_SMALL, dtype="float16")).dtype == "float16"


@pytest.mark.parametrize("change,match", [
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "unsupported architecture"),
    ({"model_type": "falcon", "architectures": ["FalconForCausalLM"]}, "unsupported architecture"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope scaling type 'yarn'"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "unsupported rope scaling type 'dynamic'"),
    ({"attention_bias": True}, "biases"),
    ({"mlp_bias": True}, "biases"),
    ({"hidden_act": "gelu"}, "gelu"),
    ({"quantization_config": {"quant_method": "gptq"}}, "gptq"),
])
def test_unsupported_models(change, match):
    with pytest.raises(UnsupportedModelError, match=match):
        from_hf_config(dict(HF4_SMALL, **change))


def test_unsupported_rope_in_transformers5_layout():
    hf = dict(HF5_SMALL, rope_parameters={"rope_theta": 1e4, "rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        from_hf_config(hf)


def test_missing_required_field():
    hf = {k: v for k, v in HF4_SMALL.items() if k != "intermediate_size"}
    with pytest.raises(ValueError, match="intermediate_size"):
        from_hf_config(hf)


@pytest.mark.parametrize("change,match", [
    ({"num_kv_heads": 3}, "multiple of num_kv_heads"),
    ({"dtype": "float64"}, "dtype must be one of"),
    ({"hidden_size": 0}, "hidden_size must be positive"),
    ({"num_layers": -1}, "num_layers must be positive"),
])
def test_validation(change, match):
    base = config_by_name("tiny").to_dict()
    with pytest.raises(ValueError, match=match):
        LlamaConfig.from_dict(base | change)


def test_unknown_field_rejected():
    with pytest.raises(ValueError, match="unknown model config fields"):
        LlamaConfig.from_dict(config_by_name("tiny").to_dict() | {"n_experts": 8})


@pytest.mark.parametrize("name", ["tiny", "llama3-1b", "llama3-3b", "llama3-8b", "llama3-70b", "llama3-405b"])
def test_named_configs_round_trip(name, tmp_path):
    cfg = config_by_name(name)
    path = str(tmp_path / "c.json")
    cfg.save(path)
    assert LlamaConfig.load(path) == cfg
    assert config_by_name(path) == cfg
    hash(cfg)  # usable as a static jit argument


@pytest.mark.parametrize("name,billions", [("llama3-1b", 1.24), ("llama3-3b", 3.21), ("llama3-8b", 8.03),
                                           ("llama3-70b", 70.6), ("llama3-405b", 405.9)])
def test_named_configs_parameter_counts(name, billions):
    """The public Llama-3 sizes (tied heads for 1B/3B) as published."""
    assert num_params(config_by_name(name)) / 1e9 == pytest.approx(billions, rel=0.01)


def test_config_by_name_reads_hf_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(HF5_LLAMA31_8B))
    assert config_by_name(str(path)) == config_by_name("llama3-8b")


def test_unknown_name():
    with pytest.raises(FileNotFoundError, match="known:.*tiny"):
        config_by_name("llama3-9000b")
    assert CONFIGS_DIR.endswith("configs")
