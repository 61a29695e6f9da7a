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

        self.server = _Served(app)
        self.url = self.server.url


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
    with pytest.raises(ValueError, match="both"):
        RouterService(prefill_workers=[workers[0].url])
