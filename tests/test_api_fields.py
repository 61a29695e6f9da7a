"""The OpenAI request fields applications send, through the official `openai` client and httpx.

One small server per module (a tiny random-weight model with the byte
tokenizer and one step shape): sampling controls over HTTP, `stop_reason`,
the 400s for fields the server does not implement, unknown roles and
non-UTF-8 bodies, and the `/tokenize`, `/detokenize`, `/version` and
`/v1/models/{id}` routes; `LLM.chat` against the chat route.
"""

import json
import os
import re
import types

import httpx
import jax
import openai
import pytest

from conftest import tiny_config
from model.params import init_params
from model.tokenizer import ByteTokenizer
from serving import LLM, SamplingParams
from serving.api import http_protocol as P
from serving.api.chat_template import encode_chat, render_chat
from serving.api.openai_fields import extension_fields
from serving.server import ServerThread

MODEL = "tiny-api"
V = 300
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server():
    cfg = tiny_config(vocab_size=V, max_position_embeddings=256)
    llm = LLM(config=cfg, params=init_params(cfg, jax.random.key(5)), tokenizer=ByteTokenizer(V), max_num_seqs=4,
              max_num_batched_tokens=32, max_model_len=96, num_pages=48, min_token_bucket=32, min_context_bucket=96,
              warmup=True)
    # The programmatic chat's answer, before the engine starts serving HTTP.
    chat_ref = llm.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    thread = ServerThread(llm, model_name=MODEL).start()
    try:
        yield types.SimpleNamespace(url=thread.url, llm=llm, chat_ref=chat_ref, client=openai.OpenAI(
            base_url=thread.url + "/v1", api_key="unused", max_retries=0, timeout=120))
    finally:
        thread.stop()


def complete(server, **kw):
    kw = {"model": MODEL, "prompt": "ab", "max_tokens": 6, "temperature": 0.0, **kw}
    return server.client.completions.create(**kw).choices[0]


def test_sampling_fields_reach_the_sampler(server):
    assert complete(server, logit_bias={"42": 100}).text == "*" * 6
    # vLLM's extensions: min_tokens holds off the stop string the bias forces; bad_words bans it.
    c = complete(server, logit_bias={"42": 100}, stop=["*"], extra_body={"min_tokens": 3})
    assert (c.text, c.finish_reason, c.stop_reason) == ("**", "stop", "*")
    c = complete(server, logit_bias={"42": 100}, stop=["*"], extra_body={"include_stop_str_in_output": True})
    assert (c.text, c.stop_reason) == ("*", "*")
    assert "*" not in complete(server, logit_bias={"42": 100}, extra_body={"bad_words": ["*"]}).text
    c = complete(server, logit_bias={"42": 100}, extra_body={"stop_token_ids": [42]})
    assert (c.finish_reason, c.stop_reason) == ("stop", 42)
    assert complete(server).stop_reason is None
    ids = [50, 51, 52]
    c = complete(server, temperature=1.0, seed=3, extra_body={"allowed_token_ids": ids}, max_tokens=10)
    assert set(c.text) <= {chr(i) for i in ids}


def test_penalties_change_a_repeating_chat(server):
    r = server.client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0.0, max_tokens=24,
                                              logit_bias={"120": 8})
    text = r.choices[0].message.content
    assert text.count("x") > 12  # a mild bias makes greedy repeat
    r = server.client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0.0, max_tokens=24,
                                              logit_bias={"120": 8}, frequency_penalty=2.0)
    assert r.choices[0].message.content.count("x") < text.count("x")
    assert r.choices[0].stop_reason is None


@pytest.mark.parametrize("kind,kw,param", [
    ("completions", {"suffix": "tail"}, "suffix"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"frequency_penalty": 3.0}, "frequency_penalty"),
    ("completions", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("completions", {"extra_body": {"min_tokens": 100}}, "min_tokens"),
    ("chat", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("chat", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
])
def test_what_is_not_implemented_is_a_400_naming_it(server, kind, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        if kind == "completions":
            complete(server, **kw)
        else:
            server.client.chat.completions.create(**{"model": MODEL, "messages": CHAT, "max_tokens": 2, **kw})
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == param and err["type"] == "invalid_request_error"


def test_fields_that_ask_for_nothing_pass(server):
    r = server.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, store=False, user="u1")
    assert r.choices[0].finish_reason == "length"
    assert complete(server, best_of=1).finish_reason == "length"


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_a_field_that_is_neither_openai_nor_implemented_is_a_400_naming_it(server, kind):
    with pytest.raises(openai.BadRequestError) as e:
        if kind == "chat":
            server.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                                  extra_body={"some_client_extension": 1})
        else:
            complete(server, extra_body={"use_beam_search": True})
    err = e.value.body
    name = "some_client_extension" if kind == "chat" else "use_beam_search"
    assert e.value.status_code == 400 and err["param"] == name and name in err["message"]
    assert err["type"] == "invalid_request_error" and err["code"] == "unsupported_parameter"


def test_return_token_ids_gives_the_prompts_and_each_tokens_ids_versions_and_keep_sizes(server):
    """vLLM's token in / token out on /v1/completions: a token-id prompt, the choice's `prompt_token_ids` and
    `token_ids`, and Ridgeline's `weight_versions` and (with logprobs) `keep_sizes`; a stream sends the
    prompt's ids in a choice's first chunk and each chunk's new tokens, which add up to the same ids."""
    prompt = [5, 80, 81, 82]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0.0, "logprobs": 1,
            "return_token_ids": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["prompt_token_ids"] == prompt and len(c["token_ids"]) == 6
    assert c["weight_versions"] == [0] * 6 and c["keep_sizes"] == [V] * 6  # raw logprobs: the whole vocabulary
    assert len(c["logprobs"]["tokens"]) == 6
    plain = httpx.post(server.url + "/v1/completions", json={**body, "return_token_ids": None, "logprobs": None},
                       timeout=60).json()["choices"][0]
    assert plain["text"] == c["text"] and all(plain.get(k) is None for k in ("token_ids", "keep_sizes"))
    no_lp = httpx.post(server.url + "/v1/completions", json={**body, "logprobs": None}, timeout=60).json()
    assert no_lp["choices"][0]["token_ids"] == c["token_ids"] and no_lp["choices"][0].get("keep_sizes") is None
    chunks = [json.loads(line[6:]) for line in httpx.post(
        server.url + "/v1/completions", json={**body, "stream": True}, timeout=60).text.splitlines()
        if line.startswith("data: {")]
    streamed = [ch["choices"][0] for ch in chunks if ch["choices"]]
    assert streamed[0]["prompt_token_ids"] == prompt and all("prompt_token_ids" not in s or s["prompt_token_ids"]
                                                             is None for s in streamed[1:])
    assert sum((s["token_ids"] for s in streamed), []) == c["token_ids"]
    assert sum((s["keep_sizes"] for s in streamed), []) == c["keep_sizes"]
    # Chat: the rendered prompt's ids at the top, each choice's tokens; streamed, the same ids.
    chat = {"model": MODEL, "messages": CHAT, "max_tokens": 5, "temperature": 0.0, "return_token_ids": True}
    r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60).json()
    assert len(r["prompt_token_ids"]) == r["usage"]["prompt_tokens"] and len(r["choices"][0]["token_ids"]) == 5
    assert r["choices"][0]["keep_sizes"] is None and r["choices"][0]["weight_versions"] == [0] * 5
    chunks = [json.loads(line[6:]) for line in httpx.post(
        server.url + "/v1/chat/completions", json={**chat, "stream": True}, timeout=60).text.splitlines()
        if line.startswith("data: {")]
    assert chunks[0]["prompt_token_ids"] == r["prompt_token_ids"]
    assert all(ch.get("prompt_token_ids") is None for ch in chunks[1:])
    assert sum((ch["choices"][0]["token_ids"] for ch in chunks if ch["choices"]), []) == r["choices"][0]["token_ids"]


def test_every_unknown_field_is_named_and_echo_is_refused_on_chat(server):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, "zeta_option": 1, "alpha_option": "x"}
    for path in ("/v1/chat/completions", "/v1/completions"):
        if path == "/v1/completions":
            body = {**{k: v for k, v in body.items() if k != "messages"}, "prompt": "ab"}
        for stream in (False, True):
            r = httpx.post(server.url + path, json={**body, "stream": stream}, timeout=30)
            err = r.json()["error"]
            assert r.status_code == 400, r.text
            assert err["param"] == "alpha_option" and "`alpha_option`" in err["message"], err
            assert "`zeta_option`" in err["message"], err
    # `echo` is a completions field: the chat route does not echo, so it does not take it.
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "echo": True},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text


def test_the_chat_route_honours_vllm_fields_in_extra_body(server):
    chat = server.client.chat.completions.create
    forced = dict(model=MODEL, messages=CHAT, max_tokens=6, temperature=0.0, logit_bias={"42": 100})
    r = chat(**forced, extra_body={"stop_token_ids": [42]})
    assert (r.choices[0].finish_reason, r.choices[0].stop_reason) == ("stop", 42)
    held = chat(**forced, extra_body={"stop_token_ids": [42], "min_tokens": 2})  # the stop id masked twice
    assert (held.choices[0].finish_reason, held.choices[0].stop_reason) == ("stop", 42)
    assert held.usage.completion_tokens == r.usage.completion_tokens + 2
    ids = [50, 51, 52]
    c = chat(model=MODEL, messages=CHAT, max_tokens=8, temperature=1.0, seed=1,
             extra_body={"allowed_token_ids": ids, "top_k": 2, "min_p": 0.0, "repetition_penalty": 1.1,
                         "ignore_eos": True, "priority": 0, "cache_salt": "s1", "skip_special_tokens": True,
                         "spaces_between_special_tokens": True, "include_stop_str_in_output": False,
                         "bad_words": ["3"], "add_generation_prompt": True, "chat_template_kwargs": {},
                         "include_reasoning": True}).choices[0]
    assert set(c.message.content) <= {chr(i) for i in ids} - {"3"} and c.finish_reason == "length"
    # The same request as raw JSON, the extension fields beside OpenAI's.
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": CHAT, "max_tokens": 6, "temperature": 0.0, "logit_bias": {"42": 100},
        "stop_token_ids": [42], "min_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["stop_reason"] == 42, r.text


def test_the_docs_list_every_vllm_field_the_request_models_declare():
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "serving.md")) as f:
        section = f.read().split("### vLLM's fields", 1)[1].split("\n### ", 1)[0]
    rows = {m.group(1): re.findall(r"`(\w+)`", m.group(2).split(" (")[0])
            for m in re.finditer(r"^\| (both|chat|completions) \| (.*) \|$", section, re.M)}
    assert sorted(rows["both"] + rows["chat"]) == extension_fields(P.ChatCompletionRequest, "chat")
    assert sorted(rows["both"] + rows["completions"]) == extension_fields(P.CompletionRequest, "completions")


def test_a_non_utf8_body_is_a_400_envelope(server):
    r = httpx.post(server.url + "/v1/completions", content=b'{"model": "tiny-api", "prompt": "\xff\xfe"}',
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["code"] == "invalid_json"


def test_tokenize_detokenize_version_and_model_routes(server):
    url = server.url
    r = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": "héllo"}, timeout=30).json()
    tok = server.llm.tokenizer
    assert r["tokens"] == tok.encode("héllo") and r["count"] == len(r["tokens"]) and r["max_model_len"] == 96
    r2 = httpx.post(url + "/tokenize", json={"prompt": "héllo", "add_special_tokens": False}, timeout=30).json()
    assert r2["tokens"] == r["tokens"][1:]
    chat = httpx.post(url + "/tokenize", json={"messages": CHAT}, timeout=30).json()
    assert chat["tokens"] == encode_chat(CHAT, tok)
    assert httpx.post(url + "/detokenize", json={"tokens": r2["tokens"]}, timeout=30).json() == {"prompt": "héllo"}
    bad = httpx.post(url + "/detokenize", json={"tokens": [V + 5]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(url + "/tokenize", json={}, timeout=30).status_code == 400
    assert isinstance(httpx.get(url + "/version", timeout=30).json()["version"], str)
    card = server.client.models.retrieve(MODEL)
    assert card.id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        server.client.models.retrieve("other/model")
    assert e.value.body["code"] == 404 and e.value.body["type"] == "NotFoundError"


def test_llm_chat_renders_like_the_chat_route(server):
    r = server.client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0.0, max_tokens=8,
                                              extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == server.chat_ref.text
    assert r.usage.completion_tokens == len(server.chat_ref.token_ids)


def test_tools_reach_the_template():
    tok = types.SimpleNamespace(chat_template="{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
                                              "{{ messages[0].content }}")
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    assert render_chat([{"role": "user", "content": "hi"}], tok, tools=tools) == "[get_time]hi"
