"""The Phi-3 family: Llama's computation with fused qkv and gate_up projections (split at
conversion), and a sliding window on every layer when `sliding_window` is set."""

from __future__ import annotations

from typing import Any

from model.config import LlamaConfig, UnsupportedModelError
from model.families.decoder import family_entry, refuse
from model.families.llama import common_fields


def config_from_hf(hf: dict[str, Any], dtype: str | None = None) -> LlamaConfig:
    refuse(hf, "Phi3ForCausalLM", hidden_act=(None, "silu"))
    rope = hf.get("rope_parameters") or {}
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1.0):
        raise UnsupportedModelError(f"unsupported Phi3ForCausalLM: partial_rotary_factor={partial} "
                                    "(only full rotary embeddings are implemented)")
    scaling = hf.get("rope_scaling") or rope
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in (None, "default"):  # longrope / su / yarn: the 128k-context variants
        raise UnsupportedModelError(f"unsupported Phi3ForCausalLM: rope scaling {kind!r} (rope_scaling) is not "
                                    "implemented; the 4k-context checkpoints are supported")
    window = hf.get("sliding_window")
    return LlamaConfig(**common_fields(hf, dtype), architecture="Phi3ForCausalLM",
                       sliding_window=None if window is None else int(window))


PHI3 = family_entry("Phi-3", ("Phi3ForCausalLM",), ("phi3",), config_from_hf, fused=True)
