"""Tokenizers: the byte tokenizer of the tiny models and the HF `tokenizers` wrapper."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from model.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

TEXTS = ["hello world", "héllo wörld", "日本語のテキスト", "llama 🦙 emoji", "tabs\tand\nnewlines", "nul \x00 byte", ""]


# --- bytes ---

@pytest.mark.parametrize("text", TEXTS)
def test_byte_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id == 256
    assert ids[1:] == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_round_trip_any_text(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids + list(tok.eos_ids)) == text


def test_byte_specials_and_invalid_utf8():
    tok = ByteTokenizer(vocab_size=300)
    assert tok.eos_ids == (257,) and tok.vocab_size == 300
    assert tok.decode([256, ord("a"), 257, 299, ord("b")]) == "ab"  # specials and unused ids vanish
    partial = list("日".encode("utf-8"))[:2]
    assert tok.decode([ord("x")] + partial) == "x\ufffd"
    assert tok.token_text(256) == "<bos>" and tok.token_text(257) == "<eos>"
    assert tok.token_text(ord("q")) == "q" and tok.token_text(0xE6) == "bytes:\\xe6"
    with pytest.raises(ValueError, match="vocab_size >= 258"):
        ByteTokenizer(vocab_size=200)


# --- Hugging Face tokenizer.json ---

CORPUS = ["the quick brown fox jumps over the lazy dog", "héllo wörld,日本語 and emoji 🦙", "def f(x):\n    return x"] * 20


def build_tokenizer_json(path):
    """A small byte-level BPE trained on the spot, with BOS/EOS special tokens."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|begin|>", "<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path))
    return tok


@pytest.fixture
def hf_dir(tmp_path):
    build_tokenizer_json(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin|>", "add_bos_token": True,  # the file has no post-processor: the flag decides
        "eos_token": {"content": "<|end|>", "lstrip": False},  # the older AddedToken-dict form
        "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
    }))
    return tmp_path


@pytest.mark.parametrize("text", TEXTS + ["unseen wörds: ñandú, Ωμέγα"])
def test_hf_round_trip(hf_dir, text):
    tok = HFTokenizer(str(hf_dir))
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id == 0
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text, add_special_tokens=False) + list(tok.eos_ids)) == text


def test_hf_merges_and_specials(hf_dir):
    tok = HFTokenizer(str(hf_dir))
    assert tok.eos_ids == (1,)
    assert tok.bos_token == "<|begin|>" and tok.eos_token == "<|end|>"
    assert 258 < tok.vocab_size <= 300
    ids = tok.encode("the quick brown fox", add_special_tokens=False)
    assert len(ids) < len("the quick brown fox")  # trained merges apply
    assert tok.token_text(0) == "<|begin|>"
    assert tok.chat_template.startswith("{% for m in messages %}")


def test_chat_template_file_and_missing_config(tmp_path):
    build_tokenizer_json(tmp_path / "tokenizer.json")
    tok = HFTokenizer(str(tmp_path))  # no tokenizer_config.json at all
    assert tok.bos_id is None and tok.eos_ids == () and tok.chat_template is None
    assert tok.encode("abc") == tok.encode("abc", add_special_tokens=False)
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}")
    assert HFTokenizer(str(tmp_path)).chat_template == "{{ messages[0].content }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    assert HFTokenizer(str(tmp_path)).chat_template == "D"


def test_load_tokenizer_picks(hf_dir, tmp_path_factory):
    assert isinstance(load_tokenizer(str(hf_dir)), HFTokenizer)
    empty = tmp_path_factory.mktemp("no_tokenizer")
    byte_tok = load_tokenizer(str(empty), vocab_size=320)
    assert isinstance(byte_tok, ByteTokenizer) and byte_tok.vocab_size == 320
    assert isinstance(load_tokenizer(None), ByteTokenizer)
