"""A checkpoint's Hugging Face tokenizer, read the way transformers reads it.

The files are `tokenizer.json` (the `tokenizers` pipeline: normalizer,
pre-tokenizer, model, post-processor, decoder), `tokenizer_config.json` and
`special_tokens_map.json`. What transformers (5.x, `TokenizersBackend`) does
with them, and so what this class does:

* **Special tokens at encode time** come from `tokenizer.json`'s
  post-processor, as it is (Llama 3's template writes `<|begin_of_text|>`,
  Llama 2's and Gemma's write `<s>` / `<bos>`, a `ByteLevel` one writes
  nothing): transformers 5 ignores `add_bos_token` / `add_eos_token` when
  the file exists. Where the file has no post-processor, those two flags are
  all the checkpoint says, and they decide (`[BOS] $A [EOS]`, each part only
  when its flag is true), as transformers 4's Llama and Gemma tokenizers did;
  transformers 5 would add nothing there. So a string prompt gets BOS
  exactly when the checkpoint's tokenizer adds it.
* **Which tokens are special** (what `skip_special_tokens` drops): the added
  tokens `tokenizer.json` marks special, plus every token the config names
  (`bos_token`, `eos_token`, `unk_token`, `pad_token`,
  `additional_special_tokens`, `added_tokens_decoder` entries with
  `special: true`) that is in the vocabulary.
* **Decoding** is the `tokenizers` decode. `clean_up_tokenization_spaces`
  is not applied: transformers 5 ignores it for BPE models, and every
  tokenizer family served here is BPE. `spaces_between_special_tokens=False`
  with `skip_special_tokens=False` follows vLLM: an added token that directly
  follows another added token is written as its bare content, without
  whatever space the decoder put before it (only WordPiece-like decoders put
  one there).

Per-token text for logprobs (`token_text`, `token_bytes`) is the token's own
bytes as the decoder would emit them inside a text (`Ġcapital` is
`' capital'`, `▁capital` is `' capital'`, `<0xE2>` is the byte 0xE2), not the
vocabulary's spelling.
"""

from __future__ import annotations

import json
import os
import re
from typing import Iterable, Optional

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def token_content(token) -> Optional[str]:
    """A special token as the config writes it: a string, or an AddedToken dict's `content`."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable stand-in character -> the byte it stands for."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    codes = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes)}


def _decoder_steps(decoder: Optional[dict]) -> list[dict]:
    """The decoder configs of tokenizer.json, a Sequence flattened."""
    if not decoder:
        return []
    if decoder.get("type") == "Sequence":
        return [s for d in decoder.get("decoders", []) for s in _decoder_steps(d)]
    return [decoder]


class HFTokenizer:
    """`encode`, `decode`, `token_text` / `token_bytes` of a checkpoint's tokenizer files (see the module doc)."""

    def __init__(self, directory: str):
        from tokenizers import AddedToken, Tokenizer, processors

        with open(os.path.join(directory, "tokenizer.json")) as f:
            raw = json.load(f)
        self._tok = Tokenizer.from_str(json.dumps(raw))
        conf = _read_json(os.path.join(directory, "tokenizer_config.json"))
        smap = _read_json(os.path.join(directory, "special_tokens_map.json"))
        named = {k: token_content(conf.get(k, smap.get(k))) for k in _NAMED_SPECIALS}
        self.chat_template = _chat_template(directory, conf)
        self.bos_token, self.eos_token = named["bos_token"], named["eos_token"]
        self._bos = self._id(self.bos_token)
        eos = self._id(self.eos_token)
        self._eos = (eos,) if eos is not None else ()

        # Every token the config calls special is special to the backend (what skip_special_tokens drops).
        special = [t for t in named.values() if t]
        extra = conf.get("additional_special_tokens", smap.get("additional_special_tokens")) or []
        extra = list(extra) if isinstance(extra, list) else []
        more = conf.get("extra_special_tokens") or []  # transformers 5: a list, or a dict of names
        extra += list(more.values()) if isinstance(more, dict) else list(more)
        special += [token_content(t) for t in extra if token_content(t)]
        special += [token_content(t) for t in (conf.get("added_tokens_decoder") or {}).values()
                    if isinstance(t, dict) and t.get("special") and token_content(t)]
        decoder = self._tok.get_added_tokens_decoder()
        already = {t.content for t in decoder.values() if t.special}
        promote = [t for t in dict.fromkeys(special) if t not in already and self._tok.token_to_id(t) is not None]
        if promote:
            self._tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in promote])
            decoder = self._tok.get_added_tokens_decoder()
        self._added = {i: t.content for i, t in decoder.items()}
        self.special_ids = frozenset(i for i, t in decoder.items() if t.special)

        if self._tok.post_processor is None:  # the config's flags decide (module doc)
            add_bos = bool(conf.get("add_bos_token", False)) and self._bos is not None
            add_eos = bool(conf.get("add_eos_token", False)) and eos is not None
            single = " ".join(([f"{self.bos_token}:0"] if add_bos else []) + ["$A:0"]
                              + ([f"{self.eos_token}:0"] if add_eos else []))
            pair = single + " " + " ".join(([f"{self.bos_token}:1"] if add_bos else []) + ["$B:1"]
                                           + ([f"{self.eos_token}:1"] if add_eos else []))
            specials = ([(self.bos_token, self._bos)] if add_bos else []) + \
                       ([(self.eos_token, eos)] if add_eos else [])
            self._tok.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                                     special_tokens=specials)
        self.vocab_size = self._tok.get_vocab_size()
        probe = self._tok.encode("a", add_special_tokens=True).ids
        self.adds_bos = bool(probe) and self._bos is not None and probe[0] == self._bos
        self._steps = _decoder_steps(raw.get("decoder"))
        kinds = {s.get("type") for s in self._steps}
        self._byte_level = _byte_level_decoder() if "ByteLevel" in kinds else None
        self._byte_fallback = "ByteFallback" in kinds

    def _id(self, token: Optional[str]) -> Optional[int]:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def bos_id(self) -> Optional[int]:
        return self._bos

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self._eos

    def is_added(self, token_id: int) -> bool:
        return int(token_id) in self._added

    def added_content(self, token_id: int) -> str:
        """An added token's text as it is written (what it decodes to inside a text, without spacing)."""
        return self._added[int(token_id)]

    # --- encode / decode -------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids transformers' `tokenizer(text, add_special_tokens=...)` gives."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_pair(self, text: str, pair: str) -> tuple[list[int], list[int]]:
        """(ids, token type ids) as transformers' `tokenizer(text, pair)` gives them: the pair template of the
        tokenizer's post-processor (BERT's `[CLS] a [SEP] b [SEP]`, the second text type 1; a plain
        concatenation where it has none)."""
        encoding = self._tok.encode(text, pair, add_special_tokens=True)
        return encoding.ids, encoding.type_ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if spaces_between_special_tokens or skip_special_tokens:  # vLLM glues added tokens only when kept
            return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        kept = ids
        out, run, ctx = [], [], None
        for k, t in enumerate(kept):
            if t in self._added and k and kept[k - 1] in self._added:
                out.append(self.decode_after(ctx, run))
                out.append(self._added[t])
                run, ctx = [], t
            else:
                run.append(t)
        out.append(self.decode_after(ctx, run))
        return "".join(out)

    def decode_after(self, context: Optional[int], ids: list[int]) -> str:
        """The text `ids` add after the token `context` (None: at the start of the text)."""
        if not ids:
            return ""
        if context is None:
            return self._tok.decode(ids, skip_special_tokens=False)
        head = self._tok.decode([context], skip_special_tokens=False)
        return self._tok.decode([context] + ids, skip_special_tokens=False)[len(head):]

    # --- one token, for logprobs ----------------------------------------------------------

    def token_bytes(self, token_id: int) -> list[int]:
        """The bytes the token contributes to a text (added tokens: their content's UTF-8)."""
        token_id = int(token_id)
        if token_id in self._added:
            return list(self._added[token_id].encode("utf-8"))
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return []
        if self._byte_level is not None:
            return [b for c in piece for b in ([self._byte_level[c]] if c in self._byte_level
                                               else c.encode("utf-8"))]
        if self._byte_fallback:
            m = _BYTE_PIECE.match(piece)
            if m:
                return [int(m.group(1), 16)]
        text = piece
        for step in self._steps:
            if step.get("type") == "Replace":
                pattern = step.get("pattern", {}).get("String")
                if pattern is not None:
                    text = text.replace(pattern, step.get("content", ""))
            elif step.get("type") == "Metaspace":
                text = text.replace(step.get("replacement", "\u2581"), " ")
        if not self._steps:  # no decoder: the library decodes one token as its piece
            text = self._tok.decode([token_id], skip_special_tokens=False)
        return list(text.encode("utf-8"))

    def tokenizer_json(self) -> str:
        """The tokenizer as `tokenizer.json` text (what structured outputs' grammar engine reads)."""
        return self._tok.to_str()

    def token_text(self, token_id: int) -> str:
        """The token as text; bytes that are not whole UTF-8 characters show as `bytes:\\xNN...`."""
        data = bytes(self.token_bytes(token_id))
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def _chat_template(directory: str, conf: dict):
    """The template from tokenizer_config.json, else from chat_template.jinja (newer transformers
    write it there); a list of named templates yields the "default" one."""
    template = conf.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    path = os.path.join(directory, "chat_template.jinja")
    if template is None and os.path.exists(path):
        with open(path) as f:
            template = f.read()
    return template
