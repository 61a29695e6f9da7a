"""Per-request sampling parameters, with vLLM's field names and defaults.

`validate()` is called when a request is added, before anything is queued, so
a bad value is reported at once with the name of the offending field (the HTTP
server turns `InvalidParameterError.param` into OpenAI's `error.param`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional, Union

from serving.core.format_params import ReasoningParams, StructuredOutputsParams, from_request_dict

log = logging.getLogger(__name__)

# The most top-k logprobs a request may ask for (OpenAI allows 20 for
# `top_logprobs`). The step function always produces this many on device when
# any row asks for logprobs, so it is a compile-time constant.
MAX_LOGPROBS = 20


class InvalidParameterError(ValueError):
    """A request parameter is out of range; `param` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


# The fields the sampling-controls part applies on the device, and the value that leaves each off.
CONTROL_FIELDS = {"logit_bias": None, "allowed_token_ids": None, "bad_words": None, "min_tokens": 0,
                  "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}


@dataclasses.dataclass
class SamplingParams:
    """How to sample one request. `temperature=0` is greedy.

    `top_k` of 0 or -1 disables top-k (vLLM accepts both); `max_tokens=None`
    generates up to the model's context window; `seed=None` draws a seed from
    the engine's own generator so the request is still reproducible within one
    engine run.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    include_stop_str_in_output: bool = False
    # Detokenization, as vLLM's: drop special tokens from the text; with them kept, False writes
    # consecutive added tokens with no space between them.
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Constrain the output to a JSON schema, regex, choice or grammar (serving.features.structured_output).
    structured_outputs: Optional[StructuredOutputsParams] = None
    # A reasoning model's think tags and thinking budget (serving.features.reasoning_phase): the budget
    # forces the end tag once spent, and structured_outputs constrain only what follows the end tag.
    reasoning: Optional[ReasoningParams] = None
    # Applied on the device by the sampling-controls part (`serving.features.sampling_controls`; vLLM's definitions):
    presence_penalty: float = 0.0  # subtracted from a token's logit once it is in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of prompt or output tokens
    min_tokens: int = 0  # EOS, stop_token_ids and stop strings cannot end the output before this many tokens
    logit_bias: Optional[dict[int, float]] = None  # token id -> added to its logit
    allowed_token_ids: Optional[list[int]] = None  # only these may be sampled
    bad_words: Optional[list[str]] = None  # words never generated (a word's last token is banned after its prefix)
    # Free-form arguments for the custom logits processors the engine runs (`serving.features.logits_processors`),
    # as vLLM's `extra_args`: string keys, values the processors read; None: none.
    extra_args: Optional[dict] = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            self.logit_bias = dict(self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Raises `InvalidParameterError` naming the first bad field; returns self."""

        def bad(param, message):
            raise InvalidParameterError(param, f"{param}: {message}")

        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x):
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        if not is_int(self.n) or self.n < 1:
            bad("n", f"must be an integer >= 1, got {self.n!r}")
        if not is_num(self.temperature) or not self.temperature >= 0.0 or self.temperature == float("inf"):
            bad("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < -1:
            bad("top_k", f"must be -1 or 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not is_int(self.seed) or not -(2**63) <= self.seed < 2**64):
            bad("seed", f"must be an integer (64-bit), got {self.seed!r}")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens", f"must be an integer >= 1 or None, got {self.max_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                bad(name, f"must be an integer in [0, {MAX_LOGPROBS}] or None, got {v!r}")
        if not all(isinstance(s, str) for s in self.stop):
            bad("stop", f"must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop):
            bad("stop", "stop strings must not be empty")
        for t in self.stop_token_ids:
            if not is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
                bad("stop_token_ids", f"token id {t!r} is not in [0, {vocab_size})")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                bad(name, f"must be a bool, got {getattr(self, name)!r}")
        if self.structured_outputs is not None:
            try:
                self.structured_outputs = from_request_dict(self.structured_outputs)
                self.structured_outputs.kind()
            except (TypeError, ValueError) as e:
                bad("structured_outputs", str(e))
        if self.reasoning is not None:
            if not isinstance(self.reasoning, ReasoningParams):
                bad("reasoning", f"must be a ReasoningParams, got {type(self.reasoning).__name__}")
            try:
                self.reasoning.validate()
            except ValueError as e:
                raise InvalidParameterError("thinking_token_budget" if "budget" in str(e) else "reasoning",
                                            str(e)) from None
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not -2.0 <= v <= 2.0:
                bad(name, f"must be in [-2, 2], got {v!r}")
        rp = self.repetition_penalty
        if not is_num(rp) or not 0.0 < rp < float("inf"):
            bad("repetition_penalty", f"must be a finite number > 0, got {rp!r}")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")

        def token_id(param, t):
            if not is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
                bad(param, f"token id {t!r} is not in [0, {vocab_size})")

        if self.logit_bias is not None:
            for t, b in self.logit_bias.items():
                token_id("logit_bias", t)
                if not is_num(b) or not -100.0 <= b <= 100.0:
                    bad("logit_bias", f"the bias of token {t} must be in [-100, 100], got {b!r}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                bad("allowed_token_ids", "must not be empty")
            for t in self.allowed_token_ids:
                token_id("allowed_token_ids", t)
        if self.bad_words is not None and not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            bad("bad_words", f"must be a list of non-empty strings, got {self.bad_words!r}")
        if self.extra_args is not None and (not isinstance(self.extra_args, dict)
                                            or not all(isinstance(k, str) for k in self.extra_args)):
            bad("extra_args", f"must be an object with string keys, got {self.extra_args!r}")
        return self

    def part_fields(self) -> list[str]:
        """The fields set here that only a step part acts on (`step_parts.StepPart.takes_fields`): an engine
        none of whose parts takes one refuses the request rather than ignore the field."""
        fields = ["extra_args"] if self.extra_args else []
        if self.structured_outputs is not None:
            fields.append("structured_outputs")
        if self.reasoning is not None and self.reasoning.budget is not None:
            fields.append("reasoning")
        return fields + self.control_fields()

    def control_fields(self) -> list[str]:
        """The sampling controls (`CONTROL_FIELDS`) this request turns on: each not at its off value."""
        return [f for f, off in CONTROL_FIELDS.items() if getattr(self, f) not in (off, [], {})]

    def clone(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)


def with_defaults(defaults: dict, source: str = "generation_config.json") -> SamplingParams:
    """SamplingParams whose fields named in `defaults` take those values (a checkpoint's generation
    defaults); a field this sampler does not have is left out, and said so in the log."""
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = sorted(set(defaults) - names)
    if unknown:
        log.warning("%s sets %s, which this sampler does not have; not applied", source, unknown)
    params = SamplingParams(**{k: v for k, v in defaults.items() if k in names})
    try:
        return params.validate()
    except InvalidParameterError as e:
        raise ValueError(f"{source}: {e}") from None
