"""The Mistral family: Llama's layout, with sliding-window attention on every layer when
`sliding_window` is set (Mistral 7B v0.1); later releases set it to null."""

from __future__ import annotations

from typing import Any

from model.config import LlamaConfig
from model.families.decoder import family_entry, refuse
from model.families.llama import common_fields


def config_from_hf(hf: dict[str, Any], dtype: str | None = None) -> LlamaConfig:
    refuse(hf, "MistralForCausalLM", hidden_act=(None, "silu"), attention_bias=(None, False), mlp_bias=(None, False))
    window = hf.get("sliding_window")
    # transformers' Mistral ignores `layer_types` (every layer slides), and so do we.
    return LlamaConfig(**common_fields(hf, dtype), architecture="MistralForCausalLM",
                       sliding_window=None if window is None else int(window))


MISTRAL = family_entry("Mistral", ("MistralForCausalLM",), ("mistral",), config_from_hf)
