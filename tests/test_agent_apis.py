"""The agent APIs with their official clients: OpenAI's Responses API (`openai`, and the OpenAI Agents
SDK's Runner on top of it) and Anthropic's Messages API (`anthropic`), against one server over the
tiny Qwen3-style reasoning checkpoint (tests/reasoning_checkpoints.py), with `--reasoning_parser
qwen3` and `--tool_call_parser hermes`. Nothing reaches the network: every client points at the
test server.

The random model never ends its thinking on its own, so requests give a thinking budget; where an
answer must end by itself (the Agents SDK treats a length stop as a failure) a bounded JSON schema
ends it.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import types
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

pytest.importorskip("transformers")

from reasoning_checkpoints import ENGINE, save_reasoning_checkpoint  # noqa: E402
from serving import LLM  # noqa: E402
from serving.api.http_auth import APIKeys  # noqa: E402
from serving.api.responses_store import ResponseStore, owner_of  # noqa: E402
from serving.core.model_runner import compilation_count  # noqa: E402
from serving.server import ServerThread, free_port  # noqa: E402
from conftest import SUBPROCESS_XLA_FLAGS  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "tiny-thinker"
KEY, OTHER_KEY = "key-a", "key-b"
CITY = {"type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}}
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
                "parameters": CITY}
POINT = {"type": "object", "additionalProperties": False, "required": ["x"],
         "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}}
THINK = {"thinking_token_budget": 4}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("agent_apis")
    return save_reasoning_checkpoint(str(root / "hf"), str(root / "ours"), added_tags=True)


@pytest.fixture(scope="module")
def server(checkpoint):
    llm = LLM(checkpoint, warmup=True, **ENGINE)
    compiled = compilation_count()
    store = ResponseStore(max_entries=8, ttl_s=600)
    thread = ServerThread(llm, model_name=MODEL, reasoning_parser="qwen3", tool_call_parser="hermes",
                          api_keys=APIKeys([KEY, OTHER_KEY]), responses_store=store).start()
    try:
        yield types.SimpleNamespace(
            url=thread.url, store=store,
            client=openai.OpenAI(base_url=thread.url + "/v1", api_key=KEY, max_retries=0, timeout=120),
            other=openai.OpenAI(base_url=thread.url + "/v1", api_key=OTHER_KEY, max_retries=0, timeout=120))
    finally:
        thread.stop()
    # Thinking phases, grammars after thinking and aborted streams compile nothing and leak no page.
    assert compilation_count() == compiled, "a request compiled a new step"
    assert not llm.engine.requests
    llm.engine.block_manager.check_invariants(live_seq_ids=())


def _respond(client, **kw):
    kw = {"model": MODEL, "input": "What is the weather in Paris?", "max_output_tokens": 24,
          "extra_body": {**THINK, "ignore_eos": True}, **kw}
    return client.responses.create(**kw)


# --- /v1/responses through `openai` ---------------------------------------------------------------

def test_create_gives_reasoning_and_message_items(server):
    r = _respond(server.client, instructions="Answer briefly.", metadata={"run": "1"})
    kinds = [item.type for item in r.output]
    assert kinds == ["reasoning", "message"]
    assert r.output[0].content[0].text and r.output_text == r.output[1].content[0].text
    assert "</think>" not in r.output_text
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    # 4 thinking tokens (the budget) and the end tag; the generation prompt opened the block.
    assert r.usage.output_tokens == 24 and r.usage.output_tokens_details.reasoning_tokens == 5
    assert r.metadata == {"run": "1"} and r.instructions == "Answer briefly."
    # A stateless client asks for the reasoning as an opaque string and sends the item back.
    stateless = _respond(server.client, include=["reasoning.encrypted_content"], store=False)
    item = stateless.output[0]
    assert base64.b64decode(item.encrypted_content).decode() == item.content[0].text
    turn = [{"role": "user", "content": "What is the weather in Paris?"}, item.model_dump(exclude_none=True),
            {"role": "assistant", "content": stateless.output_text}, {"role": "user", "content": "And Rome?"}]
    again = _respond(server.client, store=False, input=turn)
    # The thinking sent back reaches the template as the assistant's reasoning_content (rendered by this one).
    without = _respond(server.client, store=False, input=turn[:1] + turn[2:])
    assert again.output_text and again.usage.input_tokens > without.usage.input_tokens + 3
    with pytest.raises(openai.NotFoundError):  # store: false kept nothing
        server.client.responses.retrieve(stateless.id)


def test_stream_events_are_numbered_and_add_up_to_the_response(server):
    with server.client.responses.stream(model=MODEL, input="Hello", max_output_tokens=20,
                                        extra_body={**THINK, "ignore_eos": True}) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.incomplete" and "response.output_text.delta" in kinds
    assert "response.reasoning_text.delta" in kinds
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == final.output_text and reasoning == final.output[0].content[0].text
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 2


def test_function_tool_round_trip_with_function_call_output(server):
    first = _respond(server.client, tools=[WEATHER_TOOL], tool_choice={"type": "function", "name": "get_weather"},
                     max_output_tokens=40, extra_body=THINK)
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), CITY)
    follow_up = [{"role": "user", "content": "What is the weather in Paris?"},
                 {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                  "arguments": calls[0].arguments},
                 {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"}]
    second = _respond(server.client, input=follow_up, tools=[WEATHER_TOOL], tool_choice="none")
    assert second.output_text and not [i for i in second.output if i.type == "function_call"]


def test_streamed_function_call_arguments(server):
    with server.client.responses.stream(model=MODEL, input="Weather?", tools=[WEATHER_TOOL], tool_choice="required",
                                        max_output_tokens=60, extra_body=THINK) as stream:
        events = list(stream)
        final = stream.get_final_response()
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    call = [i for i in final.output if i.type == "function_call"][0]
    assert args == call.arguments
    jsonschema.validate(json.loads(args), CITY)


def test_json_schema_text_format_is_valid_after_thinking(server):
    r = _respond(server.client, max_output_tokens=48, extra_body=THINK,
                 text={"format": {"type": "json_schema", "name": "point", "schema": POINT, "strict": True}})
    assert r.status == "completed" and r.output[0].type == "reasoning"
    jsonschema.validate(json.loads(r.output_text), POINT)


def test_previous_response_id_continues_and_the_store_is_per_key(server):
    first = _respond(server.client, input="My name is Ada.")
    second = _respond(server.client, input="What is my name?", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    # The stored conversation is in the prompt: it is longer than the question alone.
    alone = _respond(server.client, input="What is my name?")
    assert second.usage.input_tokens > alone.usage.input_tokens + 5
    assert server.client.responses.retrieve(first.id).id == first.id
    for call in (lambda: server.other.responses.retrieve(first.id),
                 lambda: _respond(server.other, previous_response_id=first.id)):
        with pytest.raises(openai.NotFoundError):  # another key sees nothing
            call()
    server.client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        server.client.responses.retrieve(first.id)
    assert e.value.body["code"] == "not_found"


def test_the_store_is_capped(server):
    ids = [_respond(server.client, max_output_tokens=2).id for _ in range(server.store.max_entries + 2)]
    assert len(server.store) <= server.store.max_entries
    with pytest.raises(openai.NotFoundError):
        server.client.responses.retrieve(ids[0])
    assert server.client.responses.retrieve(ids[-1]).id == ids[-1]


@pytest.mark.parametrize("kw,param", [
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{**WEATHER_TOOL, "defer_loading": True}]}, "tools"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ({"reasoning": {"effort": "low", "summary": "auto"}}, "reasoning.summary"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "properties": {
        "a": {"type": "strin"}}}}}}, "text.format"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
])
def test_what_is_not_supported_is_a_400_naming_it(server, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        _respond(server.client, **kw)
    assert e.value.body["param"] == param


MALFORMED = {
    "/v1/responses": [
        {"input": [["not", "an", "item"]]}, {"input": [{"type": "message", "role": "robot", "content": "x"}]},
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        {"input": [{"type": "function_call", "call_id": 3, "name": "f", "arguments": "{}"}]},
        {"input": [{"type": "item_reference", "id": "x"}]}, {"input": "hi", "tools": ["nope"]},
        {"input": "hi", "tool_choice": {"type": "function"}}, {"input": "hi", "text": {"format": {"type": "xml"}}},
        {"input": "hi", "temperature": -1}, {"input": "hi", "tools": [WEATHER_TOOL], "tool_choice": "auto",
                                              "parallel_tool_calls": "maybe"}, {"input": ""},
    ],
    "/v1/messages": [
        {"max_tokens": 4, "messages": ["hi"]}, {"max_tokens": 4, "messages": []},
        {"messages": [{"role": "user", "content": "hi"}]},
        {"max_tokens": 4, "messages": [{"role": "user", "content": [{"text": "no type"}]}]},
        {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f"}]}]},
        {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "stop_sequences": [""]},
        {"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]},
        {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "tool"}},
        {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "sometimes"}},
        {"max_tokens": 4, "messages": [{"role": "system", "content": "hi"}]},
    ],
}


@pytest.mark.parametrize("route", sorted(MALFORMED))
def test_malformed_bodies_are_400s_in_the_routes_envelope_and_the_server_keeps_serving(server, route):
    headers = {"Authorization": f"Bearer {KEY}"}
    for body in MALFORMED[route]:
        r = httpx.post(server.url + route, headers=headers, json={"model": MODEL, **body}, timeout=60)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["message"] and (r.json()["type"] == "error" if route == "/v1/messages" else "param" in err)
    r = httpx.post(server.url + route, headers=headers, timeout=60, content=b"{not json")
    assert r.status_code == 400
    assert _respond(server.client, max_output_tokens=2).usage.output_tokens == 2


def test_the_store_expires_entries_and_keeps_owners_apart():
    now = [0.0]
    store = ResponseStore(max_entries=2, ttl_s=10, clock=lambda: now[0])
    a, b = owner_of("key-a"), owner_of("key-b")
    store.put(a, "r1", {"x": 1})
    assert store.get(a, "r1") == {"x": 1} and store.get(b, "r1") is None and store.get(owner_of(None), "r1") is None
    assert not store.delete(b, "r1") and store.get(a, "r1") is not None  # another owner cannot delete it
    now[0] = 9.9
    store.put(a, "r2", {"x": 2})
    now[0] = 10.0  # r1's time is up, r2's not
    assert store.get(a, "r1") is None and store.get(a, "r2") == {"x": 2} and len(store) == 1
    store.put(a, "r3", {}), store.put(a, "r4", {})  # over the cap: the oldest goes
    assert store.get(a, "r2") is None and len(store) == 2
    assert not ResponseStore(max_entries=0).enabled


def test_a_disconnected_stream_frees_its_request(server):
    with httpx.stream("POST", server.url + "/v1/responses", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": MODEL, "input": "Hi", "stream": True, "max_output_tokens": 400,
                            "ignore_eos": True}, timeout=60) as resp:
        for line in resp.iter_lines():
            if "output_text.delta" in line or "reasoning_text.delta" in line:
                break
    r = _respond(server.client, max_output_tokens=4)  # the server still serves
    assert r.usage.output_tokens == 4


# --- the OpenAI Agents SDK ----------------------------------------------------------------------------

class Answer(BaseModel):
    x: int = Field(ge=0, le=9)


def test_agents_sdk_runs_a_function_tool_to_a_final_answer(server):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    seen = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"Sunny in {city}"

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    agent = agents.Agent(
        name="weather", instructions="Use the tool, then answer.", tools=[get_weather], output_type=Answer,
        model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="get_weather", max_tokens=48, extra_body=THINK))
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert seen and seen[0] in ("Paris", "Rome")
    assert isinstance(result.final_output, Answer) and 0 <= result.final_output.x <= 9


# --- /v1/messages through `anthropic` -------------------------------------------------------------------

@pytest.fixture(scope="module")
def claude(server):
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def _message(claude, **kw):
    kw = {"model": MODEL, "max_tokens": 24, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
          "thinking": {"type": "enabled", "budget_tokens": 4}, **kw}
    # temperature is the older schema's field (this client no longer has it): sent as an extra.
    kw["extra_body"] = {"temperature": 0.0, "ignore_eos": True, **kw.get("extra_body", {})}
    return claude.messages.create(**kw)


def test_messages_create_gives_a_thinking_block_then_text(claude):
    m = _message(claude, system="Answer briefly.")
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking and m.content[1].text and "</think>" not in m.content[1].text
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 24 and m.role == "assistant"
    off = _message(claude, thinking={"type": "disabled"})  # the template closes the block: no thinking
    assert [b.type for b in off.content] == ["text"]
    hidden = _message(claude, system="Answer briefly.",
                      thinking={"type": "enabled", "budget_tokens": 4, "display": "omitted"})
    assert [b.type for b in hidden.content] == ["text"] and hidden.content[0].text == m.content[1].text


def test_messages_stream_adds_up_to_the_message(claude):
    with claude.messages.stream(model=MODEL, max_tokens=24, extra_body={"temperature": 0.0, "ignore_eos": True},
                                messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                                thinking={"type": "enabled", "budget_tokens": 4}) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    whole = _message(claude)
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 2
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.stop_reason == "max_tokens"


def test_messages_tool_use_round_trip(claude):
    tools = [{"name": "get_weather", "description": "The weather in a city.", "input_schema": CITY}]
    m = _message(claude, tools=tools, tool_choice={"type": "tool", "name": "get_weather"}, max_tokens=40,
                 extra_body={"ignore_eos": False})
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(uses) == 1 and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, CITY)
    with claude.messages.stream(model=MODEL, max_tokens=80, extra_body={"temperature": 0.0}, tools=tools,
                                tool_choice={"type": "any"}, thinking={"type": "enabled", "budget_tokens": 4},
                                messages=[{"role": "user", "content": "Weather?"}]) as stream:
        streamed = stream.get_final_message()
    assert [b.type for b in streamed.content][-1] == "tool_use", streamed
    assert streamed.stop_reason == "tool_use", streamed
    jsonschema.validate(streamed.content[-1].input, CITY)
    history = [{"role": "user", "content": "What is the weather in Paris?"},
               {"role": "assistant", "content": [b.model_dump() for b in m.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                             "content": "Sunny, 21 C"}]}]
    answer = _message(claude, tools=tools, messages=history)
    assert answer.content[-1].type == "text" and answer.content[-1].text


def test_messages_errors_are_anthropics_envelope_and_x_api_key_is_accepted(server, claude):
    anthropic = pytest.importorskip("anthropic")
    with pytest.raises(anthropic.BadRequestError) as e:
        _message(claude, extra_body={"frobnicate": True})
    assert e.value.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                       "message": "frobnicate: is not a field of this API"}}
    for bad in ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
                {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
                {"thinking": {"type": "enabled", "budget_tokens": -3}}):
        with pytest.raises(anthropic.BadRequestError):
            _message(claude, **bad)
    wrong = anthropic.Anthropic(base_url=server.url, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        _message(wrong)
    assert e.value.body["error"]["type"] == "authentication_error"
    # The anthropic client sends x-api-key; a Bearer header works too.
    bearer = httpx.post(server.url + "/v1/messages", headers={"Authorization": f"Bearer {KEY}"},
                        json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert bearer.status_code == 200 and bearer.json()["type"] == "message"
    count = claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert count.input_tokens > 0
    # A thinking block sent back reaches the template as the assistant's reasoning_content.
    said = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "the user greets me", "signature": ""}, {"type": "text", "text": "Hello"}]},
        {"role": "user", "content": "bye"}]
    plain = [said[0], {"role": "assistant", "content": "Hello"}, said[2]]
    assert (claude.messages.count_tokens(model=MODEL, messages=said).input_tokens
            > claude.messages.count_tokens(model=MODEL, messages=plain).input_tokens + 3)
    tokens = httpx.post(server.url + "/tokenize", headers={"Authorization": f"Bearer {KEY}"}, json={
        "messages": [{"role": "assistant", "content": "Hello", "reasoning_content": "I thought"}]}).json()["tokens"]
    text = httpx.post(server.url + "/detokenize", headers={"Authorization": f"Bearer {KEY}"},
                      json={"tokens": tokens}).json()["prompt"]
    assert "<think>\nI thought\n</think>" in text


# --- `python -m serving.server` -------------------------------------------------------------------------

def test_the_binary_serves_the_three_apis_and_refuses_an_unknown_parser(checkpoint, tmp_path):
    anthropic = pytest.importorskip("anthropic")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = SUBPROCESS_XLA_FLAGS  # one CPU device
    base = [sys.executable, "-m", "serving.server", f"--checkpoint={checkpoint}"]
    bad = subprocess.run(base + ["--reasoning_parser=qwen4"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and "reasoning_parser" in bad.stderr
    port = free_port()
    flags = [f"--port={port}", f"--served_model_name={MODEL}", "--reasoning_parser=qwen3",
             "--tool_call_parser=hermes", "--responses_store_max_entries=4", "--responses_store_ttl_s=60",
             "--log_level=warning"] + [f"--{k}={v}" for k, v in ENGINE.items()]
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(base + flags, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, f"server exited early:\n{log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"server did not come up:\n{log_path.read_text()[-3000:]}"
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=12, temperature=0.0, reasoning_effort="low")
        assert chat.choices[0].message.model_dump()["reasoning_content"] is not None
        r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=12, extra_body=THINK)
        assert r.output[0].type == "reasoning" and client.responses.retrieve(r.id).id == r.id
        m = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120).messages.create(
            model=MODEL, max_tokens=12, messages=[{"role": "user", "content": "Hi"}],
            thinking={"type": "enabled", "budget_tokens": 3})
        assert m.content[0].type == "thinking"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
