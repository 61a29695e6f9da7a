"""The request of Anthropic's Messages API (`POST /v1/messages`), checked, and turned into a chat.

As for the Responses API, a Messages request is a chat in another shape:
`system` is the system message; `messages` hold content blocks (`text`;
an assistant's `tool_use` blocks become its tool calls, a user's
`tool_result` blocks the tool messages answering them, and its earlier
`thinking` blocks its `reasoning_content`, which the template shows or drops); `tools` are name / description / `input_schema`; `thinking`
sets the thinking budget (`enabled` with `budget_tokens`) or switches
thinking off in the template (`disabled`: `enable_thinking` false). So the
route builds the equivalent `ChatCompletionRequest` and runs the chat
route's machinery.

Every field of Anthropic's request schema is honoured here or refused with
a 400 naming it; unknown fields are refused too.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from serving.api import http_protocol as P

# Anthropic's fields this server does not implement, and the values of them that ask for nothing.
_REFUSED_UNLESS = {
    "container": (None,), "mcp_servers": (None, []), "context_management": (None,), "diagnostics": (None,),
    "inference_geo": (None,), "speed": (None, "standard"), "user_profile_id": (None,), "workspace_id": (None,),
}
# Bookkeeping and hints with nothing to do here: prompt caching is automatic (prefix caching), so
# `cache_control` asks for what is done anyway; the tier and the end user's id change nothing.
_HINTS = ("service_tier", "cache_control")
EFFORTS = ("low", "medium", "high")


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: Optional[Union[str, list[dict[str, Any]]]] = None
    stop_sequences: Optional[list[str]] = None
    stream: bool = False
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[dict[str, Any]] = None
    thinking: Optional[dict[str, Any]] = None
    metadata: Optional[dict[str, Any]] = None
    output_config: Optional[dict[str, Any]] = None
    # Extensions (vLLM's names), for what the Messages schema has no field for:
    seed: Optional[int] = None
    ignore_eos: bool = False


def _bad(message: str, param: str, code: str = "invalid_value") -> P.APIError:
    return P.APIError(message, param=param, code=code)


def check_fields(req: MessagesRequest) -> None:
    for name, value in (req.model_extra or {}).items():
        if name in _HINTS or (name in _REFUSED_UNLESS and value in _REFUSED_UNLESS[name]):
            continue
        why = "is not supported by this server" if name in _REFUSED_UNLESS else "is not a field of this API"
        raise _bad(f"{name}: {why}", name, "unsupported_parameter")
    if req.metadata:
        unknown = sorted(set(req.metadata) - {"user_id"})
        if unknown:
            raise _bad(f"metadata.{unknown[0]}: unknown field (metadata takes user_id)", "metadata")
    if req.output_config:
        unknown = sorted(k for k, v in req.output_config.items() if k not in ("format", "effort") and v is not None)
        if unknown:
            raise _bad(f"output_config.{unknown[0]} is not supported", f"output_config.{unknown[0]}",
                       "unsupported_parameter")
        effort = req.output_config.get("effort")
        if effort is not None and effort not in EFFORTS:
            raise _bad(f"output_config.effort: expected one of {', '.join(EFFORTS)}, got {effort!r}",
                       "output_config.effort", "unsupported_parameter")


def _blocks(content, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of content blocks", "messages")
    for j, block in enumerate(content):
        if not isinstance(block, dict) or "type" not in block:
            raise _bad(f"{where}.content[{j}] must be a content block with a type", "messages")
    return content


def _text(blocks, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    out = []
    for j, block in enumerate(_blocks(blocks, where)):
        if block["type"] != "text":
            raise _bad(f"{where}.content[{j}]: blocks of type {block['type']!r} are not supported here (text only)",
                       "messages", "unsupported_parameter")
        out.append(str(block.get("text", "")))
    return "".join(out)


def chat_messages(req: MessagesRequest) -> list[dict]:
    """The chat messages (as `ChatMessage` takes them) of a Messages request."""
    out: list[dict] = []
    if req.system:
        out.append({"role": "system", "content": _text(req.system, "system")})
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise _bad(f"{where}.role: expected user or assistant, got {role!r}", "messages")
        text, calls, thinking = [], [], []
        for j, block in enumerate(_blocks(m.get("content", ""), where)):
            kind = block["type"]
            if kind == "text":
                text.append(str(block.get("text", "")))
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise _bad(f"{where}.content[{j}]: tool_use needs an id and a name", "messages")
                calls.append({"id": block["id"], "type": "function", "function": {
                    "name": block["name"], "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
            elif kind == "tool_result" and role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise _bad(f"{where}.content[{j}]: tool_result needs a tool_use_id", "messages")
                result = _text(block.get("content", ""), f"{where}.content[{j}]")
                if block.get("is_error"):
                    result = f"Error: {result}"
                out.append({"role": "tool", "content": result, "tool_call_id": block["tool_use_id"]})
            elif kind == "thinking" and role == "assistant":
                thinking.append(str(block.get("thinking", "")))  # the template decides whether to show it
            elif kind == "redacted_thinking" and role == "assistant":
                continue  # encrypted by another server: nothing to read
            else:
                raise _bad(f"{where}.content[{j}]: {role} blocks of type {kind!r} are not supported (text, "
                           "tool_use, tool_result, thinking)", "messages", "unsupported_parameter")
        if text or calls or not any(b.get("type") == "tool_result" for b in _blocks(m.get("content", ""), where)):
            message = {"role": role, "content": "".join(text)}
            if calls:
                message["tool_calls"] = calls
            if thinking:
                message["reasoning_content"] = "".join(thinking)
            out.append(message)
    return out


def chat_tools(req: MessagesRequest) -> tuple[Optional[list[dict]], Any, Optional[bool]]:
    """(tools, tool_choice, parallel_tool_calls) in the chat shape."""
    tools = None
    if req.tools:
        tools = []
        for i, t in enumerate(req.tools):
            if t.get("type", "custom") != "custom" or not isinstance(t.get("name"), str):
                raise _bad(f"tools[{i}]: only custom tools (name, description, input_schema) are supported, got "
                           f"type {t.get('type')!r}", "tools", "unsupported_parameter")
            unknown = sorted(k for k in set(t) - {"type", "name", "description", "input_schema", "cache_control"}
                             if t[k] is not None)
            if unknown:
                raise _bad(f"tools[{i}].{unknown[0]} is not supported (a custom tool takes name, description, "
                           "input_schema)", "tools", "unsupported_parameter")
            tools.append({"type": "function", "function": {
                "name": t["name"], "description": t.get("description"),
                "parameters": t.get("input_schema") or {"type": "object"}}})
    choice, parallel = req.tool_choice, None
    if choice is None:
        return tools, None, None
    kind = choice.get("type")
    if choice.get("disable_parallel_tool_use"):
        parallel = False
    if kind == "auto":
        return tools, "auto", parallel
    if kind == "any":
        return tools, "required", parallel
    if kind == "none":
        return tools, "none", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return tools, {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise _bad(f"tool_choice: expected auto, any, tool (with a name) or none, got {choice!r}", "tool_choice")


def chat_request(req: MessagesRequest) -> tuple[P.ChatCompletionRequest, bool]:
    """(the equivalent chat request, whether thinking blocks are shown)."""
    tools, choice, parallel = chat_tools(req)
    thinking = req.thinking or {}
    kind = thinking.get("type")
    budget, template_kwargs, shown = None, None, thinking.get("display") != "omitted"
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise _bad(f"thinking.budget_tokens must be an integer >= 0, got {budget!r}", "thinking.budget_tokens")
    elif kind == "disabled":
        template_kwargs = {"enable_thinking": False}
    elif kind not in (None, "adaptive"):
        raise _bad(f"thinking.type: expected enabled, disabled or adaptive, got {kind!r}", "thinking.type")
    fmt = (req.output_config or {}).get("format")
    response_format = None
    if fmt is not None:
        if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise _bad("output_config.format: expected {\"type\": \"json_schema\", \"schema\": {...}}",
                       "output_config.format")
        response_format = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    try:
        chat = P.ChatCompletionRequest(
            model=req.model, messages=chat_messages(req), max_tokens=req.max_tokens, temperature=req.temperature,
            top_p=req.top_p, top_k=req.top_k, stop=req.stop_sequences, seed=req.seed, ignore_eos=req.ignore_eos,
            tools=tools, tool_choice=choice, parallel_tool_calls=parallel, response_format=response_format, thinking_token_budget=budget,
            reasoning_effort=(req.output_config or {}).get("effort") if budget is None else None,
            chat_template_kwargs=template_kwargs)
    except ValueError as e:
        raise _bad(f"invalid request: {str(e).splitlines()[0]}", "messages") from None
    return chat, shown
