"""Poolers: one vector (or every token's) per sequence from a model's final hidden states.

Pure jnp functions over two layouts:

* the ragged packed layout of the engine's steps (`model.cache.BatchMetadata`): the tokens of
  several sequences packed on one axis `[T, E]`, sequence i owning rows
  `cu_q_lens[i]:cu_q_lens[i+1]`, rows past `cu_q_lens[-1]` padding;
* a dense padded batch `[B, L, E]` with an attention mask `[B, L]` (the encoders' forward,
  `model.families.bert`).

Poolers: last token (decoder embedders, sequence classifiers and reward models), first token
(CLS, encoders), mean over the prompt, and all tokens. Mean pooling of a prompt prefilled over
several steps is exact: each step adds its rows to a per-sequence (sum, count) accumulator
(`mean_accumulate`, fp32) and the last step divides (`mean_finish`); the sum is over the same
rows in fp32, so it equals the one-shot mean up to fp32 summation order.

After pooling: `truncate` (Matryoshka `dimensions`: the first `d` components) and `normalize`
(L2). `finish_embedding` applies both in the order served embeddings get them: truncate first,
then normalize, so a shortened embedding is a unit vector again.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

POOLING_TYPES = ("last", "cls", "mean", "all")


# --- the ragged packed layout ---

def segment_ids(cu_q_lens, num_tokens: int):
    """`[T]` int32: the sequence each row belongs to; padding rows get `S` (one past the last)."""
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    # Row r is in sequence i when cu[i] <= r < cu[i+1]: count the ends at or before r.
    return jnp.sum(rows[:, None] >= cu_q_lens[None, 1:], axis=1).astype(jnp.int32)


def last_token_rows(cu_q_lens):
    """`[S]` the row of each sequence's last token in this step (0 for an empty / padding one)."""
    ends = cu_q_lens[1:] - 1
    return jnp.where(cu_q_lens[1:] > cu_q_lens[:-1], ends, 0)


def first_token_rows(cu_q_lens):
    """`[S]` the row of each sequence's first token in this step. It is the prompt's first (CLS)
    token only in the step whose chunk starts at position 0."""
    return cu_q_lens[:-1]


def pool_last_packed(hidden, cu_q_lens):
    """`[S, E]`: each sequence's last row of this step (its prompt's last token in the step that
    ends the prompt). Padding sequences give row 0's values; callers keep the live ones."""
    return hidden[last_token_rows(cu_q_lens)]


def pool_first_packed(hidden, cu_q_lens):
    """`[S, E]`: each sequence's first row of this step."""
    return hidden[jnp.minimum(first_token_rows(cu_q_lens), hidden.shape[0] - 1)]


def mean_accumulate(hidden, cu_q_lens, acc_sum=None, acc_count=None):
    """Adds this step's rows to per-sequence running sums: returns `(sum [S, E] fp32, count [S]
    int32)`. `acc_sum` / `acc_count` are the totals of the sequences' earlier chunks (None: zeros,
    a sequence's first chunk). Padding rows add nothing."""
    num_seqs = cu_q_lens.shape[0] - 1
    seg = segment_ids(cu_q_lens, hidden.shape[0])
    sums = jax.ops.segment_sum(hidden.astype(jnp.float32), seg, num_segments=num_seqs + 1)[:num_seqs]
    counts = (cu_q_lens[1:] - cu_q_lens[:-1]).astype(jnp.int32)
    if acc_sum is not None:
        sums = sums + acc_sum
    if acc_count is not None:
        counts = counts + acc_count
    return sums, counts


def mean_finish(acc_sum, acc_count):
    """The mean from an accumulator: `sum / count` (a sequence with no rows gives zeros)."""
    return acc_sum / jnp.maximum(acc_count, 1).astype(jnp.float32)[:, None]


def pool_mean_packed(hidden, cu_q_lens):
    """`[S, E]` fp32: the mean of each sequence's rows of this step (the whole prompt when it was
    prefilled in one step)."""
    return mean_finish(*mean_accumulate(hidden, cu_q_lens))


def pool_all_packed(hidden, cu_q_lens):
    """Every row with its sequence: `(hidden [T, E], segment_ids [T])` (padding rows: segment S).
    Static shapes; `split_rows` cuts them per sequence on the host."""
    return hidden, segment_ids(cu_q_lens, hidden.shape[0])


def split_rows(hidden, cu_q_lens, num_seqs: int):
    """Host side: the list of each live sequence's rows `[n_i, E]` (numpy)."""
    import numpy as np

    hidden, cu = np.asarray(hidden), np.asarray(cu_q_lens)
    return [hidden[cu[i]:cu[i + 1]] for i in range(num_seqs)]


# --- a dense padded batch with a mask ---

def pool_dense(hidden, mask, pooling: str):
    """`[B, E]` (or `[B, L, E]` for "all", padding rows zeroed) from `hidden [B, L, E]` and `mask [B, L]`
    (1: a token of the sequence, 0: padding; the tokens of a row are contiguous from column 0 or
    right-aligned, either works for "last" and "mean")."""
    mask = mask.astype(jnp.float32)
    if pooling == "cls":
        return hidden[:, 0]
    if pooling == "last":
        cols = jnp.arange(mask.shape[1])
        last = jnp.max(jnp.where(mask > 0, cols[None, :], -1), axis=1)
        return hidden[jnp.arange(hidden.shape[0]), jnp.maximum(last, 0)]
    if pooling == "mean":
        total = jnp.einsum("ble,bl->be", hidden.astype(jnp.float32), mask)
        return total / jnp.maximum(mask.sum(axis=1), 1e-9)[:, None]
    if pooling == "all":
        return hidden * mask[..., None].astype(hidden.dtype)
    raise ValueError(f"pooling must be one of {POOLING_TYPES}, got {pooling!r}")


# --- after pooling ---

def normalize(x, eps: float = 1e-12):
    """L2-normalized along the last axis (fp32), as `torch.nn.functional.normalize`."""
    x = x.astype(jnp.float32)
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), eps)


def truncate(x, dimensions: int | None):
    """Matryoshka truncation: the first `dimensions` components (None: all)."""
    if dimensions is None:
        return x
    if not 0 < dimensions <= x.shape[-1]:
        raise ValueError(f"dimensions must be in 1..{x.shape[-1]}, got {dimensions}")
    return x[..., :dimensions]


def finish_embedding(x, *, normalize_output: bool, dimensions: int | None = None):
    """A pooled embedding as served: truncated to `dimensions`, then normalized when asked."""
    x = truncate(x, dimensions)
    return normalize(x) if normalize_output else x.astype(jnp.float32)
