"""Model parameters as a pytree of dataclasses, each weight declared once: the entry points
that work on any registered family's weights.

Every weight is declared by an `ArrayInfo` (shape, dtype, logical axes,
initializer; `model.declarations`), and a config's family (`model.families`)
declares the whole tree (`declare_weights`). The same declaration tree gives
random initialisation (`init_params`), abstract shapes for checkpoint restore
(`abstract_params`) and shardings (`sharding.rules` maps logical axes to mesh
axes), so the three can never disagree.

This module sits above the family registry; the families are built from the
blocks of `model.declarations` (`ArrayInfo`, `linear_weight`, `Layer`,
`Weights`, ...), which it re-exports, so `from model.params import Weights`
keeps working.

Layers are declared, stored and converted as a list of per-layer arrays (the
checkpoint's naming, `layers.3.wq`). To scan over layers (one `jax.lax.scan`,
one compiled layer body whatever the depth) the serving runner stacks them
once at load (`stack_layers`: one `Layer` whose leaves have a leading
`[num_layers]` axis), except on XLA CPU: there the scan's per-layer slice of a
stacked weight is a copy (batch-1 decode of 8 layers of 1024x2816 fp32
weights 4x slower than unrolled; the GPU compiler feeds the slice to its
matmuls in place), so the list stays and the scanned body picks each matrix
by `lax.switch` (`model.layer_select`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from model.config import LlamaConfig
from model.declarations import (  # noqa: F401  (re-exported: the blocks' long-standing import path)
    ArrayInfo, Initializer, Layer, Weights, attention_extras, is_array_info, linear_weight, normal_init, ones_init,
    pytree_dataclass)
from model.families import family_for_config
from model.quantize import quantize_params


def stack_layers(params: Weights, layer_shardings=None) -> Weights:
    """`params` with `layers` as one `Layer` of `[num_layers, ...]` leaves (what the scanned forward
    takes); `layer_shardings`, a `Layer` of shardings for the stacked leaves, places them."""
    stack = jax.jit(lambda layers: jax.tree.map(lambda *xs: jnp.stack(xs), *layers), out_shardings=layer_shardings)
    return dataclasses.replace(params, layers=stack(list(params.layers)))


def declare_weights(cfg: LlamaConfig) -> Weights:
    """The weight declarations of `cfg`'s model family (`model.families`)."""
    return family_for_config(cfg).declare_weights(cfg)


def init_params(cfg: LlamaConfig, key: jax.Array, shardings=None) -> Weights:
    """Random weights from the declarations (jit-compiled, optionally straight into shardings)."""
    if cfg.weight_dtype is not None:  # random float weights, then quantized like a checkpoint would be
        return quantize_params(init_params(cfg.replace(weight_dtype=None), key), cfg.replace(weight_dtype=None),
                               cfg.weight_dtype, shardings)[1]
    sharding_leaves = None if shardings is None else tuple(jax.tree.leaves(shardings))
    return _init_fn(cfg, sharding_leaves)(key)


@functools.lru_cache(maxsize=16)
def _init_fn(cfg: LlamaConfig, sharding_leaves):
    # Cached per (config, shardings) so repeated initialisation compiles once.
    decl = declare_weights(cfg)
    leaves, treedef = jax.tree_util.tree_flatten(decl, is_leaf=is_array_info)
    out_shardings = None if sharding_leaves is None else jax.tree_util.tree_unflatten(treedef, sharding_leaves)

    def build(key):
        keys = jax.random.split(key, len(leaves))
        arrays = [info.initializer(k, info.shape, info.dtype) for info, k in zip(leaves, keys)]
        return jax.tree_util.tree_unflatten(treedef, arrays)

    return jax.jit(build, out_shardings=out_shardings)


def abstract_params(cfg: LlamaConfig, shardings=None) -> Weights:
    """`jax.ShapeDtypeStruct` per weight, carrying target shardings when given."""
    decl = declare_weights(cfg)
    if shardings is None:
        return jax.tree.map(lambda i: jax.ShapeDtypeStruct(i.shape, i.dtype), decl, is_leaf=is_array_info)
    return jax.tree.map(
        lambda i, s: jax.ShapeDtypeStruct(i.shape, i.dtype, sharding=s), decl, shardings, is_leaf=is_array_info
    )


def logical_axes(cfg: LlamaConfig) -> Weights:
    """The logical axes of every weight, as a pytree of tuples (leaves are tuples)."""
    return jax.tree.map(lambda i: i.logical_axes, declare_weights(cfg), is_leaf=is_array_info)


def flatten_params(params) -> dict[str, Any]:
    """A flat {"layers.0.wq": array} dict: the on-disk and conversion naming."""
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_array_info)[0]:
        flat[_path_name(path)] = leaf
    return flat


def unflatten_params(cfg: LlamaConfig, flat: dict[str, Any]) -> Weights:
    decl = declare_weights(cfg)
    paths, treedef = jax.tree_util.tree_flatten_with_path(decl, is_leaf=is_array_info)
    names = [_path_name(p) for p, _ in paths]
    missing = [n for n in names if n not in flat]
    if missing:
        raise KeyError(f"missing weights: {missing[:5]}{'...' if len(missing) > 5 else ''}")
    return jax.tree_util.tree_unflatten(treedef, [flat[n] for n in names])


def _path_name(path) -> str:
    parts = []
    for p in path:
        if isinstance(p, jax.tree_util.GetAttrKey):
            parts.append(p.name)
        elif isinstance(p, jax.tree_util.SequenceKey):
            parts.append(str(p.idx))
        elif isinstance(p, jax.tree_util.DictKey):
            parts.append(str(p.key))
        else:
            parts.append(str(p))
    return ".".join(parts)


def param_bytes(params) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
