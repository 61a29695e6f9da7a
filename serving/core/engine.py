"""The synchronous engine core: requests in, one batched step at a time, outputs out.

`Engine.step()` schedules (scheduler + block manager), packs the batch
(input_batch), runs the jitted step (model_runner), then processes what came
back on the host: appends tokens, detokenizes, checks stop conditions, frees
finished sequences, records stats. It holds no thread of its own;
`AsyncEngine` runs it in a loop on a background thread, `LLM.generate` runs it
until everything is done.

Bad input is rejected by `make_request` before anything is queued, with an
`InvalidParameterError` naming the field, so one bad request never disturbs
the others.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Optional, Sequence, Union

import numpy as np

from model.config import ModelConfig
from model.families import kv_bytes_per_token, num_params
from model.generation_config import GenerationDefaults
from model.quant import check_kv_cache_dtype, check_weight_dtype, kv_cache_dtype
from model.quantize import quantize_params
from serving.core import compute_dtype, engine_args, step_parts
from serving.core.block_manager import BlockManager, is_cache_salt, releasing_window
from serving.core.input_batch import Buckets, pack_step, sampling_row
from serving.core.model_runner import ModelRunner
from serving.core.kv_pool import default_num_pages
from serving.core.output_processor import OutputProcessor
from serving.core.outputs import RequestOutput
from serving.core.sampling_params import InvalidParameterError, SamplingParams, with_defaults
from serving.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from serving.core.sequence import Request, Sequence
from serving.core.step_parts import StepPart
from serving.core.stats import EngineStats, FinishedRequestStats, IterationStats, StatsLog

log = logging.getLogger(__name__)

PromptType = Union[str, list, dict]


def scans_layers(layer_loop: str) -> bool:
    """Whether steps scan over layers (`EngineConfig.layer_loop`; "auto" scans, "unroll" does not)."""
    return layer_loop in ("auto", "scan")


PRIORITY_LIMIT = 2**31 - 1  # a request's priority is a 32-bit signed integer (a bound for hostile input)
# The most samples of one request (OpenAI's bound), or max_num_seqs where that is larger: a part may keep
# state per sample from the start (a grammar's matcher and mask), so `n` must be bounded, while the
# scheduler runs samples beyond max_num_seqs as seats free up.
N_LIMIT = 128


# The keys of a dict prompt the engine reads itself; parts take others (`StepPart.takes_prompt_keys`).
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})


class ContextLengthError(InvalidParameterError):
    """The prompt plus the requested tokens do not fit the context window."""


class EngineUnavailableError(RuntimeError):
    """The engine takes no request now, for a while (`Engine.unavailable` says why: asleep, or woken without
    weights): a 503 over HTTP, to be retried later."""


# How the engine batches, caches and samples: a frozen dataclass with one field per option of
# `serving.core.engine_args` that the engine reads (same names, types, defaults; the help there says what each does).
EngineConfig = engine_args.make_engine_config_class(__name__)


class Engine:
    def __init__(self, cfg: ModelConfig, params, tokenizer=None, config: EngineConfig = EngineConfig(), *,
                 runner=None, layout=None, generation: Optional[GenerationDefaults] = None,
                 parts: Sequence[StepPart] = ()):
        """`parts`: step parts built outside the engine (`serving.features.build_parts`), called after its own;
        those with device inputs of their own (`StepPart.step_input_spec`) are applied in every step.
        `generation`: the checkpoint's generation_config.json defaults (EOS ids, sampling parameters)."""
        check_weight_dtype(config.weight_dtype)
        check_kv_cache_dtype(config.kv_cache_dtype)
        if runner is None:  # the compute dtype, then load-time quantization of float weights ("auto": no-ops)
            cfg, params = compute_dtype.apply(cfg, params, config.dtype)
            cfg, params = quantize_params(params, cfg, config.weight_dtype)
        self.cfg = cfg
        self.config = config
        self.tokenizer = tokenizer
        self.cache_dtype = kv_cache_dtype(cfg, config.kv_cache_dtype)
        ps = config.page_size
        model_len = config.max_model_len or cfg.max_position_embeddings
        num_pages = config.num_pages or default_num_pages(cfg, config, model_len, self.cache_dtype, layout)
        if model_len > num_pages * ps:
            if config.max_model_len is not None:
                raise ValueError(f"max_model_len={model_len} needs {-(-model_len // ps)} pages of {ps} tokens but "
                                 f"the KV pool has {num_pages}; raise num_pages or lower max_model_len")
            log.warning("KV pool of %d pages holds %d tokens: max_model_len lowered from %d", num_pages,
                        num_pages * ps, model_len)
            model_len = num_pages * ps
        self.max_model_len = model_len
        self.num_pages = num_pages
        built = [p for p in parts if isinstance(p, StepPart)]  # (the parts built before the engine)
        # The logit rows of a step: one per sequence, or what a part's proposals need (k + 1 per decode).
        rows = max([config.max_num_seqs] + [r for p in built if (r := p.logit_rows(
            config.max_num_seqs, config.max_num_batched_tokens)) is not None])
        self.buckets = Buckets(config.max_num_batched_tokens, rows, -(-model_len // ps),
                               config.min_token_bucket, -(-config.min_context_bucket // ps),
                               decode_step=config.decode_bucket_step, token_fields=step_parts.token_fields(parts))
        self.runner = runner or ModelRunner(cfg, params, num_pages=num_pages, page_size=ps, buckets=self.buckets,
                                            backend=config.attention_backend, layout=layout,
                                            cache_dtype=self.cache_dtype, scan_layers=scans_layers(config.layer_loop),
                                            sampler_part=step_parts.sampler_part(parts),
                                            processed_logprobs=config.logprobs_mode == "processed_logprobs",
                                            forward_parts=step_parts.forward_parts(parts),
                                            logit_parts=step_parts.logit_parts(parts),
                                            hidden_parts=step_parts.hidden_parts(parts))
        self.block_manager = BlockManager(num_pages, ps, config.enable_prefix_caching,
                                          window=None if any(p.rolls_back for p in built) else releasing_window(cfg))
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, model_len,
                                                   rows, policy=config.scheduling_policy),
                                   self.block_manager)
        self.generation = generation or GenerationDefaults()
        self.eos_token_ids = tuple(sorted(set(cfg.eos_token_ids) | set(getattr(tokenizer, "eos_ids", ()) or ())
                                          | set(self.generation.eos_token_ids)))
        # A request without parameters gets these; the HTTP layer fills a field the client left out from them.
        # The file's max_new_tokens caps a request's unset max_tokens (make_request), as vLLM's does.
        self.default_max_tokens = self.generation.sampling.get("max_tokens")
        self.default_sampling_params = with_defaults(self.generation.sampling)
        if self.default_max_tokens is not None:
            self.default_sampling_params.max_tokens = None
        self.requests: dict[str, Request] = {}
        self.stats_log = StatsLog()
        self.outputs = OutputProcessor(tokenizer, model_len, self.scheduler.finish, self.stats_log)
        self._rng = np.random.default_rng(config.seed)
        self._lock = threading.Lock()  # guards the seed generator (make_request may run on any thread)
        self._pending_finished: list[FinishedRequestStats] = []
        self._emitted: list[RequestOutput] = []  # outputs made outside a step, returned by the next (`abort_request`)
        self._step_count = 0
        # The features that act inside a step, called in this order in each phase (`step_parts`): those
        # built outside the engine first, in their order (`parts`, each a part or a function building one of
        # this engine), then the engine's own.
        for part in parts:
            if isinstance(part, StepPart):
                part.attach(self)
        self.parts = [p for p in (p if isinstance(p, StepPart) else p(self) for p in parts) if p is not None]
        engine_args.check_served(config, {part.serves for part in self.parts})
        step_parts.check_applied(self.parts, getattr(self.runner, "logit_parts", ())
                                 + getattr(self.runner, "forward_parts", ())
                                 + getattr(self.runner, "hidden_parts", ())
                                 + (getattr(self.runner, "sampler_part", None),))
        self.scheduler.gates += [gate for gate in (part.gate() for part in self.parts) if gate is not None]
        # What the parts take of a request beside what the engine reads itself (its sampling fields, request
        # arguments and dict-prompt keys): anything else given is refused (`make_request`).
        self._taken_fields = {field for part in self.parts for field in part.takes_fields}
        self._taken_args = {name for part in self.parts for name in part.takes_args}
        self._taken_prompt_keys = {key for part in self.parts for key in part.takes_prompt_keys}
        # Overlapped scheduling needs a runner that dispatches without waiting; a part whose next inputs follow
        # each step's tokens (speculation's drafts: `StepPart.serial`) has the steps run one at a time.
        self.overlap = config.async_scheduling and not any(p.serial for p in self.parts)
        self._in_flight: Optional[_StepInFlight] = None  # dispatched, not yet processed
        self.weight_version = self.weights_epoch = 0  # label and count of weight updates (`serving.features.weight_updates`)
        # Why the engine takes no request now (None: it does): set and cleared by whoever made it so (sleep
        # mode, `serving.features.sleep_mode`); `make_request` refuses every request meanwhile.
        self.unavailable: Optional[str] = None

    def part(self, kind: type) -> Optional[StepPart]:
        """The engine's part of class `kind` (or of a subclass of it), or None (for tests and benchmarks that
        look inside one)."""
        return next((p for p in self.parts if isinstance(p, kind)), None)

    # --- requests ------------------------------------------------------------------------------
    def make_request(self, request_id: str, prompt: PromptType, params: Optional[SamplingParams] = None,
                     arrival_time: Optional[float] = None, cache_salt: Optional[str] = None,
                     priority: int = 0, part_args: Optional[dict] = None) -> Request:
        """Validates and tokenizes a request without queueing it (thread-safe).

        `cache_salt` (or a dict prompt's "cache_salt", as vLLM's prompts carry it) isolates the
        request's prefix-cache pages: only requests with the same salt share them. `priority`: lower
        runs first under `scheduling_policy="priority"`; under "fcfs" only 0 is accepted. `part_args`:
        request arguments the parts read (`StepPart.takes_args`, e.g. the adapter a request runs with);
        one that no part takes is refused. A request made here and never queued must be
        dropped (`drop_request`): a part may hold something for it from here on.
        """
        if self.unavailable is not None:
            raise EngineUnavailableError(self.unavailable)
        params = (params or self.default_sampling_params).clone()
        params.validate(self.cfg.vocab_size)
        self._check_priority(priority)
        if isinstance(prompt, dict) and "cache_salt" in prompt:
            if cache_salt is not None and cache_salt != prompt["cache_salt"]:
                raise InvalidParameterError("cache_salt", "cache_salt: given both in the prompt and as an argument, "
                                                          "with different values")
            cache_salt = prompt["cache_salt"]
        if cache_salt is not None and not is_cache_salt(cache_salt):
            raise InvalidParameterError("cache_salt", f"cache_salt: must be a non-empty string, got {cache_salt!r}")
        text, ids = self._prompt_ids(prompt)
        ids, content = self._expand_prompt(prompt, ids, params)
        n_limit = max(N_LIMIT, self.config.max_num_seqs)
        if params.n > n_limit:
            raise InvalidParameterError("n", f"n: {params.n} samples requested; at most {n_limit} per request")
        limit = self.max_model_len
        if len(ids) >= limit:
            raise ContextLengthError("prompt", f"This model's maximum context length is {limit} tokens, and the "
                                               f"prompt has {len(ids)} tokens (at least one must be generated).")
        if params.max_tokens is None:
            params.max_tokens = min(limit - len(ids), self.default_max_tokens or limit)
        elif len(ids) + params.max_tokens > limit:
            raise ContextLengthError(
                "max_tokens", f"This model's maximum context length is {limit} tokens. However, you requested "
                              f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, "
                              f"{params.max_tokens} for the completion).")
        with self._lock:
            seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**63))
        req = Request(request_id, text, ids, params, seed, arrival_time or time.monotonic(), self.eos_token_ids,
                      cache_salt, priority, self.weights_epoch)
        req.prompt_content = content
        req.sampling_row = sampling_row(req)
        for field in params.part_fields():
            if field not in self._taken_fields:
                raise InvalidParameterError(field, f"{field}: given, but this engine runs "
                                                   f"{engine_args.FIELD_PARTS.get(field, 'no part that acts on it')}")
        req.part_args = self._part_args(part_args)
        try:
            for part in self.parts:
                part.admit(req)
        except BaseException:  # a part admitted before the one refusing it lets go of what it took
            self.drop_request(req)
            raise
        return req

    def _part_args(self, part_args: Optional[dict]) -> dict:
        """The request arguments given (None values left out), each taken by one of the engine's parts."""
        given = {name: value for name, value in (part_args or {}).items() if value is not None}
        for name, value in given.items():
            if name not in self._taken_args:
                field, why = engine_args.ARG_PARTS.get(name, (name, "is given, but no part of this engine takes it"))
                raise InvalidParameterError(field, f"{field}: {value!r} {why}")
        return given

    def _check_priority(self, priority) -> None:
        if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)) \
                or not -PRIORITY_LIMIT <= priority <= PRIORITY_LIMIT:
            raise InvalidParameterError("priority", f"priority: must be an integer in [-{PRIORITY_LIMIT}, "
                                                    f"{PRIORITY_LIMIT}], got {priority!r}")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise InvalidParameterError("priority", f"priority: {priority} given, but the server schedules "
                                                    f"'{self.config.scheduling_policy}' (start it with "
                                                    "scheduling_policy=priority to honour priorities)")

    def _expand_prompt(self, prompt, ids: list[int], params) -> tuple[list[int], object]:
        """(the prompt's ids, the content a part placed in it, or None): a dict prompt's entries beyond its text
        or ids go to the part that takes them (`StepPart.expand_prompt`: images)."""
        if not isinstance(prompt, dict):
            return ids, None
        extra = set(prompt) - PROMPT_KEYS
        for key in sorted(extra - self._taken_prompt_keys):
            raise InvalidParameterError(key, f"{key}: {engine_args.PROMPT_KEY_PARTS.get(key, 'no part takes it')}")
        content = None
        for part in self.parts:
            if extra & set(part.takes_prompt_keys):
                placed = part.expand_prompt(prompt, ids, params)
                if placed is not None:
                    if content is not None:
                        raise InvalidParameterError("prompt", "prompt: two parts placed content in one prompt")
                    ids, content = placed
        return ids, content

    def _prompt_ids(self, prompt) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, dict):
            known = PROMPT_KEYS | set(engine_args.PROMPT_KEY_PARTS) | self._taken_prompt_keys
            unknown = sorted(set(prompt) - known)
            if unknown:
                raise InvalidParameterError("prompt", f"prompt: unknown keys {unknown} in a dict prompt (it takes "
                                                      f"'prompt' or 'prompt_token_ids', 'cache_salt' and "
                                                      f"{sorted(known - PROMPT_KEYS)})")
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidParameterError("prompt", "prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidParameterError("prompt", "prompt: this model has no tokenizer; pass token ids")
            ids = self.tokenizer.encode(prompt)
            text = prompt
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
            if bad or not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt):
                raise InvalidParameterError("prompt", f"prompt: token ids must be integers in [0, "
                                                      f"{self.cfg.vocab_size}), got {bad[:5] or prompt[:5]}")
            text = None
        else:
            raise InvalidParameterError("prompt", f"prompt: expected a string or a list of token ids, "
                                                  f"got {type(prompt).__name__}")
        if not ids:
            raise InvalidParameterError("prompt", "prompt: must not be empty")
        return text, ids

    def enqueue(self, req: Request) -> None:
        if req.request_id in self.requests:
            self.drop_request(req)
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        if not any(part.enqueue(req) for part in self.parts):  # (a part may take it: a shipped prefill)
            self.scheduler.add(req.seqs[0])

    def add_request(self, request_id: str, prompt: PromptType, params: Optional[SamplingParams] = None,
                    arrival_time: Optional[float] = None, stream: bool = False,
                    cache_salt: Optional[str] = None, priority: int = 0,
                    part_args: Optional[dict] = None) -> Request:
        req = self.make_request(request_id, prompt, params, arrival_time, cache_salt, priority, part_args)
        req.stream = stream
        self.enqueue(req)
        return req

    def abort_request(self, request_ids, emit: bool = False) -> None:
        """Ends the requests at once and frees their pages; unknown ids are ignored. With `emit`, each one's
        final output (its tokens so far, finish_reason "abort") is returned by the next `step()`, for callers
        still waiting on it (a pause that aborts what runs: `serving.features.pause`)."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            for part in self.parts:
                part.abort(req)
            self.drop_request(req)
            for seq in req.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, "abort")
            self.stats_log.count_finished("abort")
            self._pending_finished.append(self._finished_stats(req, "abort", time.monotonic()))
            if emit:
                self._emitted.append(self.outputs.make_output(req))

    def has_unfinished_requests(self) -> bool:
        # A step still in flight when the last request ended holds only finished sequences:
        # the next call of `step` processes (and discards) it.
        return bool(self.requests)

    def steps_held(self) -> bool:
        """Whether a part holds the steps (generation paused, `StepPart.holds_steps`): `step()` then only
        finishes the step in flight and returns what is ready, scheduling nothing."""
        return any(part.holds_steps() for part in self.parts)

    def has_output_ready(self) -> bool:
        """Whether `step()` has something to return even with the steps held: a step in flight, or outputs
        made outside a step (`abort_request(emit=True)`)."""
        return bool(self._emitted) or self._in_flight is not None

    # --- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one scheduled batch; returns outputs of finished requests and of streaming ones that progressed.

        Four phases: schedule, pack, run, process; the parts (`self.parts`: shipped prefills,
        speculation) act in them through `step_parts.StepPart`. With overlapped scheduling
        (`EngineConfig.async_scheduling`) the call dispatches the next step before it processes
        the one dispatched by the previous call, so the host schedules and packs step t+1 while
        the device still runs step t, and the outputs returned are those of step t. The only wait
        is for step t's sampled ids. A step t to which a part gave inputs that depend on each step's
        tokens (`StepPart.results_before_next_step`: structured outputs' masks) is processed first
        instead, so that its sequences' next inputs exist and they join step t+1.
        """
        if self.steps_held():
            return self._held_step()
        t0 = time.perf_counter()
        it = IterationStats(self._step_count, 0, 0, 0, 0, 0, 0.0, 0.0, 0)
        touched: dict[str, Request] = {}  # requests with output this step
        for part in self.parts:
            part.before_schedule(touched, it)
        waited = self._process_first(it, touched)
        out = self._schedule(it, touched)
        for part in self.parts:
            part.after_schedule(out)
        launched = None if out.is_empty else self._run(self._pack(out, it))
        done = launched
        if self.overlap:
            done, self._in_flight = self._in_flight, launched
        if done is not None:
            waited += self._process(done, it, touched)
        outputs = self._take_emitted() + self._outputs(touched, it)
        for part in self.parts:
            part.after_step()
        it.host_seconds = time.perf_counter() - t0 - waited
        it.device_seconds = waited
        self._step_count += 1
        self.stats_log.record(it)
        return outputs

    def _held_step(self) -> list[RequestOutput]:
        """`step()` while a part holds the steps: the step in flight (overlapped scheduling) is processed, and
        its outputs and those made outside a step are returned; nothing is scheduled."""
        self.finish_in_flight()
        return self._take_emitted()

    def finish_in_flight(self) -> None:
        """Processes the step in flight (overlapped scheduling) now, so every sequence has its tokens on the
        host; its outputs come with the next `step()`."""
        done, self._in_flight = self._in_flight, None
        if done is not None:
            it = IterationStats(self._step_count, 0, 0, 0, 0, 0, 0.0, 0.0, 0)
            touched: dict[str, Request] = {}
            self._process(done, it, touched)
            self._emitted.extend(self._outputs(touched, it))

    def _take_emitted(self) -> list[RequestOutput]:
        emitted, self._emitted = self._emitted, []
        return emitted

    def _schedule(self, it: IterationStats, touched: dict) -> SchedulerOutput:
        """The scheduler's decisions; a sequence that can never fit the pool ends with an error."""
        out = self.scheduler.schedule()
        for seq in out.errored:
            req = seq.request
            req.error = (f"request {req.request_id} can never be scheduled: {seq.num_tokens} tokens need more than "
                         f"the {self.num_pages} pages of the KV pool")
            for s in req.seqs:  # its samples split off for want of seats too (`Sequence.split`)
                if not s.is_finished:
                    self.scheduler.finish(s, "error")
            touched[req.request_id] = req
        it.num_tokens, it.num_seqs, it.num_preemptions = out.num_batched_tokens, len(out.scheduled), len(out.preempted)
        now = time.monotonic()
        for item in out.scheduled:
            m = item.seq.request.metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
            it.num_prompt_tokens += max(0, min(item.start + item.num_new_tokens, item.seq.num_prompt_tokens)
                                        - item.start)
        return out

    def _pack(self, out: SchedulerOutput, it: IterationStats) -> "_StepInFlight":
        """The step's host inputs: pages copied first (copy-on-write), the batch packed into its bucket,
        then each part's inputs added."""
        if out.copies:
            self.runner.copy_pages(out.copies)
        previous = self._in_flight.batch.draw_rows if self._in_flight is not None else None
        batch = pack_step(out, self.block_manager.tables, self.buckets, self.config.page_size, self.num_pages,
                          previous, shape_for=self.runner.step_shape)
        for part in self.parts:
            part.pack(batch)
        batch.part_inputs = tuple(part.step_inputs(batch) for part in getattr(self.runner, "logit_parts", ()))
        it.kv_tokens_read = batch.kv_tokens
        it.bucket = (batch.shape.T, batch.shape.S, batch.shape.P)
        it.q_lens = tuple(n for _, _, _, n in batch.token_spans)
        it.kv_lens = tuple(start + n for _, _, start, n in batch.token_spans)
        return _StepInFlight(out, batch, None, self.weight_version)

    def _run(self, step: "_StepInFlight") -> "_StepInFlight":
        """Dispatches the packed step (JAX returns at once; `result()` waits)."""
        step.pending = self.runner.dispatch(step.batch)
        return step

    def _process_first(self, it: IterationStats, touched: dict) -> float:
        """Overlapped scheduling: processes the step in flight before scheduling when a part's inputs of
        it need its tokens for the next step (without them those sequences would sit out every other
        step). Returns the seconds waited for it."""
        done = self._in_flight
        if done is None or not any(inputs is not None and part.results_before_next_step for part, inputs
                                   in zip(getattr(self.runner, "logit_parts", ()), done.batch.part_inputs)):
            return 0.0
        self._in_flight = None
        return self._process(done, it, touched)

    def _process(self, done: "_StepInFlight", it: IterationStats, touched: dict) -> float:
        """Waits for a step's sampled ids and takes them into the sequences: tokens, logprobs, stops;
        returns the seconds waited."""
        t1 = time.perf_counter()
        result = done.pending.result()
        waited = time.perf_counter() - t1
        out, batch = done.out, done.batch
        sampled = result.ids[:len(batch.sample_rows)].tolist()
        for part in self.parts:  # what the step computed for the parts besides tokens (pooled hidden states)
            part.read_step(batch, result)
        new_tokens = self.scheduler.update(out, sampled)
        for part in self.parts:  # tokens the parts take (verified drafts), one at a time
            new_tokens = itertools.chain(new_tokens, part.new_tokens(out, sampled))
        now = time.monotonic()
        for seq, row, p0, p1 in batch.prompt_rows:
            if not seq.is_finished:
                self.outputs.prompt_logprobs(seq, result, row, p0, p1)
        for seq, tok, row in new_tokens:
            self.take_token(seq, tok, row, result, now, it, done.weight_version)
            touched[seq.request.request_id] = seq.request
            it.num_generation_tokens += 1
        return waited

    def _outputs(self, touched: dict, it: IterationStats) -> list[RequestOutput]:
        """Outputs of the touched requests that finished or stream; finished ones leave the engine."""
        now = time.monotonic()
        outputs = []
        for req in touched.values():
            finished = req.is_finished
            if finished:
                reason = req.error and "error" or req.seqs[0].finish_reason
                req.metrics.finished_time = now
                it.finished.append(self._finished_stats(req, reason, now))
                self.stats_log.count_finished(reason)
                if self.requests.pop(req.request_id, None) is not None:
                    self.drop_request(req)
            if finished or req.stream:
                outputs.append(self.outputs.make_output(req))
        it.finished.extend(self._pending_finished)
        self._pending_finished = []
        return outputs

    def drop_request(self, req: Request) -> None:
        """A request made by `make_request` leaves the engine (finished, aborted, or dropped before it was
        queued): each part lets go of what it holds for it (`StepPart.leave`)."""
        for part in self.parts:
            part.leave(req)

    def _finished_stats(self, req: Request, reason: str, now: float) -> FinishedRequestStats:
        m = req.metrics
        scheduled, first, last = m.first_scheduled_time, m.first_token_time, m.last_token_time
        return FinishedRequestStats(
            req.request_id, reason, now - m.arrival_time, None if scheduled is None else scheduled - m.arrival_time,
            len(req.prompt_token_ids), sum(s.num_output_tokens for s in req.seqs),
            prefill_time=None if scheduled is None or first is None else first - scheduled,
            decode_time=None if first is None or last is None else last - first,
            inference_time=None if scheduled is None or last is None else last - scheduled,
            n=req.params.n, max_tokens=req.params.max_tokens)

    def take_token(self, seq: Sequence, tok: int, row: int, result, now: float, it: IterationStats,
                   weight_version: Optional[int] = None) -> None:
        """Takes a token into its sequence's output (detokenized, stop conditions checked, the parts'
        state of it advanced): the scheduler's samples, and tokens parts bring (a shipped prefill's first
        token). `weight_version`: the weights the step that drew it ran under (default: the current)."""
        req = seq.request
        seq.weight_versions.append(self.weight_version if weight_version is None else weight_version)
        if req.part_state and not seq.is_finished:
            tok = self._replaced(seq, tok)
        if req.part_state:
            for part in self.parts:  # before a finish can free the sequence's pages
                part.before_output(seq, tok, result, row)
        self.outputs.on_token(seq, tok, row, result, now, it)
        if req.part_state and not seq.is_finished:
            for part in self.parts:
                reason = part.took_token(seq, tok)
                if reason is not None:
                    self.scheduler.finish(seq, reason)
                    break

    def _replaced(self, seq: Sequence, tok: int) -> int:
        """The sequence's last token as the parts take it (`StepPart.replace_token`: a grammar's thinking
        phase makes an ending token the end tag's); every part then hears of it (`token_replaced`: state
        the device recorded of the drawn token is stale)."""
        for part in self.parts:
            new = part.replace_token(seq, tok)
            if new != tok:
                seq.token_ids[-1] = tok = new
                for other in self.parts:
                    other.token_replaced(seq)
        return tok

    # --- outputs and stats ---------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """A snapshot of gauges and counters; safe to call from another thread."""
        running = {s.request.request_id for s in list(self.scheduler.running)}
        waiting = {s.request.request_id for s in list(self.scheduler.waiting)} - running
        log_ = self.stats_log
        return EngineStats(
            num_running=len(running), num_waiting=len(waiting),
            kv_pages_used=self.block_manager.num_used_blocks, kv_pages_total=self.num_pages,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queried_tokens=self.scheduler.prefix_queried_tokens,
            prefix_cache_hit_tokens=self.scheduler.prefix_hit_tokens,
            prompt_tokens=log_.prompt_tokens, generation_tokens=log_.generation_tokens,
            finished_by_reason=dict(log_.finished_by_reason), num_steps=log_.num_steps,
            page_size=self.config.page_size, warmup=self.runner.warmup_stats(),
            **{k: v for part in self.parts for k, v in part.engine_stats().items()})

    def warm_up(self, background: bool = False) -> dict:
        """Compiles every step shape, so serving never compiles; returns seconds and counts. With
        `background` only the smallest and the largest compile before this returns, the rest in a
        thread while the engine serves (`serving.compilation.step_programs`; option `quick_warmup_compile`);
        a draft model's drafting shapes compile before this returns."""
        info = self.runner.warm_up(background=background, quick=background and self.config.quick_warmup_compile)
        for part in self.parts:
            own = part.warm_up()
            info.update(seconds=info["seconds"] + own["seconds"], compiled=info["compiled"] + own["compiled"],
                        shapes=info["shapes"] + own["shapes"])
        return info

    def warm_up_as_needed(self) -> None:
        """Compiles in the background what calls will need (`expect`); returns at once
        (`StepPrograms.start_as_needed`). A draft model's drafting programs compile on first use."""
        self.runner.warm_up_as_needed()

    def expect(self, requests) -> None:
        """`requests` are about to run together: their step buckets compile first (`warm_up_as_needed`)."""
        rows = max([1] + [p.rows_per_decode() for p in self.parts])  # a decode's rows (1 + its proposals)
        self.runner.expect([(len(r.prompt_token_ids), r.params.max_tokens or 1, r.params.n) for r in requests],
                           rows_per_seq=rows)

    def end_call(self) -> None:
        """The requests of the last `expect` are done: under `warm_up_as_needed` the buckets their steps were
        padded out of compile once the engine idles (`StepPrograms.end_call`)."""
        self.runner.end_call()

    def stop_warm_up(self) -> None:
        """Ends a background warm-up after the compile under way (before the process exits)."""
        self.runner.stop_warm_up()

    def describe(self) -> dict:
        """What is loaded and how big the KV pool is (for startup logs and MBU/MFU arithmetic)."""
        cfg, ps = self.cfg, self.config.page_size
        kv_per_token = kv_bytes_per_token(cfg, self.cache_dtype)
        described = {
            "num_params": num_params(cfg), "param_bytes": getattr(self.runner, "param_bytes", None),
            "kv_bytes_per_token": kv_per_token, "kv_pages": self.num_pages, "page_size": ps,
            "kv_pool_tokens": self.num_pages * ps, "kv_pool_bytes": self.num_pages * ps * kv_per_token,
            "max_model_len": self.max_model_len, "max_num_seqs": self.config.max_num_seqs,
            "max_num_batched_tokens": self.config.max_num_batched_tokens,
            "prefix_caching": self.config.enable_prefix_caching, "attention_backend": self.config.attention_backend,
            "step_shapes": len(self.buckets.all_shapes()),
            "weight_dtype": cfg.weight_dtype or cfg.dtype, "kv_cache_dtype": str(np.dtype(self.cache_dtype)),
            "speculative_method": None, "num_speculative_tokens": 0,  # (the speculation part fills them in)
            "kv_offload_pages": 0, "kv_offload_bytes": 0,  # (the host KV tier's part fills them in)
            "preemption_mode": self.config.preemption_mode,
        }
        for part in self.parts:
            described.update(part.describe())
        return described

    def reset_prefix_cache(self) -> int:
        """Forgets the cached pages no sequence holds, on the device and in the parts that cache them (the host
        KV tier); returns how many device pages."""
        for part in self.parts:
            part.reset_prefix_cache()
        return self.block_manager.reset_prefix_cache()


class _StepInFlight:
    """A packed step, once dispatched its pending results (`PendingStep`), and what processing needs."""

    __slots__ = ("out", "batch", "pending", "weight_version")

    def __init__(self, out: SchedulerOutput, batch, pending, weight_version: int = 0):
        self.out, self.batch, self.pending = out, batch, pending
        self.weight_version = weight_version  # the weights the step runs under (an update may land before it is processed)
