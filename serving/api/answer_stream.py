"""A streamed answer, cut into what may be sent now: the text delta, and with a reasoning parser or
tools, the thinking and the tool calls apart from the content.

Every streaming route (chat completions, completions, /v1/responses, /v1/messages) turns the
engine's cumulative outputs into deltas through `DeltaTracker`; the two agent routes, which stream one
choice each, take the whole split from `AnswerStream`.
"""

from __future__ import annotations

from serving.api import reasoning as R
from serving.api import tool_calls as T


class DeltaTracker:
    """Turns cumulative outputs into stream deltas for one choice.

    The engine already withholds text that may still change (an incomplete
    UTF-8 character, a tail that could begin a stop string), so its text only
    grows; as a second line of defence a trailing U+FFFD is not sent before
    the finish, since a sent character can never be taken back.
    """

    def __init__(self):
        self.sent_text = 0
        self.sent_tokens = 0
        self.logprob_offset = 0  # text_offset of the next token in the completions logprobs layout

    def step(self, text: str, num_tokens: int, finished: bool) -> tuple[str, int, int]:
        end = len(text)
        if not finished:
            while end > self.sent_text and text[end - 1] == "\ufffd":
                end -= 1
        delta = text[self.sent_text:end]
        first_tok, self.sent_tokens = self.sent_tokens, num_tokens
        self.sent_text = max(self.sent_text, end)
        return delta, first_tok, num_tokens


class AnswerStream:
    """One choice's answer as it streams: `step` gives what is new since the last call as (thinking,
    content delta, tool calls), each text held back while it may still be a think tag or a tool call."""

    def __init__(self, reasoning: "R.ReasoningFormat | None", starts: str | None, plan: "T.ToolPlan | None"):
        self.tracker = DeltaTracker()
        self.splitter = R.ReasoningStream(reasoning, starts) if starts is not None else None
        self.tools = T.ToolStream(plan) if plan is not None and plan.mode != "none" else None

    @property
    def has_calls(self) -> bool:
        """Whether the answer has made a tool call so far."""
        return self.tools is not None and self.tools.has_calls

    def step(self, text: str, num_tokens: int, finished: bool) -> tuple[str, str, list]:
        delta, _, _ = self.tracker.step(text, num_tokens, finished)
        text, thinking, calls = text[:self.tracker.sent_text], "", []
        if self.splitter is not None:
            thinking, delta = self.splitter.step(text, finished)
            text = self.splitter.content
        if self.tools is not None:
            delta, calls = self.tools.step(text, finished)
        return thinking, delta, calls
