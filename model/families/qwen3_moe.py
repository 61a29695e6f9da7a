"""The Qwen3-MoE family (`Qwen3MoeForCausalLM`): Qwen3 attention (RMSNorm on each query and
key head), a sparse mixture-of-experts MLP in every layer.

Routing as Qwen3-MoE defines it: a softmax over every expert, the top k, renormalised to sum
1 when `norm_topk_prob`. Checkpoints whose layers are not all sparse (`mlp_only_layers`,
`decoder_sparse_step` != 1) are refused: every layer must declare the same weights.
"""

from __future__ import annotations

from typing import Any

from model.config import LlamaConfig, UnsupportedModelError
from model.families import llama
from model.families.base import ModelFamily
from model.families.moe_layers import (DECLARE_CACHE, MOE_BLOCKS, check_all_layers_sparse, checkpoint_tensors,
                                       declare_weights)


def config_from_hf(hf: dict[str, Any], dtype: str | None = None) -> LlamaConfig:
    check_all_layers_sparse(hf, "Qwen3-MoE")
    if hf.get("use_sliding_window"):
        raise UnsupportedModelError("unsupported Qwen3-MoE variant: use_sliding_window=true "
                                    "(sliding-window attention is not implemented)")
    experts = hf.get("num_experts") or hf.get("num_local_experts")  # transformers 4 / 5 names
    for name, value in (("num_experts", experts), ("num_experts_per_tok", hf.get("num_experts_per_tok")),
                        ("moe_intermediate_size", hf.get("moe_intermediate_size"))):
        if not value:
            raise ValueError(f"HF config lacks required fields: [{name!r}]")
    return llama.config_from_hf(hf, dtype).replace(
        architecture="Qwen3MoeForCausalLM", num_experts=int(experts), num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]), moe_router="softmax_topk",
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)), qk_norm=True)


def qwen3_moe_tensors(cfg: LlamaConfig):
    return checkpoint_tensors(cfg, "mlp", "gate", "gate_proj", "up_proj", "down_proj")


QWEN3_MOE = ModelFamily(
    name="Qwen3-MoE",
    architectures=("Qwen3MoeForCausalLM",),
    model_types=("qwen3_moe",),
    config_class=LlamaConfig,
    config_from_hf=config_from_hf,
    declare_weights=declare_weights,
    declare_cache=DECLARE_CACHE,
    checkpoint_tensors=qwen3_moe_tensors,
    blocks=MOE_BLOCKS,
)
