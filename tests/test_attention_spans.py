"""Bidirectional spans (`span_end`, Gemma 3's image tokens) in every attention backend.

The reference is held to a dense per-sequence oracle written here in numpy (HF's mask for Gemma 3:
`(causal OR same image) AND window`); the "xla" backend (every way it cuts the work) and the Pallas
kernel (interpret mode, with and without KV splits) to the reference. Spans are random runs of a
sequence's new rows, some starting before the step's first row (a prefix hit that ends inside an
image), on the ragged batches of `test_kernels` (scattered pages, partial pages, padding sequences, GQA).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from kernels_pallas.ragged_paged_attention import ragged_paged_attention
from kernels_pallas.reference import ragged_paged_attention_reference
from kernels_pallas.xla_attention import ragged_paged_attention_xla
from model.blocks import NO_WINDOW
from test_kernels import MAX_SEQS, NUM_TOKENS, PAGES_PER_SEQ, assert_attention_close, mixes, random_mix, \
    ragged_batch

HQ, HKV, PAGE_SIZE, HEAD_DIM = 4, 2, 8, 16
NUM_PAGES = MAX_SEQS * PAGES_PER_SEQ + 5
SCALE = HEAD_DIM**-0.5
WINDOWS = (3, NO_WINDOW)

reference = jax.jit(ragged_paged_attention_reference, static_argnames=("sm_scale", "soft_cap"))


def random_spans(rng, seqs):
    """[T] int32 span ends: in each sequence with 2+ new rows, one run of them (sometimes begun before
    the step's first row) ends at a random later position of the step; every other row 0."""
    span_end = np.zeros(NUM_TOKENS, np.int32)
    row = 0
    for q_len, kv_len in seqs:
        first = kv_len - q_len
        if q_len >= 2:
            a = int(rng.randint(0, q_len - 1))
            b = int(rng.randint(a + 2, q_len + 1))
            span_end[row + (0 if rng.rand() < 0.3 else a):row + b] = first + b
        row += q_len
    return jnp.asarray(span_end)


def _batches(seed):
    rng = np.random.RandomState(seed)
    mix = mixes(PAGE_SIZE)
    cases = dict(mixed=mix["mixed"], chunk_tail=mix["chunk_tail"], prefill=mix["prefill"],
                 random=random_mix(rng, PAGE_SIZE))
    return {name: (seqs, ragged_batch(rng, seqs, page_size=PAGE_SIZE, num_pages=NUM_PAGES, num_q_heads=HQ,
                                      num_kv_heads=HKV, head_dim=HEAD_DIM, dtype=jnp.float32),
                   random_spans(rng, seqs))
            for name, seqs in cases.items()}


def dense_oracle(q, k_pages, v_pages, kv_lens, tables, cu, num_seqs, span_end, window):
    q, k_pages, v_pages = (np.asarray(a, np.float64) for a in (q, k_pages, v_pages))
    span_end = np.asarray(span_end)
    out = np.zeros_like(q)
    group = HQ // HKV
    for s in range(int(num_seqs)):
        n, q0, q1 = int(kv_lens[s]), int(cu[s]), int(cu[s + 1])
        keys = k_pages[np.asarray(tables[s])].reshape(-1, HKV, HEAD_DIM)[:n]
        vals = v_pages[np.asarray(tables[s])].reshape(-1, HKV, HEAD_DIM)[:n]
        for r in range(q0, q1):
            pos = n - (q1 - q0) + (r - q0)
            j = np.arange(n)
            visible = ((j <= pos) | (j < span_end[r])) & (j > pos - window)
            for h in range(HQ):
                sc = keys[:, h // group] @ q[r, h] * SCALE
                p = np.where(visible, np.exp(sc - sc[visible].max()), 0.0)
                out[r, h] = p @ vals[:, h // group] / p.sum()
    return out


def test_reference_matches_dense_oracle_and_spans_change_the_output():
    changed = False
    for name, (seqs, args, spans) in _batches(1).items():
        for window in WINDOWS:
            got = reference(*args, sm_scale=SCALE, window=jnp.int32(window), span_end=spans)
            want = dense_oracle(*args, spans, window)
            np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, err_msg=f"{name} {seqs} window={window}")
            causal = reference(*args, sm_scale=SCALE, window=jnp.int32(window))
            changed |= float(jnp.max(jnp.abs(got - causal))) > 1e-2
    assert changed
    # All-zero span ends are the causal contract exactly.
    _, args, _ = _batches(2)["mixed"]
    np.testing.assert_array_equal(np.asarray(reference(*args, sm_scale=SCALE, span_end=jnp.zeros(NUM_TOKENS, jnp.int32))),
                                  np.asarray(reference(*args, sm_scale=SCALE)))


# (rows per item, chunk bytes, pages per block of a multi-row item)
XLA_CUTS = [(1, 1, None), (4, None, None), (4, None, 1)]


@pytest.mark.parametrize("rows,chunk_bytes,block_pages", XLA_CUTS)
def test_xla_backend_matches_reference(rows, chunk_bytes, block_pages):
    fast = jax.jit(functools.partial(ragged_paged_attention_xla, sm_scale=SCALE, rows=rows, chunk_bytes=chunk_bytes,
                                     block_pages=block_pages))
    for name, (seqs, args, spans) in _batches(3).items():
        for window in (None, 3):
            win = None if window is None else jnp.int32(window)
            ref = reference(*args, sm_scale=SCALE, window=win, span_end=spans)
            out = fast(*args, window=win, span_end=spans)
            try:
                assert_attention_close(out, ref, args[5], args[6], jnp.float32)
            except AssertionError as e:
                raise AssertionError(f"rows={rows} block_pages={block_pages} {name} {seqs} window={window}: {e}") from None


def test_pallas_kernel_matches_reference():
    splits = 3  # KV splits: an item's span end may fall in a later split than its rows
    kernel = jax.jit(functools.partial(ragged_paged_attention, sm_scale=SCALE, interpret=True,
                                       num_kv_splits=splits, block_kv=16))
    for name, (seqs, args, spans) in _batches(4).items():
        if name not in ("mixed", "random"):
            continue
        for window in (None, PAGE_SIZE + 1):
            win = None if window is None else jnp.int32(window)
            ref = reference(*args, sm_scale=SCALE, window=win, span_end=spans)
            out = kernel(*args, window=win, span_end=spans)
            try:
                assert_attention_close(out, ref, args[5], args[6], jnp.float32)
            except AssertionError as e:
                raise AssertionError(f"splits={splits} {name} {seqs} window={window}: {e}") from None


def test_kernel_with_spans_lowers_for_cuda():
    """The span ends reach the Triton module as one more input: still one KV loop and two dots."""
    from test_kernels_lowering import attention_args, lower_for_cuda, op_counts

    args = attention_args(jnp.bfloat16, tokens=64, seqs=8, q_heads=16, kv_heads=8, head_dim=256, page_size=16)
    spanned = lambda *a: ragged_paged_attention(*a[:-2], window=a[-2], span_end=a[-1], num_kv_splits=2)  # noqa: E731
    _, kernels = lower_for_cuda(spanned, *args, jax.ShapeDtypeStruct((), jnp.int32),
                                jax.ShapeDtypeStruct((64,), jnp.int32))
    counts = op_counts(kernels[0])
    assert len(kernels) == 1 and counts["tt.dot"] == 2 and counts["scf.for"] == 1
