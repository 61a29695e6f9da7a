"""`LLM`: the offline, programmatic API (`llm.generate(prompts, params)`).

In a multi-process run (`serving.launch`, or `RIDGELINE_*` / cluster settings, see
`serving.cluster.distributed`) every process builds the same `LLM` and calls the same
methods: process 0 schedules and runs, the others replay its device calls
(`serving.cluster.multihost`), and `generate` returns process 0's outputs everywhere.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import time
import weakref
from typing import Optional, Sequence, Union

import numpy as np

from model.checkpoint import load_checkpoint, load_config
from model.generation_config import read_generation_config
from model.quant import check_kv_cache_dtype, check_weight_dtype
from model.tokenizer import ByteTokenizer, load_tokenizer
from serving import model_source
from serving.cluster import distributed, multihost
from serving.compilation import compile_cache
from serving.core import engine_args
from serving.features.lora import LoRARequest, LoraManager, parse_lora_modules
from serving.core.engine import Engine, EngineConfig, EngineUnavailableError
from serving.core.outputs import RequestOutput
from serving.core.sampling_params import InvalidParameterError, SamplingParams
from serving.features import build_parts, pause, pooling_models, sleep_mode, weight_updates
from serving.features.pooling import (PoolingModel, PoolingOutput, PoolingParams, PoolingPart, PoolingRequestOutput,
                                      pair_prompts, pair_up, pooling_sampling_params, truncated)

log = logging.getLogger(__name__)


def default_checkpoint_dir() -> str:
    """The embedded byte-level model shipped inside the `model` package."""
    import model

    return os.path.join(os.path.dirname(os.path.abspath(model.__file__)), "default")


def tensor_parallel_layout(tensor_parallel_size: int):
    """The Megatron layout over the first `tensor_parallel_size` devices; None for one device."""
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if tensor_parallel_size == 1:
        return None
    import sharding

    return sharding.Layout.create(sharding.make_mesh(tensor=tensor_parallel_size), "megatron")


def parallel_layout(tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, num_microbatches: int = 1):
    """`tensor_parallel_layout` when there is one stage; otherwise a pipeline layout of
    `pipeline_parallel_size` stages of `tensor_parallel_size` devices each, running
    `num_microbatches` microbatches per step (`sharding.pipeline`)."""
    for name, value in (("pipeline_parallel_size", pipeline_parallel_size), ("num_microbatches", num_microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if pipeline_parallel_size == 1:
        if num_microbatches != 1:
            raise ValueError(f"num_microbatches={num_microbatches} needs pipeline_parallel_size > 1 "
                             "(microbatches are the pipeline's schedule)")
        return tensor_parallel_layout(tensor_parallel_size)
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    from sharding.pipeline import make_pipeline_layout

    return make_pipeline_layout(pipeline_parallel_size, tensor_parallel_size, num_microbatches)


def _default_tokenizer(cfg):
    return ByteTokenizer(cfg.vocab_size) if cfg.vocab_size >= 258 else None


class LLM:
    """A model plus an engine. With no checkpoint, the embedded default model.

    `config`/`params` (and optionally `tokenizer`) serve an in-memory model
    instead of a checkpoint directory, e.g. random weights in tests and
    benchmarks. How the step programs compile (`warmup`):

    * "as_needed" (the default): nothing before this returns; a background
      thread compiles the buckets each `generate` says it will need
      (`serving.core.bucket_plan`: a typical batch needs two, its prefill
      and its decode), while that call's other steps pad into one of them
      when that costs at most about twice the work, and compile their own
      only when none holds them so cheaply. A script's first `generate`
      thus compiles two programs instead of one per bucket it reaches.
      Once no call has run for a couple of seconds, the buckets steps were
      padded out of compile at the lowest CPU priority and are saved, so
      later calls and later processes run those steps in their own.
    * True: every step shape up front.
    * "background": the smallest and the largest now and the rest in a
      background thread while the engine already serves (what the server does).
    * False: each bucket on first use.

    The environment variable `RIDGELINE_WARMUP` (off, full, background,
    as_needed) sets the default (the test suite turns it off). `compilation_cache_dir`
    points JAX's persistent compilation cache somewhere (None: the default
    location, see `serving.compilation.compile_cache`; "": off), so a second start loads
    its executables instead of compiling them.

    `tensor_parallel_size=T` shards every layer over T devices;
    `pipeline_parallel_size=P` splits the layers into P stages of T devices
    each, and `num_microbatches=M` cuts each step's tokens into M microbatches
    that flow through the stages (docs/sharding.md, "Pipeline parallelism").

    `dtype` is the float dtype the model computes in: the checkpoint's ("auto";
    on CPU a bf16 / fp16 checkpoint computes in float32, see
    `serving.core.compute_dtype`) or the one named.
    `weight_dtype` ("auto", "int8", "fp8") quantizes a float model's linear
    layers at load time (a checkpoint converted with `--weight_dtype` is
    already quantized and loads as it is); `kv_cache_dtype` ("auto", "int8",
    "fp8", or a float dtype) sets how the KV pool stores K and V. See
    `model.quant` and docs/quantization.md.

    `speculative_method="draft"|"ngram"` with `num_speculative_tokens=k` turns
    on speculative decoding (see `serving.spec_decode`); `speculative_draft=(config,
    params)` is an in-memory draft model, `speculative_model` a draft checkpoint
    directory.
    """

    @engine_args.with_option_keywords
    def __init__(self, checkpoint: Optional[str] = None, *, model: Optional[str] = None, config=None, params=None,
                 tokenizer=None, warmup: Union[bool, str, None] = None, speculative_draft=None,
                 pooling_model: Optional[PoolingModel] = None, **options):
        """`checkpoint` (or `model`, vLLM's name for it): a Ridgeline checkpoint directory, a Hugging Face
        checkpoint directory (converted once, the copy cached) or a Hugging Face Hub id (`serving.model_source`).
        Every option of `serving.core.engine_args.OPTIONS` is a keyword here, with its declared default (the
        signature lists them); `EngineConfig` gets those it holds. `pooling_model`: the pooling config and score
        head of an in-memory model served with runner=pooling (default: last-token embeddings). The options:
        """
        if model is not None and checkpoint is not None and model != checkpoint:
            raise ValueError(f"pass checkpoint or model, not both (got {checkpoint!r} and {model!r})")
        checkpoint = checkpoint if checkpoint is not None else model
        opts = engine_args.resolve(options)
        t0 = time.perf_counter()
        check_weight_dtype(opts["weight_dtype"])  # before any loading: a typo costs nothing
        check_kv_cache_dtype(opts["kv_cache_dtype"])
        self.compilation_cache_dir = compile_cache.enable(opts["compilation_cache_dir"])
        distributed.initialize()  # joins a multi-process run when the environment asks for one
        if (config is None) != (params is None):
            raise ValueError("pass both config and params (an in-memory model) or neither")
        layout = parallel_layout(opts["tensor_parallel_size"], opts["pipeline_parallel_size"],
                                 opts["num_microbatches"])
        multihost.check_layout(layout)  # several processes: the mesh must span them all
        generation = None  # the checkpoint's generation_config.json defaults
        if opts["generation_config"] not in ("auto", "off"):
            raise ValueError(f"generation_config must be 'auto' or 'off', got {opts['generation_config']!r}")
        self.model_name = None  # the name MODEL gives clients by default (None: the checkpoint directory's)
        source = None  # a pooling checkpoint, read in place (`serving.features.pooling_models`)
        resolved_source = None  # the directory `checkpoint` names, as it is (a Hub id: its snapshot)
        if config is None and checkpoint:
            resolved_source = model_source.resolve_source(checkpoint)
            if pooling_models.serves_pooling(resolved_source.checkpoint, opts["runner"]):
                source, self.model_name = resolved_source.checkpoint, resolved_source.name
                config, params, loaded_tokenizer, pooling_model = pooling_models.load(source, opts["pooler_config"])
                tokenizer = tokenizer or loaded_tokenizer
        if config is None:
            directory = checkpoint or default_checkpoint_dir()
            if checkpoint:
                resolved = model_source.checkpoint_of(resolved_source, opts["compilation_cache_dir"])
                directory, self.model_name = resolved.checkpoint, resolved.name
            elif not os.path.isdir(directory):
                raise FileNotFoundError(f"no checkpoint at {directory} (the embedded default model is missing)")
            config = load_config(directory)
            if hasattr(layout, "check"):  # a pipeline layout: the layers must split into its stages
                layout.check(config)
            # With a layout, every device reads only its own shards from the checkpoint.
            config, params = load_checkpoint(directory, multihost.restore_shardings(layout, config), config)
            params = multihost.narrow_to_layout(params, layout, config)  # no-op unless restored wider
            tokenizer = tokenizer or load_tokenizer(directory, config.vocab_size)
            if opts["generation_config"] == "auto":
                generation = read_generation_config(directory)
            self.checkpoint = directory
        else:
            if hasattr(layout, "check"):
                layout.check(config)
            tokenizer = tokenizer or _default_tokenizer(config)
            self.checkpoint = source
        if opts["runner"] == "pooling" and pooling_model is None:  # a causal LM (or an in-memory model) pooling
            pooling_model = pooling_models.default_model(self.checkpoint, opts["pooler_config"])
        self.layout = layout
        self.config = config
        self.tokenizer = tokenizer
        engine_config = EngineConfig(**{o.name: opts[o.name] for o in engine_args.ENGINE_CONFIG_OPTIONS})
        self.engine = Engine(config, params, tokenizer, engine_config, layout=layout, generation=generation,
                             parts=build_parts(opts, config, draft=speculative_draft, pooling=pooling_model))
        self.config = self.engine.cfg  # with weight_dtype set when the engine quantized the weights
        self._register_lora_modules(opts["lora_modules"])
        self.load_seconds = time.perf_counter() - t0
        log.info("loaded in %.1f s (persistent compilation cache: %s)", self.load_seconds,
                 self.compilation_cache_dir or "off")
        self.multihost = multihost.attach(self.engine)  # None when this process runs alone
        self.warmup_info = None
        warmup = resolve_warmup(warmup)
        if warmup in ("as_needed", "background") and self.multihost is None:
            # Both compile in a thread: a process must not exit in the middle of an XLA compile (it aborts),
            # so at exit the one under way ends first and no other starts.
            programs = weakref.ref(self.engine.runner.programs)
            atexit.register(lambda: programs() is not None and programs().stop())
        if warmup == "as_needed":
            if self.multihost is None:  # processes compile together, in step order
                self.engine.warm_up_as_needed()
        elif warmup:
            before = compile_cache.compile_counts()
            if self.multihost is not None:  # processes compile every shape together
                self.warmup_info = self.multihost.warm_up()
            else:
                self.warmup_info = self.engine.warm_up(background=warmup == "background")
            done = compile_cache.compile_counts() - before
            self.warmup_info.update(xla_compiled=done.compiled, cache_hits=done.cache_hits)
            log.info("%s", compile_cache.describe_warmup(self.warmup_info, self.compilation_cache_dir))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    def _register_lora_modules(self, spec) -> None:
        """The adapters of option `lora_modules`, registered (read and checked) before anything runs."""
        modules = parse_lora_modules(spec)
        manager = self.engine.part(LoraManager)
        if modules and manager is None:
            raise ValueError("lora_modules needs enable_lora=True")
        for name, path in modules.items():
            manager.register(name, path)

    def _lora_name(self, lora_request) -> Optional[str]:
        """The adapter name of a `lora_request` (a `LoRARequest` or a registered name; None: the base
        model), registering a `LoRARequest`'s path under its name on first use, as vLLM loads it."""
        if lora_request is None or isinstance(lora_request, str):
            return lora_request
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, an adapter name or None, got "
                            f"{type(lora_request).__name__}")
        manager = self.engine.part(LoraManager)
        if manager is not None and lora_request.lora_path is not None:
            known = manager.path(lora_request.lora_name)
            if known is None:
                manager.register(lora_request.lora_name, lora_request.lora_path)
            elif os.path.realpath(known) != os.path.realpath(lora_request.lora_path):
                raise ValueError(f"LoRA adapter {lora_request.lora_name!r} is loaded from {known!r}, not "
                                 f"{lora_request.lora_path!r}")
        return lora_request.lora_name

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` samples with when given no parameters: the checkpoint's generation_config.json
        defaults (option `generation_config`), else SamplingParams()."""
        return self.engine.default_sampling_params.clone()

    def generate(self, prompts: Union[str, list, dict, Sequence],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 lora_request=None, *, priority: Union[int, Sequence[int], None] = None,
                 pooling_params: Optional[Sequence[PoolingParams]] = None) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in prompt order.

        A prompt is a string, a list of token ids, or {"prompt_token_ids": [...]} / {"prompt": "..."};
        a dict prompt may carry "cache_salt" (requests share cached prefix pages only with
        requests of the same salt) and, for a vision-language model, "multi_modal_data": {"image":
        a PIL image, a uint8 [H, W, C] array, or a list of them}, one per image placeholder token
        of the prompt, in order (`serving.features.multimodal`). `priority` (one per prompt, or one for
        all; lower runs first) orders the requests under `scheduling_policy="priority"`, as vLLM's
        `LLM.generate` does.
        `lora_request` (needs `enable_lora`): a `LoRARequest` (registered on first use when it names a
        path), an adapter name, or one of those (or None, the base model) per prompt.
        Every request is validated before any is queued, so one bad prompt or
        parameter raises (`InvalidParameterError`) without running the others.

        Several processes (each builds the same `LLM`, whose layout spans all
        their devices, and calls `generate` with the same arguments): process 0
        runs the requests; the others replay its device calls until its call
        ends and return the same outputs (their own `prompts` are not used).
        """
        role = self.multihost
        if role is None:
            return self._generate(prompts, sampling_params, lora_request, priority, pooling_params)
        if not role.is_leader:
            return role.follow()  # process 0's outputs, once its generate is done
        with role.operation():
            try:
                outputs = self._generate(prompts, sampling_params, lora_request, priority, pooling_params)
            except BaseException as e:
                role.failed("generate", e)
                raise
            role.end(outputs)
            return outputs

    def chat(self, messages: Union[Sequence[dict], Sequence[Sequence[dict]]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None, *,
             add_generation_prompt: bool = True, tools: Optional[Sequence[dict]] = None,
             chat_template_kwargs: Optional[dict] = None) -> list[RequestOutput]:
        """Generates replies to chat conversations: one conversation (a list of {"role", "content"}
        messages) or a list of them, rendered by the model's chat template exactly as the server's
        chat route renders them (`tools` reaches the template as `tools`, `chat_template_kwargs` as
        more variables, e.g. `{"enable_thinking": False}`), then `generate`d.

        Content may be a list of parts: {"type": "text", "text"}, and for a vision-language model
        {"type": "image", "image": a PIL image or uint8 array} or {"type": "image_url", "image_url":
        {"url": a data: URL}}; each image goes where its part is."""
        from serving.api.chat_template import encode_chat

        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer; this model has none")
        from serving.api.chat_template import IMAGE_SENTINEL

        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        vision = self.config.vision
        image_ids = list(vision.image_prompt_ids or (self.config.image_token_id,)) if vision is not None else None
        prompts = []
        for conv in conversations:
            images: list = []
            rendered = [_chat_message(m, images, IMAGE_SENTINEL) for m in conv]
            if images and vision is None:
                raise InvalidParameterError("multi_modal_data", "multi_modal_data: this model does not take images")
            ids = encode_chat(rendered, self.tokenizer, add_generation_prompt, tools, chat_template_kwargs,
                              image_ids if images else None, vision.image_text_margin if images else "")
            prompts.append({"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else ids)
        return self.generate(prompts, sampling_params)

    # --- weights (serving.features.weight_updates) ------------------------------------------------------------
    def get_weights(self):
        """The engine's weight pytree as it serves it: the placed arrays themselves (their shardings, and
        the quantized form under weight_dtype int8 / fp8). Pass it, or arrays of its structure, to
        `update_weights`."""
        return weight_updates.get_weights(self.engine)

    def update_weights(self, weights, *, version: Optional[int] = None) -> int:
        """Replaces the weights the engine serves; returns the new `weight_version` (`version`, or the
        old one plus one). No step program compiles (the shapes, dtypes and shardings are the engine's;
        quantizing and resharding from other devices compile small programs on the first update only).

        `weights`: a pytree of `get_weights()`'s structure placed anywhere (arrays that already have the
        engine's shardings and dtypes are taken as they are, no copy; others are placed leaf by leaf;
        float weights are quantized where the engine serves int8 / fp8), or a flat dict keyed by Hugging
        Face tensor names. A wrong structure, shape or dtype raises ValueError naming the leaf, and
        nothing is replaced. The new weights take effect at the next dispatched step (one already
        dispatched finishes under the old ones); no later request reuses prefix-cache K/V computed
        under older weights. Call it between `generate` calls. See `serving.features.weight_updates`."""
        if self.multihost is not None:
            raise NotImplementedError("update_weights in a multi-process run: every process would have to place "
                                      "its own shards; not supported yet")
        version = weight_updates.update_weights(self.engine, weights, version)
        sleep_mode.weights_updated(self.engine)
        return version

    # --- sleep mode (serving.features.sleep_mode) -----------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Gives the device memory back between uses: level 1 moves the weights to host memory and lets the KV
        pool go; level 2 drops the weights too (update them after `wake_up(tags=["weights"])`). The engine must
        have no unfinished request; `generate` raises `EngineUnavailableError` until it is awake."""
        if self.multihost is not None:
            raise NotImplementedError("sleep in a multi-process run: not supported yet")
        sleep_mode.sleep(self.engine, level)

    def wake_up(self, tags: Optional[list] = None) -> None:
        """Takes the memory of `tags` ("weights", "kv_cache"; default both) back; generation after a level-1
        sleep is what it was before it."""
        sleep_mode.wake_up(self.engine, tags)

    @property
    def is_sleeping(self) -> bool:
        return sleep_mode.is_sleeping(self.engine)

    # --- pausing generation (serving.features.pause) --------------------------------------------------
    def pause_generation(self, mode: str = "abort") -> str:
        """Holds the engine's steps: "abort" ends unfinished requests with their tokens so far, "wait" lets the
        started ones finish first, "keep" freezes them to continue on `resume_generation` (under the weights
        the engine has then). `generate` refuses to run while paused. Returns the state."""
        return pause.pause(self.engine, mode)

    def resume_generation(self, recompute_kv: bool = False) -> None:
        """Lets the steps run again; `recompute_kv` has the requests that continue recompute their K/V first
        (after a weight update)."""
        pause.resume(self.engine, recompute_kv)

    @property
    def is_paused(self) -> bool:
        return pause.state(self.engine) != "running"

    @property
    def weight_version(self) -> int:
        """The version of the weights served: 0 as loaded, then what each `update_weights` set."""
        return self.engine.weight_version

    def reset_prefix_cache(self) -> int:
        """Drops the prefix cache: every cached page no running sequence holds, and the host KV tier's
        blocks; returns how many device pages were dropped."""
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Ends a background warm-up (after the compile under way); in multi-process runs, process 0
        also tells the others to stop following."""
        self.engine.stop_warm_up()
        if self.multihost is not None and self.multihost.is_leader:
            self.multihost.shutdown()

    # --- pooling models (runner=pooling: serving.features.pooling) ---------------------------------------------
    def encode(self, prompts, pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None, *,
               truncate_prompt_tokens: Optional[int] = None, lora_request=None,
               priority: Union[int, Sequence[int], None] = None) -> list[PoolingRequestOutput]:
        """Pools every prompt (`PoolingParams`: the task, embedding dimensions, normalization; one or one per
        prompt) through the engine's steps; outputs in prompt order, each `outputs.data` a float32 array.
        `truncate_prompt_tokens`: keep the first k tokens of a longer prompt (-1: the model's limit); unset, a
        prompt over the limit is refused naming both lengths. Prompts, `lora_request` and `priority` as
        `generate` takes them."""
        part = self.engine.part(PoolingPart)
        if part is None:
            raise InvalidParameterError("pooling_params", "this model generates; pooling needs runner=pooling on an "
                                                          "embedding or classification checkpoint")
        prompts = _as_prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling_params = [pooling_params or PoolingParams()] * len(prompts)
        elif len(pooling_params) != len(prompts):
            raise ValueError(f"{len(pooling_params)} pooling params for {len(prompts)} prompts")
        if truncate_prompt_tokens is not None:
            prompts = [self._truncated(p, truncate_prompt_tokens, part.max_prompt_tokens()) for p in prompts]
        sampling = pooling_sampling_params()
        outputs = self.generate(prompts, [sampling] * len(prompts), lora_request, priority=priority,
                                pooling_params=list(pooling_params))
        return [PoolingRequestOutput(o.request_id, PoolingOutput(o.pooled), o.prompt_token_ids) for o in outputs]

    def embed(self, prompts, pooling_params: Optional[PoolingParams] = None, **kwargs) -> list[PoolingRequestOutput]:
        """Embeddings (`outputs.embedding`): the model's pooler, normalized as its config says (`encode`)."""
        return self.encode(prompts, pooling_params or PoolingParams("embed"), **kwargs)

    def classify(self, prompts, **kwargs) -> list[PoolingRequestOutput]:
        """A sequence classifier's probabilities over its labels (`outputs.probs`; `encode`)."""
        return self.encode(prompts, PoolingParams("classify"), **kwargs)

    def reward(self, prompts, **kwargs) -> list[PoolingRequestOutput]:
        """A reward model's raw score head values (`outputs.data`; `encode`)."""
        return self.encode(prompts, PoolingParams("reward"), **kwargs)

    def score(self, data_1, data_2, **kwargs) -> list[PoolingRequestOutput]:
        """Relevance of each text of `data_2` to `data_1` (one text: scored against each), or of pairs
        (`outputs.score`): a one-label classifier (a cross-encoder reranker) reads each pair as one prompt
        (`tokenizer(text_1, text_2)`), its sigmoid the score; an embedder scores the cosine similarity of the
        two texts' embeddings."""
        firsts, seconds = pair_up(data_1, data_2)
        part = self.engine.part(PoolingPart)
        if part is not None and part.model.head is not None:
            prompts, params = pair_prompts(self.tokenizer, firsts, seconds, self.config.type_vocab_size > 1,
                                           kwargs.pop("truncate_prompt_tokens", None), part.max_prompt_tokens())
            return self.encode(prompts, params, **kwargs)
        unique = list(dict.fromkeys(firsts + seconds))
        vectors = dict(zip(unique, (o.outputs.data for o in self.embed(unique, PoolingParams("embed", normalize=True),
                                                                       **kwargs))))
        return [PoolingRequestOutput(f"score-{i}", PoolingOutput(np.asarray([float(vectors[a] @ vectors[b])],
                                                                             np.float32)), [])
                for i, (a, b) in enumerate(zip(firsts, seconds))]

    def _truncated(self, prompt, k: int, limit: int):
        """A pooling prompt cut to its first k tokens (`pooling.truncated`), as a dict of ids."""
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if isinstance(prompt, dict):
            prompt = prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt.get("prompt", "")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidParameterError("prompt", "prompt: this model has no tokenizer; pass token ids")
            prompt = self.tokenizer.encode(prompt)
        out = {"prompt_token_ids": truncated(list(prompt), k, limit)}
        return out if salt is None else {**out, "cache_salt": salt}

    def _generate(self, prompts, sampling_params, lora_request=None, priority=None,
                  pooling_params=None) -> list[RequestOutput]:
        prompts = _as_prompt_list(prompts)
        pooling_params = pooling_params or [None] * len(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        elif len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        if priority is None or isinstance(priority, int):
            priority = [priority or 0] * len(prompts)
        elif len(priority) != len(prompts):
            raise ValueError(f"{len(priority)} priorities for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, (str, LoRARequest)):
            lora_request = [lora_request] * len(prompts)
        elif len(lora_request) != len(prompts):
            raise ValueError(f"{len(lora_request)} lora requests for {len(prompts)} prompts")
        names = [self._lora_name(lr) for lr in lora_request]
        engine = self.engine
        if engine.steps_held():  # (nothing would run: this call would wait forever)
            raise EngineUnavailableError("generation is paused: resume_generation() first")
        reqs = []
        try:
            for p, sp, name, pr, pp in zip(prompts, sampling_params, names, priority, pooling_params, strict=True):
                reqs.append(engine.make_request(f"llm-{next(self._ids)}", p, sp, priority=pr,
                                                part_args={"lora_name": name, "pooling": pp}))
        except BaseException:
            for r in reqs:  # made, never queued: the parts let go of them (their adapters)
                engine.drop_request(r)
            raise
        engine.expect(reqs)  # under warmup="as_needed", their buckets start compiling now
        try:
            for r in reqs:
                engine.enqueue(r)
            done: dict[str, RequestOutput] = {}
            want = {r.request_id for r in reqs}
            while want - done.keys():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
        finally:
            engine.end_call()  # once idle, what its steps were padded out of may compile
        return [done[r.request_id] for r in reqs]


def _as_prompt_list(prompts) -> list:
    """One prompt (a string, a dict, a list of token ids) or a list of them, as a list."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                            and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


WARMUP_ENV_VAR = "RIDGELINE_WARMUP"
_WARMUP_NAMES = {"off": False, "full": True, "background": "background", "as_needed": "as_needed"}


def resolve_warmup(warmup):
    """`LLM`'s `warmup` argument: False, True, "background" or "as_needed"; None: `RIDGELINE_WARMUP`
    (off, full, background, as_needed), else "as_needed"."""
    if warmup is None:
        name = os.environ.get(WARMUP_ENV_VAR, "as_needed")
        if name not in _WARMUP_NAMES:
            raise ValueError(f"{WARMUP_ENV_VAR} must be one of {', '.join(_WARMUP_NAMES)}, got {name!r}")
        return _WARMUP_NAMES[name]
    if warmup not in (False, True, "background", "as_needed"):
        raise ValueError(f"warmup must be False, True, 'background' or 'as_needed', got {warmup!r}")
    return warmup


def _chat_message(m: dict, images: list, image_text: str = "") -> dict:
    """A message as the template sees it: its content as one string (text parts joined, each image part
    written as `image_text`); the message's images are appended to `images`."""
    content = m.get("content")
    if isinstance(content, list):
        pieces = []
        for part in content:
            kind = part.get("type", "text")
            if kind == "text":
                pieces.append(part.get("text", ""))
            elif kind in ("image", "image_url"):
                images.append(_chat_image(part))
                pieces.append(image_text)
            else:
                raise ValueError(f"unsupported content part type {kind!r} (text, image, image_url)")
        content = "".join(pieces)
    return {**m, "content": content if content is not None else ""}


def _chat_image(part: dict):
    """The image of a chat content part: {"type": "image", "image": PIL image or uint8 array} or
    {"type": "image_url", "image_url": {"url": data: URL}} (a local call fetches nothing)."""
    if part["type"] == "image":
        return part["image"]
    from serving.api.media import MediaOptions, data_url_bytes, decode_image

    url = part["image_url"]["url"] if isinstance(part["image_url"], dict) else part["image_url"]
    if not url.startswith("data:"):
        raise ValueError("LLM.chat takes image_url parts as data: URLs; pass other images as {'type': 'image'}")
    return decode_image(data_url_bytes(url), MediaOptions())
