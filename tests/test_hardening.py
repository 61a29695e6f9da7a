"""Hostile and careless clients against a live server: bounded bodies, per-key concurrency, caps.

One server per module with `--max_request_body_bytes=256 KiB`,
`--max_concurrent_requests_per_key=2` and `--scheduling_policy=priority` (so
the fuzzer's priorities are served, not refused), over a tiny random model
with one token bucket. Every attack must get a 4xx in OpenAI's error envelope, and the
server must go on serving with nothing left running, waiting or holding pages.
"""

import asyncio
import json
import time

import httpx
import pytest

from conftest import metric_value, tiny_config
from serving.api.request_limits import CAPS, RequestLimits
from serving.server import ServerThread

BODY_LIMIT = 256 * 1024
PER_KEY = 2
KEYS = ["key-a", "key-b"]


@pytest.fixture(scope="module")
def server():
    import jax

    from model.params import init_params
    from serving import LLM
    from serving.api.http_auth import APIKeys

    cfg = tiny_config(vocab_size=300)
    llm = LLM(config=cfg, params=init_params(cfg, jax.random.key(0)), max_num_seqs=8, max_num_batched_tokens=32,
              min_token_bucket=32, page_size=16, max_model_len=256, attention_backend="reference", warmup=True,
              scheduling_policy="priority")
    thread = ServerThread(llm, model_name="hardened", api_keys=APIKeys(KEYS),
                          limits=RequestLimits(max_body_bytes=BODY_LIMIT, max_concurrent_per_key=PER_KEY)).start()
    try:
        yield thread
    finally:
        thread.stop()


def headers(key="key-a", **extra):
    return {"authorization": f"Bearer {key}", "content-type": "application/json", **extra}


def completion(max_tokens=4, **fields):
    return {"model": "hardened", "prompt": [1, 5, 6, 7], "max_tokens": max_tokens, "temperature": 0, **fields}


def assert_envelope(r, status, code=None, param=None):
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"], err
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def assert_idle(server, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(server.url + "/metrics", timeout=30).text
        state = [metric_value(text, f"vllm:{n}") for n in ("num_requests_running", "num_requests_waiting",
                                                            "kv_cache_usage_perc")]
        if state == [0, 0, 0]:
            return
        assert time.monotonic() < deadline, state
        time.sleep(0.05)


def still_serves(server):
    r = httpx.post(server.url + "/v1/completions", json=completion(priority=-3), headers=headers(), timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    assert_idle(server)


# --- bodies ------------------------------------------------------------------------------------


def test_a_declared_oversized_body_is_a_413_before_it_is_read(server):
    big = json.dumps(completion(prompt="x" * (BODY_LIMIT + 10))).encode()
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/v1/models"):
        r = httpx.post(server.url + path, content=big, headers=headers(), timeout=60)
        assert_envelope(r, 413, "request_too_large")
    still_serves(server)


def test_a_streamed_body_is_cut_off_at_the_limit(server):
    """A chunked body with no Content-Length, sent 4 KiB at a time over a raw socket: the 413 arrives once
    the limit is crossed, while the client could still send ten times as much."""
    import select
    import socket

    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer key-a\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    sock.sendall(head.encode())
    sent, reply = 0, b""

    def chunk(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    sock.sendall(chunk(b'{"model": "hardened", "prompt": "'))
    while sent < 10 * BODY_LIMIT:
        if select.select([sock], [], [], 0.02)[0]:
            break  # the server answered
        try:
            sock.sendall(chunk(b"x" * 4096))
        except (BrokenPipeError, ConnectionResetError):
            break
        sent += 4096
    deadline = time.monotonic() + 30
    while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
        assert time.monotonic() < deadline, reply
        data = sock.recv(65536)
        if not data:
            break
        reply += data
    sock.close()
    status_line, _, rest = reply.partition(b"\r\n")
    assert b" 413 " in status_line, reply[:300]
    body = json.loads(rest.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "request_too_large"
    assert sent < 2 * BODY_LIMIT  # answered as soon as the limit was crossed, not after the whole body
    still_serves(server)


def test_a_body_within_the_limit_is_served(server):
    r = httpx.post(server.url + "/v1/completions", json=completion(prompt="y" * 100), headers=headers(), timeout=60)
    assert r.status_code == 200, r.text


# --- per-key concurrency -----------------------------------------------------------------------


def test_one_key_gets_at_most_its_share_then_a_429_with_retry_after(server):
    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            streams = []
            for _ in range(PER_KEY):  # hold the key's share open with slow streams
                req = client.build_request("POST", "/v1/completions", headers=headers(),
                                           json=completion(max_tokens=200, stream=True, ignore_eos=True))
                resp = await client.send(req, stream=True)
                assert resp.status_code == 200
                streams.append(resp)
            over = await client.post("/v1/completions", headers=headers(), json=completion())
            other = await client.post("/v1/completions", headers=headers("key-b"), json=completion())
            for resp in streams:
                await resp.aclose()  # a disconnect: the engine aborts them
            await asyncio.sleep(0.2)
            after = await client.post("/v1/completions", headers=headers(), json=completion())
            return over, other, after

    over, other, after = asyncio.run(run())
    assert_envelope(over, 429, "rate_limit_exceeded")
    assert over.headers["retry-after"] == "1"
    assert other.status_code == 200  # another key is not held back
    assert after.status_code == 200  # the share comes back when a request ends
    assert_idle(server)


# --- caps --------------------------------------------------------------------------------------


@pytest.mark.parametrize("field", sorted(CAPS))
def test_every_cap_is_a_400_naming_its_field(server, field):
    cap = CAPS[field][0]
    too_many = {
        "stop": ["s"] * (cap + 1),
        "stop_token_ids": [3] * (cap + 1),
        "logit_bias": {str(i): 1 for i in range(cap + 1)},
        "bad_words": ["w"] * (cap + 1),
        "tools": [{"type": "function", "function": {"name": f"f{i}", "parameters": {}}} for i in range(cap + 1)],
        "messages": [{"role": "user", "content": "m"}] * (cap + 1),
        "prompt": [[1, 5]] * (cap + 1),
    }[field]
    chat = field in ("tools", "messages")
    body = ({"model": "hardened", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            if chat else completion())
    body[field] = too_many
    r = httpx.post(server.url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body,
                   headers=headers(), timeout=60)
    err = assert_envelope(r, 400, "invalid_value", field)
    assert str(cap) in err["message"]


def test_huge_numbers_are_400s(server):
    for change, param in [({"max_tokens": 10**30}, "max_tokens"), ({"n": 10**12}, "n"),
                          ({"logprobs": 10**9}, "logprobs"), ({"priority": 10**40}, "priority")]:
        r = httpx.post(server.url + "/v1/completions", json=completion(**change), headers=headers(), timeout=60)
        assert_envelope(r, 400, param=param)
    still_serves(server)


# --- fuzzing from the server's own OpenAPI schema ----------------------------------------------

FUZZ_EXAMPLES = 25  # per route and generation mode: bounded, so CI time is too
FUZZED = [("/v1/completions", "POST"), ("/v1/chat/completions", "POST"), ("/tokenize", "POST"),
          ("/detokenize", "POST"), ("/v1/models", "GET")]


def _bounded(case):
    """Keeps a generated request cheap to serve on CPU: a few tokens, two samples at most (huge values are
    the hand-written cases' job, below); and names the served model and a known chat role, so that cases
    get past those checks to the fields behind them."""
    if isinstance(case.body, dict):
        if "model" in case.body:
            case.body["model"] = "hardened"
        for m in case.body.get("messages") or [] if isinstance(case.body.get("messages"), list) else []:
            if isinstance(m, dict) and m.get("role") not in ("system", "user", "assistant"):
                m["role"] = "user"
        for field in ("max_tokens", "max_completion_tokens"):
            if isinstance(case.body.get(field), int) and not isinstance(case.body.get(field), bool):
                case.body[field] = max(-1, min(case.body[field], 4))
        if isinstance(case.body.get("n"), int) and not isinstance(case.body.get("n"), bool):
            case.body["n"] = max(-1, min(case.body["n"], 2))
    return case


FUZZ_CASES = [(p, m, mode) for p, m in FUZZED for mode in ("positive", "negative") if m == "POST" or mode == "positive"]


@pytest.mark.parametrize("path,method,mode", FUZZ_CASES, ids=[f"{p}-{mode}" for p, _, mode in FUZZ_CASES])
def test_fuzzed_requests_never_get_a_5xx_and_errors_keep_the_envelope(server, path, method, mode):
    import requests
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_dict(httpx.get(server.url + "/openapi.json", timeout=30).json())
    strategy = schema[path][method].as_strategy(schemathesis.GenerationMode(mode)).map(_bounded)
    session = requests.Session()
    statuses = []

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def fuzz(case):
        r = case.call(base_url=server.url, session=session, headers={"authorization": "Bearer key-a"}, timeout=120)
        statuses.append(r.status_code)
        assert r.status_code < 500, (r.status_code, r.text[:500], case.body)
        if r.status_code >= 400:
            err = r.json()["error"]
            assert set(err) >= {"message", "type", "param", "code"} and err["message"], r.text[:500]

    fuzz()
    # The cases ran (a body's schema yields many; GET /v1/models has exactly one request to make), and the
    # valid ones reached the engine.
    assert len(statuses) >= (FUZZ_EXAMPLES // 2 if method == "POST" else 1), statuses
    assert mode == "negative" or 200 in statuses, statuses
    assert_idle(server)
    still_serves(server)


# --- hand-written hostile bodies ---------------------------------------------------------------


def _post(server, path, content, content_type="application/json"):
    return httpx.post(server.url + path, content=content, headers=headers(**{"content-type": content_type}),
                      timeout=60)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_hostile_bodies_are_4xx_in_the_envelope(server, path):
    deep = b"[" * 100_000 + b"]" * 100_000  # 200 KB of nesting: within the body limit
    deep_object = b'{"prompt": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5000 + b"}"
    cases = [
        (deep, "application/json"),
        (deep_object, "application/json"),
        (b'{"model": "hardened", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", "application/json"),
        (b'{"model": "hardened", "prompt": "x", "max_tokens": 1e400}', "application/json"),
        (b'{"model": "hardened", "prompt": "x", "temperature": NaN}', "application/json"),
        (b'{"model": "hardened", "prompt": "x", "temperature": Infinity}', "application/json"),
        (b'{"model": "hardened", "prompt": "x", "top_p": -Infinity}', "application/json"),
        (b'{"model": "hardened", "prompt": "\xff\xfe\xfa", "max_tokens": 2}', "application/json"),
        (b'{"model": "hardened", "prompt": "\\ud800", "max_tokens": 2}', "application/json"),
        (b'{"model": "hardened", "prompt": "x", "prompt": [1, 2], "max_tokens": 2, "max_tokens": -5}',
         "application/json"),
        (b'{"model": "hardened", "prompt": "x"}', "text/plain"),
        (b"model=hardened&prompt=x", "application/x-www-form-urlencoded"),
        (b"", "application/json"),
        (b"null", "application/json"),
        (b'"just a string"', "application/json"),
        (b'{"messages": "not a list", "prompt": {"nested": [null]}, "n": "2", "stop": [1, 2]}', "application/json"),
    ]
    for body, content_type in cases:
        r = _post(server, path, body, content_type)
        assert 400 <= r.status_code < 500, (body[:80], r.status_code, r.text[:300])
        err = r.json()["error"]
        assert set(err) >= {"message", "type", "param", "code"} and err["message"], (body[:80], r.text[:300])
    still_serves(server)
