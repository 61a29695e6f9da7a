"""Logits processors written as a user would write them (docs/logits_processors.md), for the tests.

A module of its own, importable by name in the test processes and in the processes
tests/multihost_worker.py runs.
"""

import jax.numpy as jnp
import numpy as np


class BanTokens:
    """Bans the token ids of `extra_args["ban"]` for the requests that give it."""

    def __init__(self, config):
        self.vocab = config.vocab_size

    def validate(self, extra_args):
        ban = extra_args.get("ban", [])
        if not isinstance(ban, list) or not all(isinstance(t, int) and 0 <= t < self.vocab for t in ban):
            raise ValueError(f"ban: expected a list of token ids in [0, {self.vocab}), got {ban!r}")

    def rows(self, samples):
        banned = np.zeros((len(samples), self.vocab), bool)
        for i, s in enumerate(samples):
            banned[i, s.extra_args.get("ban", [])] = True
        return {"banned": banned}

    def apply(self, rows, logits):
        return jnp.where(rows["banned"], -jnp.inf, logits)


class ForceAt:
    """Forces `extra_args["force"]` at the output positions `extra_args["at"]`: a processor that depends on
    each row's position, which a speculative step's verifying rows must each get right."""

    def __init__(self, config):
        self.vocab = config.vocab_size

    def rows(self, samples):
        force = np.full(len(samples), -1, np.int32)
        for i, s in enumerate(samples):
            if s.token_index in s.extra_args.get("at", ()):
                force[i] = s.extra_args["force"]
        return force

    def apply(self, force, logits):
        forced = jnp.where(jnp.arange(self.vocab)[None, :] == force[:, None], 0.0, -jnp.inf)
        return jnp.where(force[:, None] >= 0, forced, logits)


class RowsWithoutTheSampleAxis(BanTokens):
    """A broken processor: its rows have no leading axis of the samples (refused when the engine starts)."""

    def rows(self, samples):
        return np.zeros(3, np.int32)
