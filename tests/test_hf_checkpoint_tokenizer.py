"""A converted tiny random Llama with a real-format tokenizer and generation_config.json, through LLM.

A string prompt reaches the engine as the ids transformers' tokenizer gives
(here SmolLM's case: a BOS token that the tokenizer never adds); the
checkpoint's generation defaults become the defaults of requests that leave
them out, and only those; logprob tokens come back as text with their bytes.
"""

from __future__ import annotations

import json
import logging
import os

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_tokenizer_styles import save_style  # noqa: E402
from model.convert_hf import convert  # noqa: E402
from serving.api import http_app, http_protocol as P  # noqa: E402
from serving.llm import LLM  # noqa: E402
from serving.core.sampling_params import SamplingParams  # noqa: E402
from test_hf_parity import make_hf_model, save_hf  # noqa: E402

GENERATION = {"bos_token_id": 1, "eos_token_id": [2, 5], "temperature": 0.6, "top_p": 0.9, "top_k": 20,
              "max_new_tokens": 7, "do_sample": True}
PROMPTS = ["The capital of France is", "  two  spaces\n\n日本語 🦙", "<|im_start|>user\nhi<|im_end|>"]
ENGINE = dict(max_num_seqs=2, max_num_batched_tokens=32, num_pages=16, page_size=8, max_model_len=64)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf_dir = str(tmp_path_factory.mktemp("hf_smol"))
    save_style("bytelevel_nobos", hf_dir)
    model = make_hf_model(seed=3, vocab_size=420, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True,
                          bos_token_id=1, eos_token_id=2)
    save_hf(model, hf_dir)
    with open(os.path.join(hf_dir, "generation_config.json"), "w") as f:
        json.dump(GENERATION, f)
    out_dir = str(tmp_path_factory.mktemp("ours_smol"))
    convert(hf_dir, out_dir, dtype="float32", progress=False)
    return hf_dir, out_dir


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint[1], **ENGINE)


def test_conversion_carries_generation_config(checkpoint):
    with open(os.path.join(checkpoint[1], "generation_config.json")) as f:
        assert json.load(f) == GENERATION


def test_string_prompts_get_the_ids_transformers_gives(checkpoint, llm):
    hf = transformers.AutoTokenizer.from_pretrained(checkpoint[0])
    for i, text in enumerate(PROMPTS):
        req = llm.engine.make_request(f"p{i}", text, SamplingParams(max_tokens=1))
        assert req.prompt_token_ids == hf(text)["input_ids"]
        assert req.prompt_token_ids[0] != llm.tokenizer.bos_id or text.startswith("<|im_start|>")


def test_generation_config_gives_the_defaults_and_a_request_overrides_them(llm):
    req = llm.engine.make_request("d", "The capital of France is")
    p = req.params
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.6, 0.9, 20, 7)
    assert {2, 5} <= set(req.eos_token_ids)
    assert llm.get_default_sampling_params().temperature == 0.6
    mine = llm.engine.make_request("o", "The capital", SamplingParams(temperature=0.0, max_tokens=3)).params
    assert (mine.temperature, mine.top_p, mine.max_tokens) == (0.0, 1.0, 3)

    # The HTTP layer: a field the client leaves out takes the file's default, one it sends wins.
    ctx = http_app.ServingContext(type("AsyncEngine", (), {"engine": llm.engine})(), llm.tokenizer, "m", 64)
    left_out = ctx.sampling_params(P.ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]),
                                   None, None, None)
    assert (left_out.temperature, left_out.top_p, left_out.top_k, left_out.max_tokens) == (0.6, 0.9, 20, None)
    assert llm.engine.make_request("h", [3, 4, 5], left_out).params.max_tokens == 7  # the file's cap
    sent = ctx.sampling_params(P.CompletionRequest(prompt="x", temperature=0.25, top_k=3, max_tokens=30,
                                                   skip_special_tokens=False, spaces_between_special_tokens=False),
                               30, None, None)
    assert (sent.temperature, sent.top_p, sent.top_k, sent.max_tokens) == (0.25, 0.9, 3, 30)
    assert (sent.skip_special_tokens, sent.spaces_between_special_tokens) == (False, False)


def test_generation_config_off(checkpoint):
    llm = LLM(checkpoint[1], generation_config="off", **ENGINE)
    req = llm.engine.make_request("d", "The capital of France is")
    assert (req.params.temperature, req.params.top_k, req.params.max_tokens) == (1.0, 0, 16)
    assert 5 not in req.eos_token_ids
    with pytest.raises(ValueError, match="generation_config"):
        LLM(checkpoint[1], generation_config="vllm", **ENGINE)


def test_unknown_generation_field_is_logged(caplog):
    from serving.core.sampling_params import with_defaults

    with caplog.at_level(logging.WARNING):
        params = with_defaults({"temperature": 0.5, "no_such_knob": 1.1})
    assert params.temperature == 0.5 and "no_such_knob" in caplog.text
    with pytest.raises(ValueError, match="generation_config.json: top_p"):
        with_defaults({"top_p": 2.0})


def test_logprob_tokens_are_text_with_bytes(llm):
    """The engine's logprob entries (OutputProcessor) carry the token's text; both HTTP layouts use it."""
    import numpy as np

    tok = llm.tokenizer
    ids = tok.encode(" capital of France 🐢", add_special_tokens=False)
    assert any(tok._tok.id_to_token(i).startswith("Ġ") for i in ids)  # the raw pieces are not text
    k = 2
    result = type("StepResult", (), dict(chosen_logprob=np.full(len(ids), -0.5), rank=np.ones(len(ids), int),
                                         top_ids=np.array([[i, (i + 1) % 400] for i in ids]),
                                         top_logprobs=np.full((len(ids), k), -1.0)))()
    entries = [llm.engine.outputs._logprob_entry(result, row, t, k) for row, t in enumerate(ids)]
    chat = http_app.chat_logprobs(tok, ids, entries, k)
    assert [e.token for e in chat.content] == [tok.token_text(i) for i in ids]
    assert chat.content[0].token.startswith(" cap") and not any("Ġ" in e.token for e in chat.content)
    assert b"".join(bytes(e.bytes) for e in chat.content).decode("utf-8") == " capital of France 🐢"
    assert any(e.token.startswith("bytes:\\x") for e in chat.content)  # a piece of the turtle
    completion = http_app.completion_logprobs(tok, ids, entries)
    assert completion.tokens == [e.token for e in chat.content]
    assert all(len(top) == k for top in completion.top_logprobs)


@pytest.mark.parametrize("skip", [True, False])
def test_the_engine_detokenizes_as_the_request_asks(llm, skip):
    """skip_special_tokens reaches the engine's detokenizer: the text of the same tokens differs."""
    from types import SimpleNamespace

    tok = llm.tokenizer
    req = llm.engine.make_request(f"s{skip}", "The capital of France is",
                                  SamplingParams(max_tokens=30, skip_special_tokens=skip))
    seq = req.seqs[0]
    out = tok.encode(" Paris<|im_start|> 🐢", add_special_tokens=False)
    assert not set(out) & set(req.eos_token_ids)
    stats = SimpleNamespace(time_to_first_tokens=[], inter_token_latencies=[])
    for t in out:
        seq.token_ids.append(t)
        llm.engine.outputs.on_token(seq, t, 0, None, 0.0, stats)
    assert seq.text == (" Paris 🐢" if skip else " Paris<|im_start|> 🐢")
