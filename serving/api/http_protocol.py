"""Request and response bodies of the OpenAI-compatible HTTP API, and its error envelope.

The pydantic models accept what the OpenAI clients send (plus the vLLM
extensions people rely on: `top_k`, `min_p`, `ignore_eos`) and check only the
*shape* of a request: types, and which fields may appear together. Whether a
value is sensible (temperature >= 0, top_p in (0, 1], ...) is decided by
`SamplingParams.validate()` in the engine, so that the HTTP API and
`LLM.generate` can never disagree about what is valid; the HTTP layer only
translates the engine's parameter names back to the API's (see
`API_PARAM_NAMES`).

Every error leaves the server as OpenAI's envelope
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from serving.api.tool_protocol import DeltaToolCall, NamedToolChoice, ResponseFormat, Tool, ToolCall

# --- errors -----------------------------------------------------------------------------


class APIError(Exception):
    """An error with an HTTP status that the app turns into OpenAI's error envelope."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers  # extra response headers (Retry-After of a 503)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def model_not_found(model) -> APIError:
    """A `model` this server does not serve (neither the base model nor a loaded LoRA adapter): a 404 with
    vLLM's message, type and numeric code, on every OpenAI route, so clients and routers that match on
    vLLM's answer see the same one."""
    return APIError(f"The model `{model}` does not exist.", status=404, type="NotFoundError", param="model",
                    code=404)


# Engine (SamplingParams) field -> the request field a client wrote, where they differ.
API_PARAM_NAMES = {
    "completions": {"logprobs": "logprobs", "prompt_logprobs": "logprobs"},
    "chat": {"logprobs": "top_logprobs", "prompt_logprobs": "top_logprobs", "prompt": "messages"},
    "pooling": {"prompt": "input", "pooling_params": "input"},  # /v1/embeddings, /pooling, /classify, /score, /rerank
}

# --- requests ----------------------------------------------------------------------------


class _Request(BaseModel):
    # Inside a request (messages, content parts, stream_options) unknown fields are ignored: clients send
    # back whole response objects, an assistant message with its `refusal`, `annotations`, ... The request
    # bodies themselves (`_SamplingFields`) keep theirs, which `openai_fields.check_fields` refuses.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(_Request):
    """Fields shared by both endpoints; defaults follow OpenAI's.

    Fields the models do not declare are kept (`model_extra`) so that
    `serving.api.openai_fields` can refuse them: an OpenAI field this server
    does not implement, or a field that is nobody's. Their JSON schema
    (`/openapi.json`) says so: no properties beyond the declared ones.
    """

    model_config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": False})

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    n: int = 1
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False
    # Prefix-cache isolation (as vLLM's): only requests with the same salt share cached KV pages.
    cache_salt: Optional[str] = None
    # Detokenization (vLLM's extensions): SamplingParams' fields of the same names.
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Structured outputs (serving.api.tool_calls): OpenAI's response_format, or vLLM's structured_outputs
    # ({"json" | "json_object" | "regex" | "choice" | "grammar": ..., "whitespace": bool}).
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[dict[str, Any]] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None  # token id (as a string, as OpenAI sends it) -> bias
    user: Optional[str] = None  # an end-user id for the client's records; it changes nothing here
    # vLLM's extensions:
    repetition_penalty: Optional[float] = None
    min_tokens: Optional[int] = None
    bad_words: Optional[list[str]] = None
    allowed_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    # vLLM's: lower runs first when the server schedules by priority (--scheduling_policy=priority).
    priority: int = 0
    # vLLM's: free-form arguments of the custom logits processors (--logits_processors); `extra_args` is the
    # same field under SamplingParams' name. docs/logits_processors.md.
    vllm_xargs: Optional[dict[str, Any]] = None
    extra_args: Optional[dict[str, Any]] = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def processor_args(self) -> Optional[dict[str, Any]]:
        """The request's arguments for the logits processors: `vllm_xargs` or `extra_args` (one of them)."""
        if self.vllm_xargs is not None and self.extra_args is not None and self.vllm_xargs != self.extra_args:
            raise APIError("vllm_xargs and extra_args are the same field: give one of them", param="vllm_xargs")
        return self.vllm_xargs if self.vllm_xargs is not None else self.extra_args

    def processor_args_field(self) -> str:
        return "vllm_xargs" if self.vllm_xargs is not None else "extra_args"


PromptType = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_SamplingFields):
    prompt: PromptType
    logprobs: Optional[int] = None
    echo: bool = False  # the prompt in front of the text (chat has no echo: there it is an unknown field)
    best_of: Optional[int] = None  # only None or n (no extra candidates are drawn)
    suffix: Optional[str] = None  # refused unless empty (no insertion mode)
    max_tokens: Optional[int] = 16  # OpenAI's default for /v1/completions
    # vLLM's token in / token out for RL rollouts: each choice carries its prompt's and its own token ids, the
    # weight version of each token and, with logprobs, each token's keep-mask size (`CompletionOutput`).
    return_token_ids: Optional[bool] = None


class TextPart(_Request):
    type: Literal["text"] = "text"
    text: str


class ImageURL(_Request):
    url: str
    detail: Optional[Literal["auto", "low", "high"]] = None  # accepted; images are always used whole


class ImageURLPart(_Request):
    """An image content part: a `data:` URL (base64 PNG / JPEG / WebP) or an http(s) URL
    (`serving.api.media`)."""

    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(_Request):
    role: str
    content: Optional[Union[str, list[Union[TextPart, ImageURLPart]]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None  # an assistant's calls, sent back in the history
    tool_call_id: Optional[str] = None  # a tool message: the call it answers
    # An assistant's earlier thinking, sent back: the template receives it as `reasoning_content` and
    # decides whether to show it (Qwen3's renders it for the turns after the last user message).
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None

    def text(self, image_text: str = "") -> str:
        """The content as one string, each image part written as `image_text`."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text if part.type == "text" else image_text for part in self.content)

    def image_urls(self) -> list[tuple[int, str]]:
        """(part index, URL) of the message's image parts."""
        if not isinstance(self.content, list):
            return []
        return [(j, part.image_url.url) for j, part in enumerate(self.content) if part.type == "image_url"]


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    return_token_ids: Optional[bool] = None  # as on completions; the prompt's ids at the response's top level
    top_logprobs: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    add_generation_prompt: bool = True
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = None
    # Reasoning models (serving.api.reasoning; the budget fields need --reasoning_parser):
    reasoning_effort: Optional[str] = None  # OpenAI's: a thinking budget (reasoning.EFFORT_BUDGETS)
    thinking_token_budget: Optional[int] = None  # vLLM's: the most thinking tokens before the end tag is forced
    include_reasoning: bool = True  # vLLM's: False drops the reasoning from the answer
    chat_template_kwargs: Optional[dict[str, Any]] = None  # more variables for the chat template

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


# --- responses ---------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """The legacy completions layout: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None  # the stop string or token id that ended it (vLLM's field)
    # With return_token_ids (vLLM's fields; a stream sends the prompt's in a choice's first chunk and each
    # chunk's new tokens), and Ridgeline's: the weight version of each token and, with logprobs, the number
    # of tokens the distribution each was drawn from kept (`logprobs_mode=processed_logprobs`: top-k / top-p /
    # min-p and masks applied).
    prompt_token_ids: Optional[list[int]] = None
    token_ids: Optional[list[int]] = None
    weight_versions: Optional[list[int]] = None
    keep_sizes: Optional[list[int]] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: Optional[list[TokenLogprob]] = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: Optional[str] = None
    # The thinking of a reasoning model (--reasoning_parser): `reasoning_content` as DeepSeek's API and
    # vLLM name it, and `reasoning`, vLLM's newer name; the same text.
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None


class _TokenFields(BaseModel):
    """A choice's token fields under `return_token_ids` (see `CompletionChoice`)."""

    token_ids: Optional[list[int]] = None
    weight_versions: Optional[list[int]] = None
    keep_sizes: Optional[list[int]] = None


class ChatChoice(_TokenFields):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Optional[Usage] = None
    prompt_token_ids: Optional[list[int]] = None  # with return_token_ids (vLLM's field)


class ChatDelta(BaseModel):
    role: Optional[str] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None


class ChatChunkChoice(_TokenFields):
    index: int
    delta: ChatDelta
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None
    prompt_token_ids: Optional[list[int]] = None  # with return_token_ids: in the stream's first chunk


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "ridgeline"
    max_model_len: Optional[int] = None
    root: Optional[str] = None  # a LoRA adapter's path
    parent: Optional[str] = None  # a LoRA adapter's base model


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a `prompt`, or chat `messages` rendered by the chat template."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True  # the BOS of a prompt
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None  # more variables for the chat template


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Request):
    model: Optional[str] = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def sse(payload: BaseModel | dict | str) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    if isinstance(payload, BaseModel):
        payload = payload.model_dump_json(exclude_unset=False)
    elif isinstance(payload, dict):
        import json

        payload = json.dumps(payload)
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"
