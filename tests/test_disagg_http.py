"""One prefill worker and one decode worker (real `python -m serving.server` processes on 127.0.0.1, embedded
model, sharing a KV transfer secret and API keys): `run_disaggregated` gives what the decode worker gives when it
serves the request alone, streaming and not, completions and chat; bad payloads get a 4xx and the worker keeps
serving with no pages held. Then the security tests, on the same workers: forged imports, tenants' salts, API keys,
oversized payloads."""

import asyncio
import json
import re
import socket
import threading
import time

import httpx
import numpy as np
import pytest

from conftest import metric_value
from serving.disaggregation import kv_wire
from serving.disaggregation.disagg import run_disaggregated
from serving.router import RouterService, create_router_app
from serving.cluster.local_fleet import LocalFleet

MODEL = "fleet"  # the --served_model_name LocalFleet gives its workers
BYTES_PER_TOKEN = 2 * 4 * 2 * 64 * 4  # the embedded model: 4 layers, 2 KV heads of 64, float32
SECRET = "the workers' shared KV transfer secret"
KEYS = ("key-of-tenant-a", "key-of-tenant-b")
AUTH = {"authorization": f"Bearer {KEYS[0]}"}  # tenant a, unless a test says otherwise
WORKER_FLAGS = ["--max_num_seqs=4", "--max_num_batched_tokens=16", "--min_token_bucket=16", "--max_model_len=64",
                "--attention_backend=reference", "--kv_transfer_warmup", f"--api_key={','.join(KEYS)}",
                "--cache_salt_per_api_key"]


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """[prefill URL, decode URL, prefill pid, decode pid]: started one after the other, so the second loads
    what the first compiled. The secret reaches them through the environment (the flag's default)."""
    tmp = tmp_path_factory.mktemp("disagg")
    mp = pytest.MonkeyPatch()
    mp.setenv("RIDGELINE_KV_TRANSFER_SECRET", SECRET)
    try:
        with LocalFleet(str(tmp), str(tmp / "jax-cache"), WORKER_FLAGS) as fleet:
            fleet.start_workers(2, timeout_s=480, parallel=False)
            yield [w.url for w in fleet.workers] + [w.proc.pid for w in fleet.workers]
    finally:
        mp.undo()


def _metric(url, name):
    from serving.api.http_metrics import BY_NAME

    full = f"vllm:{name}" if f"vllm:{name}" in BY_NAME else f"ridgeline:{name}"
    return metric_value(httpx.get(url + "/metrics", timeout=30).text, full, require=True)


def _sse_text(lines, chat):
    text, finish, done = "", None, False
    for line in lines:
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            continue
        for c in json.loads(line[6:])["choices"]:
            text += (c["delta"].get("content") or "") if chat else c["text"]
            finish = c["finish_reason"] or finish
    assert done
    return text, finish


async def _disagg(urls, endpoint, body):
    async with httpx.AsyncClient(timeout=120) as client:
        resp, rec = await run_disaggregated(client, urls[0], urls[1], endpoint, body, AUTH)
        try:
            assert resp.status_code == 200, (await resp.aread()).decode()
            if body.get("stream"):
                return [line async for line in resp.aiter_lines()], rec
            return json.loads(await resp.aread()), rec
        finally:
            await resp.aclose()


def _direct(url, endpoint, body):
    if body.get("stream"):
        with httpx.stream("POST", url + endpoint, json=body, headers=AUTH, timeout=120) as r:
            assert r.status_code == 200
            return list(r.iter_lines())
    r = httpx.post(url + endpoint, json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


PROMPTS = ["def f(", "import os\nimport sys\n", "class P:\n    def run(self, x):\n        "]


def test_disaggregated_equals_one_worker(workers):
    prefill, decode = workers[:2]
    for prompt in PROMPTS:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        want = _direct(decode, "/v1/completions", body)
        got, rec = asyncio.run(_disagg(workers, "/v1/completions", body))
        assert got["choices"] == want["choices"] and got["usage"] == want["usage"]
        assert set(got) == set(want) and got["object"] == want["object"]
        n = want["usage"]["prompt_tokens"]
        assert rec.num_tokens == n and rec.kv_bytes == n * BYTES_PER_TOKEN and rec.payload_bytes > rec.kv_bytes

        lines, _ = asyncio.run(_disagg(workers, "/v1/completions", {**body, "stream": True}))
        assert _sse_text(lines, chat=False) == (want["choices"][0]["text"], want["choices"][0]["finish_reason"])

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Write a loop."}], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 2}
    want = _direct(decode, "/v1/chat/completions", chat)
    got, _ = asyncio.run(_disagg(workers, "/v1/chat/completions", chat))
    assert got["choices"][0]["message"] == want["choices"][0]["message"]
    for g, w in zip(got["choices"][0]["logprobs"]["content"], want["choices"][0]["logprobs"]["content"]):
        assert g["token"] == w["token"] and abs(g["logprob"] - w["logprob"]) < 1e-4
        assert [t["token"] for t in g["top_logprobs"]] == [t["token"] for t in w["top_logprobs"]]
    lines, _ = asyncio.run(_disagg(workers, "/v1/chat/completions", {**chat, "stream": True}))
    assert _sse_text(lines, chat=True) == (want["choices"][0]["message"]["content"],
                                           want["choices"][0]["finish_reason"])
    # Seeded sampling continues on the decode worker with the same seed.
    seeded = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 1.0, "seed": 5,
              "ignore_eos": True}
    assert asyncio.run(_disagg(workers, "/v1/completions", seeded))[0]["choices"] == \
        _direct(decode, "/v1/completions", seeded)["choices"]
    # A second turn that resends the conversation hits the blocks the first turn's import registered.
    turn = "# a conversation, and its very first turn\n"
    asyncio.run(_disagg(workers, "/v1/completions", {**seeded, "prompt": turn}))
    hits = _metric(decode, "prefix_cache_hits")
    asyncio.run(_disagg(workers, "/v1/completions", {**seeded, "prompt": turn + "second turn\n"}))
    assert _metric(decode, "prefix_cache_hits") - hits == 32
    assert _metric(decode, "kv_cache_pages_used") == 0 and _metric(prefill, "kv_cache_pages_used") == 0


# Short names: the embedded model's template lists each tool's name, and its context is 64 tokens here.
TOOLS = [{"type": "function", "function": {"name": "wx", "parameters": {
    "type": "object", "properties": {"c": {"type": "string"}}, "required": ["c"]}}},
         {"type": "function", "function": {"name": "t", "parameters": {"type": "object", "properties": {}}}}]


async def _through_router(urls, body):
    """(status, JSON or SSE lines) of a chat sent to an in-process router over the prefill/decode pair."""
    service = RouterService(prefill_workers=[urls[0]], decode_workers=[urls[1]], page_size=16)
    app = create_router_app(service)
    await service.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router",
                                     timeout=120) as client:
            r = await client.post("/v1/chat/completions", json=body, headers=AUTH)
            return r.status_code, (r.text.splitlines() if body.get("stream") else r.json())
    finally:
        await service.stop()


def _without_call_ids(message: dict) -> dict:
    """A chat message with its tool calls' ids (fresh on every answer) left out."""
    calls = [{k: v for k, v in c.items() if k != "id"} for c in message.get("tool_calls") or []]
    return {**message, "tool_calls": calls}


@pytest.mark.parametrize("tool_choice", ["none", "required", {"type": "function", "function": {"name": "t"}}],
                         ids=["none", "required", "named"])
def test_a_tool_chat_through_the_router_is_prompted_as_on_one_server(workers, tool_choice):
    """The tools are part of the prompt (the template lists them) and, when a call is forced, of the first
    token's grammar: the prefill worker must render and constrain them as the single server does."""
    decode = workers[1]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Oslo?"}], "tools": TOOLS,
            "tool_choice": tool_choice, "max_tokens": 8, "temperature": 0}
    want = _direct(decode, "/v1/chat/completions", chat)
    status, got = asyncio.run(_through_router(workers, chat))
    assert status == 200, got
    assert _without_call_ids(got["choices"][0]["message"]) == _without_call_ids(want["choices"][0]["message"])
    assert got["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"]
    assert got["usage"] == want["usage"]
    status, lines = asyncio.run(_through_router(workers, {**chat, "stream": True}))
    assert status == 200, lines
    assert [line for line in lines if line.startswith("data: ")][-1] == "data: [DONE]"
    want_lines = _direct(decode, "/v1/chat/completions", {**chat, "stream": True})
    strip = re.compile(r'"(id|created)":\s*("[^"]*"|\d+)')
    assert [strip.sub("", x) for x in lines if x] == [strip.sub("", x) for x in want_lines if x]


def prefill_payload(prefill, body, headers=AUTH) -> bytes:
    r = httpx.post(prefill + "/internal/prefill", json={"endpoint": "/v1/completions", "body": body},
                   headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.content


def split_payload(payload: bytes) -> tuple[dict, bytes]:
    """(header, array bytes) of a signed payload, read as a test that knows the secret may."""
    header_len = int.from_bytes(payload[4:8], "little")
    header = json.loads(payload[8:8 + header_len])
    return header, payload[8 + header_len + kv_wire.TAG_BYTES:-kv_wire.TAG_BYTES]


def test_bad_payloads_get_a_4xx_and_the_worker_keeps_serving(workers):
    prefill, decode = workers[:2]
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0}
    payload = prefill_payload(prefill, body)
    keys = kv_wire.SigningKeys(SECRET)
    bad = {
        "garbage": b"hello world",
        "truncated": payload[:-10],
    }
    header, arrays = split_payload(payload)
    # Signed with the right secret but not what this worker can hold: refused with a 400 naming the field.
    for key, value in {"num_kv_heads": 4, "dtype": "bfloat16", "prompt_token_ids": [1, 2], "model": "other-model",
                       "version": 1}.items():
        bad[key] = kv_wire.sign_payload(keys, {**header, key: value}, arrays)
    bad["prompt mismatch"] = kv_wire.sign_payload(keys, {**header, "body": {**body, "prompt": "something else"}},
                                                  arrays)
    for name, data in bad.items():
        r = httpx.post(decode + "/internal/decode", content=data, timeout=60)
        assert 400 <= r.status_code < 500, (name, r.status_code, r.text)
        assert r.json()["error"]["message"], name
    # An int8 worker's payload (pages and their scales) to this float32 worker: a 400 naming both dtypes.
    n = header["num_tokens"]
    int8 = {**header, "dtype": "int8", "arrays": [
        {"name": "k", "shape": [n, 2, 64], "dtype": "int8"}, {"name": "v", "shape": [n, 2, 64], "dtype": "int8"},
        {"name": "k_scale", "shape": [n, 2], "dtype": "float32"},
        {"name": "v_scale", "shape": [n, 2], "dtype": "float32"}]}
    r = httpx.post(decode + "/internal/decode", content=kv_wire.sign_payload(keys, int8, arrays[:n * 1088]),
                   timeout=60)
    assert r.status_code == 400, r.text
    assert ("KV payload dtype 'int8' does not match this worker's KV cache dtype 'float32'"
            in r.json()["error"]["message"])
    r = httpx.post(prefill + "/internal/prefill", json={"endpoint": "/v1/nope", "body": body}, headers=AUTH,
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "endpoint"
    r = httpx.post(prefill + "/internal/prefill", json={"endpoint": "/v1/completions", "body": {**body, "n": 2}},
                   headers=AUTH, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = httpx.post(decode + "/internal/decode", content=payload, timeout=60)
    assert r.status_code == 200 and r.json()["choices"] == _direct(decode, "/v1/completions", body)["choices"]
    assert _metric(decode, "kv_cache_pages_used") == 0


# --- security: what a client who can reach a worker can and cannot do ----------------------------------------------


def _hits(url) -> float:
    return _metric(url, "prefix_cache_hits")


def test_forged_imports_are_refused_and_other_users_get_clean_completions(workers):
    """The attack: take a genuine payload for a common prefix, replace its K/V with noise, import it into the
    decode worker's prefix cache. Every variant is refused, and a user whose prompt shares the prefix gets the
    completion the model really gives."""
    prefill, decode = workers[:2]
    prefix = "class Forged:\n    def __init__(self, other):\n"  # 2 full pages of 16 tokens
    victim = {"model": MODEL, "prompt": prefix + "        ", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    clean = _direct(prefill, "/v1/completions", victim)["choices"]  # the same model, never attacked
    payload = prefill_payload(prefill, {"model": MODEL, "prompt": prefix, "max_tokens": 1, "temperature": 0})
    header, arrays = split_payload(payload)
    head = payload[:len(payload) - len(arrays) - kv_wire.TAG_BYTES]
    noise = np.random.default_rng(0).standard_normal(len(arrays) // 4).astype(np.float32).tobytes()
    blob = json.dumps(header).encode()
    attempts = {
        "noise under the genuine tags": (head + noise + payload[-kv_wire.TAG_BYTES:], 403),
        "noise signed with the attacker's own secret": (
            kv_wire.sign_payload(kv_wire.SigningKeys("the attacker's secret"), header, noise), 403),
        "noise in the unsigned format": (b"RKV1" + len(blob).to_bytes(4, "little") + blob + noise, 401),
        "noise with no tags": (kv_wire.MAGIC + len(blob).to_bytes(4, "little") + blob + noise, 403),
    }
    hits = _hits(decode)
    for name, (data, status) in attempts.items():
        r = httpx.post(decode + "/internal/decode", content=data, timeout=60)
        assert r.status_code == status, (name, r.status_code, r.text)
        assert r.json()["error"]["code"] in ("kv_payload_forged", "kv_payload_unsigned"), name
    assert _direct(decode, "/v1/completions", victim)["choices"] == clean
    assert _hits(decode) == hits  # nothing the attacker sent was registered
    assert _metric(decode, "kv_cache_pages_used") == 0


def _completion_hits(url, prompt, headers, **extra):
    before = _hits(url)
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                                  "temperature": 0, **extra}, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return _hits(url) - before, r.json()["usage"]["prompt_tokens"]


def test_cache_salts_and_api_keys_isolate_tenants(workers):
    decode = workers[1]
    prompt = "def isolated(self, tenant, prompt):\n    return 1\n"
    tenant_b = {"authorization": f"Bearer {KEYS[1]}"}
    hits, n = _completion_hits(decode, prompt, AUTH)
    full = (n - 1) // 16 * 16
    assert hits == 0 and full >= 16
    assert _completion_hits(decode, prompt, AUTH)[0] == full  # the same tenant shares its pages
    assert _completion_hits(decode, prompt, tenant_b)[0] == 0  # another API key: its own pages
    assert _completion_hits(decode, prompt, tenant_b)[0] == full
    # A salt of the client's own: isolated from the same key's unsalted pages, shared with the same salt.
    assert _completion_hits(decode, prompt, AUTH, cache_salt="conversation-1")[0] == 0
    assert _completion_hits(decode, prompt, AUTH, cache_salt="conversation-1")[0] == full
    assert _completion_hits(decode, prompt, AUTH, cache_salt="conversation-2")[0] == 0
    # Tenant b naming tenant a's salt still gets pages of its own.
    assert _completion_hits(decode, prompt, tenant_b, cache_salt="conversation-1")[0] == 0
    # Disaggregated: the import is registered under the prefill side's salt, so only that tenant hits it.
    turn = "# an isolated conversation's first turn\n"
    asyncio.run(_disagg(workers, "/v1/completions", {"model": MODEL, "prompt": turn, "max_tokens": 2,
                                                     "temperature": 0, "cache_salt": "conversation-3"}))
    assert _completion_hits(decode, turn + "next", AUTH, cache_salt="conversation-3")[0] == 32
    assert _completion_hits(decode, turn + "next", AUTH)[0] == 0
    r = httpx.post(decode + "/v1/completions",
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "cache_salt": ""},
                   headers=AUTH, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_api_keys_guard_the_api_and_leave_health_and_metrics_open(workers):
    prefill, decode = workers[:2]
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    for url in (prefill, decode):
        for headers in ({}, {"authorization": "Bearer not-a-key"}, {"authorization": KEYS[0]},
                        {"authorization": f"Basic {KEYS[0]}"}):
            for method, path, kw in (("POST", "/v1/completions", {"json": body}), ("GET", "/v1/models", {}),
                                     ("POST", "/v1/chat/completions", {"json": {**body, "messages": []}}),
                                     ("POST", "/internal/prefill",
                                      {"json": {"endpoint": "/v1/completions", "body": body}})):
                r = httpx.request(method, url + path, headers=headers, timeout=60, **kw)
                assert r.status_code == 401, (url, path, headers, r.status_code)
                assert r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url + "/v1/models", headers=AUTH, timeout=60).status_code == 200
        assert httpx.get(url + "/health", timeout=60).status_code == 200
        assert httpx.get(url + "/metrics", timeout=60).status_code == 200


def _rss_bytes(pid) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_oversized_payloads_get_413_without_being_buffered(workers):
    prefill, decode, _, decode_pid = workers
    host, port = decode.removeprefix("http://").split(":")
    # A declared length past the largest payload the pool could hold: refused before the body is read.
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /internal/decode HTTP/1.1\r\nhost: x\r\ncontent-type: application/x-ridgeline-kv\r\n"
                  b"content-length: 100000000000\r\n\r\n" + b"\0" * 1000)
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.split(b"\r\n\r\n", 1)[1]) < int(
                re.search(rb"content-length: (\d+)", answer, re.I).group(1)):
            more = s.recv(65536)
            if not more:
                break
            answer += more
        answer = answer.decode(errors="replace")
    assert answer.startswith("HTTP/1.1 413"), answer[:200]
    assert "kv_payload_too_large" in answer
    # A genuine payload followed by 256 MiB more than its header announces, streamed without a length.
    payload = prefill_payload(prefill, {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 1})
    extra, chunk = 256 * 2**20, b"\0" * 2**20
    peak, stop = [_rss_bytes(decode_pid)], threading.Event()
    baseline = peak[0]

    def watch():
        while not stop.is_set():
            peak.append(_rss_bytes(decode_pid))
            time.sleep(0.005)

    def body():
        yield payload
        for _ in range(extra // len(chunk)):
            yield chunk

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        r = httpx.post(decode + "/internal/decode", content=body(), timeout=120)
        status, code = r.status_code, r.json()["error"]["code"]
    except httpx.HTTPError:  # the worker may close the connection while the rest is still being sent
        status, code = 413, "connection closed"
    finally:
        stop.set()
        watcher.join()
    assert status == 413 and code in ("kv_payload_too_large", "connection closed"), (status, code)
    assert max(peak) - baseline < 64 * 2**20, f"the worker's memory grew by {(max(peak) - baseline) / 2**20:.0f} MiB"
    assert _metric(decode, "kv_cache_pages_used") == 0
    assert httpx.get(decode + "/health", timeout=30).status_code == 200
