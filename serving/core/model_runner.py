"""Owns the model on the device: params, the paged KV cache, and the one jitted step.

The step is `forward + sampling` over a flattened ragged batch, compiled once
per bucket (see `input_batch.Buckets`), with the cache donated so each layer's
K/V update is in place. Only the sampled ids (and logprobs when a request
asked for them) come back to the host.

Device placement of params and cache happens in exactly one place,
`ModelRunner.place`. Tensor parallelism plugs in through `layout`: any object
with `param_shardings(cfg)`, `cache_shardings(cfg, num_pages, page_size,
dtype)`, `replicated` (the sharding of host inputs) and what `model.forward`
accepts as its `layout` (`sharding.Layout` is one). With `layout=None`
everything lives on the default device and no sharding code runs. A layout
with a `forward` method of its own (`sharding.pipeline.PipelineLayout`) runs
the model through it instead, over the staged params and cache it places
itself (`stage_params`, `init_cache`, `sharding.pipeline.copy_staged_pages`);
everything around the forward is the same step.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from model.cache import BatchMetadata, StackedKVCache, cache_builder, cache_bytes
from model.config import ModelConfig
from model.forward import forward, forward_with_hidden
from model.layer_select import selects_layers
from model.params import param_bytes, stack_layers
from sharding.pipeline import copy_staged_pages
from serving.compilation import table
from serving.compilation.step_programs import StepPrograms
from serving.core import bucket_plan, placement, step_parts
from serving.core.input_batch import Buckets, StepShape, StepBatch
from serving.core.sampler import SamplingInputs, filtered_logits, sample
from serving.core.sampling_table import ROW_PARAMS


def unpack_step(v: dict) -> tuple[BatchMetadata, SamplingInputs]:
    """The batch metadata and sampling inputs inside a step's split buffers (`StepShape.split`)."""
    md = BatchMetadata(positions=v["positions"], slot_mapping=v["slots"], cu_q_lens=v["cu_q_lens"],
                       kv_lens=v["kv_lens"], block_tables=v["block_tables"], num_seqs=v["num_seqs"][0],
                       logits_indices=v["logits_indices"])
    flags = v["flags"]
    params = {p.name: v[p.name] if p.device_dtype is None else jax.lax.bitcast_convert_type(v[p.name], p.device_dtype)
              for p in ROW_PARAMS}
    s = SamplingInputs(
        **params, sample_index=v["sample_index"], token_index=v["token_index"], target=v["target"],
        any_random=flags[0] != 0, any_filter=flags[1] != 0, want_logprobs=flags[2] != 0,
    )
    return md, s


def feed_tokens(tokens, feed_rows, feed):
    """The step's input tokens, with the placeholders filled in from the previous step's samples.

    `feed_rows[i] >= 0` marks token i as the id sampled in row `feed_rows[i]` of the step
    dispatched just before this one (`feed`), which the host has not seen yet (see
    `serving.core.engine`'s overlapped scheduling); -1 keeps the host's token."""
    return jnp.where(feed_rows >= 0, feed[jnp.maximum(feed_rows, 0)], tokens)


def _step(params, cache, ibuf, fbuf, feed=None, part_states=(), device_input=None, weight_states=(),
          part_inputs=(), *, cfg: ModelConfig, backend: str, shape: StepShape, layout=None, sampler_part=None,
          forward_parts: tuple = (), logit_parts: tuple = (), processed_logprobs: bool = False,
          hidden_parts: tuple = ()):
    """One engine step: forward over the ragged batch, then each logit row's token.

    Every feature a row can need is an input of this one program:
    * `feed` (the previous step's sampled ids, [max rows]): placeholder tokens are filled from it
      (overlapped scheduling), and this step's ids come back padded the same way;
    * a decode with k proposed tokens (`Scheduler.set_proposals`) has k + 1 rows, the step's
      `proposed_token` / `group_start` fields saying what each follows, and the parts of row j see
      proposals 0..j-1 as already drawn (`step_parts.StepView.proposals`); the one part that samples
      instead of the runner (`sampler_part`: speculative decoding's verification) draws the ids, reading
      `device_input`, an array its own device programs made (`StepPart.device_input_spec`);
    * the step parts `forward_parts` act before the forward, each reading the step's packed fields (its
      own token fields among them): `apply_to_inputs` adds to the batch metadata and the forward's inputs
      (a vision-language model's image rows and multimodal positions), `apply_to_weights` adapts the
      weights with the part's device state `weight_states[i]` (`step_parts.StepPart.weight_state`: LoRA
      adapter slots; None for a part without one);
    * `part_inputs[i]`, the device inputs of the step part `logit_parts[i]` (`step_parts.StepPart.
      step_input_spec`), which its `apply_to_logits` applies to the logits in the parts' order, and
      `part_states[i]` its device state carried across steps (`StepPart.step_state`, None for none),
      which it updates from the drawn ids (`record`) and the step returns;
    * the step parts `hidden_parts` read every row's final hidden state (`step_parts.StepPart.hidden_output`:
      pooled embeddings), and the step returns what each made of it, left on the device until read.
    """
    v = shape.split(ibuf, fbuf)
    md, s = unpack_step(v)
    tokens = v["tokens"] if feed is None else feed_tokens(v["tokens"], v["feed_rows"], feed)
    extra = {}  # the forward's keyword arguments the parts add
    for part, state in zip(forward_parts, weight_states, strict=True):
        md, more = part.apply_to_inputs(v, md)
        extra.update(more)
        params, more = part.apply_to_weights(state, v, params, layout)
        extra.update(more)
    hidden_outputs = ()
    if hasattr(layout, "forward") and hidden_parts:  # pipeline stages sharing every row's hidden state
        logits, hidden, cache = layout.forward(params, cache, tokens, md, cfg, backend, with_hidden=True, **extra)
        hidden_outputs = tuple(part.hidden_output(hidden, md) for part in hidden_parts)
    elif hasattr(layout, "forward"):  # a layout with a forward of its own (pipeline stages)
        logits, cache = layout.forward(params, cache, tokens, md, cfg, backend, **extra)
    elif hidden_parts:
        logits, hidden, cache = forward_with_hidden(params, cache, tokens, md, cfg, backend, layout, **extra)
        hidden_outputs = tuple(part.hidden_output(hidden, md) for part in hidden_parts)
    else:
        logits, cache = forward(params, cache, tokens, md, cfg, backend, layout, **extra)
    raw = logits  # logprobs report the model's own distribution, as vLLM's do
    proposals = None if sampler_part is None else step_parts.Proposals(v["proposed_token"], v["group_start"])
    views = [step_parts.StepView(s.token_index, s, proposals, state) for state in part_states]
    for part, inputs, view in zip(logit_parts, part_inputs, views, strict=True):
        logits = part.apply_to_logits(inputs, logits, view)
    if processed_logprobs:  # the distribution each row draws from (`logprobs_mode`)
        raw = jnp.where((s.temperature > 0)[:, None], filtered_logits(logits, s), logits)
    if sampler_part is not None:
        ids, logprobs = sampler_part.sample(logits, raw, step_parts.StepView(s.token_index, s, proposals), v,
                                            device_input)
    else:
        ids, logprobs = sample(logits, s, raw)
    part_states = tuple(part.record(inputs, view.state, ids, view)
                        for part, inputs, view in zip(logit_parts, part_inputs, views))
    if getattr(layout, "replicated", None) is not None:  # placed as they came: replicated
        part_states = jax.lax.with_sharding_constraint(part_states, layout.replicated)
    if feed is None:
        return cache, ids, logprobs, None, part_states, hidden_outputs
    next_feed = jax.lax.dynamic_update_slice(jnp.zeros_like(feed), ids[:feed.shape[0]], (0,))
    if getattr(layout, "replicated", None) is not None:  # the sharding the feed was placed with
        next_feed = jax.lax.with_sharding_constraint(next_feed, layout.replicated)
    return cache, ids, logprobs, next_feed, part_states, hidden_outputs


# Module level, so engines with the same model and buckets share compilations.
_step_jit = jax.jit(_step, static_argnames=("cfg", "backend", "shape", "layout", "sampler_part", "forward_parts",
                                            "logit_parts", "processed_logprobs", "hidden_parts"),
                    donate_argnums=(1, 5))


def _copy_pages(cache, src, dst):
    """Copies whole pages src[i] -> dst[i] in every layer; the pairs come first, then padding
    (dst == num_pages), which is never visited.

    One program for any number of pairs up to the buffers' length: a loop over the real pairs,
    each copying its page in every layer (its cost follows the pairs, not the padding). Every
    cache leaf (pages, and the scales of a quantized cache) is indexed by page first; a
    `StackedKVCache` holds layer l's page p at row `l * num_pages + p`."""
    if isinstance(cache, StackedKVCache):
        pages = cache.num_pages
        rows = jnp.arange(cache.num_layers, dtype=src.dtype) * pages
    else:
        pages = jax.tree.leaves(cache)[0].shape[0]
        rows = jnp.zeros((1,), src.dtype)

    def copy_one(i, cache):
        return jax.tree.map(lambda x: x.at[rows + dst[i]].set(x[rows + src[i]]), cache)

    return jax.lax.fori_loop(0, jnp.sum(dst < pages), copy_one, cache)


def _page_arrays(cache) -> list:
    """The cache's K and V page arrays: every layer's K then V, or the stacked K and V."""
    return [cache.k, cache.v] if isinstance(cache, StackedKVCache) else list(cache.k) + list(cache.v)


_copy_jit = jax.jit(_copy_pages, donate_argnums=(0,))
_copy_staged_jit = jax.jit(copy_staged_pages, static_argnames=("layout",), donate_argnums=(0,))


def compilation_count() -> int:
    """Executables compiled so far for the step and page-copy functions (all runners)."""
    return (_step_jit._cache_size() + _copy_jit._cache_size() + _copy_staged_jit._cache_size()
            + step_parts.state_programs_compiled()
            + table.compiled_total())


# What `ModelRunner._program_key` holds, in order: `StepPrograms.why` names a recompile's cause by these.
PROGRAM_KEY_FIELDS = ("program", "model config", "attention backend", "layout", "bucket", "step parts' sampler",
                      "argument signature (tree, then shape, dtype and sharding of each leaf)", "logprobs mode",
                      "step parts' weight adaptations", "step parts' device inputs", "step parts' hidden outputs")


class StepResult:
    """The host copy of what one step produced; `hidden_outputs`: what each hidden part made of the step's hidden
    states (`step_parts.StepPart.hidden_output`), still on the device: a part copies what it reads."""

    __slots__ = ("ids", "chosen_logprob", "rank", "top_ids", "top_logprobs", "kept", "hidden_outputs")

    def __init__(self, ids, lp=None, hidden_outputs=()):
        self.ids = ids
        self.hidden_outputs = hidden_outputs
        if lp is None:
            self.chosen_logprob = self.rank = self.top_ids = self.top_logprobs = self.kept = None
        else:
            self.chosen_logprob, self.rank, self.top_ids, self.top_logprobs, self.kept = lp


class PendingStep:
    """A dispatched step whose outputs are still on the device."""

    __slots__ = ("_ids", "_lp", "_hidden")

    def __init__(self, ids, lp=None, hidden_outputs=()):
        self._ids, self._lp, self._hidden = ids, lp, hidden_outputs

    def result(self) -> StepResult:
        """Waits for the step and copies the sampled ids (and logprobs when asked) to the host."""
        lp = None if self._lp is None else tuple(np.asarray(x) for x in self._lp)
        return StepResult(np.asarray(self._ids), lp, self._hidden)


class ModelRunner:
    def __init__(self, cfg: ModelConfig, params, *, num_pages: int, page_size: int, buckets: Buckets,
                 backend: str = "auto", cache_dtype=None, layout=None,
                 scan_layers: bool = False, sampler_part=None, forward_parts: tuple = (),
                 logit_parts: tuple = (), processed_logprobs: bool = False, hidden_parts: tuple = ()):
        """`scan_layers`: stack the
        layers' weights and KV pages so the step scans over layers (`model.forward`), compiling one
        layer body whatever the depth. `sampler_part`: the step part that samples instead of the runner
        (`step_parts.StepPart.sample`: speculative verification), with its device input. `forward_parts`: the
        step parts that act before the forward in every step (`step_parts.forward_parts`), each with its
        device state adapting the weights (`StepPart.weight_state`, None for none).
        `logit_parts`: the step parts whose own device inputs every step takes (`step_parts.StepPart.
        step_input_spec`), applied to the logits in this order, with their device state (`step_state`).
        `hidden_parts`: the step parts that read the final hidden states back (`StepPart.hidden_output`)."""
        self.cfg = cfg
        self.scan_layers = scan_layers
        self.sampler_part = sampler_part
        self.processed_logprobs = processed_logprobs  # logprobs of the drawn distribution (`logprobs_mode`)
        self.num_pages = num_pages
        self.page_size = page_size
        self.buckets = buckets
        self.backend = backend
        self.layout = layout
        self._staged = getattr(layout, "pipeline_parallel_size", 1) > 1  # pipeline stages place their own state
        self.logit_parts = tuple(logit_parts)
        self.forward_parts = tuple(forward_parts)
        self.hidden_parts = tuple(hidden_parts)
        self._small_programs: dict = {}  # executables of the cache's zeroing, the page copies, the parts' state writes
        self.params, self.cache = self.place(params, cache_dtype)
        # The last step's sampled ids, padded to the most logit rows a step has: the next step
        # reads its placeholder tokens from it (`feed_tokens`) without a trip through the host.
        self.feed = self._place_feed(np.zeros(buckets.max_num_seqs, np.int32))
        self.max_copy_pairs = buckets.max_num_seqs  # copy-on-write pairs per call of the page copy (`_copy_pages`)
        self._idle_inputs: dict = {}  # rows -> each logit part's idle inputs, on the device (`_place_part_inputs`)
        self.programs = StepPrograms(self._lower_step, self._program_key, platform=jax.default_backend(),
                                     key_fields=PROGRAM_KEY_FIELDS,
                                     holds_cheaply=functools.partial(bucket_plan.holds_cheaply, buckets=buckets))
        # The sampler part's device input a step without one reads (zeros of its shape; None: it takes none).
        spec = None if sampler_part is None else sampler_part.device_input_spec()
        self.no_device_input = None if spec is None else self._place_feed(np.zeros(spec.shape, spec.dtype))
        # The logit parts' device states, threaded through every step: placed like the feed (on the one
        # device, or replicated over the layout's mesh).
        self.part_states = tuple(None if (state := p.step_state()) is None else self._place_feed(state)
                                 for p in self.logit_parts)
        # The forward parts' weight states, inputs of every step (placed by each part; None: none).
        self.weight_states = tuple(p.weight_state(cfg, self.params, self.layout) for p in self.forward_parts)
        # The name each state program's executable is kept under (`update_part_state`), taken once.
        self._state_program_names = {jitted: name for _, jitted, name, _ in self._state_programs()}

    # --- placement: the one hook for shardings -----------------------------------------------
    def place(self, params, cache_dtype=None):
        """Puts params and a fresh (zeroed) KV cache on the device(s) of `self.layout`. Pipeline stages place
        their own: `StagedWeights`, and per stage-local layer one page array split over `pipeline` (the block
        manager's page ids are the same on every stage, each holding them for its own layers)."""
        if self._staged:
            return (self.layout.stage_params(self.cfg, params),
                    self.layout.init_cache(self.cfg, self.num_pages, self.page_size, cache_dtype))
        if self.layout is None:
            params = jax.device_put(params, jax.devices()[0])
            cache_shardings = None
        else:
            params = jax.device_put(params, self.layout.param_shardings(self.cfg))
            cache_shardings = self.layout.cache_shardings(self.cfg, self.num_pages, self.page_size, cache_dtype)
        if self.scan_layers:
            if not selects_layers(params.layers, jax.default_backend()):  # else the scan picks per-layer arrays
                shardings = None if self.layout is None else placement.stacked_shardings(params.layers[0])
                params = stack_layers(params, shardings)
            if cache_shardings is not None:  # one layer's page sharding covers the stacked pages too
                cache_shardings = StackedKVCache(cache_shardings.k[0], cache_shardings.v[0], self.cfg.num_layers)
        # Zeroed by a program the store keeps (its argument-free signature says nothing: the name says what).
        build = cache_builder(self.cfg, self.num_pages, self.page_size, cache_dtype, cache_shardings, self.scan_layers)
        name = repr(("init-cache", self.cfg, self.num_pages, self.page_size, str(cache_dtype), self.scan_layers,
                     cache_shardings))
        cache = table.call(build, name, self._small_programs)
        if self.layout is None:  # committed like the step's output, or the first step shape compiles twice
            cache = jax.device_put(cache, jax.devices()[0])
        return params, cache

    # --- device calls: every one passes through _run or _copy ----------------------------------
    # Multi-host serving (serving.cluster.multihost) plugs in here: `dispatch_hook(kind, *host_arrays, **static)`
    # sees each device call with its host inputs before it is dispatched, so process 0 can send it to
    # the other processes, which run it with `replay`. When the mesh spans processes, host inputs
    # become global arrays.
    dispatch_hook = None

    def _place_feed(self, feed: np.ndarray):
        """The feed where the step leaves it: committed to the one device, or replicated."""
        if self.layout is None:
            return jax.device_put(feed, jax.devices()[0])
        return self._host_inputs(feed)[0]

    def _host_inputs(self, *arrays):
        """Host arrays as the jitted calls' inputs: with a layout, one fixed replicated sharding (so
        nothing recompiles for it), as global arrays when the mesh spans several processes."""
        if self.layout is None:
            return arrays
        sharding = self.layout.replicated
        if sharding.is_fully_addressable:
            return jax.device_put(arrays, sharding)
        # Each leaf (a pytree such as a part's state has several) as a global array built from this
        # process's copy.
        return jax.tree.map(lambda a: jax.make_array_from_process_local_data(sharding, a, np.shape(a)), arrays)

    def replay(self, kind: str, *arrays, **static):
        """Runs a device call another process announced through its `dispatch_hook`; returns its
        outputs (not waited for). Kinds of other packages' calls go to the handler they registered
        (`register_replay`)."""
        handler = (self._replay_handlers or {}).get(kind)
        if handler is not None:
            return handler(*arrays, **static)
        if kind == "step":  # (ibuf, fbuf, *given parts' input leaves); the device input: this process's own
            probs = (self._step_inputs or {})["device_input"]() if static.get("device_input") else None
            inputs = step_parts.inputs_from_leaves(self.logit_parts, static["shape"].S, arrays[2:],
                                                   static.get("idle_parts", ()))
            return self._run(*arrays[:2], static["shape"], probs, inputs)
        if kind == "copy":
            return self._copy(*arrays)
        if kind == "part-state":  # (the part's index, *host arguments of its program)
            part = (self.logit_parts + self.forward_parts)[int(arrays[0])]
            self.update_part_state(part, placement.program(static["program"]), *arrays[1:])
            return self.part_states, self.weight_states
        if kind == "cache":  # a program of another package over the cache (`run_on_cache`)
            static = dict(static)
            return self.run_on_cache(placement.program(static.pop("program")), *arrays, **static)
        raise ValueError(f"unknown device call {kind!r}")

    def announce(self, kind: str, *host_arrays, **static) -> None:
        """Multi-host: shows a device call to the dispatch hook (process 0 sends it to the other processes)
        before it is dispatched; nothing without a hook. For device calls made outside the runner (a draft
        model's drafting), whose replay on the other processes is the handler registered for `kind`."""
        if self.dispatch_hook is not None:
            self.dispatch_hook(kind, *host_arrays, **static)

    # What other packages plug into replay (a draft model): kind -> handler(*host_arrays, **static), running
    # this process's copy of an announced call; name -> source() of a device input a replayed step reads
    # ("device_input": what this process's own part left for the step: its draft model's distributions).
    _replay_handlers: dict = None
    _step_inputs: dict = None

    def register_replay(self, kind: str, handler, step_inputs: dict = None) -> None:
        """Replays announced calls of `kind` with `handler` on this process; `step_inputs` (name -> source)
        are the device inputs the calls leave for a replayed step."""
        if kind in ("step", "copy", "part-state", "cache"):
            raise ValueError(f"{kind!r} is the runner's own kind of device call")
        self._replay_handlers = {**(self._replay_handlers or {}), kind: handler}
        self._step_inputs = {**(self._step_inputs or {}), **(step_inputs or {})}

    def _copy(self, src, dst):
        if self.dispatch_hook is not None:
            self.dispatch_hook("copy", src, dst)
        if self._staged:
            self.cache = _copy_staged_jit(self.cache, *self._host_inputs(src, dst), layout=self.layout)
        else:
            self.cache = table.call(_copy_jit, "copy-pages", self._small_programs, self.cache,
                                    *self._host_inputs(src, dst))
        return self.cache

    def _run(self, ibuf, fbuf, shape, device_input=None, part_inputs=None):
        """Dispatches one step; `part_inputs`: each logit part's host inputs, None for a part that gave none
        (all None: warm-up's empty batches)."""
        part_inputs = part_inputs or (None,) * len(self.logit_parts)
        if self.dispatch_hook is not None:
            # The sampler part's device input: each process's own (its part replayed the call that made it).
            reads = {} if device_input is None or device_input is self.no_device_input else {"device_input": True}
            idle = tuple(i for i, inputs in enumerate(part_inputs) if inputs is None)
            if idle:
                reads["idle_parts"] = idle
            self.dispatch_hook("step", ibuf, fbuf, *jax.tree.leaves(part_inputs), shape=shape, **reads)
        ibuf, fbuf = self._host_inputs(ibuf, fbuf)
        args = (self.params, self.cache, ibuf, fbuf, self.feed, self.part_states,
                self.no_device_input if device_input is None else device_input, self.weight_states,
                self._place_part_inputs(part_inputs, shape.S))
        # One compile path: a mesh spanning processes compiles here too, every process in the order of
        # the steps it runs (no background thread there, and no executables stored: `warm_up`).
        self.cache, ids, lp, self.feed, self.part_states, hidden = self.programs.get(shape)(*args)
        return ids, lp, hidden

    def _place_part_inputs(self, part_inputs: tuple, rows: int) -> tuple:
        """The logit parts' host arrays placed as every host input is (`step_parts.StepPart.step_inputs`);
        a part that gave none gets its idle inputs, placed once per row bucket and kept on the device (no
        transfer, and placed as given ones are, so nothing recompiles)."""
        if not self.logit_parts:
            return ()
        if rows not in self._idle_inputs:
            idle = tuple(p.idle_inputs(rows) for p in self.logit_parts)
            self._idle_inputs[rows] = (jax.device_put(idle, jax.devices()[0]) if self.layout is None
                                       else self._place_given(idle))
        given = self._place_given(tuple(x for x in part_inputs if x is not None))
        it = iter(given)
        return tuple(idle if x is None else next(it) for x, idle in zip(part_inputs, self._idle_inputs[rows]))

    def _place_given(self, inputs: tuple) -> tuple:
        leaves, tree = jax.tree.flatten(inputs)
        return jax.tree.unflatten(tree, list(self._host_inputs(*leaves)))

    def _abstract_inputs(self, shape: StepShape):
        """What the step of `shape` is compiled for: the shapes, dtypes and shardings of its arguments
        (taken once, so a compile in another thread never touches arrays a running step donates)."""
        if self._specs is None:
            self._specs = placement.specs_of((self.params, self.cache, self.feed, self.part_states,
                                              self.no_device_input, self.weight_states))
        params, cache, feed, states, no_device_input, weights = self._specs
        sharding = None if self.layout is None else self.layout.replicated
        (_, isize), (_, fsize) = shape.offsets(shape.int_fields), shape.offsets(shape.float_fields)
        ibuf = jax.ShapeDtypeStruct((isize,), np.int32, sharding=sharding)
        fbuf = jax.ShapeDtypeStruct((fsize,), np.float32, sharding=sharding)
        placed = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])  # device inputs made on the host
        parts = step_parts.input_specs(self.logit_parts, shape.S, placed)
        return params, cache, ibuf, fbuf, feed, states, no_device_input, weights, parts

    def _lower_step(self, shape: StepShape):
        return _step_jit.lower(*self._abstract_inputs(shape), cfg=self.cfg, backend=self.backend, shape=shape,
                               layout=self.layout, sampler_part=self.sampler_part, forward_parts=self.forward_parts,
                               processed_logprobs=self.processed_logprobs,
                               logit_parts=self.logit_parts, hidden_parts=self.hidden_parts)

    def _program_key(self, shape: StepShape):
        """Everything the step program of `shape` depends on (`PROGRAM_KEY_FIELDS` names each part)."""
        params, cache, _, _, feed, states, no_device_input, weights, _ = self._abstract_inputs(shape)
        if self._signature is None:
            leaves, treedef = jax.tree.flatten((params, cache, feed, states, no_device_input, weights))
            self._signature = (treedef, tuple((x.shape, x.dtype, x.sharding) for x in leaves))
        return ("step", self.cfg, self.backend, self.layout, shape,
                None if self.sampler_part is None else self.sampler_part.program_key(), self._signature,
                self.processed_logprobs,
                tuple(part.program_key() for part in self.forward_parts),
                tuple(part.program_key() for part in self.logit_parts),
                tuple(part.program_key() for part in self.hidden_parts))

    _specs = None
    _signature = None

    def step_shape(self, shape: StepShape) -> StepShape:
        """The bucket a step of `shape` runs in: its own, or a larger compiled one while warm-up goes on."""
        return self.programs.shape_for(shape)

    def warmup_stats(self):
        return self.programs.stats()

    def stop_warm_up(self) -> None:
        self.programs.stop()

    # --- the parts' device states (step_parts.StepPart.step_state, weight_state) ---------------------
    def update_part_state(self, part, jitted, *host_args) -> None:
        """Runs `jitted(state, *host_args) -> state` (one of `part.state_programs()`) on the part's device
        state, before the next step reads it; a forward part's new state keeps its old shardings. Data only:
        no step recompiles. Multi-host: announced like every device call (the part's index among the logit
        parts then the forward parts, then the arguments), replayed by `replay`."""
        index = (self.logit_parts + self.forward_parts).index(part)
        if self.dispatch_hook is not None:
            self.dispatch_hook("part-state", np.int32(index), *host_args, program=placement.program_ref(jitted))
        old = self._part_state(part)
        state = table.call(jitted, self._state_program_names[jitted], self._small_programs,
                           old, *self._host_inputs(*host_args))
        if part in self.forward_parts:
            i = self.forward_parts.index(part)
            state = jax.device_put(state, jax.tree.map(lambda x: x.sharding, old))  # (a no-op where it kept them)
            self.weight_states = self.weight_states[:i] + (state,) + self.weight_states[i + 1:]
        else:
            self.part_states = self.part_states[:index] + (state,) + self.part_states[index + 1:]

    def _part_state(self, part):
        """The device state of a logit part (`step_state`) or a forward part (`weight_state`)."""
        if part in self.forward_parts:
            return self.weight_states[self.forward_parts.index(part)]
        return self.part_states[self.logit_parts.index(part)]

    # --- giving device memory back between uses (`serving.features.sleep_mode`) ----------------------
    # The arrays are let go, not deleted: memory returns once nothing else holds them (a trainer that shares
    # the engine's weights keeps its own). They come back with the same shapes, dtypes and shardings, so no
    # step program compiles again.
    _released_weights = None  # (specs, host copy or None) while the weights are released
    _released_cache = None  # the cache's specs while it is released

    def release_weights(self, keep_host_copy: bool) -> None:
        """Lets the weights' device arrays go, keeping a host copy (`restore_weights` puts it back) or not (they
        come back as zeros, for the caller to replace with `update_weights`)."""
        if self.params is None:
            return
        host = jax.device_get(self.params) if keep_host_copy else None
        self._released_weights = (placement.specs_of(self.params), host)
        self.params = None

    def restore_weights(self) -> bool:
        """Places the released weights again; returns whether their contents came back (False: zeros)."""
        if self._released_weights is None:
            return True
        specs, host = self._released_weights
        shardings = jax.tree.map(lambda s: s.sharding, specs)
        self.params = placement.zeros_like(specs) if host is None else jax.device_put(host, shardings)
        self._released_weights = None
        return host is not None

    def release_cache(self) -> None:
        """Lets the KV pool's device arrays go (its contents are lost: the caller forgets what it cached)."""
        if self.cache is not None:
            self._released_cache = placement.specs_of(self.cache)
            self.cache = None

    def restore_cache(self) -> None:
        """A zeroed KV pool of the released one's shapes and shardings."""
        if self._released_cache is not None:
            self.cache, self._released_cache = placement.zeros_like(self._released_cache), None

    @property
    def param_bytes(self) -> int:
        return param_bytes(self.params)

    @property
    def cache_bytes(self) -> int:
        return cache_bytes(self.cache)

    @property
    def kv_dtype(self):
        """The dtype K and V pages are stored in (int8 / fp8 for a quantized cache)."""
        leaf = _page_arrays(self.cache)[0]
        return (leaf["data"] if isinstance(leaf, dict) else leaf).dtype

    @property
    def replicated(self):
        """Where a small model that follows this one (a draft model) lives: the one device, or
        replicated over the layout's mesh, so its outputs feed this runner's calls as they are."""
        return jax.devices()[0] if self.layout is None else self.layout.replicated

    def set_dispatch_hook(self, hook) -> None:
        """Multi-host serving: `hook(kind, *host_arrays, **static)` sees every device call first."""
        self.dispatch_hook = hook

    def _spans_processes(self) -> bool:
        return self.layout is not None and not self.layout.replicated.is_fully_addressable

    # --- execution ---------------------------------------------------------------------------
    def dispatch(self, batch: StepBatch) -> "PendingStep":
        """Starts one step and returns at once (JAX dispatches asynchronously); the host
        may do other work until it calls `result()`, the one synchronisation point."""
        ids, lp, hidden = self._run(batch.ibuf, batch.fbuf, batch.shape, batch.device_input,
                                    batch.part_inputs or None)
        return PendingStep(ids, lp if batch.want_logprobs else None, hidden)

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicates pages on device before the step that writes them."""
        size = self.max_copy_pairs
        for i in range(0, len(copies), size):
            chunk = copies[i:i + size]
            src = np.zeros(size, np.int32)
            dst = np.full(size, self.num_pages, np.int32)
            src[:len(chunk)] = [c[0] for c in chunk]
            dst[:len(chunk)] = [c[1] for c in chunk]
            self._copy(src, dst)

    # --- programs of other packages over the cache (KV transfer) ---------------------------------
    def run_on_cache(self, jitted, *host_arrays, donate: bool, **static):
        """Runs `jitted(cache, *inputs, **static)` over the KV cache: how code outside the runner reads or
        writes the pool (`serving.disaggregation.kv_transfer` gathers and scatters pages with it) while the
        runner alone places, donates and keeps it. Returns the program's outputs (not waited for).

        `host_arrays` are placed as every device call's inputs are (`_host_inputs`). Without `donate` the
        program reads the cache and returns what it computed. With `donate` it must donate its first
        argument and return `(new cache, outputs)`; the runner keeps the new cache and returns `outputs`.
        Such a program also gets `cache_shardings` (static: every cache leaf's sharding in `jax.tree.leaves`
        order, None without a layout) and constrains its new cache to them, so the next step's inputs
        match its executable.

        On a mesh over several processes the call is announced with its host arrays (kind "cache"; `jitted`
        must be a module-level name, which the other processes import), so every process runs it on its own
        shards; what a program that does not donate returns comes back replicated, so process 0 can read
        it from its own devices (a gather's pages, for KV export)."""
        if self.dispatch_hook is not None:
            self.dispatch_hook("cache", *host_arrays, program=placement.program_ref(jitted), donate=donate, **static)
        inputs = self._host_inputs(*host_arrays)
        if not donate:
            outputs = jitted(self.cache, *inputs, **static)
            return placement.replicate(self.layout.replicated)(outputs) if self._spans_processes() else outputs
        shardings = None if self.layout is None else tuple(x.sharding for x in jax.tree.leaves(self.cache))
        self.cache, outputs = jitted(self.cache, *inputs, cache_shardings=shardings, **static)
        return outputs

    def warm_up(self, background: bool = False, start_thread: bool = True, quick: bool = False) -> dict:
        """Compiles every bucket, and the page copies; returns what it did. With `background`, only
        the smallest and the largest bucket compile now and the rest in a thread (`step_programs`;
        `start_thread=False` leaves it to `programs.start_background()`); steps meanwhile run in the
        smallest compiled bucket that holds them. `quick`: the smallest compiles quickly first, and
        fully in the thread before the rest."""
        t0 = time.perf_counter()
        before = self.compilation_count()
        if self._spans_processes():  # processes compile together, as they run: every bucket, now
            shapes = self._warm_up_shapes(self._run)
            return {"seconds": time.perf_counter() - t0, "compiled": self.compilation_count() - before,
                    "shapes": shapes, "background": 0}
        info = self.programs.warm_up(self.warm_up_order(), background=background, start_thread=False, quick=quick)
        if info["background"] and table.store("small") is not None:
            calls = self._small_program_calls()  # their argument shapes, taken now: the thread runs nothing
            self.programs.first_in_background(
                lambda: [table.prepare(jitted, name, self._small_programs, *args) for jitted, name, args in calls])
        else:
            self._warm_up_small_programs()
        jax.block_until_ready(self.cache)
        if start_thread and info["background"]:  # after any small programs run here: a tracing thread would slow them
            self.programs.start_background()
        info.update(seconds=time.perf_counter() - t0, compiled=self.compilation_count() - before,
                    shapes=info["shapes"] + 1)  # and the page copy
        return info

    def warm_up_as_needed(self) -> None:
        """Starts compiling in the background what calls will need (`StepPrograms.start_as_needed`,
        `expect`); returns at once. The small programs compile first in that thread when the executable
        store is on, otherwise on first use (a fraction of a second each). A mesh over several processes
        compiles in step order instead (every process must compile the same programs together)."""
        if self._spans_processes():
            return
        self._program_key(self.warm_up_order()[0])  # the argument specs, taken here before any step donates
        if table.store("small") is not None:
            calls = self._small_program_calls()
            self.programs.first_in_background(
                lambda: [table.prepare(jitted, name, self._small_programs, *args) for jitted, name, args in calls])
        self.programs.start_as_needed()
        # What an earlier process saved whole loads in that thread before the steps get to it (largest first:
        # a call's first steps are its prefill).
        self.programs.preload_stored(self.warm_up_order()[::-1])

    def expect(self, requests, rows_per_seq: int = 1) -> None:
        """Requests ((prompt tokens, new tokens at most, sequences) each) are about to run: their buckets
        (`bucket_plan.expected_shapes`) compile first under `warm_up_as_needed`; otherwise a no-op. The call
        lasts until `end_call`."""
        self.programs.begin_call()
        self.programs.want(bucket_plan.expected_shapes(self.buckets, self.page_size, requests, rows_per_seq))

    def end_call(self) -> None:
        """The requests of the last `expect` are done (`StepPrograms.end_call`: what was padded may compile
        once the runner idles)."""
        self.programs.end_call()

    def _warm_up_small_programs(self) -> None:
        """Runs the page copy (all padding, so nothing moves) and each part's state programs once."""
        size = self.max_copy_pairs
        self._copy(np.zeros(size, np.int32), np.full(size, self.num_pages, np.int32))
        for part, jitted, _, args in self._state_programs():
            self.update_part_state(part, jitted, *args)

    def _state_programs(self) -> list:
        """(part, jitted, name, example host arguments) of every state program of the parts with a state."""
        with_state = [p for p, state in zip(self.logit_parts + self.forward_parts, self.part_states + self.weight_states)
                      if state is not None]
        return [(part, jitted, name, args) for part in with_state
                for jitted, name, args in part.state_programs()]

    def _small_program_calls(self) -> list:
        """(jitted, name, abstract arguments) of what `_warm_up_small_programs` runs, for
        `table.prepare` to compile from another thread without touching the live arrays."""
        def abstract(*args):
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype,
                                                               sharding=getattr(x, "sharding", None)), args)

        pairs = np.zeros(self.max_copy_pairs, np.int32)
        calls = [(_copy_jit, "copy-pages", abstract(self.cache, *self._host_inputs(pairs, pairs)))]
        for part, jitted, name, args in self._state_programs():
            state = self._part_state(part)
            calls.append((jitted, name, abstract(state, *self._host_inputs(*args))))
        return calls

    def warm_up_order(self) -> list[StepShape]:
        """Every bucket, smallest first: the batch-1 decode first and the bucket that holds every step
        last (the two a background warm-up compiles before serving), decode-sized buckets early."""
        return sorted((self.buckets.step_shape(T, S, P) for T, S, P in self.buckets.all_shapes()),
                      key=lambda s: (s.T, s.P))

    def _warm_up_shapes(self, run_step) -> int:
        """Runs `run_step(ibuf, fbuf, shape)` once per bucket on an empty batch, and the small programs;
        returns how many shapes that was (the page copy counted)."""
        pad = self.num_pages * self.page_size
        shapes = self.buckets.all_shapes()
        for T, S, P in shapes:
            shape = self.buckets.step_shape(T, S, P)
            ibuf, fbuf, _ = shape.empty(pad)
            run_step(ibuf, fbuf, shape)
        self._warm_up_small_programs()
        jax.block_until_ready(self.cache)
        return len(shapes) + 1  # and the page copy

    @staticmethod
    def compilation_count() -> int:
        """Executables compiled so far by runners of this kind (a subclass adds its own functions)."""
        return compilation_count()
