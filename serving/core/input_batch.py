"""Host-side packing of one scheduled step into the step function's padded inputs.

Shapes are padded to buckets so the jitted step compiles once per bucket:
T tokens (powers of two from `min_tokens` up to `max_num_batched_tokens`, and
with `decode_step` every multiple of it up to `max_num_seqs` as well: finer
decode-sized buckets, `Buckets.token_sizes`), S = min(T, `max_num_seqs`)
sequences and logit rows, P pages per sequence (powers of two from
`min_pages` up to the pages of `max_model_len`). S is tied to T because
padding sequences costs almost nothing; P is a bucket of its own because the
jnp attention reads P pages for every token.

Everything integer goes into ONE int32 buffer and everything float into ONE
float32 buffer (offsets fixed by (T, S, P)), so a step costs two host-to-device
transfers however many fields it has. Packing is vectorised numpy: the only
Python loops are over scheduled sequences and logit rows, never over tokens.

Logit rows: first one row per sample drawn this step (at the sequence's last
token), then one row per prompt position whose prompt logprob is wanted.

A decode whose input token was drawn by the step still running (overlapped
scheduling, see `serving.core.engine`) gets a placeholder: `feed_rows` names the
row of that step's samples the device takes it from. Packing records on each
sampling sequence the row its draw lands in, for the step after this one.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Optional
import functools

import numpy as np

from kernels_pallas.pow2 import powers_of_two
from model.cache import fill_ragged
from serving.core import sampling_table
from serving.core.scheduler import SchedulerOutput
from serving.core.sequence import Sequence

NUM_FLAGS = 3  # any_random, any_filter, want_logprobs


ONE_PAGE_BUCKET_FROM = 16  # steps of at least this many tokens use one page bucket (`Buckets`)


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The padded shapes the step is compiled for."""

    max_num_batched_tokens: int
    max_num_seqs: int
    max_pages_per_seq: int
    min_tokens: int = 1
    min_pages: int = 1
    # > 0: decode-sized token buckets at every multiple of this, besides the powers of two
    # (`token_sizes`; the engine option `decode_bucket_step`); 0: powers of two only.
    decode_step: int = 0
    # The step parts' per-token fields (`TokenField`s, `StepPart.token_fields`), in every step.
    token_fields: tuple = ()

    def __post_init__(self):
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                             f"max_num_seqs ({self.max_num_seqs})")
        if self.decode_step < 0:
            raise ValueError(f"decode_bucket_step must be >= 0 (0: powers of two only), got {self.decode_step}")

    @functools.cached_property
    def token_sizes(self) -> list[int]:
        """The padded token counts of a step: powers of two from `min_tokens` up to `max_num_batched_tokens`,
        and with `decode_step` also every multiple of it from `min_tokens` up to `max_num_seqs` (vLLM's CUDA
        graph sizes are 1, 2, 4, then multiples of 8). A decode step has one row per running sequence, so
        with powers of two alone 17 running sequences compute 32 rows; the multiples cap the padding of
        a decode of more than `decode_step` rows at `decode_step - 1` rows. Larger (prefill-sized) steps
        keep the powers of two: their tokens come from a budget the scheduler fills. Each added bucket
        adds one program (it has `ONE_PAGE_BUCKET_FROM` rows or more: one page bucket)."""
        sizes = set(powers_of_two(self.max_num_batched_tokens, self.min_tokens))
        if self.decode_step:
            first = max(self.decode_step, -(-self.min_tokens // self.decode_step) * self.decode_step)
            sizes.update(range(first, self.max_num_seqs + 1, self.decode_step))
        return sorted(sizes)

    @functools.cached_property
    def page_sizes(self) -> list[int]:
        return powers_of_two(self.max_pages_per_seq, min(self.min_pages, self.max_pages_per_seq))

    def tokens_for(self, n: int) -> int:
        sizes = self.token_sizes
        i = bisect.bisect_left(sizes, n)
        if i == len(sizes):
            raise ValueError(f"{n} tokens exceed max_num_batched_tokens={self.max_num_batched_tokens}")
        return sizes[i]

    def seqs_for(self, num_tokens_bucket: int) -> int:
        return min(num_tokens_bucket, self.max_num_seqs)

    def pages_for(self, n: int) -> int:
        sizes = self.page_sizes
        i = bisect.bisect_left(sizes, n)
        if i == len(sizes):
            raise ValueError(f"{n} pages exceed the {self.max_pages_per_seq} pages of max_model_len")
        return sizes[i]

    def one_page_bucket(self, num_tokens_bucket: int) -> bool:
        """Whether steps of this many tokens all take the largest page bucket: every step of at least
        `ONE_PAGE_BUCKET_FROM` tokens. Only the smallest decodes keep a bucket per page count.

        A decode-sized step (one query row per sequence) visits each row's live pages whatever the bucket
        (the page pairs of `kernels_pallas.xla_attention`, the Pallas kernels' dynamic KV loop); a
        prefill-sized one reads each item's pages a block at a time and skips the blocks past its last
        visible key. So larger page buckets cost these steps little, while a bucket per page count
        multiplies the programs a server compiles. Measured on CPU, 30-layer 135M shape
        (docs/performance.md): 16 and 64 decoding rows as fast in the largest bucket as in their own,
        batches of only short prefills up to 7% slower there (a mixed workload: no slower); but one
        decoding row 1.3x slower (its few pages are then one block of the whole bucket's table), which is
        why the steps below `ONE_PAGE_BUCKET_FROM` tokens keep every page bucket."""
        return num_tokens_bucket >= ONE_PAGE_BUCKET_FROM

    def step_pages(self, num_tokens_bucket: int, n: int) -> int:
        """The page bucket of a step of `num_tokens_bucket` tokens whose longest block table has `n` pages."""
        pages = self.pages_for(n)  # (an error for a table longer than max_model_len either way)
        return self.page_sizes[-1] if self.one_page_bucket(num_tokens_bucket) else pages

    def step_shape(self, T: int, S: int, P: int) -> "StepShape":
        """The buffers' layout of bucket (T, S, P), the parts' token fields included."""
        return StepShape(T, S, P, self.token_fields)

    def all_shapes(self) -> list[tuple[int, int, int]]:
        return [(t, self.seqs_for(t), p) for t in self.token_sizes
                for p in (self.page_sizes[-1:] if self.one_page_bucket(t) else self.page_sizes)]


@dataclasses.dataclass(frozen=True)
class TokenField:
    """A field of the packed step that a step part adds (`StepPart.token_fields`), sized by the step's
    tokens or logit rows: `shape` has -1 where the step's token count T goes (`(-1,)`: one entry per token;
    `(3, -1)`: three rows of T; `(-1, 64)`: T rows of 64) or -2 where its logit rows S go (`(-2,)`: one entry
    per row). Int32 fields travel in the int buffer, float32 ones in the float buffer; `fill` is what the
    field holds where the part writes nothing."""

    name: str
    shape: tuple = (-1,)
    dtype: str = "int32"  # "int32" or "float32"
    fill: float = 0

    def __post_init__(self):
        if self.shape.count(-1) + self.shape.count(-2) != 1 or self.dtype not in ("int32", "float32"):
            raise ValueError(f"token field {self.name!r}: its shape needs one -1 (the tokens) or -2 (the rows) and "
                             f"its dtype must be int32 or float32, got {self.shape} {self.dtype}")

    def shape_for(self, T: int, S: int) -> tuple:
        return tuple(T if d == -1 else S if d == -2 else d for d in self.shape)

    def size(self, T: int, S: int) -> int:
        return int(np.prod(self.shape_for(T, S)))


@dataclasses.dataclass(frozen=True)
class StepShape:
    """Offsets of every field inside the int32 and float32 buffers for one (T, S, P)."""

    T: int
    S: int
    P: int
    # The step parts' fields (`TokenField`s, `StepPart.token_fields`: a LoRA token's adapter slot, an image
    # row's embedding), after the engine's own.
    token_fields: tuple = ()

    def _part_fields(self, dtype: str) -> tuple:
        return tuple((f.name, f.size(self.T, self.S)) for f in self.token_fields if f.dtype == dtype)

    @property
    def int_fields(self):
        T, S, P = self.T, self.S, self.P
        return (("tokens", T), ("feed_rows", T), ("positions", T), ("slots", T), ("cu_q_lens", S + 1), ("kv_lens", S),
                ("block_tables", S * P), ("num_seqs", 1), ("logits_indices", S), ("sample_index", S),
                ("token_index", S), ("target", S), ("proposed_token", S), ("group_start", S),
                ("flags", NUM_FLAGS)) + self._part_fields("int32") \
            + sampling_table.buffer_fields(np.int32, S)

    @property
    def float_fields(self):
        return sampling_table.buffer_fields(np.float32, self.S) + self._part_fields("float32")

    @staticmethod
    def offsets(fields):
        out, o = {}, 0
        for name, n in fields:
            out[name] = (o, n)
            o += n
        return out, o

    @functools.cached_property
    def _offsets(self):
        return self.offsets(self.int_fields), self.offsets(self.float_fields)

    def split(self, ibuf, fbuf) -> dict:
        """Named views (numpy or jax) of the two buffers."""
        views = {}
        for buf, (offs, _) in zip((ibuf, fbuf), self._offsets):
            for name, (o, n) in offs.items():
                views[name] = buf[o:o + n]
        views["block_tables"] = views["block_tables"].reshape(self.S, self.P)
        for f in self.token_fields:
            views[f.name] = views[f.name].reshape(f.shape_for(self.T, self.S))
        sampling_table.shaped(views, self.S)
        return views

    def empty(self, pad_slot: int):
        (_, isize), (_, fsize) = self._offsets
        ibuf = np.zeros(isize, np.int32)
        fbuf = np.zeros(fsize, np.float32)
        v = self.split(ibuf, fbuf)
        v["slots"][:] = pad_slot
        v["feed_rows"][:] = -1
        v["target"][:] = -1
        v["proposed_token"][:] = -1  # no proposals: every row its own group
        v["group_start"][:] = np.arange(self.S)
        for f in self.token_fields:
            v[f.name][:] = f.fill
        sampling_table.reset(v)
        return ibuf, fbuf, v


@dataclasses.dataclass
class StepBatch:
    shape: StepShape
    ibuf: np.ndarray
    fbuf: np.ndarray
    num_tokens: int
    num_seqs: int
    sample_rows: list  # [(Sequence, sample_index)] for rows 0..len-1
    prompt_rows: list  # [(Sequence, first_row, p0, p1)]: rows for prompt positions p0..p1-1
    want_logprobs: bool
    kv_tokens: int  # tokens of K/V attended over (for bandwidth accounting)
    # seq_id -> the row of its draw in this step's samples: where the next step, dispatched before
    # this one is processed, finds the token it feeds as a placeholder (`feed_rows`).
    draw_rows: dict = dataclasses.field(default_factory=dict)
    # (first row, Sequence, sample_index, proposals) of each decode that checks proposed tokens
    # (`Scheduler.set_proposals`); its rows are first_row .. first_row + len(proposals), row j following
    # proposals 0..j-1.
    proposal_groups: list = dataclasses.field(default_factory=list)
    # The step's device-made input (`StepPart.device_input_spec`: a draft model's distributions), on device;
    # None: zeros.
    device_input: Optional[object] = None
    # (Sequence, first token row, first position, token count) of each scheduled sequence, in row order.
    token_spans: list = dataclasses.field(default_factory=list)
    # The device inputs of the runner's logit parts, in its order (`StepPart.step_inputs`; None: that part's
    # idle inputs); empty: none.
    part_inputs: tuple = ()

    def views(self) -> dict:
        """Named numpy views of the packed buffers (`StepShape.split`), for parts that write fields of theirs."""
        return self.shape.split(self.ibuf, self.fbuf)


def sampling_row(request) -> dict:
    """A request's per-row sampling values (`sampling_table.row_values`), computed once per request."""
    return sampling_table.row_values(request)


def pack_step(out: SchedulerOutput, tables: dict, buckets: Buckets, page_size: int, num_pages: int,
              previous_draw_rows: Optional[dict] = None,
              shape_for=None) -> StepBatch:
    """The padded host buffers of one scheduled step. `previous_draw_rows` is the `draw_rows` of the
    step dispatched just before (overlapped scheduling): a decode whose last token that step is
    still drawing reads it from there on the device. `shape_for(bucket) -> bucket`
    may hand out a larger bucket than the step's own (one that is compiled already,
    `ModelRunner.step_shape`). A decode with proposed tokens gets one row per proposal and one more; the
    parts' fields (`Buckets.token_fields`) are theirs to fill (`StepPart.pack`)."""
    items = out.scheduled
    n = len(items)
    n_new = np.fromiter((it.num_new_tokens for it in items), np.int64, n)
    starts = np.fromiter((it.start for it in items), np.int64, n)
    total = int(n_new.sum())
    num_rows = sum(it.num_rows for it in items)
    T = buckets.tokens_for(max(total, num_rows, 1))
    S = buckets.seqs_for(T)
    seq_tables = [tables[it.seq.seq_id] for it in items]
    P = buckets.step_pages(T, max((len(t) for t in seq_tables), default=1))
    shape = buckets.step_shape(T, S, P)
    if shape_for is not None:
        shape = shape_for(shape)
    ibuf, fbuf, v = shape.empty(num_pages * page_size)

    toks: list[int] = []
    feeds: list[tuple[int, int]] = []  # (token index, row of the previous step's sample)
    for it in items:
        if it.proposed_token_ids:  # the last token, then the proposals to check
            toks += it.seq.token_ids[it.start:it.start + it.num_new_tokens - len(it.proposed_token_ids)]
            toks += it.proposed_token_ids
        else:
            known = it.seq.token_ids[it.start:it.start + it.num_new_tokens]
            if len(known) < it.num_new_tokens:  # the last one is still on the device (a placeholder)
                feeds.append((len(toks) + len(known), previous_draw_rows[it.seq.seq_id]))
                known = known + [0]
            toks += known
    v["tokens"][:total] = toks
    for i, row in feeds:
        v["feed_rows"][i] = row
    cu = fill_ragged(n_new, starts, seq_tables, page_size, positions=v["positions"], slots=v["slots"],
                     cu_q_lens=v["cu_q_lens"], kv_lens=v["kv_lens"], block_tables=v["block_tables"])
    first = cu - n_new
    kv_lens = starts + n_new
    v["num_seqs"][0] = n

    sample_rows: list[tuple[Sequence, int]] = []
    draw_rows: dict[int, int] = {}
    prompt_rows = []
    proposal_groups = []
    want_logprobs = False
    any_random = any_filter = False
    row = 0
    li, si, ti = v["logits_indices"], v["sample_index"], v["token_index"]
    for i, it in enumerate(items):
        if not it.sample_indices:
            continue
        seq = it.seq
        req = seq.request
        values = req.sampling_row
        if values["temperature"] > 0:
            any_random = True
            any_filter = any_filter or sampling_table.needs_filter(values)
        if req.params.logprobs is not None:
            want_logprobs = True
        # Draws before this one, those still in flight included (this one is pending already).
        tok_index = seq.num_output_tokens + seq.num_pending - 1
        draw_rows[seq.seq_id] = row
        nd = len(it.proposed_token_ids)  # with proposals: one row per checked position, in order
        if nd:
            proposal_groups.append((row, seq, it.sample_indices[0], it.proposed_token_ids))
            v["proposed_token"][row:row + nd] = it.proposed_token_ids
            v["group_start"][row:row + nd + 1] = row
        for s in it.sample_indices:
            for j in range(nd + 1):
                li[row] = cu[i] - 1 - nd + j
                sampling_table.write_row(v, row, values)
                si[row], ti[row] = s, tok_index + j
                sample_rows.append((seq, s))
                row += 1
    for i, it in enumerate(items):
        if it.prompt_logprob_end > it.prompt_logprob_start:
            want_logprobs = True
            cnt = it.prompt_logprob_end - it.prompt_logprob_start
            base = int(first[i]) + it.prompt_logprob_start - it.start
            li[row:row + cnt] = np.arange(base, base + cnt)
            prompt = it.seq.token_ids
            v["target"][row:row + cnt] = prompt[it.prompt_logprob_start + 1:it.prompt_logprob_end + 1]
            prompt_rows.append((it.seq, row, it.prompt_logprob_start, it.prompt_logprob_end))
            row += cnt
    v["flags"][:] = (any_random, any_filter, want_logprobs)
    spans = [(it.seq, int(first[i]), int(starts[i]), int(n_new[i])) for i, it in enumerate(items)]
    return StepBatch(shape, ibuf, fbuf, total, n, sample_rows, prompt_rows, want_logprobs, int(kv_lens.sum()),
                     draw_rows, proposal_groups=proposal_groups, token_spans=spans)
