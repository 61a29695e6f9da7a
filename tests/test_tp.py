"""Tensor parallelism on 8 CPU devices: TP = 1, 2, 4, 8 give the same greedy tokens and logits,
and the compiled program has exactly the Megatron collectives.

The model has 8 query heads and 2 KV heads, so TP=2 splits KV heads and TP=4 and 8 replicate them.
The batch is ragged and mixed (a chunked prefill next to decodes, partial pages).
"""

import functools

import jax
import numpy as np
import pytest

import sharding
from conftest import tiny_config
from model.cache import init_cache, pack_batch
from model.forward import forward
from model.params import abstract_params
from sharding.hlo import collectives, collectives_per_layer, shape_dims

PAGE, PAGES, TOKENS, SEQS, PER_SEQ = 4, 16, 16, 4, 5
CFG = tiny_config(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
                  num_kv_heads=2, head_dim=16)
TPS = (1, 2, 4, 8)


def schedule():
    """Yields each step's chunks from the greedy tokens so far: (ids, start, pages) per sequence.

    A: 7-token prompt then decodes. B: 10-token prompt in chunks of 6 and 4, then decodes.
    C: joins at step 2 with a 3-token prompt. Every sequence ends on a partial page.
    """
    rng = np.random.default_rng(7)
    prompts = {"A": rng.integers(3, 128, 7), "B": rng.integers(3, 128, 10), "C": rng.integers(3, 128, 3)}
    tables = {"A": [0, 1, 2], "B": [3, 4, 5, 6], "C": [7, 8]}
    steps = [
        [("A", 0, 7), ("B", 0, 6)],
        [("A", 7, None), ("B", 6, 4), ("C", 0, 3)],
    ] + [[("A", None, None), ("B", None, None), ("C", None, None)]] * 4
    return prompts, tables, steps


def run(tp, backend="reference"):
    """Drives `forward` through the schedule on a TP mesh; returns (greedy tokens, logits per step, compiled)."""
    host_params = _host_params()
    if tp == 1:
        params, cache, layout = host_params, init_cache(CFG, PAGES, PAGE), None
    else:
        mesh = sharding.make_mesh(tensor=1 if tp == "mesh1" else tp)
        layout = sharding.Layout.create(mesh, "megatron")
        params = jax.device_put(host_params, sharding.param_shardings(CFG, mesh, "megatron"))
        cache = init_cache(CFG, PAGES, PAGE,
                           shardings=sharding.cache_shardings(CFG, mesh, "megatron", PAGES, PAGE))
    prompts, tables, steps = schedule()
    seqs = {k: list(v) for k, v in prompts.items()}  # tokens known so far
    done = {k: 0 for k in prompts}  # tokens already in the cache
    compiled, outputs, all_logits = None, {k: [] for k in prompts}, []
    for step in steps:
        chunks, names = [], []
        for name, start, n in step:
            start = done[name] if start is None else start
            n = len(seqs[name]) - start if n is None else n
            chunks.append((seqs[name][start:start + n], start, tables[name]))
            names.append(name)
            done[name] = start + n
        tokens, md = pack_batch(chunks, page_size=PAGE, num_pages=PAGES, num_tokens=TOKENS, max_seqs=SEQS,
                                pages_per_seq=PER_SEQ, logits_rows=SEQS)
        if compiled is None:  # one compile per TP degree: every step has the same padded shapes
            step_fn = jax.jit(functools.partial(forward, cfg=CFG, backend=backend, layout=layout),
                              donate_argnums=1)
            compiled = step_fn.lower(params, cache, tokens, md).compile()
        logits, cache = compiled(params, cache, tokens, md)
        logits = np.asarray(logits)[:len(chunks)]
        all_logits.append(logits)
        for row, name in zip(logits, names):
            if done[name] == len(seqs[name]):  # the sequence's last known token: sample greedily
                nxt = int(np.argmax(row))
                seqs[name].append(nxt)
                outputs[name].append(nxt)
    return outputs, all_logits, compiled, params, cache


@functools.cache
def _host_params():
    """Random host weights (numpy: compiling the jitted initializer would cost more than the tests)."""
    rng = np.random.default_rng(3)

    def draw(path, a):
        if a.ndim == 1:  # norms: near 1, but not exactly
            return (1 + 0.1 * rng.standard_normal(a.shape)).astype(np.float32)
        # [out..., in...]: the input is the last dim (wo: its last two); the table is scaled by its vocab.
        name = path[-1].name
        fan_in = a.shape[1] * a.shape[2] if name == "wo" else a.shape[0] if name == "embed" else a.shape[-1]
        return (rng.standard_normal(a.shape) / np.sqrt(fan_in)).astype(np.float32)

    return jax.tree_util.tree_map_with_path(draw, abstract_params(CFG))


@functools.cache
def result(tp, backend="reference"):
    return run(tp, backend)


@pytest.mark.parametrize("tp", TPS[1:])
def test_tp_matches_single_device(tp):
    ref_tokens, ref_logits, *_ = result(1)
    tokens, logits, *_ = result(tp)
    assert sum(len(v) for v in ref_tokens.values()) == 16  # A: 5, B: 5, C: 6 greedy tokens
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # Not vacuous: the logits rows differ between sequences and steps.
    assert np.abs(ref_logits[0][0] - ref_logits[0][1]).max() > 1e-2


def test_pallas_kernels_run_per_device_under_tp():
    """The Pallas kernels (interpreted here) are opaque to XLA's partitioner; inside the layout's
    shard_map each device runs them on its own heads. TP=4 with 2 KV heads: each device slices
    the replicated KV head its two query heads use."""
    ref_tokens, ref_logits, *_ = result(1)
    tokens, logits, compiled, *_ = result(4, "pallas_interpret")
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert collectives_per_layer(compiled.as_text())[0] == {"all-reduce": 2}


@pytest.mark.parametrize("tp", [2, 8])
def test_arrays_stay_sharded(tp):
    *_, params, cache = result(tp)
    layer = params.layers[0]
    assert {s.data.shape for s in layer.wq.addressable_shards} == {(8 // tp, 16, 64)}
    assert {s.data.shape for s in layer.w_down.addressable_shards} == {(64, 128 // tp)}
    assert {s.data.shape for s in params.embed.addressable_shards} == {(128 // tp, 64)}
    kv_local = 1 if tp == 2 else 2  # TP=8 > 2 KV heads: replicated
    assert {s.data.shape for s in cache.k[0].addressable_shards} == {(PAGES, PAGE, kv_local, 16)}


@pytest.mark.parametrize("tp", [2, 8])
def test_compiled_collectives_are_megatron(tp):
    *_, compiled, _, _ = result(tp)
    hlo = compiled.as_text()
    per_layer = collectives_per_layer(hlo)
    # Two all-reduces per layer (after wo, after w_down); one for the vocab-parallel embedding.
    assert per_layer == {0: {"all-reduce": 2}, 1: {"all-reduce": 2}, "outside": {"all-reduce": 1}}
    # Every all-reduce carries activations [tokens, hidden], never a weight.
    for c in collectives(hlo):
        assert shape_dims(c["shape"]) == (TOKENS, CFG.hidden_size)
    # No all-gather at all, so certainly none that rebuilds a full weight.
    weight_shapes = {tuple(a.shape) for a in jax.tree.leaves(_host_params())}
    gathered = [shape_dims(c["shape"]) for c in collectives(hlo) if c["kind"] == "all-gather"]
    assert not gathered and not weight_shapes & set(gathered)


def test_one_device_mesh_layout_matches_plain_forward():
    """TP=1 through a 1-device mesh layout (what an engine with tensor_parallel_size=1 may build)
    gives the plain forward's tokens; its attention backend is left unwrapped."""
    ref_tokens, ref_logits, *_ = result(1)
    tokens, logits, *_ = result("mesh1")
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
