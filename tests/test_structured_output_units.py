"""Units of structured outputs and tool calling that need no engine: the tool-call parsers on fixed
strings, the streamed scan of forced calls, the chat template's tools, the device bitmask against
its numpy statement, and llguidance's tokenizer built from a tokenizer.json."""

import json

import jax
import numpy as np
import pytest

from serving.api.chat_template import render_chat
from serving.api.tool_calls import ToolPlan, ToolStream, scan_required
from serving.api.tool_parsers import get_parser
from serving.core.format_params import StructuredOutputsParams
from serving.features.structured_output import (StructuredOutputs, apply_token_bitmask,
                                            apply_token_bitmask_reference, bitmask_width)


# --- parsers ---------------------------------------------------------------------------------------

def _args(calls):
    return [(n, json.loads(a)) for n, a in calls]


def test_llama3_json_parser():
    p = get_parser("llama3_json")
    content, calls = p.parse('{"name": "get_weather", "parameters": {"city": "Paris"}}')
    assert content is None and _args(calls) == [("get_weather", {"city": "Paris"})]
    content, calls = p.parse('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}')
    assert _args(calls) == [("a", {}), ("b", {"x": 1})]
    assert p.parse("The weather is fine.") == ("The weather is fine.", [])
    assert p.parse('{"name": "a", "parameters": ') == ('{"name": "a", "parameters": ', [])  # cut off: text
    assert p.may_start('{"na') == 0 and p.may_start("Hello") == 5


def test_hermes_parser():
    p = get_parser("hermes")
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    content, calls = p.parse(text)
    assert content == "Let me check."
    assert _args(calls) == [("get_weather", {"city": "Oslo"}), ("add", {"a": 1, "b": 2})]
    assert p.parse("no calls here") == ("no calls here", [])
    assert p.parse("<tool_call>{not json}</tool_call>")[1] == []
    assert p.may_start("Sure <tool") == 5 and p.may_start("Sure") == 4


def test_mistral_parser_both_formats():
    p = get_parser("mistral")
    content, calls = p.parse('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": "neg", "arguments": {}}]')
    assert content is None and _args(calls) == [("add", {"a": 1}), ("neg", {})]
    content, calls = p.parse('[TOOL_CALLS]add[ARGS]{"a": 2}[TOOL_CALLS]neg[ARGS]{}')
    assert _args(calls) == [("add", {"a": 2}), ("neg", {})]
    assert p.parse("plain") == ("plain", [])
    with pytest.raises(ValueError, match="unknown tool call parser"):
        get_parser("nope")


# --- forced calls, streamed ------------------------------------------------------------------------

def test_scan_required_follows_a_growing_array():
    full = '[{"name":"get_weather","parameters":{"city":"a\\"}b"}},{"name":"add","parameters":{"a":[1,2]}}]'
    assert scan_required(full) == [["get_weather", '{"city":"a\\"}b"}'], ["add", '{"a":[1,2]}']]
    plan = ToolPlan("required")
    stream = ToolStream(plan)
    deltas = []
    for k in range(1, len(full) + 1):  # one character at a time, as a byte model writes it
        content, calls = stream.step(full[:k], k == len(full))
        assert content == ""
        deltas += calls
    heads = [d for d in deltas if d.id is not None]
    assert [(d.index, d.function.name) for d in heads] == [(0, "get_weather"), (1, "add")]
    for i, expected in enumerate([{"city": 'a"}b'}, {"a": [1, 2]}]):
        args = "".join(d.function.arguments for d in deltas if d.index == i)
        assert json.loads(args) == expected


def test_chat_template_gets_tools_and_tool_calls():
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "1+1?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]},
                {"role": "tool", "content": "2", "tool_call_id": "c1"}]
    text = render_chat(messages, None, tools=tools)
    assert text.startswith("<|tools|>\nadd\n<|user|>")  # the tools come first
    assert '<|call|>add {"a": 1}\n' in text and "<|tool|>\n2\n" in text
    assert "<|tools|>" not in render_chat(messages[:1], None)


# --- the mask on the device ------------------------------------------------------------------------

@pytest.mark.parametrize("vocab", [320, 97])
def test_device_bitmask_equals_numpy_reference(vocab):
    rng = np.random.default_rng(vocab)
    rows, width = 6, bitmask_width(vocab)
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    mask = rng.integers(-2**31, 2**31, (rows, width), dtype=np.int64).astype(np.int32)
    mask[1] = -1  # all allowed
    mask[2] = 0  # nothing allowed: left alone
    mask[3] = 0
    mask[3, 0] = 1 << 5  # one token
    got = np.asarray(jax.jit(apply_token_bitmask)(logits, mask))
    ref = apply_token_bitmask_reference(logits, mask)
    np.testing.assert_array_equal(got, ref)
    assert np.argmax(got[3]) == 5 and np.isfinite(got[3]).sum() == 1
    np.testing.assert_array_equal(got[1], logits[1])
    assert np.isneginf(got[0]).any()  # the random rows do mask
    ones = np.full((rows, width), -1, np.int32)
    np.testing.assert_array_equal(np.asarray(jax.jit(apply_token_bitmask)(logits, ones)), logits)


def test_grammar_over_a_tokenizer_json(tmp_path):
    """llguidance's tokenizer from a tokenizer.json: the mask allows exactly the tokens a regex can take."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from model.tokenizer import HFTokenizer

    vocab = {"<eos>": 0, "a": 1, "b": 2, "ab": 3, "c": 4, "1": 5}
    tok = Tokenizer(models.BPE(vocab, merges=[("a", "b")]))  # a byte-level BPE, as Llama 3's and Qwen's are
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(tmp_path / "tokenizer.json"))
    so = StructuredOutputs(HFTokenizer(str(tmp_path)), vocab_size=8, eos_token_ids=(0,))
    grammar = so.for_request(StructuredOutputsParams(regex="(ab|a)c"), n=1)
    allowed = np.unpackbits(grammar.masks[0].view(np.uint8), bitorder="little")[:8]
    assert np.nonzero(allowed)[0].tolist() == [1, 3]  # "a" or "ab"; never the padding ids 6, 7
    assert not grammar.accept(0, 3)
    allowed = np.unpackbits(grammar.masks[0].view(np.uint8), bitorder="little")[:8]
    assert np.nonzero(allowed)[0].tolist() == [4]
    assert grammar.accept(0, 4)  # complete
    with pytest.raises(ValueError, match="regex"):
        so.for_request(StructuredOutputsParams(regex="(a"), n=1)


def test_auto_tool_stream_sends_text_until_a_call_may_begin():
    from serving.api.tool_parsers import HermesParser

    full = 'Checking. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    stream = ToolStream(ToolPlan("auto", parser=HermesParser()))
    content, deltas = "", []
    for k in range(1, len(full) + 1):
        text, calls = stream.step(full[:k], k == len(full))
        content += text
        deltas += calls
        if k < len(full):
            assert not calls and "<" not in content  # a possible marker is held back
    assert content == "Checking. "
    assert [d.function.name for d in deltas if d.id] == ["add"]
    assert json.loads("".join(d.function.arguments for d in deltas)) == {"a": 1}
    assert stream.has_calls


@pytest.mark.parametrize("whitespace", [False, True])
def test_json_whitespace_is_an_option(whitespace):
    from model.tokenizer import ByteTokenizer

    so = StructuredOutputs(ByteTokenizer(), 320, (ByteTokenizer.EOS,), whitespace=False)
    grammar = so.for_request(StructuredOutputsParams(json={"type": "object"}, whitespace=whitespace), n=2)
    assert not grammar.accept(1, ord("{"))
    allowed = np.unpackbits(grammar.masks.view(np.uint8), axis=-1, bitorder="little")[:, :320]
    assert bool(allowed[1, ord(" ")]) == whitespace and allowed[1, ord('"')] and allowed[1, ord("}")]
    assert allowed[0, ord("{")] and not allowed[0, ord("}")]  # sample 0 still at the start
