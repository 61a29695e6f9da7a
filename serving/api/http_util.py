"""The HTTP helpers both the server (`serving.api.http_app`) and the router (`serving.router`) use.

Kept apart from `serving.api.http_app` because that module imports the engine (and so jax), while the router
must start without jax: it only relays requests. Only asyncio and FastAPI/Starlette here.
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

_DISCONNECT_POLL_S = 0.25  # how often a waiting handler checks whether its client is still there


async def until_disconnect(request: Request, awaitable, on_orphan=None):
    """Awaits `awaitable`, cancelling it (and raising ClientGone) if the client disconnects first.

    If it finished just as it was cancelled, `on_orphan(result)` (a coroutine
    function) releases what it opened, e.g. an upstream response.
    """
    task = asyncio.ensure_future(awaitable)
    while True:
        done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            results = await asyncio.gather(task, return_exceptions=True)
            if on_orphan is not None and not isinstance(results[0], BaseException):
                await on_orphan(results[0])
            raise ClientGone()


async def primed_stream(request: Request, agen):
    """A StreamingResponse over `agen`, started only once its first event exists.

    Errors the engine raises while accepting the request (a parameter it
    rejects) thus still become an HTTP 400 instead of an in-band error after a
    200; the first event is ready no later than the first token would have been
    sent anyway.
    """
    try:
        first = await until_disconnect(request, agen.__anext__())
    except StopAsyncIteration:
        first = None
    except ClientGone:
        await agen.aclose()
        return Response(status_code=499)

    async def chained():
        try:
            if first is not None:
                yield first
                async for event in agen:
                    yield event
        finally:
            await agen.aclose()

    return StreamingResponse(chained(), media_type="text/event-stream")


class ClientGone(Exception):
    """The client disconnected before its non-streaming response was ready."""


def token_fields(req, prompt_ids, o, t0: int, t1: int) -> dict:
    """A completion or chat choice's token fields (`return_token_ids`) for output tokens t0..t1-1 of `o`: their
    ids, weight versions and, with logprobs, keep-mask sizes; `prompt_ids` when given (None: a later chunk)."""
    if not req.return_token_ids:
        return {}
    fields = {"token_ids": list(o.token_ids[t0:t1]), "weight_versions": list((o.weight_versions or [])[t0:t1])}
    if prompt_ids is not None:
        fields["prompt_token_ids"] = list(prompt_ids)
    if o.keep_sizes is not None:
        fields["keep_sizes"] = list(o.keep_sizes[t0:t1])
    return fields
