"""The Llama family (Llama 2 / 3 / 3.1 / 3.2 and checkpoints that share their layout).

What is Llama-specific and lives here: reading a Hugging Face `config.json`
into a `LlamaConfig`, refusing the variants whose weights would load but
compute something else, and the names and layouts of the HF checkpoint's
tensors. The weight and cache declarations (`model.declarations`, `model.cache`)
and the forward (`model.forward`) are Llama's too; the entry at the bottom
points at them rather than moving them, because the rest of the stack
imports them by those paths.
"""

from __future__ import annotations

from typing import Any

from model.cache import KVCache
from model.config import COMPUTE_DTYPES, LlamaConfig, RopeScaling, UnsupportedModelError
from model.declarations import Weights
from model.families.base import ForwardBlocks, ModelFamily, TensorPlan
from model.layers import (attention_block, embed_tokens, layer_rope, mlp_block, output_logits, rms_norm,
                          rope_frequencies)

_HF_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def config_from_hf(hf: dict[str, Any], dtype: str | None = None) -> LlamaConfig:
    """A `LlamaConfig` from an HF `config.json` dict (transformers 4 or 5 layout).

    The architecture itself was checked by the registry lookup; this checks the
    features a Llama checkpoint may turn on that we do not implement."""
    _check_llama_features(hf)
    return LlamaConfig(**common_fields(hf, dtype))


def common_fields(hf: dict[str, Any], dtype: str | None = None, *, rope: dict[str, Any] | None = None,
                  default_theta: float = 10000.0) -> dict[str, Any]:
    """The `LlamaConfig` fields every decoder family reads alike: sizes, RoPE base and scaling
    (`rope`: the parameters to read, by default the flat / `rope_parameters` ones), norm epsilon,
    tying, dtype and special tokens. Refuses quantized checkpoints and unknown RoPE types."""
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method", "?")
        raise UnsupportedModelError(f"quantized checkpoints ({method}) are not supported; use a float checkpoint")
    missing = [k for k in _HF_REQUIRED if hf.get(k) is None]
    if missing:
        raise ValueError(f"HF config lacks required fields: {missing}")
    # transformers 5 nests rope settings under `rope_parameters`; 4 keeps them flat.
    if rope is None:
        rope = hf.get("rope_parameters") or {}
        scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type") not in (None, "default") else None)
        rope_theta = rope.get("rope_theta", hf.get("rope_theta", default_theta))
    else:
        scaling = rope if rope.get("rope_type", rope.get("type")) not in (None, "default") else None
        rope_theta = rope.get("rope_theta", default_theta)
    heads = hf["num_attention_heads"]
    hidden = hf["hidden_size"]
    torch_dtype = dtype or hf.get("dtype") or hf.get("torch_dtype") or "bfloat16"
    if torch_dtype not in COMPUTE_DTYPES:
        torch_dtype = "bfloat16"
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hidden // heads,
        rope_theta=float(rope_theta),
        rope_scaling=_rope_scaling(scaling),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
        dtype=torch_dtype,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def _rope_scaling(scaling: dict[str, Any] | None) -> RopeScaling | None:
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        return RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    if kind == "linear":
        return RopeScaling(factor=float(scaling["factor"]), rope_type="linear")
    if kind in (None, "default"):
        return None
    raise UnsupportedModelError(f"unsupported rope scaling type {kind!r} (rope_scaling / rope_parameters); "
                                "supported: llama3, linear")


def _check_llama_features(hf: dict[str, Any]) -> None:
    """Rejects Llama variants whose weights would load but compute something else."""
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise UnsupportedModelError("unsupported Llama variant: projections with biases "
                                    "(attention_bias / mlp_bias) are not implemented")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"unsupported activation hidden_act={act!r}; Llama uses 'silu'")


# --- the HF checkpoint's tensors ---
#
# HF stores `nn.Linear` weights as [out, in], and so do we; only the fused head dims are split:
#     q_proj.weight [q_heads*head_dim, embed]  -> wq [q_heads, head_dim, embed]
#     k/v_proj.weight                          -> wk/wv [kv_heads, head_dim, embed]
#     o_proj.weight [embed, q_heads*head_dim]  -> wo [embed, q_heads, head_dim]
#     gate/up_proj.weight [ffw, embed]         -> w_gate/w_up (unchanged)
#     down_proj.weight [embed, ffw]            -> w_down (unchanged)
#     embed_tokens.weight [vocab, embed]       -> embed (unchanged)
#     lm_head.weight [vocab, embed]            -> lm_head (unchanged; absent when tied)
# No q/k permutation is needed: HF checkpoints already use the half-rotation RoPE convention
# that `model.layers.apply_rope` implements.

def _identity(w):
    return w


def _split_out_heads(n: int, d: int):
    """[n*d, embed] -> [n, d, embed]: the output rows grouped by head (a view)."""
    return lambda w: w.reshape(n, d, w.shape[1])


def _split_in_heads(n: int, d: int):
    """[embed, n*d] -> [embed, n, d]: the input columns grouped by head (a view)."""
    return lambda w: w.reshape(w.shape[0], n, d)


def checkpoint_tensors(cfg: LlamaConfig) -> list[TensorPlan]:
    """Every tensor a Llama checkpoint of this config must contain, in our order."""
    h, f, v, d = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    nq, nkv = cfg.num_heads, cfg.num_kv_heads
    plan = [TensorPlan("embed", "model.embed_tokens.weight", (v, h), _identity)]
    for i in range(cfg.num_layers):
        p, a, m = f"layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        plan += [
            TensorPlan(p + "attn_norm", f"model.layers.{i}.input_layernorm.weight", (h,), _identity),
            TensorPlan(p + "wq", a + "q_proj.weight", (nq * d, h), _split_out_heads(nq, d)),
            TensorPlan(p + "wk", a + "k_proj.weight", (nkv * d, h), _split_out_heads(nkv, d)),
            TensorPlan(p + "wv", a + "v_proj.weight", (nkv * d, h), _split_out_heads(nkv, d)),
            TensorPlan(p + "wo", a + "o_proj.weight", (h, nq * d), _split_in_heads(nq, d)),
            TensorPlan(p + "mlp_norm", f"model.layers.{i}.post_attention_layernorm.weight", (h,), _identity),
            TensorPlan(p + "w_gate", m + "gate_proj.weight", (f, h), _identity),
            TensorPlan(p + "w_up", m + "up_proj.weight", (f, h), _identity),
            TensorPlan(p + "w_down", m + "down_proj.weight", (h, f), _identity),
        ]
    plan.append(TensorPlan("final_norm", "model.norm.weight", (h,), _identity))
    if not cfg.tie_word_embeddings:
        plan.append(TensorPlan("lm_head", "lm_head.weight", (v, h), _identity))
    return plan


LLAMA = ModelFamily(
    name="Llama",
    architectures=("LlamaForCausalLM",),
    model_types=("llama",),
    config_class=LlamaConfig,
    config_from_hf=config_from_hf,
    declare_weights=Weights.declare,
    declare_cache=KVCache.declare,
    checkpoint_tensors=checkpoint_tensors,
    blocks=ForwardBlocks(norm=rms_norm, rope=rope_frequencies, attention=attention_block, mlp=mlp_block,
                         logits=output_logits, embed=embed_tokens, layer_inputs=layer_rope),
)
