"""The request parameters that constrain the form of an output: structured outputs (a JSON schema,
regex, choice or grammar) and a reasoning model's think tags and thinking budget.

They are data a request carries in its `SamplingParams`, validated with it; what enforces them (the
grammar's token masks, the thinking phase) is a step part of `serving.features.structured_output`, which
an engine without it refuses such requests for.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

# The keys of `StructuredOutputsParams` that say what to constrain to; exactly one is given.
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclasses.dataclass
class StructuredOutputsParams:
    """What a request's output must match (vLLM's `structured_outputs` fields).

    json: a JSON schema (dict or its JSON text); json_object: any JSON object; regex: a regular
    expression the whole output matches; choice: one of these strings; grammar: a Lark grammar
    (llguidance's dialect) or a GBNF one. `whitespace`: let JSON grammars put free whitespace between
    tokens (None: the engine's `structured_outputs_whitespace` option).
    """

    json: Optional[Union[dict, str]] = None
    json_object: Optional[bool] = None
    regex: Optional[str] = None
    choice: Optional[list] = None
    grammar: Optional[str] = None
    whitespace: Optional[bool] = None

    def kind(self) -> str:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(KINDS)}; got {given or 'none'}")
        return given[0]


def from_request_dict(value: Any) -> StructuredOutputsParams:
    """`StructuredOutputsParams` from a dict of its fields (as the HTTP API and `LLM` callers give it)."""
    if isinstance(value, StructuredOutputsParams):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"must be an object with one of {', '.join(KINDS)}, got {type(value).__name__}")
    fields = {f.name for f in dataclasses.fields(StructuredOutputsParams)}
    unknown = sorted(set(value) - fields)
    if unknown:
        raise ValueError(f"unknown keys {unknown} (it takes {', '.join(sorted(fields))})")
    return StructuredOutputsParams(**value)


# Where the output starts: inside a think block the prompt opened, or free to open one.
STARTS = ("thinking", "undecided")


@dataclasses.dataclass
class ReasoningParams:
    """The think tags of a request (as token ids) and its thinking budget.

    `starts`: "thinking" when the prompt already opened the block (DeepSeek-R1 templates, or
    Qwen3's when its generation prompt writes `<think>`); "undecided" when the model may open one
    itself (the block then counts only if the output begins with `start_ids`). `budget`: the most
    thinking tokens before the end tag is forced (None: no limit).
    """

    start_ids: list
    end_ids: list
    starts: str = "thinking"
    budget: Optional[int] = None

    def validate(self) -> None:
        if not self.end_ids or not all(isinstance(t, int) for t in self.end_ids):
            raise ValueError("reasoning: end_ids must be a non-empty list of token ids")
        if self.starts not in STARTS:
            raise ValueError(f"reasoning: starts must be one of {STARTS}, got {self.starts!r}")
        if self.starts == "undecided" and not self.start_ids:
            raise ValueError("reasoning: an undecided start needs start_ids")
        if self.budget is not None and (not isinstance(self.budget, int) or isinstance(self.budget, bool)
                                        or self.budget < 0):
            raise ValueError(f"thinking_token_budget: must be an integer >= 0, got {self.budget!r}")
