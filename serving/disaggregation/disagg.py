"""Disaggregated prefill/decode: a prompt is prefilled on one server and decoded on another.

Contract (what a router relies on)
----------------------------------
Both roles are ordinary `python -m serving.server` processes started with the
same `--kv_transfer_secret`; such a server mounts two internal routes next to
the OpenAI API (`serving.api.http_app`), so any worker can act as a prefill
worker, a decode worker, or serve whole requests. Without a secret the routes
do not exist: an import writes into the prefix cache every client shares, so
it must come from a worker that computed it.

`POST /internal/prefill`, JSON `{"endpoint": "/v1/completions" | "/v1/chat/completions", "body": <the client's
OpenAI request>}`. The worker tokenizes the request as the endpoint would,
runs the prompt and samples the first token with the request's own sampling
parameters and seed (max_tokens is forced to 1 here; the client's value is
still checked against the context window; where the server has API keys the
route needs one, like the endpoint it stands in for). The answer is a binary
KV payload (`application/x-ridgeline-kv`), streamed and signed
(`serving.disaggregation.kv_wire`):

    b"RKV2" | uint32 LE header length | header JSON (utf-8) | header tag | raw array bytes | payload tag

The header holds `version`, `endpoint` and `body` (echoed, so the payload
alone is enough for the decode worker), `model` (served name), `num_layers`,
`num_kv_heads`, `head_dim`, `dtype`, `page_size` (of the prefill worker; the
receiver may use another), `num_tokens` (= prompt length), `prompt_token_ids`,
`first_token`, `seed` (the effective sampling seed), `logprobs` (the first
token's chosen logprob, rank, top ids and top logprobs, or null),
`cache_salt` (the salt the prompt's pages were named under), `images` and
`mrope_delta` (a prompt holding images: each image's digest, first placeholder
position, patch grid and token count, and the multimodal-RoPE offset of the
positions after the prompt; `[]` and 0 for text) and `arrays`:
the per-layer arrays with their shapes and dtypes, `[{"name": "k", "shape":
[num_tokens, kv_heads, head_dim], "dtype": <dtype>}, {"name": "v", ...}]`,
followed for an int8 / fp8 cache by `{"name": "k_scale", "shape":
[num_tokens, kv_heads], "dtype": "float32"}` and `v_scale` (one scale per
token and KV head: quantized pages travel as stored, with their scales). The
body is, for each layer in order, each listed array's C-order bytes, so for
plain K/V it is one `[layers, 2, num_tokens, kv_heads, head_dim]` array,
followed, for a prompt with images, by their encoder outputs (float32
`[image tokens, hidden]`, the images in order). A
worker refuses arrays other than those of its own cache, and a payload whose
`dtype` is not its KV cache's (int8 into a float cache, float into an fp8
one, ...), with a 400 naming both dtypes. Response headers:
`x-ridgeline-kv-bytes` (body bytes after the header) and
`x-ridgeline-prefill-seconds`.

`POST /internal/decode`, body = that payload, unchanged. The worker reads it
under size caps and checks its tags before it parses what they cover (401
without tags, 403 with wrong ones, 413 past the caps), then checks it (model
geometry and KV dtype against its own cache, the token count against its
context window, the prompt the body tokenizes to against
`prompt_token_ids`), then serves the echoed
`endpoint`/`body` exactly as it would serve the request itself (the same
handler, so JSON or SSE streaming with the same shape), except that the
prompt's K/V comes from the payload: blocks are allocated through the block
manager (cached prefix blocks are reused, the rest written by one jitted
scatter into the donated cache), full blocks are registered in the prefix
cache so later turns hit, and generation continues from the shipped first
token; the blocks are named under the payload's `cache_salt`. Bad payloads or
mismatched models get an OpenAI-style error with a 4xx status and hold no
blocks. An image chat's images are decoded and encoded on the prefill worker
only: the decode worker takes their encoder outputs and digests from the
payload (its prefix-cache blocks are named by them as the prefill worker's
are) and never fetches, decodes or encodes an image. Only single-prompt requests with n == 1,
without echo or prompt logprobs, can be disaggregated (400 otherwise).

`run_disaggregated(client, prefill_url, decode_url, endpoint, body, headers)`
is the router's side (it holds no secret): it pipes the prefill worker's
payload into the decode request as it arrives (no full buffering in the
router) and returns the decode
worker's streaming `httpx.Response` (the caller reads or relays it and closes
it) and a `KVTransferRecord` (bytes, tokens and seconds).

Transport and overlap
---------------------
The workers are independent single-process JAX programs, so JAX's
cross-process transfers (which need one distributed runtime) do not apply:
KV is staged through host memory and sent over HTTP. On the prefill worker
the request's pages are gathered on device by one jitted gather and copied
to host once, off the engine thread; the payload is streamed layer by layer,
and the router forwards each chunk to the decode worker as it arrives, so the
two hops overlap. Chunked prefill of a long prompt does not ship pages early
(the export happens when the first token is sampled); see docs/serving.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from typing import Optional

import httpx
import pydantic
from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, Response, StreamingResponse

from serving.api import http_protocol as P
from serving.api import lora_routes, openai_fields
from serving.api import tool_calls as T
from serving.disaggregation import kv_wire
from serving.core.sampling_params import InvalidParameterError

PAYLOAD_MEDIA_TYPE = "application/x-ridgeline-kv"
ENDPOINTS = {"/v1/completions": ("completions", P.CompletionRequest),
             "/v1/chat/completions": ("chat", P.ChatCompletionRequest)}


# --- the router's side -------------------------------------------------------------------------

@dataclasses.dataclass
class KVTransferRecord:
    """What shipping one request's KV cost (seconds on the caller's clock)."""

    kv_bytes: int = 0  # K/V bytes in the payload (the header not counted)
    payload_bytes: int = 0  # everything forwarded to the decode worker
    num_tokens: int = 0  # prompt tokens whose K/V was shipped
    prefill_seconds: float = 0.0  # request sent -> prefill worker's payload begins (prefill + first token + copy)
    transfer_seconds: float = 0.0  # payload begins -> its last byte was handed to the decode worker
    decode_start_seconds: float = 0.0  # payload begins -> decode worker's response headers
    status: int = 200  # the status of the response returned (a prefill error is returned as is)

    @property
    def transfer_seconds_per_token(self) -> float:
        return self.transfer_seconds / self.num_tokens if self.num_tokens else 0.0


async def run_disaggregated(client: httpx.AsyncClient, prefill_url: str, decode_url: str, endpoint: str,
                            body: dict, headers: Optional[dict] = None) -> tuple[httpx.Response, KVTransferRecord]:
    """Prefills `body` on `prefill_url`, ships its KV to `decode_url`, returns (the decode response, record).

    `headers` go to the prefill worker with the request (the client's `authorization`, where the
    workers want an API key); the payload goes to the decode worker as the prefill worker signed it.

    The response is opened with `stream=True`: read it (`aread`, `aiter_lines`) or relay it, then
    `aclose()` it. If the prefill worker refuses the request (a 4xx for a bad client request, a 5xx),
    its response is returned instead, already read, and nothing is sent to the decode worker.
    """
    rec = KVTransferRecord()
    t0 = time.perf_counter()
    pre = await client.send(client.build_request("POST", prefill_url.rstrip("/") + "/internal/prefill",
                                                 json={"endpoint": endpoint, "body": body}, headers=headers),
                            stream=True)
    t1 = time.perf_counter()
    rec.prefill_seconds = t1 - t0
    if pre.status_code != 200:
        await pre.aread()
        await pre.aclose()
        rec.status = pre.status_code
        return pre, rec
    rec.kv_bytes = int(pre.headers.get("x-ridgeline-kv-bytes", 0))
    rec.num_tokens = int(pre.headers.get("x-ridgeline-kv-tokens", 0))

    async def payload():
        try:
            async for chunk in pre.aiter_raw():
                rec.payload_bytes += len(chunk)
                yield chunk
        finally:
            await pre.aclose()
            rec.transfer_seconds = time.perf_counter() - t1

    dec = await client.send(client.build_request("POST", decode_url.rstrip("/") + "/internal/decode",
                                                 content=payload(), headers={"content-type": PAYLOAD_MEDIA_TYPE}),
                            stream=True)
    rec.decode_start_seconds = time.perf_counter() - t1
    rec.status = dec.status_code
    return dec, rec


# --- the worker's side -------------------------------------------------------------------------

def _parse(endpoint, body):
    if endpoint not in ENDPOINTS:
        raise P.APIError(f"endpoint must be one of {sorted(ENDPOINTS)}, got {endpoint!r}", param="endpoint",
                         code="invalid_value")
    if not isinstance(body, dict):
        raise P.APIError("body must be the client's OpenAI request object", param="body", code="invalid_value")
    kind, model = ENDPOINTS[endpoint]
    try:
        req = model.model_validate(body)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(x) for x in first.get("loc", ()))
        raise P.APIError(f"Invalid request: {field}: {first.get('msg')}", param=field or None,
                         code="invalid_value") from e
    openai_fields.check_fields(req, kind)
    if req.n != 1:
        raise P.APIError("a disaggregated request must have n=1", param="n", code="invalid_value")
    if kind == "completions":
        if isinstance(req.prompt, list) and req.prompt and not all(isinstance(t, int) for t in req.prompt) \
                and len(req.prompt) != 1:
            raise P.APIError("a disaggregated request must have a single prompt", param="prompt",
                             code="invalid_value")
        if req.echo and req.logprobs is not None:
            raise P.APIError("echo with logprobs (prompt logprobs) cannot be disaggregated", param="echo",
                             code="invalid_value")
    return kind, req


def _first_token_request(ctx, kind: str, req):
    """(prompt ids, sampling params with max_tokens=1) as the endpoint would build them. The client's own
    parameters, its max_tokens included, are validated by the engine first, as the endpoint's are, so a
    request the decode worker would refuse is refused before anything is computed."""
    ctx.check_model(req.model)
    if kind == "completions":
        ((_, ids),) = ctx.completion_prompts(req.prompt)
        params = ctx.sampling_params(req, req.max_tokens, req.logprobs, None)
    else:
        if req.top_logprobs is not None and not req.logprobs:
            raise P.APIError("top_logprobs requires logprobs to be true", param="top_logprobs",
                             code="invalid_value")
        # The tool plan as the chat route makes it: the template lists the tools, and a forced call's
        # grammar constrains the first token too, so the decode worker resumes the prompt it would build.
        plan = T.plan_tools(req, ctx.tool_call_parser)
        ids = ctx.chat_prompt(req, plan)
        _, reasoning = ctx.chat_reasoning(req, plan, req.requested_max_tokens())  # a budget forces the end tag
        params = ctx.sampling_params(req, req.requested_max_tokens(), (req.top_logprobs or 0) if req.logprobs
                                     else None, None, plan, reasoning)
    try:
        ctx.engine.engine.make_request("check", ids, params)
    except InvalidParameterError as e:
        raise ctx.api_error(e, kind, req) from e
    params = params.clone()
    params.max_tokens = 1
    params.min_tokens = min(params.min_tokens, 1)  # the first token's share of it (the rest is the decode's)
    return ids, params


def _route_handler(app: FastAPI, endpoint: str):
    for route in app.router.routes:
        if getattr(route, "path", None) == endpoint and "POST" in getattr(route, "methods", ()):
            return route.endpoint
    raise P.APIError(f"this server has no {endpoint} route", status=404, param="endpoint")


def _transfer_engine(ctx, kt):
    """(the engine, its KV dtype): every runner ships and receives KV (any cache form, layout or mesh)."""
    engine = ctx.engine.engine
    return engine, engine.runner.kv_dtype


def _wire_error(e: kv_wire.WireError) -> P.APIError:
    return P.APIError(f"bad KV payload: {e}", status=e.status, param="payload", code=e.code)


def _refuse_declared_length(request: Request, limit: int) -> None:
    """413 before reading anything when the body's declared length is already over `limit`."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise P.APIError(f"request body of {declared} bytes exceeds this worker's limit of {limit}", status=413,
                         param="payload", code="kv_payload_too_large")


async def _read_json(request: Request, limit: int):
    """The JSON body of a request, read under a cap of `limit` bytes (413 past it)."""
    _refuse_declared_length(request, limit)
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit:
            raise P.APIError(f"request body exceeds this worker's limit of {limit} bytes", status=413,
                             code="request_too_large")
    try:
        return json.loads(bytes(data))
    except ValueError as e:
        raise P.APIError(f"The request body is not valid JSON: {e}", code="invalid_json") from e


def add_kv_transfer_routes(app: FastAPI, ctx, secret: str, dependencies=()) -> None:
    """Mounts `/internal/prefill` and `/internal/decode` (see the module docstring) on the OpenAI app.

    `secret` signs the payloads this worker ships and verifies the ones it receives; `dependencies`
    (the API-key check) guard `/internal/prefill` as they guard the OpenAI routes it stands in for.
    """
    # kv_transfer imports jax: a router that only calls run_disaggregated does not need it.
    from serving.disaggregation import kv_transfer as kt

    keys = kv_wire.SigningKeys(secret)
    max_header = kt.max_header_bytes(ctx.max_model_len)

    @app.post("/internal/prefill", dependencies=list(dependencies))
    async def internal_prefill(request: Request):
        t0 = time.perf_counter()
        data = await _read_json(request, max_header)
        if not isinstance(data, dict):
            raise P.APIError("expected {\"endpoint\": ..., \"body\": ...}", code="invalid_value")
        endpoint, body = data.get("endpoint"), data.get("body")
        kind, req = _parse(endpoint, body)
        ids, params = _first_token_request(ctx, kind, req)
        images = await ctx.chat_images(req) if kind == "chat" else []  # encoded here; their outputs are shipped
        prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else ids
        salt = ctx.cache_salt(req, request)
        engine, dtype = _transfer_engine(ctx, kt)
        exports = []
        try:
            async for _ in ctx.engine.generate(prompt, params, f"prefill-{uuid.uuid4().hex}", cache_salt=salt,
                                               priority=getattr(req, "priority", 0),
                                               part_args={"kv_export": kt.Exporter(exports.append),
                                                          **lora_routes.part_args()}):
                pass
        except InvalidParameterError as e:
            raise ctx.api_error(e, kind, req) from e
        if not exports:
            raise P.APIError("the prefill ended without a first token", status=500, type="server_error")
        exp = exports[0]
        host = await asyncio.to_thread(exp.host_kv)  # the one device -> host copy, off the event loop
        signer = kv_wire.PayloadSigner(keys, kt.payload_header(
            exp, engine.cfg, dtype, {"endpoint": endpoint, "body": body, "model": ctx.model_name}))

        async def chunks():
            yield signer.head()
            for piece in kt.payload_chunks(exp, host):  # one chunk per layer (then the image rows): the receiver
                yield signer.body(piece)  # gets bytes while later ones are sent
            yield signer.tail()

        return StreamingResponse(chunks(), media_type=PAYLOAD_MEDIA_TYPE, headers={
            "x-ridgeline-kv-bytes": str(host.nbytes + exp.image_embeds().nbytes), "x-ridgeline-kv-tokens": str(exp.num_tokens),
            "x-ridgeline-prefill-seconds": f"{time.perf_counter() - t0:.6f}"})

    @app.post("/internal/decode")
    async def internal_decode(request: Request):
        engine, dtype = _transfer_engine(ctx, kt)
        max_tokens = ctx.max_model_len

        def body_bytes(header):
            return kt.body_bytes(header, engine.cfg, dtype, max_tokens)

        _refuse_declared_length(request, kt.max_payload_bytes(engine.cfg, dtype, max_tokens))
        t0 = time.perf_counter()
        try:  # nothing is parsed before its signature is checked, nor buffered beyond what the header announces
            header, body = await kv_wire.read_payload(request.stream(), keys, max_header, body_bytes)
            imp = kt.to_import(header, body, engine.cfg, dtype)
        except kv_wire.WireError as e:
            raise _wire_error(e) from e
        if header.get("model") != ctx.model_name:
            raise P.APIError(f"the KV payload comes from model {header.get('model')!r}; this worker serves "
                             f"{ctx.model_name!r}", param="model", code="model_mismatch")
        endpoint = header.get("endpoint")
        _parse(endpoint, header.get("body"))
        req = ENDPOINTS[endpoint][1].model_validate(header["body"])
        handler = _route_handler(app, endpoint)
        parse_seconds = time.perf_counter() - t0
        token = kt.current_import.set(imp)
        try:
            resp = await handler(req=req, request=request)
        finally:
            kt.current_import.reset(token)
        headers = {"x-ridgeline-kv-bytes": str(len(body)), "x-ridgeline-kv-parse-seconds": f"{parse_seconds:.6f}"}
        if isinstance(resp, Response):
            resp.headers.update(headers)
            return resp
        return JSONResponse(jsonable_encoder(resp), headers=headers)
