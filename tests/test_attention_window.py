"""Sliding-window attention and score soft-capping in every attention backend.

The reference is held to a dense per-sequence oracle written here in numpy; the "xla" backend
(every way it cuts the work) and the Pallas kernel (interpret mode, with and without KV splits)
to the reference, on the ragged batches of `test_kernels` (scattered pages, partial last pages,
padding sequences) and windows from 1 token to wider than any context. The window is a traced
argument (layers differ), so one compile serves every window. Pages wholly before every row's
window are filled with NaN where a backend promises to skip them: one read would show.
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
from test_kernels import MAX_SEQS, PAGES_PER_SEQ, assert_attention_close, mixes, random_mix, ragged_batch

HQ, HKV, PAGE_SIZE, HEAD_DIM = 4, 2, 8, 16
NUM_PAGES = MAX_SEQS * PAGES_PER_SEQ + 5
SCALE = HEAD_DIM**-0.5
WINDOWS = (1, 3, PAGE_SIZE + 1, 2 * PAGE_SIZE + 3, NO_WINDOW)

reference = jax.jit(ragged_paged_attention_reference, static_argnames=("sm_scale", "soft_cap"))


def _batches(seed):
    rng = np.random.RandomState(seed)
    cases = dict(mixes(PAGE_SIZE), random=random_mix(rng, PAGE_SIZE))
    return {name: (seqs, ragged_batch(rng, seqs, page_size=PAGE_SIZE, num_pages=NUM_PAGES, num_q_heads=HQ,
                                      num_kv_heads=HKV, head_dim=HEAD_DIM, dtype=jnp.float32))
            for name, seqs in cases.items()}


def dense_oracle(q, k_pages, v_pages, kv_lens, tables, cu, num_seqs, window, soft_cap):
    """Each sequence alone: its keys gathered in order, causal + window mask, soft-cap, softmax."""
    q, k_pages, v_pages = (np.asarray(a, np.float64) for a in (q, k_pages, v_pages))
    out = np.zeros_like(q)
    group = HQ // HKV
    for s in range(int(num_seqs)):
        n, q0, q1 = int(kv_lens[s]), int(cu[s]), int(cu[s + 1])
        keys = k_pages[np.asarray(tables[s])].reshape(-1, HKV, HEAD_DIM)[:n]
        vals = v_pages[np.asarray(tables[s])].reshape(-1, HKV, HEAD_DIM)[:n]
        for r in range(q0, q1):
            pos = n - (q1 - q0) + (r - q0)
            j = np.arange(n)
            visible = (j <= pos) & (j > pos - window)
            for h in range(HQ):
                sc = keys[:, h // group] @ q[r, h] * SCALE
                if soft_cap is not None:
                    sc = soft_cap * np.tanh(sc / soft_cap)
                p = np.where(visible, np.exp(sc - sc[visible].max()), 0.0)
                out[r, h] = p @ vals[:, h // group] / p.sum()
    return out


@pytest.mark.parametrize("soft_cap", [None, 2.0])
def test_reference_matches_dense_oracle(soft_cap):
    for name, (seqs, args) in _batches(1).items():
        for window in WINDOWS:
            got = reference(*args, sm_scale=SCALE, window=jnp.int32(window), soft_cap=soft_cap)
            want = dense_oracle(*args, window, soft_cap)
            np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, err_msg=f"{name} {seqs} window={window}")


def test_no_window_and_a_wide_window_agree_and_a_narrow_one_differs():
    _, args = _batches(2)["mixed"]
    plain = reference(*args, sm_scale=SCALE)
    np.testing.assert_array_equal(np.asarray(reference(*args, sm_scale=SCALE, window=jnp.int32(NO_WINDOW))),
                                  np.asarray(plain))
    assert float(jnp.max(jnp.abs(reference(*args, sm_scale=SCALE, window=jnp.int32(3)) - plain))) > 1e-2


def _poison_skipped_pages(args, window, granule):
    """K/V pages of each live sequence that lie wholly before `granule`-aligned start of its first row's
    window set to NaN (what a backend that skips them never reads)."""
    q, k, v, kv_lens, tables, cu, num_seqs = args
    k, v = np.array(k), np.array(v)
    poisoned = 0
    for s in range(int(num_seqs)):
        first_pos = int(kv_lens[s]) - (int(cu[s + 1]) - int(cu[s]))
        start = max(first_pos - window + 1, 0) // granule * granule
        for p in range(start // PAGE_SIZE):
            k[int(tables[s, p])] = v[int(tables[s, p])] = np.nan
            poisoned += 1
    return (q, jnp.asarray(k), jnp.asarray(v), kv_lens, tables, cu, num_seqs), poisoned


# (rows per item, chunk bytes, soft cap, pages per block): one row per item reads (row, block) pairs from the
# window's first page; several rows per item read the sequence's pages, a block at a time, and mask.
XLA_CUTS = [(1, None, None, None), (1, 1, 2.0, 3), (4, None, 2.0, None), (16, 1, None, 3)]


@pytest.mark.parametrize("rows,chunk_bytes,soft_cap,block_pages", XLA_CUTS)
def test_xla_backend_matches_reference(rows, chunk_bytes, soft_cap, block_pages):
    fast = jax.jit(functools.partial(ragged_paged_attention_xla, sm_scale=SCALE, rows=rows, soft_cap=soft_cap,
                                     chunk_bytes=chunk_bytes, block_pages=block_pages))
    total_poisoned = 0
    for name, (seqs, args) in _batches(3).items():
        for window in WINDOWS:
            ref = reference(*args, sm_scale=SCALE, window=jnp.int32(window), soft_cap=soft_cap)
            args_in = args
            if rows == 1:  # the pair path never reads a page before the row's window
                args_in, n = _poison_skipped_pages(args, window, PAGE_SIZE)
                total_poisoned += n
            out = fast(*args_in, window=jnp.int32(window))
            try:
                assert_attention_close(out, ref, args[5], args[6], jnp.float32)
            except AssertionError as e:
                raise AssertionError(f"rows={rows} {name} {seqs} window={window}: {e}") from None
    assert rows != 1 or total_poisoned > 0


@pytest.mark.parametrize("splits", [1, 3])
def test_pallas_kernel_matches_reference_and_skips_pages_before_the_window(splits):
    block_kv = 16
    kernel = jax.jit(functools.partial(ragged_paged_attention, sm_scale=SCALE, soft_cap=2.0, interpret=True,
                                       num_kv_splits=splits, block_kv=block_kv))
    total_poisoned = 0
    for name, (seqs, args) in _batches(4).items():
        for window in (1, PAGE_SIZE + 1, NO_WINDOW):
            ref = reference(*args, sm_scale=SCALE, window=jnp.int32(window), soft_cap=2.0)
            # The kernel starts each item at the KV block holding its first row's first visible key.
            poisoned_args, n = _poison_skipped_pages(args, window, block_kv)
            total_poisoned += n
            out = kernel(*poisoned_args, window=jnp.int32(window))
            try:
                assert_attention_close(out, ref, args[5], args[6], jnp.float32)
            except AssertionError as e:
                raise AssertionError(f"splits={splits} {name} {seqs} window={window}: {e}") from None
    assert total_poisoned > 0  # some pages really were out of every window


def test_windowed_soft_capped_kernel_lowers_for_cuda():
    """The window (a traced scalar) and the soft-cap reach the Triton module: still one KV loop, two dots."""
    from test_kernels_lowering import attention_args, lower_for_cuda, op_counts

    args = attention_args(jnp.bfloat16, tokens=64, seqs=8, q_heads=16, kv_heads=8, head_dim=256, page_size=16)
    windowed = lambda *a: ragged_paged_attention(*a[:-1], window=a[-1], soft_cap=50.0, num_kv_splits=2)  # noqa: E731
    _, kernels = lower_for_cuda(windowed, *args, jax.ShapeDtypeStruct((), jnp.int32))
    counts = op_counts(kernels[0])
    assert len(kernels) == 1 and counts["tt.dot"] == 2 and counts["scf.for"] == 1
    assert "tanh" in kernels[0]
