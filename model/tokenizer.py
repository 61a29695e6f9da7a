"""Tokenizers: bytes for the tiny models, Hugging Face `tokenizers` for real checkpoints.

Both expose the same small interface: `encode(text, add_special_tokens)`,
`decode(ids, skip_special_tokens, spaces_between_special_tokens)`,
`token_text` / `token_bytes` (one token, for logprobs), `is_added`,
`bos_id`, `adds_bos` (whether encoding a string puts BOS first), `eos_ids`,
`vocab_size`, `bos_token` / `eos_token` and `chat_template` (a Jinja string
or None). `HFTokenizer` lives in `model.hf_tokenizer`.
"""

from __future__ import annotations

import os

from model.hf_tokenizer import HFTokenizer

__all__ = ["ByteTokenizer", "HFTokenizer", "load_tokenizer"]


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; then BOS and EOS. Lossless for any text."""

    BOS = 256
    EOS = 257
    chat_template = None
    bos_token = eos_token = None  # no text spells them
    adds_bos = True
    special_ids = frozenset((BOS, EOS))

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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS] + ids if add_special_tokens else ids

    def encode_pair(self, text: str, pair: str) -> tuple[list[int], list[int]]:
        """A text pair as one prompt (a cross-encoder's input): (the first text's ids then the second's, their
        token types: 0 then 1)."""
        first, second = self.encode(text), self.encode(pair, add_special_tokens=False)
        return first + second, [0] * len(first) + [1] * len(second)

    def decode(self, ids, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True) -> str:
        """Ids past 255 carry no text, skipped or not (BOS and EOS have no spelling)."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def is_added(self, token_id: int) -> bool:
        return False

    def token_bytes(self, token_id: int) -> list[int]:
        return [int(token_id)] if 0 <= int(token_id) < 256 else list(self.token_text(token_id).encode("utf-8"))

    def token_text(self, token_id: int) -> str:
        """A printable form of one token (for logprobs); invalid UTF-8 shows as bytes:\\xNN."""
        if token_id == self.BOS:
            return "<bos>"
        if token_id == self.EOS:
            return "<eos>"
        if 0 <= token_id < 128:
            return chr(token_id)
        return f"bytes:\\x{token_id:02x}" if token_id < 256 else f"<{token_id}>"


def load_tokenizer(directory: str | None, vocab_size: int = 320):
    """The checkpoint's HF tokenizer when it ships `tokenizer.json`, else bytes."""
    if directory and os.path.exists(os.path.join(directory, "tokenizer.json")):
        return HFTokenizer(directory)
    return ByteTokenizer(vocab_size)
