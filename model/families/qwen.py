"""The Qwen2 / Qwen2.5 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm) families."""

from __future__ import annotations

from typing import Any, Callable

from model.config import FULL_ATTENTION, SLIDING_ATTENTION, LlamaConfig
from model.families.decoder import family_entry, refuse, sliding_fields
from model.families.llama import common_fields


def qwen2_layer_types(hf: dict[str, Any]) -> list[str]:
    """transformers' Qwen2 / Qwen3 rule for a config without `layer_types`: the layers from
    `max_window_layers` (28 by default) on slide."""
    first = int(hf.get("max_window_layers", 28))
    return [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(hf["num_hidden_layers"])]


def sliding(hf: dict[str, Any], arch: str,
            default_layer_types: Callable[[dict[str, Any]], list[str] | None] = qwen2_layer_types) -> dict[str, Any]:
    """`sliding_window` and `layer_types` of a Qwen config (the dense families and the mixtures of experts).

    Qwen configs carry a `sliding_window` size even when it is off; `use_sliding_window` says. When on,
    `layer_types` says which layers slide, or, in a config without it, `default_layer_types(hf)` (the
    family's rule; None: every layer)."""
    if not hf.get("use_sliding_window") or hf.get("sliding_window") is None:
        return {}
    if hf.get("layer_types") is None:
        hf = {**hf, "layer_types": default_layer_types(hf)}
    return sliding_fields(hf, hf["sliding_window"], arch)


def qwen2_config_from_hf(hf: dict[str, Any], dtype: str | None = None) -> LlamaConfig:
    refuse(hf, "Qwen2ForCausalLM", hidden_act=(None, "silu"), mlp_bias=(None, False))
    return LlamaConfig(**common_fields(hf, dtype), architecture="Qwen2ForCausalLM", attention_bias=True,
                       **sliding(hf, "Qwen2ForCausalLM"))


def qwen3_config_from_hf(hf: dict[str, Any], dtype: str | None = None) -> LlamaConfig:
    # Qwen3's attention_bias adds an o_proj bias too, which the blocks do not have.
    refuse(hf, "Qwen3ForCausalLM", hidden_act=(None, "silu"), attention_bias=(None, False), mlp_bias=(None, False))
    return LlamaConfig(**common_fields(hf, dtype), architecture="Qwen3ForCausalLM", qk_norm=True,
                       **sliding(hf, "Qwen3ForCausalLM"))


QWEN2 = family_entry("Qwen2", ("Qwen2ForCausalLM",), ("qwen2",), qwen2_config_from_hf)
QWEN3 = family_entry("Qwen3", ("Qwen3ForCausalLM",), ("qwen3",), qwen3_config_from_hf)
