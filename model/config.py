"""Model configuration: one frozen dataclass describing a decoder of any registered family.

Llama is the base; the fields after `weight_dtype` are what the other families
(Qwen2/3, Mistral, Phi-3, Gemma 2/3) change, each defaulting to Llama's value.

The config is hashable so it can be a static argument of `jax.jit`. It loads
from our own JSON (`configs/*.json`, `model_config.json` in a checkpoint). A
Hugging Face `config.json` written by transformers 4 or 5 is translated by its
family (`model.families.from_hf_config`; `model.families.config_by_name` reads
either kind), and parameter counts and KV bytes are sums over a family's
declarations (`model.families.num_params`, `kv_bytes_per_token`). The families
import this module, so it imports nothing from them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

import jax.numpy as jnp

from model.vision.config import VisionConfig

CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")

# Grouped weight kinds of published quantized checkpoints (`model.quant.grouped_kind`).
_GROUPED_WEIGHTS = re.compile(r"(fp8|int4)_g[1-9][0-9]*")

_DTYPES = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
}
COMPUTE_DTYPES = tuple(_DTYPES)  # the names a config's `dtype` may take
MOE_ROUTERS = ("topk_softmax", "softmax_topk")  # see `LlamaConfig.moe_router`
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")  # the configs with num_experts > 0


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: Llama-3.1's frequency-dependent kind (HF `rope_type: llama3`), or
    `rope_type="linear"` (every frequency divided by `factor`; Gemma 3's global layers)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"  # or "linear"

    def __post_init__(self):
        if self.rope_type not in ("llama3", "linear"):
            raise ValueError(f"rope_scaling.rope_type must be 'llama3' or 'linear', got {self.rope_type!r}")


# Layer kinds of `LlamaConfig.layer_types` (the Hugging Face names).
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192
    dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Storage of the linear layers' weights: None (the compute dtype) or "int8" / "fp8"
    # with per-output-channel scales (model.quant). Compute stays in `dtype`.
    weight_dtype: str | None = None
    # An untied output head kept in the compute dtype under `weight_dtype`: a published quantized checkpoint that
    # leaves it unquantized (compressed-tensors' `ignore`, `modules_to_not_convert`) is served as published.
    float_lm_head: bool = False
    # --- what other decoder families change (`model.families`); every default is Llama's ---
    # The HF class the checkpoint came from: picks the family (`model.families.family_for_config`).
    architecture: str = "LlamaForCausalLM"
    attention_bias: bool = False  # q/k/v projections have biases (Qwen2)
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3)
    # Sliding-window attention: a query at position p sees keys p - sliding_window < j <= p on the
    # layers `layer_types` marks "sliding_attention" (every layer when `layer_types` is None).
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None  # RoPE base of sliding layers, unscaled (Gemma 3); None: rope_theta
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + w): Gemma's (1 + w)
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_tanh" (Gemma's GeGLU)
    sandwich_norms: bool = False  # RMSNorm after attention and after the MLP too, before each residual (Gemma)
    query_pre_attn_scalar: float | None = None  # attention scale query_pre_attn_scalar**-0.5; None: head_dim
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    # Mixture of experts (`model.moe`); the defaults mean a dense MLP. With `num_experts` > 0
    # every layer's MLP is `num_experts` experts of `moe_intermediate_size`, of which each token
    # uses `num_experts_per_tok`, weighted by the router: `moe_router` "topk_softmax" is a
    # softmax over the top-k logits (Mixtral), "softmax_topk" a softmax over every expert
    # then the top k, renormalised to sum 1 when `norm_topk_prob` (Qwen2/3-MoE). A shared
    # expert of `shared_expert_intermediate_size` (0: none) sees every token, its output scaled
    # by a sigmoid gate, and is added to the routed experts' (Qwen2-MoE).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_router: str = "topk_softmax"
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    # Image inputs (`model.vision`): the encoder's shape (None: a text-only model), the token id of
    # an image's placeholder positions, and the multimodal RoPE's split of the rotary frequencies
    # into temporal / height / width sections (Qwen2.5-VL's `mrope_section`; None: 1-D RoPE).
    vision: VisionConfig | None = None
    image_token_id: int | None = None
    mrope_section: tuple[int, ...] | None = None
    # A bidirectional encoder (BERT, XLM-RoBERTa: `model.families.encoder`): attention both ways within a prompt,
    # learned absolute positions from `position_offset` and `type_vocab_size` token-type embeddings.
    bidirectional: bool = False
    position_offset: int = 0
    type_vocab_size: int = 0

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.weight_dtype not in (None, "int8", "fp8") and not _GROUPED_WEIGHTS.fullmatch(str(self.weight_dtype)):
            raise ValueError(f"weight_dtype must be None, 'int8', 'fp8' or a grouped kind such as 'fp8_g128', "
                             f"got {self.weight_dtype!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive or None, got {self.sliding_window}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
            bad = sorted(set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
            if bad:
                raise ValueError(f"layer_types may hold {FULL_ATTENTION!r} and {SLIDING_ATTENTION!r}, not {bad}")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok must be in 1..num_experts ({self.num_experts}), "
                                 f"got {self.num_experts_per_tok}")
            if self.moe_intermediate_size <= 0:
                raise ValueError(f"moe_intermediate_size must be positive, got {self.moe_intermediate_size}")
            if self.shared_expert_intermediate_size < 0:
                raise ValueError("shared_expert_intermediate_size must be 0 (none) or positive, "
                                 f"got {self.shared_expert_intermediate_size}")
            if self.moe_router not in MOE_ROUTERS:
                raise ValueError(f"moe_router must be one of {MOE_ROUTERS}, got {self.moe_router!r}")
        if self.mrope_section is not None and 2 * sum(self.mrope_section) != self.head_dim:
            raise ValueError(f"mrope_section {self.mrope_section} must sum to head_dim / 2 ({self.head_dim // 2})")
        if self.vision is not None and self.image_token_id is None:
            raise ValueError("a config with a vision encoder needs image_token_id")
        if (self.num_experts > 0) != (self.architecture in MOE_ARCHITECTURES):
            # The family (and so the weights declared) follows the architecture: a mismatch would
            # declare a dense model for expert weights, or experts for a dense checkpoint.
            raise ValueError(f"num_experts={self.num_experts} does not fit architecture {self.architecture!r} "
                             f"(mixtures of experts: {', '.join(MOE_ARCHITECTURES)})")

    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer, its attention window (None: full attention)."""
        kinds = self.layer_types or (SLIDING_ATTENTION,) * self.num_layers
        return tuple(self.sliding_window if k == SLIDING_ATTENTION else None for k in kinds)

    @property
    def attention_scale(self) -> float:
        """The factor on q.k (softmax scale)."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def jnp_dtype(self):
        return _DTYPES[self.dtype]

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes) -> "LlamaConfig":
        return dataclasses.replace(self, **changes)

    # --- serialization ---
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        if d["weight_dtype"] is None:  # float checkpoints keep the config file they always had
            del d["weight_dtype"]
        # Fields at Llama's defaults are left out, so a Llama config file is the one it always was.
        for f in dataclasses.fields(self):
            if f.name in _FAMILY_FIELDS and d[f.name] == f.default:
                del d[f.name]
        if d.get("layer_types") is not None:
            d["layer_types"] = list(d["layer_types"])
        if d.get("mrope_section") is not None:
            d["mrope_section"] = list(d["mrope_section"])
        if self.vision is not None:
            d["vision"] = self.vision.to_dict()
        if d.get("rope_scaling") and d["rope_scaling"]["rope_type"] == "llama3":
            del d["rope_scaling"]["rope_type"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LlamaConfig":
        d = dict(d)
        scaling = d.get("rope_scaling")
        if isinstance(scaling, dict):
            d["rope_scaling"] = RopeScaling(**scaling)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        if d.get("layer_types") is not None:
            d["layer_types"] = tuple(d["layer_types"])
        if d.get("mrope_section") is not None:
            d["mrope_section"] = tuple(d["mrope_section"])
        if isinstance(d.get("vision"), dict):
            d["vision"] = VisionConfig.from_dict(d["vision"])
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown model config fields: {sorted(unknown)}")
        return cls(**d)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)

    @classmethod
    def load(cls, path: str) -> "LlamaConfig":
        with open(path) as f:
            return cls.from_dict(json.load(f))


HIDDEN_ACTS = ("silu", "gelu_tanh", "gelu", "relu")  # gelu (exact, erf) and relu: the encoders' plain MLP
_FAMILY_FIELDS = ("float_lm_head", "architecture", "attention_bias", "qk_norm", "sliding_window", "layer_types",
                  "rope_local_theta", "norm_offset", "scale_embeddings", "hidden_act", "sandwich_norms", "query_pre_attn_scalar",
                  "attn_logit_softcap", "final_logit_softcap", "num_experts", "num_experts_per_tok",
                  "moe_intermediate_size", "moe_router", "norm_topk_prob", "shared_expert_intermediate_size",
                  "vision", "image_token_id", "mrope_section", "bidirectional", "position_offset", "type_vocab_size")

# The config type of every family today. Code outside the Llama implementation (serving,
# sharding) annotates with this name, so a family with a config class of its own changes this
# line (to a Union or a Protocol) rather than every annotation.
ModelConfig = LlamaConfig


class UnsupportedModelError(ValueError):
    """The checkpoint is not a model family this stack can run (`model.families`)."""
