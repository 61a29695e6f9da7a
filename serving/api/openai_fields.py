"""Which request fields the server honours, refuses or ignores.

Nothing a client asks for is silently dropped: a field of OpenAI's request
schema that this server does not implement is a 400 naming it (unless its
value is one that asks for nothing, such as `null` or `"store": false`),
and so is a field that is not OpenAI's at all and not one of the extensions
the request models declare (vLLM's `top_k`, `min_tokens`, ... sent through
the OpenAI client's `extra_body`), as on `/v1/responses` and `/v1/messages`:
a field the server does not know would otherwise look honoured when nothing
was done with it.

The schema lists are OpenAI's; a field the request models declare is
implemented by definition, so declaring one (in `http_protocol`) is all it
takes to stop refusing it. `extension_fields` lists the declared fields that
are not OpenAI's (docs/serving.md lists the same).
"""

from __future__ import annotations

import logging
from typing import Any

from serving.api.http_protocol import APIError

log = logging.getLogger("ridgeline.http")

_COMMON = {"model", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n", "presence_penalty", "seed",
           "stop", "stream", "stream_options", "temperature", "top_p", "user"}
OPENAI_FIELDS = {
    "completions": _COMMON | {"prompt", "best_of", "echo", "suffix"},
    "chat": _COMMON | {"messages", "audio", "function_call", "functions", "max_completion_tokens", "metadata",
                       "modalities", "parallel_tool_calls", "prediction", "prompt_cache_key", "reasoning_effort",
                       "response_format", "safety_identifier", "service_tier", "store", "tool_choice", "tools",
                       "top_logprobs", "verbosity", "web_search_options"},
}

# Values of undeclared OpenAI fields that ask for nothing beyond what the server does anyway.
_NO_OP = {
    "store": (False,), "modalities": (["text"],), "service_tier": ("auto", "default"), "metadata": ({},),
    "response_format": ({"type": "text"},), "tools": ([],), "tool_choice": ("none",), "function_call": ("none",),
    "functions": ([],),
}
# Hints whose only purpose is the provider's bookkeeping or routing: nothing to do with them.
_HINTS = {"safety_identifier", "prompt_cache_key", "parallel_tool_calls"}


def check_fields(req, kind: str) -> None:
    """Raises a 400 for a field of `req` (a `kind` request: "completions" or "chat") that is not
    implemented, whether OpenAI's or nobody's, or for a list longer than its cap
    (`request_limits.CAPS`)."""
    from serving.api.request_limits import check_caps

    check_caps(req)
    extras: dict[str, Any] = req.model_extra or {}
    unknown = sorted(name for name in extras if name not in OPENAI_FIELDS[kind])
    if unknown:
        raise APIError(f"{_listed(unknown)} {'is not a field' if len(unknown) == 1 else 'are not fields'} of this "
                       "API: neither OpenAI's nor one of the extensions this server implements",
                       param=unknown[0], code="unsupported_parameter")
    for name, value in extras.items():
        if value is None or name in _HINTS or value in _NO_OP.get(name, ()):
            continue
        raise APIError(f"`{name}` is not supported by this server", param=name, code="unsupported_parameter")
    if kind == "completions":
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(f"best_of={req.best_of} is not supported: this server draws exactly n={req.n} samples "
                           "and returns them all (set best_of to n or leave it out)", param="best_of",
                           code="unsupported_parameter")
        if req.suffix:
            raise APIError("suffix is not supported (this server has no insertion mode)", param="suffix",
                           code="unsupported_parameter")


def _listed(names: list[str]) -> str:
    return ", ".join(f"`{n}`" for n in names)


def extension_fields(model, kind: str) -> list[str]:
    """The fields a request model declares beyond OpenAI's schema of `kind` (its vLLM-style extensions)."""
    return sorted(set(model.model_fields) - OPENAI_FIELDS[kind])


# OpenAI's chat roles ("function" is the deprecated form of "tool").
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def check_roles(messages) -> None:
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise APIError(f"messages[{i}].role: unknown role {m.role!r} (expected one of {', '.join(CHAT_ROLES)})",
                           param="messages", code="invalid_value")


def logit_bias(value: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as JSON object keys) as {token id: bias}."""
    if value is None:
        return None
    out = {}
    for key, bias in value.items():
        try:
            out[int(key)] = bias
        except ValueError:
            raise APIError(f"logit_bias: keys must be token ids, got {key!r}", param="logit_bias",
                           code="invalid_value") from None
    return out
