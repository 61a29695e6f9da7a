"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

A request becomes the equivalent chat (`messages_protocol.chat_request`) and runs
through the chat route's template, tool plan, reasoning split and sampling; the
answer comes back as content blocks: `thinking` (from `--reasoning_parser`;
its `signature` is empty, since nothing here verifies one), `text`, and
`tool_use` with the call's `input` object. `stop_reason` is `end_turn`,
`max_tokens`, `stop_sequence` (with `stop_sequence`) or `tool_use`.

Streaming sends Anthropic's events: `message_start`, then per block
`content_block_start`, `content_block_delta` (`thinking_delta`, `text_delta`,
`input_json_delta`) and `content_block_stop`, then `message_delta` (the stop
reason and the output tokens) and `message_stop`. A client that goes away
aborts the request.

Errors leave in Anthropic's envelope (`{"type": "error", "error": {"type",
"message"}}`) with the HTTP status of the error; the key may come as
`x-api-key` (Anthropic's header) or `Authorization: Bearer`.
"""

from __future__ import annotations

import json
import uuid
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from serving.api import http_protocol as P
from serving.api import messages_protocol as MQ
from serving.api import reasoning as R
from serving.api import tool_calls as T
from serving.api.answer_stream import AnswerStream
from serving.api.http_util import ClientGone, primed_stream

# HTTP status -> Anthropic's error type.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
_RENAMED = {"response_format": "output_config.format", "thinking_token_budget": "thinking.budget_tokens",
            "reasoning_effort": "output_config.effort", "stop": "stop_sequences", "tool_choice": "tool_choice"}


def error_body(err: P.APIError) -> dict:
    param = _RENAMED.get(err.param, err.param)
    message = err.message.replace(err.param, param, 1) if err.param and param != err.param else err.message
    kind = _ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _error(err: P.APIError) -> JSONResponse:
    return JSONResponse(error_body(err), status_code=err.status)


def _stop_reason(o, has_calls: bool) -> tuple[str, Optional[str]]:
    if o.finish_reason == "length":
        return "max_tokens", None
    if has_calls:
        return "tool_use", None
    if isinstance(o.stop_reason, str):
        return "stop_sequence", o.stop_reason
    return "end_turn", None


def _usage(prompt_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens, "output_tokens": output_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0}


def _tool_use(call_id: str, name: str, arguments: str) -> Optional[dict]:
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError:
        return None  # cut off before its arguments were whole
    return {"type": "tool_use", "id": call_id.replace("call_", "toolu_", 1), "name": name,
            "input": args if isinstance(args, dict) else {"value": args}}


async def _authorize(ctx, request: Request) -> None:
    """The API key from `x-api-key` (Anthropic's header) or `Authorization: Bearer`."""
    await ctx.api_keys.require_anthropic(request)


def add_messages_routes(app: FastAPI, ctx) -> None:
    """Mounts the Messages routes on `app` (`ctx`: the app's `ServingContext`)."""

    async def parse(request: Request) -> MQ.MessagesRequest:
        await _authorize(ctx, request)
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            raise P.APIError("The request body is not valid JSON", code="invalid_json") from None
        try:
            req = MQ.MessagesRequest.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(x) for x in first.get("loc", ()))
            raise P.APIError(f"{where}: {first.get('msg')}", param=where.split(".")[0] or None) from None
        MQ.check_fields(req)
        ctx.check_model(req.model)
        return req

    def prepare(req: MQ.MessagesRequest, request: Request):
        chat, shown = MQ.chat_request(req)
        if (req.thinking or {}).get("type") == "disabled" and ctx.reasoning is not None:
            # Besides enable_thinking false for the template: a template that opens a block anyway has it
            # closed at once, and nothing of it is shown.
            chat.thinking_token_budget, shown = 0, False
        plan = T.plan_tools(chat, ctx.tool_call_parser)
        ids = ctx.chat_prompt(chat, plan)
        starts, reasoning = ctx.chat_reasoning(chat, plan, chat.max_tokens)
        params = ctx.sampling_params(chat, chat.max_tokens, None, None, plan, reasoning)
        return chat, shown, plan, ids, starts, params, ctx.cache_salt(chat, request)

    @app.post("/v1/messages")
    async def messages(request: Request):
        try:
            req = await parse(request)
            chat, shown, plan, ids, starts, params, salt = prepare(req, request)
            base_id = f"msg_{uuid.uuid4().hex}"
            if req.stream:
                return await primed_stream(request, _stream(ctx, chat, shown, plan, ids, starts, params, salt,
                                                            base_id))
            (out,) = await ctx.final_outputs(request, [ids], params, base_id, "chat", salt, chat)
        except P.APIError as e:
            return _error(e)
        except ClientGone:
            return Response(status_code=499)
        o = out.outputs[0]
        thinking, answer = (None, o.text) if starts is None else R.split(ctx.reasoning, starts, o.text)
        content, calls = plan.calls(answer)
        blocks = []
        if thinking is not None and shown:
            blocks.append({"type": "thinking", "thinking": thinking, "signature": ""})
        uses = [u for u in (_tool_use(c.id, c.function.name, c.function.arguments) for c in T.tool_calls_of(calls))
                if u is not None]
        if content or (not uses and not blocks):
            blocks.append({"type": "text", "text": content or ""})
        blocks += uses
        stop_reason, stop_sequence = _stop_reason(o, bool(uses))
        return JSONResponse({"id": base_id, "type": "message", "role": "assistant", "model": ctx.served_model(),
                             "content": blocks, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                             "usage": _usage(len(ids), len(o.token_ids))})

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        try:
            body = await request.json() if await request.body() else {}
            if isinstance(body, dict):
                body = {"max_tokens": 1, **body}  # count_tokens takes no max_tokens
            req = MQ.MessagesRequest.model_validate(body)
            await _authorize(ctx, request)
            MQ.check_fields(req)
            ctx.check_model(req.model)
            chat, _, plan, ids, _, _, _ = prepare(req, request)
        except ValidationError as e:
            return _error(P.APIError(f"invalid request: {e.errors()[0].get('msg')}"))
        except P.APIError as e:
            return _error(e)
        return JSONResponse({"input_tokens": len(ids)})


def _event(kind: str, **fields) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"


class _Blocks:
    """The content blocks of a streamed message as they open, grow and close."""

    def __init__(self):
        self.count = 0
        self.open: Optional[str] = None  # the type of the open block

    def _start(self, block: dict) -> list[str]:
        out = self.close()
        self.open = block["type"]
        out.append(_event("content_block_start", index=self.count, content_block=block))
        return out

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        self.count += 1
        return [_event("content_block_stop", index=self.count - 1)]

    def thinking(self, delta: str) -> list[str]:
        out = [] if self.open == "thinking" else self._start({"type": "thinking", "thinking": "", "signature": ""})
        return out + [_event("content_block_delta", index=self.count, delta={"type": "thinking_delta",
                                                                              "thinking": delta})]

    def text(self, delta: str) -> list[str]:
        out = [] if self.open == "text" else self._start({"type": "text", "text": ""})
        return out + [_event("content_block_delta", index=self.count, delta={"type": "text_delta", "text": delta})]

    def call(self, call) -> list[str]:
        out = []
        if call.id is not None:
            out += self._start({"type": "tool_use", "id": call.id.replace("call_", "toolu_", 1),
                                "name": call.function.name, "input": {}})
        args = call.function.arguments if call.function is not None else None
        if args:
            out.append(_event("content_block_delta", index=self.count, delta={"type": "input_json_delta",
                                                                               "partial_json": args}))
        return out


async def _stream(ctx, chat, shown: bool, plan, ids, starts, params, salt, base_id: str):
    blocks = _Blocks()
    answer = AnswerStream(ctx.reasoning, starts, plan)
    started, final = False, None
    try:
        async for _, out in ctx.stream_outputs([ids], params, base_id, "chat", salt, chat):
            o = out.outputs[0]
            finished = o.finish_reason is not None
            events = []
            if not started:
                started = True
                events.append(_event("message_start", message={
                    "id": base_id, "type": "message", "role": "assistant", "model": ctx.served_model(), "content": [],
                    "stop_reason": None, "stop_sequence": None, "usage": _usage(len(ids), 0)}))
            thinking, delta, calls = answer.step(o.text, len(o.token_ids), finished)
            if thinking and shown:
                events += blocks.thinking(thinking)
            if delta:
                events += blocks.text(delta)
            for call in calls:
                events += blocks.call(call)
            if finished:
                final = o
            if events:
                yield "".join(events)
    except P.APIError as e:
        if not started:
            raise
        yield _event("error", error=error_body(e)["error"])
        return
    except Exception as e:  # noqa: BLE001
        if not started:
            raise
        yield _event("error", error={"type": "api_error", "message": str(e)})
        return
    if final is None:
        return
    tail = blocks.close()
    stop_reason, stop_sequence = _stop_reason(final, answer.has_calls)
    tail.append(_event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                       usage={"output_tokens": len(final.token_ids)}))
    tail.append(_event("message_stop"))
    yield "".join(tail)
