"""The device side of speculative decoding: the step part that checks the drafts inside the engine's one step
program, in place of its sampling.

Built from the options before the engine (`serving.features.build_parts`), because the runner compiles it into
every step: each verifying sequence has k + 1 rows (`logit_rows`), row j checking draft j against the target's
distribution there (`rejection_sampler.verify`: distribution-exact acceptance; greedy rows take the argmax),
rows after a sequence's first rejection coming back as -1. A draft model's distributions of its drafts are the
step's device input (`device_input_spec`: `[max_num_seqs * k, vocab]`, made by the draft model's own program,
never through the host), each verifying row pointing at its draft's row (the `q_index` row field); n-gram
drafts are point masses and take none. Rows without drafts are sampled exactly as without speculation.

The host side (proposing drafts, keeping what was accepted) is `serving.spec_decode.decoder.SpecDecoder`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from serving.core import engine_args
from serving.core.input_batch import TokenField
from serving.core.sampler import logprobs_of, sample_ids
from serving.core.step_parts import StepPart
from serving.spec_decode import rejection_sampler
from serving.spec_decode.options import check_options, logit_rows

Q_INDEX = "q_index"  # the row field: the row of the draft model's distributions a verifying row reads (-1: none)


class SpecVerifier(StepPart):
    serves = engine_args.SPECULATION
    serial = True  # the next step's drafts follow this step's tokens
    rolls_back = True  # rejected drafts' K/V is taken back

    def __init__(self, method: str, k: int, max_num_seqs: int, vocab: int):
        check_options(method, k)
        self.method, self.k, self.max_num_seqs, self.vocab = method, k, max_num_seqs, vocab

    def logit_rows(self, max_num_seqs: int, max_num_batched_tokens: int) -> int:
        return logit_rows(max_num_seqs, max_num_batched_tokens, self.k)

    def rows_per_decode(self) -> int:
        return 1 + self.k

    def token_fields(self) -> tuple:
        return (TokenField(Q_INDEX, (-2,), fill=-1),) if self.method == "draft" else ()

    def device_input_spec(self):
        if self.method != "draft":
            return None
        return jax.ShapeDtypeStruct((self.max_num_seqs * self.k, self.vocab), np.float32)

    def sample(self, logits, raw, step, views, device_input):
        proposed, group_start = step.proposals
        q_rows = None
        if device_input is not None:
            q_rows = rejection_sampler.draft_rows(device_input, proposed, views[Q_INDEX], logits.shape[-1])
        ids = jax.lax.cond(jnp.any(proposed >= 0),
                           lambda: rejection_sampler.verify(logits, step.sampling, proposed, group_start, q_rows),
                           lambda: sample_ids(logits, step.sampling))
        return ids, logprobs_of(raw, jnp.maximum(ids, 0), step.sampling)

    def program_key(self):
        return ("speculative-verification", self.method, self.k, self.max_num_seqs, self.vocab)

    def describe(self) -> dict:
        return {"speculative_method": self.method, "num_speculative_tokens": self.k}
