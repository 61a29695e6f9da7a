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
from model.config import MOE_ARCHITECTURES, LlamaConfig, ModelConfig, UnsupportedModelError
from model.convert_hf import conversion_plan
from model.families import (FAMILIES, config_by_name, family_for_architectures, family_for_config,
                            family_for_hf_config, from_hf_config, kv_bytes_per_token, num_params,
                            supported_architectures)
from model.families.gemma import GEMMA2, GEMMA3
from model.families.llama import LLAMA
from model.families.mistral import MISTRAL
from model.families.phi3 import PHI3
from model.families.qwen import QWEN2, QWEN3
from model.families.mixtral import MIXTRAL
from model.families.qwen2_moe import QWEN2_MOE
from model.families.qwen3_moe import QWEN3_MOE
from model.families.qwen2_5_vl import QWEN2_5_VL_FAMILY
from model.families.gemma3_vl import GEMMA3_VL
from model.families.encoder import ENCODER
from model.params import abstract_params, flatten_params, init_params

CONFIGS = {
    "gqa_tied": tiny_config(num_heads=4, num_kv_heads=2, tie_word_embeddings=True),
    "mha_untied": tiny_config(num_heads=4, num_kv_heads=4, tie_word_embeddings=False),
    "mqa_untied_bf16": tiny_config(num_heads=4, num_kv_heads=1, head_dim=8, dtype="bfloat16"),
    # The other families' extra weights: biases, q/k norms, Gemma's sandwich norms; Phi-3's fused tensors.
    "qwen2_biases": tiny_config(architecture="Qwen2ForCausalLM", attention_bias=True),
    "qwen3_qk_norm": tiny_config(architecture="Qwen3ForCausalLM", qk_norm=True, tie_word_embeddings=True),
    "phi3_fused": tiny_config(architecture="Phi3ForCausalLM", sliding_window=8),
    "gemma3": tiny_config(architecture="Gemma3ForCausalLM", qk_norm=True, sandwich_norms=True, norm_offset=1.0,
                          sliding_window=8, layer_types=("sliding_attention", "full_attention"),
                          tie_word_embeddings=True),
}


# --- lookups ---

def test_the_registered_families():
    assert FAMILIES == (LLAMA, QWEN2, QWEN3, MISTRAL, PHI3, GEMMA2, GEMMA3, MIXTRAL, QWEN2_MOE, QWEN3_MOE,
                        QWEN2_5_VL_FAMILY, GEMMA3_VL, ENCODER)
    assert supported_architectures() == ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                         "MistralForCausalLM", "Phi3ForCausalLM", "Gemma2ForCausalLM",
                                         "Gemma3ForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM",
                                         "Qwen3MoeForCausalLM", "Qwen2_5_VLForConditionalGeneration",
                                         "Gemma3ForConditionalGeneration", "BertModel", "XLMRobertaModel",
                                         "BertForSequenceClassification", "XLMRobertaForSequenceClassification"]
    for family in FAMILIES:
        assert family_for_architectures(family.architectures) is family
        assert family_for_architectures([], model_type=family.model_types[0]) is family
        # A loaded config finds its family again by the architecture it records.
        experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16) \
            if family.architectures[0] in MOE_ARCHITECTURES else {}
        assert family_for_config(tiny_config(architecture=family.architectures[0], **experts)) is family
    assert family_for_architectures(["LlamaForCausalLM"]) is LLAMA
    assert family_for_architectures([], model_type="llama") is LLAMA  # exports without `architectures`
    assert family_for_hf_config({"architectures": ["LlamaForCausalLM"]}) is LLAMA
    assert family_for_config(config_by_name("tiny")) is LLAMA
    assert ModelConfig is LlamaConfig


@pytest.mark.parametrize("names,model_type", [(["GPT2LMHeadModel"], "gpt2"), (["FalconForCausalLM"], "falcon"),
                                              ([], None)])
def test_unsupported_architecture_names_what_is_supported(names, model_type):
    with pytest.raises(UnsupportedModelError, match="unsupported architecture") as err:
        family_for_architectures(names, model_type)
    assert "LlamaForCausalLM" in str(err.value) and repr(model_type) in str(err.value)
    # Config loading goes through the same lookup and raises the same error.
    with pytest.raises(UnsupportedModelError, match="supported: LlamaForCausalLM"):
        from_hf_config({"architectures": names, "model_type": model_type, "vocab_size": 10})


def test_unknown_config_class_or_architecture_is_refused():
    with pytest.raises(UnsupportedModelError, match="LlamaConfig"):
        family_for_config(object())
    with pytest.raises(UnsupportedModelError, match="'FalconForCausalLM'.*supported: LlamaForCausalLM"):
        family_for_config(tiny_config(architecture="FalconForCausalLM"))


def test_config_file_round_trips_and_llama_files_are_unchanged(tmp_path):
    llama = CONFIGS["gqa_tied"]
    assert "architecture" not in llama.to_dict() and "layer_types" not in llama.to_dict()
    for cfg in CONFIGS.values():
        path = str(tmp_path / "model_config.json")
        cfg.save(path)
        assert LlamaConfig.load(path) == cfg


def test_checkpoint_tensors_cover_the_declarations():
    """Every declared weight has one HF tensor, and its relayout gives the declared shape."""
    for cfg in CONFIGS.values():
        declared = {k: v.shape for k, v in flatten_params(abstract_params(cfg)).items()}
        plan = conversion_plan(cfg)
        assert [t.ours for t in plan] == list(declared)
        for t in plan:
            assert t.relayout(np.zeros(t.hf_shape)).shape == declared[t.ours], t.hf


# --- sizes from the declarations ---

# Every optional layer weight at once (an init compile per config is the cost; the families' own
# configs are covered by the declaration tests above and below).
ALL_EXTRAS = tiny_config(architecture="Qwen2ForCausalLM", attention_bias=True, qk_norm=True, sandwich_norms=True)


@pytest.mark.parametrize("name", ["gqa_tied", "mha_untied", "mqa_untied_bf16", "all_extras"])
def test_num_params_equals_initialised_params(name):
    cfg = CONFIGS.get(name, ALL_EXTRAS)
    params = init_params(cfg, jax.random.PRNGKey(0))
    assert num_params(cfg) == sum(x.size for x in jax.tree.leaves(params))


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
    assert kv_bytes_per_token(cfg, quant.kv_cache_dtype(cfg, kv_dtype)) == per_token  # the engine's call


def test_kv_bytes_per_token_layout():
    """K and V of every layer, one fp32 scale per KV head beside each int8 / fp8 row."""
    cfg = CONFIGS["gqa_tied"]
    L, nkv, d = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    assert kv_bytes_per_token(cfg) == 2 * L * nkv * d * 4
    assert kv_bytes_per_token(cfg, jnp.int8) == 2 * L * nkv * (d + quant.SCALE_BYTES)
    # Nominal width (cost models, the planner's int4): the elements at that price, no scales.
    assert kv_bytes_per_token(cfg, bytes_per_element=1) == 2 * L * nkv * d
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


# --- refusals: what is not implemented is refused at conversion, naming the architecture or field ---

_TINY_HF = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2)


@pytest.mark.parametrize("arch,fields,fragments", [
    ("Qwen3ForCausalLM", dict(attention_bias=True), ["Qwen3ForCausalLM", "attention_bias"]),
    ("Qwen2ForCausalLM", dict(hidden_act="gelu"), ["Qwen2ForCausalLM", "hidden_act"]),
    ("MistralForCausalLM", dict(mlp_bias=True), ["MistralForCausalLM", "mlp_bias"]),
    ("Phi3ForCausalLM", dict(rope_scaling={"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}),
     ["Phi3ForCausalLM", "longrope", "rope_scaling"]),
    ("Phi3ForCausalLM", dict(partial_rotary_factor=0.5), ["Phi3ForCausalLM", "partial_rotary_factor"]),
    ("Gemma2ForCausalLM", dict(hidden_activation="relu"), ["Gemma2ForCausalLM", "hidden_activation"]),
    ("Gemma3ForCausalLM", dict(use_bidirectional_attention=True), ["Gemma3ForCausalLM",
                                                                    "use_bidirectional_attention"]),
    ("Gemma3ForCausalLM", dict(rope_parameters={"full_attention": {"rope_type": "default"},
                                                "sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
     ["Gemma3ForCausalLM", "sliding_attention"]),
    ("Gemma2ForCausalLM", dict(sliding_window=4, layer_types=["sliding_attention", "chunked_attention"]),
     ["Gemma2ForCausalLM", "chunked_attention"]),
    ("Qwen2ForCausalLM", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), ["yarn", "rope_scaling"]),
    ("MistralForCausalLM", dict(quantization_config={"quant_method": "awq"}), ["awq"]),
])
def test_unsupported_variants_are_refused(arch, fields, fragments):
    with pytest.raises(UnsupportedModelError) as err:
        from_hf_config({"architectures": [arch], **_TINY_HF, **fields})
    for fragment in fragments:
        assert fragment in str(err.value)


def test_sliding_window_settings_are_read_per_family():
    qwen = {"architectures": ["Qwen2ForCausalLM"], **_TINY_HF, "sliding_window": 32}
    assert from_hf_config(qwen).sliding_window is None  # Qwen's window is off unless use_sliding_window
    assert from_hf_config({**qwen, "use_sliding_window": True, "max_window_layers": 1}).layer_windows() == (None, 32)
    assert from_hf_config({**qwen, "use_sliding_window": True}).layer_windows() == (None, None)  # 28 by default
    mistral = from_hf_config({"architectures": ["MistralForCausalLM"], **_TINY_HF, "sliding_window": 16})
    assert mistral.layer_windows() == (16, 16)
    gemma2 = from_hf_config({"architectures": ["Gemma2ForCausalLM"], **_TINY_HF, "sliding_window": 16})
    assert gemma2.layer_windows() == (16, None)  # transformers' default: even layers local
    gemma3 = from_hf_config({"architectures": ["Gemma3ForCausalLM"], **_TINY_HF, "num_hidden_layers": 7,
                             "sliding_window": 16, "rope_theta": 1e6, "rope_local_base_freq": 1e4})
    assert gemma3.layer_windows() == (16,) * 5 + (None, 16)  # every sixth layer global
    assert (gemma3.rope_theta, gemma3.rope_local_theta) == (1e6, 1e4)
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap, gemma2.norm_offset) == (50.0, 30.0, 1.0)


def test_pipeline_parallelism_stages_every_family():
    """The stages run each family's own blocks (tests/test_pipeline.py compares their logits)."""
    from sharding.pipeline import make_pipeline_layout

    layout = make_pipeline_layout(2)
    for cfg in CONFIGS.values():
        layout.check(cfg)
    layout.check(tiny_config(architecture="MixtralForCausalLM", num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=16))
    with pytest.raises(UnsupportedModelError, match="FalconForCausalLM"):
        layout.check(tiny_config(architecture="FalconForCausalLM"))


@pytest.mark.parametrize("name,billions,arch", [("qwen2.5-7b", 7.62, "Qwen2ForCausalLM"),
                                                 ("qwen3-8b", 8.19, "Qwen3ForCausalLM"),
                                                 ("mistral-7b", 7.24, "MistralForCausalLM"),
                                                 ("gemma-2-9b", 9.24, "Gemma2ForCausalLM"),
                                                 ("phi-3-mini", 3.82, "Phi3ForCausalLM")])
def test_family_presets_have_the_published_sizes_and_plan(name, billions, arch, capsys):
    """The real-size configs: their declarations sum to the published parameter counts (biases, q/k norms and
    Gemma's extra norms included), and `python -m sharding.plan --model NAME` plans them at TP=2."""
    from sharding import plan

    cfg = config_by_name(name)
    assert cfg.architecture == arch and family_for_config(cfg).architectures == (arch,)
    assert num_params(cfg) / 1e9 == pytest.approx(billions, abs=0.01)
    assert plan.main(["--model", name, "--tp", "2", "--format", "json"]) == 0
    assert str(num_params(cfg)) in capsys.readouterr().out
