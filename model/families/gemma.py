"""The Gemma 2 and Gemma 3 (text) families.

Both: (1 + w) RMSNorm, embeddings scaled by sqrt(hidden), GeGLU (tanh GELU),
norms before and after attention and MLP, attention scale
`query_pre_attn_scalar**-0.5`, tied head, and local (sliding-window) layers
alternating with global ones by `layer_types`. Gemma 2 soft-caps attention
scores and final logits; Gemma 3 normalises q and k per head and gives its
local layers their own RoPE base (`rope_local_base_freq`, unscaled).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from model.config import FULL_ATTENTION, SLIDING_ATTENTION, LlamaConfig, UnsupportedModelError
from model.families.decoder import family_entry, refuse, sliding_fields
from model.families.llama import common_fields
from model.layers import rms_norm


def gemma_norm(x, weight, eps):
    """Gemma's RMSNorm: scales by (1 + w)."""
    return rms_norm(x, weight.astype(jnp.float32) + 1.0, eps)


def _layer_types(hf: dict[str, Any], pattern: int) -> list[str]:
    """`layer_types`, or the one older configs imply: every `pattern`-th layer global."""
    types = hf.get("layer_types")
    if types is None:
        pattern = int(hf.get("sliding_window_pattern", pattern))
        types = [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(hf["num_hidden_layers"])]
    return list(types)


def _activation(hf: dict[str, Any], arch: str) -> str:
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(f"unsupported {arch}: hidden_activation={act!r} (supported: gelu_pytorch_tanh)")
    return "gelu_tanh"


def _gemma_fields(hf: dict[str, Any], arch: str, pattern: int) -> dict[str, Any]:
    refuse(hf, arch, attention_bias=(None, False), use_bidirectional_attention=(None, False))
    window = hf.get("sliding_window")
    types = _layer_types(hf, pattern)
    fields = dict(architecture=arch, norm_offset=1.0, scale_embeddings=True, hidden_act=_activation(hf, arch),
                  sandwich_norms=True, query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
                  **sliding_fields({**hf, "layer_types": types}, window, arch))
    return fields


def gemma2_config_from_hf(hf: dict[str, Any], dtype: str | None = None) -> LlamaConfig:
    arch = "Gemma2ForCausalLM"
    fields = _gemma_fields(hf, arch, pattern=2)
    common = common_fields({"rms_norm_eps": 1e-6, "tie_word_embeddings": True, **hf}, dtype)
    return LlamaConfig(**common, **fields, attn_logit_softcap=_cap(hf.get("attn_logit_softcapping", 50.0)),
                       final_logit_softcap=_cap(hf.get("final_logit_softcapping", 30.0)))


def gemma3_config_from_hf(hf: dict[str, Any], dtype: str | None = None, arch: str = "Gemma3ForCausalLM") -> LlamaConfig:
    fields = _gemma_fields(hf, arch, pattern=6)
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers 5: one set per layer kind
        full, local = params["full_attention"], params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise UnsupportedModelError(f"unsupported {arch}: scaled RoPE on sliding layers "
                                        f"({local.get('rope_type')!r} in rope_parameters.sliding_attention)")
        local_theta = local.get("rope_theta", 10000.0)
    else:  # transformers 4: flat rope_theta / rope_scaling for global layers, rope_local_base_freq
        full = {"rope_theta": hf.get("rope_theta", 1e6), **(hf.get("rope_scaling") or {})}
        local_theta = hf.get("rope_local_base_freq", 10000.0)
    common = common_fields({"rms_norm_eps": 1e-6, "tie_word_embeddings": True, **hf}, dtype, rope=full,
                           default_theta=1e6)
    return LlamaConfig(**common, **fields, qk_norm=True, rope_local_theta=float(local_theta),
                       attn_logit_softcap=_cap(hf.get("attn_logit_softcapping")),
                       final_logit_softcap=_cap(hf.get("final_logit_softcapping")))


def _cap(value):
    return None if value is None else float(value)


GEMMA2 = family_entry("Gemma 2", ("Gemma2ForCausalLM",), ("gemma2",), gemma2_config_from_hf, norm=gemma_norm)
GEMMA3 = family_entry("Gemma 3", ("Gemma3ForCausalLM",), ("gemma3_text",), gemma3_config_from_hf, norm=gemma_norm)
