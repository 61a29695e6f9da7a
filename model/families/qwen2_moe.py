"""The Qwen2-MoE family (`Qwen2MoeForCausalLM`, Qwen1.5-MoE and Qwen2-57B-A14B): Qwen2
attention (q/k/v biases), a sparse mixture-of-experts MLP in every layer plus a shared expert.

Routing as Qwen2-MoE defines it: a softmax over every expert, the top k, renormalised only
when `norm_topk_prob` (off in the released checkpoints). The shared expert is a dense MLP
that every token passes through, scaled by `sigmoid(shared_expert_gate . h)` and added to
the routed experts' output (`model.families.moe_layers.shared_expert`). Checkpoints whose
layers are not all sparse (`mlp_only_layers`, `decoder_sparse_step` != 1) are refused.

Sliding-window attention as Qwen2's (`model.families.qwen.sliding`: off unless
`use_sliding_window`, then the layers `layer_types` marks), except for a config without
`layer_types`: transformers' Qwen2-MoE (`Qwen2MoeConfig`, transformers 5) then slides the
even-numbered layers below `max_window_layers` (0, 2, 4, ...), not Qwen2's layers from
`max_window_layers` on.
"""

from __future__ import annotations

from typing import Any

from model.config import FULL_ATTENTION, SLIDING_ATTENTION, LlamaConfig, UnsupportedModelError
from model.families import llama
from model.families.moe_layers import check_all_layers_sparse, moe_family, qwen_moe_tensors
from model.families.qwen import sliding

ARCH = "Qwen2MoeForCausalLM"


def default_layer_types(hf: dict[str, Any]) -> list[str]:
    """transformers' Qwen2-MoE rule for a config without `layer_types`: the even-numbered layers below
    `max_window_layers` (28 by default) slide."""
    below = int(hf.get("max_window_layers", 28))
    return [SLIDING_ATTENTION if i % 2 == 0 and i < below else FULL_ATTENTION for i in range(hf["num_hidden_layers"])]


def config_from_hf(hf: dict[str, Any], dtype: str | None = None) -> LlamaConfig:
    check_all_layers_sparse(hf, "Qwen2-MoE")
    for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        if not hf.get(name):
            raise ValueError(f"HF config lacks required fields: [{name!r}]")
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"unsupported {ARCH}: hidden_act={hf['hidden_act']!r} is not implemented "
                                    "(supported: 'silu')")
    return llama.config_from_hf(hf, dtype).replace(
        architecture=ARCH, num_experts=int(hf["num_experts"]), num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]), moe_router="softmax_topk",
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)), attention_bias=bool(hf.get("qkv_bias", True)),
        shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
        **sliding(hf, ARCH, default_layer_types))


QWEN2_MOE = moe_family("Qwen2-MoE", ARCH, "qwen2_moe", config_from_hf, qwen_moe_tensors)
