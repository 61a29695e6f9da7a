"""Incremental detokenization: text grows token by token, correct across split characters.

A multi-byte UTF-8 character can be split over several tokens (always so for
the byte tokenizer). Text is only released once it decodes cleanly; an
incomplete tail (which decodes to U+FFFD) is held back until the next token
completes it, or released as is when the sequence ends.

Byte tokenizer: an incremental UTF-8 decoder over the byte ids (O(1) per
token). Other tokenizers: decode a short window of recent ids (with a few
prompt tokens as left context, so e.g. a leading-space marker decodes the same
as in the full text) and emit what the newest token added.
"""

from __future__ import annotations

import codecs

from model.tokenizer import ByteTokenizer

_CONTEXT = 5  # prompt tokens of left context for windowed decoding


class ByteDetokenizer:
    def __init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""

    def push(self, token_id: int) -> str:
        if 0 <= token_id < 256:
            delta = self._decoder.decode(bytes((token_id,)))
            self.text += delta
            return delta
        return ""  # BOS/EOS/unused ids carry no text

    def flush(self) -> str:
        delta = self._decoder.decode(b"", final=True)
        self.text += delta
        return delta


class WindowDetokenizer:
    def __init__(self, tokenizer, prompt_ids):
        self._tok = tokenizer
        self._ids = list(prompt_ids[-_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)
        self.text = ""

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read])
        new_text = self._tok.decode(self._ids[self._prefix:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # nothing new yet, or an incomplete character
        delta = new_text[len(prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read])
        new_text = self._tok.decode(self._ids[self._prefix:])
        delta = new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""
        self._prefix = self._read = len(self._ids)
        self.text += delta
        return delta


def make_detokenizer(tokenizer, prompt_ids):
    if isinstance(tokenizer, ByteTokenizer):
        return ByteDetokenizer()
    return WindowDetokenizer(tokenizer, prompt_ids)
