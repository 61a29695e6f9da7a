"""The model's forward pass with the Pallas kernels (interpret mode) equals the reference backend."""

from __future__ import annotations

import functools

import numpy as np

import jax
import jax.numpy as jnp

from conftest import tiny_config
from model.cache import KVCache, pack_batch
from model.forward import forward
from model.params import Weights, flatten_params, unflatten_params

PAGE_SIZE, NUM_PAGES, PAGES_PER_SEQ = 8, 24, 5
NUM_TOKENS, MAX_SEQS = 24, 4


def random_params(cfg, rng):
    """Random weights from the declarations, drawn with numpy (no jit compile of an init program)."""
    def draw(name, info):
        if len(info.shape) == 1:  # norm scales
            return jnp.asarray(1 + 0.1 * rng.standard_normal(info.shape), info.dtype)
        # 1/sqrt of the input size ([out..., in...]: the last dim), except the table (1/sqrt(vocab))
        # and wo (1/sqrt(q_heads)): the draws these comparisons were tuned with.
        fan_in = {"embed": info.shape[0], "wo": info.shape[1]}.get(name.split(".")[-1], info.shape[-1])
        return jnp.asarray(rng.standard_normal(info.shape) / np.sqrt(fan_in), info.dtype)

    decl = flatten_params(Weights.declare(cfg))
    return unflatten_params(cfg, {name: draw(name, info) for name, info in decl.items()})


def random_cache(cfg, rng):
    # Random, not zeros: pages the batch does not own must not leak into the result.
    shape = (NUM_PAGES, PAGE_SIZE, cfg.num_kv_heads, cfg.head_dim)
    layer = lambda: jnp.asarray(rng.standard_normal(shape), cfg.jnp_dtype)
    return KVCache(k=[layer() for _ in range(cfg.num_layers)], v=[layer() for _ in range(cfg.num_layers)])


def test_forward_pallas_interpret_equals_reference():
    cfg = tiny_config()
    rng = np.random.RandomState(0)
    params = random_params(cfg, rng)
    cache = random_cache(cfg, rng)
    tables = [list(rng.permutation(NUM_PAGES)[i * PAGES_PER_SEQ:(i + 1) * PAGES_PER_SEQ]) for i in range(3)]
    pack = functools.partial(pack_batch, page_size=PAGE_SIZE, num_pages=NUM_PAGES, num_tokens=NUM_TOKENS,
                             max_seqs=MAX_SEQS, pages_per_seq=PAGES_PER_SEQ, all_logits=True,
                             logits_rows=NUM_TOKENS)
    tok = lambda n: list(rng.randint(0, cfg.vocab_size, n))
    steps = [
        # Two prefills (one crossing a page boundary) and a first chunk of a longer prompt.
        [(tok(11), 0, tables[0]), (tok(3), 0, tables[1]), (tok(8), 0, tables[2])],
        # Decodes of the first two, and the second chunk of the third (continues mid-page).
        [(tok(1), 11, tables[0]), (tok(1), 3, tables[1]), (tok(13), 8, tables[2])],
    ]
    # A function of this test's own, so its compilation cache counts only this test's calls
    # (jit caches are shared by every `jax.jit(forward)` in the process).
    def step(params, cache, tokens, md, cfg, backend):
        return forward(params, cache, tokens, md, cfg, backend)

    run = jax.jit(step, static_argnames=("cfg", "backend"))
    caches = {"reference": cache, "pallas_interpret": cache}
    for chunks in steps:
        tokens, md = pack(chunks)
        live_rows = sum(len(c[0]) for c in chunks)
        logits = {}
        for name in caches:
            logits[name], caches[name] = run(params, caches[name], tokens, md, cfg, backend=name)
        got, want = (np.asarray(logits[n])[:live_rows] for n in ("pallas_interpret", "reference"))
        assert np.isfinite(got).all() and np.abs(want).max() > 1e-3
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
        # The first layer's K/V are bit-identical (same inputs, a copy); later layers
        # inherit the attention's fp32 rounding differences.
        got_cache, want_cache = caches["pallas_interpret"], caches["reference"]
        np.testing.assert_array_equal(np.asarray(got_cache.k[0]), np.asarray(want_cache.k[0]))
        np.testing.assert_array_equal(np.asarray(got_cache.v[0]), np.asarray(want_cache.v[0]))
        for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
    # Both steps share the padded shapes: one compilation per backend, none per batch.
    assert run._cache_size() == 2
