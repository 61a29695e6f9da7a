"""The MoE layer: routing as each family defines it, the grouped matmul and the CPU decode
loop against the dense reference, int8 experts, and expert parallelism over 8 CPU devices (EP = 2 and 4 under
rules_megatron, tensor parallelism inside the experts under rules_megatron_expert_tp)
giving one device's greedy tokens.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sharding
from conftest import tiny_config
from model import moe
from model.cache import init_cache, pack_batch
from model.convert_hf import conversion_plan
from model.families import family_for_config, num_params
from model.families.mixtral import MIXTRAL
from model.families.qwen2_moe import QWEN2_MOE
from model.families.qwen3_moe import QWEN3_MOE
from model.forward import forward
from model.params import abstract_params, flatten_params
from model.quant import dequantize, quantize
from model.quantize import quantize_params

CFG = tiny_config(vocab_size=128, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=16,
                  architecture="Qwen3MoeForCausalLM", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, moe_router="softmax_topk",
                  norm_topk_prob=True, qk_norm=True)
# Qwen2-MoE's layer: q/k/v biases and a gated shared expert beside the routed ones.
SHARED_CFG = CFG.replace(architecture="Qwen2MoeForCausalLM", qk_norm=False, attention_bias=True,
                         shared_expert_intermediate_size=24, norm_topk_prob=False)


def _expert_inputs(t, e=8, k=2, h=48, f=40, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    logits = jnp.asarray(rng.standard_normal((t, e)), jnp.float32)
    ids, weights = moe.route(logits, CFG.replace(num_experts=e, num_experts_per_tok=k))
    ws = [jnp.asarray(rng.standard_normal(s) / math.sqrt(s[-1]), jnp.float32) for s in ((e, f, h), (e, f, h), (e, h, f))]
    return x, ids, weights, ws


# --- routing ---

def test_routing_follows_each_family():
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((16, 8)), jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    mixtral = CFG.replace(moe_router="topk_softmax", num_experts_per_tok=3)
    ids, w = moe.route(logits, mixtral)
    top = np.argsort(-np.asarray(logits), axis=-1)[:, :3]
    np.testing.assert_array_equal(np.asarray(ids), top)
    np.testing.assert_allclose(np.asarray(w), jax.nn.softmax(jnp.take_along_axis(logits, ids, -1), -1), rtol=1e-6)
    # Qwen3-MoE: softmax over all, top-k; renormalised only with norm_topk_prob.
    qwen = CFG.replace(num_experts_per_tok=3)
    for norm in (True, False):
        ids_q, w_q = moe.route(logits, qwen.replace(norm_topk_prob=norm))
        np.testing.assert_array_equal(np.asarray(ids_q), top)
        expected = np.take_along_axis(np.asarray(probs), top, -1)
        if norm:
            expected = expected / expected.sum(-1, keepdims=True)
        np.testing.assert_allclose(np.asarray(w_q), expected, rtol=1e-6)
    assert float(jnp.max(jnp.sum(moe.route(logits, qwen.replace(norm_topk_prob=False))[1], -1))) < 0.999


# --- grouped matmul vs the dense reference ---

_grouped, _dense, _touched = jax.jit(moe.grouped_experts), jax.jit(moe.dense_experts), jax.jit(moe.touched_experts)


@pytest.mark.parametrize("t", [1, 37])
def test_grouped_matches_dense_reference(t):
    x, ids, weights, ws = _expert_inputs(t, seed=t)
    want = _dense(x, ids, weights, *ws)
    np.testing.assert_allclose(np.asarray(_grouped(x, ids, weights, *ws)), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(_touched(x, ids, weights, *ws)), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert float(jnp.max(jnp.abs(want))) > 0.1
    # A subset of the experts (one device's, under expert parallelism): the same on both
    # paths, and the subsets sum to the whole.
    halves = [[w[lo:lo + 4] for w in ws] for lo in (0, 4)]
    parts = [_grouped(x, ids, weights, *half, expert_offset=lo) for lo, half in zip((0, 4), halves)]
    ref_part = _dense(x, ids, weights, *halves[1], expert_offset=4)
    np.testing.assert_allclose(np.asarray(parts[1]), np.asarray(ref_part), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(_touched(x, ids, weights, *halves[1], expert_offset=4)),
                               np.asarray(ref_part), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(parts[0] + parts[1]), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert float(jnp.max(jnp.abs(parts[0]))) > 0 and float(jnp.max(jnp.abs(parts[1]))) > 0


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_quantized_experts_match_the_dequantized_reference(dtype):
    x, ids, weights, ws = _expert_inputs(37, seed=3)
    qs = [quantize(w, dtype, 2) for w in ws]
    assert all(q.scale.shape == w.shape[:2] for q, w in zip(qs, ws))
    got = _grouped(x, ids, weights, *qs)
    want = _dense(x, ids, weights, *[dequantize(q) for q in qs])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(_touched(x, ids, weights, *qs)), np.asarray(want), rtol=1e-4, atol=1e-4)
    exact = _dense(x, ids, weights, *ws)
    bound = {"int8": 0.05, "fp8": 0.15}[dtype]  # e4m3 keeps 3 mantissa bits
    assert 0 < float(jnp.max(jnp.abs(got - exact))) < bound * float(jnp.max(jnp.abs(exact)))


def test_serving_path_on_cpu_follows_the_batch_size():
    """XLA CPU runs ragged_dot as a masked dense product: decode batches loop over the touched
    experts, larger ones take the dense product (a static choice per token bucket)."""
    assert jax.default_backend() == "cpu"
    assert moe.serving_experts(4, CFG) is moe.touched_experts  # 4 tokens x top 2 <= 8 experts
    assert moe.serving_experts(5, CFG) is moe.dense_experts


# --- declarations ---

def test_declarations_counts_and_conversion_plan():
    decl = abstract_params(CFG)
    layer = decl.layers[0]
    assert layer.w_gate.shape == (8, 32, 64) and layer.w_down.shape == (8, 64, 32) and layer.router.shape == (8, 64)
    assert layer.q_norm.shape == (16,)
    assert jax.tree.structure(decl.layers[0]) == jax.tree.structure(decl.layers[1])  # stackable layers
    assert num_params(CFG) == sum(math.prod(a.shape) for a in jax.tree.leaves(decl))
    assert family_for_config(CFG).name == "Qwen3-MoE"
    assert family_for_config(CFG.replace(architecture="MixtralForCausalLM")).name == "Mixtral"
    assert family_for_config(CFG.replace(architecture="LlamaForCausalLM", num_experts=0,
                                         num_experts_per_tok=0)).name == "Llama"
    with pytest.raises(ValueError, match="does not fit architecture"):
        CFG.replace(architecture="LlamaForCausalLM")
    ours = set(flatten_params(decl))
    for family, cfg in ((QWEN3_MOE, CFG), (MIXTRAL, CFG.replace(qk_norm=False)), (QWEN2_MOE, SHARED_CFG)):
        plan = conversion_plan(cfg, family)
        assert {t.ours for t in plan} == set(flatten_params(abstract_params(cfg)))
        stacked = [t for t in plan if t.stack is not None]
        assert len(stacked) == 3 * 8 * cfg.num_layers
    assert "layers.0.q_norm" in ours
    # Dense configs keep the config file they always had.
    assert "num_experts" not in CFG.replace(architecture="LlamaForCausalLM", num_experts=0, num_experts_per_tok=0,
                                            moe_intermediate_size=0,
                                            qk_norm=False, moe_router="topk_softmax").to_dict()
    assert type(CFG).from_dict(CFG.to_dict()) == CFG


# --- expert parallelism ---

PAGE, PAGES, TOKENS, SEQS, PER_SEQ = 4, 16, 16, 4, 5


@functools.cache
def _host_params(cfg=CFG):
    rng = np.random.default_rng(3)

    def draw(path, a):
        if a.ndim == 1:
            return (1 + 0.1 * rng.standard_normal(a.shape)).astype(np.float32)
        name = path[-1].name
        fan_in = a.shape[1] * a.shape[2] if name == "wo" else a.shape[-1]
        return (rng.standard_normal(a.shape) / np.sqrt(fan_in)).astype(np.float32)

    return jax.tree_util.tree_map_with_path(draw, abstract_params(cfg))


def _greedy(tp, rules="megatron", weight_dtype=None, steps=6, model=CFG):
    """Greedy tokens of two sequences (one prefilled in two chunks) and every step's logits."""
    cfg, params = model, _host_params(model)
    if weight_dtype:
        cfg, params = quantize_params(params, model, weight_dtype)
    if tp == 1:
        cache, layout = init_cache(cfg, PAGES, PAGE), None
    else:
        mesh = sharding.make_mesh(tensor=tp)
        layout = sharding.Layout.create(mesh, rules)
        params = jax.device_put(params, sharding.param_shardings(cfg, mesh, rules))
        cache = init_cache(cfg, PAGES, PAGE, shardings=sharding.cache_shardings(cfg, mesh, rules, PAGES, PAGE))
    step = jax.jit(functools.partial(forward, cfg=cfg, backend="reference", layout=layout), donate_argnums=1)
    seqs = {"A": [5, 17, 99, 3, 42, 8, 61], "B": list(range(20, 30))}
    tables = {"A": [0, 1, 2, 3, 4], "B": [5, 6, 7, 8, 9]}
    done = {"A": 0, "B": 0}
    out, all_logits = {"A": [], "B": []}, []
    for i in range(steps):
        chunks = []
        for name in seqs:
            n = 6 if (name == "B" and i == 0) else len(seqs[name]) - done[name]
            chunks.append((seqs[name][done[name]:done[name] + n], done[name], tables[name]))
            done[name] += n
        tokens, md = pack_batch(chunks, page_size=PAGE, num_pages=PAGES, num_tokens=TOKENS, max_seqs=SEQS,
                                pages_per_seq=PER_SEQ, logits_rows=SEQS)
        logits, cache = step(params, cache, tokens, md)
        logits = np.asarray(logits)[:2]
        all_logits.append(logits)
        for row, name in zip(logits, seqs):
            if done[name] == len(seqs[name]):
                seqs[name].append(int(np.argmax(row)))
                out[name].append(seqs[name][-1])
    return out, all_logits, step, params, cache


@functools.cache
def _result(tp, rules="megatron", weight_dtype=None, model=CFG):
    return _greedy(tp, rules, weight_dtype, model=model)


@pytest.mark.parametrize("tp,rules", [(2, "megatron"), (4, "megatron"), (2, "megatron_expert_tp")])
def test_expert_parallel_matches_one_device(tp, rules):
    ref_tokens, ref_logits, *_ = _result(1)
    tokens, logits, step, params, _ = _result(tp, rules)
    assert sum(map(len, ref_tokens.values())) >= 10
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits):
        np.testing.assert_allclose(a, b, atol=2e-4, rtol=2e-4)
    # The experts really are split: each device holds its share of every expert weight.
    w_gate = params.layers[0].w_gate
    local = {s.data.shape for s in w_gate.addressable_shards}
    assert local == ({(8 // tp, 32, 64)} if rules == "megatron" else {(8, 32 // tp, 64)})


def test_shared_expert_layer_under_expert_parallelism():
    """Qwen2-MoE's layer (biases, the shared expert split over devices like a dense MLP) under
    EP=2 gives one device's tokens; the shared expert's weights are really split."""
    ref_tokens, ref_logits, *_ = _result(1, model=SHARED_CFG)
    tokens, logits, _, params, _ = _result(2, model=SHARED_CFG)
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits):
        np.testing.assert_allclose(a, b, atol=2e-4, rtol=2e-4)
    assert {s.data.shape for s in params.layers[0].shared_gate.addressable_shards} == {(12, 64)}


def test_int8_experts_run_under_expert_parallelism():
    tokens, logits, _, params, _ = _result(2, "megatron", "int8")
    assert params.layers[0].w_gate.data.dtype == jnp.int8 and params.layers[0].router.dtype == jnp.float32
    _, ref_logits, *_ = _result(1)
    # The first step (the same inputs): close to the float model (per-channel int8), not the same numbers.
    diff = float(np.max(np.abs(logits[0] - ref_logits[0])))
    assert 0 < diff < 0.1 * float(np.max(np.abs(ref_logits[0])))


def test_grouped_path_lowers_for_cuda_as_ragged_dot():
    """The serving path lowers for GPUs from this CPU host, as one ragged_dot per projection."""
    x, ids, weights, ws = _expert_inputs(5)
    text = jax.jit(moe.grouped_experts).trace(x, ids, weights, *ws).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("ragged_dot") >= 3
    assert "ragged_dot" not in jax.jit(moe.dense_experts).trace(x, ids, weights, *ws).lower(
        lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("impl,tp", [("grouped_experts", 1), ("touched_experts", 2)])
def test_every_expert_path_gives_the_models_output(monkeypatch, impl, tp):
    """The whole model with the grouped matmul (the GPU path) or the touched-experts loop (CPU
    decode) in every layer, alone and under EP=2, against the step's default (dense on CPU at
    this batch size)."""
    _, ref_logits, *_ = _result(1)
    monkeypatch.setattr(moe, "serving_experts", lambda n, cfg: getattr(moe, impl))
    _, logits, *_ = _greedy(tp, steps=1)
    np.testing.assert_allclose(logits[0], ref_logits[0], atol=2e-4, rtol=2e-4)
