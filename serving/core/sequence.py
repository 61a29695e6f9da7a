"""The host-side state of requests and of the sequences the scheduler moves.

A `Request` is what a user submitted: one prompt, one `SamplingParams`, and
`n` samples. The scheduler works on `Sequence`s: a request starts as one
sequence that prefills the prompt once and carries `n` seats; when its prompt
is done it forks into `n` sequences that share the prompt's KV pages
(copy-on-write) and then decode independently. A request with more samples
than `max_num_seqs` cannot hold them all at once: when it is admitted the
scheduler splits off the samples that find no seat (`Sequence.split`) into a
sequence of their own, held back until the request's prompt has been computed
once (so that it finds the prompt's full pages in the prefix cache), then
queued to prefill the rest and fork in turn.

A sequence's progress is two numbers (vLLM V1's model): `token_ids` (prompt
plus generated tokens) and `num_computed_tokens` (how many of them have their
K/V in the cache, or will once the steps already dispatched have run). Each
step it is given `len(token_ids) - num_computed_tokens` tokens or fewer; when
the step reaches the end of `token_ids` the step samples the next token.
Prefill, chunked prefill, decode and recompute after preemption are all that
one rule. With overlapped scheduling a token sampled by a step still running
counts as `num_pending` until the host sees it; the next step may already
feed it to the model.
"""

from __future__ import annotations

import enum
import itertools
from typing import Optional

from serving.core.block_manager import salt_digest, weights_digest
from serving.core.outputs import Logprob, RequestMetrics
from serving.core.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_ids = itertools.count()


class Sequence:
    __slots__ = (
        "seq_id", "request", "sample_index", "token_ids", "num_prompt_tokens", "num_computed_tokens",
        "num_seats", "status", "finish_reason", "stop_reason", "logprobs", "keep_sizes", "cumulative_logprob",
        "detokenizer", "num_cached_tokens", "block_hashes", "text", "last_token_time",
        "num_pending", "num_in_flight", "weight_versions",
    )

    def __init__(self, request: "Request", token_ids: list[int], sample_index: int = 0, num_seats: int = 1):
        self.seq_id = next(_seq_ids)
        self.request = request
        self.sample_index = sample_index
        self.token_ids = token_ids
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0
        # Slots of `max_num_seqs` this sequence holds: n for a prompt that will
        # fork into n samples (sample_index, sample_index + 1, ...), so the fork always has room.
        self.num_seats = num_seats
        self.status = SequenceStatus.WAITING
        self.finish_reason: Optional[str] = None
        self.stop_reason = None
        self.logprobs: Optional[list[dict[int, Logprob]]] = [] if request.params.logprobs is not None else None
        self.keep_sizes: Optional[list[int]] = [] if request.params.logprobs is not None else None  # (`sampler`'s kept)
        self.cumulative_logprob = 0.0
        self.weight_versions: list[int] = []  # the engine's weight version each output token was drawn under
        self.detokenizer = None  # set by the engine's output processor
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at admission
        self.block_hashes: list[bytes] = []  # chained digests of this sequence's full blocks
        self.text = ""  # detokenized output so far (cut at a stop string)
        self.last_token_time: Optional[float] = None
        # Overlapped scheduling (serving.core.engine): tokens already drawn by dispatched steps but not
        # yet seen on the host, and how many dispatched, unprocessed steps include this sequence.
        self.num_pending = 0
        self.num_in_flight = 0

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def keeps_all_pages(self) -> bool:
        """Whether every prompt page must stay held, even those a sliding window has passed (`BlockManager`):
        a part reads the prompt's K/V once the prefill ends (`Request.keeps_all_pages`: an export)."""
        return self.request.keeps_all_pages

    def block_extra(self, start: int, end: int) -> bytes:
        """What besides its tokens decides the K/V of positions start..end (`block_digest`): the digests of
        the prompt's content placed there (`Request.prompt_content`: images); b"" for a text prompt."""
        content = self.request.prompt_content
        return b"" if content is None else content.digests_between(start, end)

    @property
    def hash_root(self) -> Optional[bytes]:
        """The parent digest of this sequence's first block (its request's cache salt, or None)."""
        return self.request.hash_root

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        """Tokens including those drawn on the device but not yet seen on the host."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Only the first sample collects prompt logprobs, once, before any output exists."""
        return (self.request.params.prompt_logprobs is not None and self.sample_index == 0
                and self.num_output_tokens == 0)

    @property
    def computes_whole_prompt(self) -> bool:
        """Whether every prompt row must be computed (prompt logprobs, or a part reading every row's hidden state):
        no prefix-cache hit may stand in for some."""
        return self.wants_prompt_logprobs or self.request.reads_every_prompt_row

    def fork(self, sample_index: int) -> "Sequence":
        """A sibling sample after the prompt: same tokens so far, its own future."""
        child = Sequence(self.request, list(self.token_ids[:self.num_prompt_tokens]), sample_index)
        child.num_computed_tokens = self.num_computed_tokens
        child.block_hashes = list(self.block_hashes)
        child.num_cached_tokens = self.num_cached_tokens
        child.status = self.status
        return child

    def split(self, keep: int) -> "Sequence":
        """Before its fork: keeps the first `keep` of the samples this sequence carries and returns a
        new waiting sequence, of the prompt alone, carrying the others. Its request holds it back
        (`Request.held`) until the prompt's pages are cached (`Scheduler.update` queues it)."""
        if not 0 < keep < self.num_seats or self.num_output_tokens:
            raise ValueError(f"{self!r} carries {self.num_seats} samples and has {self.num_output_tokens} "
                             f"output tokens: cannot keep {keep} of them")
        rest = Sequence(self.request, list(self.token_ids[:self.num_prompt_tokens]), self.sample_index + keep,
                        num_seats=self.num_seats - keep)
        self.num_seats = keep
        self.request.seqs.append(rest)
        self.request.held.append(rest)
        return rest

    def __repr__(self):
        return (f"Sequence(id={self.seq_id}, req={self.request.request_id!r}, sample={self.sample_index}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, {self.status.value})")


class Request:
    """One submitted prompt and its samples."""

    def __init__(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                 params: SamplingParams, seed: int, arrival_time: float, eos_token_ids: tuple[int, ...] = (),
                 cache_salt: Optional[str] = None, priority: int = 0, weights_epoch: int = 0):
        """`weights_epoch`: how many times the engine's weights were replaced before this request was made
        (its pages are named under those weights, `block_manager.weights_digest`)."""
        self.request_id = request_id
        self.priority = priority  # lower runs first under the `priority` scheduling policy
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.seed = seed  # the effective seed (drawn by the engine when params.seed is None)
        self.eos_token_ids = eos_token_ids
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.prompt_logprobs: Optional[list] = [None] if params.prompt_logprobs is not None else None
        first = Sequence(self, list(prompt_token_ids), 0, num_seats=params.n)
        self.seqs: list[Sequence] = [first]
        # Sequences split off for want of seats (`Sequence.split`), waiting for the prompt's pages to be
        # cached before they are queued.
        self.held: list[Sequence] = []
        self.error: Optional[str] = None
        self.stream = False  # emit an output every step (else only when finished)
        self.sampling_row = None  # packed sampling parameters, set by the engine
        self.part_state: dict = {}  # what step parts keep of the request, by the part's key (set at admission)
        self.part_args: dict = {}  # the request arguments step parts read (`StepPart.takes_args`), set at admission
        # Prefix-cache isolation: requests with different salts, or made under other weights, share no cached pages.
        self.cache_salt = cache_salt
        self.hash_root = weights_digest(salt_digest(cache_salt), weights_epoch)
        # Whether every prompt page stays held until the request leaves (a part reads the prompt's K/V when the
        # first token is drawn: the export of a disaggregated prefill, `serving.features.kv_exports`).
        self.keeps_all_pages = False
        # Whether a part reads the hidden state of every prompt row (mean, first-token or all-token pooling): the
        # prompt is then computed whole, no prefix-cache hit skipping rows.
        self.reads_every_prompt_row = False
        # What a pooling part made of the prompt (`serving.features.pooling`: an embedding, a classifier's
        # scores, every token's embedding), set in the step that ends the prompt; None for a generation request.
        self.pooled = None
        # What a part placed in the prompt besides its token ids (`StepPart.expand_prompt`; images, where each
        # one's placeholder tokens are, its digest and encoder output), None for a plain prompt: its digests
        # (`digests_between(start, end)`) name the pages that hold it (`Sequence.block_extra`).
        self.prompt_content = None

    @property
    def is_finished(self) -> bool:
        """Every sequence ended. One that still carries several samples (not forked yet) ends only by an
        abort or an error, which end the request's samples with it."""
        return all(s.is_finished for s in self.seqs)

    @property
    def max_total_tokens(self) -> int:
        """The most tokens any one sample can hold: prompt + max_tokens."""
        return len(self.prompt_token_ids) + (self.params.max_tokens or 0)
