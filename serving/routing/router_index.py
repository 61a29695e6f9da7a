"""What the router knows about the workers' prefix caches, and how it picks a worker.

Prompts are tokenized exactly as the workers tokenize them (`PromptEncoder`:
the same tokenizer and chat template, loaded from the same model directory)
and cut into the engine's chained block digests (`serving.core.block_manager.
block_digest`, the same page size), so a digest the router computed names the
same KV page a worker registered for that prefix.

Images enter the chain as they enter the workers' (`Sequence.block_extra`):
a chat's image part is one `IMAGE_MARK` id where the worker puts the image's
placeholder tokens (`RoutedPrompt`), and the digest of a block holding it also
covers a digest of the image (`image_digest`: of its URL, so of its bytes for a
`data:` URL; the router decodes and fetches nothing). Two chats with the same
text and different images therefore match only up to the first image, and two
with the same image match past it. These image blocks are the router's own
names (a worker expands an image into many placeholder tokens and hashes its
pixels), used only to compare routed prompts with each other; a client that
sends the same pixels in another encoding misses a hit, never gets a wrong answer.

`PrefixIndex` remembers, per worker, the digests of the full blocks of every
prompt the router sent there. It is learned only from routing: the router
cannot see the workers' pools, so it approximates their eviction. A worker's
pool frees pages to an LRU queue and evicts from its cold end when it needs a
page, so the index keeps each worker's digests in LRU order too (a routed
prompt touches all its blocks) and drops the coldest beyond a bound: the
worker's pool size in pages when its /metrics says so (`kv_cache_pages_total`),
else `--index_blocks_per_worker`. Blocks still held by running sequences or
pages a worker evicted early (preemption, other traffic) make it an estimate;
a wrong guess costs a recompute, never a wrong answer. A worker that fails
loses its entries (a restarted worker starts with an empty cache).

Policies (`choose`): `round_robin` cycles through the healthy workers;
`least_loaded` takes the one with the least load; `kv_aware` minimises

    cost = (prompt blocks the worker would have to compute) / (prompt blocks)
           + load_weight * load + kv_weight * KV usage

where load is max(the router's own in-flight requests there, the worker's last
scraped running + waiting requests): the prefix term prefers the worker that
already holds the conversation; the load terms keep one hot worker from
taking everything. Ties go round-robin.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
from typing import Optional, Sequence

from serving.core.block_manager import block_digest, salt_digest

POLICIES = ("kv_aware", "round_robin", "least_loaded")
IMAGE_MARK = -1  # where an image goes in a routed prompt's ids (no token has this id)


class RoutedPrompt(list):
    """A prompt's token ids as the router hashes them, with `images`: the digests of its images in prompt
    order, the i-th one standing at the i-th `IMAGE_MARK` id."""

    def __init__(self, ids=(), images: Sequence[bytes] = ()):
        super().__init__(ids)
        self.images = tuple(images)


def image_digest(url: str) -> bytes:
    """The router's name of an image part: a digest of its URL (for a `data:` URL, of the image's bytes)."""
    return hashlib.blake2b(b"image\0" + url.encode("utf-8"), digest_size=16).digest()


# --- prompts -> block digests ------------------------------------------------------------------


class PromptEncoder:
    """Token ids of a request body as a worker serving `model_dir` computes them."""

    def __init__(self, model_dir: Optional[str] = None, tokenizer=None):
        if tokenizer is None:
            from model.tokenizer import load_tokenizer

            model_dir = model_dir or default_model_dir()
            with open(os.path.join(model_dir, "model_config.json")) as f:
                vocab_size = json.load(f)["vocab_size"]
            tokenizer = load_tokenizer(model_dir, vocab_size)
        self.tokenizer = tokenizer

    def prompts(self, endpoint: str, body: dict) -> list[list[int]]:
        """The token ids of each prompt in `body`; [] when the body is malformed (the worker will say why)."""
        try:
            if endpoint in CHAT_LIKE:
                return [self.chat_prompt(as_chat(endpoint, body))]
            prompt = body.get("input" if endpoint in INPUT_ENDPOINTS else "prompt")
            if isinstance(prompt, str):
                prompt = [prompt]
            elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                prompt = [prompt]
            if not isinstance(prompt, list):
                return []
            return [self.tokenizer.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in prompt]
        except Exception:  # noqa: BLE001 - a request the worker will reject; route it anywhere
            return []

    def chat_prompt(self, req) -> list[int]:
        """A chat's prompt as the worker renders it (its tools and template arguments included), each
        image a single `IMAGE_MARK` keyed by the image's digest."""
        from serving.api.chat_template import IMAGE_SENTINEL, encode_chat
        from serving.api.tool_calls import template_message

        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        messages = [template_message(m) for m in req.messages]
        images = [image_digest(url) for m in req.messages for _, url in m.image_urls()]
        if not images:
            return encode_chat(messages, self.tokenizer, req.add_generation_prompt, tools, req.chat_template_kwargs)
        for out, m in zip(messages, req.messages):
            out["content"] = m.text(IMAGE_SENTINEL)
        ids = encode_chat(messages, self.tokenizer, req.add_generation_prompt, tools, req.chat_template_kwargs,
                          image_ids=[IMAGE_MARK])
        return RoutedPrompt(ids, images)


# Endpoints whose body is a chat, or becomes one on the worker (`as_chat`).
CHAT_LIKE = frozenset({"chat", "responses", "messages"})
# Endpoints whose prompts are the body's "input" (the pooling routes: /v1/embeddings, /pooling, /classify).
INPUT_ENDPOINTS = frozenset({"embeddings", "pooling", "classify"})


def as_chat(endpoint: str, body: dict):
    """The chat request a chat-like body is served as (a Responses turn without its stored history: a
    continued one is routed by its `previous_response_id` instead)."""
    if endpoint == "responses":
        from serving.api import responses_protocol as RQ

        return RQ.chat_request(RQ.ResponsesRequest.model_validate(body), [])[0]
    if endpoint == "messages":
        from serving.api import messages_protocol as MQ

        return MQ.chat_request(MQ.MessagesRequest.model_validate(body))[0]
    from serving.api.http_protocol import ChatCompletionRequest

    return ChatCompletionRequest.model_validate(body)


def default_model_dir() -> str:
    import model

    return os.path.join(os.path.dirname(os.path.abspath(model.__file__)), "default")


def block_hashes(token_ids: Sequence[int], page_size: int, cache_salt: Optional[str] = None,
                 model: Optional[str] = None, images: Sequence[bytes] = ()) -> list[bytes]:
    """Chained digests of the full blocks of `token_ids`, as `BlockManager` names its pages (a request's
    `cache_salt` starts the chain). `model`, when given (the request's `model`, which names a LoRA adapter
    on the workers), keys the chain after the salt, so an adapter's requests match only each other and
    go where its pages are: these names are the router's own (a worker keys an adapter's pages by a digest
    of its weights, which the router does not know). `images`: the digest of each `IMAGE_MARK` of
    `token_ids`, in order; a block holding marks is keyed by their images too, as a worker's is."""
    out: list[bytes] = []
    root = salt_digest(cache_salt)
    if model is not None:
        root = hashlib.blake2b(b"model\0" + (root or b"root") + model.encode("utf-8"), digest_size=16).digest()
    marks = [i for i, t in enumerate(token_ids) if t == IMAGE_MARK] if images else []
    if len(marks) != len(images):
        raise ValueError(f"{len(images)} image digests for {len(marks)} image marks")
    for i in range(len(token_ids) // page_size):
        start, end = i * page_size, (i + 1) * page_size
        extra = b"".join(d for m, d in zip(marks, images) if start <= m < end)
        out.append(block_digest(out[-1] if out else root, token_ids[start:end], extra))
    return out


def hittable_blocks(num_tokens: int, page_size: int) -> int:
    """Blocks of a prompt the engine can take from its cache: never the one holding the last token."""
    return max(0, (num_tokens - 1) // page_size)


# --- the index ----------------------------------------------------------------------------------


class PrefixIndex:
    """Per worker, an LRU-ordered set of block digests believed to be cached there."""

    def __init__(self, default_capacity: int = 4096):
        self.default_capacity = default_capacity
        self._blocks: dict[str, collections.OrderedDict[bytes, None]] = {}
        self._capacity: dict[str, int] = {}

    def set_capacity(self, worker: str, num_blocks: Optional[int]) -> None:
        self._capacity[worker] = int(num_blocks) if num_blocks else self.default_capacity
        self._trim(worker)

    def capacity(self, worker: str) -> int:
        return self._capacity.get(worker, self.default_capacity)

    def overlap(self, worker: str, hashes: Sequence[bytes]) -> int:
        """Leading blocks of `hashes` the worker holds (a chain: the first miss ends the match)."""
        held = self._blocks.get(worker)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def record(self, worker: str, hashes: Sequence[bytes]) -> None:
        """The worker computed (or reused) these blocks: they become its most recently used."""
        held = self._blocks.setdefault(worker, collections.OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        self._trim(worker)

    def forget(self, worker: str) -> None:
        self._blocks.pop(worker, None)

    def size(self, worker: str) -> int:
        return len(self._blocks.get(worker, ()))

    def _trim(self, worker: str) -> None:
        held = self._blocks.get(worker)
        cap = self.capacity(worker)
        while held and len(held) > cap:
            held.popitem(last=False)


# --- workers and policies -------------------------------------------------------------------------


@dataclasses.dataclass
class WorkerLoad:
    """A worker as the policies see it: health, the router's own in-flight count, the last scrape."""

    url: str
    healthy: bool = True
    in_flight: int = 0
    running: int = 0  # scraped vllm:num_requests_running
    waiting: int = 0  # scraped vllm:num_requests_waiting
    kv_usage: float = 0.0  # scraped vllm:kv_cache_usage_perc
    page_size: int = 0  # scraped ridgeline:kv_cache_page_size (0: not reported yet)

    def load(self) -> int:
        return max(self.in_flight, self.running + self.waiting)


@dataclasses.dataclass(frozen=True)
class Choice:
    worker: str
    matched_blocks: int  # leading prompt blocks the index says the worker holds


class Router:
    """Picks a worker for a prompt under one policy; remembers what it sent where."""

    def __init__(self, policy: str, page_size: int, index: Optional[PrefixIndex] = None,
                 load_weight: float = 0.1, kv_weight: float = 0.5):
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.policy, self.page_size = policy, page_size
        self.index = index or PrefixIndex()
        self.load_weight, self.kv_weight = load_weight, kv_weight
        self._next = 0  # round-robin cursor (also breaks ties)

    def hashes(self, prompts: Sequence[Sequence[int]], cache_salt: Optional[str] = None,
               model: Optional[str] = None) -> list[list[bytes]]:
        return [block_hashes(p, self.page_size, cache_salt, model, getattr(p, "images", ())) for p in prompts]

    def choose(self, workers: Sequence[WorkerLoad], prompts: Sequence[Sequence[int]],
               exclude: Sequence[str] = (), policy: Optional[str] = None,
               cache_salt: Optional[str] = None, model: Optional[str] = None) -> Optional[Choice]:
        """The worker for a request with these prompts (token ids), salt and model (`block_hashes`); None
        when no healthy worker is left."""
        pool = [w for w in workers if w.healthy and w.url not in exclude]
        if not pool:
            return None
        policy = policy or self.policy
        hashes = self.hashes(prompts, cache_salt, model)
        hittable = [h[:hittable_blocks(len(p), self.page_size)] for p, h in zip(prompts, hashes)]
        total = sum(len(h) for h in hittable)
        matched = {w.url: sum(self.index.overlap(w.url, h) for h in hittable) for w in pool}
        start = self._next % len(pool)
        order = pool[start:] + pool[:start]  # rotation: ties and round-robin both follow it
        self._next += 1
        if policy == "round_robin":
            best = order[0]
        elif policy == "least_loaded":
            best = min(order, key=lambda w: (w.load(), w.kv_usage))
        else:
            def cost(w: WorkerLoad) -> float:
                uncached = (total - matched[w.url]) / total if total else 0.0
                return uncached + self.load_weight * w.load() + self.kv_weight * w.kv_usage

            best = min(order, key=cost)
        return Choice(best.url, matched[best.url])

    def record(self, worker: str, prompts: Sequence[Sequence[int]], cache_salt: Optional[str] = None,
               model: Optional[str] = None) -> None:
        """The worker was sent these prompts: their full blocks will be cached there."""
        for h in self.hashes(prompts, cache_salt, model):
            self.index.record(worker, h)
