"""Reasoning outputs: the thinking apart from the answer, a thinking budget, and grammars after thinking.

Two tiny reasoning checkpoints (tests/reasoning_checkpoints.py): Qwen3-style, whose think tags are
single added tokens, served with `--reasoning_parser qwen3`; DeepSeek-R1-style, whose tags are
several tokens of plain text, served with `deepseek_r1`, so tags split across tokens and stream
chunks. The random models never close their thinking on their own: the budget does.
"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import openai
import pytest

pytest.importorskip("transformers")

from reasoning_checkpoints import ENGINE, save_reasoning_checkpoint  # noqa: E402
from serving import LLM, SamplingParams  # noqa: E402
from serving.api import reasoning as R  # noqa: E402
from serving.api.chat_template import encode_chat  # noqa: E402
from serving.core.format_params import ReasoningParams, StructuredOutputsParams  # noqa: E402
from serving.features.reasoning_phase import PhasedGrammar  # noqa: E402
from serving.server import ServerThread  # noqa: E402

ASK = [{"role": "user", "content": "What is the capital of France?"}]
POINT = {"type": "object", "additionalProperties": False, "required": ["x", "y"],
         "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                        "y": {"type": "string", "maxLength": 5}}}


# --- the text splitter ----------------------------------------------------------------------------

FMT = R.ReasoningFormat("qwen3", "<think>", "</think>", [1], [2], "undecided")


def _chunked(text: str, starts: str, cuts: list[int]) -> tuple[str, str]:
    s = R.ReasoningStream(FMT, starts)
    reasoning = content = ""
    for end in cuts + [len(text)]:
        r, c = s.step(text[:end], finished=end == len(text))
        reasoning, content = reasoning + r, content + c
    return reasoning, content


@pytest.mark.parametrize("starts,text,want", [
    ("undecided", "<think>\nhmm </think>\n\nParis.", ("\nhmm ", "Paris.")),
    ("undecided", "  <think>a</think>b", ("a", "b")),
    ("undecided", "Paris, no thinking.", (None, "Paris, no thinking.")),
    ("undecided", "<thin", (None, "<thin")),  # a finished output that only looked like a tag
    ("thinking", "still thinking <", ("still thinking <", "")),  # cut off by max_tokens
    ("thinking", "<think>r1 writes the tag</think>ok", ("r1 writes the tag", "ok")),
    ("thinking", "a</think>b</think>c", ("a", "b</think>c")),
    ("answer", "<think>not a block here", (None, "<think>not a block here")),
])
def test_split_whole_and_at_every_chunk_boundary(starts, text, want):
    assert R.split(FMT, starts, text) == want
    for cut in range(len(text) + 1):  # one boundary anywhere, and then every character its own chunk
        for cuts in ([cut], list(range(1, len(text)))):
            reasoning, content = _chunked(text, starts, cuts)
            assert (reasoning if want[0] is not None else None, content) == want, (cuts, reasoning, content)


def test_effort_budgets_leave_the_answer_its_share():
    class Req:
        thinking_token_budget, reasoning_effort = None, "low"

    assert R.thinking_budget(Req, FMT, 100) == 25
    assert R.thinking_budget(Req, FMT, None) == R.EFFORT_BUDGETS["low"][0]
    Req.thinking_token_budget = 7
    assert R.thinking_budget(Req, FMT, 100) == 7
    with pytest.raises(Exception, match="--reasoning_parser"):
        R.thinking_budget(Req, None, 100)


# --- the phase machine ----------------------------------------------------------------------------

def _allowed(mask_row) -> list[int]:
    bits = np.unpackbits(np.ascontiguousarray(mask_row).view(np.uint8), bitorder="little")
    return [] if bits.all() else [int(i) for i in np.flatnonzero(bits)]


def test_phase_forces_the_rest_of_the_end_tag_and_frees_overlap_while_thinking():
    g = PhasedGrammar(ReasoningParams([7], [9, 10], "thinking", 3), None, n=1, width=1)
    assert _allowed(g.masks[0]) == [] and not g.constrains(0)  # thinking freely: nothing barred
    assert not g.needs_pending(0, 2) and g.needs_pending(0, 3)  # 3 draws in flight could spend the budget
    for tok in (5, 6, 9):  # the model begins the end tag as the budget runs out
        assert not g.accept(0, tok)
    assert _allowed(g.masks[0]) == [10] and g.constrains(0)  # its rest is forced, not the whole tag again
    g.accept(0, 10)
    assert g.in_answer(0) and not g.constrains(0) and not g.needs_pending(0, 4)
    # Drafts: the forced token must come where it is due; the answer is free without a grammar.
    h = PhasedGrammar(ReasoningParams([7], [9, 10], "thinking", 1), None, n=1, width=1)
    assert h.valid_drafts(0, [5, 9, 10, 3]) == [5, 9, 10, 3]
    assert h.valid_drafts(0, [5, 4, 10]) == [5]
    out = np.zeros((4, 1), np.int32)
    h.fill_draft_masks(0, [5, 9, 10], out, 0)
    assert [_allowed(r) for r in out] == [[], [9], [10], []]


class _AnyAnswer:
    """A grammar that allows every token and is never complete (the phase machine on its own)."""

    def __init__(self):
        self.masks = np.full((1, 1), -1, np.int32)

    def accept(self, sample_index, token):
        return False

    def valid_drafts(self, sample_index, drafts):
        return list(drafts)


def test_an_ending_token_while_thinking_becomes_the_end_tag_only_with_a_grammar():
    g = PhasedGrammar(ReasoningParams([7], [9, 10], "thinking"), _AnyAnswer(), n=1, width=1, ends=[2, 3])
    assert g.valid_drafts(0, [5, 2, 6]) == [5]  # an ending draft is not verified as itself
    assert g.instead_of_ending(0, 5) == 5
    g.accept(0, 5)
    assert g.instead_of_ending(0, 3) == 9  # a stop token id: the end tag's first token instead
    g.accept(0, 9)
    assert _allowed(g.masks[0]) == [10] and g.constrains(0)  # and the rest of the tag is forced
    g.accept(0, 10)
    assert g.in_answer(0) and g.instead_of_ending(0, 2) == 2  # in the answer the grammar decides
    begun = PhasedGrammar(ReasoningParams([7], [9, 10], "thinking"), _AnyAnswer(), n=1, width=1, ends=[2])
    begun.accept(0, 9)
    assert begun.instead_of_ending(0, 2) == 10  # a tag the model had begun is finished
    free = PhasedGrammar(ReasoningParams([7], [9, 10], "thinking", 5), None, n=1, width=1, ends=[2])
    assert free.instead_of_ending(0, 2) == 2 and free.valid_drafts(0, [5, 2, 6]) == [5, 2, 6]


# --- the engine: budget and grammar after thinking ---------------------------------------------------

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("reasoning")
    return {"qwen3": save_reasoning_checkpoint(str(root / "q_hf"), str(root / "q"), added_tags=True),
            "deepseek_r1": save_reasoning_checkpoint(str(root / "r_hf"), str(root / "r"), added_tags=False)}


@pytest.fixture(scope="module")
def llms(checkpoints):
    return {name: LLM(path, **ENGINE) for name, path in checkpoints.items()}


def _tags(tok):
    return tok.encode("<think>", add_special_tokens=False), tok.encode("</think>", add_special_tokens=False)


def test_the_tags_are_one_token_in_one_checkpoint_and_several_in_the_other(llms):
    assert [len(t) for t in _tags(llms["qwen3"].tokenizer)] == [1, 1]
    assert min(len(t) for t in _tags(llms["deepseek_r1"].tokenizer)) > 1


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_budget_forces_the_end_tag_and_the_grammar_applies_after_it(llms, name):
    llm = llms[name]
    start, end = _tags(llm.tokenizer)
    prompt = encode_chat(ASK, llm.tokenizer)
    for budget in (0, 3, 9):
        rp = ReasoningParams(start, end, "thinking", budget)
        o = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                  reasoning=rp))[0].outputs[0]
        ids = list(o.token_ids)
        # The end tag sits where the budget ran out (or the model began it a little before).
        at = next(i for i in range(len(ids)) if ids[i:i + len(end)] == end)
        assert budget - len(end) < at <= budget, (at, ids)
        assert "</think>" in o.text
    so = StructuredOutputsParams(json=POINT)
    rp = ReasoningParams(start, end, "thinking", 6)
    o = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=60, reasoning=rp,
                                              structured_outputs=so))[0].outputs[0]
    fmt = R.make_format(name, llm.tokenizer)
    thinking, answer = R.split(fmt, "thinking", o.text)
    jsonschema.validate(json.loads(answer), POINT)  # the answer is constrained ...
    assert thinking and not thinking.lstrip().startswith("{")  # ... and the thinking was not
    # The plain grammar (no reasoning) would have constrained the first token too.
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=so))
    assert plain[0].outputs[0].text.startswith("{")


def test_speculation_respects_the_phase(checkpoints, llms):
    """Prompt-lookup drafts cross the end of thinking; the output is the plain engine's, token for token."""
    llm = llms["deepseek_r1"]
    start, end = _tags(llm.tokenizer)
    prompt = encode_chat(ASK, llm.tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=48, reasoning=ReasoningParams(start, end, "thinking", 5),
                            structured_outputs=StructuredOutputsParams(json=POINT))
    want = llm.generate([prompt], params)[0].outputs[0]
    spec = LLM(checkpoints["deepseek_r1"], speculative_method="ngram", num_speculative_tokens=3, **ENGINE)
    got = spec.generate([prompt], params)[0].outputs[0]
    assert list(got.token_ids) == list(want.token_ids)


def test_undecided_start_allows_the_opening_tag_beside_the_grammar(llms):
    """An output that may open a block: biased towards `<think>`, it thinks first and its answer still
    parses; biased against it, the grammar holds from the first token."""
    llm = llms["qwen3"]
    start, end = _tags(llm.tokenizer)
    prompt = encode_chat(ASK, llm.tokenizer, template_kwargs={"enable_thinking": False})
    so = StructuredOutputsParams(json=POINT)
    opened = llm.generate([prompt], SamplingParams(
        temperature=0.0, max_tokens=60, logit_bias={start[0]: 100.0},
        reasoning=ReasoningParams(start, end, "undecided", 4), structured_outputs=so))[0].outputs[0]
    assert opened.token_ids[0] == start[0]
    thinking, answer = R.split(R.make_format("qwen3", llm.tokenizer), "undecided", opened.text)
    assert thinking is not None
    jsonschema.validate(json.loads(answer), POINT)
    direct = llm.generate([prompt], SamplingParams(
        temperature=0.0, max_tokens=60, logit_bias={start[0]: -100.0},
        reasoning=ReasoningParams(start, end, "undecided", 4), structured_outputs=so))[0].outputs[0]
    jsonschema.validate(json.loads(direct.text), POINT)


def _ending_bias(llm) -> dict:
    """A logit bias that makes every one of the engine's end-of-sequence tokens the greedy choice."""
    return {t: 100.0 for t in llm.engine.eos_token_ids}


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_an_end_of_sequence_while_thinking_closes_the_thinking_of_a_request_with_a_format(llms, name):
    """EOS (or a stop token) is the greedy choice everywhere, held off for 3 tokens by `min_tokens`:
    drawn inside the thinking, it becomes the end tag (finished when it is several tokens), and the
    JSON follows. The stop token is a padding id of the vocabulary, which no grammar allows."""
    llm = llms[name]
    start, end = _tags(llm.tokenizer)
    prompt = encode_chat(ASK, llm.tokenizer)
    fmt = R.make_format(name, llm.tokenizer)
    for ending in ({"logit_bias": _ending_bias(llm)}, {"logit_bias": {440: 100.0}, "stop_token_ids": [440]}):
        o = llm.generate([prompt], SamplingParams(
            temperature=0.0, max_tokens=60, min_tokens=3, reasoning=ReasoningParams(start, end, "thinking"),
            structured_outputs=StructuredOutputsParams(json=POINT), **ending))[0].outputs[0]
        ids = list(o.token_ids)
        assert ids[3:3 + len(end)] == end, (ending, ids)  # the end tag stands where the EOS was drawn
        thinking, answer = R.split(fmt, "thinking", o.text)
        assert thinking, (ending, o.text)
        jsonschema.validate(json.loads(answer), POINT)
        assert o.finish_reason == "stop"


def test_an_end_of_sequence_while_thinking_ends_a_request_without_a_format(llms):
    """Without a format (a budget alone, or nothing) the EOS ends the request inside its thinking."""
    llm = llms["deepseek_r1"]
    start, end = _tags(llm.tokenizer)
    prompt = encode_chat(ASK, llm.tokenizer)
    for rp in (ReasoningParams(start, end, "thinking", 20), None):
        o = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=60, min_tokens=3, reasoning=rp,
                                                  logit_bias=_ending_bias(llm)))[0].outputs[0]
        assert len(o.token_ids) == 4 and o.token_ids[-1] in llm.engine.eos_token_ids, o.token_ids
        assert o.finish_reason == "stop" and "</think>" not in o.text


def test_unknown_parser_and_tagless_auto_are_refused(llms):
    with pytest.raises(ValueError, match="unknown --reasoning_parser"):
        R.make_format("qwen4", llms["qwen3"].tokenizer)
    from model.tokenizer import ByteTokenizer

    with pytest.raises(ValueError, match="no think tags"):
        R.make_format("auto", ByteTokenizer(300))
    fmt = R.make_format("auto", llms["qwen3"].tokenizer)
    assert (fmt.start, fmt.end, fmt.end_ids) == ("<think>", "</think>", _tags(llms["qwen3"].tokenizer)[1])


def test_llm_chat_takes_chat_template_kwargs(llms):
    llm = llms["qwen3"]
    on = llm.chat(ASK, SamplingParams(temperature=0.0, max_tokens=1))[0]
    off = llm.chat(ASK, SamplingParams(temperature=0.0, max_tokens=1),
                   chat_template_kwargs={"enable_thinking": False})[0]
    assert llm.tokenizer.decode(off.prompt_token_ids).endswith("<think>\n\n</think>\n\n")
    assert not llm.tokenizer.decode(on.prompt_token_ids).endswith("</think>\n\n")


# --- the chat route --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def servers(llms):
    threads = {name: ServerThread(llm, model_name=name, reasoning_parser=name, tool_call_parser="hermes").start()
               for name, llm in llms.items()}
    try:
        yield {name: openai.OpenAI(base_url=t.url + "/v1", api_key="unused", max_retries=0, timeout=120)
               for name, t in threads.items()}
    finally:
        for t in threads.values():
            t.stop()


def _chat(client, name, **kw):
    return client.chat.completions.create(**{"model": name, "messages": ASK, "temperature": 0.0, "max_tokens": 30,
                                             **kw})


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_chat_reasoning_apart_from_content_streamed_or_not(servers, name):
    client = servers[name]
    extra = {"thinking_token_budget": 6, "ignore_eos": True}
    msg = _chat(client, name, extra_body=extra).choices[0].message
    d = msg.model_dump()
    assert d["reasoning_content"] == d["reasoning"] and d["reasoning_content"]
    assert "</think>" not in (d["content"] or "") and "</think>" not in d["reasoning_content"]
    reasoning = content = ""
    for chunk in _chat(client, name, extra_body=extra, stream=True):
        for c in chunk.choices:
            delta = c.delta.model_dump()
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            assert (delta.get("reasoning_content") or None) == (delta.get("reasoning") or None)
    assert (reasoning, content) == (d["reasoning_content"], d["content"] or "")


def test_enable_thinking_false_and_include_reasoning_false(servers):
    client = servers["qwen3"]
    off = _chat(client, "qwen3", extra_body={"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True})
    assert off.choices[0].message.model_dump()["reasoning_content"] is None
    assert "</think>" not in off.choices[0].message.content
    hidden = _chat(client, "qwen3", extra_body={"include_reasoning": False, "thinking_token_budget": 4,
                                                "ignore_eos": True})
    shown = _chat(client, "qwen3", extra_body={"thinking_token_budget": 4, "ignore_eos": True})
    assert hidden.choices[0].message.model_dump()["reasoning_content"] is None
    assert hidden.choices[0].message.content == shown.choices[0].message.content
    assert shown.choices[0].message.model_dump()["reasoning_content"]


def test_reasoning_effort_low_leaves_the_answer_its_tokens(servers):
    out = _chat(servers["qwen3"], "qwen3", reasoning_effort="low", max_tokens=40, extra_body={"ignore_eos": True})
    usage, msg = out.usage, out.choices[0].message
    assert usage.completion_tokens == 40 and msg.content  # thinking stopped at 10 tokens, the answer got the rest


def test_json_schema_after_thinking_through_the_route(servers):
    out = _chat(servers["deepseek_r1"], "deepseek_r1", max_tokens=60, extra_body={"thinking_token_budget": 5},
                response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": POINT}})
    msg = out.choices[0].message
    jsonschema.validate(json.loads(msg.content), POINT)
    assert msg.model_dump()["reasoning_content"]


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_json_schema_when_the_model_ends_while_thinking_through_the_route(llms, servers, name):
    """An EOS drawn inside the thinking: with a format the content is still valid JSON; without one
    the request ends there, with the thinking and no content."""
    bias = {str(t): 100 for t in _ending_bias(llms[name])}
    schema = {"type": "json_schema", "json_schema": {"name": "p", "schema": POINT}}
    for stream in (False, True):
        out = _chat(servers[name], name, max_tokens=60, logit_bias=bias, response_format=schema,
                    extra_body={"min_tokens": 3}, stream=stream)
        if stream:
            reasoning = content = ""
            for chunk in out:
                for c in chunk.choices:
                    delta = c.delta.model_dump()
                    reasoning += delta.get("reasoning_content") or ""
                    content += delta.get("content") or ""
        else:
            msg = out.choices[0].message
            reasoning, content = msg.model_dump()["reasoning_content"], msg.content
        jsonschema.validate(json.loads(content), POINT)
        assert reasoning
    plain = _chat(servers[name], name, max_tokens=60, logit_bias=bias, extra_body={"min_tokens": 3})
    msg = plain.choices[0].message
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens == 4
    assert msg.model_dump()["reasoning_content"] and msg.content is None


def test_bad_reasoning_fields_are_400s(servers):
    client = servers["qwen3"]
    for extra, param in (({"thinking_token_budget": -1}, "thinking_token_budget"),
                         ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs")):
        with pytest.raises(openai.BadRequestError) as e:
            _chat(client, "qwen3", extra_body=extra)
        assert e.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, "qwen3", reasoning_effort="extreme")
    assert e.value.body["param"] == "reasoning_effort"


def test_allowed_token_ids_must_allow_the_forced_tags(llms):
    llm = llms["qwen3"]
    start, end = _tags(llm.tokenizer)
    params = SamplingParams(max_tokens=4, allowed_token_ids=[5, 6],
                            reasoning=ReasoningParams(start, end, "thinking", 2))
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.engine.make_request("x", [5, 6, 7], params)
