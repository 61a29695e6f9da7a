"""A whole model's float weights quantized to int8 / fp8 (`quantize_params`), at load time.

Which weights become `QuantizedArray`s, and along which dims their scales run, is what the
quantized config's family declares (`model.families`, from `model.declarations.linear_weight`);
the arithmetic is `model.quant.quantize`. This module sits above the family registry, as
`model.params` does: `model.quant` is a leaf the families build on, so nothing there looks a
config's family up.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from model.declarations import is_array_info
from model.families import family_for_config
from model.quant import GroupQuantizedArray, check_weight_dtype, is_quantized, quantize, quantize_grouped

def quantize_params(params, cfg, weight_dtype: str, shardings=None):
    """Float `Weights` -> the quantized `Weights` that `cfg.replace(weight_dtype=...)` declares.

    Returns (quantized config, params). Which weights are quantized and along
    which dims comes from the declarations (`model.families`), never from names
    here. Sharded inputs stay sharded (pass the quantized config's `shardings`
    to place the result). The weights are converted by one jitted program per
    set of devices holding them: under pipeline parallelism every stage's layers
    live on that stage's devices only, and one program cannot take arguments
    committed to different device sets. So a pipeline of `p` stages compiles
    `p + 1` small programs (each stage's layers, and the replicated rest), and
    an unsharded or tensor-parallel model one, as before.
    """
    weight_dtype = check_weight_dtype(weight_dtype)
    if weight_dtype == "auto":
        return cfg, params
    if cfg.weight_dtype == weight_dtype:
        return cfg, params
    if cfg.weight_dtype is not None:
        raise ValueError(f"the weights are already quantized to {cfg.weight_dtype}; cannot convert them to "
                         f"{weight_dtype} (load the float checkpoint instead)")
    qcfg = cfg.replace(weight_dtype=weight_dtype)
    decl = family_for_config(qcfg).declare_weights(qcfg)
    is_decl_leaf = lambda x: is_array_info(x) or is_quantized(x)  # noqa: E731
    decl_leaves, treedef = jax.tree_util.tree_flatten(decl, is_leaf=is_decl_leaf)
    leaves = treedef.flatten_up_to(params)
    targets = [None] * len(leaves) if shardings is None else treedef.flatten_up_to(shardings)

    groups: dict[Any, list[int]] = {}  # device set -> leaf indices
    for i, (d, t) in enumerate(zip(decl_leaves, targets)):
        if t is not None:  # the float weight goes where its quantized data goes (same shape and axes)
            leaves[i] = jax.device_put(leaves[i], t.data if is_quantized(d) else t)
        groups.setdefault(_device_set(leaves[i]), []).append(i)

    out = [None] * len(leaves)
    for idx in groups.values():
        kinds = tuple(_ConvertKind.of(decl_leaves[i]) for i in idx)
        outs = None if shardings is None else tuple(targets[i] for i in idx)
        for i, w in zip(idx, _convert_group([leaves[i] for i in idx], kinds=kinds, out_shardings=outs)):
            out[i] = w
    return qcfg, jax.tree_util.tree_unflatten(treedef, out)


@dataclasses.dataclass(frozen=True)
class _ConvertKind:
    """What one declared weight becomes: quantized to `dtype` with one scale per entry of its
    first `num_out_dims` dims, or (`num_out_dims` None) cast to `dtype`. Hashable: a static
    jit argument."""

    dtype: Any
    num_out_dims: int | None
    group: int | None = None  # grouped scales (`model.quant.GroupQuantizedArray`): input columns per scale

    @classmethod
    def of(cls, decl) -> "_ConvertKind":
        if isinstance(decl, GroupQuantizedArray):
            return cls(jnp.dtype(decl.data.dtype), len(decl.scale.shape) - 1, decl.group)
        if is_quantized(decl):
            return cls(jnp.dtype(decl.data.dtype), len(decl.scale.shape))
        return cls(jnp.dtype(decl.dtype), None)


def _device_set(x):
    """The devices a committed array lives on (None for host, uncommitted or traced arrays: any
    program takes them; a trace, e.g. `init_params` under `eval_shape`, is one program already)."""
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.committed:
        return frozenset(x.sharding.device_set)
    return None


@functools.partial(jax.jit, static_argnames=("kinds", "out_shardings"))
def _convert_group(leaves, kinds, out_shardings=None):
    """Converts arrays that live on one set of devices; `kinds` and `out_shardings` are static,
    so every call with the same weight shapes, kinds and placement reuses one compilation."""
    out = [w.astype(k.dtype) if k.num_out_dims is None
           else quantize(w, k.dtype, k.num_out_dims) if k.group is None
           else quantize_grouped(w, k.dtype, k.num_out_dims, k.group)
           for w, k in zip(leaves, kinds)]
    if out_shardings is not None:
        out = [jax.lax.with_sharding_constraint(w, s) for w, s in zip(out, out_shardings)]
    return out
