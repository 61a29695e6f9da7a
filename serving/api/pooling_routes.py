"""The pooling routes: OpenAI's `/v1/embeddings`, and vLLM's `/pooling`, `/classify`, `/score` and rerank routes.

Each input is one engine request with the request argument "pooling" (`serving.features.pooling`): it runs
in the same steps as generation requests and is aborted, its pages freed, when the client goes away. The
routes answer only on an engine serving a pooling model (runner=pooling); elsewhere each is a 400 saying so.

* `POST /v1/embeddings` (OpenAI): `input` a string, a list of strings, a list of token ids or a list of such
  lists; `encoding_format` "float" or "base64" (little-endian float32, what the `openai` client decodes);
  `dimensions` (Matryoshka truncation, bounded by the model's config); `user` (accepted, as OpenAI's).
* `POST /pooling` (vLLM): the same inputs; `task` "embed" (default on an embedder), "token_embed" (every
  token's hidden state), "classify" or "reward" (default on a classifier).
* `POST /classify`: a sequence classifier's label probabilities and its predicted label.
* `POST /score`: `text_1` against each `text_2` (one to one, or one to many): a cross-encoder's relevance
  (a one-label classifier on the pair) or an embedder's cosine similarity.
* `POST /rerank`, `/v1/rerank` (Jina's shape) and `/v2/rerank` (Cohere's): `query`, `documents` (strings or
  {"text": ...}), `top_n`, `return_documents`; results sorted by relevance.

Every route takes `truncate_prompt_tokens` (keep the first k tokens; -1: the model's limit); without it a
longer input is a 400 naming both lengths. Bodies are strict: an unknown field is a 400 naming it.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Literal, Optional, Union

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from serving.api import http_protocol as P
from serving.api.http_util import ClientGone
from serving.core.sampling_params import InvalidParameterError
from serving.features.pooling import (PoolingParams, PoolingPart, pair_prompts, pair_up, pooling_sampling_params,
                                      truncated)

Input = Union[str, list[str], list[int], list[list[int]]]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = None
    priority: int = 0


class EmbeddingRequest(_Strict):
    input: Input
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None
    normalize: Optional[bool] = None


class PoolingRequest(EmbeddingRequest):
    task: Optional[Literal["embed", "token_embed", "classify", "reward"]] = None


class ClassifyRequest(_Strict):
    input: Input
    user: Optional[str] = None


class ScoreRequest(_Strict):
    text_1: Union[str, list[str]]
    text_2: Union[str, list[str]]


class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="allow")
    text: str


class RerankRequest(_Strict):
    query: str
    documents: list[Union[str, RerankDocument]]
    top_n: Optional[int] = Field(default=None, ge=0)
    return_documents: bool = True
    max_tokens_per_doc: Optional[int] = None  # Cohere v2 (documents truncated to it)


def add_pooling_routes(app: FastAPI, ctx, keyed: list) -> None:
    """Mounts the pooling routes on `app` (their answers need an engine with a `PoolingPart`)."""

    def part() -> PoolingPart:
        found = ctx.engine_core().part(PoolingPart)
        if found is None:
            raise P.APIError(f"The model {ctx.model_name} generates text; this route needs a pooling model "
                             "(an embedding or classification checkpoint, served with runner=pooling)",
                             code="model_not_supported")
        return found

    def input_ids(value, truncate: Optional[int], field: str = "input") -> list[list[int]]:
        """Each input's token ids, truncated as asked (the engine checks them against the vocabulary)."""
        if isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(t, int) for t in value)):
            value = [value]
        if not value:
            raise P.APIError(f"{field} must not be empty", param=field, code="invalid_value")
        out = []
        for item in value:
            if isinstance(item, str):
                if ctx.tokenizer is None:
                    raise P.APIError("this model has no tokenizer; send token ids", param=field, code="invalid_value")
                ids = ctx.tokenizer.encode(item)
            else:
                ids = list(item)
            if not ids:
                raise P.APIError(f"{field}: an input must not be empty", param=field, code="invalid_value")
            out.append(ids)
        return [truncate_to(ids, truncate) for ids in out]

    def truncate_to(ids: list[int], truncate: Optional[int]) -> list[int]:
        try:
            return truncated(ids, truncate, part().max_prompt_tokens())
        except InvalidParameterError as e:
            raise P.APIError(str(e), param="truncate_prompt_tokens", code="invalid_value") from None

    def pooling_params(task: str, req=None) -> PoolingParams:
        try:
            return PoolingParams(task, dimensions=getattr(req, "dimensions", None),
                                 normalize=getattr(req, "normalize", None))
        except InvalidParameterError as e:
            raise P.APIError(str(e), param=e.param, code="invalid_value") from None

    async def pooled(request: Request, req, prompts: list[list[int]], params, prefix: str) -> list:
        """Each prompt's pooled array, in order (every request aborted if the client goes away); `params`: one
        `PoolingParams` for all, or one per prompt."""
        ctx.check_model(req.model)
        # Prefix-cache pages (last-token pooling shares them) are bound to the client's API key, as elsewhere.
        salt = ctx.api_keys.cache_salt(request, None)
        base = f"{prefix}-{uuid.uuid4().hex}"
        if isinstance(params, PoolingParams):
            finals = await ctx.final_outputs(request, prompts, pooling_sampling_params(), base, "pooling", salt, req,
                                             part_args={"pooling": params})
        else:  # one request per prompt, each with its own parameters, all at once
            finals = await asyncio.gather(*(
                ctx.final_outputs(request, [p], pooling_sampling_params(), f"{base}-{i}", "pooling", salt, req,
                                  part_args={"pooling": pp}) for i, (p, pp) in enumerate(zip(prompts, params))))
            finals = [f[0] for f in finals]
        return [np.asarray(out.pooled, np.float32) for out in finals]

    def usage(prompts: list[list[int]]) -> dict:
        n = sum(len(p) for p in prompts)
        return {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0, "prompt_tokens_details": None}

    def encoded(vec: np.ndarray, encoding_format: str):
        if encoding_format == "base64":
            return base64.b64encode(np.asarray(vec, "<f4").tobytes()).decode("ascii")
        return vec.tolist()

    def default_task() -> str:
        return "embed" if part().model.head is None else "classify"

    @app.post("/v1/embeddings", dependencies=keyed)
    async def embeddings(req: EmbeddingRequest, request: Request):
        part()
        prompts = input_ids(req.input, req.truncate_prompt_tokens)
        try:
            vectors = await pooled(request, req, prompts, pooling_params("embed", req), "embd")
        except ClientGone:
            return Response(status_code=499)
        data = [{"object": "embedding", "index": i, "embedding": encoded(v, req.encoding_format)}
                for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": ctx.served_model(), "usage": usage(prompts)}

    @app.post("/pooling", dependencies=keyed)
    async def pooling_route(req: PoolingRequest, request: Request):
        part()
        prompts = input_ids(req.input, req.truncate_prompt_tokens)
        params = pooling_params(req.task or default_task(), req)
        try:
            arrays = await pooled(request, req, prompts, params, "pool")
        except ClientGone:
            return Response(status_code=499)
        data = [{"object": "pooling", "index": i, "data": encoded(a, req.encoding_format)}
                for i, a in enumerate(arrays)]
        return {"id": f"pool-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": ctx.served_model(), "data": data, "usage": usage(prompts)}

    @app.post("/classify", dependencies=keyed)
    async def classify(req: ClassifyRequest, request: Request):
        labels = part().model.labels or {}
        prompts = input_ids(req.input, req.truncate_prompt_tokens)
        try:
            probs = await pooled(request, req, prompts, pooling_params("classify"), "classify")
        except ClientGone:
            return Response(status_code=499)
        data = [{"index": i, "label": labels.get(int(np.argmax(p)), str(int(np.argmax(p)))), "probs": p.tolist(),
                 "num_classes": len(p)} for i, p in enumerate(probs)]
        return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": ctx.served_model(), "data": data, "usage": usage(prompts)}

    async def scores(request: Request, req, firsts: list[str], seconds: list[str]) -> tuple[list[float], list]:
        """The relevance of each (first, second) text pair, and the prompts it read."""
        truncate = req.truncate_prompt_tokens
        if part().model.head is not None:  # a cross-encoder: each pair is one prompt
            try:
                prompts, params = pair_prompts(ctx.tokenizer, firsts, seconds,
                                               ctx.engine_core().cfg.type_vocab_size > 1, truncate,
                                               part().max_prompt_tokens())
            except InvalidParameterError as e:
                raise P.APIError(str(e), param=e.param, code="invalid_value") from None
            values = await pooled(request, req, prompts, params, "score")
            return [float(v[0]) for v in values], prompts
        texts = list(dict.fromkeys(firsts + seconds))  # an embedder: the cosine of the two embeddings
        prompts = input_ids(texts, truncate)
        vectors = dict(zip(texts, await pooled(request, req, prompts, PoolingParams("embed", normalize=True),
                                               "score")))
        return [float(vectors[a] @ vectors[b]) for a, b in zip(firsts, seconds)], prompts

    def pairs(first, second, names: tuple[str, str]) -> tuple[list[str], list[str]]:
        try:
            return pair_up(first, second, names)
        except InvalidParameterError as e:
            raise P.APIError(str(e), param=e.param, code="invalid_value") from None

    @app.post("/score", dependencies=keyed)
    async def score(req: ScoreRequest, request: Request):
        part()
        firsts, seconds = pairs(req.text_1, req.text_2, ("text_1", "text_2"))
        try:
            values, prompts = await scores(request, req, firsts, seconds)
        except ClientGone:
            return Response(status_code=499)
        data = [{"index": i, "object": "score", "score": v} for i, v in enumerate(values)]
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": ctx.served_model(), "data": data, "usage": usage(prompts)}

    async def rerank(req: RerankRequest, request: Request):
        part()
        docs = [d if isinstance(d, str) else d.text for d in req.documents]
        if req.max_tokens_per_doc is not None and ctx.tokenizer is not None:
            docs = [ctx.tokenizer.decode(ctx.tokenizer.encode(d, add_special_tokens=False)[:req.max_tokens_per_doc])
                    for d in docs]
        firsts, seconds = pairs(req.query, docs, ("query", "documents"))
        try:
            values, prompts = await scores(request, req, firsts, seconds)
        except ClientGone:
            return Response(status_code=499)
        order = sorted(range(len(values)), key=lambda i: -values[i])
        if req.top_n is not None and req.top_n > 0:
            order = order[:req.top_n]
        results = [{"index": i, "relevance_score": values[i],
                    **({"document": {"text": docs[i]}} if req.return_documents else {})} for i in order]
        n = sum(len(p) for p in prompts)
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": ctx.served_model(), "results": results,
                "usage": {"total_tokens": n}}

    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path, dependencies=keyed)(rerank)
