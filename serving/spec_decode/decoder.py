"""Speculative decoding in the engine: propose, verify in the ragged step, keep what was accepted.

Per engine step, with speculation on:

1. `propose()` (before scheduling, `before_schedule`) asks the proposer for up to k drafts for
   every running sequence that decodes next; they go to the scheduler as its proposals
   (`Scheduler.set_proposals`).
   A sequence is never given more drafts than its `max_tokens` and the
   context window leave room for.
   Drafts a request's grammar (structured outputs) does not allow are cut
   off first: they could never be accepted.
2. The scheduler gives such a decode 1 + k query tokens (the last token and
   the drafts) under the one token budget, and KV slots for all of them;
   `pack_step` gives it k + 1 logit rows with the drafts, and `pack` adds
   where a draft model's distributions of them are (the step's device input
   and each row's `q_index`).
3. The engine's one step program (`serving.core.model_runner._step`) runs
   the target's forward over the whole ragged batch and verifies on device
   (`serving.spec_decode.verifier.SpecVerifier`, the step part that samples
   in its place), row j's grammar mask and sampling controls seeing drafts
   0..j-1; only the emitted ids come back.
4. `new_tokens()` rolls each verified sequence back to what was
   accepted (`num_computed_tokens`, pages past it released) and yields the
   accepted tokens one at a time, so a stop condition met mid-way ends the
   sequence there and drops the rest.

Sequences without drafts run through the same step as plain rows.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from serving.core import compute_dtype
from serving.core.model_runner import compilation_count as step_compilation_count
from serving.core.sequence import SequenceStatus
from serving.core.step_parts import StepPart
from serving.spec_decode import draft_model
from serving.spec_decode.verifier import Q_INDEX
from serving.spec_decode.ngram import NgramProposer
from serving.spec_decode.options import check_options, default_draft_dir
from serving.features.structured_output import grammar_of


@dataclasses.dataclass
class SpecStats:
    """Cumulative counters (vLLM's names): verifications, drafted and accepted tokens."""

    num_drafts: int = 0  # sequence-steps that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # tokens the verifying passes produced (accepted + one each)
    accepted_per_position: list = dataclasses.field(default_factory=list)  # [j]: drafts accepted at position j

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_tokens_per_pass(self) -> float:
        """Tokens per target pass of a verifying sequence (1 would be no speculation)."""
        return self.num_emitted_tokens / self.num_drafts if self.num_drafts else 0.0


class SpecDecoder(StepPart):
    """Speculation as a part of the engine's step (`serving.core.step_parts`): before scheduling it
    reads the scheduler's running sequences and hands it their drafts; it adds where the drafts'
    distributions are to the packed step, which verifies them (`SpecVerifier`); it tells the scheduler
    what was accepted and yields the accepted tokens."""

    serial = True  # the next step's drafts follow this step's tokens

    @classmethod
    def for_engine(cls, engine, draft=None) -> "SpecDecoder":
        """The part for `engine` (built once its scheduler and runner exist, `serving.features.build_parts`),
        from its options; `draft`: an in-memory (config, params) draft model instead of the
        `speculative_model` checkpoint."""
        c = engine.config
        return cls(engine.scheduler, engine.block_manager, engine.runner, max_model_len=engine.max_model_len,
                   max_num_seqs=c.max_num_seqs, method=c.speculative_method, k=c.num_speculative_tokens,
                   draft=draft, draft_dir=c.speculative_model, dtype=c.dtype)

    def __init__(self, scheduler, block_manager, runner, *, max_model_len: int, max_num_seqs: int, method: str,
                 k: int, dtype: str, draft=None, draft_dir=None):
        check_options(method, k)
        self.scheduler, self.block_manager, self.runner = scheduler, block_manager, runner
        self.max_model_len = max_model_len
        self.method = method
        self.k = k
        self.stats = SpecStats(accepted_per_position=[0] * k)
        cfg = runner.cfg
        if method == "ngram":
            self.proposer = NgramProposer(k)
        else:
            if draft is None:
                from model.checkpoint import load_checkpoint, load_config

                directory = draft_dir or default_draft_dir()
                if not os.path.isdir(directory):
                    raise FileNotFoundError(f"no draft model checkpoint at {directory}")
                dcfg, dparams = load_checkpoint(directory, None, load_config(directory))
            else:
                dcfg, dparams = draft
            if dcfg.vision is not None:
                # Drafting runs the draft's decoder on the target's token ids alone: no image rows and no
                # multimodal positions reach it, so a vision-language draft would read an image as its
                # placeholder embeddings at the wrong positions. A text-only draft reads the placeholder
                # ids as the text they are, which is all a proposer needs (verification keeps the output
                # exact).
                raise ValueError("the draft model takes images (its config has a vision encoder); drafting "
                                 "feeds it token ids only, without image rows or multimodal positions: use a "
                                 "text-only draft model with the target's vocabulary")
            # The target's `dtype` option holds for the draft too (on CPU "auto" makes a bf16 draft float32).
            dcfg, dparams = compute_dtype.apply(dcfg, dparams, dtype, what="the draft model")
            if dcfg.vocab_size != cfg.vocab_size:
                raise ValueError(f"the draft model's vocabulary ({dcfg.vocab_size}) differs from the target's "
                                 f"({cfg.vocab_size}); they must share the tokenizer")
            self.proposer = draft_model.DraftModelProposer(
                dcfg, dparams, num_speculative_tokens=k, num_pages=runner.num_pages, page_size=runner.page_size,
                buckets=runner.buckets, max_num_seqs=max_num_seqs, backend=runner.backend,
                runner=runner)  # placed where the runner says; announced through it on a multi-process mesh

    # --- 1. propose --------------------------------------------------------------------------
    def before_schedule(self, touched: dict, it) -> None:
        self.propose()

    def propose(self) -> None:
        running = [s for s in self.scheduler.running if s.status is SequenceStatus.RUNNING]
        self.proposer.forget(s.seq_id for s in running)
        feeds = []
        for seq in running:
            if seq.num_tokens - seq.num_computed_tokens == 1 and seq.num_seats == 1:
                room = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
                feeds.append((seq, seq.num_tokens, max(0, min(self.k, room))))
            else:  # prefilling: the draft model can follow the computed prompt chunks
                feeds.append((seq, seq.num_computed_tokens, 0))
        if self.method == "ngram":
            feeds = [(seq, limit) for seq, _, limit in feeds if limit > 0]
        drafts, _ = self.proposer.propose(feeds)
        for seq in running:
            grammar = grammar_of(seq.request)
            if grammar is not None and drafts.get(seq.seq_id):
                drafts[seq.seq_id] = grammar.valid_drafts(seq.sample_index, drafts[seq.seq_id])
        self.scheduler.set_proposals(drafts)

    # --- 3. verify (in the engine's step) -------------------------------------------------------
    def pack(self, batch) -> None:
        """Points each verifying row at its draft's distribution (the draft model's output, on device);
        prompt-lookup drafts are point masses and leave the rows at -1."""
        q_base = getattr(self.proposer, "q_base", None)
        if q_base is None:
            return
        batch.device_input = self.proposer.draft_probs
        q_index = batch.views()[Q_INDEX]  # a view: writes reach the buffer
        for first, seq, _, drafts in batch.proposal_groups:
            base = q_base.get(seq.seq_id)
            if base is not None:
                q_index[first:first + len(drafts)] = np.arange(base, base + len(drafts))

    # --- 4. keep what was accepted -----------------------------------------------------------
    def new_tokens(self, out, ids):
        """Yields (sequence, token, row) for verified sequences, appending each token just before."""
        st = self.stats
        row = 0
        for it in out.scheduled:
            first, nd = row, len(it.proposed_token_ids)
            row += len(it.sample_indices) + nd
            seq = it.seq
            if not nd or seq.status is not SequenceStatus.RUNNING:
                continue
            accepted = []
            for t in ids[first:first + nd + 1]:
                if t < 0:
                    break
                accepted.append(int(t))
            a = len(accepted) - 1
            st.num_drafts += 1
            st.num_draft_tokens += nd
            st.num_accepted_tokens += a
            st.num_emitted_tokens += len(accepted)
            for j in range(a):
                st.accepted_per_position[j] += 1
            # K/V is valid for the last token and the accepted drafts; the rest is rolled back.
            self.scheduler.keep_accepted(it, len(accepted))
            for j, tok in enumerate(accepted):
                seq.token_ids.append(tok)
                yield seq, tok, first + j
                if seq.status is not SequenceStatus.RUNNING:
                    break  # a stop condition: the remaining accepted tokens are dropped
            else:
                self.block_manager.register_full_blocks(seq)

    def engine_stats(self) -> dict:
        return {"spec_decode": dataclasses.replace(self.stats,
                                                   accepted_per_position=list(self.stats.accepted_per_position))}

    def after_step(self) -> None:
        """Frees the proposer's state of sequences that finished this step (so an idle engine holds nothing)."""
        self.proposer.forget(s.seq_id for s in self.scheduler.running)

    # --- warm-up -----------------------------------------------------------------------------
    def warm_up(self) -> dict:
        """Compiles the proposer's shapes (the step's are the runner's warm-up)."""
        return self.proposer.warm_up()


def compilation_count() -> int:
    """Executables compiled so far for the step (which verifies), page copies and drafting (all engines)."""
    return step_compilation_count() + draft_model.compilation_count()
