"""Reasoning outputs: the model's thinking apart from its answer (`--reasoning_parser`).

A reasoning model writes its thinking between two tags (`<think>` and
`</think>` for Qwen3 and DeepSeek-R1) and then its answer. The server's
parser names the tags and where thinking starts:

* `qwen3` (also Qwen3-MoE): the model opens the block itself, unless the
  chat template's generation prompt already did (Qwen3-2507 thinking models)
  or closed it (`chat_template_kwargs: {"enable_thinking": false}` writes an
  empty block into the prompt);
* `deepseek_r1`: the output starts inside the block, whether or not the
  model writes the opening tag;
* `auto`: the tags are read from the tokenizer (an added `<think>` / `</think>`
  pair, or the pair the chat template writes) and where thinking starts from
  the template's generation prompt, as for qwen3.

`ReasoningStream` splits a growing output into reasoning and content
deltas. It holds back text that may be the beginning of a tag, so a tag split
across tokens or stream chunks never leaks into either part; the non-streamed
answer runs the same splitter over the whole text, so the two always agree.

The engine enforces the same boundaries on tokens (`serving.features.reasoning_phase`):
a thinking budget forces the end tag, and a grammar applies from the end tag on.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from serving.api import http_protocol as P
from serving.core.format_params import ReasoningParams

PARSER_NAMES = ("auto", "deepseek_r1", "qwen3")
# Tag pairs the `auto` parser looks for in the tokenizer's vocabulary and the chat template, in order.
KNOWN_TAGS = (("<think>", "</think>"), ("<thinking>", "</thinking>"), ("<|begin_of_thought|>", "<|end_of_thought|>"))

# `reasoning_effort` -> the thinking budget: at most this many tokens, and at most this share of the
# request's max_tokens (so the answer always keeps the rest). "none" closes thinking at once.
EFFORT_BUDGETS = {"none": (0, 0.0), "minimal": (128, 0.25), "low": (1024, 0.25), "medium": (4096, 0.5),
                  "high": (16384, 0.75)}


@dataclasses.dataclass
class ReasoningFormat:
    """A model's think tags (text and token ids) and where its output starts by default."""

    name: str
    start: str
    end: str
    start_ids: list
    end_ids: list
    default_start: str  # "thinking" or "undecided"

    def starts(self, generation_prompt: str) -> str:
        """Where the output of a prompt whose generation prompt (the text the template adds after the
        conversation) is `generation_prompt` starts: "thinking", "undecided", or "answer" (closed)."""
        opened, closed = generation_prompt.rfind(self.start), generation_prompt.rfind(self.end)
        if closed >= 0 and closed >= opened:
            return "answer"
        if opened >= 0:
            return "thinking"
        return self.default_start

    def engine_params(self, starts: str, budget: Optional[int]) -> Optional[ReasoningParams]:
        """What the engine enforces for an output that starts as `starts` (None when it has no thinking)."""
        if starts == "answer":
            return None
        return ReasoningParams(list(self.start_ids), list(self.end_ids), starts, budget)


def _tags_from_tokenizer(tokenizer) -> Optional[tuple[str, str]]:
    template = getattr(tokenizer, "chat_template", None) or ""
    for start, end in KNOWN_TAGS:
        ids = [tokenizer.encode(t, add_special_tokens=False) for t in (start, end)]
        if all(len(i) == 1 for i in ids) or (start in template and end in template):
            return start, end
    return None


def make_format(name: Optional[str], tokenizer) -> Optional[ReasoningFormat]:
    """The server's reasoning format for `--reasoning_parser name` (None: no parsing). ValueError for an
    unknown name, a model without a tokenizer, or `auto` on a tokenizer without think tags."""
    if name is None:
        return None
    if name not in PARSER_NAMES:
        raise ValueError(f"unknown --reasoning_parser {name!r}; expected one of {', '.join(PARSER_NAMES)}")
    if tokenizer is None:
        raise ValueError("--reasoning_parser needs the model's tokenizer; this model has none")
    if name == "auto":
        tags = _tags_from_tokenizer(tokenizer)
        if tags is None:
            raise ValueError("--reasoning_parser auto: the tokenizer has no think tags (looked for "
                             f"{', '.join(s + ' ' + e for s, e in KNOWN_TAGS)}); name the model's parser instead")
    else:
        tags = ("<think>", "</think>")
    start_ids, end_ids = (tokenizer.encode(t, add_special_tokens=False) for t in tags)
    special = set(getattr(tokenizer, "special_ids", ()) or ())
    if special & set(start_ids + end_ids):
        raise ValueError(f"--reasoning_parser {name}: the think tags {tags} are special tokens of this tokenizer, "
                         "so they are dropped from the text; they must be ordinary (added) tokens")
    default = "thinking" if name == "deepseek_r1" else "undecided"
    return ReasoningFormat(name, tags[0], tags[1], start_ids, end_ids, default)


def _held(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `tag`."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ReasoningStream:
    """One output's text, split as it grows: `step(text, finished)` -> (reasoning delta, content delta).

    `text` is the whole output so far (it only grows); phases: "undecided" (the output may open a
    block: leading whitespace and a beginning of the start tag are held), "thinking" (up to the end
    tag; a leading start tag is dropped), "answer" (everything; whitespace right after the end tag
    is dropped).
    """

    def __init__(self, fmt: ReasoningFormat, starts: str):
        self.fmt = fmt
        self.phase = starts
        self.pos = 0  # how much of the text is decided
        self.reasoning = ""
        self.content = ""
        self.entered = starts == "thinking"  # whether the output has a think block
        self._fresh = True  # nothing of the current phase consumed yet
        self._after_end = False  # content right after an end tag: its leading whitespace is dropped

    def step(self, text: str, finished: bool = False) -> tuple[str, str]:
        r0, c0 = len(self.reasoning), len(self.content)
        while self.pos < len(text):
            rest = text[self.pos:]
            if self.phase == "undecided":
                stripped = rest.lstrip()
                if stripped.startswith(self.fmt.start):
                    self.pos += len(rest) - len(stripped) + len(self.fmt.start)
                    self.phase, self._fresh, self.entered = "thinking", False, True
                    continue
                if not finished and (not stripped or self.fmt.start.startswith(stripped)):
                    break  # may still become the start tag
                self.phase = "answer"
                continue
            if self.phase == "thinking":
                if self._fresh:  # a model that writes the start tag the prompt already opened
                    stripped = rest.lstrip()
                    if stripped.startswith(self.fmt.start):
                        self.pos += len(rest) - len(stripped) + len(self.fmt.start)
                        self._fresh = False
                        continue
                    if not finished and (not stripped or self.fmt.start.startswith(stripped)):
                        break
                    self._fresh = False
                end = rest.find(self.fmt.end)
                if end >= 0:
                    self.reasoning += rest[:end]
                    self.pos += end + len(self.fmt.end)
                    self.phase, self._after_end = "answer", True
                    continue
                keep = 0 if finished else _held(rest, self.fmt.end)
                self.reasoning += rest[:len(rest) - keep]
                self.pos += len(rest) - keep
                break
            # answer
            if self._after_end:
                stripped = rest.lstrip()
                self.pos += len(rest) - len(stripped)
                if not stripped:
                    break
                self._after_end = False
                continue
            self.content += rest
            self.pos = len(text)
        return self.reasoning[r0:], self.content[c0:]


def split(fmt: ReasoningFormat, starts: str, text: str) -> tuple[Optional[str], str]:
    """(reasoning or None, content) of a finished output."""
    s = ReasoningStream(fmt, starts)
    s.step(text, finished=True)
    return (s.reasoning if s.entered else None), s.content


def thinking_budget(req, fmt: Optional[ReasoningFormat], max_tokens: Optional[int]) -> Optional[int]:
    """The request's thinking budget: `thinking_token_budget`, else `reasoning_effort`'s share
    (`EFFORT_BUDGETS`); None without either. A 400 when the server has no reasoning parser."""
    budget = getattr(req, "thinking_token_budget", None)
    effort = getattr(req, "reasoning_effort", None)
    for field, value in (("thinking_token_budget", budget), ("reasoning_effort", effort)):
        if value is not None and fmt is None:
            raise P.APIError(f"{field} needs a reasoning model: start the server with --reasoning_parser",
                             param=field, code="unsupported_parameter")
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise P.APIError(f"thinking_token_budget: must be an integer >= 0, got {budget!r}",
                             param="thinking_token_budget", code="invalid_value")
        return budget
    if effort is None:
        return None
    if effort not in EFFORT_BUDGETS:
        raise P.APIError(f"reasoning_effort: expected one of {', '.join(EFFORT_BUDGETS)}, got {effort!r}",
                         param="reasoning_effort", code="invalid_value")
    most, share = EFFORT_BUDGETS[effort]
    return most if max_tokens is None else min(most, int(max_tokens * share))
