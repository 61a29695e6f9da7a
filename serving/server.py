"""`python -m serving.server`: the OpenAI-compatible HTTP server.

    python -m serving.server --port 8000                       # the embedded byte model
    python -m serving.server --checkpoint /ckpt/llama3-8b --max_num_seqs 256 \\
        --max_num_batched_tokens 4096 --page_size 16
    ridgeline serve Qwen/Qwen3-0.6B --max-model-len 4k         # vLLM's spelling (serving.vllm_flags)

The model is the first argument or `--checkpoint`: a Ridgeline checkpoint, a
Hugging Face checkpoint directory or a Hub id (`serving.model_source`, which
converts a Hugging Face checkpoint once and caches the result).

Startup turns on JAX's persistent compilation cache (`serving.compilation.compile_cache`;
`--compilation_cache_dir`, default `~/.cache/ridgeline/jax`), builds the `LLM`
(loading the checkpoint), compiles the smallest and the largest step shape
(with a warm cache they are loaded from disk instead), starts the engine loop
on its own thread (`AsyncEngine`) and serves the FastAPI app from
`serving.api.http_app` with uvicorn, while the other step shapes compile in
the background, one at a time (`--warmup=full` compiles them all first;
`serving.compilation.step_programs`). `/health` answers 200 from then on, with
`{"status": "warming"}` until the last shape is compiled and `{"status":
"ready"}` after. The port is checked before anything is loaded. The log says
what was loaded, how big the KV pool is (pages, tokens, bytes), how long
loading and warm-up took, and a progress line per compiled step shape.

Multi-host: every process runs this same command (e.g. through `python -m
serving.launch`, or one per node under SLURM with `--distributed`); they join
JAX's distributed runtime first (`--coordinator_address`, `--num_processes`,
`--process_id`, else the `RIDGELINE_*` environment, else cluster
auto-detection). Process 0 serves HTTP and schedules; the others follow its
device calls until it shuts down (`serving.cluster.multihost`).

`ServerThread` runs the same stack inside a Python process (tests, benchmarks,
notebooks): uvicorn on a background thread, bound to loopback by default.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import sys
import threading
import time
from typing import Optional

from absl import app as absl_app
from absl import flags

log = logging.getLogger("ridgeline.server")

FLAGS = flags.FLAGS
SECRET_ENV = "RIDGELINE_KV_TRANSFER_SECRET"
API_KEY_ENV = "RIDGELINE_API_KEY"


def define_flags(flag_values: Optional[flags.FlagValues] = None) -> None:
    """The command-line flags, defined only when the server runs as a program (importing this module from
    tests or other binaries must not claim flag names such as --seed or --checkpoint). `flag_values`: where
    to define them (default: absl's global FLAGS; tests pass a fresh `flags.FlagValues()`).

    The engine options (--max_num_seqs, --min_token_bucket, ...) come from `serving.core.engine_args`, with the
    defaults `LLM` has; the flags below are the server's own."""
    from serving.api.request_limits import DEFAULT_MAX_BODY_BYTES
    from serving.api.reasoning import PARSER_NAMES as REASONING_PARSERS
    from serving.api.responses_store import DEFAULT_MAX_ENTRIES, DEFAULT_TTL_S
    from serving.api.tool_parsers import PARSERS as PARSER_NAMES
    from serving.core import engine_args

    fv = FLAGS if flag_values is None else flag_values
    flags = _DefinitionsInto(fv)  # every flags.DEFINE_* below lands in `fv`
    engine_args.define_flags(fv)
    flags.DEFINE_string("checkpoint", None, "The model (also the first argument, as `vllm serve MODEL`): a Ridgeline "
                        "checkpoint directory, a Hugging Face checkpoint directory (converted on first use, the "
                        "copy cached beside the compilation cache) or a Hugging Face Hub id (org/name; "
                        "HF_HUB_OFFLINE=1: from the cache only); none serves the embedded default model.")
    flags.DEFINE_string("chat_template", None, "A chat template replacing the checkpoint's: a file, or the Jinja "
                        "template itself.")
    flags.DEFINE_string("host", "127.0.0.1", "Address to bind (0.0.0.0 to serve other machines).")
    flags.DEFINE_integer("port", 8000, "Port to listen on.")
    flags.DEFINE_enum("warmup", "background", ["background", "full"],
                      "background: serve once the smallest and the largest step shape are compiled, the rest "
                      "compiling one at a time meanwhile (a step whose shape is not ready runs padded into a "
                      "larger one); full: compile every step shape before serving.")
    flags.DEFINE_string("served_model_name", None, "The model name clients send (default: the checkpoint's).")
    flags.DEFINE_float("peak_bandwidth_gbps", None, "Device memory bandwidth for MBU, GB/s (default: GPU table).")
    flags.DEFINE_float("peak_tflops", None, "Device dense bf16 TFLOP/s for MFU (default: GPU table).")
    flags.DEFINE_float("metrics_window_s", 10.0, "Window of the MBU/MFU gauges, seconds.")
    flags.DEFINE_string("profile_dir", None, "Directory for /start_profile and /stop_profile traces "
                                             "(unset: those routes answer 400).")
    flags.DEFINE_boolean("kv_transfer_warmup", False, "Also compile the KV export/import of disaggregated "
                                                      "serving at startup (/internal/prefill, /internal/decode).")
    flags.DEFINE_string("kv_transfer_secret", None, "Shared secret of disaggregated serving: mounts /internal/prefill "
                        "and /internal/decode, whose KV payloads are signed and verified with it (HMAC-SHA256); "
                        "every prefill and decode worker gets the same one. Unset: those routes do not exist. "
                        f"Default: ${SECRET_ENV} (prefer it: flags show in the process list).")
    flags.DEFINE_string("api_key", None, "Comma-separated API keys; when set, the /v1 routes, /internal/prefill and "
                        f"the profiling routes need 'Authorization: Bearer <key>'. Default: ${API_KEY_ENV}.")
    flags.DEFINE_boolean("allow_runtime_lora_updating", False, "Mount POST /v1/load_lora_adapter and "
                         "/v1/unload_lora_adapter (behind --api_key when set), which load and unload LoRA adapters "
                         "while serving (needs --enable_lora).")
    flags.DEFINE_boolean("enable_rl_routes", False, "Mount the routes an RL trainer drives the server with: POST "
                         "/sleep, /wake_up, /pause, /resume, /reset_prefix_cache, /update_weights and GET "
                         "/is_sleeping, /is_paused (behind "
                         "--api_key when set). vLLM's VLLM_SERVER_DEV_MODE=1 turns them on too.")
    flags.DEFINE_list("rl_checkpoint_roots", [], "Directories POST /update_weights may read checkpoints under "
                      "(symlinks resolved); empty: it reads none.")
    flags.DEFINE_boolean("cache_salt_per_api_key", False, "Bind every request's prefix-cache salt to its API key, "
                         "so clients with different keys never share cached KV pages (needs --api_key).")
    flags.DEFINE_enum("tool_call_parser", None, sorted(PARSER_NAMES), "How tool calls are read from the output "
                      "when tool_choice is \"auto\": the model's format (unset: \"auto\" is refused).")
    flags.DEFINE_integer("max_request_body_bytes", DEFAULT_MAX_BODY_BYTES, "Largest request body accepted on any "
                         "route but the KV routes (which bound their own): a larger declared or streamed body is a "
                         "413 before it is buffered (0: no limit).")
    flags.DEFINE_integer("max_concurrent_requests_per_key", 0, "Most generating requests (POST /v1/*) one API key "
                         "(on an open server: one client address) may have in flight; one more is a 429 with "
                         "Retry-After (0: no limit).")
    flags.DEFINE_float("shutdown_timeout_s", 30.0, "On SIGTERM the server refuses new requests (503, /health "
                       "too) and gives those in flight this long to finish; the rest then end with an in-band "
                       "error and the process exits 0. A second SIGTERM stops at once.")
    flags.DEFINE_enum("reasoning_parser", None, list(REASONING_PARSERS), "How a reasoning model's thinking is told "
                      "from its answer (message.reasoning_content; thinking budgets; grammars applied after thinking): "
                      "qwen3, deepseek_r1, or auto (the think tags read from the tokenizer). Unset: outputs are not split.")
    flags.DEFINE_integer("responses_store_max_entries", DEFAULT_MAX_ENTRIES, "The most responses /v1/responses "
                         "keeps for previous_response_id and GET (the oldest go first); 0: store: true is refused.")
    flags.DEFINE_float("responses_store_ttl_s", DEFAULT_TTL_S, "How long /v1/responses keeps a stored response, "
                       "in seconds.")
    flags.DEFINE_list("allowed_media_domains", [], "Hosts whose http(s) image URLs the server fetches for chat "
                                                   "image parts (exact names; default none: data: URLs only).")
    flags.DEFINE_integer("media_max_bytes", 20 << 20, "Largest encoded image a request may carry or a fetch may "
                                                      "return, bytes.")
    flags.DEFINE_float("media_fetch_timeout_s", 10.0, "Longest an image URL fetch may take, seconds.")
    flags.DEFINE_enum("log_level", "info", ["debug", "info", "warning", "error"], "Log level of the server.")
    flags.DEFINE_enum("uvicorn_log_level", None, ["critical", "error", "warning", "info", "debug", "trace"],
                      "Log level of uvicorn (its access log among it); default: --log_level.")
    flags.DEFINE_string("coordinator_address", None, "Multi-host: host:port of process 0's coordination service "
                                                     "(default: $RIDGELINE_COORDINATOR_ADDRESS, else detected).")
    flags.DEFINE_integer("num_processes", None, "Multi-host: number of processes (default: "
                                                "$RIDGELINE_NUM_PROCESSES, else detected).")
    flags.DEFINE_integer("process_id", None, "Multi-host: this process's index, 0 serves HTTP (default: "
                                             "$RIDGELINE_PROCESS_ID, else detected).")
    flags.DEFINE_boolean("distributed", None, "Multi-host: join the runtime even with none of the above set, "
                                              "letting jax.distributed detect the cluster (SLURM, Open MPI, ...).")
    flags.DEFINE_integer("distributed_init_timeout_s", None, "Multi-host: every process must join within this "
                                                             "(default 120).")
    flags.DEFINE_integer("distributed_heartbeat_timeout_s", None, "Multi-host: a process silent this long is "
                                                                  "declared dead, ending the run (default 30).")
    flags.DEFINE_float("distributed_call_timeout_s", None, "Multi-host: longest wait on a live peer (a device "
                                                           "call, or process 0's next call) (default 300).")


class _DefinitionsInto:
    """absl's `flags.DEFINE_*` functions with `flag_values` bound, so `define_flags` can define into a
    `FlagValues` of the caller's choosing while reading like plain absl."""

    def __init__(self, flag_values: flags.FlagValues):
        self._flag_values = flag_values

    def __getattr__(self, name: str):
        return functools.partial(getattr(flags, name), flag_values=self._flag_values)


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def responses_store_from_flags():
    from serving.api.responses_store import ResponseStore

    return ResponseStore(FLAGS.responses_store_max_entries, FLAGS.responses_store_ttl_s)


def default_model_name(llm) -> str:
    """The name clients send by default: what MODEL gave (a Hub id as written, a directory's base name)."""
    if getattr(llm, "model_name", None):
        return llm.model_name
    return os.path.basename(os.path.normpath(llm.checkpoint)) if llm.checkpoint else "ridgeline-random"


def build_stack(llm, model_name: str | None = None, *, peak=None, metrics_window_s: float = 10.0,
                num_devices: int = 1, profile_dir: str | None = None, api_keys=None,
                kv_transfer_secret: str | None = None, tool_call_parser: str | None = None, limits=None,
                shutdown_timeout_s: float = 30.0, reasoning_parser: str | None = None, responses_store=None,
                media=None, allow_lora_updates: bool = False, rl_routes=None):
    """(FastAPI app, AsyncEngine, ServerMetrics) over an `LLM` whose engine is not yet running.

    The engine thread starts here; stop it with `async_engine.shutdown()`. `profile_dir` enables
    `/start_profile` and `/stop_profile` (traces land there); `api_keys` (`http_auth.APIKeys`)
    guards the API; `kv_transfer_secret` mounts the signed KV routes of disaggregated serving;
    `tool_call_parser` reads the calls of `tool_choice="auto"` (`serving.api.tool_parsers`);
    `limits` (`request_limits.RequestLimits`, default: its defaults) bounds bodies and per-key concurrency;
    `app.state.drain` (`serving.api.drain.Drain`) drains the server, in-flight requests getting up to
    `shutdown_timeout_s`.
    `media` (`serving.api.media.MediaOptions`) says where image URLs may be fetched from and how much.
    `allow_lora_updates` mounts the LoRA load / unload routes (`serving.api.lora_routes`); `rl_routes`
    (`serving.api.rl_routes.RLRouteOptions`, None: off) the routes an RL trainer drives the server with.
    """
    from serving.api.drain import Drain, DrainGate
    from serving.api.request_limits import RequestLimits, add_request_limits

    from serving.async_engine import AsyncEngine
    from serving.api.http_app import create_app
    from serving.api.http_metrics import ModelCost, ServerMetrics

    model_name = model_name or default_model_name(llm)
    engine = llm.engine
    runner = engine.runner
    cost = ModelCost.from_config(llm.config, weight_bytes=_param_bytes(runner),
                                 kv_bytes_per_element=None, num_devices=num_devices,
                                 streamed_weight_bytes=_streamed_weight_bytes(runner, llm.config),
                                 kv_bytes_per_token=_kv_bytes_per_token(engine))
    async_engine = AsyncEngine(engine)
    try:
        metrics = ServerMetrics(async_engine, model_name, cost, peak, metrics_window_s,
                                max_model_len=engine.max_model_len).attach()
        fastapi_app = create_app(async_engine, llm.tokenizer, model_name, engine.max_model_len, metrics,
                                 vocab_size=llm.config.vocab_size, profile_dir=profile_dir, api_keys=api_keys,
                                 kv_transfer_secret=kv_transfer_secret, tool_call_parser=tool_call_parser,
                                 reasoning_parser=reasoning_parser, responses_store=responses_store, media=media,
                                 allow_lora_updates=allow_lora_updates, rl_routes=rl_routes)
    except BaseException:  # an option create_app refuses: no engine thread is left running behind the error
        async_engine.shutdown()
        raise
    add_request_limits(fastapi_app, limits or RequestLimits())
    drain = fastapi_app.state.drain = Drain(async_engine, shutdown_timeout_s)
    fastapi_app.add_middleware(DrainGate, drain=drain)  # outermost: a draining server reads no body
    return fastapi_app, async_engine, metrics


def _param_bytes(runner) -> float | None:
    from model.params import param_bytes

    params = getattr(runner, "params", None)
    return float(param_bytes(params)) if params is not None else None


def _streamed_weight_bytes(runner, cfg) -> float | None:
    from model.quant import streamed_weight_bytes

    params = getattr(runner, "params", None)
    return float(streamed_weight_bytes(params, cfg)) if params is not None else None


def _kv_bytes_per_token(engine) -> float | None:
    from model.families import kv_bytes_per_token

    dtype = getattr(engine, "cache_dtype", None)
    return float(kv_bytes_per_token(engine.cfg, dtype)) if dtype is not None else None


def describe_startup(llm) -> list[str]:
    """The startup log lines: model, KV pool, load and warm-up time, compilation cache."""
    import jax.numpy as jnp

    from model.families import kv_bytes_per_token, num_params

    cfg, engine = llm.config, llm.engine
    runner = engine.runner
    lines = [
        f"model: {llm.checkpoint or 'in-memory weights'}; {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_heads} heads / {cfg.num_kv_heads} KV heads, vocab {cfg.vocab_size}, dtype {cfg.dtype}"
        f"{', linear weights ' + cfg.weight_dtype if cfg.weight_dtype else ''}; "
        f"{num_params(cfg) / 1e6:.1f}M parameters, {_human_bytes(_param_bytes(runner) or 0)} of weights; "
        f"tokenizer {type(llm.tokenizer).__name__}",
    ]
    pool_bytes = runner.cache_bytes
    kv_dtype = jnp.dtype(getattr(engine, "cache_dtype", None) or cfg.jnp_dtype).name
    lines.append(
        f"KV pool: {engine.num_pages} pages x {engine.config.page_size} tokens = "
        f"{engine.num_pages * engine.config.page_size} tokens, {_human_bytes(pool_bytes)} "
        f"({_human_bytes(_kv_bytes_per_token(engine) or kv_bytes_per_token(cfg))} per token, {kv_dtype}); "
        f"max_model_len {engine.max_model_len}; "
        f"max_num_seqs {engine.config.max_num_seqs}, max_num_batched_tokens {engine.config.max_num_batched_tokens}, "
        f"prefix caching {'on' if engine.config.enable_prefix_caching else 'off'}")
    lines.append(f"loaded in {llm.load_seconds:.1f} s")
    if llm.warmup_info:
        from serving.compilation.compile_cache import describe_warmup

        lines.append(describe_warmup(llm.warmup_info, getattr(llm, "compilation_cache_dir", None)))
    return lines


def check_port_free(host: str, port: int) -> None:
    """Exits with a message when `host:port` cannot be bound: before loading, not after a warm-up."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise SystemExit(f"cannot listen on {host}:{port}: {e.strerror or e}; stop what holds it or pass "
                             "another --port") from None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """The whole server (engine thread + uvicorn) inside this process, for tests and benchmarks.

        with ServerThread(llm, model_name="tiny") as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
    """

    def __init__(self, llm, model_name: str | None = None, host: str = "127.0.0.1", port: int | None = None,
                 peak=None, log_level: str = "warning", profile_dir: str | None = None, api_keys=None,
                 kv_transfer_secret: str | None = None, tool_call_parser: str | None = None, limits=None,
                 reasoning_parser: str | None = None, responses_store=None, media=None,
                 allow_lora_updates: bool = False, rl_routes=None):
        import uvicorn

        self.app, self.async_engine, self.metrics = build_stack(llm, model_name, peak=peak,
                                                                profile_dir=profile_dir, api_keys=api_keys,
                                                                kv_transfer_secret=kv_transfer_secret,
                                                                tool_call_parser=tool_call_parser, limits=limits,
                                                                reasoning_parser=reasoning_parser,
                                                                responses_store=responses_store, media=media,
                                                                allow_lora_updates=allow_lora_updates,
                                                                rl_routes=rl_routes)
        self.model_name = model_name or default_model_name(llm)
        self.host, self.port = host, port or free_port(host)
        config = uvicorn.Config(self.app, host=self.host, port=self.port, log_level=log_level,
                                timeout_keep_alive=30, lifespan="off")
        from serving.api.drain import DrainingServer

        self._server = DrainingServer(config, self.app.state.drain)
        self._thread = threading.Thread(target=self._server.run, name="ridgeline-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self.app.state.profiler.stop_if_running()
        self.async_engine.shutdown()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def join_from_flags() -> bool:
    """Joins the multi-process runtime when the flags or environment ask for it (before any device use)."""
    from serving.cluster import distributed

    return distributed.initialize(
        coordinator_address=FLAGS.coordinator_address, num_processes=FLAGS.num_processes,
        process_id=FLAGS.process_id, auto=FLAGS.distributed, init_timeout_s=FLAGS.distributed_init_timeout_s,
        heartbeat_timeout_s=FLAGS.distributed_heartbeat_timeout_s, call_timeout_s=FLAGS.distributed_call_timeout_s)


def make_llm_from_flags(flag_values: Optional[flags.FlagValues] = None):
    """The `LLM` the flags describe: every engine option passed through, every shape compiled up front."""
    from serving.core import engine_args
    from serving.llm import LLM

    fv = FLAGS if flag_values is None else flag_values
    return LLM(fv.checkpoint, warmup="background" if fv.warmup == "background" else True,
               **engine_args.from_flags(fv))


def _peak_from_flags():
    from serving.api.http_metrics import device_peak

    bw = FLAGS.peak_bandwidth_gbps * 1e9 if FLAGS.peak_bandwidth_gbps else None
    fl = FLAGS.peak_tflops * 1e12 if FLAGS.peak_tflops else None
    peak = device_peak(bandwidth=bw, flops=fl)
    if peak is None:
        log.info("device peak figures unknown (not in the GPU table, no --peak_* flags): MBU/MFU gauges are off")
    else:
        log.info("device peaks for MBU/MFU: %s, %.0f GB/s, %.0f TFLOP/s", peak.name, peak.bandwidth / 1e9,
                 peak.flops / 1e12)
    return peak


def _limits_from_flags():
    from serving.api.request_limits import RequestLimits

    return RequestLimits(max_body_bytes=FLAGS.max_request_body_bytes,
                         max_concurrent_per_key=FLAGS.max_concurrent_requests_per_key)


# What a start is refused with: an option or flag value the code checks (ValueError), or a checkpoint or file
# that is missing or unusable (OSError); `main` also takes a `SystemExit` carrying a message (`check_port_free`).
REFUSALS = (ValueError, OSError)


def refuse(problem) -> None:
    """Ends a start that cannot go on: one line on stderr naming the problem, exit status 2 (a usage error,
    as argparse exits), no traceback. The caller has stopped every thread it started first: a background
    XLA compile still running when the interpreter exits aborts it."""
    line = " ".join(str(problem).split()) or type(problem).__name__
    for handler in logging.getLogger().handlers:  # the log lines before it reach stderr first
        handler.flush()
    sys.stderr.write(f"error: {line}\n")
    sys.stderr.flush()
    sys.exit(2)


def _parse_flags(argv):
    """absl's flag parsing after vLLM's spellings are translated (`serving.vllm_flags`), with a bad flag
    refused as any other start is (`refuse`) instead of absl's 'FATAL Flags parsing error' and exit status 1;
    a first argument that is no flag is the model (`vllm serve MODEL`)."""
    try:
        return model_from_arguments(FLAGS(translate_vllm_flags(argv, FLAGS)), FLAGS)
    except (flags.Error, ValueError) as e:
        refuse(f"{e} (--helpfull lists the flags)" if isinstance(e, flags.Error) else e)


def translate_vllm_flags(argv, flag_values) -> list:
    """`argv` with vLLM's flag spellings rewritten as the flags `flag_values` defines."""
    from serving.vllm_flags import translate

    names = list(flag_values)
    return translate(argv, names, [n for n in names if flag_values[n].boolean])


def model_from_arguments(argv, flag_values) -> list:
    """The positional MODEL, if any, set as --checkpoint; returns argv[:1] (absl's remaining arguments)."""
    positional = argv[1:]
    if len(positional) > 1:
        raise ValueError(f"one MODEL argument is taken, got {len(positional)}: {' '.join(positional)}")
    if positional:
        if flag_values.checkpoint not in (None, positional[0]):
            raise ValueError(f"MODEL {positional[0]} and --checkpoint {flag_values.checkpoint}: pass one")
        flag_values.checkpoint = positional[0]
    return argv[:1]


def chat_template_from_flags(flag_values) -> Optional[str]:
    """--chat_template's template: a file's text when it names one, else the value itself (as vLLM reads it)."""
    value = flag_values.chat_template
    if not value:
        return None
    if os.path.isfile(value):
        with open(value) as f:
            return f.read()
    if "{" not in value:  # neither a file nor a template: most likely a mistyped path
        raise ValueError(f"--chat_template {value}: no such file, and not a Jinja template")
    return value


def _set_log_level() -> None:
    level = getattr(logging, FLAGS.log_level.upper())
    logging.getLogger().setLevel(level)
    if level > logging.DEBUG:  # checkpoint and backend chatter only when debugging
        for noisy in ("absl", "jax", "orbax"):
            logging.getLogger(noisy).setLevel(max(level, logging.WARNING))


def _media_from_flags():
    from serving.api.media import MediaOptions

    return MediaOptions(allowed_domains=tuple(d.strip().lower() for d in FLAGS.allowed_media_domains if d.strip()),
                        max_bytes=FLAGS.media_max_bytes, fetch_timeout_s=FLAGS.media_fetch_timeout_s)


def _rl_routes_from_flags():
    """The RL routes' options, or None when they are off (`serving.api.rl_routes`)."""
    from serving.api import rl_routes

    if not (FLAGS.enable_rl_routes or rl_routes.enabled_by_env()):
        return None
    return rl_routes.RLRouteOptions(checkpoint_roots=tuple(r for r in FLAGS.rl_checkpoint_roots if r.strip()))


class _Start:
    """The server's start, phase by phase, keeping what each phase started so that a refusal in a later
    one (`create_app` refusing an option while the background warm-up compiles) stops it before exiting."""

    def __init__(self):
        self.llm = None
        self.app = None
        self.async_engine = None

    def prepare(self) -> None:
        """Before anything loads: the multi-process runtime, the port, the compilation cache."""
        from serving.cluster import distributed
        from serving.compilation import compile_cache

        join_from_flags()
        joined = distributed.current()
        if joined is None or not joined.process_id:  # the process that will listen (process 0)
            check_port_free(FLAGS.host, FLAGS.port)
        cache_dir = compile_cache.enable(FLAGS.compilation_cache_dir)  # before anything compiles
        log.info("persistent compilation cache: %s", cache_dir or "off")
        # The HTTP stack is imported before the model loads: once the engine exists, its background warm-up
        # competes with whatever the main thread still does, and these imports are a second of it.
        import uvicorn  # noqa: F401

        import serving.api.drain  # noqa: F401
        import serving.api.http_app  # noqa: F401
        import serving.api.http_auth  # noqa: F401
        import serving.api.media  # noqa: F401
        import serving.api.http_metrics  # noqa: F401
        import serving.async_engine  # noqa: F401

    def load(self) -> None:
        """The `LLM` (the engine built, the first step shapes compiled, the rest compiling meanwhile)."""
        log.info("loading %s", FLAGS.checkpoint or "the embedded default model")
        template = chat_template_from_flags(FLAGS)  # a bad path is refused before the load
        self.llm = make_llm_from_flags()
        if template is not None and self.llm.tokenizer is not None:
            self.llm.tokenizer.chat_template = template
            log.info("chat template: from --chat_template, not the checkpoint's")
        for line in describe_startup(self.llm):
            log.info("%s", line)

    def build_app(self) -> None:
        """The HTTP app over the engine (process 0 only); the engine loop starts here."""
        from serving.api.http_auth import APIKeys

        llm = self.llm
        secret = FLAGS.kv_transfer_secret or os.environ.get(SECRET_ENV) or None
        api_keys = APIKeys.parse(FLAGS.api_key or os.environ.get(API_KEY_ENV), FLAGS.cache_salt_per_api_key)
        log.info("API keys: %s; disaggregated serving routes (/internal/*): %s",
                 f"{len(api_keys.keys)} accepted" if api_keys.enabled else "none (the API is open)",
                 "on (signed payloads)" if secret else f"off (set --kv_transfer_secret or ${SECRET_ENV})")
        if FLAGS.kv_transfer_warmup and secret:
            from serving.disaggregation import kv_transfer

            log.info("KV transfer warm-up: %d executables", kv_transfer.warm_up(llm.engine))
        elif FLAGS.kv_transfer_warmup:
            log.warning("--kv_transfer_warmup ignored: the KV transfer routes are off without a secret")
        self.app, self.async_engine, _ = build_stack(
            llm, FLAGS.served_model_name, peak=_peak_from_flags(), metrics_window_s=FLAGS.metrics_window_s,
            num_devices=FLAGS.tensor_parallel_size * FLAGS.pipeline_parallel_size, profile_dir=FLAGS.profile_dir,
            api_keys=api_keys, kv_transfer_secret=secret, tool_call_parser=FLAGS.tool_call_parser,
            limits=_limits_from_flags(), shutdown_timeout_s=FLAGS.shutdown_timeout_s,
            reasoning_parser=FLAGS.reasoning_parser, responses_store=responses_store_from_flags(),
            media=_media_from_flags(), allow_lora_updates=FLAGS.allow_runtime_lora_updating,
            rl_routes=_rl_routes_from_flags())
        if FLAGS.profile_dir:
            log.info("profiling: POST /start_profile and /stop_profile write traces under %s", FLAGS.profile_dir)
        if llm.multihost is not None:
            llm.multihost.watch(self.async_engine)  # a failed engine loop ends every process, not just HTTP

    def serve(self) -> None:
        """uvicorn until SIGINT or a drained SIGTERM; then the engine loop and the warm-up stop."""
        import uvicorn

        from serving.api.drain import DrainingServer

        name = FLAGS.served_model_name or default_model_name(self.llm)
        log.info("serving %r on http://%s:%d (OpenAI API under /v1, metrics at /metrics)", name, FLAGS.host,
                 FLAGS.port)
        try:
            config = uvicorn.Config(self.app, host=FLAGS.host, port=FLAGS.port,
                                    log_level=FLAGS.uvicorn_log_level or FLAGS.log_level, lifespan="off",
                                    timeout_keep_alive=30)
            try:
                DrainingServer(config, self.app.state.drain).run()  # the first SIGTERM drains (serving.api.drain)
            except KeyboardInterrupt:  # SIGINT, re-raised by uvicorn once it has shut down (as uvicorn.run does)
                pass
        finally:
            self.app.state.profiler.stop_if_running()
            self.stop()

    def stop(self) -> None:
        """Stops what the phases so far started: the engine loop, and the background warm-up after the
        compile under way (multi-host: the other processes stop following)."""
        if self.async_engine is not None:
            self.async_engine.shutdown()
        if self.llm is not None:
            self.llm.shutdown()


def main(argv) -> None:
    del argv
    _set_log_level()
    from serving import platform_choice

    platform_choice.choose()  # before anything asks JAX for a device
    start = _Start()
    try:
        start.prepare()
        start.load()
        if start.llm.multihost is not None and not start.llm.multihost.is_leader:
            sys.exit(start.llm.multihost.serve())  # process 0 serves HTTP; this one replays its device calls
        start.build_app()
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        start.stop()
        refuse(e.code)
    except REFUSALS as e:
        start.stop()
        refuse(e)
    except BaseException:  # a failure that is not a refusal still stops the warm-up before the traceback
        start.stop()
        raise
    start.serve()


def run() -> None:
    define_flags()
    absl_app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
    run()
