"""HFTokenizer against transformers.AutoTokenizer, on tokenizers in every style real checkpoints ship.

Each style (tests/hf_tokenizer_styles.py) is saved in the Hugging Face format
and loaded by both. Encoding (with and without special tokens), decoding
(skipping special tokens or not) and the incremental detokenizer over every
prefix must agree; chat prompts must start with exactly one BOS; logprob
tokens are text with the bytes they add.
"""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from hf_tokenizer_styles import STYLES, save_style  # noqa: E402
from model.hf_tokenizer import HFTokenizer  # noqa: E402
from serving.api.chat_template import encode_chat  # noqa: E402
from serving.core.detokenizer import WindowDetokenizer  # noqa: E402

TEXTS = [
    "hello world", "The capital of France is", " leading space", "trailing space ", "  two  spaces",
    "\n\nnewlines\n\n\n", "\ttabs\t\tand\r\nCRLF", "日本語のテキスト", "中文字符测试，还有标点。", "emoji 🦙🚀",
    "skin tone 👍🏽 and flag 🇫🇷 and ZWJ 👩‍💻", "mixed 中文 and ñ and Ωμέγα ⚡️ ∑", "unseen: Ꭿ ꙮ 𝔘𝔫𝔦",
    "<s> special </s> text", "<|im_start|>user\nhi<|im_end|>", "<bos><start_of_turn>user\nhi<end_of_turn>",
    "<|begin_of_text|>x<|end_of_text|>", "[INST] hi [/INST]", "a", " ", "", "    indented\n\tcode()  # c",
]


@pytest.fixture(scope="module", params=STYLES)
def style(request, tmp_path_factory):
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    directory = save_style(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, transformers.AutoTokenizer.from_pretrained(directory), HFTokenizer(directory)


def test_encode_matches_transformers(style):
    name, hf, ours = style
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == \
                hf(text, add_special_tokens=special)["input_ids"], (name, text, special)
    assert ours.adds_bos == (name != "bytelevel_nobos")
    assert ours.encode("x")[:1] == ([ours.bos_id] if ours.adds_bos else ours.encode("x", False)[:1])


def test_decode_matches_transformers(style):
    name, hf, ours = style
    saw_special = False
    for text in TEXTS:
        ids = hf(text)["input_ids"]
        saw_special |= any(i in ours.special_ids for i in ids)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), \
                (name, text, skip)
    assert saw_special  # skip_special_tokens was exercised


def _stream(tok, ids, prompt=(), **kw):
    """(deltas, text released before the flush, text after it)."""
    d = WindowDetokenizer(tok, list(prompt), **kw)
    deltas = [d.push(i) for i in ids]
    released = d.text
    tail = d.flush()
    assert "".join(deltas) + tail == d.text
    return deltas, released, d.text


@pytest.mark.parametrize("skip, spaces", [(True, True), (False, True), (False, False)])
def test_incremental_detokenization_equals_full_decode_at_every_prefix(style, skip, spaces):
    """Released text is never taken back (it begins the final text), and a prefix that ends on a whole
    character streams to its full decode. (One that ends inside a character may not: byte fallback
    turns a run of byte tokens that is not valid UTF-8 into one U+FFFD per byte, the whole ones too.)"""
    name, hf, ours = style
    kw = dict(skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    for text in TEXTS:
        ids = hf(text)["input_ids"]
        final = ours.decode(ids, **kw)
        for n in range(len(ids) + 1):
            _, released, streamed = _stream(ours, ids[:n], **kw)
            assert final.startswith(released), (name, text, n)
            full = ours.decode(ids[:n], **kw)
            if "\ufffd" not in full:
                assert streamed == full, (name, text, n)


def test_split_characters_are_held_back(style):
    """One emoji is several tokens here (byte-level pieces, or <0xNN> byte-fallback tokens): no delta
    carries part of it, and the character appears whole with the token that completes it."""
    name, _, ours = style
    for char in "🐢龍":  # in no training text: several tokens each
        ids = ours.encode(f"ok {char}!", add_special_tokens=False)
        assert len(ids) >= 5
        deltas, _, text = _stream(ours, ids)
        assert text == ours.decode(ids) == f"ok {char}!" and all("\ufffd" not in d for d in deltas)
        assert sum(char in d for d in deltas) == 1 and deltas.count("") >= 1


def test_first_generated_token_keeps_its_space(style):
    """SentencePiece strips the `▁` of a text's first token; after a prompt it is a space."""
    name, _, ours = style
    prompt = ours.encode("The capital of France is")
    out = ours.encode(" Paris, of course", add_special_tokens=False)
    if name == "sentencepiece":  # its normalizer prepends the `▁` itself
        out = ours.encode("Paris, of course", add_special_tokens=False)
    assert ours.decode(prompt + out) == "The capital of France is Paris, of course"
    assert ours.decode(out) == ("Paris, of course" if name in ("sentencepiece", "metaspace")
                                else " Paris, of course")  # alone, a leading `▁` is stripped
    assert _stream(ours, out, prompt)[2] == " Paris, of course"


def test_spaces_between_special_tokens_matters():
    """WordPiece-like decoders put a space before every non-## token: False glues added tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordPiece({"[UNK]": 0, "[A]": 1, "[B]": 2, "hi": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(["[A]", "[B]"])

    import tempfile

    d = tempfile.mkdtemp()
    tok.save(f"{d}/tokenizer.json")
    ours = HFTokenizer(d)
    ids = [3, 1, 2, 3]
    assert ours.decode(ids, skip_special_tokens=False) == "hi [A] [B] hi"
    assert ours.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=False) == "hi [A][B] hi"
    assert ours.decode(ids) == "hi hi"
    assert _stream(ours, ids, skip_special_tokens=False, spaces_between_special_tokens=False)[2] == "hi [A][B] hi"


def test_logprob_tokens_are_text_with_bytes(style):
    name, _, ours = style
    ids = ours.encode("The capital of France", add_special_tokens=False)
    texts = [ours.token_text(i) for i in ids]
    assert "".join(texts).strip() == "The capital of France"
    assert any(" " in t for t in texts) and not any("Ġ" in t or "\u2581" in t for t in texts)
    for i, t in zip(ids, texts):
        assert bytes(ours.token_bytes(i)).decode("utf-8") == t
    emoji = ours.encode("🐢", add_special_tokens=False)  # in no training text: split into byte tokens
    assert bytes(b for i in emoji for b in ours.token_bytes(i)).decode("utf-8").strip() == "🐢"
    partial = [i for i in emoji if "🐢" not in ours.token_text(i)]
    assert partial and all(ours.token_text(i).startswith("bytes:\\x") for i in partial if
                           ours.token_text(i).strip())
    if ours.bos_id is not None:
        assert ours.token_text(ours.bos_id) == ours.bos_token


def test_chat_prompt_has_one_bos(style):
    name, hf, ours = style
    msgs = [{"role": "user", "content": "Hello there"}]
    ids = encode_chat(msgs, ours)
    if ours.chat_template is None:
        return
    expected = hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    expected = list(expected["input_ids"]) if hasattr(expected, "keys") else list(expected)
    assert ids == expected
    assert ids[:2] != [ours.bos_id] * 2
    assert ids[0] == ours.bos_id or not ours.adds_bos


def test_chat_prompt_gets_bos_when_the_template_writes_none(tmp_path):
    directory = save_style("sentencepiece", tmp_path)
    conf = json.load(open(f"{directory}/tokenizer_config.json"))
    conf["chat_template"] = "{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
    json.dump(conf, open(f"{directory}/tokenizer_config.json", "w"))
    ours = HFTokenizer(directory)
    ids = encode_chat([{"role": "user", "content": "hi"}], ours)
    assert ids[0] == ours.bos_id and ids.count(ours.bos_id) == 1


def test_config_names_make_tokens_special(tmp_path):
    """A token the config names (here `<|im_end|>` as EOS) is special even if the file says otherwise."""
    directory = save_style("bytelevel_nobos", tmp_path)
    raw = json.load(open(f"{directory}/tokenizer.json"))
    for t in raw["added_tokens"]:
        t["special"] = False
    json.dump(raw, open(f"{directory}/tokenizer.json", "w"))
    ours = HFTokenizer(directory)
    eos = ours.eos_ids[0]
    assert eos in ours.special_ids and ours.decode(ours.encode("hi<|im_end|>")) == "hi"


def test_config_flags_decide_where_the_file_has_no_post_processor(tmp_path):
    """transformers 4's Llama / Gemma tokenizers added BOS / EOS from the config's flags; a file without a
    post-processor says nothing else, so the flags decide. A chat prompt still never ends with EOS."""
    directory = save_style("sentencepiece", tmp_path)
    raw = json.load(open(f"{directory}/tokenizer.json"))
    raw["post_processor"] = None
    json.dump(raw, open(f"{directory}/tokenizer.json", "w"))
    conf = json.load(open(f"{directory}/tokenizer_config.json"))
    for add_bos, add_eos in ((True, True), (False, True), (False, False)):
        conf.update(add_bos_token=add_bos, add_eos_token=add_eos)
        json.dump(conf, open(f"{directory}/tokenizer_config.json", "w"))
        ours = HFTokenizer(directory)
        plain = ours.encode("hi there", add_special_tokens=False)
        expected = [ours.bos_id] * add_bos + plain + list(ours.eos_ids) * add_eos
        assert ours.encode("hi there") == expected and ours.adds_bos == add_bos
        chat = encode_chat([{"role": "user", "content": "hi"}], ours)
        assert chat[-1] not in ours.eos_ids and chat[:2] != [ours.bos_id] * 2
