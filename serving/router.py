"""`python -m serving.router`: an OpenAI-compatible front over N `serving.server` workers.

    python -m serving.router --port 8000 --workers http://127.0.0.1:8001,http://127.0.0.1:8002
    python -m serving.router --port 8000 --policy round_robin --workers ...
    python -m serving.router --port 8000 --prefill_workers http://...:8101 --decode_workers http://...:8201,...

Each `/v1/completions`, `/v1/chat/completions`, `/v1/responses` or
`/v1/messages` request is tokenized the way
the workers tokenize it (`router_index.PromptEncoder`), cut into the engine's
chained block digests, and sent to the worker the policy picks
(`router_index.Router`; `kv_aware` by default: the worker whose prefix cache
most likely holds the prompt, weighed against its load). The body goes
upstream unchanged and the answer comes back unchanged: SSE streams are
relayed chunk by chunk as they arrive, never buffered, and when the client
goes away the upstream request is closed, which makes the worker abort it.

Failures: a connection error or an HTTP 5xx from a worker takes it out of
rotation (`router_workers.WorkerPool`; it is probed back in later). If no
byte of the answer has reached the client yet, the request is retried once on
another worker; otherwise a stream ends with an in-band OpenAI error event,
and a request with no worker left gets a 502/503 with OpenAI's error envelope.
4xx answers are the client's fault and pass through untouched.

A Responses turn that continues a stored response (`previous_response_id`), and
`GET` / `DELETE /v1/responses/{id}`, go to the worker that stored it
(`response_owners.ResponseOwners`); when that worker is out of rotation or
fails, the answer is a 404 naming it, never another worker's answer without
the conversation (docs/router.md). The Messages routes answer the router's own
errors in Anthropic's envelope.

Disaggregated mode (`--prefill_workers` and `--decode_workers`): the prefill
worker is chosen `kv_aware` within the prefill pool, the decode worker
least-loaded within the decode pool, and `serving.disaggregation.disagg.run_disaggregated`
runs the request across the pair; its KV shipping bytes and seconds go to the
router's metrics. Responses and Messages requests are served whole by a decode
worker (least loaded).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import urllib.parse
from typing import Awaitable, Callable, Optional, Sequence

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from serving.api import http_protocol as P
from serving.api.http_util import ClientGone, until_disconnect as _watch
from serving.api.messages_api import error_body as anthropic_error_body
from serving.routing.router_index import POLICIES, PrefixIndex, PromptEncoder, Router
from serving.routing.router_metrics import RouterMetrics
from serving.routing.response_owners import DEFAULT_MAX_ENTRIES, ResponseOwners, StreamIdScanner, response_id_of
from serving.routing.router_workers import WorkerPool

log = logging.getLogger("ridgeline.router")

DEFAULT_PAGE_SIZE = 16  # the server's default --page_size, until a worker reports its own

# The pooling routes (`serving.api.pooling_routes`), by endpoint name: an embedding's inputs route by their
# prefix as a completion's prompt does (last-token pooling reuses cached pages).
POOLING_ENDPOINTS = {"embeddings": "/v1/embeddings", "pooling": "/pooling", "classify": "/classify", "score": "/score",
                     "rerank": "/rerank", "rerank_v1": "/v1/rerank", "rerank_v2": "/v2/rerank"}
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "responses": "/v1/responses",
             "messages": "/v1/messages", "count_tokens": "/v1/messages/count_tokens", **POOLING_ENDPOINTS}
# Served whole by one worker, in disaggregated mode too (by a decode worker): the KV shipping routes
# take completions and chat only.
WHOLE = frozenset({"responses", "messages", "count_tokens", *POOLING_ENDPOINTS})
# Request headers that go upstream: the API key (OpenAI's or Anthropic's header) and Anthropic's version.
FORWARDED_HEADERS = ("authorization", "x-api-key", "anthropic-version", "anthropic-beta")

# serving.disaggregation.disagg.run_disaggregated(client, prefill_url, decode_url, endpoint, body)
#     -> (the decode worker's streaming httpx.Response, KVTransferRecord with kv_bytes and transfer_seconds)
DisaggFn = Callable[[httpx.AsyncClient, str, str, str, dict], Awaitable[tuple]]


class UpstreamFailed(Exception):
    """A worker failed this attempt (connection, 5xx, broken body); `worker` is the one to blame."""

    def __init__(self, worker: str, kind: str, message: str):
        super().__init__(message)
        self.worker, self.kind = worker, kind


@dataclasses.dataclass
class _Attempt:
    """One upstream try: the open response and who to credit or blame."""

    response: httpx.Response
    workers: tuple[str, ...]
    pools: tuple[WorkerPool, ...]
    transfer: Optional[object] = None  # disaggregated mode: the shipping record
    pair: Optional[tuple[str, str]] = None


@dataclasses.dataclass
class _Pinned:
    """A request only one worker can answer: the one that stored response `response_id`."""

    worker: str
    response_id: str
    param: Optional[str]  # the request field holding the id; None where the id is in the path

    def pick(self, service: "RouterService"):
        """(workers, pools, matched blocks) of the attempt; the 404 when the worker is out of rotation."""
        w = service.whole_pool.workers.get(self.worker)
        if w is None or not w.healthy:
            service.metrics.failed.inc()
            raise self.gone("it is out of rotation")
        return (self.worker,), (service.whole_pool,), 0

    def gone(self, why: str) -> P.APIError:
        """The answer when that worker cannot serve: no other worker holds the response, so any other
        answer would be a conversation without its history."""
        return P.APIError(f"Response '{self.response_id}' is stored on worker {self.worker}, which cannot serve "
                          f"it now ({why}); no other worker holds it.", status=404, param=self.param,
                          code="response_worker_unavailable")


def _answered_by(resp: httpx.Response, workers: Sequence[str]) -> str:
    """Which of the attempt's workers sent `resp` (in disaggregated mode, the prefill one may answer)."""
    url = str(resp.request.url) if getattr(resp, "_request", None) is not None else ""
    return next((w for w in workers if url.startswith(w)), workers[-1])


def transfer_figures(record) -> tuple[float, float]:
    """(bytes, seconds) of a KV shipping record, an object or a mapping."""
    def get(*names):
        for n in names:
            v = record.get(n) if isinstance(record, dict) else getattr(record, n, None)
            if v is not None:
                return float(v)
        return 0.0

    return get("kv_bytes", "bytes", "num_bytes"), get("transfer_seconds", "seconds")


class RouterService:
    """The routing state (pools, index, metrics, one shared HTTP client) and the proxying logic."""

    def __init__(self, workers: Sequence[str] = (), *, policy: str = "kv_aware", page_size: Optional[int] = None,
                 encoder: Optional[PromptEncoder] = None, prefill_workers: Sequence[str] = (),
                 decode_workers: Sequence[str] = (), check_interval_s: float = 2.0, load_weight: float = 0.1,
                 kv_weight: float = 0.5, index_blocks_per_worker: int = 4096, connect_timeout_s: float = 5.0,
                 disagg_fn: Optional[DisaggFn] = None, response_owners_max_entries: int = DEFAULT_MAX_ENTRIES):
        self.disaggregated = bool(prefill_workers or decode_workers)
        if self.disaggregated and not (prefill_workers and decode_workers):
            raise ValueError("disaggregated mode needs both --prefill_workers and --decode_workers")
        if self.disaggregated and workers:
            raise ValueError("give either --workers or --prefill_workers/--decode_workers, not both")
        self.metrics = RouterMetrics(policy if not (prefill_workers or decode_workers) else "kv_aware")
        self.encoder = encoder or PromptEncoder()
        self.index = PrefixIndex(index_blocks_per_worker)
        # The block size prefixes are hashed in must be the workers' page size: given, or taken
        # from the first worker that reports one (`ridgeline:kv_cache_page_size`).
        self.page_size_given = page_size is not None
        self.router = Router(policy if not self.disaggregated else "kv_aware", page_size or DEFAULT_PAGE_SIZE,
                             self.index, load_weight, kv_weight)
        self._page_size_learned = False
        self.check_interval_s, self.connect_timeout_s = check_interval_s, connect_timeout_s
        if self.disaggregated:
            self.prefill = WorkerPool(prefill_workers, self.index, self.metrics, "prefill worker")
            self.decode = WorkerPool(decode_workers, None, self.metrics, "decode worker")
            self.decode_router = Router("least_loaded", self.router.page_size, PrefixIndex(1))
            self.pools = [self.prefill, self.decode]
            self.disagg_fn = disagg_fn
        else:
            self.pool = WorkerPool(workers, self.index, self.metrics)
            self.pools = [self.pool]
        # The pool that serves whole requests (`WHOLE`), and which of its workers stored which response.
        self.whole_pool = self.decode if self.disaggregated else self.pool
        self.owners = ResponseOwners(response_owners_max_entries)
        for pool in self.pools:
            pool.on_page_size = self._worker_page_size
            policy = self.decode_router.policy if self.disaggregated and pool is self.decode else self.router.policy
            for w in pool:
                self.metrics.add_worker(w.url, policy)
        self.client: Optional[httpx.AsyncClient] = None
        self._checks: Optional[asyncio.Task] = None

    def _worker_page_size(self, url: str, size: int) -> None:
        """A worker reported its page size: adopt the first one unless --page_size was given;
        warn about any worker whose cache the router's block hashes cannot name."""
        if not self.page_size_given and not self._page_size_learned:
            self._page_size_learned = True
            if size != self.router.page_size:
                log.info("page size %d, as worker %s reports", size, url)
                self.router.page_size = size
                for pool in self.pools:  # entries hashed in the old block size can never match
                    for w in pool:
                        self.index.forget(w.url)
            return
        if size != self.router.page_size:
            log.warning("worker %s has KV pages of %d tokens but the router hashes blocks of %d: prefix-aware "
                        "routing cannot match its cache (start every worker with the same --page_size)", url, size,
                        self.router.page_size)

    # --- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        timeout = httpx.Timeout(connect=self.connect_timeout_s, read=None, write=60.0, pool=None)
        self.client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=1024,
                                                                            max_keepalive_connections=256))
        if self.disaggregated and self.disagg_fn is None:
            from serving.disaggregation.disagg import run_disaggregated  # the worker-side half of disaggregated serving

            self.disagg_fn = run_disaggregated
        for pool in self.pools:
            await pool.check_all(self.client)
        self._checks = asyncio.gather(*(p.run_checks(self.client, self.check_interval_s) for p in self.pools))

    async def stop(self) -> None:
        if self._checks is not None:
            self._checks.cancel()
            await asyncio.gather(self._checks, return_exceptions=True)
        if self.client is not None:
            await self.client.aclose()

    def any_healthy(self) -> bool:
        return all(p.healthy() for p in self.pools)

    # --- one attempt ----------------------------------------------------------------------------

    def _pick(self, prompts, tried: set[str], salt: Optional[str], model: Optional[str] = None,
              endpoint: str = "chat"):
        """(workers, pools, matched blocks) for the next attempt, or None when nobody is left."""
        if self.disaggregated and endpoint in WHOLE:
            d = self.decode_router.choose(self.decode.loads(), prompts, exclude=tried, cache_salt=salt, model=model)
            return None if d is None else ((d.worker,), (self.decode,), 0)
        if not self.disaggregated:
            c = self.router.choose(self.pool.loads(), prompts, exclude=tried, cache_salt=salt, model=model)
            return None if c is None else ((c.worker,), (self.pool,), c.matched_blocks)
        p = self.router.choose(self.prefill.loads(), prompts, exclude=tried, cache_salt=salt, model=model)
        d = self.decode_router.choose(self.decode.loads(), prompts, exclude=tried, cache_salt=salt, model=model)
        if p is None or d is None:
            return None
        return (p.worker, d.worker), (self.prefill, self.decode), p.matched_blocks

    async def _send(self, workers: tuple[str, ...], endpoint: str, body: dict, raw: bytes,
                    headers: dict) -> tuple[httpx.Response, object]:
        if len(workers) == 1:  # a whole request to one worker
            req = self.client.build_request("POST", workers[0] + ENDPOINTS[endpoint], content=raw, headers=headers)
            try:
                return await self.client.send(req, stream=True), None
            except httpx.TransportError as e:
                raise UpstreamFailed(workers[0], "connect", f"{type(e).__name__}: {e}") from e
        try:
            auth = {k: v for k, v in headers.items() if k == "authorization"}
            result = await self.disagg_fn(self.client, workers[0], workers[1], ENDPOINTS[endpoint], body, auth)
        except httpx.TransportError as e:
            url = str(e.request.url) if getattr(e, "_request", None) is not None else ""
            blamed = workers[1] if url.startswith(workers[1]) else workers[0]
            raise UpstreamFailed(blamed, "connect", f"{type(e).__name__}: {e}") from e
        # serving.disaggregation.disagg returns (decode response, KVTransferRecord); the prefill's own response if it refused.
        resp, record = result if isinstance(result, tuple) else (result, getattr(result, "transfer", None))
        return resp, record

    async def _open(self, endpoint: str, body: dict, raw: bytes, headers: dict, prompts,
                    attempts: int = 2, pinned: Optional["_Pinned"] = None) -> _Attempt:
        """Sends the request to a worker, retrying once on another if the first fails before answering;
        a `pinned` request goes to its worker only (another could not answer it), a 404 if that fails."""
        tried: set[str] = set()
        last: Optional[UpstreamFailed] = None
        # The client's salt names its pages on the workers (a salt the workers bind to an API key is not
        # known here: such requests are routed as if unsalted, which costs affinity, not isolation).
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) and body["cache_salt"] else None
        # The model names a LoRA adapter on the workers (or the base): its requests are kept together.
        model = body.get("model") if isinstance(body.get("model"), str) else None
        for attempt in range(attempts if pinned is None else 1):
            picked = self._pick(prompts, tried, salt, model, endpoint) if pinned is None else pinned.pick(self)
            if picked is None:
                break
            workers, pools, matched_blocks = picked
            if attempt:
                self.metrics.retries.inc()
            self._count_routed(endpoint, workers, prompts, matched_blocks, salt, model, pinned)
            self._in_flight(workers, pools, +1)
            try:
                resp, record = await self._send(workers, endpoint, body, raw, headers)
                if resp.status_code >= 500:
                    text = (await resp.aread()).decode("utf-8", "replace")[:500]
                    await resp.aclose()
                    raise UpstreamFailed(_answered_by(resp, workers), "status_5xx", f"HTTP {resp.status_code}: {text}")
                return _Attempt(resp, workers, pools, record, workers if len(workers) == 2 else None)
            except asyncio.CancelledError:  # the client went away while we waited
                self._in_flight(workers, pools, -1)
                raise
            except UpstreamFailed as e:
                self._in_flight(workers, pools, -1)
                self._fail(e)
                if pinned is not None:
                    self.metrics.failed.inc()
                    raise pinned.gone(f"it failed: {e}") from e
                tried.update(workers if len(workers) == 1 else (e.worker,))
                last = e
        self.metrics.failed.inc()
        if last is None and not tried:
            raise P.APIError("no worker is available: every worker is out of rotation", status=503,
                             type="server_error", code="no_worker_available")
        raise P.APIError(f"the request failed upstream{' after a retry' if len(tried) > 1 else ''}: "
                         f"{last.worker}: {last}" if last else "no worker left to retry on",
                         status=502, type="server_error", code="upstream_error")

    def _count_routed(self, endpoint: str, workers: tuple[str, ...], prompts, matched_blocks: int,
                      salt: Optional[str], model: Optional[str], pinned: Optional["_Pinned"]) -> None:
        """Metrics of one routing decision, and the prefix index's record of where the prompt went."""
        prompt_tokens = sum(len(p) for p in prompts)
        whole_in_decode_pool = self.disaggregated and endpoint in WHOLE
        policy = "sticky" if pinned is not None else (
            self.decode_router.policy if whole_in_decode_pool else self.router.policy)
        self.metrics.on_routed(workers[0], prompt_tokens, matched_blocks * self.router.page_size, policy)
        if len(workers) == 2:
            self.metrics.routed.labels(workers[1], self.decode_router.policy).inc()
        if not whole_in_decode_pool and pinned is None:  # the index knows the prefill (or only) pool's caches
            self.router.record(workers[0], prompts, salt, model)

    def _fail(self, e: UpstreamFailed) -> None:
        self.metrics.on_error(e.worker, e.kind)
        for pool in self.pools:
            if e.worker in pool.workers:
                pool.mark_failed(e.worker, str(e))

    def _in_flight(self, workers, pools, delta: int) -> None:
        for url, pool in zip(workers, pools):
            w = pool.workers[url]
            w.in_flight += delta
            self.metrics.in_flight.labels(url).set(w.in_flight)

    def _finish(self, a: _Attempt) -> None:
        self._in_flight(a.workers, a.pools, -1)
        if a.transfer is not None and a.pair is not None:
            n, s = transfer_figures(a.transfer)
            if n > 0:  # nothing was shipped when the prefill worker refused the request
                self.metrics.on_transfer(a.pair[0], a.pair[1], n, s)

    async def _abandon(self, a: _Attempt) -> None:
        await a.response.aclose()
        self._finish(a)

    # --- a whole request -------------------------------------------------------------------------

    async def handle(self, endpoint: str, request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise P.APIError("The request body is not a valid JSON object.", code="invalid_json")
        headers = _upstream_headers(request)
        stream = body.get("stream") is True
        pinned = await self._pin(endpoint, body, headers)
        # A pinned turn's prompt starts with a history only its worker has: no routing needs its tokens.
        prompts = self.encoder.prompts(endpoint, body) if pinned is None else []
        for attempt in range(2):
            # A second pass (the first answer broke before any byte was relayed) is the retry: one attempt only.
            a = await _watch(request, self._open(endpoint, body, raw, headers, prompts, attempts=2 - attempt,
                                                 pinned=pinned), on_orphan=self._abandon)
            try:
                if stream and a.response.status_code == 200:
                    return await self._stream(request, a, self._id_watcher(endpoint, a))
                content = await _watch(request, a.response.aread())
            except ClientGone:
                await a.response.aclose()
                self._finish(a)
                return Response(status_code=499)
            except (httpx.TransportError, httpx.StreamError) as e:  # broke before a byte reached the client
                await a.response.aclose()
                self._finish(a)
                self._fail(UpstreamFailed(a.workers[-1], "stream", f"{type(e).__name__}: {e}"))
                if attempt == 0:
                    self.metrics.retries.inc()
                    continue
                self.metrics.failed.inc()
                raise P.APIError(f"the request failed upstream after a retry: {e}", status=502,
                                 type="server_error", code="upstream_error") from e
            await a.response.aclose()
            self._finish(a)
            if endpoint == "responses" and a.response.status_code == 200:
                self._remember(response_id_of(content), a.workers[-1])
            return Response(content, status_code=a.response.status_code,
                            media_type=a.response.headers.get("content-type"))
        raise AssertionError("unreachable")

    # --- stored responses: sticky routing --------------------------------------------------------

    def _remember(self, response_id: Optional[str], worker: str) -> None:
        if response_id:
            self.owners.remember(response_id, worker)

    def _id_watcher(self, endpoint: str, a: _Attempt) -> Optional[Callable[[bytes], None]]:
        """For a streamed Responses answer: a chunk callback that remembers the response's worker."""
        if endpoint != "responses":
            return None
        scanner = StreamIdScanner()

        def watch(chunk: bytes) -> None:
            if scanner.response_id is None and scanner.feed(chunk):
                self._remember(scanner.response_id, a.workers[-1])

        return watch

    async def _pin(self, endpoint: str, body: dict, headers: dict) -> Optional[_Pinned]:
        """A Responses turn continuing a stored response goes to the worker that stored it."""
        previous = body.get("previous_response_id") if endpoint == "responses" else None
        if not isinstance(previous, str) or not previous:
            return None
        owner = await self.find_owner(previous, headers)
        return None if owner is None else _Pinned(owner, previous, "previous_response_id")

    async def find_owner(self, response_id: str, headers: dict) -> Optional[str]:
        """The worker that stored `response_id`: remembered, else found by asking each worker in rotation
        for it with the client's key (the stores are per key); None when no worker in rotation has it."""
        owner = self.owners.owner(response_id)
        if owner is not None:
            return owner
        path = _stored_path(response_id)
        get_headers = {k: v for k, v in headers.items() if k != "content-type"}

        async def holds(url: str) -> bool:
            try:
                r = await self.client.get(url + path, headers=get_headers, timeout=30)
            except httpx.TransportError:
                return False
            return r.status_code == 200

        healthy = [w.url for w in self.whole_pool.healthy()]
        found = await asyncio.gather(*(holds(u) for u in healthy))
        owner = next((u for u, ok in zip(healthy, found) if ok), None)
        if owner is not None:
            self.owners.remember(response_id, owner)
        return owner

    async def relay_stored(self, method: str, response_id: str, request: Request) -> Response:
        """`GET` or `DELETE /v1/responses/{id}` at the worker holding the response."""
        headers = {k: v for k, v in _upstream_headers(request).items() if k != "content-type"}
        owner = await self.find_owner(response_id, headers)
        if owner is None:
            raise P.APIError(f"No response with id '{response_id}' found.", status=404, code="not_found")
        pinned = _Pinned(owner, response_id, None)
        workers, pools, _ = pinned.pick(self)
        self._in_flight(workers, pools, +1)
        try:
            r = await self.client.request(method, owner + _stored_path(response_id), headers=headers)
        except httpx.TransportError as e:
            failed = UpstreamFailed(owner, "connect", f"{type(e).__name__}: {e}")
            self._fail(failed)
            raise pinned.gone(f"it failed: {failed}") from e
        finally:
            self._in_flight(workers, pools, -1)
        if method == "DELETE" and r.status_code == 200:
            self.owners.forget(response_id)
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    async def _stream(self, request: Request, a: _Attempt,
                      on_chunk: Optional[Callable[[bytes], None]] = None) -> Response:
        """Relays an SSE answer; the first chunk is awaited here so a failure before it can still be retried.
        `on_chunk` sees every chunk as it passes (it must not hold it up)."""
        chunks = a.response.aiter_raw()
        try:
            first = await _watch(request, chunks.__anext__())  # TransportError here: the caller retries
        except StopAsyncIteration:
            first = b""

        async def relay():
            try:
                if on_chunk is not None:
                    on_chunk(first)
                yield first
                async for chunk in chunks:
                    if on_chunk is not None:
                        on_chunk(chunk)
                    yield chunk
            except (httpx.TransportError, httpx.StreamError) as e:
                self._fail(UpstreamFailed(a.workers[-1], "stream", f"{type(e).__name__}: {e}"))
                self.metrics.failed.inc()
                err = P.error_body(f"the worker failed mid-stream: {e}", type="server_error", code="upstream_error")
                yield f"\ndata: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
            finally:  # also on client disconnect: closing the upstream makes the worker abort the request
                await a.response.aclose()
                self._finish(a)

        return StreamingResponse(relay(), status_code=200,
                                 media_type=a.response.headers.get("content-type", "text/event-stream"))


def _stored_path(response_id: str) -> str:
    """A worker's path of one stored response (the id quoted: it comes from the client)."""
    return "/v1/responses/" + urllib.parse.quote(response_id, safe="")


def _upstream_headers(request: Request) -> dict:
    """The headers a relayed request carries: JSON, and the client's key and API version."""
    headers = {"content-type": "application/json"}
    for name in FORWARDED_HEADERS:
        if name in request.headers:
            headers[name] = request.headers[name]
    return headers


def create_router_app(service: RouterService) -> FastAPI:
    """The router's FastAPI app; its lifespan starts the service (client, first scrape, checks) and stops it."""

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(title="Ridgeline router", lifespan=lifespan)
    app.state.service = service

    @app.exception_handler(P.APIError)
    async def _api_error(_request, err: P.APIError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            return await service.handle("completions", request)
        except ClientGone:
            return Response(status_code=499)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        try:
            return await service.handle("chat", request)
        except ClientGone:
            return Response(status_code=499)

    @app.post("/v1/responses")
    async def responses(request: Request):
        try:
            return await service.handle("responses", request)
        except ClientGone:
            return Response(status_code=499)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request):
        return await service.relay_stored("GET", response_id, request)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request):
        return await service.relay_stored("DELETE", response_id, request)

    async def anthropic(endpoint: str, request: Request) -> Response:
        """The Messages routes answer the router's own errors in Anthropic's envelope, as a worker does."""
        try:
            return await service.handle(endpoint, request)
        except ClientGone:
            return Response(status_code=499)
        except P.APIError as e:
            return JSONResponse(anthropic_error_body(e), status_code=e.status)

    @app.post("/v1/messages")
    async def messages(request: Request):
        return await anthropic("messages", request)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        return await anthropic("count_tokens", request)

    def pooling_route(endpoint: str):
        async def relay(request: Request):
            try:
                return await service.handle(endpoint, request)
            except ClientGone:
                return Response(status_code=499)
        return relay

    for endpoint, path in POOLING_ENDPOINTS.items():
        app.post(path)(pooling_route(endpoint))

    @app.get("/v1/models")
    async def models():
        for pool in service.pools[-1:]:
            for w in pool.healthy():
                try:
                    r = await service.client.get(w.url + "/v1/models", timeout=10)
                    return Response(r.content, status_code=r.status_code, media_type="application/json")
                except httpx.TransportError:
                    continue
        raise P.APIError("no worker is available", status=503, type="server_error", code="no_worker_available")

    @app.get("/health")
    async def health():
        if service.any_healthy():
            return Response(status_code=200)
        return JSONResponse(P.error_body("no worker is in rotation", type="server_error",
                                         code="no_worker_available"), status_code=503)

    @app.get("/metrics")
    async def metrics_route():
        body, content_type = service.metrics.render()
        return Response(body, media_type=content_type)

    return app


def _split(urls: str | None) -> list[str]:
    return [u.strip() for u in (urls or "").split(",") if u.strip()]


def main(argv) -> None:
    del argv
    import uvicorn
    from absl import flags

    F = flags.FLAGS
    level = getattr(logging, F.log_level.upper())
    logging.getLogger().setLevel(level)
    if level > logging.DEBUG:  # one line per scrape and upstream request only when debugging
        logging.getLogger("httpx").setLevel(max(level, logging.WARNING))
    service = RouterService(_split(F.workers), policy=F.policy, page_size=F.page_size,
                            encoder=PromptEncoder(F.model_dir), prefill_workers=_split(F.prefill_workers),
                            decode_workers=_split(F.decode_workers), check_interval_s=F.check_interval_s,
                            load_weight=F.load_weight, kv_weight=F.kv_weight,
                            index_blocks_per_worker=F.index_blocks_per_worker,
                            response_owners_max_entries=F.response_owners_max_entries)
    app = create_router_app(service)
    log.info("routing (%s) on http://%s:%d over %s", F.policy, F.host, F.port,
             ", ".join(w.url for pool in service.pools for w in pool))
    uvicorn.run(app, host=F.host, port=F.port, log_level=F.log_level, timeout_keep_alive=30)


def define_flags() -> None:
    from absl import flags

    flags.DEFINE_string("workers", None, "Comma-separated worker base URLs (python -m serving.server replicas).")
    flags.DEFINE_string("prefill_workers", None, "Disaggregated mode: comma-separated prefill worker URLs.")
    flags.DEFINE_string("decode_workers", None, "Disaggregated mode: comma-separated decode worker URLs.")
    flags.DEFINE_enum("policy", "kv_aware", list(POLICIES), "How a worker is chosen.")
    flags.DEFINE_string("host", "127.0.0.1", "Address to bind.")
    flags.DEFINE_integer("port", 8000, "Port to listen on.")
    flags.DEFINE_string("model_dir", None, "Checkpoint directory the workers serve (for its tokenizer and chat "
                                           "template); default: the embedded model.")
    flags.DEFINE_integer("page_size", None, "The workers' KV page size (--page_size of serving.server); "
                         "default: what the first worker reports on /metrics.")
    flags.DEFINE_float("check_interval_s", 2.0, "Seconds between scrapes of the workers' /metrics (and probes "
                                                "of failed workers).")
    flags.DEFINE_float("load_weight", 0.1, "kv_aware: cost of one request of load, in prompts recomputed.")
    flags.DEFINE_float("kv_weight", 0.5, "kv_aware: cost of a full KV pool, in prompts recomputed.")
    flags.DEFINE_integer("index_blocks_per_worker", 4096, "Prefix-index bound per worker until its /metrics "
                                                         "gives its pool size in pages.")
    flags.DEFINE_integer("response_owners_max_entries", DEFAULT_MAX_ENTRIES,
                         "Stored /v1/responses ids whose worker the router remembers (least recently used "
                         "forgotten first; a forgotten id is looked up by asking the workers).")
    flags.DEFINE_enum("log_level", "info", ["debug", "info", "warning", "error"], "Log level.")


def run() -> None:
    from absl import app as absl_app

    define_flags()
    absl_app.run(main)


if __name__ == "__main__":
    run()
