"""Sampling controls that need a vocabulary-sized row per request, kept on the device.

`logit_bias`, `allowed_token_ids`, `bad_words`, `min_tokens` (which holds off
EOS and `stop_token_ids`) and the three penalties (`repetition_penalty` over
prompt and output tokens, `presence_penalty` and `frequency_penalty` over
output tokens, as vLLM defines them) depend on more than a few numbers per
row: on a `[vocab]` bias and mask per request and on which tokens the
request has seen so far. Packing that every step would cost a `[rows, vocab]`
transfer, so it lives on the device in a `ControlState` of `num_slots` rows:

* a sequence that uses any of these controls holds a *slot* while it runs
  (`ControlSlots`); each step row carries its sequence's slot (`control_slot`,
  -1 for none), so a row reads only its own slot and batch composition never
  changes its result;
* when a sequence gets a slot, the host writes the whole row once
  (`host_row`: the request's constant bias and masks, and counts of the
  tokens the host has seen, which are all of them: a sequence gets a slot
  only when nothing of it is in flight);
* the step itself adds each sampled token to its slot's counts and recent
  tokens (`record`), so overlapped scheduling (the next step dispatched
  before the host sees this one's token) stays exact.

The part (`SamplingControlsPart`) holds the slots and the state; a step's
logits pass through `apply` before the sampler: the additive bias
(logit bias, -inf outside `allowed_token_ids` and on single-token bad words),
multi-token bad words, the `min_tokens` hold-off, then the penalties; the
order is vLLM's. Rows without a slot are returned untouched, and a batch
with no slot in use skips the whole computation.

Values live in arrays, never in static arguments: no value recompiles the step.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from serving.core import step_parts
from serving.core.sampling_params import CONTROL_FIELDS, InvalidParameterError
from serving.core.sequence import SequenceStatus
from serving.core.step_parts import Proposals, StepPart

# Multi-token bad words: how many a request may give and how many tokens each may have. The step
# checks every slot's words against its last MAX_BAD_WORD_TOKENS - 1 output tokens.
MAX_BAD_WORDS = 16
MAX_BAD_WORD_TOKENS = 8
_ANY = -2  # a prefix position a shorter word does not use (matches every token)
_NONE = -1  # no token (a recent-token position before the output began; an unused bad word)


KEY = "sampling_controls"  # the part's entry of `Request.part_state`: the request's `RequestRows`


class ControlState(NamedTuple):
    """The device rows, one per slot."""

    bias: jax.Array  # [slots, vocab] f32: logit bias, -inf on tokens never allowed
    stop_mask: jax.Array  # [slots, vocab] bool: tokens banned while fewer than min_tokens are out (EOS, stop ids)
    prompt_seen: jax.Array  # [slots, vocab] bool: tokens of the prompt
    counts: jax.Array  # [slots, vocab] i32: occurrences in the output
    recent: jax.Array  # [slots, MAX_BAD_WORD_TOKENS - 1] i32: the last output tokens, oldest first
    bad_prefix: jax.Array  # [slots, MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS - 1] i32, right-aligned, _ANY-padded
    bad_last: jax.Array  # [slots, MAX_BAD_WORDS] i32: the token banned after the prefix (_NONE: unused)


def init_state(num_slots: int, vocab: int) -> ControlState:
    """Host (numpy) zeros of the state; `ModelRunner` places it."""
    L = MAX_BAD_WORD_TOKENS - 1
    return ControlState(np.zeros((num_slots, vocab), np.float32), np.zeros((num_slots, vocab), bool),
                        np.zeros((num_slots, vocab), bool), np.zeros((num_slots, vocab), np.int32),
                        np.full((num_slots, L), _NONE, np.int32),
                        np.full((num_slots, MAX_BAD_WORDS, L), _ANY, np.int32),
                        np.full((num_slots, MAX_BAD_WORDS), _NONE, np.int32))


# --- host: what a request's slot holds ------------------------------------------------------------


def bad_word_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Token ids of each bad word, as vLLM tokenizes them: the word as written and, when it differs,
    with a leading space (the form a word takes after another word); duplicates dropped."""
    out: list[list[int]] = []
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in out:
                out.append(ids)
    return out


class RequestRows:
    """The constant part of a request's slot row (computed once, shared by its samples)."""

    def __init__(self, params, prompt_token_ids, eos_token_ids, vocab: int, bad_words: list[list[int]]):
        bias = np.zeros(vocab, np.float32)
        for t, b in (params.logit_bias or {}).items():
            bias[int(t)] += float(b)
        if params.allowed_token_ids:
            allowed = np.zeros(vocab, bool)
            allowed[list(params.allowed_token_ids)] = True
            bias[~allowed] = -np.inf
        L = MAX_BAD_WORD_TOKENS - 1
        self.bad_prefix = np.full((MAX_BAD_WORDS, L), _ANY, np.int32)
        self.bad_last = np.full(MAX_BAD_WORDS, _NONE, np.int32)
        multi = 0
        for ids in bad_words:
            if len(ids) == 1:
                bias[ids[0]] = -np.inf
                continue
            self.bad_prefix[multi, L - (len(ids) - 1):] = ids[:-1]
            self.bad_last[multi] = ids[-1]
            multi += 1
        self.bias = bias
        self.stop_mask = np.zeros(vocab, bool)
        if params.min_tokens > 0:
            stops = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))
            self.stop_mask[[t for t in stops if 0 <= t < vocab]] = True
        self.prompt_seen = np.bincount(np.asarray(prompt_token_ids, np.int64), minlength=vocab)[:vocab] > 0


def check_bad_words(ids: list[list[int]]) -> Optional[str]:
    """Why these tokenized bad words do not fit the device's tables, or None."""
    multi = [w for w in ids if len(w) > 1]
    if len(multi) > MAX_BAD_WORDS:
        return f"at most {MAX_BAD_WORDS} multi-token bad words (with their leading-space forms) are supported"
    if any(len(w) > MAX_BAD_WORD_TOKENS for w in multi):
        return f"a bad word may have at most {MAX_BAD_WORD_TOKENS} tokens"
    return None


def request_rows(req, tokenizer, vocab: int) -> RequestRows:
    """A request's `RequestRows`, or an `InvalidParameterError` naming `bad_words` when they do not fit."""
    p = req.params
    words: list[list[int]] = []
    if p.bad_words:
        if tokenizer is None:
            raise InvalidParameterError("bad_words", "bad_words: this model has no tokenizer")
        words = bad_word_ids(tokenizer, p.bad_words)
        problem = check_bad_words(words)
        if problem:
            raise InvalidParameterError("bad_words", f"bad_words: {problem}")
    return RequestRows(p, req.prompt_token_ids, req.eos_token_ids, vocab, words)


def host_row(rows: RequestRows, output_token_ids: list[int], vocab: int) -> tuple:
    """One slot's full row for a sequence whose tokens so far are all on the host."""
    out = np.asarray(output_token_ids, np.int64)
    counts = np.bincount(out, minlength=vocab)[:vocab].astype(np.int32)
    L = MAX_BAD_WORD_TOKENS - 1
    recent = np.full(L, _NONE, np.int32)
    tail = out[-L:] if len(out) else out
    if len(tail):
        recent[L - len(tail):] = tail
    return rows.bias, rows.stop_mask, rows.prompt_seen, counts, recent, rows.bad_prefix, rows.bad_last


# --- host: which sequence holds which slot ----------------------------------------------------------


class ControlSlots:
    """Hands out slots to running sequences that use controls, and takes them back.

    A slot is taken back once its sequence is no longer running (finished, preempted) and after
    the step that forks a sequence into its samples (every sample then loads its own row). The
    device state is threaded through every step and load in dispatch order, so a slot given to
    a new sequence is written after the last step that used it for the old one.
    """

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.free = list(range(num_slots - 1, -1, -1))
        self.held: dict[int, tuple] = {}  # seq_id -> (slot, sequence)

    def assign(self, scheduled, is_running) -> tuple[dict, list]:
        """For a scheduled step: ({seq_id: slot} of its sampling sequences that use controls, [(slot,
        sequence)] whose rows to load before it). `is_running(seq)` says a sequence still runs."""
        for seq_id, (slot, seq) in list(self.held.items()):
            if not is_running(seq):
                del self.held[seq_id]
                self.free.append(slot)
        slots, loads = {}, []
        for item in scheduled:
            seq = item.seq
            if not item.sample_indices or KEY not in seq.request.part_state:
                continue
            if seq.seq_id not in self.held:
                self.held[seq.seq_id] = (self.free.pop(), seq)
                loads.append((self.held[seq.seq_id][0], seq))
            slots[seq.seq_id] = self.held[seq.seq_id][0]
        for item in scheduled:  # a fork's samples each load their own row next time
            if len(item.sample_indices) > 1 and item.seq.seq_id in self.held:
                self.free.append(self.held.pop(item.seq.seq_id)[0])
        return slots, loads

    def release(self, seq_id: int) -> None:
        """Frees a sequence's slot, so that its row is loaded from the host when it is next scheduled
        (the host changed a token the device had recorded; the sequence has no step in flight)."""
        held = self.held.pop(seq_id, None)
        if held is not None:
            self.free.append(held[0])


# --- device: loading a slot, applying and recording --------------------------------------------------


def _load(state: ControlState, slot, *row) -> ControlState:
    return ControlState(*(x.at[slot].set(r) for x, r in zip(state, row)))


load_jit = step_parts.state_program(jax.jit(_load, donate_argnums=(0,)))


def _row_counts(state: ControlState, idx, drafts: Optional[Proposals]):
    """Per row: its slot's output-token counts, plus one for each draft before the row in its group."""
    counts = state.counts[idx]
    if drafts is None:
        return counts
    R = counts.shape[0]
    rows = jnp.arange(R, dtype=jnp.int32)
    # one per (row, earlier row of its group), every earlier row of a group carrying a draft
    earlier = (rows[None, :] >= drafts.group_start[:, None]) & (rows[None, :] < rows[:, None])
    r_idx = jnp.broadcast_to(rows[:, None], (R, R))
    tok = jnp.broadcast_to(jnp.maximum(drafts.token, 0)[None, :], (R, R))
    return counts.at[r_idx, tok].add(earlier.astype(counts.dtype))


def _row_recent(state: ControlState, idx, drafts: Optional[Proposals]):
    """Per row: the last output tokens of its slot followed by the drafts before the row (the last L)."""
    recent = state.recent[idx]
    if drafts is None:
        return recent
    R, L = recent.shape
    rows = jnp.arange(R, dtype=jnp.int32)
    p = jnp.arange(L, dtype=jnp.int32)[None, :]
    src = (rows - drafts.group_start)[:, None] + p  # past the slot's L tokens: the drafts before the row
    from_recent = jnp.take_along_axis(recent, jnp.clip(src, 0, L - 1), axis=1)
    from_drafts = drafts.token[jnp.clip(rows[:, None] - L + p, 0, R - 1)]
    return jnp.where(src < L, from_recent, from_drafts)


def _bad_word_mask(state: ControlState, idx, recent, vocab: int):
    """[R, vocab] bool: the last tokens of multi-token bad words whose prefix the output just ended with."""
    prefix, last = state.bad_prefix[idx], state.bad_last[idx]
    matched = jnp.all((prefix == _ANY) | (prefix == recent[:, None, :]), axis=-1) & (last >= 0)  # [R, NB]
    hit = jnp.zeros((idx.shape[0], vocab + 1), bool)
    rows = jnp.broadcast_to(jnp.arange(idx.shape[0])[:, None], last.shape)
    hit = hit.at[rows, jnp.where(matched, last, vocab)].set(True)
    return hit[:, :vocab]


def _apply_rows(logits, state: ControlState, slot, token_index, s, drafts):
    has = slot >= 0
    idx = jnp.maximum(slot, 0)
    vocab = logits.shape[-1]
    counts, recent = _row_counts(state, idx, drafts), _row_recent(state, idx, drafts)
    x = logits + state.bias[idx]
    x = jnp.where(_bad_word_mask(state, idx, recent, vocab), -jnp.inf, x)
    hold = (token_index < s.min_tokens)[:, None] & state.stop_mask[idx]
    x = jnp.where(hold, -jnp.inf, x)
    seen = state.prompt_seen[idx] | (counts > 0)
    rp = s.repetition_penalty[:, None]
    x = jnp.where(seen, jnp.where(x > 0, x / rp, x * rp), x)
    x = x - s.frequency_penalty[:, None] * counts - s.presence_penalty[:, None] * (counts > 0)
    return jnp.where(has[:, None], x, logits)


def apply(logits, state: ControlState, slot, token_index, s, drafts: Optional[Proposals] = None):
    """The logits the sampler sees: each row with a slot adjusted by its controls (`s`: the sampler's
    inputs, which carry the per-row penalties and min_tokens of `sampling_table`; `drafts`: what a
    verifying step's rows follow, None for a step that verifies nothing)."""
    return jax.lax.cond(jnp.any(slot >= 0), lambda: _apply_rows(logits, state, slot, token_index, s, drafts),
                        lambda: logits)


def record(state: ControlState, slot, ids, drafts: Optional[Proposals] = None) -> ControlState:
    """Adds each row's emitted token to its slot's counts and recent tokens (rows without a slot, and
    rows a verification did not emit (-1): nothing). Only sampling rows carry a slot.

    A verifying sequence emits the accepted drafts and one more token; its rows hold them in order,
    so the counts take every emitted row, and the recent tokens are those its last emitted row saw
    (`_row_recent`: the slot's, then the accepted drafts) followed by that row's token."""
    n = state.counts.shape[0]
    emitted = (slot >= 0) & (ids >= 0)
    tok = jnp.maximum(ids, 0)
    counts = state.counts.at[jnp.where(emitted, slot, n), tok].add(1, mode="drop")
    recent = _row_recent(state, jnp.maximum(slot, 0), drafts)
    last = emitted
    if drafts is not None:  # the last emitted row of its group writes the group's recent tokens
        nxt = jnp.concatenate([drafts.group_start[1:] == drafts.group_start[:-1], jnp.zeros((1,), bool)])
        nxt_emitted = jnp.concatenate([ids[1:] >= 0, jnp.zeros((1,), bool)])
        last = emitted & ~(nxt & nxt_emitted)
    shifted = jnp.concatenate([recent[:, 1:], tok[:, None]], axis=1)
    recent = state.recent.at[jnp.where(last, slot, n)].set(shifted, mode="drop")
    return state._replace(counts=counts, recent=recent)


# --- the part ----------------------------------------------------------------------------------------


class SamplingControlsPart(StepPart):
    """Sampling controls as a step part: checks and keeps each request's rows at admission, hands out slots
    once a step is scheduled (writing a new holder's row first), gives each step its rows' slots, and
    applies and records the controls inside the step program."""

    takes_fields = tuple(CONTROL_FIELDS)  # the SamplingParams fields applied here

    def __init__(self, num_slots: int, vocab: int):
        self.num_slots, self.vocab = num_slots, vocab
        self.slots = ControlSlots(num_slots)
        self.tokenizer = None
        self._runner = lambda: None  # a weak reference: see `attach`
        self._step_slots: dict = {}  # seq_id -> slot, of the step being packed

    def attach(self, engine) -> None:
        """Keeps the runner weakly: the part is a static argument of the step program, so JAX's tracing
        cache holds it past the engine's life, and a strong reference would keep the runner's weights, KV
        pool and executables alive with it."""
        self.tokenizer, self._runner = engine.tokenizer, weakref.ref(engine.runner)

    def admit(self, request) -> None:
        if request.params.control_fields():  # a request with any needs a slot
            request.part_state[KEY] = request_rows(request, self.tokenizer, self.vocab)

    def after_schedule(self, out) -> None:
        """Slots for the step's sequences that use controls; a sequence new to its slot has its row written
        first (all its tokens are on the host then: a sequence gets a slot when it is admitted, readmitted
        or forked, and each of those waits for its steps to be processed)."""
        self._step_slots, loads = self.slots.assign(out.scheduled, lambda seq: seq.status is SequenceStatus.RUNNING)
        for slot, seq in loads:
            row = host_row(seq.request.part_state[KEY], seq.output_token_ids, self.vocab)
            self._runner().update_part_state(self, load_jit, np.int32(slot), *row)

    def token_replaced(self, seq) -> None:
        self.slots.release(seq.seq_id)

    # --- device side --------------------------------------------------------------------------------
    def step_input_spec(self, rows: int):
        return jax.ShapeDtypeStruct((rows,), np.int32)

    def idle_inputs(self, rows: int):
        return np.full(rows, -1, np.int32)

    def step_inputs(self, batch):
        """Each row's slot (-1: none; padding and prompt-logprob rows hold none); None: no row holds one."""
        if not self._step_slots:
            return None
        slots = np.full(batch.shape.S, -1, np.int32)
        for row, (seq, _) in enumerate(batch.sample_rows):
            slots[row] = self._step_slots.get(seq.seq_id, -1)
        return slots

    def apply_to_logits(self, slot, logits, step):
        return apply(logits, step.state, slot, step.token_index, step.sampling, step.proposals)

    def step_state(self):
        return init_state(self.num_slots, self.vocab)

    def record(self, slot, state, ids, step):
        return record(state, slot, ids, step.proposals)

    def state_programs(self) -> tuple:
        empty = tuple(x[0] for x in init_state(1, self.vocab))  # into slot 0, which nothing holds yet
        return ((load_jit, "load-controls", (np.int32(0),) + empty),)

    def program_key(self):
        return ("sampling-controls", self.num_slots, self.vocab)
