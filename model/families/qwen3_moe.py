"""The Qwen3-MoE family (`Qwen3MoeForCausalLM`): Qwen3 attention (RMSNorm on each query and
key head), a sparse mixture-of-experts MLP in every layer.

Routing as Qwen3-MoE defines it: a softmax over every expert, the top k, renormalised to sum
1 when `norm_topk_prob`. Checkpoints whose layers are not all sparse (`mlp_only_layers`,
`decoder_sparse_step` != 1) are refused: every layer must declare the same weights.

Sliding-window attention as transformers' Qwen3-MoE (transformers 5) has it: off unless
`use_sliding_window`, then on every layer, whatever `max_window_layers` or a `layer_types` say
(`Qwen3MoeConfig` reads neither; `model.families.qwen.sliding` with every layer sliding).
"""

from __future__ import annotations

from typing import Any

from model.config import LlamaConfig
from model.families import llama
from model.families.moe_layers import check_all_layers_sparse, moe_family, qwen_moe_tensors
from model.families.qwen import sliding

ARCH = "Qwen3MoeForCausalLM"


def _every_layer(hf: dict[str, Any]) -> None:
    return None  # no `layer_types`: every layer slides


def config_from_hf(hf: dict[str, Any], dtype: str | None = None) -> LlamaConfig:
    check_all_layers_sparse(hf, "Qwen3-MoE")
    experts = hf.get("num_experts") or hf.get("num_local_experts")  # transformers 4 / 5 names
    for name, value in (("num_experts", experts), ("num_experts_per_tok", hf.get("num_experts_per_tok")),
                        ("moe_intermediate_size", hf.get("moe_intermediate_size"))):
        if not value:
            raise ValueError(f"HF config lacks required fields: [{name!r}]")
    return llama.config_from_hf(hf, dtype).replace(
        architecture=ARCH, num_experts=int(experts), num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]), moe_router="softmax_topk",
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)), qk_norm=True,
        **sliding({**hf, "layer_types": None}, ARCH, _every_layer))


QWEN3_MOE = moe_family("Qwen3-MoE", ARCH, "qwen3_moe", config_from_hf, qwen_moe_tensors)
