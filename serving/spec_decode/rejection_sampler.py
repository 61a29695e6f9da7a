"""Distribution-exact acceptance of drafted tokens (speculative decoding), on device, inside the engine's step.

The verification step computes the target's logits at k+1 consecutive
positions of a sequence: row j predicts the token after draft j (row 0 follows
the sequence's last real token). Row j carries the draft `d` proposed for that
next position (or -1 on the last row, the "bonus" row, and on every ordinary
row), and `q`, the distribution the proposer drew `d` from.

Per row, with `p` the target's sampling distribution (temperature, min-p,
top-k and top-p applied exactly as `serving.core.sampler` does):

* a random row accepts `d` with probability min(1, p(d) / q(d)); when it
  rejects, it draws from norm(max(0, p - q)). Accepting or drawing the
  residual gives a token distributed exactly as p (the standard speculative
  sampling argument). A prompt-lookup draft is a point mass, q = onehot(d):
  accept with probability p(d), resample from p with d removed.
* a greedy row accepts `d` iff it is the argmax, otherwise emits the argmax,
  so greedy output is the longest matching prefix plus the target's token.
* a row without a draft draws from p with the same uniform number the plain
  sampler would use, so it emits exactly what the non-speculative step would.

A sequence's rows are emitted up to and including its first row that did not
accept (an ordinary row never accepts, so it always ends its group); later
rows come back as -1. Only these ids leave the device.

Random numbers: the uniform that draws a row's token is the plain sampler's
`fold_in(fold_in(key(seed), sample_index), token_index)`; the acceptance test
folds in one more constant. Both depend only on the request, never on the
batch, so seeded output is reproducible whatever runs next to it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from serving.core.sampler import SamplingInputs, filtered_logits, inverse_cdf, row_uniforms

ACCEPT_STREAM = 0x5EC0  # folded into a row's key for its acceptance test
DRAFT_STREAM = 0xD4AF  # folded into a row's key when a draft model samples it


def stream_uniforms(key_data, sample_index, token_index, stream: int):
    """U(0, 1] per row from the row's (seed, sample, token) key with `stream` folded in."""

    def one(kd, s, t):
        key = jax.random.wrap_key_data(kd, impl="threefry2x32")
        key = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, s), t), stream)
        return 1.0 - jax.random.uniform(key, (), jnp.float32)

    return jax.vmap(one)(key_data, sample_index, token_index)


def residual(p, q):
    """norm(max(0, p - q)) up to normalisation: where a rejected draft's replacement is drawn from."""
    return jnp.maximum(p - q, 0.0)


def accept_random(p, q_d, p_d, u_accept):
    """Accept with probability min(1, p(d) / q(d)); u in (0, 1]."""
    return u_accept * q_d <= p_d


def random_rows(logits, s: SamplingInputs, draft, has_draft, q_rows):
    """(accepted [R] bool, token to emit when not accepted [R] i32) for temperature > 0 rows."""
    x = filtered_logits(logits, s)
    weights = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))  # exactly the plain sampler's
    p = weights / jnp.sum(weights, axis=-1, keepdims=True)
    vocab = logits.shape[-1]
    q = jax.nn.one_hot(draft, vocab, dtype=jnp.float32) if q_rows is None else q_rows
    p_d = jnp.take_along_axis(p, draft[:, None], axis=-1)[:, 0]
    q_d = jnp.take_along_axis(q, draft[:, None], axis=-1)[:, 0]
    u_acc = stream_uniforms(s.key_data, s.sample_index, s.token_index, ACCEPT_STREAM)
    accepted = has_draft & accept_random(p, q_d, p_d, u_acc)
    r = residual(p, q)
    r_ok = jnp.sum(r, axis=-1, keepdims=True) > 0  # p == q leaves nothing: such a draft is always accepted
    w = jnp.where(has_draft[:, None] & r_ok, r, weights)
    u = row_uniforms(s.key_data, s.sample_index, s.token_index)
    return accepted, inverse_cdf(w, u)


def verify(logits, s: SamplingInputs, draft_tokens, group_start, q_rows=None):
    """Token per row [R] i32, -1 for rows after a sequence's first non-accepted row.

    `draft_tokens` [R] (-1: none), `group_start` [R] (the first row of the
    row's sequence; a row on its own points at itself), `q_rows` [R, V] the
    draft distribution of each row (None: every draft is a point mass).
    """
    logits = logits.astype(jnp.float32)
    has_draft = draft_tokens >= 0
    draft = jnp.maximum(draft_tokens, 0)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    greedy_accept = has_draft & (draft == greedy)

    def with_random():
        acc, tok = random_rows(logits, s, draft, has_draft, q_rows)
        rnd = s.temperature > 0
        return jnp.where(rnd, acc, greedy_accept), jnp.where(rnd, tok, greedy)

    accepted, own = jax.lax.cond(s.any_random, with_random, lambda: (greedy_accept, greedy))
    token = jnp.where(accepted, draft, own)
    return emit_prefix(token, accepted, group_start)


def draft_rows(draft_probs, draft_tokens, q_index, vocab: int):
    """[R, V] the distribution each row's draft was drawn from: row `q_index` of the draft model's
    `draft_probs`, or a point mass on the draft where the row has no distribution (-1)."""
    point = jax.nn.one_hot(jnp.maximum(draft_tokens, 0), vocab, dtype=jnp.float32)
    gathered = draft_probs[jnp.clip(q_index, 0, draft_probs.shape[0] - 1)]
    return jnp.where((q_index >= 0)[:, None], gathered, point)


def emit_prefix(token, accepted, group_start):
    """Keeps each group's rows up to and including its first non-accepted row; -1 elsewhere."""
    stop = (~accepted).astype(jnp.int32)
    before = jnp.cumsum(stop) - stop  # non-accepted rows strictly before each row
    emitted = before == before[group_start]
    return jnp.where(emitted, token, -1)
