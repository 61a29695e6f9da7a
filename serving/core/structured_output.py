"""Structured outputs: a grammar per request that decides which tokens may come next.

A request's `SamplingParams.structured_outputs` (JSON schema, any JSON object,
regex, a choice of strings, or a Lark / GBNF grammar) is compiled once, when
the request is made, by llguidance against the engine's tokenizer; a grammar
that does not compile is an `InvalidParameterError` naming the problem. Each
of the request's `n` samples then owns a matcher on the host.

The mask of a sample's next draw is computed as soon as its last token is taken
in (`RequestGrammar.accept`, called while the engine processes a step). Packing copies the rows of
the sampling rows that have a grammar into a `[rows, ceil(vocab / 32)]` int32
bitmask (`batch_mask`); rows without one are all ones, and a batch without any
grammar row passes no mask at all (the runner then feeds a resident all-ones
one), so the step's shapes never change. On the device `apply_token_bitmask`
sets every masked token's logit to -inf before sampling.

With overlapped scheduling a grammar sequence does not run ahead of its own
samples, since its next mask depends on the token the running step draws: the
engine processes a step with grammar rows before it schedules the next one
(`Engine._process_grammar_step`), so those sequences join every step, and the
scheduler never puts one with a draw in flight into a step.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from typing import Any, Optional, Union

import numpy as np

log = logging.getLogger(__name__)

# The keys of `StructuredOutputsParams` that say what to constrain to; exactly one is given.
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclasses.dataclass
class StructuredOutputsParams:
    """What a request's output must match (vLLM's `structured_outputs` fields).

    json: a JSON schema (dict or its JSON text); json_object: any JSON object; regex: a regular
    expression the whole output matches; choice: one of these strings; grammar: a Lark grammar
    (llguidance's dialect) or a GBNF one. `whitespace`: let JSON grammars put free whitespace between
    tokens (None: the engine's `structured_outputs_whitespace` option).
    """

    json: Optional[Union[dict, str]] = None
    json_object: Optional[bool] = None
    regex: Optional[str] = None
    choice: Optional[list] = None
    grammar: Optional[str] = None
    whitespace: Optional[bool] = None

    def kind(self) -> str:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(KINDS)}; got {given or 'none'}")
        return given[0]


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


# --- on the device --------------------------------------------------------------------------

def apply_token_bitmask(logits, mask):
    """`logits` [R, V] with every token whose bit in `mask` [R, ceil(V/32)] int32 is 0 set to -inf.

    A row whose mask allows nothing is left as it is (it cannot be a grammar's row: a grammar
    always allows at least EOS), and a batch whose mask is all ones skips the work."""
    import jax
    import jax.numpy as jnp

    def masked(x):
        vocab = x.shape[-1]
        idx = jnp.arange(vocab, dtype=jnp.int32)
        bits = (mask[:, idx >> 5] >> (idx & 31)) & 1
        allowed = bits != 0
        keep = allowed | ~jnp.any(allowed, axis=-1, keepdims=True)
        return jnp.where(keep, x, -jnp.inf)

    return jax.lax.cond(jnp.all(mask == -1), lambda x: x, masked, logits)


def apply_token_bitmask_reference(logits: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The numpy statement of `apply_token_bitmask`, bit by bit (for tests)."""
    out = np.array(logits, np.float32, copy=True)
    bits = np.unpackbits(np.ascontiguousarray(mask).view(np.uint8), axis=-1, bitorder="little")
    bits = bits[:, :logits.shape[-1]].astype(bool)
    for r in range(out.shape[0]):
        if bits[r].any():
            out[r, ~bits[r]] = -np.inf
    return out


# --- on the host ----------------------------------------------------------------------------

class _ByteTokens:
    """`model.tokenizer.ByteTokenizer` as llguidance's `TokenizerWrapper` expects a tokenizer: the
    bytes of every id (ids past 255 are special tokens, which grammars never emit as text)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.eos_token_id = tokenizer.EOS
        self.bos_token_id = tokenizer.BOS
        names = {tokenizer.BOS: b"<bos>", tokenizer.EOS: b"<eos>"}
        self.tokens = [bytes([i]) for i in range(256)] + [b"\xff" + names.get(i, b"<%d>" % i)
                                                           for i in range(256, vocab_size)]
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, text) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode("utf-8"))


def make_ll_tokenizer(tokenizer, vocab_size: int, eos_token_ids):
    """llguidance's tokenizer info for one of `model.tokenizer`'s tokenizers, over the model's
    vocabulary (often padded beyond the tokenizer's; padding ids are never allowed)."""
    import llguidance

    from model.tokenizer import ByteTokenizer

    eos = [int(t) for t in eos_token_ids]
    if isinstance(tokenizer, ByteTokenizer):
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokens(tokenizer, vocab_size)),
                                      n_vocab=vocab_size, eos_token=eos or None)
    if hasattr(tokenizer, "tokenizer_json"):
        return llguidance.LLTokenizer(tokenizer.tokenizer_json(), n_vocab=vocab_size, eos_token=eos or None)
    raise TypeError(f"structured outputs need a byte or tokenizer.json tokenizer, not {type(tokenizer).__name__}")


def grammar_text(so: StructuredOutputsParams, whitespace: bool) -> str:
    """llguidance's grammar for `so` (not yet checked); ValueError for a malformed request."""
    import llguidance

    kind = so.kind()
    ws = {"whitespace_flexible": bool(whitespace)}
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else so.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"json: not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"json: a JSON schema is an object, got {type(schema).__name__}")
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=ws)
    if kind == "regex":
        if not isinstance(so.regex, str):
            raise ValueError("regex: must be a string")
        return llguidance.LLMatcher.grammar_from_regex(so.regex)
    if kind == "choice":
        if not isinstance(so.choice, list) or not so.choice or not all(isinstance(c, str) for c in so.choice):
            raise ValueError("choice: must be a non-empty list of strings")
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choice))
    if not isinstance(so.grammar, str):
        raise ValueError("grammar: must be a string")
    return llguidance.grammar_from("grammar", so.grammar)


class StructuredOutputs:
    """The engine's grammar compiler: the llguidance tokenizer (built on first use) and the option
    that says whether JSON grammars allow free whitespace."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, whitespace: bool = False):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.whitespace = whitespace
        self.width = bitmask_width(vocab_size)
        self._ll = None
        self._lock = threading.Lock()  # requests are made on any thread

    def ll_tokenizer(self):
        with self._lock:
            if self._ll is None:
                self._ll = make_ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._ll

    def for_request(self, so: Optional[StructuredOutputsParams], n: int) -> Optional["RequestGrammar"]:
        """The compiled grammar and `n` matchers of a request, or None without structured outputs.

        Raises ValueError with llguidance's message when the grammar does not compile."""
        if so is None:
            return None
        if self.tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer; this model has none")
        import llguidance

        whitespace = self.whitespace if so.whitespace is None else bool(so.whitespace)
        try:
            grammar = grammar_text(so, whitespace)
        except ValueError:
            raise
        except Exception as e:  # llguidance rejects some inputs before validation
            raise ValueError(f"{so.kind()}: {e}") from None
        tok = self.ll_tokenizer()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tok)
        if is_error:
            raise ValueError(f"{so.kind()}: cannot be compiled: {messages[0].strip()}")
        first = llguidance.LLMatcher(tok, grammar, log_level=0)
        if first.is_error():
            raise ValueError(f"{so.kind()}: cannot be compiled: {first.get_error()}")
        matchers = [first] + [first.deep_copy() for _ in range(n - 1)]
        return RequestGrammar(matchers, self.width)


class RequestGrammar:
    """One request's matchers (one per sample) and the bitmask of each sample's next draw."""

    def __init__(self, matchers: list, width: int):
        from llguidance.numpy import fill_next_token_bitmask

        self._fill = fill_next_token_bitmask
        self.matchers = matchers
        self.masks = np.full((len(matchers), width), -1, np.int32)
        for i in range(len(matchers)):
            self._fill(matchers[i], self.masks, i)

    def accept(self, sample_index: int, token: int) -> bool:
        """Takes in sample `sample_index`'s drawn `token` and computes its next mask; returns True
        when the grammar is complete (nothing but the end may follow), so the sample can stop."""
        m = self.matchers[sample_index]
        if m.is_stopped():
            return True
        if not m.consume_token(int(token)):  # cannot happen under the mask; end the sample rather than the engine
            log.warning("structured outputs: the grammar rejected sampled token %d (%s); sample ended", token,
                        m.get_error())
            return True
        if m.is_stopped():
            return True
        self._fill(m, self.masks, sample_index)
        return False

    def instead_of_ending(self, sample_index: int, token: int) -> int:
        """The token the sample takes for its drawn `token`: always `token` (the mask holds EOS back
        until the grammar is complete; a `PhasedGrammar` replaces one drawn while thinking)."""
        return token

    # Overlapped scheduling asks these (a `PhasedGrammar` answers them otherwise while it thinks freely):
    def constrains(self, sample_index: int) -> bool:
        """Whether the sample's current mask bars anything (a grammar's always may)."""
        return True

    def needs_pending(self, sample_index: int, pending: int) -> bool:
        """Whether the sample's next mask depends on its `pending` tokens still being drawn."""
        return True

    # Speculative decoding: drafts are checked against the grammar without taking them in.
    def valid_drafts(self, sample_index: int, drafts: list[int]) -> list[int]:
        """The longest prefix of `drafts` the grammar allows after what the sample has taken in (a
        draft past it could never be accepted under the masks, so it is not verified at all)."""
        m = self.matchers[sample_index]
        return [] if m.is_stopped() else list(drafts[:m.validate_tokens([int(t) for t in drafts])])

    def fill_draft_masks(self, sample_index: int, drafts, out: np.ndarray, first_row: int) -> None:
        """Writes the masks of a verifying sequence's rows into `out`: row `first_row` + j gets the mask
        after drafts 0..j-1 (row `first_row` the sample's current one). The matcher steps over the
        drafts and rolls back, so it holds only accepted tokens: those come in through `accept`."""
        m = self.matchers[sample_index]
        out[first_row] = self.masks[sample_index]
        consumed = 0
        for j, tok in enumerate(drafts):
            if m.is_stopped() or not m.consume_token(int(tok)):
                break  # this draft cannot be accepted, so no later row is emitted
            consumed += 1
            self._fill(m, out, first_row + j + 1)
        if consumed and not m.rollback(consumed):
            raise RuntimeError(f"structured outputs: the grammar could not roll back {consumed} drafted tokens: "
                               f"{m.get_error()}")


def batch_mask(batch, width: int) -> Optional[np.ndarray]:
    """The step's `[S, width]` bitmask (rows in `batch.sample_rows` order; all ones where no grammar
    applies), or None when no row of `batch` has a grammar that constrains it now (a reasoning
    phase thinking freely bars nothing, so its steps overlap as plain ones do)."""
    mask = None
    for row, (seq, sample_index) in enumerate(batch.sample_rows):
        grammar = seq.request.structured
        if grammar is None or not grammar.constrains(sample_index):
            continue
        if mask is None:
            mask = np.full((batch.shape.S, width), -1, np.int32)
        mask[row] = grammar.masks[sample_index]
    for first, seq, sample_index, drafts in batch.draft_groups:
        if seq.request.structured is not None:
            if mask is None:
                mask = np.full((batch.shape.S, width), -1, np.int32)
            seq.request.structured.fill_draft_masks(sample_index, drafts, mask, first)
    return mask


def finish_complete(seq, finish) -> None:
    """Ends a sample whose grammar is complete (reason "stop"), with the text as a stop would leave it."""
    if seq.detokenizer is not None and seq.detokenizer.flush():
        seq.text = seq.detokenizer.text
    finish(seq, "stop")


def from_request_dict(value: Any) -> StructuredOutputsParams:
    """`StructuredOutputsParams` from a dict of its fields (as the HTTP API and `LLM` callers give it)."""
    if isinstance(value, StructuredOutputsParams):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"must be an object with one of {', '.join(KINDS)}, got {type(value).__name__}")
    fields = {f.name for f in dataclasses.fields(StructuredOutputsParams)}
    unknown = sorted(set(value) - fields)
    if unknown:
        raise ValueError(f"unknown keys {unknown} (it takes {', '.join(sorted(fields))})")
    return StructuredOutputsParams(**value)
