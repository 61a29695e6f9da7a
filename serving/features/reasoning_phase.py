"""The thinking phase of a reasoning model's output, enforced by the engine.

A reasoning model writes `<think> ... </think>` before its answer. Two things
must know where that block ends: a thinking budget (`thinking_token_budget`),
which ends thinking by forcing the end tag once the budget is spent, and a
grammar (structured outputs, a forced tool call), which must constrain the
answer only, never the thinking (otherwise the end tag is impossible and the
model cannot think).

Both ride on the machinery structured outputs already have: a request's
`structured` object gives each sample's next-token bitmask, and the one step
program applies it per row (`structured_output.apply_token_bitmask`). A
`PhasedGrammar` wraps the request's grammar (or none) and decides each
sample's mask from a small host-side phase:

* `undecided` (a template that lets the model choose whether to open a think
  block): the answer's mask plus the start tag's first token;
* `opening`: the rest of a multi-token start tag, forced one token at a time;
* `thinking`: every token allowed, until the end tag appears in the output
  (matched as its token ids, across tokens) or the budget is spent; then the
  rest of the end tag is forced, one token per step;
* `answer`: the grammar's mask (all ones without a grammar).

A request with a grammar must not end before its answer is written, so a token
that would end it (an EOS, a stop token id: the `ends` it is made with) drawn
while it thinks freely is taken as the end tag's next token instead
(`instead_of_ending`), and the rest of the tag is forced as the budget forces
it; the grammar then holds EOS back until it is complete. Without a grammar
such a token ends the request inside its thinking, as it would without
reasoning.

So no new compiled program and no new step input: the phase is host state,
and its effect reaches the device as the mask row the step takes anyway.
Speculative drafts go through the same phase machine (`valid_drafts`,
`fill_draft_masks`), so a draft that crosses the end of thinking is checked
against the grammar from exactly the token where the answer begins.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from serving.core.format_params import ReasoningParams

@dataclasses.dataclass
class _Phase:
    """One sample's place in the output: the phase, thinking tokens so far, how many of the tag
    being written (start while opening, end while thinking) its last tokens already match, and
    whether the rest of the end tag is forced because an ending token was drawn (`closing`)."""

    name: str
    thought: int = 0
    matched: int = 0
    closing: bool = False


def _end_match(recent: list, end_ids: list) -> int:
    """The longest k such that the last k tokens of `recent` are the first k of `end_ids`."""
    for k in range(min(len(recent), len(end_ids)), 0, -1):
        if recent[-k:] == end_ids[:k]:
            return k
    return 0


class PhasedGrammar:
    """A request's masks with a thinking phase in front of its grammar (`grammar` may be None).

    Has `RequestGrammar`'s interface (`masks`, `accept`, `valid_drafts`, `fill_draft_masks`), so the
    engine, the packing and the speculative decoder use it as they use a grammar. `ends`: the token
    ids that end the request (its EOS ids unless it ignores EOS, and its stop token ids); with a
    grammar, one drawn while thinking closes the thinking instead."""

    def __init__(self, params: ReasoningParams, grammar, n: int, width: int, ends=()):
        self.params = params
        self.grammar = grammar
        self.width = width
        self.ends = frozenset(int(t) for t in ends) if grammar is not None else frozenset()
        self.phases = [_Phase(params.starts) for _ in range(n)]
        self.recent: list[list[int]] = [[] for _ in range(n)]  # each sample's last thinking tokens
        self.masks = np.full((n, width), -1, np.int32)
        for i in range(n):
            self._write_mask(i, self.phases[i], self.masks, i)

    # --- the phase machine ----------------------------------------------------------------------
    def _forced(self, phase: _Phase) -> Optional[int]:
        """The token this phase forces next, if any."""
        p = self.params
        if phase.name == "opening":
            return p.start_ids[phase.matched]
        if phase.name == "thinking" and (phase.closing or (p.budget is not None and phase.thought >= p.budget)):
            return p.end_ids[phase.matched]
        return None

    def _ends_early(self, phase: _Phase, token: int) -> bool:
        """Whether `token` would end the request before its grammar's answer: an ending token drawn
        while thinking freely (never true without a grammar: `ends` is empty then)."""
        return token in self.ends and phase.name == "thinking" and self._forced(phase) is None

    def _advance(self, phase: _Phase, recent: list, token: int) -> tuple[_Phase, list, bool]:
        """(next phase, next recent tokens, whether this token is the answer's) after `token`."""
        p = self.params
        if phase.name == "answer":
            return phase, recent, True
        if phase.name == "undecided":
            if token != p.start_ids[0]:
                return _Phase("answer"), [], True
            phase = _Phase("opening", matched=1)
            return (_Phase("thinking") if len(p.start_ids) == 1 else phase), [], False
        if phase.name == "opening":
            matched = phase.matched + 1 if token == p.start_ids[phase.matched] else 0
            if matched == 0:  # cannot happen under the forcing mask; treat the block as open
                return _Phase("thinking", thought=1), [token], False
            opened = matched == len(p.start_ids)
            return (_Phase("thinking") if opened else _Phase("opening", matched=matched)), [], False
        recent = (recent + [token])[-len(p.end_ids):]
        matched = _end_match(recent, p.end_ids)
        if matched == len(p.end_ids):
            return _Phase("answer"), [], False
        return _Phase("thinking", phase.thought + 1, matched, phase.closing), recent, False

    def _write_mask(self, i: int, phase: _Phase, out: np.ndarray, row: int, grammar_row=None) -> None:
        """Writes sample i's mask in `phase` into out[row] (`grammar_row`: the grammar's mask to use
        in the answer, if not the sample's current one)."""
        forced = self._forced(phase)
        if forced is not None:
            out[row] = 0
            out[row, forced >> 5] = np.int32(np.uint32(1 << (forced & 31)).view(np.int32))
            return
        if phase.name in ("answer", "undecided"):
            if self.grammar is None:
                out[row] = -1
            else:
                out[row] = self.grammar.masks[i] if grammar_row is None else grammar_row
            if phase.name == "undecided":
                first = self.params.start_ids[0]
                out[row, first >> 5] |= np.int32(np.uint32(1 << (first & 31)).view(np.int32))
            return
        out[row] = -1

    def in_answer(self, sample_index: int) -> bool:
        return self.phases[sample_index].name == "answer"

    # --- overlapped scheduling -------------------------------------------------------------------
    def constrains(self, sample_index: int) -> bool:
        """Whether the sample's current mask bars anything: not while it thinks freely, nor in an
        answer without a grammar."""
        phase = self.phases[sample_index]
        if self._forced(phase) is not None or phase.name == "undecided":
            return True
        return phase.name == "answer" and self.grammar is not None

    def needs_pending(self, sample_index: int, pending: int) -> bool:
        """Whether the sample's next mask depends on its `pending` tokens still being drawn. Without a
        grammar, a sample thinking freely whose budget those tokens cannot spend gets an all-ones mask
        whatever they are (they either go on thinking or end it; both bar nothing), so it may run
        ahead of its draws like a plain sequence."""
        phase = self.phases[sample_index]
        if self.grammar is not None or phase.name not in ("thinking", "answer"):
            return True
        if phase.name == "answer":
            return False
        return self.params.budget is not None and phase.thought + pending >= self.params.budget

    # --- RequestGrammar's interface --------------------------------------------------------------
    def instead_of_ending(self, sample_index: int, token: int) -> int:
        """The token a sample takes in place of its drawn `token`: the end tag's next token when `token`
        would end a request with a grammar while it thinks (the rest of the tag is then forced, as
        when the budget is spent), `token` itself otherwise. Called before `accept`."""
        phase = self.phases[sample_index]
        if not self._ends_early(phase, int(token)):
            return token
        self.phases[sample_index] = dataclasses.replace(phase, closing=True)
        return self.params.end_ids[phase.matched]

    def accept(self, sample_index: int, token: int) -> bool:
        """Takes in a sample's drawn token; True when its grammar is complete (the sample may stop)."""
        phase, recent, answer = self._advance(self.phases[sample_index], self.recent[sample_index], int(token))
        self.phases[sample_index], self.recent[sample_index] = phase, recent
        if answer and self.grammar is not None and self.grammar.accept(sample_index, token):
            return True
        self._write_mask(sample_index, phase, self.masks, sample_index)
        return False

    def _walk(self, sample_index: int, drafts) -> tuple[int, list]:
        """How many leading drafts the phase machine allows before the answer begins, and the
        drafts from the answer's first token on (empty when they never reach it)."""
        phase, recent = self.phases[sample_index], self.recent[sample_index]
        for j, tok in enumerate(drafts):
            forced = self._forced(phase)
            if (forced is not None and tok != forced) or self._ends_early(phase, int(tok)):
                return j, []  # an ending draft would be taken as the end tag, not as itself
            if phase.name == "answer":
                return j, list(drafts[j:])
            phase, recent, answer = self._advance(phase, recent, int(tok))
            if answer:
                return j, list(drafts[j:])
        return len(drafts), []

    def valid_drafts(self, sample_index: int, drafts: list[int]) -> list[int]:
        """The longest prefix of `drafts` the phase (and, from the answer on, the grammar) allows."""
        head, answer = self._walk(sample_index, drafts)
        if not answer or self.grammar is None:
            return list(drafts[:head + len(answer)])
        return list(drafts[:head]) + self.grammar.valid_drafts(sample_index, answer)

    def fill_draft_masks(self, sample_index: int, drafts, out: np.ndarray, first_row: int) -> None:
        """Row `first_row` + j of `out` gets the mask after drafts 0..j-1, as the phase and the grammar
        would give it; the grammar steps over the answer's drafts and rolls back."""
        phase, recent = self.phases[sample_index], self.recent[sample_index]
        out[first_row] = self.masks[sample_index]
        m = self.grammar.matchers[sample_index] if self.grammar is not None else None
        consumed = 0
        scratch = np.empty((1, self.width), np.int32)
        for j, tok in enumerate(drafts):
            forced = self._forced(phase)
            if (forced is not None and tok != forced) or self._ends_early(phase, int(tok)):
                break
            phase, recent, answer = self._advance(phase, recent, int(tok))
            grammar_row = None
            if answer and m is not None:
                if m.is_stopped() or not m.consume_token(int(tok)):
                    break
                consumed += 1
                self.grammar._fill(m, scratch, 0)
                grammar_row = scratch[0]
            elif phase.name == "answer" and m is not None and consumed == 0:
                grammar_row = self.grammar.masks[sample_index]  # the answer begins after this token
            self._write_mask(sample_index, phase, out, first_row + j + 1, grammar_row)
        if consumed and not m.rollback(consumed):
            raise RuntimeError(f"structured outputs: the grammar could not roll back {consumed} drafted tokens: "
                               f"{m.get_error()}")
