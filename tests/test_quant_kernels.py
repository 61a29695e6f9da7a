"""Quantized (int8 / fp8) KV cache: the Pallas kernels against the reference, in interpret mode.

The reference itself is pinned to float attention over the dequantized pages,
so "kernel == reference" means "kernel computes attention over the values the
cache stands for". Pages and scales come from quantizing random normals (never
zeros); block tables are random permutations; lengths hit partial pages,
page boundaries, several pages, a prefill chunk and padding sequences; the
query heads are grouped (GQA), including a group that is not a power of two.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from kernels_pallas import get_backend
from kernels_pallas.kv_cache_write import write_kv
from kernels_pallas.kv_quant import quantize_kv
from kernels_pallas.ragged_paged_attention import ragged_paged_attention
from kernels_pallas.reference import ragged_paged_attention_reference, write_kv_reference
from test_kernels import ragged_metadata

reference_attention = jax.jit(ragged_paged_attention_reference, static_argnames="sm_scale")
NUM_TOKENS, MAX_SEQS, PAGES_PER_SEQ = 24, 5, 4
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def quantized_batch(rng, seqs, *, page_size, num_q_heads, num_kv_heads, head_dim, q_dtype, kv_dtype):
    """q, quantized K/V pages with scales, and the ragged metadata for `seqs` [(q_len, kv_len)]."""
    num_pages = MAX_SEQS * PAGES_PER_SEQ + 3
    kv_lens, tables, cu = ragged_metadata(rng, seqs, page_size=page_size, num_pages=num_pages,
                                          max_seqs=MAX_SEQS, pages_per_seq=PAGES_PER_SEQ)
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    # Per-token magnitudes spread over two decades, so one scale per page would not do.
    mag = np.exp(rng.uniform(-2.3, 2.3, shape[:3] + (1,)))
    k, ks = quantize_kv(jnp.asarray(rng.standard_normal(shape) * mag, jnp.float32), kv_dtype)
    v, vs = quantize_kv(jnp.asarray(rng.standard_normal(shape) * mag, jnp.float32), kv_dtype)
    q = jnp.asarray(rng.standard_normal((NUM_TOKENS, num_q_heads, head_dim)), q_dtype)
    meta = (jnp.asarray(kv_lens), jnp.asarray(tables), jnp.asarray(cu), jnp.int32(len(seqs)))
    return q, (k, v, ks, vs), meta


def mixes(ps):
    long = 3 * ps + 2
    return {
        "decode": [(1, 1), (1, ps - 1), (1, ps), (1, ps + 1), (1, long)],
        "mixed": [(5, ps + 5), (1, long), (0, 0), (9, 9), (1, 2 * ps)],
    }


# (q dtype, kv dtype, q heads, kv heads, page size, head_dim, kernel kwargs)
CASES = [
    pytest.param(jnp.float32, jnp.int8, 4, 2, 8, 64, dict(num_kv_splits=1), id="f32-int8-g2-ps8"),
    pytest.param(jnp.bfloat16, jnp.float8_e4m3fn, 6, 2, 16, 32, dict(num_kv_splits=2, block_kv=16),
                 id="bf16-fp8-g3pad-ps16-split2"),
]


@pytest.mark.parametrize("q_dtype,kv_dtype,hq,hkv,ps,d,kwargs", CASES)
def test_attention_quantized_kv_matches_reference(q_dtype, kv_dtype, hq, hkv, ps, d, kwargs):
    rng = np.random.RandomState(ps + hq)
    for name, seqs in mixes(ps).items():
        q, (k, v, ks, vs), meta = quantized_batch(rng, seqs, page_size=ps, num_q_heads=hq, num_kv_heads=hkv,
                                                  head_dim=d, q_dtype=q_dtype, kv_dtype=kv_dtype)
        want = reference_attention(q, k, v, *meta, sm_scale=d**-0.5, k_scale=ks, v_scale=vs)
        got = ragged_paged_attention(q, k, v, *meta, sm_scale=d**-0.5, k_scale=ks, v_scale=vs, interpret=True,
                                     **kwargs)
        got, want = np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))
        assert np.isfinite(got).all()
        # Values here reach ~10x a standard normal; bf16 rounding of p and q scales with them.
        tol = TOL[q_dtype] * max(1.0, float(np.std(want)))
        np.testing.assert_allclose(got, want, atol=tol, rtol=TOL[q_dtype], err_msg=f"mix {name}")
        dead = np.arange(NUM_TOKENS) >= int(meta[2][int(meta[3])])
        assert dead.any() and (got[dead] == 0).all()
        # The reference reads what the cache stands for: float attention over dequantized pages.
        deq = lambda x, s: (x.astype(jnp.float32) * s[..., None]).astype(jnp.float32)  # noqa: E731
        exact = reference_attention(q.astype(jnp.float32), deq(k, ks), deq(v, vs), *meta, sm_scale=d**-0.5)
        np.testing.assert_allclose(want, np.asarray(exact), atol=tol, rtol=TOL[q_dtype])


@pytest.mark.parametrize("kv_dtype", [jnp.int8, jnp.float8_e4m3fn])
def test_write_quantized_kv_matches_reference_and_drops_padding(kv_dtype):
    rng = np.random.RandomState(7)
    num_pages, page_size, hkv, head_dim, tokens = 6, 8, 2, 32, 21
    shape = (num_pages, page_size, hkv, head_dim)
    k, ks = quantize_kv(jnp.asarray(rng.standard_normal(shape), jnp.float32), kv_dtype)
    v, vs = quantize_kv(jnp.asarray(rng.standard_normal(shape), jnp.float32), kv_dtype)
    new = lambda: jnp.asarray(rng.standard_normal((tokens, hkv, head_dim)) * 3, jnp.bfloat16)  # noqa: E731
    k_new, v_new = new(), new()
    slots = rng.permutation(num_pages * page_size)[:tokens].astype(np.int32)
    pad = num_pages * page_size
    slots[::5] = pad
    got = write_kv(k, v, k_new, v_new, jnp.asarray(slots), ks, vs, interpret=True)
    want = write_kv_reference(k, v, k_new, v_new, jnp.asarray(slots), k_scale=ks, v_scale=vs)
    assert len(got) == len(want) == 4
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)))
    live = slots != pad
    # What was written dequantizes to the new rows within the format's error.
    kd = np.asarray(got[0].astype(jnp.float32)).reshape(pad, hkv, head_dim)
    kscale = np.asarray(got[2]).reshape(pad, hkv)
    stored = kd[slots[live]] * kscale[slots[live]][..., None]
    new32 = np.asarray(k_new.astype(jnp.float32))[live]
    amax = np.abs(new32).max(-1, keepdims=True)
    bound = amax / 254 + 1e-6 if kv_dtype == jnp.int8 else np.maximum(np.abs(new32) / 16, amax / 448 / 512)
    assert (np.abs(stored - new32) <= bound + 1e-6).all()
    untouched = np.setdiff1d(np.arange(pad), slots)
    old = np.asarray(k.astype(jnp.float32)).reshape(pad, hkv, head_dim)
    np.testing.assert_array_equal(kd[untouched], old[untouched])


def test_quantized_pages_without_scales_are_refused():
    pages = jnp.zeros((4, 8, 1, 16), jnp.int8)
    q = jnp.ones((2, 2, 16), jnp.float32)
    args = (jnp.ones(1, jnp.int32), jnp.zeros((1, 2), jnp.int32), jnp.array([0, 2], jnp.int32), jnp.int32(1))
    for backend in ("reference", "pallas_interpret"):
        impl = get_backend(backend)
        with pytest.raises(ValueError, match="need their scales"):
            impl.attention(q, pages, pages, *args, sm_scale=0.25)
        with pytest.raises(ValueError, match="need their scales"):
            impl.write_kv(pages, pages, q[:, :1], q[:, :1], jnp.array([0, 1], jnp.int32))
    with pytest.raises(ValueError, match="only int8 / fp8 pages"):
        write_kv_reference(q, q, q, q, jnp.array([0, 1], jnp.int32), k_scale=q[..., 0], v_scale=q[..., 0])


# --- lowering for cuda (on this CPU machine; see tests/test_kernels_lowering.py) ---

@pytest.mark.parametrize("kv_dtype", [jnp.int8, jnp.float8_e4m3fn], ids=["int8", "fp8"])
def test_quantized_kernels_lower_for_cuda(kv_dtype):
    from test_kernels_lowering import lower_for_cuda, op_counts

    sds = jax.ShapeDtypeStruct
    pages, scales = sds((64, 16, 8, 128), kv_dtype), sds((64, 16, 8), jnp.float32)
    meta = (sds((8,), jnp.int32), sds((8, 8), jnp.int32), sds((9,), jnp.int32), sds((), jnp.int32))
    q = sds((8, 32, 128), jnp.bfloat16)
    fn = lambda q, k, v, ks, vs, *m: ragged_paged_attention(q, k, v, *m, k_scale=ks, v_scale=vs)  # noqa: E731
    _, kernels = lower_for_cuda(fn, q, pages, pages, scales, scales, *meta)
    assert len(kernels) == 1
    counts = op_counts(kernels[0])
    assert counts["tt.dot"] == 2 and counts["scf.for"] == 1
    assert counts["tt.load"] >= 6  # K, V, their scales, q, the block table
    new = sds((48, 8, 128), jnp.bfloat16)
    hlo, kernels = lower_for_cuda(write_kv, pages, pages, new, new, sds((48,), jnp.int32), scales, scales,
                                  donate_argnums=(0, 1, 5, 6))
    assert len(kernels) == 1 and op_counts(kernels[0])["tt.store"] == 4
    assert hlo.count("tf.aliasing_output") == 4  # pages and scales updated in place


def test_quantized_model_forward_lowers_for_cuda():
    """int8 weights and an int8 KV cache through the pallas backend: the whole step lowers."""
    import re

    from conftest import tiny_config
    from test_kernels_lowering import lower_for_cuda

    from model.cache import BatchMetadata, KVCache
    from model.forward import forward
    from model.params import Weights, is_array_info

    sds = jax.ShapeDtypeStruct
    cfg = tiny_config(dtype="bfloat16", weight_dtype="int8")
    to_sds = lambda tree: jax.tree.map(lambda i: sds(i.shape, i.dtype), tree, is_leaf=is_array_info)  # noqa: E731
    params, cache = to_sds(Weights.declare(cfg)), to_sds(KVCache.declare(cfg, 32, 16, "int8"))
    assert params.layers[0].wq.data.dtype == jnp.int8 and cache.k[0].scale.shape == (32, 16, cfg.num_kv_heads)
    t, s = 16, 4
    md = BatchMetadata(positions=sds((t,), jnp.int32), slot_mapping=sds((t,), jnp.int32),
                       cu_q_lens=sds((s + 1,), jnp.int32), kv_lens=sds((s,), jnp.int32),
                       block_tables=sds((s, 8), jnp.int32), num_seqs=sds((), jnp.int32),
                       logits_indices=sds((s,), jnp.int32))
    fn = lambda p, c, tok, m: forward(p, c, tok, m, cfg, backend="pallas")  # noqa: E731
    hlo, kernels = lower_for_cuda(fn, params, cache, sds((t,), jnp.int32), md, donate_argnums=(1,))
    names = sorted(re.match(r"module @(\w+)", k).group(1) for k in kernels)
    assert names == ["kv_cache_write", "ragged_paged_attention"]
    assert "xi8>" in hlo  # the weights enter the program as int8


def test_model_forward_with_quantized_kv_pallas_interpret_equals_reference():
    """int8 weights and an int8 cache, one step through both backends: a decode and a prefill
    chunk that continues mid-page, both reading random cached pages of their own."""
    import functools

    from conftest import tiny_config
    from model.cache import KVCache, pack_batch
    from model.forward import forward
    from model.params import init_params
    from model.quant import QuantizedArray

    cfg = tiny_config(weight_dtype="int8", num_layers=1)
    rng = np.random.RandomState(11)
    params = init_params(cfg, jax.random.key(4))
    pages, ps, per_seq = 16, 8, 4
    shape = (pages, ps, cfg.num_kv_heads, cfg.head_dim)

    def layer():  # random, not zeros: pages the batch does not own must not leak in
        return QuantizedArray(*quantize_kv(jnp.asarray(rng.standard_normal(shape), jnp.float32), jnp.int8))

    cache = KVCache(k=[layer() for _ in range(cfg.num_layers)], v=[layer() for _ in range(cfg.num_layers)])
    tables = [list(rng.permutation(pages)[i * per_seq:(i + 1) * per_seq]) for i in range(2)]
    pack = functools.partial(pack_batch, page_size=ps, num_pages=pages, num_tokens=16, max_seqs=2,
                             pages_per_seq=per_seq, all_logits=True, logits_rows=16)
    tok = lambda n: list(rng.randint(0, cfg.vocab_size, n))  # noqa: E731
    steps = [[(tok(1), 11, tables[0]), (tok(9), 3, tables[1])]]
    run = jax.jit(lambda p, c, t, m, backend: forward(p, c, t, m, cfg, backend), static_argnames="backend")
    caches = {"reference": cache, "pallas_interpret": cache}
    for chunks in steps:
        tokens, md = pack(chunks)
        live = sum(len(c[0]) for c in chunks)
        logits = {}
        for name in caches:
            logits[name], caches[name] = run(params, caches[name], tokens, md, backend=name)
        got, want = (np.asarray(logits[n])[:live] for n in ("pallas_interpret", "reference"))
        assert np.isfinite(got).all() and np.abs(want).max() > 1e-3
        np.testing.assert_allclose(got, want, atol=1e-3, rtol=1e-3)
        # The first layer's pages and scales are written from identical K/V: bit-identical.
        for a, b in zip(jax.tree.leaves(caches["pallas_interpret"].k[0]), jax.tree.leaves(caches["reference"].k[0])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
