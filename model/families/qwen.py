"""The Qwen2 / Qwen2.5 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm) families."""

from __future__ import annotations

from typing import Any

from model.config import LlamaConfig
from model.families.decoder import family_entry, refuse, sliding_fields
from model.families.llama import common_fields


def _sliding(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """Qwen configs carry a `sliding_window` size even when it is off; `use_sliding_window` says. When on,
    the layers from `max_window_layers` on slide (transformers' rule), unless `layer_types` says otherwise."""
    if not hf.get("use_sliding_window") or hf.get("sliding_window") is None:
        return {}
    if hf.get("layer_types") is None:
        first = int(hf.get("max_window_layers", 28))
        hf = {**hf, "layer_types": ["sliding_attention" if i >= first else "full_attention"
                                    for i in range(hf["num_hidden_layers"])]}
    return sliding_fields(hf, hf["sliding_window"], arch)


def qwen2_config_from_hf(hf: dict[str, Any], dtype: str | None = None) -> LlamaConfig:
    refuse(hf, "Qwen2ForCausalLM", hidden_act=(None, "silu"), mlp_bias=(None, False))
    return LlamaConfig(**common_fields(hf, dtype), architecture="Qwen2ForCausalLM", attention_bias=True,
                       **_sliding(hf, "Qwen2ForCausalLM"))


def qwen3_config_from_hf(hf: dict[str, Any], dtype: str | None = None) -> LlamaConfig:
    # Qwen3's attention_bias adds an o_proj bias too, which the blocks do not have.
    refuse(hf, "Qwen3ForCausalLM", hidden_act=(None, "silu"), attention_bias=(None, False), mlp_bias=(None, False))
    return LlamaConfig(**common_fields(hf, dtype), architecture="Qwen3ForCausalLM", qk_norm=True,
                       **_sliding(hf, "Qwen3ForCausalLM"))


QWEN2 = family_entry("Qwen2", ("Qwen2ForCausalLM",), ("qwen2",), qwen2_config_from_hf)
QWEN3 = family_entry("Qwen3", ("Qwen3ForCausalLM",), ("qwen3",), qwen3_config_from_hf)
