"""The mixture-of-experts MLP: a router picks `k` of `E` experts per token and mixes their outputs.

Three pieces, each a pure function:

* `route(logits, cfg)` -> (expert ids `[T, k]`, weights `[T, k]`), exactly as each family
  defines it (`LlamaConfig.moe_router`): Mixtral takes a softmax over the top-k logits;
  Qwen3-MoE a softmax over every expert, then the top k, renormalised when
  `norm_topk_prob`.
* `grouped_experts(...)`, the serving path: the `T*k` (token, expert) assignments are
  sorted by expert, each expert's rows form one group, and every projection is one
  `jax.lax.ragged_dot_general` over the groups, so an expert's weights multiply only the
  tokens routed to it. Shapes are static (the sorted buffer always has `T*k` rows); the
  group sizes are data, so no routing decision recompiles anything.
* `dense_experts(...)`, the reference: every expert on every token, weighted by a dense
  `[T, E]` combine matrix (zero where a token did not pick the expert). Tests compare the
  two on random inputs.
* `touched_experts(...)`, XLA CPU's decode path: a loop over the experts some token
  picked. `serving_experts` says which one the forward runs (grouped everywhere but on
  CPU, where `ragged_dot` is expanded into a masked dense product; see there).

Expert weights are stacked along a leading `experts` dim, each expert `[out, in]` like every
linear weight (`model.declarations`): `w_gate`, `w_up` `[E, moe_ffw, embed]`, `w_down`
`[E, embed, moe_ffw]`. Quantized ones (`QuantizedArray`) carry one scale per expert and
output channel, `[E, out]`.

Expert parallelism: `grouped_experts` computes the experts `expert_offset ..
expert_offset + E_local` of its weights only (rows routed elsewhere sort past the last group
and come out zero), so a device holding a slice of the experts computes its part of every
token's output, and a sum over devices completes it (`sharding.experts`, reached through
`layout.expert_parallel` when the layout has one).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from model.linear import linear
from model.quant import QuantizedArray, dequantize

# lhs [rows, in] x rhs [groups, out, in] -> [rows, out]: rows are grouped, the weight is [out, in].
_RAGGED_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def route(logits, cfg):
    """(ids `[T, k]` int32, weights `[T, k]` fp32) from router logits `[T, E]` (fp32)."""
    k = cfg.num_experts_per_tok
    logits = logits.astype(jnp.float32)
    if cfg.moe_router == "topk_softmax":
        top, ids = jax.lax.top_k(logits, k)
        return ids, jax.nn.softmax(top, axis=-1)
    weights, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return ids, weights


def router_logits(x, router):
    """x `[T, embed]` @ router `[E, embed]` -> fp32 logits `[T, E]`."""
    return jnp.einsum("te,xe->tx", x, router, preferred_element_type=jnp.float32)


def _ragged(rows, w, group_sizes, row_expert):
    """rows `[M, in]` through each row's expert of `w` `[G, out, in]` -> `[M, out]`.

    A quantized `w` is widened to the rows' dtype and its output scaled by the row's
    expert's per-channel scale (`row_expert` clipped into range: rows past the groups are
    zero anyway)."""
    if not isinstance(w, QuantizedArray):
        return jax.lax.ragged_dot_general(rows, w, group_sizes, _RAGGED_DIMS)
    out = jax.lax.ragged_dot_general(rows, w.data.astype(rows.dtype), group_sizes, _RAGGED_DIMS)
    scale = w.scale[jnp.clip(row_expert, 0, w.scale.shape[0] - 1)]
    return (out.astype(jnp.float32) * scale).astype(out.dtype)


def grouped_experts(x, ids, weights, w_gate, w_up, w_down, expert_offset=0):
    """The experts' mixed output `[T, embed]` (fp32) for tokens x `[T, embed]` routed to
    `ids` `[T, k]` with `weights` `[T, k]`, over the experts this call holds
    (`expert_offset` onwards, as many as `w_gate` has; others contribute zero)."""
    t, k = ids.shape
    local = w_gate.shape[0]
    expert = ids.reshape(-1) - expert_offset  # [T*k]
    mine = (expert >= 0) & (expert < local)
    key = jnp.where(mine, expert, local)  # the others sort last, past every group
    order = jnp.argsort(key, stable=True)
    row_expert = key[order]
    token = order // k
    group_sizes = jnp.zeros((local + 1,), jnp.int32).at[key].add(1)[:local]
    rows = x[token]  # [T*k, embed]
    gate = _ragged(rows, w_gate, group_sizes, row_expert)
    up = _ragged(rows, w_up, group_sizes, row_expert)
    y = _ragged(jax.nn.silu(gate) * up, w_down, group_sizes, row_expert)  # [T*k, embed]
    w = jnp.where(mine, weights.reshape(-1), 0.0)[order]
    return jnp.zeros((t, x.shape[1]), jnp.float32).at[token].add(y.astype(jnp.float32) * w[:, None])


def _combine(ids, weights, local, expert_offset):
    """The dense `[T, local]` mixing matrix: token t's weight for each expert held here."""
    t = ids.shape[0]
    expert = ids - expert_offset
    mine = (expert >= 0) & (expert < local)
    combine = jnp.zeros((t, local + 1), jnp.float32).at[
        jnp.arange(t)[:, None], jnp.where(mine, expert, local)].add(jnp.where(mine, weights, 0.0))
    return combine[:, :local], jnp.zeros((local + 1,), bool).at[jnp.where(mine, expert, local)].set(True)[:local]


def dense_experts(x, ids, weights, w_gate, w_up, w_down, expert_offset=0):
    """The reference of `grouped_experts`: every expert on every token, mixed by a dense
    `[T, E]` combine matrix."""
    def full(w):
        return dequantize(w, x.dtype) if isinstance(w, QuantizedArray) else w

    w_gate, w_up, w_down = full(w_gate), full(w_up), full(w_down)
    gate = jnp.einsum("te,xfe->xtf", x, w_gate)
    up = jnp.einsum("te,xfe->xtf", x, w_up)
    y = jnp.einsum("xtf,xef->xte", jax.nn.silu(gate) * up, w_down).astype(jnp.float32)  # [E, T, embed]
    combine, _ = _combine(ids, weights, w_gate.shape[0], expert_offset)
    return jnp.einsum("tx,xte->te", combine, y)


def _expert(w, e):
    return QuantizedArray(w.data[e], w.scale[e]) if isinstance(w, QuantizedArray) else w[e]


def touched_experts(x, ids, weights, w_gate, w_up, w_down, expert_offset=0):
    """`grouped_experts`' result by a loop over only the experts some token picked (a dynamic
    trip count, so no recompilation), each run on the whole batch and mixed in by the combine
    matrix (zero for the tokens that did not pick it).

    Why: XLA CPU expands `ragged_dot` into a masked product with every expert (plus a
    transpose of the weights): the grouped path ran at 0.02-0.31x the dense reference's
    speed at decode sizes (benchmarks/results/moe_layer_cpu.json). For decode batches, where
    few experts are touched, this loop reads only those experts' weights: 1 token ran 1.4x
    faster than dense over 8 experts (top 2), 9.6x over 64 (top 8), 8 tokens over 64 1.5x."""
    combine, used = _combine(ids, weights, w_gate.shape[0], expert_offset)
    order = jnp.argsort(~used, stable=True)  # the touched experts first

    def body(i, out):
        e = order[i]
        gate = linear("te,fe->tf", x, _expert(w_gate, e))
        up = linear("te,fe->tf", x, _expert(w_up, e))
        y = linear("tf,ef->te", jax.nn.silu(gate) * up, _expert(w_down, e)).astype(jnp.float32)
        return out + y * jax.lax.dynamic_index_in_dim(combine, e, axis=1)

    return jax.lax.fori_loop(0, jnp.sum(used), body, jnp.zeros((x.shape[0], x.shape[1]), jnp.float32))


def serving_experts(num_tokens: int, cfg):
    """The expert computation the forward uses for a batch of `num_tokens` (a static shape, so
    the choice never recompiles): the grouped matmul, except on XLA CPU, whose `ragged_dot`
    is a masked dense product, where decode-sized batches (`tokens * k <= experts`) loop over
    the touched experts and larger ones take the dense product directly (faster there than
    the expansion, the same arithmetic)."""
    if jax.default_backend() != "cpu":
        return grouped_experts
    return touched_experts if num_tokens * cfg.num_experts_per_tok <= cfg.num_experts else dense_experts


def moe_mlp(layer, h, cfg, layout=None, experts=None):
    """The MoE MLP of normed hidden states h `[T, embed]` -> `[T, embed]` in h's dtype;
    `experts` defaults to `serving_experts`' choice."""
    experts = experts or serving_experts(h.shape[0], cfg)
    ids, weights = route(router_logits(h, layer.router), cfg)
    parallel = getattr(layout, "expert_parallel", None)
    run = experts if parallel is None else parallel(experts, cfg)
    return run(h, ids, weights, layer.w_gate, layer.w_up, layer.w_down).astype(h.dtype)
