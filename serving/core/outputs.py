"""What a request returns, in vLLM's shape: `RequestOutput.outputs[i].token_ids`, ...

Logprobs follow vLLM: one dict per generated token mapping token id to a
`Logprob(logprob, rank, decoded_token)`; it holds the sampled token and the
top-k alternatives. `prompt_logprobs` has `None` for the first prompt token.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: Optional[int] = None  # 1 = the most likely token
    decoded_token: Optional[str] = None


SampleLogprobs = list  # list[dict[int, Logprob]]
PromptLogprobs = list  # list[Optional[dict[int, Logprob]]]


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[SampleLogprobs]
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | None while running
    stop_reason: Optional[int | str] = None  # the stop string or stop token id that ended it
    # The weight version (`LLM.weight_version`) each token was drawn under: a rollout that spans a weight
    # update (generation paused with "keep") says which tokens came from which policy.
    weight_versions: Optional[list[int]] = None
    # With logprobs: per token, how many tokens had nonzero probability in the distribution its logprobs are
    # of; under logprobs_mode="processed_logprobs" the top-k / top-p / min-p keep-mask size (masks included),
    # what a trainer needs to rebuild the truncated distribution it was drawn from.
    keep_sizes: Optional[list[int]] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.monotonic) of one request's life."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    prompt_logprobs: Optional[PromptLogprobs]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: Optional[RequestMetrics] = None
    num_cached_tokens: int = 0
    # A pooling request's result (`serving.features.pooling`): the pooled vector [dim] (or a classifier's
    # scores [labels], or every prompt token's hidden state [tokens, dim]) as float32; None for generation.
    pooled: Optional[Any] = None
