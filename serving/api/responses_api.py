"""OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A request becomes the equivalent chat (`responses_protocol.chat_request`) and runs
through the chat route's template, tool plan, reasoning split and sampling; its
answer comes back as output items: `reasoning` (from `--reasoning_parser`),
`message` with `output_text`, and `function_call`s. A length stop is
`status: "incomplete"` with `incomplete_details.reason: "max_output_tokens"`.

Streaming sends the documented events, each with its `sequence_number`:
`response.created`, `response.in_progress`, then per item
`response.output_item.added`, its deltas (`response.reasoning_text.delta`,
`response.content_part.added` / `response.output_text.delta` /
`response.output_text.done` / `response.content_part.done`,
`response.function_call_arguments.delta` / `.done`) and
`response.output_item.done`, and last `response.completed` (or
`response.incomplete`). A client that goes away aborts the request.

Stored responses (`store`, on by default as OpenAI's) live in the app's
`ResponseStore`, scoped to the API key; `previous_response_id` continues the
stored conversation (its input and output; not its `instructions`, as OpenAI
documents). `background` is refused: every response is answered by the
request that makes it.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from serving.api import http_protocol as P
from serving.api import reasoning as R
from serving.api import responses_protocol as RQ
from serving.api import tool_calls as T
from serving.api.answer_stream import AnswerStream
from serving.api.http_util import ClientGone, primed_stream
from serving.api.responses_store import owner_of


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _renamed(err: P.APIError) -> P.APIError:
    """A chat-route error named as the Responses request names the field."""
    names = {"response_format": "text.format", "max_tokens": "max_output_tokens", "messages": "input",
             "reasoning_effort": "reasoning.effort"}
    if err.param in names:
        err.message = err.message.replace(err.param, names[err.param], 1)
        err.param = names[err.param]
    return err


class _Turn:
    """One response being made: the request, its chat form and what it needs to build items."""

    def __init__(self, ctx, req: RQ.ResponsesRequest, chat, conversation, plan, starts, prompt_len: int):
        self.ctx, self.req, self.chat, self.conversation = ctx, req, chat, conversation
        self.plan, self.starts, self.prompt_len = plan, starts, prompt_len
        self.id = _new_id("resp")
        self.created_at = int(time.time())

    def reasoning_tokens(self, token_ids, thinking: Optional[str]) -> int:
        """The output tokens up to and including the end tag (all of them when thinking never ended);
        0 for an output without thinking."""
        if thinking is None:
            return 0
        end, ids = list(self.ctx.reasoning.end_ids), list(token_ids)
        for i in range(len(ids) - len(end) + 1):
            if ids[i:i + len(end)] == end:
                return i + len(end)
        return len(ids)

    def body(self, output: list[dict], status: str, token_ids=(), thinking: Optional[str] = None) -> dict:
        req = self.req
        fmt = (req.text or {}).get("format") or {"type": "text"}
        usage = None
        if status != "in_progress":
            usage = {"input_tokens": self.prompt_len, "input_tokens_details": {"cached_tokens": 0},
                     "output_tokens": len(token_ids),
                     "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens(token_ids, thinking)},
                     "total_tokens": self.prompt_len + len(token_ids)}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.ctx.served_model(), "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "metadata": req.metadata or {},
            "max_output_tokens": req.max_output_tokens, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "reasoning": {"effort": (req.reasoning or {}).get(
                "effort"), "summary": None}, "store": bool(req.store), "temperature": self.chat.temperature,
            "top_p": self.chat.top_p, "text": {"format": fmt}, "tool_choice": RQ.tool_choice_out(req),
            "tools": req.tools or [], "truncation": "disabled", "usage": usage, "background": False,
        }


def _reasoning_item(text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": _new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def _with_encrypted_content(turn: "_Turn", item: dict) -> dict:
    """A reasoning item with `encrypted_content` when the request included it (an opaque copy of the
    text for a client that keeps no store; an item sent back is read again as the thinking)."""
    if item["type"] == "reasoning" and "reasoning.encrypted_content" in (turn.req.include or []):
        text = item["content"][0]["text"] if item["content"] else ""
        item["encrypted_content"] = base64.b64encode(text.encode("utf-8")).decode("ascii")
    return item


def _message_item(text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": _new_id("msg"), "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": _new_id("fc"), "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(turn: _Turn, text: str, incomplete: bool) -> tuple[list[dict], Optional[str]]:
    """(output items, the thinking) of a finished output's text."""
    thinking, answer = (None, text) if turn.starts is None else R.split(turn.ctx.reasoning, turn.starts, text)
    content, calls = turn.plan.calls(answer)
    status = "incomplete" if incomplete else "completed"
    items = []
    if thinking is not None:
        items.append(_with_encrypted_content(turn, _reasoning_item(thinking, status)))
    if content:
        items.append(_message_item(content, status))
    for call in T.tool_calls_of(calls):
        items.append(_call_item(call.id, call.function.name, call.function.arguments, status))
    return items, thinking


def add_responses_routes(app: FastAPI, ctx, keyed: list) -> None:
    """Mounts the Responses routes on `app` (`ctx`: the app's `ServingContext`)."""
    store = app.state.responses_store

    def owner(request: Request) -> str:
        return owner_of(getattr(request.state, "api_key", None))

    def not_found(response_id: str, param: Optional[str] = None) -> P.APIError:
        return P.APIError(f"No response with id '{response_id}' found.", status=404, param=param, code="not_found")

    @app.post("/v1/responses", dependencies=keyed)
    async def create_response(req: RQ.ResponsesRequest, request: Request):
        RQ.check_fields(req)
        ctx.check_model(req.model)
        if "store" in req.model_fields_set and req.store and not store.enabled:
            raise P.APIError("store: this server keeps no responses (--responses_store_max_entries 0)",
                             param="store", code="unsupported_parameter")
        history: list[dict] = []
        if req.previous_response_id is not None:
            previous = store.get(owner(request), req.previous_response_id)
            if previous is None:
                raise not_found(req.previous_response_id, "previous_response_id")
            history = previous["conversation"]
        chat, conversation = RQ.chat_request(req, history)
        try:
            plan = T.plan_tools(chat, ctx.tool_call_parser)
            ids = ctx.chat_prompt(chat, plan)
            starts, reasoning = ctx.chat_reasoning(chat, plan, chat.max_tokens)
            params = ctx.sampling_params(chat, chat.max_tokens, None, None, plan, reasoning)
            salt = ctx.cache_salt(chat, request)
        except P.APIError as e:
            raise _renamed(e) from None
        turn = _Turn(ctx, req, chat, conversation, plan, starts, len(ids))
        if req.stream:
            return await primed_stream(request, _stream(turn, ids, params, salt, store, owner(request)))
        try:
            (out,) = await ctx.final_outputs(request, [ids], params, turn.id, "chat", salt, chat)
        except ClientGone:
            return Response(status_code=499)
        except P.APIError as e:
            raise _renamed(e) from None
        o = out.outputs[0]
        incomplete = o.finish_reason == "length"
        items, thinking = output_items(turn, o.text, incomplete)
        body = turn.body(items, "incomplete" if incomplete else "completed", o.token_ids, thinking)
        _save(store, owner(request), turn, body)
        return JSONResponse(body)

    @app.get("/v1/responses/{response_id}", dependencies=keyed)
    async def get_response(response_id: str, request: Request):
        entry = store.get(owner(request), response_id)
        if entry is None:
            raise not_found(response_id)
        return JSONResponse(entry["response"])

    @app.delete("/v1/responses/{response_id}", dependencies=keyed)
    async def delete_response(response_id: str, request: Request):
        if not store.delete(owner(request), response_id):
            raise not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


def _save(store, owner: str, turn: _Turn, body: dict) -> None:
    if turn.req.store:
        store.put(owner, turn.id, {"response": body, "conversation": turn.conversation
                                   + RQ.output_messages(body["output"])})


class _Events:
    """Server-sent events of one response, numbered in order."""

    def __init__(self):
        self.sequence = 0

    def __call__(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _StreamedItems:
    """The output items of a streamed response as they open, grow and close, with their events."""

    def __init__(self, events: _Events, turn: _Turn):
        self.ev = events
        self.turn = turn
        self.items: list[dict] = []
        self.open: Optional[dict] = None

    def _start(self, item: dict) -> list[str]:
        out = self.close()
        self.items.append(item)
        self.open = item
        out.append(self.ev("response.output_item.added", output_index=len(self.items) - 1, item=item))
        if item["type"] == "message":
            out.append(self.ev("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                               content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return out

    def reasoning(self, delta: str) -> list[str]:
        out = [] if self.open is not None and self.open["type"] == "reasoning" else self._start(
            {"type": "reasoning", "id": _new_id("rs"), "summary": [], "content": [], "status": "in_progress"})
        self.open.setdefault("_text", "")
        self.open["_text"] += delta
        out.append(self.ev("response.reasoning_text.delta", item_id=self.open["id"], output_index=len(self.items) - 1,
                           content_index=0, delta=delta))
        return out

    def text(self, delta: str) -> list[str]:
        out = [] if self.open is not None and self.open["type"] == "message" else self._start(
            {"type": "message", "id": _new_id("msg"), "role": "assistant", "status": "in_progress", "content": []})
        self.open.setdefault("_text", "")
        self.open["_text"] += delta
        out.append(self.ev("response.output_text.delta", item_id=self.open["id"], output_index=len(self.items) - 1,
                           content_index=0, delta=delta, logprobs=[]))
        return out

    def call(self, call) -> list[str]:
        out = []
        if call.id is not None:
            out += self._start({"type": "function_call", "id": _new_id("fc"), "call_id": call.id,
                                "name": call.function.name, "arguments": "", "status": "in_progress"})
        delta = call.function.arguments if call.function is not None else None
        if delta:
            self.open["arguments"] += delta
            out.append(self.ev("response.function_call_arguments.delta", item_id=self.open["id"],
                               output_index=len(self.items) - 1, delta=delta))
        return out

    def close(self, status: str = "completed") -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        index, out = self.items.index(item), []
        item["status"] = status
        text = item.pop("_text", "")
        if item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
            _with_encrypted_content(self.turn, item)
            out.append(self.ev("response.reasoning_text.done", item_id=item["id"], output_index=index,
                               content_index=0, text=text))
        elif item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item["content"] = [part]
            out.append(self.ev("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                               text=text, logprobs=[]))
            out.append(self.ev("response.content_part.done", item_id=item["id"], output_index=index,
                               content_index=0, part=part))
        else:
            out.append(self.ev("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                               name=item["name"], arguments=item["arguments"]))
        out.append(self.ev("response.output_item.done", output_index=index, item=item))
        return out


async def _stream(turn: _Turn, ids, params, salt, store, owner: str):
    ctx = turn.ctx
    ev = _Events()
    items = _StreamedItems(ev, turn)
    answer = AnswerStream(ctx.reasoning, turn.starts, turn.plan)
    started, final = False, None
    try:
        async for _, out in ctx.stream_outputs([ids], params, turn.id, "chat", salt, turn.chat):
            o = out.outputs[0]
            finished = o.finish_reason is not None
            events = []
            if not started:
                started = True
                events.append(ev("response.created", response=turn.body([], "in_progress")))
                events.append(ev("response.in_progress", response=turn.body([], "in_progress")))
            thinking, delta, calls = answer.step(o.text, len(o.token_ids), finished)
            if thinking:
                events += items.reasoning(thinking)
            if delta:
                events += items.text(delta)
            for call in calls:
                events += items.call(call)
            if finished:
                final = o
            if events:
                yield "".join(events)
    except P.APIError as e:
        if not started:
            raise _renamed(e) from None
        yield ev("error", code=e.code, message=e.message, param=e.param)
        return
    except Exception as e:  # noqa: BLE001
        if not started:
            raise
        yield ev("error", code="server_error", message=str(e), param=None)
        return
    if final is None:
        return
    incomplete = final.finish_reason == "length"
    status = "incomplete" if incomplete else "completed"
    tail = items.close(status)
    for item in items.items:
        item["status"] = status
    thinking = next((i["content"][0]["text"] for i in items.items if i["type"] == "reasoning"), None)
    body = turn.body(items.items, status, final.token_ids, thinking)
    _save(store, owner, turn, body)
    tail.append(ev("response.incomplete" if incomplete else "response.completed", response=body))
    yield "".join(tail)
