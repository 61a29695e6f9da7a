"""One prefill worker and one decode worker (real `python -m serving.server` processes on 127.0.0.1, embedded
model): `run_disaggregated` gives what the decode worker gives when it serves the request alone, streaming and
not, completions and chat; bad payloads get a 400 and the worker keeps serving with no pages held."""

import asyncio
import json

import httpx
import pytest

from conftest import metric_value
from serving.disagg import run_disaggregated
from serving.local_fleet import LocalFleet

MODEL = "fleet"  # the --served_model_name LocalFleet gives its workers
BYTES_PER_TOKEN = 2 * 4 * 2 * 64 * 4  # the embedded model: 4 layers, 2 KV heads of 64, float32
WORKER_FLAGS = ["--max_num_seqs=4", "--max_num_batched_tokens=16", "--min_token_bucket=16", "--max_model_len=64",
                "--attention_backend=reference", "--kv_transfer_warmup"]


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """[prefill URL, decode URL]: started one after the other, so the second loads what the first compiled."""
    tmp = tmp_path_factory.mktemp("disagg")
    with LocalFleet(str(tmp), str(tmp / "jax-cache"), WORKER_FLAGS) as fleet:
        fleet.start_workers(2, timeout_s=480, parallel=False)
        yield [w.url for w in fleet.workers]


def _metric(url, name):
    return metric_value(httpx.get(url + "/metrics", timeout=30).text, f"ridgeline:{name}", require=True)


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
        resp, rec = await run_disaggregated(client, urls[0], urls[1], endpoint, body)
        try:
            assert resp.status_code == 200, (await resp.aread()).decode()
            if body.get("stream"):
                return [line async for line in resp.aiter_lines()], rec
            return json.loads(await resp.aread()), rec
        finally:
            await resp.aclose()


def _direct(url, endpoint, body):
    if body.get("stream"):
        with httpx.stream("POST", url + endpoint, json=body, timeout=120) as r:
            assert r.status_code == 200
            return list(r.iter_lines())
    r = httpx.post(url + endpoint, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


PROMPTS = ["def f(", "import os\nimport sys\n", "class P:\n    def run(self, x):\n        "]


def test_disaggregated_equals_one_worker(workers):
    prefill, decode = workers
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


def test_bad_payloads_get_a_4xx_and_the_worker_keeps_serving(workers):
    prefill, decode = workers
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0}
    payload = httpx.post(prefill + "/internal/prefill", json={"endpoint": "/v1/completions", "body": body},
                         timeout=120).content
    bad = {
        "garbage": b"hello world",
        "truncated": payload[:-10],
    }
    header_len = int.from_bytes(payload[4:8], "little")
    header = json.loads(payload[8:8 + header_len])
    for key, value in {"num_kv_heads": 4, "dtype": "bfloat16", "prompt_token_ids": [1, 2], "model": "other-model",
                       "version": 2}.items():
        blob = json.dumps({**header, key: value}).encode()
        bad[key] = payload[:4] + len(blob).to_bytes(4, "little") + blob + payload[8 + header_len:]
    blob = json.dumps({**header, "body": {**body, "prompt": "something else"}}).encode()
    bad["prompt mismatch"] = payload[:4] + len(blob).to_bytes(4, "little") + blob + payload[8 + header_len:]
    for name, data in bad.items():
        r = httpx.post(decode + "/internal/decode", content=data, timeout=60)
        assert 400 <= r.status_code < 500, (name, r.status_code, r.text)
        assert r.json()["error"]["message"], name
    r = httpx.post(prefill + "/internal/prefill", json={"endpoint": "/v1/nope", "body": body}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "endpoint"
    r = httpx.post(prefill + "/internal/prefill", json={"endpoint": "/v1/completions", "body": {**body, "n": 2}},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = httpx.post(decode + "/internal/decode", content=payload, timeout=60)
    assert r.status_code == 200 and r.json()["choices"] == _direct(decode, "/v1/completions", body)["choices"]
    assert _metric(decode, "kv_cache_pages_used") == 0
