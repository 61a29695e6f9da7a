"""The family registry: lookups by HF architecture, and sizes that derive from the declarations.

Parameter counts and KV bytes per token are sums over the declared arrays (`model.families`);
these tests hold them to the arrays that `init_params` / `init_cache` actually build, so a
declaration change cannot leave a count behind.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from model import quant
from model.cache import cache_bytes, init_cache
from model.config import LlamaConfig, ModelConfig, UnsupportedModelError, config_by_name, from_hf_config
from model.convert_hf import conversion_plan
from model.families import (FAMILIES, family_for_architectures, family_for_config, family_for_hf_config,
                            kv_bytes_per_token, num_params, supported_architectures)
from model.families.llama import LLAMA
from model.families.mixtral import MIXTRAL
from model.families.qwen3_moe import QWEN3_MOE
from model.params import abstract_params, flatten_params, init_params

CONFIGS = {
    "gqa_tied": tiny_config(num_heads=4, num_kv_heads=2, tie_word_embeddings=True),
    "mha_untied": tiny_config(num_heads=4, num_kv_heads=4, tie_word_embeddings=False),
    "mqa_untied_bf16": tiny_config(num_heads=4, num_kv_heads=1, head_dim=8, dtype="bfloat16"),
}


# --- lookups ---

def test_llama_is_the_registered_family():
    assert FAMILIES == (LLAMA, MIXTRAL, QWEN3_MOE)
    assert supported_architectures() == ["LlamaForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM"]
    assert family_for_architectures(["LlamaForCausalLM"]) is LLAMA
    assert family_for_architectures([], model_type="llama") is LLAMA  # exports without `architectures`
    assert family_for_hf_config({"architectures": ["LlamaForCausalLM"]}) is LLAMA
    assert family_for_config(config_by_name("tiny")) is LLAMA
    assert ModelConfig is LlamaConfig


@pytest.mark.parametrize("names,model_type", [(["GPT2LMHeadModel"], "gpt2"), (["MistralForCausalLM"], "mistral"),
                                              ([], None)])
def test_unsupported_architecture_names_what_is_supported(names, model_type):
    with pytest.raises(UnsupportedModelError, match="unsupported architecture") as err:
        family_for_architectures(names, model_type)
    assert "LlamaForCausalLM" in str(err.value) and repr(model_type) in str(err.value)
    # Config loading goes through the same lookup and raises the same error.
    with pytest.raises(UnsupportedModelError, match="supported: LlamaForCausalLM"):
        from_hf_config({"architectures": names, "model_type": model_type, "vocab_size": 10})


def test_unknown_config_class_is_refused():
    with pytest.raises(UnsupportedModelError, match="LlamaConfig"):
        family_for_config(object())


def test_checkpoint_tensors_cover_the_declarations():
    """Every declared weight has one HF tensor, and its relayout gives the declared shape."""
    for cfg in CONFIGS.values():
        declared = {k: v.shape for k, v in flatten_params(abstract_params(cfg)).items()}
        plan = conversion_plan(cfg)
        assert [t.ours for t in plan] == list(declared)
        for t in plan:
            assert t.relayout(np.zeros(t.hf_shape)).shape == declared[t.ours], t.hf


# --- sizes from the declarations ---

@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_num_params_equals_initialised_params(name):
    cfg = CONFIGS[name]
    params = init_params(cfg, jax.random.PRNGKey(0))
    assert num_params(cfg) == cfg.num_params() == sum(x.size for x in jax.tree.leaves(params))


def test_num_params_of_quantized_weights_counts_data_not_scales():
    cfg = CONFIGS["mha_untied"]
    qcfg = cfg.replace(weight_dtype="int8")
    params = init_params(qcfg, jax.random.PRNGKey(0))
    data = sum(leaf.data.size if quant.is_quantized(leaf) else leaf.size
               for leaf in jax.tree.leaves(params, is_leaf=quant.is_quantized))
    assert num_params(qcfg) == data == num_params(cfg)


def test_num_params_of_a_preset_needs_no_arrays():
    """The planner sizes presets it could never allocate; the count is the published one."""
    cfg = config_by_name("llama3-405b")
    assert num_params(cfg) / 1e9 == pytest.approx(405.9, rel=0.01)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("kv_dtype", [None, "float32", "int8", "fp8"])
def test_kv_bytes_per_token_equals_initialised_cache(name, kv_dtype):
    cfg = CONFIGS[name]
    num_pages, page_size = 3, 4
    cache = init_cache(cfg, num_pages, page_size, kv_dtype)
    per_token = cache_bytes(cache) / (num_pages * page_size)
    assert kv_bytes_per_token(cfg, kv_dtype) == per_token
    assert quant.kv_bytes_per_token(cfg, quant.kv_cache_dtype(cfg, kv_dtype)) == per_token  # the engine's call


def test_kv_bytes_per_token_layout():
    """K and V of every layer, one fp32 scale per KV head beside each int8 / fp8 row."""
    cfg = CONFIGS["gqa_tied"]
    L, nkv, d = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    assert kv_bytes_per_token(cfg) == 2 * L * nkv * d * 4
    assert kv_bytes_per_token(cfg, jnp.int8) == 2 * L * nkv * (d + quant.SCALE_BYTES)
    # Nominal width (cost models, the planner's int4): the elements at that price, no scales.
    assert cfg.kv_bytes_per_token(1) == kv_bytes_per_token(cfg, bytes_per_element=1) == 2 * L * nkv * d
    assert kv_bytes_per_token(cfg, bytes_per_element=0.5) == L * nkv * d


def test_planner_kv_bytes_come_from_the_declaration():
    from sharding.estimate import PlanInputs, plan
    from sharding.hardware import get_gpu

    cfg = config_by_name("llama3-8b")
    for kv_dtype, real in (("bfloat16", "bfloat16"), ("float32", "float32"), ("int8", "int8"), ("fp8", "fp8"),
                           ("float8", "fp8")):
        mem = plan(PlanInputs(cfg=cfg, gpu=get_gpu("h200"), kv_dtype=kv_dtype))["memory"]
        assert mem["kv_bytes_per_token"] == kv_bytes_per_token(cfg, real), kv_dtype
    mem = plan(PlanInputs(cfg=cfg, gpu=get_gpu("h200"), kv_dtype="int4"))["memory"]
    assert mem["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 0.5
