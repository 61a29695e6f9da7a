"""The decoder layer the mixture-of-experts families share (Mixtral, Qwen3-MoE).

Attention is Llama's, plus Qwen3's RMSNorm over each query and key head before RoPE
when `cfg.qk_norm`; the MLP is `model.moe`'s router and experts. Every layer declares
the same pytree (the per-head norms are None in every layer or in none), so the layers
can be stacked and scanned; the MoE families refuse, at conversion, checkpoints that mix
dense and sparse layers.

Both families share a config class with Llama (`LlamaConfig` with `num_experts` > 0),
so one set of declarations and blocks serves both (`model.families.base.ModelFamily`).
"""

from __future__ import annotations

import functools
from typing import Any

from model.cache import KVCache
from model.config import LlamaConfig, UnsupportedModelError
from model.families.base import ForwardBlocks, TensorPlan
from model.families.llama import _identity
from model.families.llama import checkpoint_tensors as llama_tensors
from model.forward import (_constrain, apply_rope, embed_tokens, forward, head_projection, layer_rope, output_logits,
                           output_projection, paged_attention, rms_norm, rope_frequencies)
from model.moe import moe_mlp
from model.params import ArrayInfo, Weights, linear_weight, normal_init, ones_init, pytree_dataclass

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

    @classmethod
    def declare(cls, cfg: LlamaConfig) -> "MoeLayer":
        h, f, d, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.head_dim, cfg.num_experts
        nq, nkv, dt = cfg.num_heads, cfg.num_kv_heads, cfg.jnp_dtype
        lin = functools.partial(linear_weight, cfg)
        head_norm = (lambda: ArrayInfo((d,), dt, ("norm",), ones_init)) if cfg.qk_norm else (lambda: None)
        return cls(
            attn_norm=ArrayInfo((h,), dt, ("norm",), ones_init),
            wq=lin(ArrayInfo((nq, d, h), dt, ("q_heads", "head_dim", "embed"), normal_init(h)), 2),
            wk=lin(ArrayInfo((nkv, d, h), dt, ("kv_heads", "head_dim", "embed"), normal_init(h)), 2),
            wv=lin(ArrayInfo((nkv, d, h), dt, ("kv_heads", "head_dim", "embed"), normal_init(h)), 2),
            wo=lin(ArrayInfo((h, nq, d), dt, ("embed", "q_heads", "head_dim"), normal_init(nq * d))),
            q_norm=head_norm(),
            k_norm=head_norm(),
            mlp_norm=ArrayInfo((h,), dt, ("norm",), ones_init),
            router=ArrayInfo((e, h), dt, (None, "embed"), normal_init(h)),
            w_gate=lin(ArrayInfo((e, f, h), dt, ("experts", "moe_ffw", "embed"), normal_init(h)), 2),
            w_up=lin(ArrayInfo((e, f, h), dt, ("experts", "moe_ffw", "embed"), normal_init(h)), 2),
            w_down=lin(ArrayInfo((e, h, f), dt, ("experts", "embed", "moe_ffw"), normal_init(f)), 2),
        )


def declare_weights(cfg: LlamaConfig) -> Weights:
    return Weights.declare(cfg, layer=MoeLayer.declare)


def attention_block(layer: MoeLayer, x, k_pages, v_pages, md, inv_freq, cfg: LlamaConfig, backend, layout=None):
    """Llama's attention block with the optional per-head q/k RMSNorm before RoPE."""
    h = rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
    q = _constrain(layout, head_projection(h, layer.wq), ("tokens", "q_heads", "head_dim"))
    k = _constrain(layout, head_projection(h, layer.wk), ("tokens", "kv_heads", "head_dim"))
    v = _constrain(layout, head_projection(h, layer.wv), ("tokens", "kv_heads", "head_dim"))
    if layer.q_norm is not None:
        q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
    q = apply_rope(q, md.positions, inv_freq)
    k = apply_rope(k, md.positions, inv_freq)
    o, k_pages, v_pages = paged_attention(backend, q, k, v, k_pages, v_pages, md, cfg)
    out = x + output_projection(o, layer.wo)
    return _constrain(layout, out, ("tokens", "embed")), k_pages, v_pages


def mlp_block(layer: MoeLayer, x, cfg: LlamaConfig, layout=None):
    h = rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps)
    out = x + moe_mlp(layer, h, cfg, layout)
    return _constrain(layout, out, ("tokens", "embed"))


MOE_BLOCKS = ForwardBlocks(norm=rms_norm, rope=rope_frequencies, attention=attention_block, mlp=mlp_block,
                           logits=output_logits, forward=forward, embed=embed_tokens, layer_inputs=layer_rope)
DECLARE_CACHE = KVCache.declare  # the KV cache is Llama's: experts change only the MLP


def checkpoint_tensors(cfg: LlamaConfig, moe: str, router: str, gate: str, up: str, down: str) -> list[TensorPlan]:
    """A MoE checkpoint's tensors: Llama's attention and norms, the per-head q/k norms with
    `qk_norm`, and under `model.layers.{i}.{moe}.` the router `{router}.weight` and each
    expert's `experts.{j}.{gate|up|down}.weight`, stacked into our `[E, ...]` weights."""
    h, f, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    plan = []
    for t in llama_tensors(cfg.replace(intermediate_size=1)):
        if t.ours.rsplit(".", 1)[-1] in ("w_gate", "w_up", "w_down"):
            continue  # Llama's dense MLP: replaced by the experts below
        plan.append(t)
        name = t.ours.rsplit(".", 1)
        if len(name) == 2 and name[1] == "mlp_norm":
            i = int(t.ours.split(".")[1])
            p, m = f"layers.{i}.", f"model.layers.{i}.{moe}."
            if cfg.qk_norm:
                a = f"model.layers.{i}.self_attn."
                plan += [TensorPlan(p + "q_norm", a + "q_norm.weight", (cfg.head_dim,), _identity),
                         TensorPlan(p + "k_norm", a + "k_norm.weight", (cfg.head_dim,), _identity)]
            plan.append(TensorPlan(p + "router", m + f"{router}.weight", (e, h), _identity))
            for ours, theirs, shape in (("w_gate", gate, (f, h)), ("w_up", up, (f, h)), ("w_down", down, (h, f))):
                plan += [TensorPlan(p + ours, m + f"experts.{j}.{theirs}.weight", shape, _identity, stack=(j, e))
                         for j in range(e)]
    return plan


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
