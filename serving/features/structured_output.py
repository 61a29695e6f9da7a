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
(`StepPart.results_before_next_step`), so those sequences join every step, and
the scheduler never puts one with a draw in flight into a step (the part's
scheduling gate, `waits_for_draw`).

All of it reaches the engine as one step part, `StructuredOutputsPart`: it
compiles a request's grammar at admission (with a reasoning model's thinking
phase in front of it, `reasoning_phase`), gives each step its bitmask as the
part's device input, and takes each drawn token into the grammar.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Optional

import jax
import numpy as np

from serving.core.engine_args import STRUCTURED_OUTPUTS
from serving.core.format_params import StructuredOutputsParams
from serving.core.sampling_params import InvalidParameterError
from serving.core.scheduler import AdmissionGate
from serving.core.step_parts import StepPart
from serving.features.reasoning_phase import PhasedGrammar

log = logging.getLogger(__name__)


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
        grammar = grammar_of(seq.request)
        if grammar is None or not grammar.constrains(sample_index):
            continue
        if mask is None:
            mask = np.full((batch.shape.S, width), -1, np.int32)
        mask[row] = grammar.masks[sample_index]
    for first, seq, sample_index, drafts in batch.proposal_groups:
        grammar = grammar_of(seq.request)
        if grammar is not None:
            if mask is None:
                mask = np.full((batch.shape.S, width), -1, np.int32)
            grammar.fill_draft_masks(sample_index, drafts, mask, first)
    return mask


# --- the part -------------------------------------------------------------------------------
KEY = "structured_outputs"  # the request's grammar in `Request.part_state`


def grammar_of(request):
    """The request's grammar (a `RequestGrammar` or `PhasedGrammar`), or None: it has none."""
    return request.part_state.get(KEY)


class _WaitForDraw(AdmissionGate):
    """A sequence whose grammar's next mask needs the token its step in flight draws sits out the next
    step (with overlapped scheduling), rather than run under a mask that does not know that token."""

    def waits_for_draw(self, seq) -> bool:
        grammar = grammar_of(seq.request)
        return grammar is not None and grammar.needs_pending(seq.sample_index, seq.num_pending)


class StructuredOutputsPart(StepPart):
    """Structured outputs and the thinking phase of reasoning requests, as one step part.

    Admission compiles the request's grammar (a 400 naming `structured_outputs` or `reasoning` when it
    cannot be used); each step's device input is the `[rows, ceil(vocab / 32)]` bitmask of its rows, a
    resident all-ones one when no row is constrained; each drawn token advances its sample's grammar,
    which ends the sample when nothing but the end may follow."""

    serves = STRUCTURED_OUTPUTS
    takes_fields = ("structured_outputs", "reasoning")
    results_before_next_step = True

    def __init__(self, vocab_size: int, whitespace: bool = False):
        self.vocab_size = vocab_size
        self.width = bitmask_width(vocab_size)
        self.whitespace = whitespace
        self.compiler: Optional[StructuredOutputs] = None
        self.eos_token_ids: tuple = ()

    def attach(self, engine) -> None:
        self.eos_token_ids = engine.eos_token_ids
        self.compiler = StructuredOutputs(engine.tokenizer, self.vocab_size, engine.eos_token_ids, self.whitespace)

    def gate(self) -> AdmissionGate:
        return _WaitForDraw()

    def admit(self, request) -> None:
        grammar = self._grammar(request.params)
        if grammar is not None:
            request.part_state[KEY] = grammar

    def _grammar(self, params):
        """The request's compiled grammar, or None; a 400 when it cannot be used. A reasoning request with
        a thinking budget or a grammar gets a `PhasedGrammar`: free (or budgeted) thinking first, then the
        grammar from the end tag on."""
        grammar = None
        if params.structured_outputs is not None:
            try:
                grammar = self.compiler.for_request(params.structured_outputs, params.n)
            except (TypeError, ValueError) as e:
                raise InvalidParameterError("structured_outputs", f"structured_outputs: {e}") from None
        reasoning = params.reasoning
        if reasoning is None or (grammar is None and reasoning.budget is None):
            return grammar
        bad = [t for t in reasoning.start_ids + reasoning.end_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidParameterError("reasoning", f"reasoning: think-tag token ids {bad} are not in the "
                                                     f"vocabulary [0, {self.vocab_size})")
        forced = set(reasoning.end_ids) | (set(reasoning.start_ids) if reasoning.starts == "undecided" else set())
        if params.allowed_token_ids is not None and not forced <= set(params.allowed_token_ids):
            raise InvalidParameterError("allowed_token_ids", "allowed_token_ids: must allow the think tags' "
                                                             f"tokens {sorted(forced)}, which the reasoning "
                                                             "phase may force")
        ends = list(params.stop_token_ids) + ([] if params.ignore_eos else list(self.eos_token_ids))
        return PhasedGrammar(reasoning, grammar, params.n, self.width, ends)

    # --- tokens ------------------------------------------------------------------------------------
    def replace_token(self, seq, token: int) -> int:
        """An ending token drawn while a request with a format thinks becomes the end tag's
        (`PhasedGrammar.instead_of_ending`), so the request goes on to its answer."""
        grammar = grammar_of(seq.request)
        return token if grammar is None else grammar.instead_of_ending(seq.sample_index, token)

    def took_token(self, seq, token: int) -> Optional[str]:
        grammar = grammar_of(seq.request)
        if grammar is None or not grammar.accept(seq.sample_index, token):
            return None
        # The grammar is complete (only the end may follow): the sample stops, its text as a stop leaves it.
        if seq.detokenizer is not None and seq.detokenizer.flush():
            seq.text = seq.detokenizer.text
        return "stop"

    # --- the device input --------------------------------------------------------------------------
    def step_input_spec(self, rows: int):
        return jax.ShapeDtypeStruct((rows, self.width), np.int32)

    def idle_inputs(self, rows: int):
        return np.full((rows, self.width), -1, np.int32)

    def step_inputs(self, batch):
        return batch_mask(batch, self.width)

    def apply_to_logits(self, inputs, logits, step):
        return apply_token_bitmask(logits, inputs)

    def program_key(self):
        return ("token-bitmask", self.width)
