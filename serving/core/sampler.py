"""On-device sampling: greedy, temperature, top-k, top-p, min-p, and logprobs.

Runs inside the jitted step on the `[R, vocab]` fp32 logits, so logits never
leave the device. Every row is sampled from its own parameters only:

* the random number of a row comes from `fold_in(fold_in(key(seed),
  sample_index), token_index)`, so a seeded request draws the same tokens
  whatever else is in the batch and wherever it is in it;
* a row whose filters are off is left untouched even when another row in the
  batch needs the sorting path.

One uniform number per row and an inverse-CDF lookup replace a Gumbel draw
over the whole vocabulary (far fewer random bits on CPU). The expensive paths
(anything random; a full sort for top-k/top-p; top-k logprobs) sit behind
`lax.cond` on batch-level flags, so an all-greedy batch pays for an argmax.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from serving.core.sampling_params import MAX_LOGPROBS


class SamplingInputs(NamedTuple):
    """The sampler's inputs: the per-row parameters of `serving.core.sampling_table` (same names), then
    what packing computes per row and per batch."""

    temperature: jax.Array  # [R] f32, 0 = greedy
    top_k: jax.Array  # [R] i32, <= 0 = off
    top_p: jax.Array  # [R] f32, 1 = off
    min_p: jax.Array  # [R] f32, 0 = off
    key_data: jax.Array  # [R, 2] u32, threefry key words of the request's seed
    sample_index: jax.Array  # [R] i32, which of the request's n samples
    token_index: jax.Array  # [R] i32, index of the token being drawn within its sample
    target: jax.Array  # [R] i32, token whose logprob to report (-1: the sampled one)
    any_random: jax.Array  # [] bool
    any_filter: jax.Array  # [] bool, some row uses top-k or top-p
    want_logprobs: jax.Array  # [] bool
    # Read only by the sampling-controls part (serving.features.sampling_controls), for rows holding a slot
    # (None outside the step).
    presence_penalty: jax.Array = None  # [R] f32
    frequency_penalty: jax.Array = None  # [R] f32
    repetition_penalty: jax.Array = None  # [R] f32
    min_tokens: jax.Array = None  # [R] i32


class LogprobsOutput(NamedTuple):
    chosen: jax.Array  # [R] f32 logprob of the sampled (or target) token
    rank: jax.Array  # [R] i32, 1 = most likely
    top_ids: jax.Array  # [R, MAX_LOGPROBS] i32
    top_logprobs: jax.Array  # [R, MAX_LOGPROBS] f32
    # [R] i32: tokens of nonzero probability in the distribution these logprobs are of (under processed
    # logprobs, the keep-mask size of top-k / top-p / min-p and the parts' masks; raw: the vocabulary)
    kept: jax.Array


def num_top_logprobs(vocab_size: int) -> int:
    return min(MAX_LOGPROBS, vocab_size)


def row_uniforms(key_data, sample_index, token_index):
    """One U(0, 1] draw per row from its own (seed, sample, token) key."""

    def one(kd, s, t):
        key = jax.random.wrap_key_data(kd, impl="threefry2x32")
        key = jax.random.fold_in(jax.random.fold_in(key, s), t)
        return 1.0 - jax.random.uniform(key, (), jnp.float32)

    return jax.vmap(one)(key_data, sample_index, token_index)


def _filter_top_k_top_p(x, top_k, top_p):
    """Masks to -inf what top-k and top-p drop, row by row (a no-op for rows with both off)."""
    vocab = x.shape[-1]
    sorted_desc = -jnp.sort(-x, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    x = jnp.where(x < kth, -jnp.inf, x)
    ranks = jnp.arange(vocab, dtype=jnp.int32)[None, :]
    sorted_k = jnp.where(ranks < k[:, None], sorted_desc, -jnp.inf)
    p = jax.nn.softmax(sorted_k, axis=-1)
    mass_before = jnp.cumsum(p, axis=-1) - p
    # Keep the smallest prefix whose mass reaches top_p; the first token always stays.
    keep = (mass_before < top_p[:, None]) | (ranks == 0)
    last = jnp.sum(keep, axis=-1) - 1
    cutoff = jnp.take_along_axis(sorted_k, last[:, None], axis=-1)
    cutoff = jnp.where((top_p < 1.0)[:, None], cutoff, -jnp.inf)
    return jnp.where(x < cutoff, -jnp.inf, x)


def filtered_logits(logits, s: SamplingInputs):
    """The logits the sampler draws from: temperature, then min-p, then top-k/top-p applied."""
    temp = jnp.where(s.temperature > 0, s.temperature, 1.0)
    x = logits / temp[:, None]
    # min-p: drop tokens whose probability is below min_p times the top one's.
    top = jnp.max(x, axis=-1, keepdims=True)
    floor = jnp.where(s.min_p > 0, jnp.log(jnp.maximum(s.min_p, 1e-38)), -jnp.inf)[:, None]
    x = jnp.where(x < top + floor, -jnp.inf, x)
    return jax.lax.cond(s.any_filter, lambda y: _filter_top_k_top_p(y, s.top_k, s.top_p), lambda y: y, x)


def inverse_cdf(weights, u):
    """Index drawn from unnormalised `weights` [R, V] with uniforms `u` in (0, 1]."""
    cdf = jnp.cumsum(weights, axis=-1)
    # The first token whose cumulative mass reaches the threshold (threshold > 0,
    # so a token of zero probability is never chosen).
    ids = jnp.sum(cdf < (u * cdf[:, -1])[:, None], axis=-1).astype(jnp.int32)
    return jnp.minimum(ids, weights.shape[-1] - 1)


def _sample_random(logits, s: SamplingInputs):
    x = filtered_logits(logits, s)
    probs = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    return inverse_cdf(probs, row_uniforms(s.key_data, s.sample_index, s.token_index))


def _logprobs(logits, ids, target):
    logp = jax.nn.log_softmax(logits, axis=-1)
    chosen_id = jnp.where(target >= 0, target, ids)
    chosen = jnp.take_along_axis(logp, chosen_id[:, None], axis=-1)[:, 0]
    rank = jnp.sum(logp > chosen[:, None], axis=-1).astype(jnp.int32) + 1
    top_lp, top_ids = jax.lax.top_k(logp, num_top_logprobs(logp.shape[-1]))
    kept = jnp.sum(jnp.isfinite(logp), axis=-1).astype(jnp.int32)
    return LogprobsOutput(chosen, rank, top_ids.astype(jnp.int32), top_lp, kept)


def sample_ids(logits: jax.Array, s: SamplingInputs):
    """Token ids [R] i32: each row's argmax, or its draw when the row samples."""
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.lax.cond(
        s.any_random,
        lambda: jnp.where(s.temperature > 0, _sample_random(logits, s), greedy),
        lambda: greedy,
    )


def logprobs_of(raw_logits: jax.Array, ids, s: SamplingInputs) -> LogprobsOutput:
    """Logprobs of `ids` (or each row's target) under `raw_logits`; zeros unless the batch asked."""
    raw = raw_logits.astype(jnp.float32)
    r = raw.shape[0]
    k = num_top_logprobs(raw.shape[-1])
    empty = LogprobsOutput(jnp.zeros((r,), jnp.float32), jnp.zeros((r,), jnp.int32),
                           jnp.zeros((r, k), jnp.int32), jnp.zeros((r, k), jnp.float32), jnp.zeros((r,), jnp.int32))
    return jax.lax.cond(s.want_logprobs, lambda: _logprobs(raw, ids, s.target), lambda: empty)


def sample(logits: jax.Array, s: SamplingInputs, raw_logits=None):
    """Returns (token ids [R] i32, LogprobsOutput); logprobs are zeros unless asked for.

    Logprobs are those of the model's raw distribution (before temperature
    and filters), as vLLM reports them: `raw_logits`, when `logits` were
    adjusted by the step parts first (`step_parts.StepPart.apply_to_logits`).
    """
    ids = sample_ids(logits, s)
    return ids, logprobs_of(logits if raw_logits is None else raw_logits, ids, s)
