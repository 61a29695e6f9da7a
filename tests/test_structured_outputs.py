"""Structured outputs and tool calling end to end: the official `openai` client against a live server
over the embedded byte model, and `LLM.generate` with `SamplingParams.structured_outputs`.

One engine per module (warm-up compiles a handful of step shapes). The `LLM.generate` tests come
first: once the HTTP server is started (for the rest of the module) its engine loop owns the engine.
"""

import json
import os
import re

import jsonschema
import openai
import pytest

from serving import LLM, SamplingParams
from serving.core.engine import Engine
from serving.llm import default_checkpoint_dir
from serving.features.structured_output import StructuredOutputsPart
from serving.server import ServerThread

MODEL = "ridgeline-so"
# The engine of tests/test_server.py: the same step shapes, so a run of both compiles them once.
ENGINE = dict(max_num_seqs=16, max_num_batched_tokens=32, min_token_bucket=32, page_size=16, max_model_len=128,
              attention_backend="reference")
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 6}}}
ADD = {"type": "object", "additionalProperties": False, "required": ["a"],
       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
ASK = [{"role": "user", "content": "Weather?"}]

pytestmark = pytest.mark.skipif(not os.path.isdir(default_checkpoint_dir()), reason="needs the embedded model")


@pytest.fixture(scope="module")
def llm():
    return LLM(warmup=True, **ENGINE)


@pytest.fixture(scope="module")
def client(llm):
    from serving.core.model_runner import compilation_count

    compiled = compilation_count()
    thread = ServerThread(llm, model_name=MODEL, tool_call_parser="hermes").start()
    try:
        yield openai.OpenAI(base_url=thread.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        thread.stop()
    assert compilation_count() == compiled, "a structured-output request compiled a new step"


# --- through LLM.generate -----------------------------------------------------------------------------

def test_llm_generate_same_with_overlap_on_and_off(llm):
    """Seeded grammar-constrained samples are the same whether steps overlap or not (n > 1, and the
    same prompt twice so the second request reuses the first one's cached prefix)."""
    sp = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=60, structured_outputs={"json": PERSON})
    prompts = ["<|user|>\nA person\n<|assistant|>\n"] * 2
    steps = llm.engine.stats().num_steps
    overlapped = [llm.generate([p], sp)[0] for p in prompts]
    # A constrained sequence joins every step (its step is processed before the next is scheduled),
    # not every other one: about one step per token, plus prefill and the last step's processing.
    longest = [max(len(c.token_ids) for c in out.outputs) for out in overlapped]
    assert llm.engine.stats().num_steps - steps <= sum(longest) + 2 * len(prompts) + 2
    # The same runner under a second engine that steps one at a time (the server is not running yet).
    stepwise = Engine(llm.config, None, llm.tokenizer, llm.engine.config.__class__(**{
        **{k: getattr(llm.engine.config, k) for k in llm.engine.config.__dataclass_fields__},
        "async_scheduling": False}), runner=llm.engine.runner, parts=[llm.engine.part(StructuredOutputsPart)])
    for i, p in enumerate(prompts):
        stepwise.add_request(str(i), p, sp)
    done = {}
    while stepwise.has_unfinished_requests():
        for out in stepwise.step():
            if out.finished:
                done[out.request_id] = out
    for i, out in enumerate(overlapped):
        assert [c.text for c in out.outputs] == [c.text for c in done[str(i)].outputs]
        for c in out.outputs:
            jsonschema.validate(json.loads(c.text), PERSON)
    assert overlapped[1].num_cached_tokens > 0
    llm.engine.reset_prefix_cache()  # the second engine wrote into pages the first one has cached


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_speculation_keeps_constrained_output(llm, method):
    """Under speculative decoding a constrained request gives the plain engine's greedy output: drafts
    the grammar does not allow are cut off, row j of a verifying sequence is masked as after drafts
    0..j-1, and the matcher takes in only the accepted tokens."""
    spec = LLM(speculative_method=method, num_speculative_tokens=3, **ENGINE)
    prompts = ["<|user|>\nA person\n<|assistant|>\n", "<|user|>\nname and age\n<|assistant|>\n{"]
    sps = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs={"json": PERSON}),
           SamplingParams(temperature=0.0, max_tokens=30, structured_outputs={"regex": r"(def|class) [a-z_]{1,12}\("}),
           SamplingParams(temperature=0.0, max_tokens=60, structured_outputs={"choice": ["self.assertEqual",
                                                                                          "self.value"]})]
    jobs = [(p, sp) for p in prompts for sp in sps]
    want = [o.outputs[0].text for o in llm.generate([p for p, _ in jobs], [sp for _, sp in jobs])]
    got = [o.outputs[0].text for o in spec.generate([p for p, _ in jobs], [sp for _, sp in jobs])]
    st = spec.engine.stats().spec_decode
    assert st.num_accepted_tokens > 0, st
    assert got == want
    for text in got[0::3]:
        jsonschema.validate(json.loads(text), PERSON)
    assert all(re.fullmatch(r"(def|class) [a-z_]{1,12}\(", t) for t in got[1::3])
    assert all(t in ("self.assertEqual", "self.value") for t in got[2::3])


# --- through the HTTP API ----------------------------------------------------------------------------

def test_json_schema_response_with_n_samples_all_validate(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Who?"}], n=3,
                                       response_format=fmt, temperature=1.0, seed=7, max_tokens=60)
    assert len(r.choices) == 3
    texts = set()
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), PERSON)
        assert " " not in c.message.content.replace(json.loads(c.message.content)["name"], "")  # no free spaces
        texts.add(c.message.content)
    assert len(texts) > 1  # independent samples, each under its own grammar


def test_json_object_regex_and_choice(client):
    r = client.completions.create(model=MODEL, prompt="<|user|>\nJSON\n<|assistant|>\n", temperature=0,
                                  max_tokens=40, extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].text), dict)
    for seed in range(3):
        r = client.completions.create(model=MODEL, prompt="def f(x):", temperature=1.0, seed=seed, max_tokens=12,
                                      extra_body={"structured_outputs": {"regex": "[a-c]{2}-[0-9]{1,3}"}})
        assert re.fullmatch("[a-c]{2}-[0-9]{1,3}", r.choices[0].text), r.choices[0].text
        r = client.completions.create(model=MODEL, prompt="def f(x):", temperature=1.0, seed=seed, max_tokens=12,
                                      extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe so"]}})
        assert r.choices[0].text in ("yes", "no", "maybe so") and r.choices[0].finish_reason == "stop"
    lark = 'start: num "+" num\nnum: /[1-9][0-9]?/'
    r = client.completions.create(model=MODEL, prompt="1+1=", temperature=1.0, seed=5, max_tokens=12,
                                  extra_body={"structured_outputs": {"grammar": lark}})
    assert re.fullmatch(r"[1-9][0-9]?\+[1-9][0-9]?", r.choices[0].text), r.choices[0].text


def test_what_cannot_compile_is_a_400_naming_it(client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, response_format=bad)
    assert e.value.body["param"] == "response_format" and "frobnicate" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", extra_body={"structured_outputs": {"regex": "(ab"}})
    assert e.value.body["param"] == "structured_outputs" and "unclosed group" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", extra_body={"structured_outputs": {"regex": "a",
                                                                                             "choice": ["b"]}})
    assert "exactly one" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # a forced call and a response format at once
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                       response_format={"type": "json_object"})
    assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice" and "nope" in e.value.body["message"]


def test_streamed_required_tool_call_arguments_match_the_schema(client):
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, stream=True, temperature=1.0, seed=3,
                                            max_tokens=60)
    heads, args, finishes = [], [], []
    for chunk in stream:
        for choice in chunk.choices:
            assert not choice.delta.content
            for d in choice.delta.tool_calls or []:
                assert d.index == 0
                if d.id is not None:
                    heads.append(d.function.name)
                if d.function and d.function.arguments:
                    args.append(d.function.arguments)
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    assert finishes == ["tool_calls"] and len(heads) == 1 and heads[0] in ("get_weather", "add")
    assert len(args) > 1  # sent as it is written, not in one piece
    jsonschema.validate(json.loads("".join(args)), WEATHER if heads[0] == "get_weather" else ADD)


def test_named_function_and_tool_messages_round_trip(client):
    named = {"type": "function", "function": {"name": "add"}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=30)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    (call,) = msg.tool_calls
    assert call.function.name == "add" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), ADD)
    # The call and its result go back as history; "none" answers in text.
    history = ASK + [msg.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "4"}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=4,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens > len(call.function.arguments)  # the call was rendered into the prompt


