"""The OpenAI-compatible HTTP API: a FastAPI app over an `AsyncEngine`.

Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`,
`GET /health`, `GET /metrics`, and `POST /start_profile` / `POST /stop_profile`
(a JAX profiler trace of the running server, written under `profile_dir`);
OpenAI's Responses API (`serving.api.responses_api`) and Anthropic's Messages API
(`serving.api.messages_api`) are mounted from their own modules over the same
`ServingContext`.

The app never runs model code: the engine loop lives in its own thread, and a
handler only tokenizes, checks the request, submits it and awaits outputs, so
a slow client or a burst of requests can only queue, never stall the engine.
Every prompt of a request (and every one of its `n` samples, which the engine
forks from one prompt) is one engine request; when the client goes away (a
streaming connection closes, or a non-streaming one disconnects while it
waits) every one of them is aborted, which frees its KV pages at once.

Errors leave as OpenAI's envelope with HTTP 400 (`http_protocol.APIError`);
the `param` of a bad sampling value is the request field the client wrote.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.api import http_protocol as P
from serving.disaggregation import kv_transfer
from serving.api.chat_template import IMAGE_SENTINEL, ChatTemplateError, encode_chat, generation_prompt
from serving.api.media import MediaLoader, MediaOptions
from serving.api import tool_calls as T
from serving.api.http_auth import APIKeys
from serving.api import lora_routes, openai_fields
from serving.api import reasoning as R
from serving.api.profiling import TraceControl
from serving.api.responses_store import ResponseStore
from serving.async_engine import EngineDeadError
from serving.core.engine import EngineUnavailableError
from serving.core.engine import ContextLengthError
from serving.api.answer_stream import DeltaTracker
from serving.api.http_util import ClientGone, primed_stream, token_fields, until_disconnect  # noqa: F401 (also imported from here)
from serving.core.sampling_params import InvalidParameterError, SamplingParams

log = logging.getLogger("ridgeline.http")
# Seconds a client is told to wait (Retry-After) when the engine is asleep (`serving.api.rl_routes`).
UNAVAILABLE_RETRY_AFTER_S = 5


class ServingContext:
    """What the routes need: the engine, the tokenizer, the name and the context window."""

    def __init__(self, engine, tokenizer, model_name: str, max_model_len: int, metrics=None,
                 vocab_size: int | None = None, api_keys: APIKeys | None = None, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None, media: MediaOptions | None = None):
        self.engine = engine
        # The think tags and where thinking starts (serving.api.reasoning); None: outputs are not split.
        self.reasoning = R.make_format(reasoning_parser, tokenizer)
        self.media = MediaLoader(media or MediaOptions())  # image parts, loaded off the event loop
        self.tool_call_parser = tool_call_parser  # how "auto" tool calls are read (serving.api.tool_parsers)
        self.api_keys = api_keys or APIKeys()
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.metrics = metrics
        # The model's vocabulary (often padded beyond the tokenizer's): the range of valid token ids.
        self.vocab_size = vocab_size or getattr(tokenizer, "vocab_size", None)

    # --- request checks --------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        """The request's `model` must be the base model or a loaded LoRA adapter, which the request then
        runs with (`serving.api.lora_routes`)."""
        if not lora_routes.resolve_model(self.engine, self.model_name, model):
            raise P.model_not_found(model)

    def served_model(self) -> str:
        """The `model` a response reports: the request's LoRA adapter (as vLLM reports it), else the base
        model. Read where the request was checked (`check_model`) or in its stream, which runs in a copy
        of that context."""
        return lora_routes.current_lora.get() or self.model_name

    def completion_prompts(self, prompt) -> list[tuple[str | None, list[int]]]:
        """(text, token ids) of each prompt in a completions request."""
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            prompt = [prompt]
        if not prompt:
            raise P.APIError("prompt must not be empty", param="prompt", code="invalid_value")
        out = []
        for p in prompt:
            if isinstance(p, str):
                if not p:
                    raise P.APIError("prompt must not be an empty string", param="prompt", code="invalid_value")
                out.append((p, self.tokenizer.encode(p)))
            else:
                ids = list(p)
                if not ids:
                    raise P.APIError("a token-id prompt must not be empty", param="prompt", code="invalid_value")
                out.append((None, ids))  # the engine checks the ids against the vocabulary
        return out

    def chat_prompt(self, req: P.ChatCompletionRequest, plan: "T.ToolPlan | None" = None) -> list[int]:
        openai_fields.check_roles(req.messages)
        messages = [T.template_message(m) for m in req.messages]
        image_ids, image_margin = None, ""
        if any(m.image_urls() for m in req.messages):  # image parts: the model's image prompt goes there
            vision = getattr(self.engine_core().cfg, "vision", None)
            if vision is None:  # (the chat route said so in `chat_images`; /tokenize comes straight here)
                raise self._no_vision(req)
            image_ids = list(vision.image_prompt_ids or (self.engine_core().cfg.image_token_id,))
            image_margin = vision.image_text_margin
            for out, m in zip(messages, req.messages):
                out["content"] = m.text(IMAGE_SENTINEL)
        return self.encode_messages(messages, plan and plan.tools, req.add_generation_prompt,
                                    req.chat_template_kwargs, image_ids, image_margin)

    def encode_messages(self, messages: list[dict], tools, add_generation_prompt: bool = True,
                        template_kwargs: dict | None = None, image_ids: list[int] | None = None,
                        image_margin: str = "") -> list[int]:
        """Token ids of template messages (400 naming `messages`, or `chat_template_kwargs`, when the
        template cannot render them); `image_ids` replace each image part (`IMAGE_SENTINEL`), with
        `image_margin` text on each side."""
        if template_kwargs is not None and not isinstance(template_kwargs, dict):
            raise P.APIError("chat_template_kwargs must be an object", param="chat_template_kwargs",
                             code="invalid_value")
        try:
            return encode_chat(messages, self.tokenizer, add_generation_prompt, tools, template_kwargs, image_ids,
                               image_margin)
        except ChatTemplateError as e:
            param = "chat_template_kwargs" if "chat_template_kwargs" in str(e) else "messages"
            raise P.APIError(str(e), param=param, code="invalid_value") from e

    def reasoning_start(self, messages: list[dict], tools, template_kwargs: dict | None = None) -> str | None:
        """Where a chat answer starts with this server's reasoning parser ("thinking", "undecided" or
        "answer"), judged from the template's generation prompt; None without a parser."""
        if self.reasoning is None:
            return None
        try:
            tail = generation_prompt(messages, self.tokenizer, tools, template_kwargs)
        except ChatTemplateError:
            tail = ""
        return self.reasoning.starts(tail)

    def chat_reasoning(self, req: P.ChatCompletionRequest, plan: "T.ToolPlan | None", max_tokens: int | None):
        """(where the answer starts, the engine's ReasoningParams) of a chat request."""
        budget = R.thinking_budget(req, self.reasoning, max_tokens)
        if self.reasoning is None or not req.add_generation_prompt:
            return None, None
        messages = [T.template_message(m) for m in req.messages]
        starts = self.reasoning_start(messages, plan and plan.tools, req.chat_template_kwargs)
        return starts, self.reasoning.engine_params(starts, budget)

    @staticmethod
    def _image_parts(req: P.ChatCompletionRequest) -> list:
        """(name of the part, its URL) of every image part of a chat request, in prompt order."""
        return [(f"messages[{i}].content[{j}]", url) for i, m in enumerate(req.messages) for j, url in m.image_urls()]

    def _no_vision(self, req: P.ChatCompletionRequest) -> P.APIError:
        """The 400 of image parts sent to a model without vision, naming the first part."""
        name = self._image_parts(req)[0][0]
        return P.APIError(f"{name}: this model does not take images", param=name, code="invalid_value")

    def engine_core(self):
        """The synchronous engine behind the async one (its config and options)."""
        return getattr(self.engine, "engine", self.engine)

    async def chat_images(self, req: P.ChatCompletionRequest) -> list:
        """The decoded images of the request's image parts, in prompt order (none: an empty list); a 400
        naming the part for a model without vision, too many images, or an image that cannot be used."""
        parts = self._image_parts(req)
        if not parts:
            return []
        imp = kv_transfer.current_import.get()
        if imp is not None:  # resuming a shipped prefill: its images' encoder outputs came with the K/V
            if len(imp.images) != len(parts):
                name = parts[0][0]
                raise P.APIError(f"{name}: the request has {len(parts)} image parts, the shipped KV "
                                 f"{len(imp.images)} images", param=name, code="invalid_value")
            return imp.encoded_images
        core = self.engine_core()
        if getattr(core.cfg, "vision", None) is None:
            raise self._no_vision(req)
        limit = core.config.limit_mm_per_prompt
        if len(parts) > limit:
            name = parts[limit][0]
            raise P.APIError(f"{name}: {len(parts)} images exceed limit_mm_per_prompt={limit}", param=name,
                             code="invalid_value")
        return await self.media.load(parts)

    def cache_salt(self, req: P._SamplingFields, request: Request) -> str | None:
        """The prefix-cache salt of a request: the one its shipped KV was computed under when it resumes
        a disaggregated prefill (signed by the prefill worker), else the client's, bound to its API key."""
        imp = kv_transfer.current_import.get()
        if imp is not None:
            return imp.cache_salt
        return self.api_keys.cache_salt(request, req.cache_salt)

    def sampling_params(self, req: P._SamplingFields, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None, plan: "T.ToolPlan | None" = None,
                        reasoning=None) -> SamplingParams:
        """The request's sampling parameters as the client wrote them; the engine validates them (and the
        prompt against the context window) when the request is made, in one place for every entry point.
        A field the client left out takes the checkpoint's generation_config.json default, if any (the engine
        caps an unset max_tokens by the file's max_new_tokens)."""
        defaults = getattr(getattr(self.engine, "engine", None), "default_sampling_params", None) or SamplingParams()
        return SamplingParams(
            n=req.n,
            temperature=defaults.temperature if req.temperature is None else req.temperature,
            top_p=defaults.top_p if req.top_p is None else req.top_p,
            top_k=defaults.top_k if req.top_k is None else req.top_k,
            min_p=defaults.min_p if req.min_p is None else req.min_p,
            seed=req.seed,
            stop=req.stop_list(),
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            max_tokens=max_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            structured_outputs=T.request_structured_outputs(req, plan),
            include_stop_str_in_output=req.include_stop_str_in_output,
            presence_penalty=defaults.presence_penalty if req.presence_penalty is None else req.presence_penalty,
            frequency_penalty=defaults.frequency_penalty if req.frequency_penalty is None else req.frequency_penalty,
            repetition_penalty=(defaults.repetition_penalty if req.repetition_penalty is None
                                else req.repetition_penalty),
            min_tokens=defaults.min_tokens if req.min_tokens is None else req.min_tokens,
            logit_bias=openai_fields.logit_bias(req.logit_bias),
            allowed_token_ids=req.allowed_token_ids,
            bad_words=req.bad_words,
            reasoning=reasoning,
            extra_args=req.processor_args(),
        )

    @staticmethod
    def api_error(e: InvalidParameterError, kind: str, req=None) -> P.APIError:
        """The engine's parameter error, named as the client named the field."""
        names = dict(P.API_PARAM_NAMES[kind])
        if kind == "chat" and req is not None:
            names["max_tokens"] = req.max_tokens_field()
        if req is not None and hasattr(req, "processor_args_field"):  # (a generating route's request)
            names["structured_outputs"] = T.structured_field(req)
            names["extra_args"] = req.processor_args_field()
        field = names.get(e.param, e.param)
        code = "context_length_exceeded" if isinstance(e, ContextLengthError) else "invalid_value"
        return P.APIError(str(e).replace(e.param, field, 1), param=field, code=code)

    # --- running requests ------------------------------------------------------------------

    async def stream_outputs(self, prompts: list[list[int]], params: SamplingParams, base_id: str,
                             kind: str, cache_salt: str | None = None, req=None,
                             part_args: dict | None = None) -> AsyncIterator[tuple[int, object]]:
        """Cumulative RequestOutputs of every prompt, interleaved as they come: (prompt index, output).
        `part_args`: request arguments of every prompt's request beside the adapter's (a pooling request's).

        Closing this iterator (the client went away) aborts every engine request still running.
        """
        queue: asyncio.Queue = asyncio.Queue()
        ids = [f"{base_id}-{i}" for i in range(len(prompts))]
        done = object()

        async def pump(i: int):
            try:
                given = {**kv_transfer.part_args(), **lora_routes.part_args(), **(part_args or {})}
                async for out in self.engine.generate(prompts[i], params, ids[i], cache_salt=cache_salt,
                                                      priority=getattr(req, "priority", 0), part_args=given):
                    queue.put_nowait((i, out))
            except InvalidParameterError as e:
                queue.put_nowait((i, self.api_error(e, kind, req)))
            except EngineDeadError as e:
                queue.put_nowait((i, P.APIError(f"the engine has stopped: {e}", status=503, type="server_error",
                                                code="engine_dead")))
            except EngineUnavailableError as e:  # asleep (RL routes): come back later
                queue.put_nowait((i, P.APIError(str(e), status=503, type="server_error", code="engine_unavailable",
                                                headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)})))
            except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
                queue.put_nowait((i, e))
            finally:
                queue.put_nowait((i, done))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(prompts))]
        remaining = len(prompts)
        try:
            while remaining:
                i, item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
            for rid in ids:
                self.engine.abort(rid)

    async def final_outputs(self, request: Request, prompts, params, base_id, kind, cache_salt=None, req=None,
                            part_args: dict | None = None) -> list:
        """The last output of every prompt; aborts them all if the client disconnects meanwhile."""
        finals: list = [None] * len(prompts)

        async def collect():
            async for i, out in self.stream_outputs(prompts, params, base_id, kind, cache_salt, req, part_args):
                finals[i] = out

        await until_disconnect(request, collect())
        return finals


def _token_bytes(tokenizer, token_id: int, text: str) -> list[int]:
    """The bytes the token adds to the text, as OpenAI's `bytes` (part of a character for a partial token)."""
    if hasattr(tokenizer, "token_bytes"):
        return tokenizer.token_bytes(token_id)
    return list(text.encode("utf-8"))


def _token_str(tokenizer, token_id: int, lp) -> str:
    return lp.decoded_token if getattr(lp, "decoded_token", None) is not None else tokenizer.token_text(token_id)


def completion_logprobs(tokenizer, token_ids, logprobs, start_offset: int = 0) -> P.CompletionLogprobs:
    """OpenAI's legacy layout. Each entry of `logprobs` maps token id -> Logprob (None for the first prompt token)."""
    out = P.CompletionLogprobs()
    offset = start_offset
    for tid, entry in zip(token_ids, logprobs):
        lp = entry.get(tid) if entry else None
        tok = _token_str(tokenizer, tid, lp)
        out.tokens.append(tok)
        out.token_logprobs.append(None if lp is None else float(lp.logprob))
        out.top_logprobs.append(None if not entry else {
            _token_str(tokenizer, k, v): float(v.logprob) for k, v in entry.items()})
        out.text_offset.append(offset)
        offset += len(tok)
    return out


def chat_logprobs(tokenizer, token_ids, logprobs, top_n: int) -> P.ChatLogprobs:
    content = []
    for tid, entry in zip(token_ids, logprobs):
        lp = entry.get(tid)
        tok = _token_str(tokenizer, tid, lp)
        ranked = sorted(entry.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30,
                                                       -kv[1].logprob))
        tops = [P.TopLogprob(token=_token_str(tokenizer, k, v), logprob=float(v.logprob),
                             bytes=_token_bytes(tokenizer, k, _token_str(tokenizer, k, v)))
                for k, v in ranked if v.rank is not None and v.rank <= top_n][:top_n]
        content.append(P.TokenLogprob(token=tok, logprob=float(lp.logprob), bytes=_token_bytes(tokenizer, tid, tok),
                                      top_logprobs=tops))
    return P.ChatLogprobs(content=content)


def _usage(prompt_tokens: int, completion_tokens: int) -> P.Usage:
    return P.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


def _finish_reason(reason):
    """The engine's finish reason as the OpenAI routes report it: as it is ("stop", "length", and vLLM's "abort"
    for a request a pause ended with its tokens so far, `serving.features.pause`)."""
    return reason


def _in_band_error(e: Exception) -> dict:
    if isinstance(e, P.APIError):
        return e.body()
    return P.error_body(str(e), type="server_error")


def _error_response(err: P.APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def create_app(engine, tokenizer, model_name: str, max_model_len: int, metrics=None,
               vocab_size: int | None = None, profile_dir: str | None = None, api_keys: APIKeys | None = None,
               kv_transfer_secret: str | None = None, tool_call_parser: str | None = None,
               reasoning_parser: str | None = None, responses_store=None,
               media: MediaOptions | None = None, allow_lora_updates: bool = False, rl_routes=None) -> FastAPI:
    """The FastAPI app serving `engine` (an `AsyncEngine`) under the name `model_name`.

    `api_keys` guards the OpenAI and profiling routes (`serving.api.http_auth`); the internal KV
    routes of disaggregated serving are mounted only with a `kv_transfer_secret`, which signs
    and verifies their payloads (`serving.disaggregation.disagg`). `allow_lora_updates` mounts
    `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (`serving.api.lora_routes`). `rl_routes` (a
    `serving.api.rl_routes.RLRouteOptions`) mounts the sleep, wake, prefix-cache reset and weight-update routes.
    """
    ctx = ServingContext(engine, tokenizer, model_name, max_model_len, metrics, vocab_size, api_keys, tool_call_parser,
                         reasoning_parser, media)
    app = FastAPI(title="Ridgeline OpenAI-compatible API")
    app.state.ctx = ctx
    # /v1/responses keeps stored responses here (previous_response_id, GET / DELETE by id).
    app.state.responses_store = responses_store if responses_store is not None else ResponseStore()
    profiler = app.state.profiler = TraceControl(profile_dir)
    keyed = [Depends(ctx.api_keys.require)]

    @app.exception_handler(P.APIError)
    async def _api_error(_request, err: P.APIError):
        return _error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, err: StarletteHTTPException):  # unknown routes, wrong methods
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code)
        message = str(err.detail)
        if err.status_code == 400 and message == "There was an error parsing the body":  # e.g. not UTF-8
            message, code = "The request body could not be parsed: it must be JSON in UTF-8", "invalid_json"
        body = P.error_body(message, code=code)
        return JSONResponse(body, status_code=err.status_code, headers=getattr(err, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        if first.get("type") == "json_invalid":
            return _error_response(P.APIError(f"The request body is not valid JSON: {first.get('msg', '')}",
                                              code="invalid_json"))
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        # Union members show up in loc as type names ("str", "list[int]"); the field is the first element.
        param = loc[0] if loc else None
        msg = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body')}: {e.get('msg')}"
                        for e in err.errors()[:3])
        return _error_response(P.APIError(f"Invalid request: {msg}", param=param, code="invalid_value"))

    @app.exception_handler(ValueError)
    async def _value_error(_request, err: ValueError):
        return _error_response(P.APIError(str(err), param=getattr(err, "param", None), code="invalid_value"))

    @app.exception_handler(Exception)
    async def _unexpected(_request, err: Exception):
        log.exception("request failed")
        return JSONResponse(P.error_body(f"internal error: {type(err).__name__}: {err}", type="server_error"),
                            status_code=500)

    @app.get("/health")
    async def health():
        if not getattr(engine, "is_running", True):
            return JSONResponse(P.error_body("the engine loop has stopped", type="server_error", code="engine_dead"),
                                status_code=503)
        warm = getattr(engine.stats(), "warmup", None)
        if warm is None or warm.ready:
            return JSONResponse({"status": "ready"})
        # It serves already (vLLM's contract: 200 when it can); the other step buckets still compile.
        return JSONResponse({"status": "warming", "step_executables_compiled": warm.compiled,
                             "step_executables_total": warm.total, "step_executables_quick": warm.quick})

    @app.get("/v1/models", dependencies=keyed)
    async def models():
        return P.ModelList(data=[P.ModelCard(id=model_name, max_model_len=max_model_len)]
                           + lora_routes.adapter_cards(engine, model_name, max_model_len))

    @app.get("/metrics")
    async def metrics_route():
        if metrics is None:
            return Response(status_code=404)
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.post("/start_profile", dependencies=keyed)
    async def start_profile():
        return await asyncio.to_thread(profiler.start)  # starting a profiler session blocks briefly

    @app.post("/stop_profile", dependencies=keyed)
    async def stop_profile():
        return await asyncio.to_thread(profiler.stop)  # writing the trace takes a moment

    @app.post("/v1/completions", dependencies=keyed)
    async def completions(req: P.CompletionRequest, request: Request):
        openai_fields.check_fields(req, "completions")
        ctx.check_model(req.model)
        prompts = ctx.completion_prompts(req.prompt)
        lengths = [len(ids) for _, ids in prompts]
        echo_lp = req.logprobs if (req.echo and req.logprobs is not None) else None
        params = ctx.sampling_params(req, req.max_tokens, req.logprobs, echo_lp)
        salt = ctx.cache_salt(req, request)
        base_id = f"cmpl-{uuid.uuid4().hex}"
        token_prompts = [ids for _, ids in prompts]
        # A model served without a tokenizer takes token ids only; its prompt text is empty.
        texts = [t if t is not None else (tokenizer.decode(ids) if tokenizer is not None else "")
                 for t, ids in prompts]
        if req.stream:
            return await primed_stream(request, _stream_completion(ctx, req, token_prompts, texts, params, base_id,
                                                                   salt))
        try:
            finals = await ctx.final_outputs(request, token_prompts, params, base_id, "completions", salt, req)
        except ClientGone:
            return Response(status_code=499)
        choices, completion_tokens = [], 0
        for i, out in enumerate(finals):
            for o in out.outputs:
                completion_tokens += len(o.token_ids)
                prefix = texts[i] if req.echo else ""
                lps = None
                if req.logprobs is not None:
                    ids, entries = list(o.token_ids), list(o.logprobs or [])
                    if req.echo:
                        ids = list(out.prompt_token_ids) + ids
                        entries = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + entries
                    lps = completion_logprobs(tokenizer, ids, entries)
                choices.append(P.CompletionChoice(index=i * req.n + o.index, text=prefix + o.text, logprobs=lps,
                                                  finish_reason=_finish_reason(o.finish_reason),
                                                  stop_reason=o.stop_reason,
                                                  **token_fields(req, out.prompt_token_ids, o, 0, len(o.token_ids))))
        return P.CompletionResponse(id=base_id, model=ctx.served_model(), choices=choices,
                                    usage=_usage(sum(lengths), completion_tokens))

    @app.post("/v1/chat/completions", dependencies=keyed)
    async def chat_completions(req: P.ChatCompletionRequest, request: Request):
        openai_fields.check_fields(req, "chat")
        ctx.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise P.APIError("top_logprobs requires logprobs to be true", param="top_logprobs",
                             code="invalid_value")
        plan = T.plan_tools(req, ctx.tool_call_parser)
        images = await ctx.chat_images(req)
        ids = ctx.chat_prompt(req, plan)
        starts, reasoning = ctx.chat_reasoning(req, plan, req.requested_max_tokens())
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = ctx.sampling_params(req, req.requested_max_tokens(), logprobs, None, plan, reasoning)
        salt = ctx.cache_salt(req, request)
        base_id = f"chatcmpl-{uuid.uuid4().hex}"
        prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else ids
        if req.stream:
            return await primed_stream(request, _stream_chat(ctx, req, prompt, params, base_id, salt, plan, starts))
        try:
            (out,) = await ctx.final_outputs(request, [prompt], params, base_id, "chat", salt, req)
        except ClientGone:
            return Response(status_code=499)
        choices = []
        for o in out.outputs:
            lps = chat_logprobs(tokenizer, o.token_ids, o.logprobs or [], logprobs) if req.logprobs else None
            thinking, text = (None, o.text) if starts is None else R.split(ctx.reasoning, starts, o.text)
            content, calls = plan.calls(text)
            if starts is not None and content == "":
                content = None
            message = P.ChatResponseMessage(content=content, tool_calls=T.tool_calls_of(calls) if calls else None)
            if req.include_reasoning:
                message.reasoning_content = message.reasoning = thinking
            choices.append(P.ChatChoice(index=o.index, message=message, logprobs=lps,
                                        finish_reason=T.finish_reason(_finish_reason(o.finish_reason), bool(calls)),
                                        stop_reason=o.stop_reason, **token_fields(req, None, o, 0, len(o.token_ids))))
        usage = _usage(len(out.prompt_token_ids), sum(len(o.token_ids) for o in out.outputs))
        return P.ChatCompletionResponse(id=base_id, model=ctx.served_model(), choices=choices, usage=usage,
                                        prompt_token_ids=list(out.prompt_token_ids) if req.return_token_ids else None)

    from serving.api.utility_routes import add_utility_routes

    add_utility_routes(app, ctx, keyed)  # /tokenize, /detokenize, /version, /v1/models/{id}
    if allow_lora_updates:
        lora_routes.add_lora_routes(app, ctx, keyed)  # /v1/load_lora_adapter, /v1/unload_lora_adapter
    if rl_routes is not None:
        from serving.api.rl_routes import add_rl_routes

        add_rl_routes(app, ctx, keyed, rl_routes)  # /sleep, /wake_up, /is_sleeping, /reset_prefix_cache, ...

    from serving.api.pooling_routes import add_pooling_routes

    add_pooling_routes(app, ctx, keyed)  # /v1/embeddings, /pooling, /classify, /score, /rerank (a pooling model)
    from serving.api.responses_api import add_responses_routes

    add_responses_routes(app, ctx, keyed)  # /v1/responses (OpenAI's Responses API)

    from serving.api.messages_api import add_messages_routes

    add_messages_routes(app, ctx)  # /v1/messages (Anthropic's Messages API; its own key check and envelope)

    if kv_transfer_secret:
        from serving.disaggregation.disagg import add_kv_transfer_routes

        # /internal/prefill and /internal/decode (disaggregated serving); without a secret they do
        # not exist (404), since an unsigned import could put forged pages into the shared prefix cache.
        add_kv_transfer_routes(app, ctx, kv_transfer_secret, keyed)
    return app


async def _stream_completion(ctx: ServingContext, req: P.CompletionRequest, prompts, texts, params, base_id,
                             cache_salt=None):
    """SSE chunks of a completions request: one choice entry per index and chunk, as OpenAI sends them."""
    trackers: dict[int, DeltaTracker] = {}
    tok = ctx.tokenizer
    completion_tokens: dict[int, int] = {}
    try:
        async for i, out in ctx.stream_outputs(prompts, params, base_id, "completions", cache_salt, req):
            choices = []
            for o in out.outputs:
                index = i * req.n + o.index
                tr = trackers.get(index)
                head, head_lps = "", None
                first = tr is None
                if first:
                    tr = trackers[index] = DeltaTracker()
                    if req.echo:  # the prompt goes out in front of the first delta
                        head = texts[i]
                        if req.logprobs is not None and out.prompt_logprobs is not None:
                            head_lps = completion_logprobs(tok, out.prompt_token_ids, out.prompt_logprobs)
                            tr.logprob_offset = sum(len(t) for t in head_lps.tokens)
                finished = o.finish_reason is not None
                delta, t0, t1 = tr.step(o.text, len(o.token_ids), finished)
                completion_tokens[index] = len(o.token_ids)
                if not (head or delta or finished or t0 != t1):
                    continue
                lps = head_lps
                if req.logprobs is not None and o.logprobs is not None:
                    new = completion_logprobs(tok, o.token_ids[t0:t1], o.logprobs[t0:t1], tr.logprob_offset)
                    tr.logprob_offset += sum(len(t) for t in new.tokens)
                    lps = new if lps is None else P.CompletionLogprobs(
                        tokens=lps.tokens + new.tokens, token_logprobs=lps.token_logprobs + new.token_logprobs,
                        top_logprobs=lps.top_logprobs + new.top_logprobs, text_offset=lps.text_offset + new.text_offset)
                choices.append(P.CompletionChoice(index=index, text=head + delta, logprobs=lps,
                                                  finish_reason=_finish_reason(o.finish_reason),
                                                  stop_reason=o.stop_reason,
                                                  **token_fields(req, out.prompt_token_ids if first else None,
                                                                  o, t0, t1)))
            if choices:
                yield P.sse(P.CompletionResponse(id=base_id, model=ctx.served_model(), choices=choices))
        if req.include_usage():
            usage = _usage(sum(len(p) for p in prompts), sum(completion_tokens.values()))
            yield P.sse(P.CompletionResponse(id=base_id, model=ctx.served_model(), choices=[], usage=usage))
    except Exception as e:  # noqa: BLE001
        if not trackers:
            raise  # nothing sent yet: primed_stream turns it into an HTTP error
        log.exception("stream %s failed", base_id)
        yield P.sse(_in_band_error(e))
    yield P.SSE_DONE


async def _stream_chat(ctx: ServingContext, req: P.ChatCompletionRequest, ids, params, base_id, cache_salt=None,
                       plan: "T.ToolPlan | None" = None, starts: str | None = None):
    trackers: dict[int, DeltaTracker] = {}
    splits: dict[int, R.ReasoningStream] = {}  # with a reasoning parser: reasoning and content apart per choice
    tool_streams: dict[int, T.ToolStream] = {}  # with tools: content and tool-call deltas per choice
    completion_tokens: dict[int, int] = {}
    sent_ids: dict[int, int] = {}  # with return_token_ids: the output tokens each choice's chunks carried so far
    top_n = params.logprobs or 0
    out = None
    prompt_sent = False
    try:
        async for _, out in ctx.stream_outputs([ids], params, base_id, "chat", cache_salt, req):
            choices = []
            for o in out.outputs:
                tr = trackers.get(o.index)
                first = tr is None
                if first:
                    tr = trackers[o.index] = DeltaTracker()
                finished = o.finish_reason is not None
                delta, t0, t1 = tr.step(o.text, len(o.token_ids), finished)
                completion_tokens[o.index] = len(o.token_ids)
                if not (first or delta or finished or t0 != t1):
                    continue
                lps = None
                if req.logprobs and o.logprobs is not None and t1 > t0:
                    lps = chat_logprobs(ctx.tokenizer, o.token_ids[t0:t1], o.logprobs[t0:t1], top_n)
                reason = _finish_reason(o.finish_reason)
                calls = None
                text, thinking = o.text[:tr.sent_text], None
                if starts is not None:
                    rs = splits.setdefault(o.index, R.ReasoningStream(ctx.reasoning, starts))
                    thinking, delta = rs.step(text, finished)
                    text = rs.content
                    thinking = thinking if req.include_reasoning else None
                if plan is not None and plan.mode != "none":
                    ts = tool_streams.setdefault(o.index, T.ToolStream(plan))
                    delta, calls = ts.step(text, finished)
                    reason = T.finish_reason(reason, ts.has_calls)
                if (starts is not None or calls is not None) and not (first or delta or thinking or calls or finished
                                                                      or lps):
                    continue  # text that is held back or already sent as a call
                # The first chunk of a choice carries the role, as OpenAI's do.
                d = P.ChatDelta(role="assistant", content=delta) if first else P.ChatDelta(content=delta or None)
                if thinking:
                    d.reasoning_content = d.reasoning = thinking
                d.tool_calls = calls or None
                choices.append(P.ChatChunkChoice(index=o.index, delta=d, logprobs=lps, finish_reason=reason,
                                                 stop_reason=o.stop_reason,
                                                 **token_fields(req, None, o, sent_ids.get(o.index, 0), t1)))
                sent_ids[o.index] = t1
            if choices:
                prompt_ids = None
                if req.return_token_ids and not prompt_sent:
                    prompt_ids, prompt_sent = list(out.prompt_token_ids), True
                yield P.sse(P.ChatCompletionChunk(id=base_id, model=ctx.served_model(), choices=choices,
                                                  prompt_token_ids=prompt_ids))
        if req.include_usage():
            prompt_len = len(ids["prompt_token_ids"]) if isinstance(ids, dict) else len(ids)
            if out is not None and getattr(out, "prompt_token_ids", None) is not None:
                prompt_len = len(out.prompt_token_ids)  # with image placeholders expanded
            usage = _usage(prompt_len, sum(completion_tokens.values()))
            yield P.sse(P.ChatCompletionChunk(id=base_id, model=ctx.served_model(), choices=[], usage=usage))
    except Exception as e:  # noqa: BLE001
        if not trackers:
            raise
        log.exception("stream %s failed", base_id)
        yield P.sse(_in_band_error(e))
    yield P.SSE_DONE
