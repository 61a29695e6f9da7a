"""The Mixtral family (`MixtralForCausalLM`): Llama attention, a sparse mixture-of-experts MLP.

Routing as Mixtral defines it: a softmax over the top-k router logits (the same weights as
a softmax over every expert renormalised over the top k). The HF checkpoint keeps each
expert's matrices apart (`block_sparse_moe.experts.{j}.w1/w3/w2`: gate, up, down); conversion
stacks them into our `[experts, ...]` weights (`model.families.moe_layers`).

Attention is Mistral's: with `sliding_window` set, every layer slides (transformers' Mixtral applies
the window to every layer and reads no `layer_types`), as the dense sliding families do
(`model.blocks.layer_inputs`).
"""

from __future__ import annotations

from typing import Any

from model.config import LlamaConfig
from model.families import llama
from model.families.decoder import sliding_fields
from model.families.moe_layers import checkpoint_tensors, moe_family

ARCH = "MixtralForCausalLM"


def config_from_hf(hf: dict[str, Any], dtype: str | None = None) -> LlamaConfig:
    for name in ("num_local_experts", "num_experts_per_tok"):
        if not hf.get(name):
            raise ValueError(f"HF config lacks required fields: [{name!r}]")
    return llama.config_from_hf(hf, dtype).replace(
        architecture=ARCH,
        num_experts=int(hf["num_local_experts"]), num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["intermediate_size"]), moe_router="topk_softmax",
        **sliding_fields({**hf, "layer_types": None}, hf.get("sliding_window"), ARCH))  # every layer slides


def mixtral_tensors(cfg: LlamaConfig):
    return checkpoint_tensors(cfg, "block_sparse_moe", "gate", "w1", "w3", "w2")


MIXTRAL = moe_family("Mixtral", ARCH, "mixtral", config_from_hf, mixtral_tensors)
