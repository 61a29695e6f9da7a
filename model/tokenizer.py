"""Tokenizers: bytes for the tiny models, Hugging Face `tokenizers` for real checkpoints.

Both expose the same small interface: `encode`, `decode`, `bos_id`,
`eos_ids`, `vocab_size`, and `chat_template` (a Jinja string or None).
"""

from __future__ import annotations

import json
import os


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; then BOS and EOS. Lossless for any text."""

    BOS = 256
    EOS = 257
    chat_template = None

    def __init__(self, vocab_size: int = 320):
        if vocab_size < 258:
            raise ValueError(f"a byte tokenizer needs vocab_size >= 258, got {vocab_size}")
        self.vocab_size = vocab_size

    @property
    def bos_id(self) -> int:
        return self.BOS

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return (self.EOS,)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS] + ids if add_bos else ids

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        """A printable form of one token (for logprobs); invalid UTF-8 shows as bytes:\\xNN."""
        if token_id == self.BOS:
            return "<bos>"
        if token_id == self.EOS:
            return "<eos>"
        if 0 <= token_id < 128:
            return chr(token_id)
        return f"bytes:\\x{token_id:02x}" if token_id < 256 else f"<{token_id}>"


class HFTokenizer:
    """A `tokenizer.json` read by the `tokenizers` library, plus its tokenizer_config.json."""

    def __init__(self, directory: str):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
        conf_path = os.path.join(directory, "tokenizer_config.json")
        conf = {}
        if os.path.exists(conf_path):
            with open(conf_path) as f:
                conf = json.load(f)
        self.chat_template = _chat_template(directory, conf)
        self.vocab_size = self._tok.get_vocab_size()
        self._bos = self._token_id(conf.get("bos_token"))
        eos = self._token_id(conf.get("eos_token"))
        self._eos = (eos,) if eos is not None else ()
        self.bos_token = _token_str(conf.get("bos_token"))
        self.eos_token = _token_str(conf.get("eos_token"))

    def _token_id(self, token):
        token = _token_str(token)
        return None if token is None else self._tok.token_to_id(token)

    @property
    def bos_id(self):
        return self._bos

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self._eos

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self._bos] + ids if add_bos and self._bos is not None else ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        return self._tok.id_to_token(int(token_id)) or f"<{token_id}>"

    def tokenizer_json(self) -> str:
        """The tokenizer as `tokenizer.json` text (what structured outputs' grammar engine reads)."""
        return self._tok.to_str()


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


def _token_str(token):
    if isinstance(token, dict):
        return token.get("content")
    return token


def load_tokenizer(directory: str | None, vocab_size: int = 320):
    """The checkpoint's HF tokenizer when it ships `tokenizer.json`, else bytes."""
    if directory and os.path.exists(os.path.join(directory, "tokenizer.json")):
        return HFTokenizer(directory)
    return ByteTokenizer(vocab_size)
