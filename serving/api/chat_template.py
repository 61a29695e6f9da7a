"""Turning chat messages into a prompt.

A checkpoint whose tokenizer ships a chat template (`tokenizer_config.json`'s
`chat_template`, a Jinja string) is rendered with that template, the way
transformers' `apply_chat_template` renders it: `messages`, `tools`, `bos_token`,
`eos_token`, `add_generation_prompt` and `raise_exception` are in scope, and
the sandboxed Jinja environment uses `trim_blocks` and `lstrip_blocks`.

The embedded byte model has no template, so it gets `BYTE_CHAT_TEMPLATE`, a
deliberately plain one (each message is a `<|role|>` line followed by its
text, then an assistant's tool calls, one `<|call|>name {arguments}` line
each; a request's tools come first, their names under `<|tools|>`, since a
byte model reads no schemas; the generation prompt is the `<|assistant|>`
line):

    <|system|>
    You are terse.
    <|user|>
    Hello
    <|assistant|>

Tokens are then the UTF-8 bytes of that text after the BOS id, exactly as
`LLM.generate` would encode the same string (see `encode_chat` for BOS).
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

BYTE_CHAT_TEMPLATE = (
    "{% if tools %}<|tools|>\n{% for tool in tools %}{{ tool['function']['name'] }}\n{% endfor %}{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% for call in message['tool_calls'] or [] %}"
    "<|call|>{{ call['function']['name'] }} {{ call['function']['arguments'] | tojson }}\n"
    "{% endfor %}"
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


# The names a template sees from the server; `chat_template_kwargs` may not replace them.
RESERVED_NAMES = frozenset({"messages", "add_generation_prompt", "tools", "bos_token", "eos_token",
                            "raise_exception"})


def render_chat(messages: Sequence[dict[str, Any]], tokenizer, add_generation_prompt: bool = True,
                tools: Sequence[dict] | None = None, template_kwargs: dict | None = None) -> str:
    """The prompt text for `messages` (dicts with `role` and `content` strings, and `tool_calls` /
    `tool_call_id` where a conversation has tool calls); `tools` as transformers passes them
    (OpenAI's `{"type": "function", "function": {...}}` entries), None without tools;
    `template_kwargs`: more variables for the template (`chat_template_kwargs`, such as
    `enable_thinking`), as transformers' `apply_chat_template(**kwargs)` passes them."""
    import jinja2

    extra = dict(template_kwargs or {})
    clash = sorted(RESERVED_NAMES & set(extra))
    if clash:
        raise ChatTemplateError(f"chat_template_kwargs may not set {clash}: the server sets them")
    try:
        return _compile(template_for(tokenizer)).render(
            **extra,
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            tools=list(tools) if tools else None,
            bos_token=getattr(tokenizer, "bos_token", None) or "",
            eos_token=getattr(tokenizer, "eos_token", None) or "",
        )
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template failed: {e}") from e


def generation_prompt(messages: Sequence[dict[str, Any]], tokenizer, tools: Sequence[dict] | None = None,
                      template_kwargs: dict | None = None) -> str:
    """The text the template adds after the conversation for the assistant's turn (where a
    reasoning template opens or closes its think block); "" when it cannot be told apart."""
    full = render_chat(messages, tokenizer, True, tools, template_kwargs)
    bare = render_chat(messages, tokenizer, False, tools, template_kwargs)
    return full[len(bare):] if full.startswith(bare) else ""


# Where an image goes in a rendered chat: a message's image part is this text when the template
# renders it, and `encode_chat(..., image_ids=...)` puts the model's image prompt ids there instead.
IMAGE_SENTINEL = "\x00<image>\x00"


def encode_chat(messages: Sequence[dict[str, Any]], tokenizer, add_generation_prompt: bool = True,
                tools: Sequence[dict] | None = None, template_kwargs: dict | None = None,
                image_ids: Sequence[int] | None = None, image_margin: str = "") -> list[int]:
    """Token ids of the rendered chat.

    The text is encoded without the tokenizer's special tokens (a template
    writes its own, and an `add_eos_token` tokenizer must not end a prompt with
    EOS); BOS goes in front only when the tokenizer puts BOS before a string
    (`adds_bos`) and the template did not already write it, so a chat prompt
    never starts with two.

    `image_ids`: the ids each `IMAGE_SENTINEL` in the messages becomes (a vision-language model's image
    prompt, `VisionConfig.image_prompt_ids`); the text between images is encoded piece by piece, as
    the special tokens around an image split it in a whole-text encoding too. `image_margin`: text written
    on each side of every image (`VisionConfig.image_text_margin`, Gemma 3's blank lines), part of the
    text pieces around it, so it is tokenized together with their text as the HF processor, which
    rewrites the rendered text before tokenizing it, does.
    """
    text = render_chat(messages, tokenizer, add_generation_prompt, tools, template_kwargs)
    if image_ids is not None and image_margin:
        text = text.replace(IMAGE_SENTINEL, image_margin + IMAGE_SENTINEL + image_margin)
    if image_ids is None:
        ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        ids = []
        for i, piece in enumerate(text.split(IMAGE_SENTINEL)):
            ids += list(image_ids) if i else []
            ids += tokenizer.encode(piece, add_special_tokens=False) if piece else []
    bos_id, bos_text = getattr(tokenizer, "bos_id", None), getattr(tokenizer, "bos_token", None)
    wrote_bos = (ids and ids[0] == bos_id) or (bos_text and text.startswith(bos_text))
    if getattr(tokenizer, "adds_bos", False) and bos_id is not None and not wrote_bos:
        ids = [bos_id] + ids
    return ids
