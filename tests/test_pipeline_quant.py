"""Quantization under pipeline parallelism: int8 / fp8 weights and int8 / fp8 KV pages on stages.

Greedy tokens of a mixed batch (chunked prefills next to decodes, sequences cut by microbatch
boundaries) at PP x TP must equal the same quantization on one device, for every weight dtype
and every KV dtype, with KV heads split (PP=2 x TP=2) and replicated (PP=2 x TP=4) inside a
stage. Forked samples (n=2) share their last page until copy-on-write, which must copy the
pages' scales on every stage. Quantizing weights that already sit on their stages converts
each stage's layers on that stage with one compilation per device set, and the staged
quantized weights and KV scales live on their own stage only. A mixture of experts' quantized expert
weights stage with their per-expert scales.
"""

import functools
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from model import quant, quantize
from model.params import Weights, is_array_info, ones_init
from model.quantize import quantize_params
from serving import LLM, SamplingParams
from sharding.pipeline import copy_staged_pages, make_pipeline_layout

CFG = tiny_config(vocab_size=128, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=8)
NUM_PAGES, PAGE = 32, 8
COMMON = dict(page_size=PAGE, max_model_len=64, num_pages=NUM_PAGES, max_num_seqs=8, max_num_batched_tokens=32,
              min_token_bucket=32, min_context_bucket=64, attention_backend="reference")
_RNG = random.Random(5)
PROMPTS = [[1] + [_RNG.randrange(3, 128) for _ in range(n)] for n in (29, 4, 17, 11)]  # partial last pages


@functools.cache
def params():
    """Random float weights drawn on the host (norms at one): nothing to compile."""
    rng = np.random.default_rng(11)

    def draw(info):
        if info.initializer is ones_init:
            return np.ones(info.shape, np.float32)
        return (0.1 * rng.standard_normal(info.shape)).astype(np.float32)

    return jax.tree.map(draw, Weights.declare(CFG), is_leaf=is_array_info)


def greedy(llm, batch, n=1):
    outs = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=n))
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


@functools.cache
def single_device(weight_dtype, kv_dtype):
    return greedy(LLM(config=CFG, params=params(), weight_dtype=weight_dtype, kv_cache_dtype=kv_dtype, **COMMON),
                  PROMPTS)


@pytest.mark.parametrize("weight_dtype,kv_dtype,pp,tp,m", [("int8", "fp8", 2, 4, 3), ("fp8", "int8", 2, 2, 2)])
def test_quantized_greedy_tokens_identical_to_single_device(weight_dtype, kv_dtype, pp, tp, m):
    want = single_device(weight_dtype, kv_dtype)
    assert len({tuple(t[0]) for t in want}) == len(PROMPTS)  # not vacuous
    llm = LLM(config=CFG, params=params(), weight_dtype=weight_dtype, kv_cache_dtype=kv_dtype,
              pipeline_parallel_size=pp, tensor_parallel_size=tp, num_microbatches=m, **COMMON)
    assert greedy(llm, PROMPTS) == want

    runner = llm.engine.runner
    layout, staged, cache = runner.layout, runner.params, runner.cache
    stage_of = {d: s for s in range(pp) for d in layout.mesh.devices[:, s, :].flat}
    # Weights: staged data in the storage dtype and fp32 scales, every shard on its own stage.
    host_cfg, host = quantize_params(params(), CFG, weight_dtype)
    per_stage = CFG.num_layers // pp
    for j, layer in enumerate(staged.stages):
        for name in ("wq", "w_down"):
            q = getattr(layer, name)
            assert q.data.dtype == quant.storage_dtype(weight_dtype) and q.scale.dtype == jnp.float32
            for field in ("data", "scale"):
                arr = getattr(q, field)
                want_arr = np.concatenate([np.asarray(getattr(getattr(host.layers[s * per_stage + j], name), field)
                                                      .astype(jnp.float32)) for s in range(pp)])
                np.testing.assert_array_equal(np.asarray(arr.astype(jnp.float32)), want_arr)
                rows = arr.shape[0] // pp
                for shard in arr.addressable_shards:
                    first = shard.index[0].start or 0
                    assert first // rows == (first + shard.data.shape[0] - 1) // rows == stage_of[shard.device]
    # KV: quantized pages with their scales, page axis split over stages; every stage wrote scales.
    for page in cache.k + cache.v:
        assert page.data.dtype == quant.storage_dtype(kv_dtype)
        assert page.scale.shape == (pp * NUM_PAGES, PAGE, CFG.num_kv_heads)
        assert page.scale.sharding.spec[0] == page.data.sharding.spec[0]
        scales = np.asarray(page.scale).reshape(pp, NUM_PAGES, -1)
        assert all((scales[s] > 0).any() for s in range(pp))

    # Forks: both greedy samples share the prompt's partial last page until copy-on-write.
    forked = greedy(llm, PROMPTS[:2], n=2)
    assert forked == [[w[0], w[0]] for w in want[:2]]


def test_copy_on_write_copies_quantized_pages_and_scales_on_every_stage():
    layout = make_pipeline_layout(2, 2)
    cache = layout.init_cache(CFG, 6, 2, "int8")
    rng = np.random.default_rng(1)
    leaves, treedef = jax.tree.flatten(cache)
    values = [rng.integers(-127, 128, a.shape).astype(a.dtype) if a.dtype == jnp.int8
              else rng.random(a.shape).astype(np.float32) for a in leaves]
    cache = jax.tree.unflatten(treedef, [jax.device_put(v, a.sharding) for a, v in zip(leaves, values)])
    src, dst = np.array([1, 4, 0], np.int32), np.array([3, 5, 6], np.int32)  # 6 == pages: dropped
    out = jax.jit(copy_staged_pages, static_argnames="layout")(cache, src, dst, layout=layout)
    got_leaves = jax.tree.leaves(out)
    assert len(got_leaves) == 4 * CFG.num_layers // 2  # k and v, data and scale, per stage-local layer
    for got, before, a in zip(got_leaves, values, leaves):
        want = before.reshape(2, 6, *before.shape[1:]).copy()  # [stage, page, ...]
        want[:, 3], want[:, 5] = want[:, 1], want[:, 4]
        np.testing.assert_array_equal(np.asarray(got), want.reshape(before.shape))
        assert got.sharding == a.sharding


def test_quantize_params_on_stage_devices_compiles_once_per_device_set():
    layout = make_pipeline_layout(2, 2)
    placed = jax.device_put(params(), layout.param_shardings(CFG))
    _, want = quantize_params(params(), CFG, "int8")
    before = quantize._convert_group._cache_size()
    qcfg, got = quantize_params(placed, CFG, "int8")
    # Stage 0's layers, stage 1's layers, and the replicated embedding / norm / head.
    assert quantize._convert_group._cache_size() - before == 3
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    for i, layer in enumerate(got.layers):
        stage_devices = set(layout.stage_mesh(layout.stage_of_layer(CFG, i)).devices.flat)
        assert all(a.sharding.device_set == stage_devices for a in jax.tree.leaves(layer))
    # Into explicit target shardings (the quantized config's): each leaf lands exactly there.
    targets = layout.param_shardings(qcfg)
    _, placed_q = quantize_params(params(), CFG, "int8", targets)
    for a, sh in zip(jax.tree.leaves(placed_q), jax.tree.leaves(targets), strict=True):
        assert a.sharding.is_equivalent_to(sh, a.ndim)
    # Staging the quantized weights keeps the converted arrays (no conversion on the way).
    staged = layout.stage_params(qcfg, got)
    np.testing.assert_array_equal(np.asarray(staged.stages[0].wk.scale)[CFG.num_kv_heads:],
                                  np.asarray(got.layers[1].wk.scale))  # stage 1's block: global layer 1


def test_quantized_mixture_of_experts_stages_with_its_expert_scales():
    """Int8 Qwen2-MoE weights (expert weights with `[experts, out]` scales, the shared expert, q/k/v
    biases left in the compute dtype) staged field by field at PP=2 x TP=2, experts split over
    `tensor` inside each stage: the pipelined logits equal the plain forward's."""
    from model.cache import init_cache, pack_batch
    from model.forward import forward_jit
    from model.params import abstract_params
    from sharding.pipeline import pipeline_forward_jit

    moe = tiny_config(vocab_size=128, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, architecture="Qwen2MoeForCausalLM", num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=16, moe_router="softmax_topk",
                      attention_bias=True, shared_expert_intermediate_size=24)
    rng = np.random.default_rng(2)
    host = jax.tree.map(lambda a: (rng.standard_normal(a.shape) / np.sqrt(a.shape[-1])).astype(np.float32)
                        if a.ndim > 1 else np.ones(a.shape, np.float32), abstract_params(moe))
    cfg, host = quantize_params(host, moe, "int8")
    layout = make_pipeline_layout(2, 2, 2)
    staged = layout.stage_params(cfg, host)
    assert staged.stages[0].w_gate.scale.shape == (2 * moe.num_experts, moe.moe_intermediate_size)
    assert staged.stages[0].q_bias.dtype == jnp.float32

    def run(fn, params, cache):
        out = []
        for chunks in ([(list(range(3, 12)), 0, [0, 1, 2]), ([7, 8, 9], 0, [3])],
                       [([40], 9, [0, 1, 2]), ([50, 51, 52, 53], 3, [3, 4])]):
            tokens, md = pack_batch(chunks, page_size=4, num_pages=8, num_tokens=16, max_seqs=2, pages_per_seq=3,
                                    logits_rows=2)
            logits, cache = fn(params, cache, tokens, md)
            out.append(np.asarray(logits))
        return out

    want = run(lambda p, c, t, md: forward_jit(p, c, t, md, cfg, "reference"), host, init_cache(cfg, 8, 4))
    got = run(lambda p, c, t, md: pipeline_forward_jit(p, c, t, md, cfg, "reference", layout), staged,
              layout.init_cache(cfg, 8, 4))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
