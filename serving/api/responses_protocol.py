"""The request of OpenAI's Responses API (`POST /v1/responses`), checked, and turned into a chat.

A Responses request is a chat in another shape: `instructions` is the system
message, `input` a string or a list of items (messages with text parts, the
model's earlier `function_call`s and the client's `function_call_output`s),
`tools` flat function definitions, `text.format` the response format. So the
route builds the equivalent `ChatCompletionRequest` and runs it through the
chat route's machinery (template, tool plan, reasoning, sampling), and nothing
is implemented twice.

Every field of OpenAI's request schema is either honoured here or refused
with a 400 naming it (`check_fields`); fields that are not OpenAI's are refused
too, except the extensions declared below, since on this route nothing a
client sends may be silently dropped.
"""

from __future__ import annotations

import base64
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict

from serving.api import http_protocol as P

# OpenAI's fields this server does not implement, and the values of them that ask for nothing.
_REFUSED_UNLESS = {
    "background": (None, False), "max_tool_calls": (None,), "conversation": (None,),
    "prompt": (None,), "top_logprobs": (None, 0), "context_management": (None, []), "moderation": (None,),
    "image": (None,), "access_programs": (None,), "background_options": (None,), "prompt_cache_options": (None,),
    "prompt_cache_retention": (None,), "truncation": (None, "disabled"), "service_tier": (None, "auto", "default"),
    "stream_options": (None, {}, {"include_obfuscation": False}, {"include_obfuscation": True}),
}
INCLUDABLE = ("reasoning.encrypted_content",)
# Hints for the provider's own bookkeeping or routing: nothing to do with them.
_HINTS = ("user", "safety_identifier", "prompt_cache_key")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]] = ""
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[dict[str, Any]] = None
    reasoning: Optional[dict[str, Any]] = None
    metadata: Optional[dict[str, str]] = None
    store: Optional[bool] = True
    previous_response_id: Optional[str] = None
    stream: bool = False
    # "reasoning.encrypted_content": reasoning items carry their text as an opaque string a stateless
    # client passes back (base64 of the text: nothing secret, the client has the text anyway).
    include: Optional[list[str]] = None
    # Extensions (vLLM's names), for what the Responses schema has no field for:
    seed: Optional[int] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    ignore_eos: bool = False
    thinking_token_budget: Optional[int] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


def check_fields(req: ResponsesRequest) -> None:
    for name, value in (req.model_extra or {}).items():
        if name in _HINTS or (name in _REFUSED_UNLESS and _is_no_op(value, _REFUSED_UNLESS[name])):
            continue
        why = "is not supported by this server" if name in _REFUSED_UNLESS else "is not a field of this API"
        if name == "background":
            why = "is not supported: this server answers every response in the request that makes it"
        raise P.APIError(f"`{name}` {why}", param=name, code="unsupported_parameter")
    for value in req.include or []:
        if value not in INCLUDABLE:
            raise P.APIError(f"include: {value!r} is not supported (this server can include "
                             f"{', '.join(INCLUDABLE)})", param="include", code="unsupported_parameter")
    if req.reasoning:
        unknown = sorted(k for k, v in req.reasoning.items() if k != "effort" and v is not None)
        if unknown:
            raise P.APIError(f"reasoning.{unknown[0]} is not supported (reasoning takes effort); the reasoning "
                             "itself comes back as a reasoning item", param=f"reasoning.{unknown[0]}",
                             code="unsupported_parameter")
    if req.text:
        unknown = sorted(k for k, v in req.text.items() if k != "format" and not (k == "verbosity" and v in
                                                                                    (None, "medium")))
        if unknown:
            raise P.APIError(f"text.{unknown[0]} is not supported", param=f"text.{unknown[0]}",
                             code="unsupported_parameter")


def _is_no_op(value, allowed) -> bool:
    return any(value == a and type(value) is type(a) for a in allowed)


# --- input items -> chat messages --------------------------------------------------------------------

def _text_of(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise P.APIError(f"{where}.content must be a string or a list of parts", param="input", code="invalid_value")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            out.append(str(part.get("text", "")))
        elif kind == "refusal":
            out.append(str(part.get("refusal", "")))
        else:
            raise P.APIError(f"{where}.content[{j}]: parts of type {kind!r} are not supported (this model reads "
                             "text: input_text / output_text)", param="input", code="unsupported_parameter")
    return "".join(out)


def _reasoning_text(item: dict) -> str:
    """A reasoning item's thinking: its reasoning_text parts, else the opaque copy this server put in
    `encrypted_content` (base64 of the text), else its summary."""
    parts = [p.get("text", "") for p in item.get("content") or [] if isinstance(p, dict)]
    if parts:
        return "".join(parts)
    if isinstance(item.get("encrypted_content"), str):
        try:
            return base64.b64decode(item["encrypted_content"], validate=True).decode("utf-8")
        except (ValueError, UnicodeDecodeError):
            pass  # not this server's: nothing to read
    return "".join(p.get("text", "") for p in item.get("summary") or [] if isinstance(p, dict))


def input_messages(items) -> list[dict]:
    """Chat messages (as `ChatMessage` takes them) of a Responses `input`."""
    if isinstance(items, str):
        if not items:
            raise P.APIError("input must not be empty", param="input", code="invalid_value")
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    thinking: list[str] = []  # reasoning items waiting for the assistant turn they belong to

    def assistant(message: dict) -> dict:
        if thinking:
            message["reasoning_content"] = "".join(thinking)
            thinking.clear()
        return message

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise P.APIError(f"{where} must be an object", param="input", code="invalid_value")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise P.APIError(f"{where}.role: expected user, system, developer or assistant, got {role!r}",
                                 param="input", code="invalid_value")
            message = {"role": role, "content": _text_of(item.get("content", ""), where)}
            messages.append(assistant(message) if role == "assistant" else message)
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise P.APIError(f"{where}.{key} must be a string", param="input", code="invalid_value")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not thinking:  # one turn's text and calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append(assistant({"role": "assistant", "content": "", "tool_calls": [call]}))
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise P.APIError(f"{where}.call_id must be a string", param="input", code="invalid_value")
            output = item.get("output", "")
            text = output if isinstance(output, str) else _text_of(output, where)
            messages.append({"role": "tool", "content": text, "tool_call_id": item["call_id"]})
        elif kind == "reasoning":
            thinking.append(_reasoning_text(item))  # goes with the assistant turn that follows
        else:
            raise P.APIError(f"{where}: items of type {kind!r} are not supported (this server takes message, "
                             "function_call, function_call_output and reasoning items)", param="input",
                             code="unsupported_parameter")
    return messages


def chat_tools(req: ResponsesRequest) -> tuple[Optional[list[dict]], Any]:
    """The request's tools and tool_choice in the chat shape; other tool types are a 400."""
    tools = None
    if req.tools:
        tools = []
        for i, t in enumerate(req.tools):
            if t.get("type") != "function":
                raise P.APIError(f"tools[{i}]: tools of type {t.get('type')!r} are not supported (this server "
                                 "calls function tools)", param="tools", code="unsupported_parameter")
            if not isinstance(t.get("name"), str):
                raise P.APIError(f"tools[{i}].name must be a string", param="tools", code="invalid_value")
            unknown = sorted(set(t) - {"type", "name", "description", "parameters", "strict"})
            if unknown:
                raise P.APIError(f"tools[{i}].{unknown[0]} is not supported (a function tool takes name, "
                                 "description, parameters, strict)", param="tools", code="unsupported_parameter")
            tools.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters",
                                                                              "strict") if t.get(k) is not None}})
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise P.APIError(f"tool_choice: expected none, auto, required or {{\"type\": \"function\", \"name\": "
                             f"...}}, got {choice!r}", param="tool_choice", code="unsupported_parameter")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools, choice


def response_format(req: ResponsesRequest) -> Optional[dict]:
    """`text.format` as the chat route's `response_format`."""
    fmt = (req.text or {}).get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise P.APIError("text.format: json_schema needs a schema object", param="text.format",
                             code="invalid_value")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "response"),
                                                       "schema": fmt["schema"], "strict": fmt.get("strict")}}
    raise P.APIError(f"text.format: type {fmt.get('type')!r} is not supported (text, json_object, json_schema)",
                     param="text.format", code="unsupported_parameter")


def chat_request(req: ResponsesRequest, history: list[dict]) -> tuple[P.ChatCompletionRequest, list[dict]]:
    """(the equivalent chat request, the conversation without instructions to store for the next turn)."""
    conversation = history + input_messages(req.input)
    if not conversation:
        raise P.APIError("input must not be empty", param="input", code="invalid_value")
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    tools, choice = chat_tools(req)
    effort = (req.reasoning or {}).get("effort")
    # text.format shapes the output text; a forced call (tool_choice required or named) makes no text, only
    # the call (constrained by its own schema), so the format has nothing to apply to in this turn.
    fmt = response_format(req)
    if tools and (choice == "required" or isinstance(choice, dict)):
        fmt = None
    try:
        chat = P.ChatCompletionRequest(
            model=req.model, messages=messages, max_tokens=req.max_output_tokens, temperature=req.temperature,
            top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, seed=req.seed, ignore_eos=req.ignore_eos,
            tools=tools, tool_choice=choice, parallel_tool_calls=req.parallel_tool_calls,
            response_format=fmt, reasoning_effort=effort,
            thinking_token_budget=req.thinking_token_budget, chat_template_kwargs=req.chat_template_kwargs)
    except ValueError as e:  # pydantic's: a malformed tool or message
        raise P.APIError(f"Invalid request: {e}".splitlines()[0] + " " + str(e).splitlines()[-1].strip(),
                         param="input", code="invalid_value") from None
    return chat, conversation


def output_messages(output: list[dict]) -> list[dict]:
    """The chat messages of a response's output items (the history the next turn continues)."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    message: dict = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    thinking = "".join(_reasoning_text(item) for item in output if item["type"] == "reasoning")
    if thinking:
        message["reasoning_content"] = thinking
    return [message]


def tool_choice_out(req: ResponsesRequest):
    return req.tool_choice if req.tool_choice is not None else "auto"

