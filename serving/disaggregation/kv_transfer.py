"""Moving a finished prefill's KV between engines: device gather/scatter and the wire payload.

Export (prefill side): when a request flagged with `kv_export` samples its
first token, `Engine.export_prompt_kv` has the runner gather the pages of its
block table with one jitted gather (`gather_jit`, page count padded to a power
of two so few shapes compile) into a single `[layers, 2, pages, page_size,
kv_heads, head_dim]` device array. Nothing waits for it on the engine thread;
the HTTP handler copies it to host once and cuts it to the prompt's tokens.

Import (decode side): the runner scatters `[layers, 2, tokens, kv_heads,
head_dim]` host K/V into its donated cache at the given slots (`write_jit`,
token count padded to a power of two, padding slots dropped, a sharded
cache kept in its shardings). It works per token, so the two engines may use
different page sizes. Both calls go through the runner (`ModelRunner.
export_pages` / `import_tokens`), the one place that places arrays, so they
work under tensor parallelism too.

The payload is signed and read under size caps by `serving.disaggregation.kv_wire` (its
framing and tags); this module says what its header holds (`payload_header`)
and how many array bytes an engine accepts after it (`body_bytes`: the same
geometry and dtype, at most the tokens the pool and context window hold). The
header lists the per-layer arrays by name and shape, so quantized caches can
add scale arrays without a new framing. `PayloadError` is an authenticated
payload this engine cannot hold; `to_import` turns a checked one into a
`KVImport` (the prompt, its K/V, the first token, seed, logprobs and the
request's cache salt).
"""

from __future__ import annotations

import contextvars
import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.pow2 import next_pow2, powers_of_two
from model.cache import KVCache, StackedKVCache
from model.quant import kv_bytes_per_token
from serving.core.block_manager import is_cache_salt
from serving.disaggregation import kv_wire

VERSION = 2
KV_ARRAYS = ("k", "v")  # what this engine reads and writes; quantized caches would add e.g. "k_scale"


class PayloadError(kv_wire.WireError):
    """An authenticated KV payload that does not fit this engine (an HTTP 400, or 413 when too large)."""


# --- device side (called by the model runner, which places the inputs) ------------------------------

def _gather_pages(cache, pages):
    if isinstance(cache, StackedKVCache):  # layer l's page p is row l * num_pages + p
        shape = (cache.num_layers, cache.num_pages) + cache.k.shape[1:]
        return jnp.stack([cache.k.reshape(shape)[:, pages], cache.v.reshape(shape)[:, pages]], axis=1)
    return jnp.stack([jnp.stack([k[pages], v[pages]]) for k, v in zip(cache.k, cache.v)])


def _write_tokens(cache: KVCache, slots, kv, *, shardings=None):
    """The cache with `kv` written at `slots`; `shardings` (one per leaf, k's then v's) keeps a sharded
    cache in the shardings it was placed with, so the next step's inputs match its executable."""
    def put(x, new):
        num_pages, page_size, heads, dim = x.shape
        flat = x.reshape(num_pages * page_size, heads, dim).at[slots].set(new.astype(x.dtype), mode="drop")
        return flat.reshape(x.shape)

    if isinstance(cache, StackedKVCache):  # layer l's page p is row l * num_pages + p: one scatter each
        layers, pages, page_size = cache.num_layers, cache.num_pages, cache.page_size
        page, offset = slots // page_size, slots % page_size
        rows = jnp.where(page[None, :] >= pages, layers * pages,
                         page[None, :] + (jnp.arange(layers) * pages)[:, None])  # [layers, n]; padding dropped
        k, v = (x.at[rows, offset[None, :]].set(kv[:, j].astype(x.dtype), mode="drop")
                for j, x in enumerate((cache.k, cache.v)))
        if shardings is not None:
            k, v = (jax.lax.with_sharding_constraint(x, s) for x, s in zip((k, v), shardings))
        return StackedKVCache(k=k, v=v, num_layers=layers)
    k = [put(x, kv[i, 0]) for i, x in enumerate(cache.k)]
    v = [put(x, kv[i, 1]) for i, x in enumerate(cache.v)]
    if shardings is not None:
        leaves = [jax.lax.with_sharding_constraint(x, s) for x, s in zip(k + v, shardings)]
        k, v = leaves[:len(k)], leaves[len(k):]
    return KVCache(k=k, v=v)


gather_jit = jax.jit(_gather_pages)
write_jit = jax.jit(_write_tokens, static_argnames=("shardings",), donate_argnums=(0,))


def padded_pages(table: list[int]) -> np.ndarray:
    """The page ids to gather: `table`, padded with page 0 to a power of two (few shapes compile)."""
    pages = np.zeros(next_pow2(len(table)), np.int32)
    pages[:len(table)] = table
    return pages


def padded_tokens(slots: np.ndarray, kv: np.ndarray, pad_slot: int) -> tuple[np.ndarray, np.ndarray]:
    """`slots` and `kv` ([layers, 2, n, kv_heads, head_dim]) padded to a power-of-two token count (at
    least 16); padding slots are `pad_slot`, one past the pool, which the scatter drops."""
    n = len(slots)
    size = next_pow2(n, 16)
    padded_slots = np.full(size, pad_slot, np.int32)
    padded_slots[:n] = slots
    padded = np.zeros(kv.shape[:2] + (size,) + kv.shape[3:], kv.dtype)
    padded[:, :, :n] = kv
    return padded_slots, padded


def transfer_sizes(max_model_len: int, page_size: int) -> tuple[list[int], list[int]]:
    """(page counts a gather compiles for, token counts a scatter compiles for) up to `max_model_len`:
    the sizes `padded_pages` and `padded_tokens` pad to."""
    max_pages = -(-max_model_len // page_size)
    return powers_of_two(next_pow2(max_pages)), powers_of_two(next_pow2(max_model_len, 16), 16)


def compilation_count() -> int:
    """Executables compiled so far for the page gather and the token scatter."""
    return gather_jit._cache_size() + write_jit._cache_size()


def warm_up(engine) -> int:
    """Compiles the gather and the scatter for every size `engine` can ship or receive; returns how many
    executables that compiled. Call before the engine loop starts (it writes nothing: every slot is padding)."""
    return engine.runner.warm_up_transfer(engine.max_model_len)


def token_slots(table: list[int], page_size: int, start: int, stop: int) -> np.ndarray:
    pos = np.arange(start, stop)
    return np.asarray(table, np.int64)[pos // page_size] * page_size + pos % page_size


# --- what crosses between the engine and its callers ---------------------------------------------

@dataclasses.dataclass
class PrefillExport:
    """What a prefill produced, handed to the request's `kv_export` callback on the engine thread."""

    prompt_token_ids: list[int]
    first_token: int
    seed: int
    page_size: int
    pages: Any  # device array [layers, 2, P, page_size, kv_heads, head_dim] (not yet on host)
    logprobs: Optional[dict]  # the first token's chosen_logprob, rank, top_ids, top_logprobs (or None)
    cache_salt: Optional[str] = None  # the request's prefix-cache salt (the decode side keeps it)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def host_kv(self) -> np.ndarray:
        """Copies the pages to host (blocking) and cuts them to `[layers, 2, tokens, kv_heads, head_dim]`."""
        x = np.asarray(self.pages)
        layers, two, pages, ps = x.shape[:4]
        return np.ascontiguousarray(x.reshape(layers, two, pages * ps, *x.shape[4:])[:, :, :self.num_tokens])


@dataclasses.dataclass
class KVImport:
    """A prompt's K/V and first token, to be resumed by `Engine` instead of computed."""

    prompt_token_ids: list[int]
    first_token: int
    seed: int
    kv: np.ndarray  # [layers, 2, tokens, kv_heads, head_dim]
    logprobs: Optional[dict] = None
    cache_salt: Optional[str] = None  # the salt the prefill side used; the resumed request keeps it

    def step_result(self, k: Optional[int]):
        """The first token's logprobs in the shape of a one-row `StepResult` (for the engine's output path)."""
        from serving.core.model_runner import StepResult

        if k is None:
            return StepResult(np.asarray([self.first_token]))
        if self.logprobs is None:
            raise PayloadError("the request asks for logprobs but the payload carries none")
        lp = self.logprobs
        top_ids = np.asarray(lp["top_ids"], np.int64)[None]
        if top_ids.shape[1] < k:
            raise PayloadError(f"the payload carries {top_ids.shape[1]} top logprobs, the request asks for {k}")
        return StepResult(np.asarray([self.first_token]), (
            np.asarray([lp["chosen_logprob"]], np.float32), np.asarray([lp["rank"]], np.int64), top_ids,
            np.asarray(lp["top_logprobs"], np.float32)[None]))


def unsupported_reason(engine) -> Optional[str]:
    """Why `engine` cannot export or import KV, or None when it can."""
    return engine.runner.kv_transfer_unsupported()


def check_import(req, imp: KVImport) -> None:
    """Raises InvalidParameterError unless `imp` can resume `req` (same prompt, one sample, logprobs shipped)."""
    from serving.core.sampling_params import InvalidParameterError

    p = req.params
    if req.prompt_token_ids != imp.prompt_token_ids:
        raise InvalidParameterError("prompt", "prompt: tokenizes to other token ids than the shipped KV's prompt "
                                              "(prefill and decode workers must serve the same model)")
    if req.cache_salt != imp.cache_salt:
        raise InvalidParameterError("cache_salt", "cache_salt: differs from the salt the shipped KV was computed "
                                                  "under")
    if p.n != 1 or p.prompt_logprobs is not None:
        raise InvalidParameterError("n", "n: a disaggregated request must have n=1 and no prompt logprobs")
    if imp.kv.shape[2] != len(req.prompt_token_ids):
        raise InvalidParameterError("prompt", "prompt: the shipped KV does not cover the prompt")
    try:
        imp.step_result(p.logprobs)
    except PayloadError as e:
        raise InvalidParameterError("logprobs", f"logprobs: {e}") from e


# The import an internal decode route hands to the OpenAI handler it calls (read by the HTTP layer).
current_import: contextvars.ContextVar[Optional[KVImport]] = contextvars.ContextVar("kv_import", default=None)


def engine_kwargs() -> dict:
    """`generate(...)` keyword arguments for the import in the current context (none outside a decode route)."""
    imp = current_import.get()
    return {} if imp is None else {"kv_import": imp}


# --- the payload ---------------------------------------------------------------------------------

def geometry(cfg, dtype) -> dict:
    return {"num_layers": cfg.num_layers, "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "dtype": np.dtype(dtype).name}


def payload_header(export: PrefillExport, cfg, dtype, extra: dict) -> dict:
    """The header of the payload that ships `export` (the array bytes follow it)."""
    shape = [export.num_tokens, cfg.num_kv_heads, cfg.head_dim]
    return {"version": VERSION, **extra, **geometry(cfg, dtype), "page_size": export.page_size,
            "num_tokens": export.num_tokens, "prompt_token_ids": export.prompt_token_ids,
            "first_token": export.first_token, "seed": export.seed, "logprobs": export.logprobs,
            "cache_salt": export.cache_salt, "arrays": [{"name": n, "shape": shape} for n in KV_ARRAYS]}


def encode_payload(export: PrefillExport, cfg, dtype, keys: kv_wire.SigningKeys,
                   extra: Optional[dict] = None) -> bytes:
    """The whole signed payload in memory (the HTTP route streams the same bytes layer by layer)."""
    return kv_wire.sign_payload(keys, payload_header(export, cfg, dtype, extra or {}), export.host_kv().tobytes())


def max_header_bytes(max_model_len: int) -> int:
    """The largest header a worker reads: the prompt's ids and the client's request echoed, generously."""
    return 2**20 + 256 * max_model_len


def max_payload_bytes(cfg, dtype, max_tokens: int) -> int:
    """The largest payload a worker holding at most `max_tokens` tokens per request accepts."""
    return (kv_wire.PREFIX_BYTES + max_header_bytes(max_tokens) + 2 * kv_wire.TAG_BYTES
            + kv_bytes_per_token(cfg, dtype) * max_tokens)


def body_bytes(header: dict, cfg, dtype, max_tokens: int) -> int:
    """The array bytes that must follow `header`; raises PayloadError unless this engine (config `cfg`,
    cache `dtype`, at most `max_tokens` tokens per request) can hold the payload's K/V."""
    if header.get("version") != VERSION:
        raise PayloadError(f"KV payload version {header.get('version')!r} is not {VERSION}")
    mine = geometry(cfg, dtype)
    for key, want in mine.items():
        if header.get(key) != want:
            raise PayloadError(f"KV payload {key}={header.get(key)!r} does not match this worker's {want!r} "
                               f"(prefill and decode workers must serve the same model and KV dtype)")
    arrays = header.get("arrays")
    names = [a.get("name") for a in arrays if isinstance(a, dict)] if isinstance(arrays, list) else None
    if names != list(KV_ARRAYS):
        raise PayloadError(f"KV payload arrays {names} are not supported; this worker reads exactly "
                           f"{list(KV_ARRAYS)} (quantized KV with scales is not supported yet)")
    n = header.get("num_tokens")
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= max_tokens:
        raise PayloadError(f"KV payload num_tokens={n!r} is not in [1, {max_tokens}] (this worker's context "
                           f"window and pool)", status=413 if isinstance(n, int) and n > max_tokens else 400)
    for a in arrays:
        if a.get("shape") != [n, cfg.num_kv_heads, cfg.head_dim]:
            raise PayloadError(f"KV payload array {a.get('name')} has shape {a.get('shape')}, expected "
                               f"{[n, cfg.num_kv_heads, cfg.head_dim]}")
    return n * kv_bytes_per_token(cfg, dtype)  # plain K/V pages: what the cache holds per token


def decode_payload(data: bytes, keys: kv_wire.SigningKeys, cfg, dtype, max_tokens: int) -> tuple[dict, memoryview]:
    """(header, the array bytes) of a signed payload in memory; raises `kv_wire.WireError` (PayloadError
    for one this engine cannot hold)."""
    return kv_wire.read_payload_bytes(data, keys, max_header_bytes(max_tokens),
                                      lambda h: body_bytes(h, cfg, dtype, max_tokens))


def to_import(header: dict, body: memoryview, cfg, dtype) -> KVImport:
    """The checked `KVImport` of an authenticated payload (zero-copy view of `body`)."""
    ids = header.get("prompt_token_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
        raise PayloadError("KV payload prompt_token_ids must be a non-empty list of ints")
    want = body_bytes(header, cfg, dtype, len(ids))
    if header["num_tokens"] != len(ids):
        raise PayloadError(f"KV payload num_tokens={header['num_tokens']} but {len(ids)} prompt_token_ids")
    if len(body) != want:
        raise PayloadError(f"KV payload carries {len(body)} bytes of K/V, expected {want} for {len(ids)} tokens")
    first, seed = header.get("first_token"), header.get("seed")
    if not isinstance(first, int) or not 0 <= first < cfg.vocab_size or not isinstance(seed, int):
        raise PayloadError("KV payload first_token/seed missing or out of range")
    salt = header.get("cache_salt")
    if salt is not None and not is_cache_salt(salt):
        raise PayloadError("KV payload cache_salt must be a non-empty string or null")
    shape = (cfg.num_layers, len(KV_ARRAYS), len(ids), cfg.num_kv_heads, cfg.head_dim)
    kv = np.frombuffer(body, dtype=np.dtype(jnp.dtype(dtype))).reshape(shape)
    return KVImport(list(ids), first, seed, kv, header.get("logprobs"), salt)
