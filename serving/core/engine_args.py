"""Every engine option, declared once: name, Python type, default, help.

Three things are derived from `OPTIONS`, so they cannot drift apart:

* `serving.core.engine.EngineConfig`, the frozen dataclass of the options the
  engine itself reads (`EngineOption.engine_config`);
* the keyword arguments of `serving.LLM(...)`: every option, with the same
  default (the others, `tensor_parallel_size` and the like, shape how the
  model is loaded rather than how the engine runs);
* the server's absl flags (`define_flags`, used by `serving.server`), whose
  flag type follows the Python type: int, float, bool, str, `Optional[...]`
  of those (default None), and `choices` for an enum.

A default chosen by measurement says so in its help ("measured: ...").
tests/test_engine_options.py checks that all three agree.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Any, Optional

from absl import flags

from model.quant import KV_CACHE_DTYPE_CHOICES, WEIGHT_DTYPE_CHOICES
from serving.core.compute_dtype import CHOICES as COMPUTE_DTYPE_CHOICES
from serving.core.sampling_params import CONTROL_FIELDS

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")  # option logprobs_mode
SPECULATIVE_METHODS = ("draft", "ngram")  # option speculative_method (`serving.spec_decode`)
SPECULATION = "speculative decoding"  # the part of the speculation options (`serving.spec_decode.verifier`)
# What a preempted sequence's KV becomes (option preemption_mode; `serving.features.host_kv_tier`).
PREEMPTION_MODES = ("recompute", "swap", "auto")
HOST_KV_TIER = "host KV tier"  # the part of the host tier's options
STRUCTURED_OUTPUTS = "structured outputs"  # the part of structured outputs' options
# The request fields parts take (`StepPart.takes_fields`) and the part an engine needs for each: what a
# request that gives one to an engine without that part is told.
FIELD_PARTS = {
    "extra_args": "no logits processor that reads them (option logits_processors)",
    "structured_outputs": "no structured-outputs part (serving.features.build_parts builds one for every engine)",
    "reasoning": "no structured-outputs part, which runs the reasoning phase (serving.features.build_parts)",
    **{field: "no sampling-controls part (serving.features.build_parts builds one for every engine)"
       for field in CONTROL_FIELDS},
}

# The request arguments parts take (`StepPart.takes_args`): the field a request that gives one to an engine
# without the part is refused under, and why.
ARG_PARTS = {
    "lora_name": ("lora_request", "names a LoRA adapter, but this engine serves none (enable_lora is off)"),
    "pooling": ("pooling_params", "asks for a pooled output, but this engine serves a generation model (start it "
                                  "with runner=pooling on an embedding or classification checkpoint)"),
}
LORA = "LoRA"  # the part of the LoRA options (`serving.features.lora`)
# The keys of a dict prompt parts take (`StepPart.takes_prompt_keys`): why a prompt giving one to an engine
# without that part is refused.
PROMPT_KEY_PARTS = {"multi_modal_data": "this model does not take images"}

# The flags `define_flags` defines belong to its caller (absl lists a program's own flags under --help).
flags.disclaim_key_flags()


@dataclasses.dataclass(frozen=True)
class EngineOption:
    name: str
    type: Any  # int, float, bool, str, or Optional[one of them]
    default: Any
    help: str
    choices: Optional[tuple] = None  # the values a flag accepts (an absl enum); None: any value of `type`
    engine_config: bool = True  # a field of EngineConfig; False: only `LLM` reads it (how the model is loaded)
    # The step part that serves the option (its `StepPart.serves`), built outside the engine
    # (`serving.features.build_parts`); the engine refuses a value other than the default without that part.
    part: Optional[str] = None

    @property
    def base_type(self) -> type:
        """`type` without its `Optional`."""
        args = [a for a in typing.get_args(self.type) if a is not type(None)]
        return args[0] if args else self.type


OPTIONS: tuple[EngineOption, ...] = (
    EngineOption("max_num_seqs", int, 64, "Most sequences in one step."),
    EngineOption("max_num_batched_tokens", int, 512, "Token budget of one step (prefill chunks + decodes)."),
    EngineOption("page_size", int, 16, "Tokens per KV-cache page."),
    EngineOption("num_pages", Optional[int], None, "KV pool size in pages; default: sized from device memory."),
    EngineOption("max_model_len", Optional[int], None, "Context window; default: the model's, capped by the pool."),
    EngineOption("enable_prefix_caching", bool, True, "Reuse cached KV pages of shared prompt prefixes."),
    EngineOption("scheduling_policy", str, "fcfs",
                 "Order of admission. fcfs: arrival order; priority: by the request's priority (lower first, "
                 "vLLM's convention), then arrival, and a running request of lower priority is preempted for a "
                 "waiting one of higher priority when seats or KV pages run out. Under fcfs a request with a "
                 "priority other than 0 is refused.", choices=("fcfs", "priority")),
    EngineOption("layer_loop", str, "auto",
                 "How a step runs the layers: scan (one lax.scan over the layers: the step compiles one layer "
                 "body whatever the depth; stacked weights on GPUs, matrices picked per layer by lax.switch on "
                 "XLA CPU, which would copy a stacked slice), unroll (one copy of the layer per layer in the "
                 "program), or auto (= scan). Measured on 2 CPU cores, 135M-shape model, 32 layers: scan "
                 "compiles in 1.2x the time of 4 layers (unrolled 2.9x), decodes at batch 1 1.2x and a mixed "
                 "workload 0.97x as fast as unrolled (docs/performance.md).",
                 choices=("auto", "scan", "unroll")),
    EngineOption("quick_warmup_compile", bool, True,
                 "A background warm-up (the server's) first compiles its smallest bucket (the batch-1 decode) "
                 "with the platform's quick compiler options (XLA CPU: LLVM -O0; other platforms: none, a full "
                 "compile), then recompiles it fully in the background before the other buckets. Measured on "
                 "2 CPU cores (benchmarks/quick_compile.py): the bucket compiles in about half the time; its "
                 "steps run at 0.5-0.65x speed, with the same tokens, until replaced."),
    EngineOption("attention_backend", str, "auto",
                 "Attention backend: auto, xla, reference, pallas, pallas_interpret."),
    EngineOption("seed", int, 0, "Engine seed (for requests that give none)."),
    EngineOption("logprobs_mode", str, "raw_logprobs",
                 "What a sampled token's logprobs are computed from, as vLLM names it: raw_logprobs (the model's "
                 "own distribution) or processed_logprobs (the one the token was drawn from: after the logit "
                 "adjustments, temperature, min-p and top-k/top-p; greedy rows: after the adjustments), what an "
                 "RL trainer sampling below temperature 1 wants.", choices=LOGPROBS_MODES),
    EngineOption("kv_cache_memory_fraction", float, 0.9,
                 "Share of device memory the KV pool may take, on devices that report their memory."),
    EngineOption("host_kv_cache_bytes", int, 256 * 2**20,
                 "KV pool budget in bytes where the device reports no memory (CPU)."),
    EngineOption("kv_offload_bytes", int, 0,
                 "Host-memory tier of the prefix cache, in bytes (0: off): KV pages evicted from the device pool "
                 "are copied to a host page pool (LRU, pinned host memory where the backend has it) and restored "
                 "on a later prefix hit instead of recomputed. Needs enable_prefix_caching.", part=HOST_KV_TIER),
    EngineOption("kv_offloading_size", Optional[float], None,
                 "The host tier's size in GiB (vLLM's spelling of kv_offload_bytes; give one of the two).",
                 part=HOST_KV_TIER),
    EngineOption("preemption_mode", str, "recompute",
                 "What a preempted sequence's KV becomes: recomputed when it resumes (recompute), copied to the "
                 "host tier and restored (swap), or per sequence whichever the measured copy bandwidth and step "
                 "rate say is cheaper (auto). swap and auto need the host tier (kv_offload_bytes).",
                 choices=PREEMPTION_MODES, part=HOST_KV_TIER),
    EngineOption("min_token_bucket", int, 1,
                 "Smallest padded token count of a step (raising it compiles fewer shapes, but pads every small "
                 "step up to it). Measured: batch-1 greedy decode of the embedded model through LLM.generate "
                 "on a 2-core CPU, 1: 1000-1100 tok/s, 16: 240-250 tok/s."),
    EngineOption("decode_bucket_step", int, 8,
                 "Decode-sized token buckets (up to max_num_seqs) at every multiple of this besides the powers of "
                 "two, as vLLM's CUDA graph sizes (0: powers of two only). Each adds one step program (more "
                 "compiles at warm-up) and cuts a decode step's padding rows to fewer than this many; "
                 "docs/performance.md has the measurement."),
    EngineOption("min_context_bucket", int, 64, "Smallest padded context (tokens) attention reads per sequence."),
    EngineOption("dtype", str, "auto",
                 "Float dtype the model computes in: the checkpoint's (auto), except on CPU, where a bfloat16 / "
                 "float16 checkpoint computes in float32 (measured: a 16-token prefill of the 135M Llama shape "
                 "took 3.3 s in bf16 against 0.07 s in float32 on 2 cores), or float32 / bfloat16 / float16.",
                 choices=COMPUTE_DTYPE_CHOICES),
    EngineOption("weight_dtype", str, "auto",
                 "Linear-layer weights: as loaded (auto), or quantized at load time to int8 / fp8 (e4m3) "
                 "with per-output-channel scales.", choices=WEIGHT_DTYPE_CHOICES),
    EngineOption("kv_cache_dtype", str, "auto",
                 "KV cache storage: the model dtype (auto), or int8 / fp8 with per-token scales.",
                 choices=KV_CACHE_DTYPE_CHOICES),
    EngineOption("speculative_method", Optional[str], None,
                 "Speculative decoding: a draft model or prompt lookup (unset: off).", choices=SPECULATIVE_METHODS,
                 part=SPECULATION),
    EngineOption("num_speculative_tokens", int, 0, "Drafted tokens verified per step (with speculative_method)."),
    EngineOption("speculative_model", Optional[str], None,
                 "Draft model checkpoint directory for speculative_method=draft (default: the embedded draft "
                 "model)."),
    EngineOption("async_scheduling", bool, True,
                 "Schedule and dispatch step t+1 while the device runs step t (off: one step at a time; "
                 "speculative decoding always runs one step at a time)."),
    EngineOption("generation_config", str, "auto",
                 "Whether the checkpoint's generation_config.json supplies default EOS ids and default sampling "
                 "parameters (temperature, top_p, top_k, min_p, max_new_tokens) for requests that do not set "
                 "them (auto), or is not read (off).", choices=("auto", "off"), engine_config=False),
    EngineOption("structured_outputs_whitespace", bool, False,
                 "Let JSON grammars of structured outputs put free whitespace between tokens (off: none, so a "
                 "weak model cannot loop on spaces; a request's structured_outputs.whitespace overrides it).",
                 part=STRUCTURED_OUTPUTS),
    EngineOption("limit_mm_per_prompt", int, 4,
                 "Most images one prompt may carry (a vision-language model); more is a 400."),
    EngineOption("encoder_cache_mb", int, 256,
                 "Host memory (MiB) for image encoder outputs kept by image content digest, so a repeated "
                 "image is encoded once (a vision-language model)."),
    EngineOption("enable_lora", bool, False,
                 "Serve LoRA adapters (PEFT format) on the base model: requests pick one by name (the OpenAI "
                 "routes' model, LLM.generate's lora_request); one step mixes base rows and up to max_loras "
                 "adapters.", part=LORA),
    EngineOption("max_loras", int, 1, "Most distinct LoRA adapters in one step (device slots, each padded to "
                                      "max_lora_rank; with enable_lora)."),
    EngineOption("max_lora_rank", int, 16, "Largest LoRA rank served; a higher-rank adapter is refused."),
    EngineOption("max_cpu_loras", Optional[int], None,
                 "LoRA adapters kept loaded in host memory (LRU; an evicted one is read again from its path when "
                 "used); default: max_loras."),
    EngineOption("lora_modules", Optional[str], None,
                 "LoRA adapters registered at start, name=path[,name=path...] (PEFT directories; with "
                 "enable_lora).", engine_config=False),
    EngineOption("logits_processors", Optional[str], None,
                 "Custom logits processors applied inside the step, 'module:Class[,module:Class]' "
                 "(serving.features.logits_processors; LLM also takes a list); requests switch them "
                 "through extra_args.", engine_config=False),
    EngineOption("runner", str, "auto",
                 "What the model serves, as vLLM's --runner: generate (tokens), pooling (embeddings, classifier "
                 "and reward scores: serving.features.pooling; generation requests still run on a decoder), or "
                 "auto: pooling for a checkpoint whose architecture is a base model or a sequence classifier "
                 "(Qwen3Model, LlamaForSequenceClassification, ...) or that holds a sentence-transformers "
                 "modules.json, else generate.", choices=("auto", "generate", "pooling"), engine_config=False),
    EngineOption("pooler_config", Optional[str], None,
                 "Overrides of the checkpoint's pooling config, as JSON: pooling_type (LAST, CLS, MEAN, ALL), "
                 "normalize, max_seq_length, matryoshka_dimensions (with runner=pooling; docs/pooling.md).",
                 engine_config=False),
    EngineOption("tensor_parallel_size", int, 1, "Devices to shard the model over (tensor parallelism).",
                 engine_config=False),
    EngineOption("pipeline_parallel_size", int, 1,
                 "Pipeline stages (contiguous layers each), each stage tensor_parallel_size devices.",
                 engine_config=False),
    EngineOption("num_microbatches", int, 1, "Microbatches a step's tokens are cut into so pipeline stages "
                                             "overlap (needs pipeline_parallel_size > 1).", engine_config=False),
    EngineOption("compilation_cache_dir", Optional[str], None,
                 "Persistent compilation cache directory ('' turns it off); default: "
                 "$RIDGELINE_COMPILATION_CACHE_DIR, else ~/.cache/ridgeline/jax.", engine_config=False),
)

BY_NAME = {o.name: o for o in OPTIONS}
ENGINE_CONFIG_OPTIONS = tuple(o for o in OPTIONS if o.engine_config)


def make_engine_config_class(module: str) -> type:
    """`EngineConfig`: a frozen dataclass of the `engine_config` options, fields in declaration order."""
    fields = [(o.name, o.type, dataclasses.field(default=o.default)) for o in ENGINE_CONFIG_OPTIONS]
    cls = dataclasses.make_dataclass("EngineConfig", fields, frozen=True)
    cls.__module__ = module  # where pickle and repr find it
    cls.__doc__ = ("How the engine batches, caches and samples; generated from `serving.core.engine_args.OPTIONS`, "
                   "the table `LLM(...)`'s keywords and the server's flags come from too.\n\n"
                   + describe(ENGINE_CONFIG_OPTIONS))
    return cls


def resolve(options: dict, caller: str = "LLM()") -> dict:
    """Every option's value: those given, the declared default for the rest. A name that is no option is a
    TypeError, as an unknown keyword argument would be."""
    unknown = sorted(set(options) - BY_NAME.keys())
    if unknown:
        raise TypeError(f"{caller} got an unexpected keyword argument {unknown[0]!r}")
    return {o.name: options.get(o.name, o.default) for o in OPTIONS}


def check_served(config, served: set) -> None:
    """Refuses an option of `config` (an `EngineConfig`) set to other than its default when none of the engine's
    parts serves it (`EngineOption.part` not in `served`): the engine would otherwise ignore it."""
    for o in ENGINE_CONFIG_OPTIONS:
        value = getattr(config, o.name)
        if o.part is not None and value != o.default and o.part not in served:
            raise ValueError(f"{o.name}={value!r} needs the {o.part} part, which this engine was not given: "
                             "build the engine's parts with serving.features.build_parts (as LLM does)")


def with_option_keywords(fn):
    """`fn`, which takes the options as **kwargs, with a signature that lists them instead, keyword-only
    with their defaults (what `help()` and `inspect.signature` show), and their help in its docstring.
    `fn` must not name an option itself: a second declaration, with a default of its own, would be
    the drift this table exists to prevent."""
    sig = inspect.signature(fn)
    head = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    named = sorted({p.name for p in head} & BY_NAME.keys())
    if named:
        raise TypeError(f"{fn.__qualname__} declares {named} itself; they are options of serving.core.engine_args")
    added = [inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=o.default, annotation=o.type)
             for o in OPTIONS]
    fn.__signature__ = sig.replace(parameters=head + added)
    fn.__doc__ = (fn.__doc__ or "").rstrip() + "\n\n" + describe(indent=" " * 8) + "\n"
    return fn


def describe(options=OPTIONS, indent: str = "    ") -> str:
    """One line per option (name = default: help), for docstrings."""
    return "\n".join(f"{indent}{o.name} = {o.default!r}: {o.help}" for o in options)


def define_flags(flag_values) -> None:
    """One absl flag per option, same name, default and help, into `flag_values` (an absl `FlagValues`)."""
    for o in OPTIONS:
        kind = o.base_type
        kw = dict(name=o.name, default=o.default, help=o.help, flag_values=flag_values)
        if o.choices is not None:
            flags.DEFINE_enum(enum_values=list(o.choices), **kw)
        elif kind is bool:
            flags.DEFINE_boolean(**kw)
        elif kind is int:
            flags.DEFINE_integer(**kw)
        elif kind is float:
            flags.DEFINE_float(**kw)
        elif kind is str:
            flags.DEFINE_string(**kw)
        else:
            raise TypeError(f"option {o.name}: no flag type for {o.type!r}")


def from_flags(flag_values) -> dict:
    """Every option's value from parsed flags, as `LLM(**...)` takes them."""
    return {o.name: getattr(flag_values, o.name) for o in OPTIONS}
