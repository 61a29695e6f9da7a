"""The speculative-decoding options (`speculative_method`, `num_speculative_tokens`, declared with the
engine's other options in `serving.core.engine_args`): their checks and what they imply (the logit rows a
step needs, the embedded draft model)."""

from __future__ import annotations

import os

from serving.core.engine_args import SPECULATIVE_METHODS as METHODS


def default_draft_dir() -> str:
    """The embedded draft model for the embedded default model."""
    import model

    return os.path.join(os.path.dirname(os.path.abspath(model.__file__)), "default_draft")


def check_options(method, k: int) -> None:
    if method is None:
        return
    if method not in METHODS:
        raise ValueError(f"speculative_method must be one of {METHODS} (or None), got {method!r}")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"num_speculative_tokens must be an integer >= 1 with speculative_method={method!r}, "
                         f"got {k!r}")


def logit_rows(max_num_seqs: int, max_num_batched_tokens: int, k: int) -> int:
    """Logit rows a step may need: k + 1 per decoding sequence (at most one per token)."""
    return min(max_num_batched_tokens, max_num_seqs * (k + 1))
