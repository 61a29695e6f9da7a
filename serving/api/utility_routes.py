"""The routes around generation: `/tokenize`, `/detokenize`, `/version` and `/v1/models/{id}`.

`/tokenize` and `/detokenize` take and return vLLM's shapes, so tools written
against vLLM (prompt-length checks, token counting) work unchanged; chat
`messages` are rendered by the same chat template the chat route uses.
"""

from __future__ import annotations

from importlib import metadata

from fastapi import FastAPI

from serving.api import http_protocol as P, lora_routes


def server_version() -> str:
    try:
        return metadata.version("ridgeline")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def add_utility_routes(app: FastAPI, ctx, keyed: list) -> None:
    """Mounts the routes on `app` (`ctx`: the app's `http_app.ServingContext`; `keyed`: the API-key
    dependency the OpenAI routes use)."""

    def tokenizer():
        if ctx.tokenizer is None:
            raise P.APIError("this model is served without a tokenizer", code="no_tokenizer")
        return ctx.tokenizer

    @app.post("/tokenize", dependencies=keyed)
    async def tokenize(req: P.TokenizeRequest):
        ctx.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise P.APIError("give exactly one of prompt and messages", param="prompt", code="invalid_value")
        if req.messages is not None:
            ids = ctx.chat_prompt(req)
        else:
            ids = tokenizer().encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return P.TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids)

    @app.post("/detokenize", dependencies=keyed)
    async def detokenize(req: P.DetokenizeRequest):
        ctx.check_model(req.model)
        vocab = ctx.vocab_size
        bad = [t for t in req.tokens if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise P.APIError(f"tokens: ids {bad[:5]} are not in [0, {vocab})", param="tokens", code="invalid_value")
        return P.DetokenizeResponse(prompt=tokenizer().decode(req.tokens))

    @app.get("/version")
    async def version():
        return {"version": server_version()}

    @app.get("/v1/models/{model_id:path}", dependencies=keyed)
    async def model_card(model_id: str):
        adapters = {card.id: card for card in lora_routes.adapter_cards(ctx.engine, ctx.model_name, ctx.max_model_len)}
        if model_id in adapters:
            return adapters[model_id]
        if model_id != ctx.model_name:
            raise P.model_not_found(model_id)
        return P.ModelCard(id=ctx.model_name, max_model_len=ctx.max_model_len)
