"""Incremental detokenization: text grows token by token, correct across split characters.

A multi-byte UTF-8 character can be split over several tokens (always so for
the byte tokenizer; byte-level BPE pieces of one emoji or CJK character;
SentencePiece byte-fallback tokens such as `<0xE2>`). Text is only released
once it decodes cleanly; an incomplete tail (which decodes to U+FFFD) is held
back until the next token completes it, or released as is when the sequence
ends.

Byte tokenizer: an incremental UTF-8 decoder over the byte ids (O(1) per
token). Other tokenizers: decode a short window of recent ids (with a few
prompt tokens as left context, so that SentencePiece's `▁` on the first
generated token decodes as the space it is inside the text, not as the
stripped start of a text) and emit what the newest token added.

`skip_special_tokens` and `spaces_between_special_tokens` mean what they mean
to `tokenizer.decode` (model.hf_tokenizer): over a sequence without prompt,
the text released token by token plus the flush equals the full decode.
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
    def __init__(self, tokenizer, prompt_ids, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # Added tokens glue to a preceding added token only when both are kept (as in decode).
        self._glue = not spaces_between_special_tokens and not skip_special_tokens
        self._last_added = False
        self._ids = list(prompt_ids[-_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)
        self.text = ""

    def _decode(self, ids) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        token_id = int(token_id)
        self._ids.append(token_id)
        if self._glue:
            added = self._tok.is_added(token_id)
            glued, self._last_added = added and self._last_added, added
            if glued:  # its bare content; the window restarts after it
                delta = self._tok.added_content(token_id)
                self._prefix, self._read = len(self._ids) - 1, len(self._ids)
                self.text += delta
                return delta
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # nothing new yet, or an incomplete character
        delta = new_text[len(prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        delta = new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""
        self._prefix = self._read = len(self._ids)
        self.text += delta
        return delta


def make_detokenizer(tokenizer, prompt_ids, skip_special_tokens: bool = True,
                     spaces_between_special_tokens: bool = True):
    if isinstance(tokenizer, ByteTokenizer):
        return ByteDetokenizer()
    return WindowDetokenizer(tokenizer, prompt_ids, skip_special_tokens, spaces_between_special_tokens)
