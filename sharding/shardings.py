"""Shardings of the weights and the paged KV cache, derived from their declarations.

`param_shardings` and `cache_shardings` walk the `ArrayInfo` declaration trees
that the config's model family declares (`model.families`; for Llama
`model.params.Weights` and `model.cache.KVCache`), resolve each leaf's logical
axes through a rule table, and return pytrees of `NamedSharding` with the same
structure as the arrays (so they can be passed to `init_params`,
`init_cache`, `load_checkpoint` or `jax.jit(in_shardings=...)`).
"""

from __future__ import annotations

import math
from typing import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from model.cache import KVCache
from model.config import ModelConfig
from model.families import family_for_config
from model.params import ArrayInfo, Weights, _path_name, is_array_info
from sharding.mesh import mesh_axis_sizes
from sharding.rules import DimResolution, RuleError, Rules, load_rules, resolve_dims, spec_from_dims


def _resolve_tree(decl, rules: Rules, axis_sizes: Mapping[str, int], prefix: str):
    """{flat name: [DimResolution]} for every declared leaf, in tree order."""
    out = {}
    for path, info in jax.tree_util.tree_flatten_with_path(decl, is_leaf=is_array_info)[0]:
        name = f"{prefix}{_path_name(path)}"
        out[name] = (info, resolve_dims(info.logical_axes, info.shape, rules, axis_sizes, where=name))
    return out


def param_resolutions(cfg: ModelConfig, mesh_or_sizes, rules) -> dict[str, tuple[ArrayInfo, list[DimResolution]]]:
    return _resolve_tree(family_for_config(cfg).declare_weights(cfg), load_rules(rules),
                         mesh_axis_sizes(mesh_or_sizes), "")


def cache_resolutions(cfg: ModelConfig, mesh_or_sizes, rules, num_pages: int, page_size: int, dtype=None):
    decl = family_for_config(cfg).declare_cache(cfg, num_pages, page_size, dtype)
    return _resolve_tree(decl, load_rules(rules), mesh_axis_sizes(mesh_or_sizes), "cache.")


def check_rules(rules, cfg: ModelConfig, mesh_or_sizes, *, num_pages: int = 1, page_size: int = 1,
                kv_dtype=None) -> list[str]:
    """Validates a rule table against every weight and cache array of `cfg` on a mesh
    (a `Mesh` or an {axis: size} dict). Raises `RuleError` on the first problem;
    returns notes about dimensions that fell back to replication."""
    notes = []
    both = {**param_resolutions(cfg, mesh_or_sizes, rules),
            **cache_resolutions(cfg, mesh_or_sizes, rules, num_pages, page_size, kv_dtype)}
    seen = set()
    for name, (_, dims) in both.items():
        for d in dims:
            if d.replicated_fallback and (d.logical, d.size) not in seen:
                seen.add((d.logical, d.size))
                notes.append(f"{d.logical} (size {d.size}) is replicated: fewer than the devices of its mesh axes")
    check_attention_groups(load_rules(rules), cfg, mesh_axis_sizes(mesh_or_sizes))
    return notes


def check_attention_groups(rules: Rules, cfg: ModelConfig, sizes: Mapping[str, int]) -> None:
    """Query heads may be split only if each device's query heads share their KV heads' split."""
    q = resolve_dims(("q_heads",), (cfg.num_heads,), rules, sizes, where="wq")[0]
    kv = resolve_dims(("kv_heads",), (cfg.num_kv_heads,), rules, sizes, where="wk")[0]
    if kv.mesh_axes and kv.mesh_axes != q.mesh_axes:
        raise RuleError(f"kv_heads is split over {list(kv.mesh_axes)} but q_heads over {list(q.mesh_axes)}: "
                        "a query head must live with its KV head")


def _named(mesh: Mesh, resolved) -> list[NamedSharding]:
    return [NamedSharding(mesh, spec_from_dims(dims)) for _, dims in resolved.values()]


def param_shardings(cfg: ModelConfig, mesh: Mesh, rules="megatron") -> Weights:
    """A `Weights` pytree of `NamedSharding`, one per declared weight."""
    rules = load_rules(rules)
    check_attention_groups(rules, cfg, mesh_axis_sizes(mesh))
    decl = family_for_config(cfg).declare_weights(cfg)
    treedef = jax.tree_util.tree_structure(decl, is_leaf=is_array_info)
    return jax.tree_util.tree_unflatten(treedef, _named(mesh, param_resolutions(cfg, mesh, rules)))


def cache_shardings(cfg: ModelConfig, mesh: Mesh, rules="megatron", num_pages: int = 1, page_size: int = 16,
                    dtype=None) -> KVCache:
    """A `KVCache` pytree of `NamedSharding` (pages follow their KV heads)."""
    rules = load_rules(rules)
    decl = family_for_config(cfg).declare_cache(cfg, num_pages, page_size, dtype)
    treedef = jax.tree_util.tree_structure(decl, is_leaf=is_array_info)
    return jax.tree_util.tree_unflatten(
        treedef, _named(mesh, cache_resolutions(cfg, mesh, rules, num_pages, page_size, dtype)))


def bytes_per_device(infos, shardings) -> int:
    """Bytes one device holds of arrays declared by `infos` (ArrayInfo leaves) placed with
    `shardings` (a matching tree of NamedSharding); shards are even, so every device holding
    a part holds this much."""
    infos = jax.tree_util.tree_leaves(infos, is_leaf=is_array_info)
    shardings = jax.tree_util.tree_leaves(shardings)
    if len(infos) != len(shardings):
        raise ValueError(f"{len(infos)} arrays but {len(shardings)} shardings")
    return sum(math.prod(sh.shard_shape(tuple(i.shape))) * np.dtype(i.dtype).itemsize
               for i, sh in zip(infos, shardings))


def logical_sharding(mesh: Mesh, rules, logical_axes, shape) -> NamedSharding:
    """The sharding of any other array (an activation, a host input) with these logical axes."""
    rules = load_rules(rules)
    dims = resolve_dims(logical_axes, shape, rules, mesh_axis_sizes(mesh), where=f"array {tuple(logical_axes)}")
    return NamedSharding(mesh, spec_from_dims(dims))
