"""The router against fake workers, in-process: index, policies, proxying, failures, disconnects, metrics."""

import asyncio
import json
import logging
import os
import subprocess
import sys
import threading
import time
import types

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from model.tokenizer import load_tokenizer
from serving.core.block_manager import BlockManager, block_digest, salt_digest
from serving.api.chat_template import encode_chat
from serving.llm import default_checkpoint_dir
from serving.router import RouterService, create_router_app, transfer_figures
from serving.routing.router_index import (IMAGE_MARK, PrefixIndex, PromptEncoder, Router, WorkerLoad, block_hashes,
                                          image_digest)
from serving.routing.router_workers import parse_worker_metrics
from serving.server import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# --- imports -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("code", [
    "import serving.router, sys; assert 'jax' not in sys.modules",
    # Running: the router's prompt encoder loads the tokenizer and tokenizes a completion and a chat.
    "import sys; from serving.router import RouterService; from serving.routing.router_index import PromptEncoder; "
    "e = PromptEncoder(); assert e.prompts('completions', {'prompt': 'hi'}) and e.prompts('chat', "
    "{'model': 'm', 'messages': [{'role': 'user', 'content': 'hi'}]}); "
    "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if m.startswith('jax'))[:5]",
], ids=["import", "prompt_encoder"])
def test_the_router_runs_without_jax(code):
    """A router only relays requests: it must not pay for (or need) jax. A fresh interpreter, since this
    one imported jax long ago."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_old_import_paths_still_work():
    import serving
    from serving import LLM, SamplingParams  # noqa: F401
    from serving.api.http_app import ClientGone, primed_stream, until_disconnect
    from serving.api import http_util

    assert (ClientGone, primed_stream, until_disconnect) == (http_util.ClientGone, http_util.primed_stream,
                                                            http_util.until_disconnect)
    assert set(serving.__all__) <= set(dir(serving))
    for name in serving.__all__:
        assert getattr(serving, name).__name__ == name
    with pytest.raises(AttributeError):
        serving.no_such_name  # noqa: B018


# --- index and policies ------------------------------------------------------------------------------


class _Seq:
    def __init__(self, tokens):
        self.token_ids, self.block_hashes, self.num_tokens = list(tokens), [], len(tokens)
        self.hash_root = None


def test_block_hashes_are_the_engines_page_names():
    tokens = [7, 300, 12, 5, 99, 1, 2, 3, 4, 5, 6, 250, 17]
    bm = BlockManager(num_pages=8, page_size=4)
    assert block_hashes(tokens, 4) == bm._hashes_upto(_Seq(tokens), 3)
    assert block_hashes(tokens, 4)[1] == block_digest(block_digest(None, tokens[:4]), tokens[4:8])
    assert block_hashes(tokens[:3], 4) == []
    salted = _Seq(tokens)
    salted.hash_root = salt_digest("tenant")
    assert block_hashes(tokens, 4, "tenant") == bm._hashes_upto(salted, 3) != block_hashes(tokens, 4)


def test_prompt_encoder_tokenizes_like_the_worker():
    enc = PromptEncoder()  # the embedded model's directory, as the workers load it
    tok = load_tokenizer(default_checkpoint_dir(), 320)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo"}]
    assert enc.prompts("chat", {"messages": messages}) == [encode_chat(messages, tok, True)]
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert enc.prompts("chat", {"messages": parts}) == [encode_chat([{"role": "user", "content": "ab"}], tok)]
    assert enc.prompts("completions", {"prompt": "abc"}) == [tok.encode("abc")]
    assert enc.prompts("completions", {"prompt": [1, 2, 3]}) == [[1, 2, 3]]
    assert enc.prompts("completions", {"prompt": ["x", [4, 5]]}) == [tok.encode("x"), [4, 5]]
    assert enc.prompts("chat", {"messages": "not a list"}) == []  # the worker will answer the 400
    # Tools are rendered as the worker renders them (the embedded template lists their names).
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    with_tools = enc.prompts("chat", {"messages": messages, "tools": tools})
    assert with_tools == [encode_chat(messages, tok, True, tools)] != enc.prompts("chat", {"messages": messages})
    # Responses and Messages bodies are routed by the chat they become.
    user = [{"role": "user", "content": "héllo"}]
    assert enc.prompts("responses", {"model": "m", "input": "héllo", "instructions": "be brief"}) == \
        enc.prompts("chat", {"messages": messages})
    assert enc.prompts("messages", {"model": "m", "max_tokens": 4, "messages": user}) == \
        [encode_chat(user, tok, True)]


def test_index_matches_chains_and_evicts_least_recently_routed():
    idx = PrefixIndex(default_capacity=4)
    a, b = block_hashes(list(range(16)), 4), block_hashes([9] * 4 + list(range(4, 16)), 4)
    idx.record("w", a)
    assert idx.overlap("w", a) == 4 and idx.overlap("w", a[:2]) == 2
    assert idx.overlap("w", b) == 0  # a different first block: the chain breaks at once
    assert idx.overlap("v", a) == 0
    idx.record("w", b[:2])  # capacity 4: a's two coldest blocks go
    assert idx.size("w") == 4 and idx.overlap("w", a) == 0 and idx.overlap("w", b) == 2
    idx.set_capacity("w", 100)
    idx.record("w", a)
    assert idx.overlap("w", a) == 4 and idx.overlap("w", b) == 2
    idx.forget("w")
    assert idx.overlap("w", a) == 0


def _workers(n, **kw):
    return [WorkerLoad(f"http://w{i}", **kw) for i in range(n)]


def test_round_robin_cycles_over_healthy_workers():
    r = Router("round_robin", page_size=4)
    ws = _workers(3)
    assert [r.choose(ws, [[1] * 20]).worker for _ in range(6)] == ["http://w0", "http://w1", "http://w2"] * 2
    ws[1].healthy = False
    picks = {r.choose(ws, [[1] * 20]).worker for _ in range(4)}
    assert picks == {"http://w0", "http://w2"}
    assert r.choose(ws, [[1]], exclude=["http://w0", "http://w2"]) is None


def test_least_loaded_takes_the_emptiest_worker():
    r = Router("least_loaded", page_size=4)
    ws = _workers(3)
    ws[0].in_flight, ws[1].running, ws[1].waiting, ws[2].in_flight = 3, 1, 1, 1
    assert r.choose(ws, [[1] * 8]).worker == "http://w2"
    ws[2].waiting = 5  # the scrape saw a queue the router did not cause
    assert r.choose(ws, [[1] * 8]).worker == "http://w1"


def test_kv_aware_follows_the_prefix_until_load_outweighs_it():
    r = Router("kv_aware", page_size=4, load_weight=0.1)
    ws = _workers(3)
    turn1 = list(range(1, 30))
    first = r.choose(ws, [turn1])
    assert first.matched_blocks == 0
    r.record(first.worker, [turn1])
    turn2 = turn1 + list(range(40, 60))
    for _ in range(5):  # every later turn, whatever the rotation, goes where turn 1 went
        c = r.choose(ws, [turn2])
        assert c.worker == first.worker and c.matched_blocks == len(turn1) // 4
    holder = next(w for w in ws if w.url == first.worker)
    holder.in_flight = 20  # 20 * 0.1 = 2 prompts' worth of load outweighs recomputing one prompt
    assert r.choose(ws, [turn2]).worker != first.worker
    holder.in_flight, holder.kv_usage = 0, 0.0
    holder.healthy = False
    assert r.choose(ws, [turn2]).worker != first.worker


def test_kv_aware_keeps_an_adapters_requests_together():
    """The request's model (a LoRA adapter's name on the workers) keys its blocks: an adapter's next turn
    follows its first, and another adapter's (or the base model's) identical prompt matches nothing there."""
    r = Router("kv_aware", page_size=4, load_weight=0.1)
    ws = _workers(3)
    prompt = list(range(1, 30))
    first = r.choose(ws, [prompt], model="sql")
    r.record(first.worker, [prompt], model="sql")
    assert r.choose(ws, [prompt + [7, 8, 9, 10]], model="sql").matched_blocks == len(prompt) // 4
    assert r.choose(ws, [prompt + [7]], model="sql").worker == first.worker
    assert r.choose(ws, [prompt], model="chat").matched_blocks == 0
    assert r.choose(ws, [prompt]).matched_blocks == 0
    assert block_hashes(prompt, 4, model="sql") != block_hashes(prompt, 4, model="chat") != block_hashes(prompt, 4)
    assert block_hashes(prompt, 4, "tenant", "sql") != block_hashes(prompt, 4, None, "sql")


def _image_chat(url: str, turn: str = "") -> dict:
    content = [{"type": "text", "text": "describe this picture in one line"}, {"type": "image_url", "image_url": {"url": url}},
               {"type": "text", "text": "and name its colours" + turn}]
    return {"model": "vl", "messages": [{"role": "user", "content": content}]}


def test_image_digests_enter_the_routing_chain():
    """An image part is one mark in the routed ids; its digest keys the block holding it and, through the
    chain, every block after: same text with another image matches only the blocks before the image, the
    same image matches past it (as a worker's prefix cache does, `Sequence.block_extra`)."""
    enc = PromptEncoder()
    a, b = "data:image/png;base64,iVBORw0KGgoAAAA=", "data:image/png;base64,iVBORw0KGgoBBBB="
    (pa,), (pb,) = enc.prompts("chat", _image_chat(a)), enc.prompts("chat", _image_chat(b))
    assert list(pa) == list(pb) and pa.images == (image_digest(a),) and pb.images == (image_digest(b),)
    mark = pa.index(IMAGE_MARK)
    assert pa.count(IMAGE_MARK) == 1 and mark > 8

    # The same chain as the block manager's, where the image's digest is the block's extra.
    seq = _Seq(pa)
    seq.block_extra = lambda start, end: pa.images[0] if start <= mark < end else b""
    n = len(pa) // 4
    assert block_hashes(pa, 4, images=pa.images) == BlockManager(num_pages=64, page_size=4)._hashes_upto(seq, n)

    ha, hb = block_hashes(pa, 4, images=pa.images), block_hashes(pb, 4, images=pb.images)
    before = mark // 4  # the blocks wholly before the image
    assert ha[:before] == hb[:before] and all(x != y for x, y in zip(ha[before:], hb[before:]))

    r = Router("kv_aware", page_size=4, load_weight=0.1)
    ws = _workers(3)
    first = r.choose(ws, [pa])
    r.record(first.worker, [pa])
    (later,) = enc.prompts("chat", _image_chat(a, " and its shapes"))
    same = r.choose(ws, [later])
    assert same.worker == first.worker and same.matched_blocks > before
    assert r.choose(ws, [pb]).matched_blocks == before


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown policy 'random'"):
        Router("random", page_size=16)


def test_worker_metrics_are_parsed():
    text = ('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m",engine="0"} 2.0\n'
            '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name="m",engine="0"} 5.0\n'
            '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name="m",engine="0"} 0.25\n'
            '# TYPE ridgeline:kv_cache_pages_total gauge\nridgeline:kv_cache_pages_total{model_name="m"} 64.0\n'
            '# TYPE ridgeline:kv_cache_page_size gauge\nridgeline:kv_cache_page_size{model_name="m"} 8.0\n')
    assert parse_worker_metrics(text) == {"running": 2, "waiting": 5, "kv_usage": 0.25, "pages_total": 64,
                                          "page_size": 8}


def test_page_size_comes_from_the_workers_unless_given(caplog):
    service = RouterService(["http://a", "http://b"])
    assert service.router.page_size == 16  # the server's default, until a worker reports
    service.index.record("http://a", [b"x", b"y"])  # hashed in blocks of 16: useless once the size changes
    service.pool._mark_up("http://a", {"page_size": 4})
    assert service.router.page_size == 4 and service.index.overlap("http://a", [b"x"]) == 0
    with caplog.at_level(logging.WARNING, logger="ridgeline.router"):
        service.pool._mark_up("http://b", {"page_size": 8})  # disagrees with the first worker
    assert service.router.page_size == 4 and "worker http://b has KV pages of 8 tokens" in caplog.text

    given = RouterService(["http://a"], page_size=16)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ridgeline.router"):
        given.pool._mark_up("http://a", {"page_size": 4})
    assert given.router.page_size == 16 and "has KV pages of 4 tokens" in caplog.text


def test_transfer_figures_read_objects_and_mappings():
    rec = types.SimpleNamespace(kv_bytes=4096, payload_bytes=5000, prefill_seconds=3.0, transfer_seconds=0.5)
    assert transfer_figures(rec) == (4096.0, 0.5)
    assert transfer_figures({"kv_bytes": 10, "transfer_seconds": 2}) == (10.0, 2.0)


# --- fake workers over HTTP ---------------------------------------------------------------------------


class FakeWorker:
    """A worker speaking the server's HTTP surface, with knobs to make it fail or hold a stream open."""

    def __init__(self, name):
        self.name, self.mode, self.healthy = name, "ok", True
        self.draining = False  # as a real server drains: /health and new requests 503, /metrics open
        self.requests: list[dict] = []
        self.release = threading.Event()  # a held stream sends its rest once set
        self.stream_closed = threading.Event()  # the stream generator ended (finished or cancelled)
        self.hold = False
        app = FastAPI()

        @app.get("/health")
        async def health():
            return Response(status_code=200 if self.healthy and not self.draining else 503)

        @app.get("/metrics")
        async def metrics():
            if not self.healthy:
                return Response(status_code=503)
            return Response('# TYPE ridgeline:kv_cache_pages_total gauge\n'
                            'ridgeline:kv_cache_pages_total{model_name="m"} 64.0\n')

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

        async def answer(request: Request, kind: str):
            body = await request.json()
            self.requests.append(body)
            if self.draining:
                return JSONResponse({"error": {"message": "shutting down", "type": "server_error",
                                               "code": "server_shutting_down"}}, status_code=503)
            if self.mode == "500":
                return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, status_code=500)
            if self.mode == "400":
                return JSONResponse({"error": {"message": "bad", "type": "invalid_request_error"}}, status_code=400)
            if not body.get("stream"):
                return {"worker": self.name, "kind": kind}

            async def events():
                try:
                    yield f"data: {json.dumps({'worker': self.name, 'i': 0})}\n\n"
                    if self.hold:
                        while not self.release.is_set():
                            await asyncio.sleep(0.02)
                    if self.mode == "die_mid_stream":
                        raise RuntimeError("worker crashed")
                    for i in range(1, 4):
                        yield f"data: {json.dumps({'worker': self.name, 'i': i})}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    self.stream_closed.set()

            return StreamingResponse(events(), media_type="text/event-stream")

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await answer(request, "completions")

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await answer(request, "chat")

        @app.post("/v1/embeddings")
        async def embeddings(request: Request):
            return await answer(request, "embeddings")

        @app.post("/v2/rerank")
        async def rerank(request: Request):
            return await answer(request, "rerank_v2")

        self.stored: dict[str, dict] = {}  # response id -> the response, as a worker's store keeps it
        self.headers: list[dict] = []  # the headers of each Responses / Messages request

        def not_found(response_id):
            return JSONResponse({"error": {"message": f"No response with id '{response_id}' found.",
                                           "type": "invalid_request_error", "code": "not_found"}}, status_code=404)

        @app.post("/v1/responses")
        async def responses(request: Request):
            body = await request.json()
            self.requests.append(body)
            self.headers.append(dict(request.headers))
            if self.mode == "500":
                return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, status_code=500)
            previous = body.get("previous_response_id")
            if previous is not None and previous not in self.stored:
                return not_found(previous)
            response = _fake_response(f"resp_{self.name}{len(self.stored)}", f"from {self.name}", previous)
            self.stored[response["id"]] = response
            if not body.get("stream"):
                return response
            return StreamingResponse(_response_events(response), media_type="text/event-stream")

        @app.get("/v1/responses/{response_id}")
        async def get_response(response_id: str):
            return self.stored[response_id] if response_id in self.stored else not_found(response_id)

        @app.delete("/v1/responses/{response_id}")
        async def delete_response(response_id: str):
            if self.stored.pop(response_id, None) is None:
                return not_found(response_id)
            return {"id": response_id, "object": "response.deleted", "deleted": True}

        @app.post("/v1/messages")
        async def messages(request: Request):
            body = await request.json()
            self.requests.append(body)
            self.headers.append(dict(request.headers))
            message = _fake_message(f"msg_{self.name}", f"from {self.name}")
            if not body.get("stream"):
                return message
            return StreamingResponse(_message_events(message), media_type="text/event-stream")

        @app.post("/v1/messages/count_tokens")
        async def count_tokens(request: Request):
            self.requests.append(await request.json())
            return {"input_tokens": 7}

        self.server = _Served(app)
        self.url = self.server.url


def _fake_response(response_id: str, text: str, previous=None) -> dict:
    """A completed Responses answer as a worker sends it (the fields the official client reads)."""
    return {"id": response_id, "object": "response", "created_at": 0, "model": "fake", "status": "completed",
            "previous_response_id": previous, "output": [
                {"type": "message", "id": "msg_0", "role": "assistant", "status": "completed",
                 "content": [{"type": "output_text", "text": text, "annotations": []}]}],
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
            "usage": {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2,
                      "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}}


async def _response_events(response: dict):
    text = response["output"][0]["content"][0]["text"]
    events = [("response.created", {"response": {**response, "status": "in_progress", "output": []}}),
              ("response.output_text.delta", {"item_id": "msg_0", "output_index": 0, "content_index": 0,
                                              "delta": text}),
              ("response.completed", {"response": response})]
    for i, (kind, fields) in enumerate(events):
        yield f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': i, **fields})}\n\n"
        await asyncio.sleep(0)


def _fake_message(message_id: str, text: str) -> dict:
    """A Messages answer as a worker sends it."""
    return {"id": message_id, "type": "message", "role": "assistant", "model": "fake",
            "content": [{"type": "text", "text": text}], "stop_reason": "end_turn", "stop_sequence": None,
            "usage": {"input_tokens": 1, "output_tokens": 1}}


async def _message_events(message: dict):
    text = message["content"][0]["text"]
    events = [("message_start", {"message": {**message, "content": [], "stop_reason": None}}),
              ("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
              ("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}}),
              ("content_block_stop", {"index": 0}),
              ("message_delta", {"delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                 "usage": {"output_tokens": 1}}),
              ("message_stop", {})]
    for kind, fields in events:
        yield f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"
        await asyncio.sleep(0)


class _Served:
    """uvicorn on a background thread."""

    def __init__(self, app):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def fleet():
    """Two fake workers and a kv_aware router over them (page size 4; checks every 0.2 s)."""
    workers = [FakeWorker("a"), FakeWorker("b")]
    made = []

    def make(policy="kv_aware", urls=None, check_interval_s=0.2, **kw):
        service = RouterService([w.url for w in workers] if urls is None else urls, policy=policy, page_size=4,
                                check_interval_s=check_interval_s, **kw)
        served = _Served(create_router_app(service))
        made.append(served)
        return service, served.url

    yield workers, make
    for s in made:
        s.stop()
    for w in workers:
        w.server.stop()


def _chat(*turns):
    return {"messages": [{"role": "user", "content": t} for t in turns], "max_tokens": 4}


def test_conversation_sticks_to_one_worker_and_hit_rate_is_counted(fleet):
    workers, make = fleet
    service, url = make()
    first = httpx.post(url + "/v1/chat/completions", json=_chat("hello there, this is turn one"), timeout=10)
    assert first.status_code == 200
    owner = first.json()["worker"]
    for n in range(2, 6):
        turns = [f"turn {i} of a long conversation" for i in range(n)]
        r = httpx.post(url + "/v1/chat/completions", json=_chat("hello there, this is turn one", *turns), timeout=10)
        assert r.json()["worker"] == owner
    metrics = httpx.get(url + "/metrics").text
    assert 'ridgeline:router_requests_routed_total{policy="kv_aware",worker="%s"} 5.0' % (
        next(w.url for w in workers if w.name == owner)) in metrics
    hit = float(next(line.split()[-1] for line in metrics.splitlines()
                     if line.startswith("ridgeline:router_prefix_hit_rate ")))
    assert 0.3 < hit < 1.0  # turns 2-5 matched their earlier turns; turn 1 matched nothing


def test_embedding_inputs_route_by_prefix_and_rerank_is_relayed(fleet):
    workers, make = fleet
    _, url = make()
    long = "a shared document prefix long enough to fill several pages of the cache " * 3
    owner = httpx.post(url + "/v1/embeddings", json={"input": long + "one"}, timeout=10).json()
    assert owner["kind"] == "embeddings"
    for tail in ("two", "three", "four"):  # the same prefix: the worker that holds its pages
        assert httpx.post(url + "/v1/embeddings", json={"input": [long + tail]}, timeout=10).json() == owner
    r = httpx.post(url + "/v2/rerank", json={"query": "q", "documents": ["d"]}, timeout=10)
    assert r.status_code == 200 and r.json()["kind"] == "rerank_v2"
    assert sum(len(w.requests) for w in workers) == 5


def test_round_robin_spreads_and_client_errors_pass_through(fleet):
    workers, make = fleet
    _, url = make("round_robin")
    seen = [httpx.post(url + "/v1/completions", json={"prompt": "same prompt"}, timeout=10).json()["worker"]
            for _ in range(4)]
    assert sorted(seen) == ["a", "a", "b", "b"]
    workers[0].mode = workers[1].mode = "400"
    r = httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["message"] == "bad"
    r = httpx.post(url + "/v1/completions", content=b"{not json", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_a_failing_worker_is_retried_around_taken_out_and_probed_back(fleet):
    workers, make = fleet
    service, url = make("round_robin")
    workers[0].mode, workers[0].healthy = "500", False
    for _ in range(4):
        r = httpx.post(url + "/v1/completions", json={"prompt": "p"}, timeout=10)
        assert r.status_code == 200 and r.json()["worker"] == "b"
    assert not service.pool.workers[workers[0].url].healthy
    m = httpx.get(url + "/metrics").text
    assert f'ridgeline:router_worker_healthy{{worker="{workers[0].url}"}} 0.0' in m
    workers[0].mode, workers[0].healthy = "ok", True
    deadline = time.monotonic() + 10
    while not service.pool.workers[workers[0].url].healthy:  # the prober brings it back
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert {httpx.post(url + "/v1/completions", json={"prompt": "p"}, timeout=10).json()["worker"]
            for _ in range(4)} == {"a", "b"}


def test_a_draining_worker_leaves_rotation_and_its_requests_are_retried_elsewhere(fleet):
    workers, make = fleet
    # The prober reads /health, not only /metrics (which a draining worker still answers).
    service, _ = make("round_robin")
    workers[0].draining = True
    deadline = time.monotonic() + 10
    while service.pool.workers[workers[0].url].healthy:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert workers[0].requests == []  # taken out before any request reached it
    workers[0].draining = False
    # A request that reaches a draining worker before any probe (none for a minute here) gets its 503, and the
    # router sends it to the other worker instead: the client never sees the drain.
    service, url = make("round_robin", check_interval_s=60)
    workers[1].draining = True
    answers = [httpx.post(url + "/v1/completions", json={"prompt": f"p{i}"}, timeout=10) for i in range(4)]
    assert [(r.status_code, r.json()["worker"]) for r in answers] == [(200, "a")] * 4
    assert workers[1].requests  # it was tried, and refused
    assert "ridgeline:router_retries_total 1.0" in httpx.get(url + "/metrics").text


def test_a_dead_worker_is_routed_around_and_no_worker_is_a_clean_503(fleet):
    workers, make = fleet
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    service, url = make("round_robin", urls=[dead, workers[1].url])
    for _ in range(3):
        r = httpx.post(url + "/v1/completions", json={"prompt": "p", "stream": True}, timeout=10)
        assert r.status_code == 200 and '"worker": "b"' in r.text
    workers[1].mode, workers[1].healthy = "500", False  # its health check fails too: it stays out
    r = httpx.post(url + "/v1/completions", json={"prompt": "p"}, timeout=10)
    assert r.status_code in (502, 503) and r.json()["error"]["type"] == "server_error"
    r = httpx.post(url + "/v1/completions", json={"prompt": "p"}, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker_available"
    assert httpx.get(url + "/health").status_code == 503
    m = httpx.get(url + "/metrics").text
    assert "ridgeline:router_upstream_errors_total" in m and "ridgeline:router_requests_failed_total 2.0" in m


def test_a_connection_error_is_retried_once_on_another_worker(fleet):
    workers, make = fleet
    dead = f"http://127.0.0.1:{free_port()}"
    service, url = make("round_robin", urls=[workers[0].url, dead], check_interval_s=60)
    service.pool.workers[dead].healthy = True  # as if the worker died after its last check
    for _ in range(2):
        r = httpx.post(url + "/v1/completions", json={"prompt": "p"}, timeout=10)
        assert r.status_code == 200 and r.json()["worker"] == "a"
    assert "ridgeline:router_retries_total 1.0" in httpx.get(url + "/metrics").text


def test_streams_are_relayed_unbuffered_and_disconnects_close_the_upstream(fleet):
    workers, make = fleet
    _, url = make("round_robin", urls=[workers[0].url])
    w = workers[0]
    w.hold = True
    with httpx.Client(timeout=10) as client:
        with client.stream("POST", url + "/v1/completions", json={"prompt": "p", "stream": True}) as r:
            first = next(r.iter_lines())
            assert json.loads(first[len("data: "):]) == {"worker": "a", "i": 0}  # while the worker holds the rest
        # leaving the block closed the connection
    assert w.stream_closed.wait(10), "the worker's stream was not cancelled"
    w.hold, w.stream_closed = False, threading.Event()
    w.mode = "die_mid_stream"
    r = httpx.post(url + "/v1/completions", json={"prompt": "p", "stream": True}, timeout=10)
    assert r.status_code == 200
    events = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[0][6:])["i"] == 0
    assert json.loads(events[-2][6:])["error"]["code"] == "upstream_error" and events[-1] == "data: [DONE]"


def test_disaggregated_mode_uses_both_pools_and_records_transfers(fleet):
    workers, make = fleet
    calls = []

    async def fake_disagg(client, prefill_url, decode_url, endpoint, body, headers=None):
        calls.append((prefill_url, decode_url, endpoint))
        req = client.build_request("POST", decode_url + endpoint, json=body)
        # serving.disaggregation.disagg's record: kv_bytes and transfer_seconds (among others)
        return await client.send(req, stream=True), types.SimpleNamespace(kv_bytes=1000, transfer_seconds=0.01,
                                                                           num_tokens=10)

    service, url = make(urls=[], prefill_workers=[workers[0].url], decode_workers=[workers[1].url],
                        disagg_fn=fake_disagg)
    for stream in (False, True):
        r = httpx.post(url + "/v1/chat/completions", json={**_chat("hi"), "stream": stream}, timeout=10)
        assert r.status_code == 200 and '"b"' in r.text
    assert calls == [(workers[0].url, workers[1].url, "/v1/chat/completions")] * 2
    m = httpx.get(url + "/metrics").text
    assert (f'ridgeline:router_kv_transfer_bytes_total{{decode="{workers[1].url}",prefill="{workers[0].url}"}} '
            '2000.0') in m
    assert "ridgeline:router_kv_transfer_seconds_count 2.0" in m
    assert f'ridgeline:router_requests_routed_total{{policy="least_loaded",worker="{workers[1].url}"}} 2.0' in m
    assert f'ridgeline:router_requests_routed_total{{policy="kv_aware",worker="{workers[0].url}"}} 2.0' in m
    assert f'policy="kv_aware",worker="{workers[1].url}"' not in m  # the decode worker is only picked least-loaded
    # Responses and Messages are served whole by a decode worker: the shipping routes take chat and completions.
    for endpoint in ("/v1/responses", "/v1/messages"):
        r = httpx.post(url + endpoint, json={"model": "fake", "input": "hi", "max_tokens": 4, "messages": []},
                       timeout=10)
        assert r.status_code == 200 and "from b" in r.text
    assert len(calls) == 2 and workers[0].requests == []
    assert f'ridgeline:router_requests_routed_total{{policy="least_loaded",worker="{workers[1].url}"}} 4.0' in \
        httpx.get(url + "/metrics").text
    with pytest.raises(ValueError, match="both"):
        RouterService(prefill_workers=[workers[0].url])


# --- /v1/responses and /v1/messages: relays and sticky routing ------------------------------------------


def _worker_of(workers, response_id):
    return next(w for w in workers if response_id in w.stored)


def test_responses_and_messages_are_relayed_for_the_official_clients(fleet):
    import anthropic
    import openai

    workers, make = fleet
    _, url = make("round_robin")
    oa = openai.OpenAI(base_url=url + "/v1", api_key="key-a", max_retries=0)
    r = oa.responses.create(model="fake", input="hello")
    assert r.output_text in ("from a", "from b") and r.id in _worker_of(workers, r.id).stored
    events = list(oa.responses.create(model="fake", input="hello", stream=True))
    assert [e.type for e in events] == ["response.created", "response.output_text.delta", "response.completed"]
    assert events[-1].response.output_text == events[1].delta

    an = anthropic.Anthropic(base_url=url, api_key="key-b", max_retries=0)
    m = an.messages.create(model="fake", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert m.content[0].text in ("from a", "from b") and m.stop_reason == "end_turn"
    with an.messages.stream(model="fake", max_tokens=4, messages=[{"role": "user", "content": "hi"}]) as st:
        assert st.get_final_message().content[0].text in ("from a", "from b")
    assert an.messages.count_tokens(model="fake", messages=[{"role": "user", "content": "hi"}]).input_tokens == 7
    # Each client's key (Anthropic's client may send it either way) and Anthropic's version header went upstream.
    sent = [h for w in workers for h in w.headers]
    assert {h.get("authorization") for h in sent if "anthropic-version" not in h} == {"Bearer key-a"}
    assert {h.get("x-api-key") or h.get("authorization") for h in sent if "anthropic-version" in h} <= \
        {"key-b", "Bearer key-b"}
    assert len([h for h in sent if "anthropic-version" in h]) == 2
    r = httpx.post(url + "/v1/messages", headers={"x-api-key": "key-c", "anthropic-version": "2023-06-01"},
                   json={"model": "fake", "max_tokens": 4, "messages": []}, timeout=10)
    assert r.status_code == 200 and any(h.get("x-api-key") == "key-c" for w in workers for h in w.headers)

    # The router's own errors on the Messages routes leave in Anthropic's envelope, as a worker's do.
    for w in workers:
        w.healthy = False
    deadline = time.monotonic() + 10
    while httpx.get(url + "/health").status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    r = httpx.post(url + "/v1/messages", json={"model": "fake", "max_tokens": 4, "messages": []}, timeout=10)
    assert r.status_code == 503 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "overloaded_error" and "no worker" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/messages", content=b"{not json", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_a_continued_response_goes_to_the_worker_that_stored_it(fleet):
    workers, make = fleet
    service, url = make("round_robin")  # round robin would alternate: only stickiness keeps the turns together
    for stream in (False, True):
        first = httpx.post(url + "/v1/responses", json={"model": "fake", "input": "one", "stream": stream},
                           timeout=10)
        assert first.status_code == 200
        rid = (first.json()["id"] if not stream else
               json.loads(next(x for x in first.text.splitlines() if x.startswith("data: "))[6:])["response"]["id"])
        owner = _worker_of(workers, rid)
        assert service.owners.owner(rid) == owner.url
        for turn in range(3):
            r = httpx.post(url + "/v1/responses", json={"model": "fake", "input": f"turn {turn}", "stream": stream,
                                                       "previous_response_id": rid}, timeout=10)
            assert r.status_code == 200 and f"from {owner.name}" in r.text, r.text
            assert owner.requests[-1]["previous_response_id"] == rid
        m = httpx.get(url + "/metrics").text
        assert f'ridgeline:router_requests_routed_total{{policy="sticky",worker="{owner.url}"}}' in m
    # GET and DELETE go to the owner too; a deleted id is forgotten.
    assert httpx.get(url + f"/v1/responses/{rid}", timeout=10).json()["id"] == rid
    assert httpx.delete(url + f"/v1/responses/{rid}", timeout=10).json()["deleted"] is True
    assert service.owners.owner(rid) is None and rid not in owner.stored
    r = httpx.get(url + f"/v1/responses/{rid}", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_the_owner_map_is_bounded_and_a_forgotten_id_is_found_by_asking(fleet):
    workers, make = fleet
    service, url = make("round_robin", response_owners_max_entries=1)
    ids = [httpx.post(url + "/v1/responses", json={"model": "fake", "input": "x"}, timeout=10).json()["id"]
           for _ in range(3)]
    assert len(service.owners) == 1 and service.owners.owner(ids[0]) is None
    owner = _worker_of(workers, ids[0])
    for _ in range(2):
        r = httpx.post(url + "/v1/responses", json={"model": "fake", "input": "y", "previous_response_id": ids[0]},
                       timeout=10)
        assert r.status_code == 200 and r.json()["output"][0]["content"][0]["text"] == f"from {owner.name}"
    # An id no worker holds: the worker the turn goes to answers its own 404.
    r = httpx.post(url + "/v1/responses", json={"model": "fake", "input": "z", "previous_response_id": "resp_no"},
                   timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert httpx.get(url + "/v1/responses/resp_no", timeout=10).status_code == 404


def test_a_continued_response_whose_worker_is_gone_is_a_404_naming_it(fleet):
    workers, make = fleet
    service, url = make("round_robin", check_interval_s=60)  # no probe: the failed request takes it out
    rid = httpx.post(url + "/v1/responses", json={"model": "fake", "input": "one"}, timeout=10).json()["id"]
    owner = _worker_of(workers, rid)
    other = next(w for w in workers if w is not owner)
    before = len(other.requests)
    owner.mode = "500"  # it fails the turn: no retry elsewhere, where the history is not
    turn = {"model": "fake", "input": "two", "previous_response_id": rid}
    for _ in range(2):  # failing, then out of rotation
        r = httpx.post(url + "/v1/responses", json=turn, timeout=10)
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["param"] == "previous_response_id" and err["code"] == "response_worker_unavailable"
        assert owner.url in err["message"] and rid in err["message"]
    assert "out of rotation" in err["message"] and not service.pool.workers[owner.url].healthy
    r = httpx.get(url + f"/v1/responses/{rid}", timeout=10)
    assert r.status_code == 404 and owner.url in r.json()["error"]["message"]
    assert len(other.requests) == before  # the other worker never saw the turn
    # A turn without a stored history still goes anywhere in rotation.
    assert httpx.post(url + "/v1/responses", json={"model": "fake", "input": "new"}, timeout=10).status_code == 200


def test_stream_id_scanner_and_owner_map():
    from serving.routing.response_owners import ResponseOwners, StreamIdScanner, response_id_of

    event = b'event: response.created\ndata: {"type": "response.created", "response": {"id": "resp_7"}}\n\n'
    scanner = StreamIdScanner()
    found = [scanner.feed(event[i:i + 5]) for i in range(0, len(event), 5)]  # split anywhere
    assert found[-1] == "resp_7" and found[0] is None
    assert StreamIdScanner().feed(b'data: {"type": "error"}\n\n') is None
    assert response_id_of(b'{"object": "response", "id": "resp_1"}') == "resp_1"
    assert response_id_of(b'{"error": {}}') is None and response_id_of(b"not json") is None
    owners = ResponseOwners(2)
    owners.remember("a", "w1")
    owners.remember("b", "w2")
    assert owners.owner("a") == "w1"  # a is now the most recently used
    owners.remember("c", "w1")
    assert (owners.owner("a"), owners.owner("b"), owners.owner("c"), len(owners)) == ("w1", None, "w1", 2)
    with pytest.raises(ValueError):
        ResponseOwners(0)
