"""Tool-call parsers: a model's raw text -> (content, tool calls), one parser per output format.

A model that chooses a tool itself (`tool_choice="auto"`) writes the call in the
format its chat template taught it; the server is told which one with
`--tool_call_parser` (as vLLM's `--tool-call-parser`):

* `llama3_json` (Llama 3.1 / 3.2 / 3.3): the whole message is a JSON object
  `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`;
  several calls are separated by `;`.
* `hermes` (Hermes, Qwen 2.5 / 3): text, then one `<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>` block per call.
* `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` objects,
  or (newer tokenizers) `[TOOL_CALLS]name[ARGS]{...}` per call.

`parse(text)` returns the text before the calls (None if empty) and the calls as
(name, arguments JSON text); text without a well-formed call is all content.
`marker` is where a call may begin, so a stream can hold back text that might
still turn into one (`may_start`).
"""

from __future__ import annotations

import json
import re
from typing import Optional

ToolCall = tuple[str, str]  # (function name, arguments as JSON text)


def _call_from(obj, args_keys=("arguments", "parameters")) -> Optional[ToolCall]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def _json_values(text: str) -> Optional[list]:
    """The JSON values in `text`, one after another (whitespace and `;` between them), or None."""
    dec = json.JSONDecoder()
    out, i = [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i == len(text):
            return out
        try:
            value, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        out.append(value)


class ToolParser:
    name = ""
    marker = ""

    def parse(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        raise NotImplementedError

    def may_start(self, text: str) -> int:
        """Where in `text` a tool call has begun or may still begin (len(text) if nowhere): the
        text before that index is content for certain."""
        i = text.find(self.marker)
        if i >= 0:
            return i
        for k in range(min(len(self.marker) - 1, len(text)), 0, -1):  # a marker cut off at the end
            if self.marker.startswith(text[-k:]):
                return len(text) - k
        return len(text)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    marker = "<|python_tag|>"

    def parse(self, text):
        body = text.strip()
        if body.startswith(self.marker):
            body = body[len(self.marker):]
        if not body.lstrip().startswith("{"):
            return text or None, []
        values = _json_values(body)
        calls = [_call_from(v) for v in values] if values else []
        if not calls or any(c is None for c in calls):
            return text or None, []
        return None, calls

    def may_start(self, text):
        stripped = text.lstrip()
        if not stripped or stripped.startswith("{") or self.marker.startswith(stripped[:len(self.marker)]):
            return 0  # the whole message may be a call
        return len(text)


class HermesParser(ToolParser):
    name = "hermes"
    marker = "<tool_call>"
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)

    def parse(self, text):
        start = text.find(self.marker)
        if start < 0:
            return text or None, []
        calls = []
        for body in self._block.findall(text[start:]):
            values = _json_values(body.strip())
            if not values or len(values) != 1 or _call_from(values[0]) is None:
                return text or None, []
            calls.append(_call_from(values[0]))
        return text[:start].strip() or None, calls


class MistralParser(ToolParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"

    def parse(self, text):
        start = text.find(self.marker)
        if start < 0:
            return text or None, []
        content = text[:start].strip() or None
        body = text[start + len(self.marker):].strip()
        if body.startswith("["):  # a JSON list of calls
            values = _json_values(body)
            if not values or len(values) != 1 or not isinstance(values[0], list):
                return text or None, []
            calls = [_call_from(v) for v in values[0]]
        else:  # name[ARGS]{...}, repeated after further [TOOL_CALLS] markers
            calls = []
            for part in body.split(self.marker):
                name, sep, args = part.partition("[ARGS]")
                values = _json_values(args.strip()) if sep else None
                if not values or len(values) != 1:
                    return text or None, []
                calls.append(_call_from({"name": name.strip(), "arguments": values[0]}))
        if not calls or any(c is None for c in calls):
            return text or None, []
        return content, calls


PARSERS = {p.name: p for p in (Llama3JsonParser, HermesParser, MistralParser)}


def get_parser(name: Optional[str]) -> Optional[ToolParser]:
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()
