"""Bounds on what one request, and one API key, may ask of the server.

Three pieces, each independent of the routes it guards:

* `BodyLimit` (ASGI middleware): a request body over `--max_request_body_bytes`
  is a 413 in OpenAI's error envelope before it is buffered. A declared
  `Content-Length` over the limit is refused before a byte is read; a chunked
  (or lying) body is counted as it arrives and refused at the first chunk that
  crosses the limit, the route seeing only a disconnect. The KV routes of
  disaggregated serving (`/internal/*`) are left to their own readers, which
  bound a payload by what the context window can hold.
* `KeyConcurrency` (ASGI middleware): at most `--max_concurrent_requests_per_key`
  requests of one API key (the bearer token; on an open server, the client's
  address) in flight on the routes that run engine requests (`POST /v1/*`, and the pooling routes
  outside /v1/); one more is a 429
  with `Retry-After`. A request counts until its response (a stream included) ends.
* `check_caps(req)`: counts that a request body may not exceed (stop strings,
  tools, logit_bias entries, ...), each a 400 naming the field. The other
  bounds (`max_tokens` and prompt length by the context window, `n` by
  128 or `max_num_seqs`, `logprobs` by 20) are the engine's own checks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Optional

from serving.api import http_protocol as P

DEFAULT_MAX_BODY_BYTES = 16 * 2**20
RETRY_AFTER_S = 1

# Field -> (cap, what it bounds). Counts beyond these serve no client and cost the host per step.
CAPS: dict[str, tuple[int, str]] = {
    "stop": (16, "stop strings"),
    "stop_token_ids": (256, "stop token ids"),
    "logit_bias": (1024, "logit_bias entries"),
    "bad_words": (128, "bad words"),
    "tools": (128, "tools"),
    "messages": (4096, "messages"),
    "prompt": (256, "prompts in one request"),
}


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """The server's limits (flags `--max_request_body_bytes`, `--max_concurrent_requests_per_key`; 0: none)."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_concurrent_per_key: int = 0


def check_caps(req) -> None:
    """400 (`invalid_value`, naming the field) for a list or map in `req` longer than its cap."""
    for field, (cap, what) in CAPS.items():
        value = getattr(req, field, None)
        if field == "prompt" and (isinstance(value, str) or (value and isinstance(value[0], int))):
            continue  # one prompt: the context window bounds it
        if field == "stop" and isinstance(value, str):
            continue
        if value is not None and len(value) > cap:
            raise P.APIError(f"{field}: at most {cap} {what} are accepted, got {len(value)}", param=field,
                             code="invalid_value")


async def send_error(send, status: int, body: dict, headers: Optional[dict] = None) -> None:
    """A complete JSON error response over raw ASGI `send`."""
    payload = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})


def _too_large(limit: int) -> dict:
    return P.error_body(f"The request body exceeds this server's limit of {limit} bytes "
                        "(--max_request_body_bytes).", code="request_too_large")


class BodyLimit:
    """ASGI middleware: 413 for a body over `max_bytes`, before it is buffered (see the module docstring)."""

    def __init__(self, app, max_bytes: int, exempt_prefixes: tuple[str, ...] = ("/internal/",)):
        self.app, self.max_bytes, self.exempt = app, max_bytes, exempt_prefixes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.max_bytes or scope["path"].startswith(self.exempt):
            return await self.app(scope, receive, send)
        limit = self.max_bytes
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            try:
                too_large = int(declared) > limit
            except ValueError:
                return await send_error(send, 400, P.error_body("Content-Length is not a number",
                                                                code="invalid_value"))
            if too_large:
                return await send_error(send, 413, _too_large(limit))
        state = {"seen": 0, "refused": False, "started": False}

        async def counted_receive():
            if state["refused"]:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                state["seen"] += len(message.get("body", b""))
                if state["seen"] > limit:
                    state["refused"] = True
                    if not state["started"]:
                        state["started"] = True
                        await send_error(send, 413, _too_large(limit))
                    return {"type": "http.disconnect"}  # the route stops reading; its answer is dropped
            return message

        async def guarded_send(message):
            if state["refused"]:
                return  # the 413 went out instead
            if message["type"] == "http.response.start":
                state["started"] = True
            await send(message)

        await self.app(scope, counted_receive, guarded_send)


def key_of(scope) -> str:
    """Who a request counts against: its bearer token (by digest), else the client's address."""
    auth = dict(scope["headers"]).get(b"authorization", b"")
    scheme, _, token = auth.partition(b" ")
    if scheme.lower() == b"bearer" and token.strip():
        return "key:" + hashlib.sha256(token.strip()).hexdigest()[:32]
    client = scope.get("client") or ("?", 0)
    return f"addr:{client[0]}"


# The routes outside /v1/ that run engine requests (vLLM's pooling routes, `serving.api.pooling_routes`).
ENGINE_ROUTES = ("/pooling", "/classify", "/score", "/rerank", "/v2/rerank")


class KeyConcurrency:
    """ASGI middleware: at most `limit` requests that run on the engine (`POST /v1/*` and `ENGINE_ROUTES`) in
    flight per key; then 429."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit
        self.in_flight: dict[str, int] = {}

    async def __call__(self, scope, receive, send):
        if (scope["type"] != "http" or not self.limit or scope["method"] != "POST"
                or not (scope["path"].startswith("/v1/") or scope["path"] in ENGINE_ROUTES)):
            return await self.app(scope, receive, send)
        key = key_of(scope)
        if self.in_flight.get(key, 0) >= self.limit:
            body = P.error_body(f"Too many concurrent requests for this API key: at most {self.limit} may be in "
                                "flight (--max_concurrent_requests_per_key); retry when one has finished.",
                                type="requests", code="rate_limit_exceeded")
            return await send_error(send, 429, body, {"retry-after": str(RETRY_AFTER_S)})
        self.in_flight[key] = self.in_flight.get(key, 0) + 1
        try:
            await self.app(scope, receive, send)
        finally:
            left = self.in_flight[key] - 1
            if left:
                self.in_flight[key] = left
            else:
                del self.in_flight[key]


def add_request_limits(app, limits: RequestLimits) -> None:
    """Installs both middlewares on a FastAPI app (the body limit outermost: nothing oversized is counted)."""
    app.add_middleware(KeyConcurrency, limit=limits.max_concurrent_per_key)
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)
