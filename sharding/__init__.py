"""Layouts: the device mesh, logical-axis rule tables, and the shardings derived from them.

    mesh = sharding.make_mesh(tensor=4)
    rules = sharding.load_rules("megatron")
    params = init_params(cfg, key, shardings=sharding.param_shardings(cfg, mesh, rules))
    cache = init_cache(cfg, pages, page_size, shardings=sharding.cache_shardings(cfg, mesh, rules, pages, page_size))
    logits, cache = forward(params, cache, tokens, md, cfg, layout=sharding.Layout.create(mesh, rules))

`python -m sharding.plan` does the layout arithmetic (see docs/sharding.md).
"""

from sharding.layout import Layout, make_layout
from sharding.mesh import AXES, MeshError, describe_mesh, make_mesh
from sharding.rules import RuleError, Rules, available_rules, load_rules, resolve_spec
from sharding.shardings import cache_shardings, check_rules, logical_sharding, param_shardings

__all__ = [
    "AXES", "Layout", "MeshError", "RuleError", "Rules", "available_rules", "cache_shardings", "check_rules",
    "describe_mesh", "load_rules", "logical_sharding", "make_layout", "make_mesh", "param_shardings",
    "resolve_spec",
]
