"""Iteration-level scheduling under one token budget (vLLM V1's model).

Every step hands out `max_num_batched_tokens` tokens: first to running
sequences in admission order (a decode takes one token, a sequence still
prefilling takes as much of its remaining prompt as the budget allows), then
to waiting sequences, admitted in arrival order while the budget, the
`max_num_seqs` cap and free pages allow. There are no prefill and decode
phases: a long prompt is chunked simply because the budget truncates it.

A request's samples (`n > 1`) hold one seat each: its prompt is admitted as one
sequence holding all `n` seats and forks into the samples once it is computed.
A request with more samples than `max_num_seqs` takes, when it is admitted, as
many seats as are free; the samples that found none are split off into a
sequence of their own (`Sequence.split`), held back until the prompt has been
computed once and then queued at its request's place (by arrival; under
`priority`, by priority first). When it runs it finds the prompt's full pages
in the prefix cache, computes the rest of the prompt, forks, and so on until
every sample has run. (Under FCFS such a sequence joins the running batch
behind requests admitted while it waited, where `priority` serves it in its
request's place, so with equal priorities the two policies may order such
samples differently.)

When a running sequence needs a page and none is free, the most recently
admitted sequence is preempted: its pages are freed and it goes back to the
front of the queue, to be recomputed later (its tokens are kept, only their
K/V is dropped). No admission happens in a step that preempted.

Under the `priority` policy (vLLM's: a lower `Request.priority` runs first)
the waiting queue is kept ordered by (priority, arrival) and the running batch
is served in that order, so the sequence preempted for a page is the one of
lowest priority; and when the request at the head of the queue finds no seat
or too few pages for its first chunk, running sequences of strictly lower
priority are preempted for it before the step is planned. With every priority equal this is FCFS.

Features limit admission and chunking through gates (`AdmissionGate`, given as
`Scheduler(gates=...)`), which name no feature here: a waiting sequence a gate
does not fit now (an adapter that would be one more than the device's adapter
slots, `serving.features`' gates) is skipped, keeping its place, and the sequences
behind it are considered (vLLM V1's scheduler does the same). So that it is not
starved by a stream of sequences that do fit, once a gate says it has waited too
long (`AdmissionGate.waited`) only sequences that need nothing of that gate pass
it: the gate's holders drain and it fits. A gate may also end a prefill chunk
early (`chunk_end`: never inside an image attended both ways).

Logit rows are a second, smaller budget (`max_logit_rows`): a sequence that
completes its tokens this step needs one row per sample it draws (n at the
end of a prompt with `n > 1`), and a prompt that asked for `prompt_logprobs`
needs one row per prompt position.

With overlapped scheduling (serving.core.engine) the next step is planned while
the last one still runs: a step's tokens count as computed, and its draws as
`num_pending`, from the moment it is dispatched; `update` later appends the
drawn tokens.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Optional

from serving.core.block_manager import BlockManager
from serving.core.sequence import Sequence, SequenceStatus


POLICIES = ("fcfs", "priority")


class AdmissionGate:
    """A limit a feature puts on which waiting sequences are admitted, where prefill chunks end, and which
    running ones wait for their draw.
    Each method's default imposes nothing."""

    def fits(self, seq: Sequence, running: list) -> bool:
        """Whether admitting `seq` now, beside the `running` sequences, keeps within the gate's limit."""
        return True

    def needs(self, seq: Sequence) -> bool:
        """Whether `seq` takes anything of what the gate limits (a sequence that does not passes a starving one)."""
        return False

    def waited(self, seq: Sequence) -> bool:
        """`seq` did not fit this step; whether it has now waited so long that only sequences the gate does
        not limit may pass it."""
        return False

    def forget(self, seq: Sequence) -> None:
        """`seq` was admitted or finished: the gate drops what it kept of it."""

    def waits_for_draw(self, seq: Sequence) -> bool:
        """Whether `seq`, with a draw in a dispatched step not yet processed, must wait for it before it
        joins another step (overlapped scheduling)."""
        return False

    def chunk_end(self, seq: Sequence, start: int, end: int) -> int:
        """Where a prefill chunk of `seq` from `start` to `end` may end (<= `end`; `start`: not at all now)."""
        return end


def priority_order(seq: Sequence) -> tuple:
    """The order of the `priority` policy: lower priority value first, then earlier arrival (then
    creation, which keeps a request's samples together and in order)."""
    return seq.request.priority, seq.request.metrics.arrival_time, seq.seq_id


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    max_logit_rows: int | None = None  # defaults to max_num_seqs
    policy: str = "fcfs"  # one of POLICIES

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {POLICIES}, got {self.policy!r}")

    @property
    def logit_rows(self) -> int:
        return self.max_logit_rows or self.max_num_seqs


@dataclasses.dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # num_computed_tokens before this step
    num_new_tokens: int
    sample_indices: tuple  # samples drawn from this step's last row ((), (i,), or range(n) at a fork)
    prompt_logprob_start: int = 0  # prompt positions [start, end) get a logprob row
    prompt_logprob_end: int = 0
    proposed_token_ids: tuple = ()  # a part's proposals, run after the last token (one more row each)

    @property
    def num_rows(self) -> int:
        return (len(self.sample_indices) + len(self.proposed_token_ids) + self.prompt_logprob_end
                - self.prompt_logprob_start)


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    copies: list[tuple[int, int]]  # copy-on-write page pairs to copy before the step
    num_batched_tokens: int
    preempted: list[Sequence]
    errored: list[Sequence]

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class PoolTooSmall(Exception):
    """A sequence that even an empty KV pool cannot hold."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, gates=()):
        self.config = config
        self.bm = block_manager
        self.gates: list[AdmissionGate] = list(gates)  # the features' limits (the module's docstring)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        # Counters (cumulative).
        self.num_preemptions = 0
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        # Proposed tokens for the next step, {seq_id: token ids} (a part's: speculative decoding's drafts); a
        # decode runs them after its last token, one more row each, and the part keeps what the step accepted.
        self.proposals: dict[int, list[int]] = {}
        # Called with a sequence about to be preempted, before its pages are freed (the host KV tier
        # swaps them out: serving.features.host_kv_tier).
        self.on_preempt = None

    # --- queue management ----------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq, front=False)

    @property
    def by_priority(self) -> bool:
        return self.config.policy == "priority"

    def _enqueue(self, seq: Sequence, front: bool) -> None:
        """FCFS: at the back (new) or the front (preempted). Priority: at its place in `priority_order`."""
        if not self.by_priority:
            self.waiting.appendleft(seq) if front else self.waiting.append(seq)
            return
        self._insert_in_order(seq)

    def _insert_in_order(self, seq: Sequence) -> None:
        """Into the queue before the sequences behind it in `priority_order` (under FCFS, where every
        priority is 0: in arrival order)."""
        key, i = priority_order(seq), len(self.waiting)
        while i > 0 and priority_order(self.waiting[i - 1]) > key:
            i -= 1
        self.waiting.insert(i, seq)

    def admit_computed(self, seq: Sequence) -> Optional[tuple[list[int], int]]:
        """Admits a sequence whose prompt K/V arrives from elsewhere (a shipped prefill) straight
        into the running batch, its prompt counted as computed.

        Returns (its block table, how many leading prompt tokens came from the prefix cache) so
        the caller writes the rest of the K/V; None when no seat or pages are free now, in which
        case nothing changed. Raises `PoolTooSmall` when even an idle pool cannot hold it.
        """
        if self.num_seats_running + seq.num_seats > self.config.max_num_seqs or self._holding_gate(seq):
            return None  # (a shipped prefill has n = 1: serving.disaggregation)
        n = seq.num_prompt_tokens
        hits = self.bm.lookup_prefix(seq)
        start = len(hits) * self.bm.page_size
        if self.bm.allocate(seq, n - start, hits) is None:
            if self.running:
                return None  # pages free up as running sequences finish
            raise PoolTooSmall(f"{n} computed tokens need more than the whole KV pool")
        seq.num_computed_tokens = n
        seq.num_cached_tokens = start
        self.bm.register_full_blocks(seq)
        self.prefix_queried_tokens += n
        self.prefix_hit_tokens += start
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return self.bm.table(seq), start

    def set_proposals(self, proposals: dict[int, list[int]]) -> None:
        """Proposed tokens for the next step, {seq_id: token ids}: a decode runs them after its last token
        (as many as the step's budget and rows leave room for), and the part that proposed them takes the
        step's tokens for it (`keep_accepted`, `StepPart.new_tokens`)."""
        self.proposals = proposals

    def keep_accepted(self, item: "ScheduledSeq", num_accepted: int) -> None:
        """A decode that checked proposals keeps the K/V of its last token and its accepted proposals
        (`num_accepted` tokens from the item's start); the pages of the rejected ones are released."""
        seq = item.seq
        seq.num_computed_tokens = item.start + num_accepted
        self.bm.trim(seq, seq.num_computed_tokens)

    def finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        """Ends a sequence (stop, length, abort, error) and frees its pages at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.bm.free_seq(seq)
        for gate in self.gates:
            gate.forget(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    @property
    def num_seats_running(self) -> int:
        return sum(s.num_seats for s in self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step --------------------------------------------------------------------------
    def _plan(self, seq: Sequence, start: int, budget: int, rows_left: int,
              seats: Optional[int] = None) -> Optional[ScheduledSeq]:
        """How many of `seq`'s tokens to run this step (None: none fit). `seats`: the samples it draws at
        the end of its prompt if not all it carries (a waiting sequence admitted with fewer, `_seats_for`)."""
        seats = seq.num_seats if seats is None else seats
        end = seq.num_tokens_with_pending
        remaining = end - start
        if remaining == 1 and seats == 1:  # a decode (the caller guarantees budget and a row)
            proposed = self.proposals.get(seq.seq_id)
            if proposed:
                proposed = tuple(proposed[:min(budget, rows_left) - 1])
                return ScheduledSeq(seq, start, 1 + len(proposed), (seq.sample_index,), proposed_token_ids=proposed)
            return ScheduledSeq(seq, start, 1, (seq.sample_index,))
        n = min(remaining, budget)
        plp_done = plp_last = 0
        if seq.wants_prompt_logprobs:
            # Row for position p gives the logprob of prompt token p + 1.
            plp_done = len(seq.request.prompt_logprobs) - 1
            plp_last = seq.num_prompt_tokens - 1

        def rows(k):
            plp = max(0, min(start + k, plp_last) - max(start, plp_done))
            return plp + (seats if start + k == end else 0)

        if rows(n) > rows_left:
            n = min(n, rows_left)  # prompt-logprob rows bound the chunk
            if start + n == end and rows(n) > rows_left:
                n = remaining - 1  # not enough rows to sample yet: stop one short
                n = min(n, rows_left) if rows(n) > rows_left else n
        for gate in self.gates:
            if n > 0:
                n = gate.chunk_end(seq, start, start + n) - start
        if n <= 0:
            return None
        complete = start + n == end
        samples = tuple(range(seq.sample_index, seq.sample_index + seats)) if complete else ()
        p0 = max(start, plp_done)
        p1 = max(p0, min(start + n, plp_last))
        return ScheduledSeq(seq, start, n, samples, p0, p1)

    def _may_run_again(self, seq: Sequence) -> bool:
        """Whether a sequence in a dispatched, unprocessed step may join the next step.

        Only a plain decode or prompt chunk may: one seat (a fork needs the samples), no
        prompt logprobs still being collected (where they resume is known only once the
        step is processed), no gate waiting for its draw (a grammar's next mask needs that token),
        and, with a draw in flight, not at its length limit (a draw that is the last by
        length would make the next step's token a wasted one)."""
        if not seq.num_in_flight:
            return True
        if seq.num_seats > 1 or seq.wants_prompt_logprobs:
            return False
        if seq.num_pending and any(gate.waits_for_draw(seq) for gate in self.gates):
            return False  # e.g. its grammar's next mask needs the token still being drawn
        return not seq.num_pending or (
            seq.num_output_tokens + seq.num_pending < seq.params.max_tokens
            and seq.num_tokens_with_pending < self.config.max_model_len)

    def _holding_gate(self, seq: Sequence) -> Optional[AdmissionGate]:
        """The first gate that does not fit `seq` now, or None."""
        return next((g for g in self.gates if not g.fits(seq, self.running)), None)

    def preempt_running(self) -> int:
        """Every running sequence back to the waiting queue with its pages freed, to be computed again from its
        tokens when it runs next (never swapped: the caller wants its K/V recomputed, e.g. under new weights);
        returns how many. The caller holds the steps, so no step of them is in flight."""
        running = [s for s in self.running if not s.num_in_flight]
        for seq in reversed(running):  # (each to the front: they keep their order)
            self.running.remove(seq)
            self.bm.free_seq(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self._enqueue(seq, front=True)
        return len(running)

    def _preempt(self, seq: Sequence) -> None:
        if self.on_preempt is not None:
            self.on_preempt(seq)
        self.bm.free_seq(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq, front=True)
        self.num_preemptions += 1

    def _make_room_for_priority(self) -> list[Sequence]:
        """Priority policy, before a step is planned: while the head of the queue would find no seat or
        too few free pages for its first chunk, preempts the running sequence of lowest priority among
        those of strictly lower priority than the head. Returns the sequences preempted."""
        displaced: list[Sequence] = []
        if not self.by_priority or not self.waiting or self.waiting[0].num_in_flight:
            return displaced
        head = self.waiting[0]
        while True:
            lower = [r for r in self.running if r.request.priority > head.request.priority]
            if not lower or self._fits(head):
                return displaced
            victim = max(lower, key=priority_order)
            self.running.remove(victim)
            self._preempt(victim)
            displaced.append(victim)

    def _seats_for(self, seq: Sequence, taken: int) -> int:
        """The seats a waiting sequence takes if admitted now, with `taken` seats held (0: it must wait).
        All it carries, or, when that is more than `max_num_seqs` (which could never be free at once),
        as many as are free: the others are split off when it is admitted (`Sequence.split`)."""
        free = self.config.max_num_seqs - taken
        if seq.num_seats > self.config.max_num_seqs:
            return max(0, min(seq.num_seats, free))
        return seq.num_seats if seq.num_seats <= free else 0

    def _fits(self, seq: Sequence) -> bool:
        """Whether a waiting sequence has its seats (a group larger than `max_num_seqs`: that many) and the
        free pages for its first chunk now."""
        wanted = min(seq.num_seats, self.config.max_num_seqs)
        if self.num_seats_running + wanted > self.config.max_num_seqs:
            return False
        hits = [] if seq.computes_whole_prompt else self.bm.lookup_prefix(seq)
        start = len(hits) * self.bm.page_size
        item = self._plan(seq, start, self.config.max_num_batched_tokens, self.config.logit_rows, wanted)
        if item is None:
            return True  # nothing to allocate for
        need = self.bm.blocks_needed(start + item.num_new_tokens) - len(hits)
        reclaimed = sum(1 for b in hits if self.bm.ref[b] == 0)  # hits sitting in the free queue
        return need <= self.bm.num_free_blocks - reclaimed

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        rows_left = cfg.logit_rows
        scheduled: list[ScheduledSeq] = []
        copies: list[tuple[int, int]] = []
        preempted: list[Sequence] = []
        errored: list[Sequence] = []
        displaced = self._make_room_for_priority()  # preempted for a waiting request of higher priority
        if self.by_priority:  # served, and preempted from the back, in priority order
            self.running.sort(key=priority_order)

        i = 0
        while i < len(self.running) and budget > 0 and rows_left > 0:
            seq = self.running[i]
            item = self._plan(seq, seq.num_computed_tokens, budget, rows_left) if self._may_run_again(seq) else None
            if item is None:
                i += 1
                continue
            while True:
                got = self.bm.allocate(seq, item.num_new_tokens)
                if got is not None:
                    break
                victim = self.running.pop()  # the most recently admitted
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if got is None:
                break  # `seq` preempted itself: it was the last running sequence
            copies.extend(got)
            self._dispatch(item)
            scheduled.append(item)
            budget -= item.num_new_tokens
            rows_left -= item.num_rows
            i += 1

        seats = self.num_seats_running
        i = 0  # the queue position considered: sequences a gate holds are passed, keeping theirs
        starving: set = set()  # gates a sequence ahead has waited for too long: only sequences they do not limit pass
        while i < len(self.waiting) and not preempted and budget > 0 and rows_left > 0:
            seq = self.waiting[i]
            group = self._seats_for(seq, seats)
            if not group or seq.num_in_flight:
                break  # (a preempted sequence waits for its last step to be processed)
            gate = self._holding_gate(seq)
            if gate is not None:
                if gate.waited(seq):
                    starving.add(gate)
                i += 1
                continue
            if any(g.needs(seq) for g in starving):
                i += 1
                continue
            hits = [] if seq.computes_whole_prompt else self.bm.lookup_prefix(seq)
            start = len(hits) * self.bm.page_size
            item = self._plan(seq, start, budget, rows_left, group)
            if item is None:
                break
            got = self.bm.allocate(seq, item.num_new_tokens, hits)
            if got is None:
                if not self.running and self.bm.num_free_blocks == self.bm.num_pages:
                    # Even an empty pool cannot hold this chunk: it can never run.
                    del self.waiting[i]
                    self.bm.free_seq(seq)
                    errored.append(seq)
                    continue
                break
            del self.waiting[i]
            if group < seq.num_seats:
                seq.split(group)  # the samples that found no seat wait for the prompt's pages
            for g in self.gates:
                g.forget(seq)
            self.running.append(seq)
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = start
            if seq.request.metrics.first_scheduled_time is None:
                seq.num_cached_tokens = start
            self.prefix_queried_tokens += seq.num_tokens
            self.prefix_hit_tokens += start
            copies.extend(got)
            self._dispatch(item)
            scheduled.append(item)
            seats += group
            budget -= item.num_new_tokens
            rows_left -= item.num_rows

        return SchedulerOutput(scheduled, copies, cfg.max_num_batched_tokens - budget, preempted + displaced,
                               errored)

    @staticmethod
    def _dispatch(item: ScheduledSeq) -> None:
        """The step will compute the item's tokens (and draw its samples): count them as
        computed (and pending) now, so the next step can be planned before this one has run."""
        item.seq.num_computed_tokens = item.start + item.num_new_tokens
        item.seq.num_in_flight += 1
        if item.sample_indices:
            item.seq.num_pending += 1

    def update(self, out: SchedulerOutput, sampled: list[int]) -> list[tuple[Sequence, int, int]]:
        """Advances every scheduled sequence past the step it just ran.

        `sampled` holds the drawn tokens in row order: scheduled sequences in
        order, each contributing one token per entry of its `sample_indices`.
        Appends the token to each sequence that completed, forks `n > 1`
        prompts into their samples, and registers newly full blocks in the
        prefix cache. Returns (sequence, token, row) for every sequence that
        received a token, forked children included.
        """
        new_tokens = []
        row = 0
        for item in out.scheduled:
            seq = item.seq
            first_row = row
            row += len(item.sample_indices) + len(item.proposed_token_ids)
            seq.num_in_flight -= 1
            if item.sample_indices:
                seq.num_pending -= 1
            if seq.status is SequenceStatus.FINISHED or item.proposed_token_ids:
                continue  # finished (aborted, stopped) meanwhile; or checked proposals (the proposing part's job)
            self.bm.register_full_blocks(seq)
            if not item.sample_indices:
                continue
            if seq.num_seats > 1:
                if seq.status is SequenceStatus.WAITING:
                    continue  # preempted before its fork: it draws the same samples when it runs again
                seq.num_seats = 1
                pos = self.running.index(seq) + 1
                children = []
                for j, k in enumerate(item.sample_indices[1:], start=1):
                    child = seq.fork(k)
                    self.bm.fork(seq, child)
                    tok = sampled[first_row + j]
                    child.token_ids.append(tok)
                    children.append(child)
                    new_tokens.append((child, tok, first_row + j))
                seq.request.seqs.extend(children)
                self.running[pos:pos] = children
            tok = sampled[first_row]
            seq.token_ids.append(tok)
            new_tokens.append((seq, tok, first_row))
            if seq.request.held:
                self._release_held(seq.request)
        return new_tokens

    def _release_held(self, request) -> None:
        """A sequence of `request` drew a token, so its prompt has been computed and its full pages are in
        the prefix cache (`register_full_blocks` above): the samples split off for want of seats join the
        queue at their request's place (its priority, then its arrival: ahead of the requests that came
        after it, under FCFS too)."""
        for seq in request.held:
            if not seq.is_finished:
                self._insert_in_order(seq)
        request.held = []
