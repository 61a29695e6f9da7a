"""vLLM's server flag spellings, with vLLM's meanings, translated into the server's own flags.

`python -m serving.server` / `ridgeline serve` define their flags once
(`serving.core.engine_args.OPTIONS` for the engine, `serving.server` for the
server's own) under Ridgeline's names (`--max_model_len`). A vLLM command
line spells them with dashes (`--max-model-len 1k`), sometimes under another
name (`--gpu-memory-utilization`), sometimes as JSON (`--speculative-config`).
`translate` rewrites such a command line into Ridgeline flags before absl
parses it:

* a flag of `VLLM_FLAGS` is converted by its entry (names, values, JSON
  fields), or refused with a message saying why and what to do instead;
* any other dashed flag whose underscore spelling is a Ridgeline flag is that
  flag (`--page-size 8` is `--page_size=8`, `--no-async-scheduling` is
  `--noasync_scheduling`);
* an unknown dashed flag is refused with the nearest spellings suggested;
  Ridgeline's own spellings (underscores) go to absl as they are.

docs/vllm_flags.md lists `VLLM_FLAGS` (tests/test_vllm_flags.py keeps the two
the same).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from typing import Any, Callable, Iterable, Optional

# vLLM's --kv-cache-dtype / --dtype values and ours.
_KV_CACHE_DTYPES = {"auto": "auto", "bfloat16": "bfloat16", "fp8": "fp8", "fp8_e4m3": "fp8"}
_DTYPES = {"auto": "auto", "half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float": "float32",
           "float32": "float32"}
_SPECULATIVE_METHODS = {"ngram": "ngram", "draft_model": "draft"}
_UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


class VllmFlagError(ValueError):
    """A vLLM flag the server cannot honour, or a value it cannot read; the message says what to do."""


@dataclasses.dataclass(frozen=True)
class VllmFlag:
    """One vLLM flag: what it sets here (`convert`: its value -> {Ridgeline flag: value}) and how far vLLM's
    meaning is kept (`status`, for docs/vllm_flags.md)."""

    name: str  # vLLM's spelling, without the leading dashes
    ours: str  # what it becomes, as docs/vllm_flags.md shows it
    status: str
    convert: Callable[[Any], dict]
    kind: str = "value"  # "value": one value; "bool": --x / --no-x; "list": one or more values
    short: tuple = ()  # vLLM's one-dash abbreviations (-tp)


def _same(flag: str, parse: Callable = str) -> Callable[[Any], dict]:
    """The value as it is (read by `parse`), under Ridgeline's name `flag`."""
    return lambda value: {flag: parse(value)}


def _int(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise VllmFlagError(f"expected an integer, got {value!r}") from None


def _float(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise VllmFlagError(f"expected a number, got {value!r}") from None


def human_int(value: str) -> int:
    """vLLM's readable sizes: 1k = 1000, 1K = 1024 (m/M, g/G likewise), decimals allowed (25.6k)."""
    text = str(value).strip()
    scale = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    number = text[:-1] if scale != 1 else text
    try:
        result = float(number) * scale
    except ValueError:
        raise VllmFlagError(f"expected a length such as 4096, 4k or 4K, got {value!r}") from None
    if result != int(result):
        raise VllmFlagError(f"{value!r} is not a whole number of tokens")
    return int(result)


def _max_model_len(value: str) -> dict:
    """`auto` / -1: the model's context window capped by the KV pool (our default); else a length."""
    if str(value).strip().lower() in ("auto", "-1"):
        return {}
    return {"max_model_len": human_int(value)}


def _only_one(what: str, instead: str) -> Callable[[str], dict]:
    """A count of which only 1 (vLLM's default) is supported."""
    def convert(value: str) -> dict:
        if _int(value) != 1:
            raise VllmFlagError(f"{what} is not supported yet: {instead}")
        return {}
    return convert


def _gpu_memory_utilization(value: str) -> dict:
    fraction = _float(value)
    if not 0 < fraction <= 1:
        raise VllmFlagError(f"expected a fraction in (0, 1], got {value!r}")
    return {"kv_cache_memory_fraction": fraction}


def _choice(flag: str, table: dict, hint: str) -> Callable[[str], dict]:
    """vLLM's value looked up in `table` (vLLM's name -> ours); any other is refused with `hint`."""
    def convert(value: str) -> dict:
        if value not in table:
            raise VllmFlagError(f"{value!r} is not supported: {hint}")
        return {flag: table[value]}
    return convert


def _quantization(value: str) -> dict:
    if value == "fp8":
        return {"weight_dtype": "fp8"}
    raise VllmFlagError(f"{value!r} is not supported: fp8 quantizes a float checkpoint's linear layers at load "
                        "(as vLLM's does; --weight_dtype=int8 for int8); checkpoints already quantized are refused")


def _generation_config(value: str) -> dict:
    if value == "auto":
        return {"generation_config": "auto"}
    if value == "vllm":
        return {"generation_config": "off"}
    raise VllmFlagError(f"a generation config folder ({value!r}) is not supported: pass auto (the checkpoint's "
                        "generation_config.json) or vllm (none), or put the file in the checkpoint directory")


def _single_name(values: list) -> dict:
    if len(values) != 1:
        raise VllmFlagError(f"one name is served, got {len(values)} ({' '.join(values)})")
    return {"served_model_name": values[0]}


def _lora_modules(values: list) -> dict:
    """vLLM's `name=path` pairs or JSON objects ({"name", "path", "base_model_name"}), as name=path,..."""
    pairs = []
    for value in values:
        if value.lstrip().startswith("{"):
            spec = _json_object(value)
            if not isinstance(spec.get("name"), str) or not isinstance(spec.get("path"), str):
                raise VllmFlagError(f"a JSON LoRA module needs \"name\" and \"path\" strings, got {value!r}")
            pairs.append(f"{spec['name']}={spec['path']}")
        elif "=" in value:
            pairs.append(value)
        else:
            raise VllmFlagError(f"expected name=path or a JSON object, got {value!r}")
    return {"lora_modules": ",".join(pairs)}


def _json_object(value: str) -> dict:
    try:
        spec = json.loads(value)
    except json.JSONDecodeError as e:
        raise VllmFlagError(f"invalid JSON ({e.msg} at character {e.pos}): {value!r}") from None
    if not isinstance(spec, dict):
        raise VllmFlagError(f"expected a JSON object, got {value!r}")
    return spec


def _refuse_unknown_keys(spec: dict, known: Iterable[str]) -> None:
    unknown = sorted(set(spec) - set(known))
    if unknown:
        raise VllmFlagError(f"field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} not supported "
                            f"(supported: {', '.join(sorted(known))})")


def _speculative_config(value: str) -> dict:
    """{"method": "ngram" | "draft_model", "model": ..., "num_speculative_tokens": k}; a model without a
    method is a draft model, as in vLLM."""
    spec = _json_object(value)
    _refuse_unknown_keys(spec, ("method", "model", "num_speculative_tokens", "prompt_lookup_max",
                                "prompt_lookup_min"))
    method = spec.get("method") or ("draft_model" if spec.get("model") else None)
    if method not in _SPECULATIVE_METHODS:
        raise VllmFlagError(f"method {method!r} is not supported (supported: {', '.join(_SPECULATIVE_METHODS)})")
    _check_prompt_lookup(spec)
    out = {"speculative_method": _SPECULATIVE_METHODS[method]}
    if "num_speculative_tokens" in spec:
        out["num_speculative_tokens"] = _int(str(spec["num_speculative_tokens"]))
    if spec.get("model"):
        if method == "ngram":
            raise VllmFlagError("method ngram takes no model")
        out["speculative_model"] = str(spec["model"])
    return out


def _check_prompt_lookup(spec: dict) -> None:
    """prompt_lookup_max / _min are accepted as the sizes the n-gram proposer matches, and refused otherwise."""
    from serving.spec_decode.ngram import MAX_N, MIN_N

    for key, ours in (("prompt_lookup_max", MAX_N), ("prompt_lookup_min", MIN_N)):
        if key in spec and spec[key] != ours:
            raise VllmFlagError(f"{key}={spec[key]!r} is not supported: prompt lookup matches n-grams of "
                                f"{MIN_N} to {MAX_N} tokens (prompt_lookup_min={MIN_N}, prompt_lookup_max={MAX_N})")


def _structured_outputs_config(value: str) -> dict:
    """Fields of vLLM's StructuredOutputsConfig: the backend is llguidance's (auto and guidance name it)."""
    spec = _json_object(value)
    _refuse_unknown_keys(spec, ("backend", "disable_any_whitespace", "disable_fallback", "reasoning_parser",
                                "enable_in_reasoning"))
    out: dict = {}
    if spec.get("backend", "auto") not in ("auto", "guidance"):
        raise VllmFlagError(f"backend {spec['backend']!r} is not supported: grammars run on llguidance "
                            "(backend auto or guidance)")
    if spec.get("enable_in_reasoning"):
        raise VllmFlagError("enable_in_reasoning is not supported: grammars apply after the thinking")
    if "disable_any_whitespace" in spec:
        out["structured_outputs_whitespace"] = not spec["disable_any_whitespace"]
    if spec.get("reasoning_parser"):
        out["reasoning_parser"] = spec["reasoning_parser"]
    return out


def _chunked_prefill(on: bool) -> dict:
    if not on:
        raise VllmFlagError("prefill is always chunked (chunks up to --max-num-batched-tokens); drop the flag")
    return {}


def _bool(flag: Optional[str]) -> Callable[[bool], dict]:
    """A vLLM on/off flag: Ridgeline's boolean `flag`, or (None) accepted with no effect."""
    return lambda on: {flag: on} if flag else {}


def _uvicorn_log_level(value: str) -> dict:
    if value not in _UVICORN_LOG_LEVELS:
        raise VllmFlagError(f"expected one of {', '.join(_UVICORN_LOG_LEVELS)}, got {value!r}")
    return {"uvicorn_log_level": value}


SAME = "same meaning"
_POOLING_TASKS = ("embed", "embedding", "classify", "score", "reward")


def _runner(value: str) -> dict:
    if value not in ("generate", "pooling", "auto"):
        raise VllmFlagError(f"--runner {value}: Ridgeline runs generate, pooling or auto")
    return {"runner": value}


def _convert(value: str) -> dict:
    if value in ("none", "auto"):
        return {}
    if value in _POOLING_TASKS:
        return {"runner": "pooling"}
    raise VllmFlagError(f"--convert {value}: Ridgeline converts to embed, classify or reward (or none / auto)")


def _task(value: str) -> dict:
    if value in _POOLING_TASKS:
        return {"runner": "pooling"}
    if value in ("generate", "auto"):
        return {"runner": "generate" if value == "generate" else "auto"}
    raise VllmFlagError(f"--task {value}: Ridgeline serves generate, embed, classify, score and reward")
VLLM_FLAGS: tuple[VllmFlag, ...] = (
    VllmFlag("model", "MODEL (--checkpoint)", "same meaning; MODEL may also come first, as `vllm serve MODEL`",
             _same("checkpoint")),
    VllmFlag("host", "--host", SAME, _same("host")),
    VllmFlag("port", "--port", SAME, _same("port", _int)),
    VllmFlag("api-key", "--api_key", "same meaning; several keys may follow", lambda v: {"api_key": ",".join(v)},
             kind="list"),
    VllmFlag("served-model-name", "--served_model_name", "one name (vLLM takes several)", _single_name, kind="list"),
    VllmFlag("max-model-len", "--max_model_len", "same meaning, 4k / 4K / auto included", _max_model_len),
    VllmFlag("tensor-parallel-size", "--tensor_parallel_size", SAME, _same("tensor_parallel_size", _int),
             short=("tp",)),
    VllmFlag("pipeline-parallel-size", "--pipeline_parallel_size", SAME, _same("pipeline_parallel_size", _int),
             short=("pp",)),
    VllmFlag("data-parallel-size", "(none)", "1 only; more is refused (run one server per replica behind "
             "`python -m serving.router`)",
             _only_one("data parallelism", "run one server per replica behind python -m serving.router"),
             short=("dp",)),
    VllmFlag("gpu-memory-utilization", "--kv_cache_memory_fraction",
             "same meaning: the share of device memory this server may use, the KV pool taking what the weights "
             "leave", _gpu_memory_utilization),
    VllmFlag("max-num-seqs", "--max_num_seqs", SAME, _same("max_num_seqs", _int)),
    VllmFlag("max-num-batched-tokens", "--max_num_batched_tokens", SAME,
             _same("max_num_batched_tokens", human_int)),
    VllmFlag("enable-prefix-caching", "--enable_prefix_caching", "same meaning (on by default, as in vLLM)",
             _bool("enable_prefix_caching"), kind="bool"),
    VllmFlag("enable-chunked-prefill", "(always on)", "accepted; --no-enable-chunked-prefill is refused (prefill "
             "is always chunked)", _chunked_prefill, kind="bool"),
    VllmFlag("kv-cache-dtype", "--kv_cache_dtype", "auto, bfloat16, fp8 and fp8_e4m3 (fp8 with per-token "
             "scales); fp8_e5m2 and the others are refused",
             _choice("kv_cache_dtype", _KV_CACHE_DTYPES, "use auto, bfloat16, fp8 or fp8_e4m3")),
    VllmFlag("dtype", "--dtype", "same meaning (half = float16, float = float32); auto computes a bf16 "
             "checkpoint in float32 on CPU", _choice("dtype", _DTYPES, f"use one of {', '.join(_DTYPES)}")),
    VllmFlag("quantization", "--weight_dtype", "fp8 (weights quantized at load); other methods are refused",
             _quantization, short=("q",)),
    VllmFlag("seed", "--seed", SAME, _same("seed", _int)),
    VllmFlag("logprobs-mode", "--logprobs_mode", "raw_logprobs and processed_logprobs; raw_logits and "
             "processed_logits are refused", _choice("logprobs_mode", {m: m for m in ("raw_logprobs",
                                                                                    "processed_logprobs")},
                                                    "use raw_logprobs or processed_logprobs")),
    VllmFlag("chat-template", "--chat_template", "same meaning: a file, or the template itself",
             _same("chat_template")),
    VllmFlag("generation-config", "--generation_config", "auto (the checkpoint's) and vllm (none, = off); a "
             "folder is refused", _generation_config),
    VllmFlag("enable-lora", "--enable_lora", SAME, _bool("enable_lora"), kind="bool"),
    VllmFlag("lora-modules", "--lora_modules", "same meaning: name=path pairs or JSON objects", _lora_modules,
             kind="list"),
    VllmFlag("max-lora-rank", "--max_lora_rank", SAME, _same("max_lora_rank", _int)),
    VllmFlag("max-loras", "--max_loras", SAME, _same("max_loras", _int)),
    VllmFlag("speculative-config", "--speculative_method, --num_speculative_tokens, --speculative_model",
             "methods ngram and draft_model (a model without a method is a draft model); fields method, "
             "model, num_speculative_tokens, and prompt_lookup_max / _min at 4 / 1 (the n-gram sizes matched)",
             _speculative_config),
    VllmFlag("tool-call-parser", "--tool_call_parser", "same meaning, for the parsers Ridgeline has",
             _same("tool_call_parser")),
    VllmFlag("enable-auto-tool-choice", "(with --tool_call_parser)", "accepted, needs --tool-call-parser (as in "
             "vLLM); tool_choice \"auto\" is on whenever a parser is set", _bool(None), kind="bool"),
    VllmFlag("reasoning-parser", "--reasoning_parser", "same meaning, for the parsers Ridgeline has",
             _same("reasoning_parser")),
    VllmFlag("structured-outputs-config", "--structured_outputs_whitespace, --reasoning_parser",
             "backend auto / guidance (llguidance), disable_any_whitespace, reasoning_parser; other backends "
             "are refused", _structured_outputs_config),
    VllmFlag("disable-log-requests", "(nothing)", "accepted, no effect: requests are never logged", _bool(None),
             kind="bool"),
    VllmFlag("uvicorn-log-level", "--uvicorn_log_level", SAME, _uvicorn_log_level),
    VllmFlag("runner", "--runner", "generate, pooling and auto (draft is refused)", _runner),
    VllmFlag("convert", "--runner", "embed, classify and reward: served as pooling (--runner pooling); none and "
             "auto: unchanged", _convert),
    VllmFlag("task", "--runner", "the older spelling: embed, classify, score, reward -> pooling; generate -> "
             "generate", _task),
    VllmFlag("pooler-config", "--pooler_config", "pooling_type (LAST, CLS, MEAN, ALL), normalize, dimensions "
             "bounds (docs/pooling.md); other fields are refused when the model loads", _same("pooler_config")),
    VllmFlag("api-server-count", "(none)", "1 only; more is refused",
             _only_one("more than one API server process", "run one server per replica behind "
                       "python -m serving.router")),
)
BY_NAME = {f.name: f for f in VLLM_FLAGS}
BY_SHORT = {s: f for f in VLLM_FLAGS for s in f.short}


def translate(argv: list[str], known: Iterable[str], booleans: Iterable[str] = ()) -> list[str]:
    """`argv` (argv[0] first) with vLLM's flags rewritten as Ridgeline's. `known`: every Ridgeline flag name;
    `booleans`: those of them that are boolean. Raises `VllmFlagError` naming the flag as it was written."""
    known, booleans = set(known), set(booleans)
    out, given = [argv[0]], set()
    rest = list(argv[1:])
    while rest:
        arg = rest.pop(0)
        if arg == "--":
            out += [arg] + rest
            break
        if not arg.startswith("-") or arg == "-" or _is_number(arg):
            out.append(arg)
            continue
        name, eq, inline = arg.lstrip("-").partition("=")
        value = inline if eq else None
        try:
            flag, on = _lookup(name, arg.startswith("--"))
            if flag is not None:
                given.add(flag.name)
                out += _render(flag.convert(_take_value(flag, on, value, rest)))
            else:
                out.append(_ridgeline_spelling(arg, name, eq, inline, known, booleans))
        except VllmFlagError as e:
            raise VllmFlagError(f"{arg.partition('=')[0]}: {e}") from None
    if "enable-auto-tool-choice" in given and not any(a.startswith("--tool_call_parser=") for a in out):
        raise VllmFlagError("--enable-auto-tool-choice needs --tool-call-parser (the format tool calls are read in)")
    return out


def _lookup(name: str, double_dash: bool) -> tuple[Optional[VllmFlag], bool]:
    """The vLLM flag `name` spells (`--no-x` turns boolean x off), and whether it is on."""
    if not double_dash:
        return BY_SHORT.get(name), True
    if name in BY_NAME:
        return BY_NAME[name], True
    if name.startswith("no-") and BY_NAME.get(name[3:]) and BY_NAME[name[3:]].kind == "bool":
        return BY_NAME[name[3:]], False
    return None, True


def _take_value(flag: VllmFlag, on: bool, inline: Optional[str], rest: list[str]):
    """The flag's value: inline (`--x=v`), else the next argument (a list: every argument up to the next flag);
    a boolean's is whether it is on."""
    if flag.kind == "bool":
        if inline is None:
            return on
        if inline.lower() not in ("true", "false", "1", "0"):
            raise VllmFlagError(f"takes no value (or true / false), got {inline!r}")
        return on == (inline.lower() in ("true", "1"))
    if inline is not None:
        values = [inline]
    else:
        values = []
        while rest and (not rest[0].startswith("-") or _is_number(rest[0])) and (flag.kind == "list" or not values):
            values.append(rest.pop(0))
        if not values:
            raise VllmFlagError("needs a value")
    return values if flag.kind == "list" else values[0]


def _render(values: dict) -> list[str]:
    """absl arguments setting `values` (booleans as --x / --nox)."""
    return [(f"--{k}" if v else f"--no{k}") if isinstance(v, bool) else f"--{k}={v}" for k, v in values.items()]


def _ridgeline_spelling(arg: str, name: str, eq: str, inline: str, known: set, booleans: set) -> str:
    """`arg` in Ridgeline's spelling: a dashed name whose underscore form is a flag becomes it; an unknown
    dashed name is refused with the nearest spellings; anything else is left to absl."""
    if "-" not in name:
        return arg
    underscored = name.replace("-", "_")
    if underscored in known:
        return f"--{underscored}{eq}{inline}"
    if underscored.startswith("no_") and underscored[3:] in booleans:
        return f"--no{underscored[3:]}{eq}{inline}"
    raise VllmFlagError(f"unknown flag{_suggestion(name, known)} (--helpfull lists the flags, docs/vllm_flags.md "
                        "the vLLM spellings)")


def _suggestion(name: str, known: set) -> str:
    """'; did you mean --x?' for the spellings (vLLM's and Ridgeline's dashed ones) nearest `name`."""
    spellings = set(BY_NAME) | {k.replace("_", "-") for k in known}
    near = difflib.get_close_matches(name, sorted(spellings), n=3, cutoff=0.6)
    return f"; did you mean {' or '.join('--' + n for n in near)}?" if near else ""


def _is_number(arg: str) -> bool:
    try:
        float(arg)
        return True
    except ValueError:
        return False


def markdown_table() -> str:
    """The table of docs/vllm_flags.md: vLLM flag | Ridgeline flag | status."""
    rows = ["| vLLM flag | Ridgeline flag | status |", "|---|---|---|"]
    for f in VLLM_FLAGS:
        spelled = f"`--{f.name}`" + "".join(f" / `-{s}`" for s in f.short)
        if f.kind == "bool":
            spelled += f" / `--no-{f.name}`"
        rows.append(f"| {spelled} | {f.ours} | {f.status} |")
    return "\n".join(rows)
