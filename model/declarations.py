"""The building blocks of declarations: `ArrayInfo` (one array's shape, dtype, logical axes and
initializer), the initializers, `linear_weight` (a linear layer's weight, quantized when the config
says so), and the dense decoder's pytrees `Layer` and `Weights` with their `declare` methods.

The families (`model.families`) and the KV cache (`model.cache`) declare their arrays with these;
nothing here knows which family a config belongs to. The family-generic entry points (a config's
declarations, random initialisation, abstract shapes, logical axes, the flat checkpoint naming) are
`model.params`, above the family registry, as `model.forward` (the driver) sits above the pieces
of `model.layers`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from model.config import LlamaConfig
from model.quant import SCALE_DTYPE, GroupQuantizedArray, QuantizedArray, grouped_kind, storage_dtype

Initializer = Callable[[jax.Array, tuple[int, ...], Any], jax.Array]


def normal_init(fan_in: int) -> Initializer:
    std = 1.0 / math.sqrt(fan_in)
    return lambda key, shape, dtype: (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def ones_init(key, shape, dtype):
    del key
    return jnp.ones(shape, dtype)


def zeros_init(key, shape, dtype):
    del key
    return jnp.zeros(shape, dtype)


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
    """The one declaration of a weight (or cache array)."""

    shape: tuple[int, ...]
    dtype: Any
    logical_axes: tuple[str | None, ...]
    initializer: Initializer | None = None

    def __post_init__(self):
        if len(self.shape) != len(self.logical_axes):
            raise ValueError(f"shape {self.shape} and logical axes {self.logical_axes} differ in rank")


def replicated(shape, dtype, init) -> ArrayInfo:
    """A weight no mesh axis splits (every logical axis None): the vision encoders' weights, a small share of
    a model's bytes that runs once per image, off the decode path."""
    return ArrayInfo(tuple(shape), dtype, (None,) * len(shape), init)


def is_array_info(x) -> bool:
    return isinstance(x, ArrayInfo)


def linear_weight(cfg: LlamaConfig, info: ArrayInfo, num_out_dims: int = 1):
    """A linear layer's declaration: `info` itself, or with `cfg.weight_dtype` a
    `QuantizedArray` of two declarations: the data (same shape and axes, int8/fp8)
    and one fp32 scale per output channel (the first `num_out_dims` dims, with
    their logical axes, so the rules shard it like the data's rows).

    Linear weights are stored output dims first, input dims last ([out, in], the
    PyTorch / Hugging Face layout): every matmul contracts the weight's trailing
    dims. On XLA CPU that is faster for decode-sized batches (8-32 rows) than
    [in, out], provided the dot is 2-D: `model.forward` merges wq/wk/wv/wo's
    (heads, head_dim) dims first, since a 3-D dot made XLA transpose the weight
    on every call. Checkpoint conversion from Hugging Face needs no transposes."""
    if cfg.weight_dtype is None:
        return info
    grouped = grouped_kind(cfg.weight_dtype)
    if grouped is not None:  # a published checkpoint's group-wise scales: [out..., input groups]
        dtype, group = grouped
        groups = -(-math.prod(info.shape[num_out_dims:]) // group)
        return GroupQuantizedArray(
            data=ArrayInfo(info.shape, dtype, info.logical_axes, info.initializer),
            scale=ArrayInfo(info.shape[:num_out_dims] + (groups,), SCALE_DTYPE,
                            info.logical_axes[:num_out_dims] + (None,), ones_init), group=group)
    return QuantizedArray(
        data=ArrayInfo(info.shape, storage_dtype(cfg.weight_dtype), info.logical_axes, info.initializer),
        scale=ArrayInfo(info.shape[:num_out_dims], SCALE_DTYPE, info.logical_axes[:num_out_dims], ones_init),
    )


def pytree_dataclass(cls):
    """A frozen dataclass registered as a pytree whose fields are all children."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = [f.name for f in dataclasses.fields(cls)]
    return jax.tree_util.register_dataclass(cls, data_fields=fields, meta_fields=[])


def attention_extras(cfg: LlamaConfig) -> dict:
    """The optional attention weights a config turns on, for every layer type that has them: q/k/v
    biases (`attention_bias`; they stay in the compute dtype when the weights are quantized) and the
    per-head q/k RMSNorm weights (`qk_norm`)."""
    d, nq, nkv, dt = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.jnp_dtype
    extra = {}
    if cfg.attention_bias:
        extra.update(q_bias=ArrayInfo((nq, d), dt, ("q_heads", "head_dim"), normal_init(d)),
                     k_bias=ArrayInfo((nkv, d), dt, ("kv_heads", "head_dim"), normal_init(d)),
                     v_bias=ArrayInfo((nkv, d), dt, ("kv_heads", "head_dim"), normal_init(d)))
    if cfg.qk_norm:
        extra.update(q_norm=ArrayInfo((d,), dt, ("norm",), ones_init), k_norm=ArrayInfo((d,), dt, ("norm",), ones_init))
    return extra


@pytree_dataclass
class Layer:
    # Linear weights are [out..., in...] (see `linear_weight`).
    attn_norm: Any  # [embed]
    wq: Any  # [q_heads, head_dim, embed]
    wk: Any  # [kv_heads, head_dim, embed]
    wv: Any  # [kv_heads, head_dim, embed]
    wo: Any  # [embed, q_heads, head_dim]
    mlp_norm: Any  # [embed]
    w_gate: Any  # [ffw, embed]
    w_up: Any  # [ffw, embed]
    w_down: Any  # [embed, ffw]
    # What other families add (None, so no weight, in a Llama): every layer of one model has the
    # same ones, so the layers stack into one pytree structure.
    q_bias: Any = None  # [q_heads, head_dim]  (cfg.attention_bias)
    k_bias: Any = None  # [kv_heads, head_dim]
    v_bias: Any = None  # [kv_heads, head_dim]
    q_norm: Any = None  # [head_dim]  (cfg.qk_norm)
    k_norm: Any = None  # [head_dim]
    post_attn_norm: Any = None  # [embed]  (cfg.sandwich_norms)
    post_mlp_norm: Any = None  # [embed]

    @classmethod
    def declare(cls, cfg: LlamaConfig) -> "Layer":
        h, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        nq, nkv, dt = cfg.num_heads, cfg.num_kv_heads, cfg.jnp_dtype
        lin = functools.partial(linear_weight, cfg)
        extra = attention_extras(cfg)
        if cfg.sandwich_norms:
            extra.update(post_attn_norm=ArrayInfo((h,), dt, ("norm",), ones_init),
                         post_mlp_norm=ArrayInfo((h,), dt, ("norm",), ones_init))
        return cls(**extra,
            attn_norm=ArrayInfo((h,), dt, ("norm",), ones_init),
            wq=lin(ArrayInfo((nq, d, h), dt, ("q_heads", "head_dim", "embed"), normal_init(h)), 2),
            wk=lin(ArrayInfo((nkv, d, h), dt, ("kv_heads", "head_dim", "embed"), normal_init(h)), 2),
            wv=lin(ArrayInfo((nkv, d, h), dt, ("kv_heads", "head_dim", "embed"), normal_init(h)), 2),
            wo=lin(ArrayInfo((h, nq, d), dt, ("embed", "q_heads", "head_dim"), normal_init(nq * d))),
            mlp_norm=ArrayInfo((h,), dt, ("norm",), ones_init),
            w_gate=lin(ArrayInfo((f, h), dt, ("ffw", "embed"), normal_init(h))),
            w_up=lin(ArrayInfo((f, h), dt, ("ffw", "embed"), normal_init(h))),
            w_down=lin(ArrayInfo((h, f), dt, ("embed", "ffw"), normal_init(f))),
        )


@pytree_dataclass
class Weights:
    embed: Any  # [vocab, embed]
    layers: list
    final_norm: Any  # [embed]
    lm_head: Any  # [vocab, embed] like `embed` (one einsum for both), or None when tied to `embed`
    vision: Any = None  # a vision-language model's image encoder (`model.vision`); None: text only

    @classmethod
    def declare(cls, cfg: LlamaConfig, layer=None) -> "Weights":
        """`layer(cfg)` declares one decoder layer (default `Layer.declare`; a family whose layers
        differ, like a mixture of experts, passes its own; every layer has the same structure)."""
        h, v, dt = cfg.hidden_size, cfg.vocab_size, cfg.jnp_dtype
        layer = layer or Layer.declare
        head = ArrayInfo((v, h), dt, ("vocab", "embed"), normal_init(h))
        return cls(
            embed=ArrayInfo((v, h), dt, ("vocab", "embed"), normal_init(h)),
            layers=[layer(cfg) for _ in range(cfg.num_layers)],
            final_norm=ArrayInfo((h,), dt, ("norm",), ones_init),
            lm_head=None if cfg.tie_word_embeddings else head if cfg.float_lm_head else linear_weight(cfg, head),
        )
