"""The decoder layer the mixture-of-experts families share (Mixtral, Qwen2-MoE, Qwen3-MoE).

Attention is the dense families' block (`model.blocks.attention_block`: Qwen2's q/k/v
biases with `cfg.attention_bias`, Qwen3's per-head q/k RMSNorm with `cfg.qk_norm`, each
layer's sliding window from `model.blocks.layer_inputs`); the
MLP is `model.moe`'s router and experts, plus Qwen2-MoE's gated shared expert when
`cfg.shared_expert_intermediate_size` is set. Every layer declares the same pytree (the
optional weights are None in every layer or in none), so the layers can be stacked and
scanned; the MoE families refuse, at conversion, checkpoints that mix dense and sparse
layers.

Both families share a config class with Llama (`LlamaConfig` with `num_experts` > 0),
so one set of declarations and blocks serves both (`model.families.base.ModelFamily`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from model import blocks
from model.cache import KVCache
from model.config import LlamaConfig, UnsupportedModelError
from model.declarations import ArrayInfo, Weights, attention_extras, linear_weight, normal_init, ones_init, pytree_dataclass
from model.families.base import ForwardBlocks, ModelFamily, TensorPlan
from model.families.decoder import attention_extra_tensors
from model.families.llama import _identity
from model.families.llama import checkpoint_tensors as llama_tensors
from model.layers import _constrain, embed_tokens, output_logits, rms_norm, rope_frequencies
from model.linear import linear
from model.moe import moe_mlp

# The logical axes the expert weights add (configs/rules_*.json map them): `experts` splits
# whole experts over devices (expert parallelism); `moe_ffw` an expert's hidden dim (tensor
# parallelism inside each expert).
EXPERT_AXES = ("experts", "moe_ffw")


@pytree_dataclass
class MoeLayer:
    attn_norm: Any  # [embed]
    wq: Any  # [q_heads, head_dim, embed]
    wk: Any  # [kv_heads, head_dim, embed]
    wv: Any  # [kv_heads, head_dim, embed]
    wo: Any  # [embed, q_heads, head_dim]
    q_norm: Any  # [head_dim], or None without qk_norm
    k_norm: Any  # [head_dim], or None without qk_norm
    mlp_norm: Any  # [embed]
    router: Any  # [experts, embed]; replicated and never quantized (routing decides discretely)
    w_gate: Any  # [experts, moe_ffw, embed]
    w_up: Any  # [experts, moe_ffw, embed]
    w_down: Any  # [experts, embed, moe_ffw]
    q_bias: Any = None  # [q_heads, head_dim]  (cfg.attention_bias)
    k_bias: Any = None  # [kv_heads, head_dim]
    v_bias: Any = None  # [kv_heads, head_dim]
    shared_gate: Any = None  # [ffw, embed]  (cfg.shared_expert_intermediate_size)
    shared_up: Any = None  # [ffw, embed]
    shared_down: Any = None  # [embed, ffw]
    shared_expert_gate: Any = None  # [1, embed]: the sigmoid gate of the shared expert's output

    @classmethod
    def declare(cls, cfg: LlamaConfig) -> "MoeLayer":
        h, f, d, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.head_dim, cfg.num_experts
        nq, nkv, dt = cfg.num_heads, cfg.num_kv_heads, cfg.jnp_dtype
        lin = functools.partial(linear_weight, cfg)
        extra = attention_extras(cfg)  # biases and q/k norms, as the dense layers declare them
        q_norm, k_norm = extra.pop("q_norm", None), extra.pop("k_norm", None)  # fields without defaults here
        fs = cfg.shared_expert_intermediate_size
        if fs:  # a dense MLP beside the experts, split over devices as Llama's is
            extra.update(shared_gate=lin(ArrayInfo((fs, h), dt, ("ffw", "embed"), normal_init(h))),
                         shared_up=lin(ArrayInfo((fs, h), dt, ("ffw", "embed"), normal_init(h))),
                         shared_down=lin(ArrayInfo((h, fs), dt, ("embed", "ffw"), normal_init(fs))),
                         shared_expert_gate=ArrayInfo((1, h), dt, (None, "embed"), normal_init(h)))
        return cls(**extra,
            attn_norm=ArrayInfo((h,), dt, ("norm",), ones_init),
            wq=lin(ArrayInfo((nq, d, h), dt, ("q_heads", "head_dim", "embed"), normal_init(h)), 2),
            wk=lin(ArrayInfo((nkv, d, h), dt, ("kv_heads", "head_dim", "embed"), normal_init(h)), 2),
            wv=lin(ArrayInfo((nkv, d, h), dt, ("kv_heads", "head_dim", "embed"), normal_init(h)), 2),
            wo=lin(ArrayInfo((h, nq, d), dt, ("embed", "q_heads", "head_dim"), normal_init(nq * d))),
            q_norm=q_norm,
            k_norm=k_norm,
            mlp_norm=ArrayInfo((h,), dt, ("norm",), ones_init),
            router=ArrayInfo((e, h), dt, (None, "embed"), normal_init(h)),
            w_gate=lin(ArrayInfo((e, f, h), dt, ("experts", "moe_ffw", "embed"), normal_init(h)), 2),
            w_up=lin(ArrayInfo((e, f, h), dt, ("experts", "moe_ffw", "embed"), normal_init(h)), 2),
            w_down=lin(ArrayInfo((e, h, f), dt, ("experts", "embed", "moe_ffw"), normal_init(f)), 2),
        )


def declare_weights(cfg: LlamaConfig) -> Weights:
    return Weights.declare(cfg, layer=MoeLayer.declare)


def shared_expert(layer: MoeLayer, h, layout=None):
    """Qwen2-MoE's shared expert: a SiLU-gated MLP over every token, scaled by sigmoid(h . gate)."""
    gate = _constrain(layout, linear("te,fe->tf", h, layer.shared_gate), ("tokens", "ffw"))
    up = _constrain(layout, linear("te,fe->tf", h, layer.shared_up), ("tokens", "ffw"))
    out = linear("tf,ef->te", jax.nn.silu(gate) * up, layer.shared_down)
    scale = jax.nn.sigmoid(jnp.einsum("te,oe->to", h, layer.shared_expert_gate.astype(h.dtype)))
    return out * scale.astype(out.dtype)


def mlp_block(layer: MoeLayer, x, cfg: LlamaConfig, layout=None):
    h = rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps)
    out = moe_mlp(layer, h, cfg, layout)
    if layer.shared_gate is not None:
        out = out + shared_expert(layer, h, layout).astype(out.dtype)
    return _constrain(layout, x + out, ("tokens", "embed"))


# Attention and per-layer data are the dense families' (`model.blocks`); only the MLP differs.
MOE_BLOCKS = ForwardBlocks(norm=rms_norm, rope=rope_frequencies, attention=blocks.attention_block, mlp=mlp_block,
                           logits=output_logits, embed=embed_tokens, layer_inputs=blocks.layer_inputs)
DECLARE_CACHE = KVCache.declare  # the KV cache is Llama's: experts change only the MLP


def moe_family(name: str, architecture: str, model_type: str, config_from_hf, checkpoint_tensors) -> ModelFamily:
    """A mixture-of-experts family's registry entry: only its config translation and tensor names differ."""
    return ModelFamily(name=name, architectures=(architecture,), model_types=(model_type,), config_class=LlamaConfig,
                       config_from_hf=config_from_hf, declare_weights=declare_weights, declare_cache=DECLARE_CACHE,
                       checkpoint_tensors=checkpoint_tensors, blocks=MOE_BLOCKS)


def checkpoint_tensors(cfg: LlamaConfig, moe: str, router: str, gate: str, up: str, down: str) -> list[TensorPlan]:
    """A MoE checkpoint's tensors: Llama's attention and norms, the q/k/v biases with
    `attention_bias`, the per-head q/k norms with `qk_norm`, and under `model.layers.{i}.{moe}.`
    the router `{router}.weight`, each expert's `experts.{j}.{gate|up|down}.weight` (stacked
    into our `[E, ...]` weights) and, with a shared expert, `shared_expert.{gate|up|down}_proj`
    and `shared_expert_gate`."""
    h, f, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    fs = cfg.shared_expert_intermediate_size
    plan = []
    for t in llama_tensors(cfg.replace(intermediate_size=1)):
        if t.ours.rsplit(".", 1)[-1] in ("w_gate", "w_up", "w_down"):
            continue  # Llama's dense MLP: replaced by the experts below
        plan.append(t)
        name = t.ours.rsplit(".", 1)
        if len(name) == 2 and name[1] == "mlp_norm":
            i = int(t.ours.split(".")[1])
            p, m = f"layers.{i}.", f"model.layers.{i}.{moe}."
            plan += attention_extra_tensors(cfg, p, f"model.layers.{i}.self_attn.")
            if fs:
                se = m + "shared_expert."
                plan += [TensorPlan(p + "shared_gate", se + "gate_proj.weight", (fs, h), _identity),
                         TensorPlan(p + "shared_up", se + "up_proj.weight", (fs, h), _identity),
                         TensorPlan(p + "shared_down", se + "down_proj.weight", (h, fs), _identity),
                         TensorPlan(p + "shared_expert_gate", m + "shared_expert_gate.weight", (1, h), _identity)]
            plan.append(TensorPlan(p + "router", m + f"{router}.weight", (e, h), _identity))
            for ours, theirs, shape in (("w_gate", gate, (f, h)), ("w_up", up, (f, h)), ("w_down", down, (h, f))):
                plan += [TensorPlan(p + ours, m + f"experts.{j}.{theirs}.weight", shape, _identity, stack=(j, e))
                         for j in range(e)]
    return plan


def qwen_moe_tensors(cfg: LlamaConfig) -> list[TensorPlan]:
    """Qwen2-MoE's and Qwen3-MoE's names: `mlp.gate` routes, `mlp.experts.{j}.{gate,up,down}_proj`."""
    return checkpoint_tensors(cfg, "mlp", "gate", "gate_proj", "up_proj", "down_proj")


def check_all_layers_sparse(hf: dict, family: str) -> None:
    """Refuses checkpoints whose layers are not all MoE: every layer must declare the same
    weights (the forward stacks and scans them)."""
    only = hf.get("mlp_only_layers") or []
    if only:
        raise UnsupportedModelError(f"unsupported {family} variant: mlp_only_layers={list(only)} mixes dense and "
                                    "sparse layers; only checkpoints whose every layer is a mixture of experts run")
    step = hf.get("decoder_sparse_step", 1)
    if step != 1:
        raise UnsupportedModelError(f"unsupported {family} variant: decoder_sparse_step={step} mixes dense and "
                                    "sparse layers; only decoder_sparse_step=1 (every layer sparse) runs")
