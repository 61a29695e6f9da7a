"""Expert parallelism: a mixture of experts' MLP run per device on its own experts.

The rule table places the expert weights: logical axis `experts` (whole experts per
device, expert parallelism) and `moe_ffw` (a slice of every expert's hidden dim, tensor
parallelism inside the experts) each map to mesh axes (`configs/rules_*.json`).
`expert_parallel` wraps `model.moe.grouped_experts` (or its dense reference) in a
`shard_map` over those axes:

* tokens, their expert ids and routing weights enter replicated (the router is
  replicated and cheap, so every device routes every token identically);
* each device runs the grouped matmul over *its* experts only: assignments to experts
  held elsewhere sort past its last group and contribute zero; with `moe_ffw` split, it
  computes its slice of the hidden dim, and its `w_down` product is a partial sum;
* one `psum` over those mesh axes adds the partial outputs (an all-reduce of `[T, embed]`
  fp32 per layer, the same collective a row-parallel dense MLP ends in).

This is the simplest exact scheme: no all-to-all token dispatch, so no capacity limits and
no dropped tokens; every device sorts all `T*k` assignments, which at serving batch sizes
costs far less than the expert matmuls. The planner (`sharding.estimate`) prices the
all-reduce.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import PartitionSpec

from model.quant import QuantizedArray
from sharding.rules import RuleError, resolve_dims

GATE_AXES = ("experts", "moe_ffw", "embed")
DOWN_AXES = ("experts", "embed", "moe_ffw")


def expert_axes(rules, cfg, sizes) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(mesh axes splitting experts, mesh axes splitting moe_ffw) under `rules`."""
    e = resolve_dims(("experts",), (cfg.num_experts,), rules, sizes, where="experts")[0]
    f = resolve_dims(("moe_ffw",), (cfg.moe_intermediate_size,), rules, sizes, where="moe_ffw")[0]
    if resolve_dims(("embed",), (cfg.hidden_size,), rules, sizes, where="embed")[0].mesh_axes:
        raise RuleError(f"rule table {rules.name!r} splits 'embed'; the expert-parallel MLP needs the "
                        "hidden dimension replicated")
    return e.mesh_axes, f.mesh_axes


def expert_parallel(layout, experts_fn, cfg):
    """`experts_fn(x, ids, weights, w_gate, w_up, w_down)` run per device on its experts and
    summed over the devices that split them; `experts_fn` itself when nothing is split."""
    sizes = layout.axis_sizes
    e_axes, f_axes = expert_axes(layout.rules, cfg, sizes)
    split = tuple(a for a in e_axes + f_axes if sizes[a] > 1)
    if not split:
        return experts_fn
    e, f, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    gate_spec = layout.spec(GATE_AXES, (e, f, h))
    down_spec = layout.spec(DOWN_AXES, (e, h, f))
    rep = PartitionSpec()
    index_axes = e_axes[0] if len(e_axes) == 1 else e_axes

    def local(x, ids, weights, w_gate, w_up, w_down):
        offset = jax.lax.axis_index(index_axes) * w_gate.shape[0] if e_axes else 0
        out = experts_fn(x, ids, weights, w_gate, w_up, w_down, expert_offset=offset)
        return jax.lax.psum(out, split)

    def run(x, ids, weights, w_gate, w_up, w_down):
        def spec(w, full):
            if isinstance(w, QuantizedArray):  # scales are [experts, out]: the data spec's first two dims
                return QuantizedArray(full, PartitionSpec(*tuple(full)[:2]))
            return full
        in_specs = (rep, rep, rep, spec(w_gate, gate_spec), spec(w_up, gate_spec), spec(w_down, down_spec))
        f = jax.shard_map(local, mesh=layout.mesh, in_specs=in_specs, out_specs=rep, check_vma=False)
        return f(x, ids, weights, w_gate, w_up, w_down)

    return functools.wraps(experts_fn)(run)
