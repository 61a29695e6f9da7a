"""The target model's step when speculation is on: forward, then verify drafts on device.

Same padded inputs as `serving.core.model_runner`'s step (one int32 and one
float32 buffer laid out by `StepShape`), plus one more int32 buffer of three
`[S]` row fields (draft token, first row of the row's sequence, index of the
row's draft distribution) and, for a draft model, its distributions
`[max_seqs * k, vocab]` straight from the draft step's output on device.
Rows without drafts are sampled exactly like the plain step, so with
speculation on this one function serves every step and is the only one
compiled.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from model.forward import forward
from model.config import ModelConfig
from serving.core.input_batch import StepShape
from serving.core.model_runner import unpack_step
from serving.core.sampler import _logprobs, num_top_logprobs, LogprobsOutput
from serving.spec_decode.rejection_sampler import verify

NUM_ROW_FIELDS = 3  # draft_token, group_start, q_index


def empty_row_fields(S: int) -> np.ndarray:
    """Row fields meaning "no drafts": every row its own group."""
    buf = np.empty(NUM_ROW_FIELDS * S, np.int32)
    buf[:S] = -1
    buf[S:2 * S] = np.arange(S)
    buf[2 * S:] = -1
    return buf


def _verify_step(params, cache, ibuf, fbuf, rbuf, draft_probs, *, cfg: ModelConfig, backend: str,
                 shape: StepShape, layout=None):
    # The same inputs as model_runner's step (and the same tensor-parallel `layout`); only the sampling differs.
    v = shape.split(ibuf, fbuf)
    md, s = unpack_step(v)
    logits, cache = forward(params, cache, v["tokens"], md, cfg, backend, layout)
    S = shape.S
    draft_tokens, group_start, q_index = rbuf[:S], rbuf[S:2 * S], rbuf[2 * S:]
    q_rows = None
    if draft_probs is not None:
        point = jax.nn.one_hot(jnp.maximum(draft_tokens, 0), logits.shape[-1], dtype=jnp.float32)
        gathered = draft_probs[jnp.clip(q_index, 0, draft_probs.shape[0] - 1)]
        q_rows = jnp.where((q_index >= 0)[:, None], gathered, point)
    ids = verify(logits, s, draft_tokens, group_start, q_rows)
    r, k = logits.shape[0], num_top_logprobs(logits.shape[-1])
    empty = LogprobsOutput(jnp.zeros((r,), jnp.float32), jnp.zeros((r,), jnp.int32),
                           jnp.zeros((r, k), jnp.int32), jnp.zeros((r, k), jnp.float32))
    lp = jax.lax.cond(s.want_logprobs, lambda: _logprobs(logits, jnp.maximum(ids, 0), s.target), lambda: empty)
    return cache, ids, lp


verify_step_jit = jax.jit(_verify_step, static_argnames=("cfg", "backend", "shape", "layout"), donate_argnums=(1,))
