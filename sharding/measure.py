"""`sharding.plan --measure`: compile the real forward step for a layout and read what XLA did.

The decode step (one token for each of `batch` sequences, each with
`context_len` tokens of paged KV) is lowered with abstract, sharded inputs
(nothing is allocated, so even a 70B shape compiles on CPU devices) and
compiled for the devices present. From the compiled executable come the
per-device argument / output / temp bytes of its memory analysis, and from its
HLO text the collectives, attributed to layers by the forward's named scopes.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from model.cache import BatchMetadata
from model.config import ModelConfig
from model.families import family_for_config
from model.forward import forward
from model.params import abstract_params, is_array_info
from sharding.hlo import collectives_per_layer, collective_counts
from sharding.layout import Layout
from sharding.mesh import describe_mesh, make_mesh
from sharding.rules import load_rules, shard_count
from sharding.shardings import cache_resolutions, cache_shardings, param_resolutions, param_shardings


def abstract_step_inputs(cfg: ModelConfig, mesh, rules, *, batch: int, context_len: int, page_size: int,
                         kv_dtype=None):
    """ShapeDtypeStructs (with shardings) for params, cache, tokens and metadata of a decode step."""
    pages_per_seq = math.ceil(context_len / page_size)
    num_pages = batch * pages_per_seq
    params = abstract_params(cfg, param_shardings(cfg, mesh, rules))
    decl = family_for_config(cfg).declare_cache(cfg, num_pages, page_size, kv_dtype)
    cache = jax.tree.map(lambda i, s: jax.ShapeDtypeStruct(i.shape, i.dtype, sharding=s), decl,
                         cache_shardings(cfg, mesh, rules, num_pages, page_size, kv_dtype), is_leaf=is_array_info)
    rep = NamedSharding(mesh, PartitionSpec())
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rep)
    md = BatchMetadata(positions=i32(batch), slot_mapping=i32(batch), cu_q_lens=i32(batch + 1),
                       kv_lens=i32(batch), block_tables=i32(batch, pages_per_seq), num_seqs=i32(),
                       logits_indices=i32(batch))
    return params, cache, i32(batch), md, num_pages


def measure(cfg: ModelConfig, *, tp: int, batch: int, context_len: int, rules="megatron", page_size: int = 16,
            kv_dtype=None, backend: str = "reference", devices=None) -> dict:
    """Compiles the TP decode step on the first `tp` devices present and reports memory and collectives."""
    rules = load_rules(rules)
    mesh = make_mesh(tensor=tp, devices=devices)
    layout = Layout(mesh, rules)
    params, cache, tokens, md, num_pages = abstract_step_inputs(
        cfg, mesh, rules, batch=batch, context_len=context_len, page_size=page_size, kv_dtype=kv_dtype)
    step = jax.jit(functools.partial(forward, cfg=cfg, backend=backend, layout=layout), donate_argnums=1)
    compiled = step.lower(params, cache, tokens, md).compile()
    hlo = compiled.as_text()

    sizes = dict(mesh.shape)
    w_dev = sum(math.prod(i.shape) * jnp.dtype(i.dtype).itemsize / shard_count(d, sizes)
                for i, d in param_resolutions(cfg, sizes, rules).values())
    c_dev = sum(math.prod(i.shape) * jnp.dtype(i.dtype).itemsize / shard_count(d, sizes)
                for i, d in cache_resolutions(cfg, sizes, rules, num_pages, page_size, kv_dtype).values())
    per_layer = collectives_per_layer(hlo)
    layer_counts = [per_layer.get(i, {}) for i in range(cfg.num_layers)]
    uniform = all(c == layer_counts[0] for c in layer_counts)
    mem = compiled.memory_analysis()
    memory = None
    if mem is not None:
        memory = {k: int(getattr(mem, f"{k}_size_in_bytes")) for k in ("argument", "output", "temp", "alias")}
    return {
        "mesh": describe_mesh(mesh),
        "platform": mesh.devices.flat[0].platform,
        "step": {"kind": "decode", "tokens": batch, "sequences": batch, "context_len": context_len,
                 "page_size": page_size, "num_pages": num_pages, "backend": backend},
        "memory_per_device": memory,
        "predicted_per_device": {"weight_bytes": w_dev, "cache_bytes": c_dev, "argument_bytes": w_dev + c_dev},
        "collectives": {
            "per_layer": layer_counts[0] if uniform else None,
            "layers_differ": None if uniform else layer_counts,
            "outside_layers": per_layer.get("outside", {}),
            "total": collective_counts(hlo),
        },
        "predicted_collectives": {"per_layer": {"all-reduce": 2} if tp > 1 else {},
                                  "outside_layers": {"all-reduce": 1} if tp > 1 else {}},
    }
