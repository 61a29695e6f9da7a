"""The OpenAI-compatible server, end to end: the official `openai` client against a live server.

One server per module (a module-scoped fixture): uvicorn on a free loopback
port in a thread, the engine loop in its own thread, the embedded default
model (random weights of the same shape if the checkpoint is absent) with a
small bucket set so warm-up compiles only a handful of step shapes.
"""

import asyncio
import json
import os
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving import LLM, SamplingParams
from serving.api.chat_template import encode_chat
from serving.api.http_metrics import DevicePeak
from serving.llm import default_checkpoint_dir
from serving.server import ServerThread

MODEL = "ridgeline-test"
MAX_LEN = 128
ENGINE = dict(max_num_seqs=16, max_num_batched_tokens=32, min_token_bucket=32, page_size=16, max_model_len=MAX_LEN,
              attention_backend="reference", warmup=True)
REF_PROMPTS = ["def parse_args(argv):\n    ", "import os\nimport sys\n\n", "class Node:"]
REF_TOKENS = 16


def make_llm() -> LLM:
    if os.path.isdir(default_checkpoint_dir()):
        return LLM(**ENGINE)
    import jax

    from model.families import config_by_name
    from model.params import init_params

    cfg = config_by_name("tiny")  # the embedded model's shape
    return LLM(config=cfg, params=init_params(cfg, jax.random.key(0)), **ENGINE)


class Server:
    def __init__(self, thread: ServerThread, llm: LLM, reference):
        self.thread, self.llm, self.reference = thread, llm, reference
        self.url = thread.url
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def metrics(self) -> dict:
        """{(name, labels tuple): value} of every sample on /metrics."""
        text = httpx.get(self.url + "/metrics", timeout=30).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine")))
                out[(s.name, labels)] = s.value
        return out

    def wait_idle(self, timeout=60.0) -> dict:
        """Polls /metrics until nothing runs, waits or holds KV pages (or the deadline passes)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m[("vllm:num_requests_running", ())] == 0 and m[("vllm:num_requests_waiting", ())] == 0
                    and m[("vllm:kv_cache_usage_perc", ())] == 0)
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.05)


@pytest.fixture(scope="module")
def server():
    llm = make_llm()
    # The programmatic API's answers, computed on the same engine before it starts serving HTTP.
    reference = llm.generate(REF_PROMPTS, SamplingParams(temperature=0.0, max_tokens=REF_TOKENS, ignore_eos=True))
    thread = ServerThread(llm, model_name=MODEL, peak=DevicePeak("test device", bandwidth=50e9, flops=1e12)).start()
    try:
        yield Server(thread, llm, reference)
    finally:
        thread.stop()


def _printable_stop(text: str) -> str | None:
    """A 2-character stop string that first occurs in the middle of `text` (no replacement characters)."""
    for k in range(3, len(text) - 3):
        s = text[k:k + 2]
        if "\ufffd" not in s and text.find(s) == k:
            return s
    return None


# --- basics ------------------------------------------------------------------------------------


def test_models_health_and_greedy_equals_llm_generate(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200
    for prompt, ref in zip(REF_PROMPTS, server.reference):
        r = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=REF_TOKENS, temperature=0,
                                             extra_body={"ignore_eos": True})
        assert r.choices[0].text == ref.outputs[0].text
        assert r.choices[0].finish_reason == "length"
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.usage.completion_tokens == REF_TOKENS
    # Several prompts in one request, and token ids as the prompt, give the same texts.
    r = server.client.completions.create(model=MODEL, prompt=REF_PROMPTS, max_tokens=REF_TOKENS, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [o.outputs[0].text for o in server.reference]
    ids = server.reference[0].prompt_token_ids
    r = server.client.completions.create(model=MODEL, prompt=ids, max_tokens=REF_TOKENS, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert r.choices[0].text == server.reference[0].outputs[0].text


def test_completion_stream_equals_non_stream_with_usage_and_echo(server):
    prompt = REF_PROMPTS[1]
    chunks = list(server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=REF_TOKENS, temperature=0,
                                                   stream=True, stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == server.reference[1].outputs[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == REF_TOKENS
    r = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True)
    assert r.choices[0].text.startswith(prompt) and len(r.choices[0].text) > len(prompt)


def test_chat_stream_and_non_stream(server):
    messages = [{"role": "system", "content": "Answer in Python."}, {"role": "user", "content": "Sort a list"}]
    r = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                              extra_body={"ignore_eos": True})
    msg = r.choices[0].message
    assert msg.role == "assistant" and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(encode_chat(messages, server.llm.tokenizer))
    assert r.usage.completion_tokens == 12
    # The rendered chat template sent as token ids to /v1/completions gives the same text.
    ids = encode_chat(messages, server.llm.tokenizer)
    direct = server.client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                                              extra_body={"ignore_eos": True})
    assert msg.content == direct.choices[0].text
    stream = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == msg.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_samples_and_seeded_sample_reproduced(server):
    kw = dict(model=MODEL, prompt=REF_PROMPTS[0], max_tokens=12, temperature=1.0, n=3, seed=1234,
              extra_body={"ignore_eos": True})
    a = server.client.completions.create(**kw)
    b = server.client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    texts = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1, "n samples of one request should differ"
    assert a.usage.completion_tokens == 36
    # Streamed, the same seed gives the same samples, each under its own index.
    got = {}
    for chunk in server.client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            got[c.index] = got.get(c.index, "") + c.text
    assert [got[i] for i in range(3)] == texts
    other = server.client.completions.create(**{**kw, "seed": 99, "n": 1})
    assert other.choices[0].text != texts[0]
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=10, temperature=0.8, seed=5)
    assert (server.client.chat.completions.create(**chat).choices[0].message.content
            == server.client.chat.completions.create(**chat).choices[0].message.content)


def test_logprobs(server):
    r = server.client.completions.create(model=MODEL, prompt=REF_PROMPTS[2], max_tokens=6, temperature=0, logprobs=3,
                                         extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for chosen, tops in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 3 <= len(tops) <= 4
        assert chosen == pytest.approx(max(tops.values()), abs=1e-5)  # greedy picks the most likely token
    assert lp.text_offset == sorted(lp.text_offset)
    chat = server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x = "}],
                                                 max_tokens=5, temperature=0, logprobs=True, top_logprobs=2,
                                                 extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)
        assert entry.bytes


def test_stop_strings(server):
    # A seeded sample gives varied text whatever the model; the stop string is taken from its middle.
    kw = dict(model=MODEL, prompt=REF_PROMPTS[0], max_tokens=REF_TOKENS, temperature=1.0, seed=7,
              extra_body={"ignore_eos": True})
    full = server.client.completions.create(**kw).choices[0].text
    stop = _printable_stop(full)
    assert stop is not None, f"no usable stop string in {full!r}"
    r = server.client.completions.create(stop=[stop, "never-generated"], **kw)
    assert r.choices[0].text == full[:full.find(stop)]
    assert r.choices[0].finish_reason == "stop"
    chunks = list(server.client.completions.create(stream=True, stop=stop, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "stop"


# --- bad input -----------------------------------------------------------------------------------


BAD_COMPLETIONS = [
    ({"temperature": -0.5}, "temperature", None),
    ({"top_p": 0}, "top_p", None),
    ({"top_p": 1.5}, "top_p", None),
    ({"n": 0}, "n", None),
    ({"extra_body": {"top_k": -7}}, "top_k", None),
    ({"extra_body": {"min_p": 1.5}}, "min_p", None),
    ({"max_tokens": 0}, "max_tokens", None),
    ({"logprobs": 99}, "logprobs", None),
    ({"temperature": "hot"}, "temperature", None),
    ({"prompt": [5, 100000]}, "prompt", None),
    ({"prompt": ""}, "prompt", None),
    ({"n": 1000}, "n", None),
    ({"max_tokens": MAX_LEN}, "max_tokens", "context_length_exceeded"),
    ({"extra_body": {"priority": 1}}, "priority", None),  # the server schedules fcfs: a priority is refused
]


@pytest.mark.parametrize("stream", [False, True])
def test_bad_inputs_get_400_and_the_server_keeps_serving(server, stream):
    base = {"model": MODEL, "prompt": "x = 1", "max_tokens": 4, "stream": stream}
    for change, param, code in BAD_COMPLETIONS:
        with pytest.raises(openai.BadRequestError) as e:
            server.client.completions.create(**{**base, **change})
        assert e.value.status_code == 400, change
        err = e.value.body
        assert set(err) >= {"message", "type", "param", "code"}, err
        assert err["param"] == param, (change, err)
        if code:
            assert err["code"] == code, (change, err)
        assert err["message"]
    with pytest.raises(openai.NotFoundError) as e:  # an unknown model: vLLM's 404
        server.client.completions.create(**{**base, "model": "no-such-model"})
    assert e.value.body == {"message": "The model `no-such-model` does not exist.", "type": "NotFoundError",
                            "param": "model", "code": 404}
    # The context-window message names both lengths.
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(**{**base, "max_tokens": MAX_LEN - 2})
    msg = e.value.body["message"]
    assert str(MAX_LEN) in msg and f"{len(server.llm.tokenizer.encode('x = 1'))} in the prompt" in msg
    # Chat: a prompt longer than the window, top_logprobs without logprobs, no messages.
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "y" * (MAX_LEN + 10)}], "stream": stream}
    with pytest.raises(openai.BadRequestError) as e:
        server.client.chat.completions.create(**chat)
    assert e.value.body["param"] == "messages" and e.value.body["code"] == "context_length_exceeded"
    assert str(MAX_LEN) in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        server.client.chat.completions.create(**{**chat, "messages": [{"role": "user", "content": "hi"}],
                                                 "top_logprobs": 2})
    assert e.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        server.client.chat.completions.create(**{**chat, "messages": []})
    assert e.value.body["param"] == "messages"
    # Bodies no client library would send.
    for body, param in [(b"{not json", None), (b"[1, 2]", None), (b'{"model": "%s"}' % MODEL.encode(), "prompt")]:
        r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == param
        assert r.json()["error"]["type"] == "invalid_request_error"
    # ...and a good request still succeeds (priority 0 is every request's under fcfs).
    r = server.client.completions.create(model=MODEL, prompt="x = 1", max_tokens=3, temperature=0,
                                         extra_body={"priority": 0})
    assert r.usage.completion_tokens == 3
    m = server.wait_idle()
    assert m[("vllm:kv_cache_usage_perc", ())] == 0


def test_internal_kv_routes_do_not_exist_without_a_secret(server):
    """A server started without --kv_transfer_secret has no route that imports KV into its prefix cache:
    those paths, like any unknown one, answer 404 in OpenAI's envelope; a wrong method is a 405."""
    for path in ("/internal/decode", "/internal/prefill", "/v1/nope"):
        r = httpx.post(server.url + path, content=b"RKV1" + b"\0" * 64)
        assert r.status_code == 404, path
        assert r.json()["error"]["code"] == "not_found" and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    # Without API keys the API is open, and a salted request is served.
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x = 1", "max_tokens": 2,
                                                        "cache_salt": "tenant"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


# --- disconnects and load -------------------------------------------------------------------------


def test_client_disconnect_aborts_and_frees_kv(server):
    before = server.metrics()
    aborted = ("vllm:request_success_total", (("finished_reason", "abort"),))
    streams = [server.client.completions.create(model=MODEL, prompt=p, max_tokens=MAX_LEN - 32, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
               for p in REF_PROMPTS]
    for s in streams:
        it = iter(s)
        next(it)
        next(it)
    mid = server.metrics()
    assert mid[("vllm:num_requests_running", ())] + mid[("vllm:num_requests_waiting", ())] == 3
    assert mid[("vllm:kv_cache_usage_perc", ())] > 0
    for s in streams:
        s.close()
    m = server.wait_idle()
    assert m[("vllm:num_requests_running", ())] == 0
    assert m[("vllm:num_requests_waiting", ())] == 0
    assert m[("vllm:kv_cache_usage_perc", ())] == 0
    # The aborts are counted once the engine steps again.
    server.client.completions.create(model=MODEL, prompt="a", max_tokens=1)
    assert server.metrics()[aborted] - before[aborted] == 3


def test_load_64_concurrent_streams(server):
    async def one(client, i):
        text, finish, usage = "", None, None
        stream = await client.completions.create(model=MODEL, prompt=f"x{i} = ", max_tokens=4, temperature=0.7,
                                                 seed=i, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for c in chunk.choices:
                text += c.text
                finish = c.finish_reason or finish
        return finish, usage.completion_tokens

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)), return_exceptions=True)

    before = server.metrics()
    results = asyncio.run(main())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert results == [("length", 4)] * 64
    m = server.wait_idle()
    assert m[("vllm:num_requests_running", ())] == 0
    assert m[("vllm:num_requests_waiting", ())] == 0
    assert m[("vllm:kv_cache_usage_perc", ())] == 0
    assert m[("vllm:generation_tokens_total", ())] - before[("vllm:generation_tokens_total", ())] == 256
    ok = ("vllm:request_success_total", (("finished_reason", "length"),))
    assert m[ok] - before[ok] == 64


# --- metrics -------------------------------------------------------------------------------------


def test_metrics_follow_the_requests_as_vllm_defines_them(server):
    """A short workload (one request, one with n=2), then /metrics parsed with the Prometheus client's parser:
    vLLM's metrics moved by what vLLM's definitions say."""
    before = server.metrics()
    shared = "for i in range(10):\n    print(i * i)\n"  # two pages: the second request hits the prefix cache
    r = server.client.completions.create(model=MODEL, prompt=shared, max_tokens=7, temperature=0,
                                         extra_body={"ignore_eos": True})
    r2 = server.client.completions.create(model=MODEL, prompt=shared + "while True:", max_tokens=5, n=2,
                                          temperature=0.8, seed=3, extra_body={"ignore_eos": True})
    m = server.wait_idle()
    delta = lambda key: m[key] - before.get(key, 0)  # noqa: E731
    hist = lambda name, suffix="count": delta((f"vllm:{name}_{suffix}", ()))  # noqa: E731
    assert delta(("vllm:generation_tokens_total", ())) == 7 + 2 * 5
    assert delta(("vllm:prompt_tokens_total", ())) == r.usage.prompt_tokens + r2.usage.prompt_tokens
    assert delta(("vllm:request_success_total", (("finished_reason", "length"),))) == 2
    assert hist("time_to_first_token_seconds") == 2  # one per request
    assert hist("inter_token_latency_seconds") == 6 + 2 * 4  # one per token after a sequence's first
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds", "request_prompt_tokens",
                 "request_generation_tokens", "request_params_n", "request_params_max_tokens",
                 "request_max_num_generation_tokens", "request_time_per_output_token_seconds"):
        assert hist(name) == 2, name
    # The phases add up: prefill (scheduled -> first token) + decode (first -> last token) = inference, and
    # queue + inference fit inside end-to-end.
    assert hist("request_prefill_time_seconds", "sum") + hist("request_decode_time_seconds", "sum") == \
        pytest.approx(hist("request_inference_time_seconds", "sum"))
    assert hist("request_queue_time_seconds", "sum") + hist("request_inference_time_seconds", "sum") <= \
        hist("e2e_request_latency_seconds", "sum") + 1e-6
    assert hist("request_generation_tokens", "sum") == 7 + 2 * 5
    assert hist("request_params_max_tokens", "sum") == 7 + 5
    assert hist("request_params_n", "sum") == 3 and delta(("vllm:request_params_n_bucket", (("le", "1.0"),))) == 1
    assert hist("iteration_tokens_total", "sum") >= r.usage.prompt_tokens + 6
    assert delta(("vllm:prefix_cache_queries_total", ())) >= delta(("vllm:prefix_cache_hits_total", ())) > 0
    for name in ("vllm:num_preemptions_total", "vllm:kv_cache_usage_perc",
                 "ridgeline:model_bandwidth_utilization", "ridgeline:model_flops_utilization"):
        assert (name, ()) in m, name
    assert m[("ridgeline:kv_cache_page_size", ())] == ENGINE["page_size"]  # what a router hashes blocks by
    assert 0 < m[("ridgeline:model_bandwidth_utilization", ())]
    assert 0 < m[("ridgeline:model_flops_utilization", ())]
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}
    assert families["vllm:num_requests_running"].type == "gauge"
    assert families["vllm:prefix_cache_hits"].type == "counter"
    assert families["vllm:time_to_first_token_seconds"].type == "histogram"
    assert families["vllm:num_requests_waiting"].samples[0].labels == {"model_name": MODEL, "engine": "0"}
    assert families["ridgeline:kv_cache_pages_total"].samples[0].labels == {"model_name": MODEL}
    assert "ridgeline:num_requests_running" not in families  # each metric under one name only


def test_serve_bench_against_the_server(server, tmp_path):
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "serve_bench.py")
    spec = importlib.util.spec_from_file_location("serve_bench", path)
    serve_bench = importlib.util.module_from_spec(spec)
    sys.modules["serve_bench"] = serve_bench  # dataclasses look their module up there
    spec.loader.exec_module(serve_bench)

    out = tmp_path / "bench.json"
    result = serve_bench.main(["--base-url", server.url, "--dataset-name", "random", "--num-prompts", "12",
                               "--random-input-len", "12", "--random-output-len", "5", "--chars-per-token", "1",
                               "--max-concurrency", "6", "--goodput", "ttft:60000", "--result-file", str(out)])
    run = result["runs"]["server"]
    assert run["completed"] == 12 and run["failed"] == 0
    assert run["total_output_tokens"] == 60
    assert run["request_goodput"] > 0
    assert json.loads(out.read_text())["runs"]["server"]["model"] == MODEL
