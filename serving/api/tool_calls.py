"""Tool calling and `response_format`: from the request to structured outputs, and from the
model's text back to OpenAI's `tool_calls`.

What a request asks for becomes at most one `StructuredOutputsParams`:

* `response_format` `{"type": "json_object"}` or `{"type": "json_schema", ...}`,
  or vLLM's `structured_outputs` field, as they are;
* `tool_choice="required"`: a JSON array of one or more calls (one only when
  `parallel_tool_calls` is false), each `{"name": <one of the tools>,
  "parameters": <that function's JSON schema>}`;
* `tool_choice` naming a function: that function's parameters schema; the whole
  output is its arguments.

So forced calls always parse and match their schemas. `tool_choice="auto"` (the
default when tools are given) leaves the model free and reads its calls back
with the server's `--tool_call_parser` (`serving.api.tool_parsers`); `"none"`
returns text. `ToolStream` turns a growing output into OpenAI's stream deltas.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Optional

from serving.api import http_protocol as P
from serving.api.tool_parsers import PARSERS, ToolParser
from serving.api.tool_protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, NamedToolChoice, ToolCall
from serving.core.format_params import StructuredOutputsParams, from_request_dict

_ANY_OBJECT = {"type": "object"}


def structured_outputs(req) -> tuple[Optional[StructuredOutputsParams], Optional[str]]:
    """What `response_format` / `structured_outputs` ask for, and the field that asked (for errors)."""
    asked = []
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            asked.append(("response_format", StructuredOutputsParams(json_object=True)))
        else:
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise P.APIError("response_format: type json_schema needs json_schema.schema", param="response_format",
                                 code="invalid_value")
            asked.append(("response_format", StructuredOutputsParams(json=rf.json_schema.schema_)))
    if getattr(req, "structured_outputs", None) is not None:
        try:
            asked.append(("structured_outputs", from_request_dict(req.structured_outputs)))
        except (TypeError, ValueError) as e:
            raise P.APIError(f"structured_outputs: {e}", param="structured_outputs", code="invalid_value") from None
    if len(asked) > 1:
        raise P.APIError("give either response_format or structured_outputs, not both", param="structured_outputs",
                         code="invalid_value")
    return (asked[0][1], asked[0][0]) if asked else (None, None)


def request_structured_outputs(req, plan: Optional["ToolPlan"] = None) -> Optional[StructuredOutputsParams]:
    """The one `StructuredOutputsParams` of a request: its tool plan's forced call, or what
    `response_format` / `structured_outputs` ask for (not both)."""
    asked, field = structured_outputs(req)
    forced = plan.structured() if plan is not None else None
    if forced is not None and asked is not None:
        raise P.APIError(f"{field} cannot be combined with tool_choice {req.tool_choice!r}, which constrains the "
                         f"output to the tool call", param=field, code="invalid_value")
    return forced or asked


def structured_field(req) -> str:
    """The request field an error of the engine's `structured_outputs` parameter belongs to."""
    choice = getattr(req, "tool_choice", None)
    if getattr(req, "tools", None) and (choice == "required" or isinstance(choice, NamedToolChoice)):
        return "tool_choice"
    rf = getattr(req, "response_format", None)
    return "response_format" if rf is not None and rf.type != "text" else "structured_outputs"


@dataclasses.dataclass
class ToolPlan:
    """How one chat request uses its tools."""

    mode: str  # "none", "auto", "required" or "named"
    tools: Optional[list[dict]] = None  # as the chat template receives them
    function: Optional[str] = None  # the named function
    parser: Optional[ToolParser] = None
    parallel: bool = True
    schema: Optional[dict] = None  # the forced output's JSON schema (required / named)

    def structured(self) -> Optional[StructuredOutputsParams]:
        return None if self.schema is None else StructuredOutputsParams(json=self.schema)

    def calls(self, text: str) -> tuple[Optional[str], list[tuple[str, str]]]:
        """(content, [(name, arguments JSON)]) of a finished output."""
        if self.mode == "named":
            return None, [(self.function, text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:
                return text or None, []  # cut off by max_tokens: no call came out whole
            return None, [(it["name"], json.dumps(it["parameters"], ensure_ascii=False)) for it in items]
        if self.mode == "auto":
            content, calls = self.parser.parse(text)
            return content, calls if self.parallel else calls[:1]
        return text, []


def plan_tools(req: P.ChatCompletionRequest, parser_name: Optional[str]) -> ToolPlan:
    """The request's tools and tool_choice, checked (400s name the field)."""
    tools = req.tools or []
    choice = req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise P.APIError("tool_choice needs tools", param="tool_choice", code="invalid_value")
        return ToolPlan("none")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise P.APIError("tools: function names must be unique", param="tools", code="invalid_value")
    listed = [t.model_dump(exclude_none=True) for t in tools]
    parallel = req.parallel_tool_calls is not False
    params = {t.function.name: t.function.parameters or _ANY_OBJECT for t in tools}
    if choice is None:
        choice = "auto"
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in params:
            raise P.APIError(f"tool_choice: function {choice.function.name!r} is not among the tools ({names})",
                             param="tool_choice", code="invalid_value")
        return ToolPlan("named", listed, choice.function.name, schema=params[choice.function.name])
    if choice == "none":
        return ToolPlan("none", listed)
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"const": n}, "parameters": s},
                  "required": ["name", "parameters"], "additionalProperties": False} for n, s in params.items()]
        schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if not parallel:
            schema["maxItems"] = 1
        return ToolPlan("required", listed, schema=schema, parallel=parallel)
    if choice == "auto":
        if parser_name is None:
            raise P.APIError("tool_choice \"auto\" needs the server started with --tool_call_parser (one of "
                             f"{', '.join(sorted(PARSERS))}); use \"required\" or a named function to force a call",
                             param="tool_choice", code="invalid_value")
        return ToolPlan("auto", listed, parser=PARSERS[parser_name](), parallel=parallel)
    raise P.APIError(f"tool_choice: expected \"none\", \"auto\", \"required\" or a named function, got {choice!r}",
                     param="tool_choice", code="invalid_value")


def template_message(m) -> dict:
    """A history message as chat templates read it: assistant tool calls with their arguments as
    objects (what Llama / Qwen / Mistral templates iterate over), tool results with their call id,
    an assistant's earlier thinking as `reasoning_content` (vLLM's name, which Qwen3's template reads)."""
    out = {"role": m.role, "content": m.text()}
    thinking = getattr(m, "reasoning_content", None) or getattr(m, "reasoning", None)
    if thinking:
        out["reasoning_content"] = thinking
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        calls = []
        for c in m.tool_calls:
            try:
                args = json.loads(c.function.arguments)
            except json.JSONDecodeError:
                args = c.function.arguments
            calls.append({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}})
        out["tool_calls"] = calls
    return out


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_calls_of(calls: list[tuple[str, str]]) -> list[ToolCall]:
    return [ToolCall(id=new_call_id(), function=FunctionCall(name=n, arguments=a)) for n, a in calls]


def finish_reason(reason: Optional[str], has_calls: bool) -> Optional[str]:
    return "tool_calls" if has_calls and reason == "stop" else reason


# --- streaming -------------------------------------------------------------------------------

def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _scan_string(text: str, i: int) -> Optional[int]:
    """The index after the JSON string starting at text[i] == '"', or None if it is not closed yet."""
    i += 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == '"':
            return i + 1
        i += 1
    return None


def _scan_value(text: str, i: int) -> tuple[int, bool]:
    """(end, complete) of the JSON value starting at text[i]: its end so far if the text stops inside it."""
    if i < len(text) and text[i] == '"':
        end = _scan_string(text, i)
        return (len(text), False) if end is None else (end, True)
    depth, j = 0, i
    while j < len(text):
        ch = text[j]
        if ch == '"':
            end = _scan_string(text, j)
            if end is None:
                return len(text), False
            j = end
            continue
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            if depth == 0:
                return j, True  # a scalar ended by its container
            depth -= 1
            if depth == 0:
                return j + 1, True
        elif depth == 0 and ch in ", \t\r\n":
            return j, True
        j += 1
    return len(text), False


def scan_required(text: str) -> list[list]:
    """[[name or None, arguments text so far]] of each call begun in a prefix of the "required" array."""
    calls: list[list] = []
    i = _skip_ws(text, 0)
    if i >= len(text) or text[i] != "[":
        return calls
    i += 1
    while True:
        i = _skip_ws(text, i)
        if i < len(text) and text[i] == ",":
            i = _skip_ws(text, i + 1)
        if i >= len(text) or text[i] != "{":
            return calls
        call = [None, ""]
        calls.append(call)
        i += 1
        while True:
            i = _skip_ws(text, i)
            if i < len(text) and text[i] == ",":
                i = _skip_ws(text, i + 1)
            if i >= len(text):
                return calls
            if text[i] == "}":
                i += 1
                break
            key_end = _scan_string(text, i) if text[i] == '"' else None
            if key_end is None:
                return calls
            key = json.loads(text[i:key_end])
            i = _skip_ws(text, key_end)
            if i >= len(text) or text[i] != ":":
                return calls
            i = _skip_ws(text, i + 1)
            if i >= len(text):
                return calls
            end, complete = _scan_value(text, i)
            if key == "name":
                if not complete:
                    return calls
                call[0] = json.loads(text[i:end])
            elif key == "parameters":
                call[1] = text[i:end]
            if not complete:
                return calls
            i = end


class ToolStream:
    """One choice's stream under a tool plan: `step(text, finished)` -> (content delta, tool-call deltas)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.sent_content = 0
        self.ids: list[str] = []  # call index -> id (its header sent)
        self.sent_args: list[int] = []
        self.has_calls = False

    def _call_deltas(self, progress: list[list]) -> list[DeltaToolCall]:
        out = []
        for k, (name, args) in enumerate(progress):
            if name is None:
                break  # calls come out in order: wait for this one's name
            if k == len(self.ids):
                self.ids.append(new_call_id())
                self.sent_args.append(0)
                out.append(DeltaToolCall(index=k, id=self.ids[k], type="function",
                                         function=DeltaFunctionCall(name=name, arguments="")))
            if len(args) > self.sent_args[k]:
                out.append(DeltaToolCall(index=k, function=DeltaFunctionCall(arguments=args[self.sent_args[k]:])))
                self.sent_args[k] = len(args)
        self.has_calls = self.has_calls or bool(self.ids)
        return out

    def step(self, text: str, finished: bool) -> tuple[str, list[DeltaToolCall]]:
        mode = self.plan.mode
        if mode == "named":
            return "", self._call_deltas([[self.plan.function, text]])
        if mode == "required":
            return "", self._call_deltas(scan_required(text))
        # auto: content up to where a call may begin; the calls themselves once the output is complete
        if not finished:
            end = self.plan.parser.may_start(text)
            delta = text[self.sent_content:end] if end > self.sent_content else ""
            self.sent_content = max(self.sent_content, end)
            return delta, []
        content, calls = self.plan.calls(text)
        if not calls:
            delta, self.sent_content = text[self.sent_content:], len(text)
            return delta, []
        head = content or ""
        delta = head[self.sent_content:] if len(head) > self.sent_content else ""
        return delta, self._call_deltas([[n, a] for n, a in calls])
