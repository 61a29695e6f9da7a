"""Pooling requests: a prompt prefilled by the engine's one step, returning a pooled vector instead of text.

A pooling request is an ordinary request (greedy, one token: `pooling_sampling_params`) with the request
argument "pooling" (`PoolingParams`), so it is scheduled, chunked, batched and preempted exactly as a
generation request is, and a step may hold both. The step returns what the part needs of its final hidden
states (`PoolingPart.hidden_output`): each sequence's last and first row of the step and the fp32 sum of
its rows, plus every row (read only for all-token pooling), left on the device unless a pooling request is
in the step. On the host (`read_step`) each request takes what its pooler needs from the steps that hold
its prompt: the last row of the step that ends it, the first row of the step that starts at position 0,
the sum and count of every chunk (a chunked prompt's mean is the one-shot mean up to fp32 summation
order), or the rows themselves. The step that ends the prompt finishes the pooled value
(`Request.pooled`, reaching `RequestOutput.pooled`); the request's one drawn token ends it by length.

What a request gets (`PoolingParams.task`):

* "embed": the model's pooler (`PoolingConfig.pooling_type`), Matryoshka-truncated to `dimensions`, then
  L2-normalized when the model's config says so (or `normalize` asks): what `SentenceTransformer.encode`
  returns for the same checkpoint;
* "token_embed": every prompt token's hidden state `[tokens, dim]` (vLLM's `/pooling` "all" output);
* "classify": a sequence classifier's probabilities over its labels (softmax; one label: sigmoid);
* "score": a one-label classifier's sigmoid (a cross-encoder on a text pair, `CrossEncoder.predict`);
* "reward": the score head's raw values (a reward model, `num_labels` 1).

A pooler that reads every prompt row (mean, CLS, all) marks its request `reads_every_prompt_row`: no
prefix-cache hit stands in for rows it needs. Last-token pooling recomputes only the last token of a
cached prefix, as any prefill does, so it shares cached pages.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import numpy as np

from model import pooling as poolers
from serving.core.input_batch import TokenField
from serving.core.sampling_params import InvalidParameterError, SamplingParams
from serving.core.scheduler import AdmissionGate
from serving.core.step_parts import StepPart
from serving.features.pooling_config import PoolingConfig, PoolingConfigError

TASKS = ("embed", "token_embed", "classify", "score", "reward")
HEAD_TASKS = ("classify", "score", "reward")  # the tasks a score head answers
_KEY = "pooling"  # the part's key in `Request.part_state` and `Request.part_args`


@dataclasses.dataclass(frozen=True)
class PoolingParams:
    """What a pooling request asks for (vLLM's `PoolingParams`): the task, the embedding's `dimensions`
    (Matryoshka truncation), whether to L2-normalize it (None: as the model's config says)."""

    task: str = "embed"
    dimensions: Optional[int] = None
    normalize: Optional[bool] = None
    # An encoder's token types, one per prompt token (a cross-encoder's text pair: 0s then 1s); None: all 0.
    token_type_ids: Optional[tuple] = None

    def __post_init__(self):
        if self.task not in TASKS:
            raise InvalidParameterError("task", f"task: must be one of {TASKS}, got {self.task!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise InvalidParameterError("dimensions", f"dimensions: must be a positive integer, got "
                                                      f"{self.dimensions!r}")
        if self.dimensions is not None and self.task != "embed":
            raise InvalidParameterError("dimensions", f"dimensions: only embeddings are truncated, not {self.task}")


def pooling_sampling_params() -> SamplingParams:
    """The sampling parameters of a pooling request: one greedy token, which ends it (never shown)."""
    return SamplingParams(max_tokens=1, temperature=0.0)


@dataclasses.dataclass
class PoolingModel:
    """What a pooling checkpoint adds to its body: the pooling config and the classifier's score head (a host
    function of the pooled fp32 vector with `num_labels`: `model.pooling_heads.LinearHead` / `TanhHead`; None
    for an embedder); `labels`: the classifier's label names by index (`config.json`'s id2label)."""

    config: PoolingConfig
    head: Optional[Callable] = None
    labels: Optional[dict] = None

    @property
    def num_labels(self) -> int:
        return 0 if self.head is None else int(self.head.num_labels)


@dataclasses.dataclass
class PoolingOutput:
    """A pooling request's result (vLLM's names): `data` the float32 array; `embedding` / `probs` as lists,
    `score` the first value (a one-label classifier's, or a similarity)."""

    data: np.ndarray

    @property
    def embedding(self) -> list:
        return np.asarray(self.data).tolist()

    @property
    def probs(self) -> list:
        return np.asarray(self.data).tolist()

    @property
    def score(self) -> float:
        return float(np.asarray(self.data).reshape(-1)[0])


@dataclasses.dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list
    finished: bool = True


class _Pooled:
    """One request's pooling under way: its pooler, what it has taken from the steps so far."""

    __slots__ = ("params", "mode", "sum", "count", "first", "rows", "covered")

    def __init__(self, params: PoolingParams, mode: str):
        self.params, self.mode = params, mode
        self.reset()

    def reset(self) -> None:
        self.sum, self.count, self.first, self.rows, self.covered = None, 0, None, [], 0


class PoolingPart(StepPart):
    """Pooled outputs of requests that ask for them (`PoolingParams` as the request argument "pooling")."""

    takes_args = (_KEY,)

    def __init__(self, model: PoolingModel, hidden_size: int):
        self.model = model
        self.hidden_size = hidden_size
        self.max_model_len: Optional[int] = None  # the engine's context window (`attach`)
        self._slot = None  # this part's index among the runner's hidden parts (`StepResult.hidden_outputs`)

    def attach(self, engine) -> None:
        self._slot = engine.runner.hidden_parts.index(self)
        self.max_model_len = engine.max_model_len

    # --- admission ---------------------------------------------------------------------------------
    def max_prompt_tokens(self) -> int:
        """The longest prompt a pooling request may have: the pooling config's `max_seq_length`, within the
        context window (one position is left for the token that ends the request)."""
        limit = (self.max_model_len or 1 << 30) - 1
        if self.model.config.max_seq_length is not None:
            limit = min(limit, self.model.config.max_seq_length)
        return limit

    def admit(self, request) -> None:
        params = request.part_args.get(_KEY)
        if params is None:
            return
        if not isinstance(params, PoolingParams):
            raise InvalidParameterError("pooling_params", f"pooling_params: expected PoolingParams, got "
                                                          f"{type(params).__name__}")
        p = request.params
        if p.n != 1 or p.max_tokens != 1 or p.temperature != 0:
            raise InvalidParameterError("pooling_params", "pooling_params: a pooling request draws one greedy "
                                                          "sample of one token (pooling_sampling_params())")
        if params.task in HEAD_TASKS and self.model.head is None:
            raise InvalidParameterError("task", f"task: {params.task} needs a sequence classifier's score head; "
                                                "this model is an embedder (use embed)")
        if params.task in ("embed", "token_embed") and self.model.head is not None:
            raise InvalidParameterError("task", f"task: {params.task} is not served by a sequence classifier "
                                                "(use classify, score or reward)")
        if params.task == "score" and self.model.num_labels != 1:
            raise InvalidParameterError("task", f"task: score needs a one-label classifier; this one has "
                                                f"{self.model.num_labels} labels (use classify)")
        try:
            self.model.config.check_dimensions(params.dimensions, self.hidden_size)
        except PoolingConfigError as e:
            raise InvalidParameterError("dimensions", str(e)) from None
        n, limit = len(request.prompt_token_ids), self.max_prompt_tokens()
        if n > limit:
            raise InvalidParameterError("input", f"This model's maximum input length is {limit} tokens, and the "
                                                 f"input has {n} tokens (truncate_prompt_tokens truncates it)")
        mode = "all" if params.task == "token_embed" else self.model.config.pooling_type
        request.part_state[_KEY] = _Pooled(params, mode)
        request.reads_every_prompt_row = mode != "last"

    # --- the step ------------------------------------------------------------------------------------
    def hidden_output(self, hidden, md):
        cu = md.cu_q_lens
        sums, _ = poolers.mean_accumulate(hidden, cu)
        return {"last": poolers.pool_last_packed(hidden, cu).astype(np.float32),
                "first": poolers.pool_first_packed(hidden, cu).astype(np.float32),
                "sum": sums, "rows": hidden}

    def program_key(self):
        return "pooling-part-v1"  # what `hidden_output` computes, by a stable name (the executable store's key)

    def read_step(self, batch, result) -> None:
        outputs, fetched = None, {}

        def read(name):  # copied from the device once per step, only when a pooling request needs it
            if name not in fetched:
                fetched[name] = np.asarray(outputs[name], np.float32)
            return fetched[name]

        for i, (seq, first_row, start, n) in enumerate(batch.token_spans):
            state = seq.request.part_state.get(_KEY)
            if state is None or seq.request.pooled is not None:
                continue
            outputs = result.hidden_outputs[self._slot]
            if start == 0:  # the prompt's start (again, after a preemption that recomputes it)
                state.reset()
            if state.mode != "last" and start != state.covered:
                raise RuntimeError(f"pooling: request {seq.request.request_id} skipped prompt rows "
                                   f"{state.covered}..{start}")
            if state.mode == "mean":
                state.sum = read("sum")[i] + (0 if state.sum is None else state.sum)
                state.count += n
            elif state.mode == "cls" and start == 0:
                state.first = read("first")[i]
            elif state.mode == "all":
                state.rows.append(read("rows")[first_row:first_row + n])
            state.covered = start + n
            if state.covered >= seq.num_prompt_tokens:
                seq.request.pooled = self._finish(state, read("last")[i] if state.mode == "last" else None)

    def _finish(self, state: _Pooled, last) -> np.ndarray:
        """The request's pooled value, from what the steps gave its pooler."""
        config, params = self.model.config, state.params
        if state.mode == "all":
            rows = np.concatenate(state.rows)
            return _normalized(rows) if _normalizes(config, params) else rows
        vec = {"last": last, "cls": state.first}.get(state.mode)
        if state.mode == "mean":
            vec = state.sum / max(state.count, 1)
        if params.task == "embed":
            vec = vec[:params.dimensions] if params.dimensions else vec
            return _normalized(vec) if _normalizes(config, params) else vec
        logits = np.asarray(self.model.head(vec), np.float32)
        if params.task == "reward":
            return logits
        if params.task == "score" or logits.shape[0] == 1:
            return (1 / (1 + np.exp(-logits))).astype(np.float32)
        e = np.exp(logits - logits.max())
        return (e / e.sum()).astype(np.float32)

    def describe(self) -> dict:
        c = self.model.config
        return {"pooling": {"pooling_type": c.pooling_type, "normalize": c.normalize, "labels": self.model.num_labels,
                            "max_seq_length": c.max_seq_length}}


class WholePrompts(AdmissionGate):
    """An encoder's prompt runs in one step: a token attends to the ones after it, which a chunk would not hold."""

    def chunk_end(self, seq, start: int, end: int) -> int:
        return end if end >= seq.num_prompt_tokens else start


class BidirectionalPooling(PoolingPart):
    """`PoolingPart` for an encoder (`model.families.encoder`): every prompt in one step (`WholePrompts`), each
    token's span end its prompt's end (attention both ways), its token type from the request, no prefix-cache
    hit (a page's K/V depend on the tokens after it), and pooling requests only (an encoder has no head to
    generate with)."""

    def __init__(self, model: PoolingModel, hidden_size: int, max_positions: int, type_vocab_size: int):
        super().__init__(model, hidden_size)
        self.max_positions, self.type_vocab_size = max_positions, max(type_vocab_size, 1)
        self.max_step_tokens: Optional[int] = None

    def attach(self, engine) -> None:
        super().attach(engine)
        self.max_step_tokens = engine.config.max_num_batched_tokens

    def gate(self):
        return WholePrompts()

    def max_prompt_tokens(self) -> int:
        return min([super().max_prompt_tokens(), self.max_positions]
                   + ([self.max_step_tokens] if self.max_step_tokens else []))

    def admit(self, request) -> None:
        params = request.part_args.get("pooling")
        if params is None:
            raise InvalidParameterError("prompt", "this model is an encoder: it embeds, classifies and scores "
                                                  "prompts (pooling requests), it does not generate")
        super().admit(request)
        request.reads_every_prompt_row = True
        types = params.token_type_ids
        if types is not None and (len(types) != len(request.prompt_token_ids)
                                  or not all(0 <= int(t) < self.type_vocab_size for t in types)):
            raise InvalidParameterError("token_type_ids", f"token_type_ids: one per prompt token "
                                                          f"({len(request.prompt_token_ids)}), each below "
                                                          f"{self.type_vocab_size}")

    def token_fields(self) -> tuple:
        return (TokenField("pool_span_end"), TokenField("pool_token_type"))

    def pack(self, batch) -> None:
        v = batch.views()
        spans, types = v["pool_span_end"], v["pool_token_type"]
        spans[:] = 0
        types[:] = 0
        for seq, row, start, count in batch.token_spans:
            spans[row:row + count] = start + count  # the whole prompt (`WholePrompts`): its end
            given = seq.request.part_args.get("pooling")
            if given is not None and given.token_type_ids is not None:
                types[row:row + count] = given.token_type_ids[start:start + count]

    def apply_to_inputs(self, views, md):
        return dataclasses.replace(md, span_end=views["pool_span_end"], token_types=views["pool_token_type"]), {}

    def program_key(self):
        return "bidirectional-pooling-part-v1"


def _normalizes(config: PoolingConfig, params: PoolingParams) -> bool:
    return config.normalize if params.normalize is None else params.normalize


def _normalized(x: np.ndarray, eps: float = 1e-12) -> np.ndarray:
    """L2-normalized along the last axis, in fp32 (as `model.pooling.normalize`, on the host)."""
    x = np.asarray(x, np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), eps)


def truncated(ids: list, truncate_prompt_tokens: Optional[int], limit: int) -> list:
    """A pooling prompt's ids under `truncate_prompt_tokens`: None keeps them (a longer prompt is refused at
    admission, naming both lengths); k > 0 keeps the first k; -1 keeps the first `limit` (the model's). The
    first tokens are kept, as sentence-transformers truncates to `max_seq_length`."""
    if truncate_prompt_tokens is None:
        return list(ids)
    if truncate_prompt_tokens == -1:
        return list(ids[:limit])
    if isinstance(truncate_prompt_tokens, bool) or not isinstance(truncate_prompt_tokens, int) \
            or truncate_prompt_tokens < 1:
        raise InvalidParameterError("truncate_prompt_tokens", f"truncate_prompt_tokens: must be -1 or a positive "
                                                              f"integer, got {truncate_prompt_tokens!r}")
    if truncate_prompt_tokens > limit:
        raise InvalidParameterError("truncate_prompt_tokens", f"truncate_prompt_tokens: {truncate_prompt_tokens} "
                                                              f"exceeds the model's maximum input length {limit}")
    return list(ids[:truncate_prompt_tokens])


# --- scoring text pairs (`LLM.score`, the /score and rerank routes) ------------------------------------------
def pair_up(first, second, names: tuple = ("data_1", "data_2")) -> tuple[list, list]:
    """Two sides of a scoring request as aligned lists: one text against each of the other side's, or pairs one
    to one; `InvalidParameterError` naming the side (`names`, as the caller's fields are called) otherwise."""
    firsts = [first] if isinstance(first, str) else list(first)
    seconds = [second] if isinstance(second, str) else list(second)
    if not seconds:
        raise InvalidParameterError(names[1], f"{names[1]} must not be empty")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise InvalidParameterError(names[0], f"{names[0]} must hold one text or as many as {names[1]} "
                                              f"({len(seconds)}), got {len(firsts)}")
    return firsts, seconds


def pair_prompts(tokenizer, firsts: list, seconds: list, typed: bool, truncate: Optional[int],
                 limit: int) -> tuple[list, list]:
    """(prompts, `PoolingParams`) of a cross-encoder scoring each pair as one prompt (`tokenizer.encode_pair`:
    `tokenizer(text_1, text_2)`), each cut by `truncated` with its token types alike; the types go with the
    request when the model reads them (`typed`: an encoder's second text is type 1)."""
    if tokenizer is None or not hasattr(tokenizer, "encode_pair"):
        raise InvalidParameterError("prompt", "scoring text pairs needs a tokenizer to join them")
    prompts, params = [], []
    for a, b in zip(firsts, seconds):
        ids, types = tokenizer.encode_pair(a, b)
        ids = truncated(ids, truncate, limit)
        prompts.append(ids)
        params.append(PoolingParams("score", token_type_ids=tuple(types[:len(ids)]) if typed else None))
    return prompts, params

