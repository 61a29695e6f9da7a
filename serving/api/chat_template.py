"""Turning chat messages into a prompt.

A checkpoint whose tokenizer ships a chat template (`tokenizer_config.json`'s
`chat_template`, a Jinja string) is rendered with that template, the way
transformers' `apply_chat_template` renders it: `messages`, `bos_token`,
`eos_token`, `add_generation_prompt` and `raise_exception` are in scope, and
the sandboxed Jinja environment uses `trim_blocks` and `lstrip_blocks`.

The embedded byte model has no template, so it gets `BYTE_CHAT_TEMPLATE`, a
deliberately plain one (each message is a `<|role|>` line followed by its
text; the generation prompt is the `<|assistant|>` line):

    <|system|>
    You are terse.
    <|user|>
    Hello
    <|assistant|>

Tokens are then the UTF-8 bytes of that text after the BOS id, exactly as
`LLM.generate` would encode the same string.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

BYTE_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class ChatTemplateError(ValueError):
    """The messages cannot be rendered by the template (the template raised, or a role is unknown)."""


def _raise(message: str):
    raise ChatTemplateError(message)


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    return env.from_string(template)


def template_for(tokenizer) -> str:
    return getattr(tokenizer, "chat_template", None) or BYTE_CHAT_TEMPLATE


def render_chat(messages: Sequence[dict[str, Any]], tokenizer, add_generation_prompt: bool = True,
                tools: Sequence[dict] | None = None) -> str:
    """The prompt text for `messages` (dicts with `role` and `content` strings); `tools` (OpenAI's
    tool definitions) are in the template's scope as `tools`, as transformers passes them."""
    import jinja2

    try:
        return _compile(template_for(tokenizer)).render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=getattr(tokenizer, "bos_token", None) or "",
            eos_token=getattr(tokenizer, "eos_token", None) or "",
            tools=list(tools) if tools is not None else None,
        )
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template failed: {e}") from e


def encode_chat(messages: Sequence[dict[str, Any]], tokenizer, add_generation_prompt: bool = True,
                tools: Sequence[dict] | None = None) -> list[int]:
    """Token ids of the rendered chat. BOS is prepended unless the template already wrote it."""
    text = render_chat(messages, tokenizer, add_generation_prompt, tools)
    bos_text = getattr(tokenizer, "bos_token", None)
    add_bos = not (bos_text and text.startswith(bos_text))
    return tokenizer.encode(text, add_bos=add_bos)
