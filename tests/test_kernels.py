"""The Pallas kernels against their references, in interpret mode on CPU.

Shapes are fixed per configuration and the ragged structure (lengths, block
tables, offsets) is data, so each configuration compiles once and then runs
several batch mixes. Inputs are random normals (never zeros); block tables are
random permutations of the page pool, and their unused entries point at random
pages, which the kernels must ignore.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from kernels_pallas.kv_cache_write import write_kv
from kernels_pallas.ragged_paged_attention import ragged_paged_attention
from kernels_pallas.reference import ragged_paged_attention_reference, write_kv_reference

reference_attention = jax.jit(ragged_paged_attention_reference, static_argnames="sm_scale")

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
NUM_TOKENS, MAX_SEQS, PAGES_PER_SEQ = 24, 6, 4


def ragged_metadata(rng, seqs, *, page_size, num_pages, max_seqs=MAX_SEQS, pages_per_seq=PAGES_PER_SEQ):
    """kv_lens [max_seqs], block tables [max_seqs, pages_per_seq] and cu_q_lens for `seqs` [(q_len, kv_len)].

    Every sequence owns distinct, scattered pages; unused table entries (and
    the padding sequences' rows) hold random page ids.
    """
    cu = np.zeros(max_seqs + 1, np.int32)
    cu[1:len(seqs) + 1] = np.cumsum([q for q, _ in seqs])
    cu[len(seqs) + 1:] = cu[len(seqs)]
    kv_lens = np.zeros(max_seqs, np.int32)
    kv_lens[:len(seqs)] = [kv for _, kv in seqs]
    pool = rng.permutation(num_pages)
    tables = rng.randint(0, num_pages, (max_seqs, pages_per_seq)).astype(np.int32)
    used = 0
    for i, (_, kv) in enumerate(seqs):
        n = -(-kv // page_size)
        tables[i, :n] = pool[used:used + n]
        used += n
    return kv_lens, tables, cu


def ragged_batch(rng, seqs, *, page_size, num_pages, num_q_heads, num_kv_heads, head_dim, dtype):
    """Random q/k/v and the ragged metadata for `seqs`, a list of (q_len, kv_len)."""
    assert len(seqs) <= MAX_SEQS and sum(q for q, _ in seqs) <= NUM_TOKENS
    assert all(q <= kv <= PAGES_PER_SEQ * page_size for q, kv in seqs)
    kv_lens, tables, cu = ragged_metadata(rng, seqs, page_size=page_size, num_pages=num_pages)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
    q = normal(NUM_TOKENS, num_q_heads, head_dim)
    k = normal(num_pages, page_size, num_kv_heads, head_dim)
    v = normal(num_pages, page_size, num_kv_heads, head_dim)
    return q, k, v, jnp.asarray(kv_lens), jnp.asarray(tables), jnp.asarray(cu), jnp.int32(len(seqs))


def mixes(page_size):
    """Named batch mixes of (q_len, kv_len); lengths hit 0, 1, ps-1, ps, ps+1 and several pages."""
    ps = page_size
    long = 3 * ps + 2
    return {
        "decode": [(1, 1), (1, ps - 1), (1, ps), (1, ps + 1), (1, long)],
        "prefill": [(min(ps + 1, 17), min(ps + 1, 17)), (1, 1), (3, 3), (2, 2)],
        "mixed": [(5, ps + 5), (1, long), (0, 0), (7, 7), (1, ps), (3, 2 * ps)],
        "chunk_tail": [(NUM_TOKENS - 2, long), (1, ps + 1)],
    }


def random_mix(rng, page_size):
    seqs, budget = [], NUM_TOKENS - 1
    for _ in range(rng.randint(1, MAX_SEQS + 1)):
        kv = int(rng.randint(1, PAGES_PER_SEQ * page_size + 1))
        q = int(min(budget, kv, 1 if rng.rand() < 0.5 else rng.randint(1, 9)))
        if q == 0:
            break
        seqs.append((q, kv))
        budget -= q
    return seqs


def assert_attention_close(out, ref, cu, num_seqs, dtype):
    out = np.asarray(out.astype(jnp.float32))
    ref = np.asarray(ref.astype(jnp.float32))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
    dead = np.arange(out.shape[0]) >= int(cu[int(num_seqs)])
    assert dead.any() and (out[dead] == 0).all()


# (dtype, q_heads, kv_heads, page_size, head_dim, kernel kwargs)
CONFIGS = [
    pytest.param(jnp.float32, 4, 4, 8, 64, dict(num_kv_splits=1), id="f32-g1-ps8-d64"),
    pytest.param(jnp.float32, 8, 2, 16, 128, dict(num_kv_splits=3), id="f32-g4-ps16-d128-split3"),
    pytest.param(jnp.float32, 6, 2, 16, 64, dict(), id="f32-g3pad-ps16-d64-default"),
    pytest.param(jnp.bfloat16, 8, 1, 32, 64, dict(num_kv_splits=1), id="bf16-g8-ps32-d64"),
    pytest.param(jnp.bfloat16, 8, 2, 64, 128, dict(num_kv_splits=2, block_kv=32), id="bf16-g4-ps64-d128-split2"),
    pytest.param(jnp.bfloat16, 8, 2, 8, 64, dict(rows=16, block_kv=16), id="bf16-g4-ps8-rows16"),
]


@pytest.mark.parametrize("dtype,hq,hkv,page_size,head_dim,kwargs", CONFIGS)
def test_attention_matches_reference(dtype, hq, hkv, page_size, head_dim, kwargs):
    rng = np.random.RandomState(page_size * 100 + hq * 10 + hkv)
    num_pages = MAX_SEQS * PAGES_PER_SEQ + 5
    cases = dict(mixes(page_size), random=random_mix(rng, page_size))
    for name, seqs in cases.items():
        args = ragged_batch(rng, seqs, page_size=page_size, num_pages=num_pages, num_q_heads=hq,
                            num_kv_heads=hkv, head_dim=head_dim, dtype=dtype)
        out = ragged_paged_attention(*args, sm_scale=head_dim**-0.5, interpret=True, **kwargs)
        ref = reference_attention(*args, sm_scale=head_dim**-0.5)
        try:
            assert_attention_close(out, ref, args[5], args[6], dtype)
        except AssertionError as e:
            raise AssertionError(f"mix {name!r} {seqs}: {e}") from None


def test_attention_rejects_unsupported_head_dim():
    q = jnp.ones((4, 2, 48), jnp.float32)
    pages = jnp.ones((4, 8, 1, 48), jnp.float32)
    with pytest.raises(ValueError, match="head_dim"):
        ragged_paged_attention(q, pages, pages, jnp.ones(2, jnp.int32), jnp.zeros((2, 2), jnp.int32),
                               jnp.array([0, 1, 2], jnp.int32), jnp.int32(2), interpret=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_write_kv_matches_reference_and_drops_padding(dtype):
    rng = np.random.RandomState(3)
    num_pages, page_size, hkv, head_dim, tokens = 7, 8, 2, 64, 37
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
    k, v = normal(num_pages, page_size, hkv, head_dim), normal(num_pages, page_size, hkv, head_dim)
    k_new, v_new = normal(tokens, hkv, head_dim), normal(tokens, hkv, head_dim)
    slots = rng.permutation(num_pages * page_size)[:tokens].astype(np.int32)
    pad = num_pages * page_size
    slots[::4] = pad  # padding tokens: dropped
    got = write_kv(k, v, k_new, v_new, jnp.asarray(slots), interpret=True)
    want = write_kv_reference(k, v, k_new, v_new, jnp.asarray(slots))
    for g, w, old in zip(got, want, (k, v)):
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)))
        flat_new = np.asarray(g.astype(jnp.float32)).reshape(pad, hkv, head_dim)
        flat_old = np.asarray(old.astype(jnp.float32)).reshape(pad, hkv, head_dim)
        untouched = np.setdiff1d(np.arange(pad), slots)
        np.testing.assert_array_equal(flat_new[untouched], flat_old[untouched])
        assert not np.array_equal(flat_new, flat_old)


def test_write_kv_in_place_on_donated_cache():
    rng = np.random.RandomState(4)
    k = jnp.asarray(rng.standard_normal((4, 8, 1, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((4, 8, 1, 16)), jnp.float32)
    new = jnp.asarray(rng.standard_normal((3, 1, 16)), jnp.float32)
    slots = jnp.array([5, 32, 17], jnp.int32)
    want = write_kv_reference(k, v, new, -new, slots)
    step = jax.jit(lambda k, v: write_kv(k, v, new, -new, slots, interpret=True), donate_argnums=(0, 1))
    got = step(k, v)
    assert k.is_deleted() and v.is_deleted()
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_power_of_two_sizes():
    """The one padding helper (kernels_pallas.pow2) the kernels, step buckets, KV transfer and metrics share."""
    from kernels_pallas.pow2 import next_pow2, powers_of_two

    assert [next_pow2(n) for n in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, 16]
    assert [next_pow2(n, 16) for n in (0, 1, 16, 17, 33)] == [16, 16, 16, 32, 64]
    assert powers_of_two(512, 16) == [16, 32, 64, 128, 256, 512]
    assert powers_of_two(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert powers_of_two(1, 4) == [1] and powers_of_two(8, 0) == [1, 2, 4, 8]
