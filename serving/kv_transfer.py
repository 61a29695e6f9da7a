"""Moving a finished prefill's KV between engines: device gather/scatter and the wire payload.

Export (prefill side): when a request flagged with `kv_export` samples its
first token, `Engine.export_prompt_kv` gathers the pages of its block table
with one jitted gather (`gather_pages`, page count padded to a power of two
so few shapes compile) into a single `[layers, 2, pages, page_size, kv_heads,
head_dim]` device array. Nothing waits for it on the engine thread; the HTTP
handler copies it to host once and cuts it to the prompt's tokens.

Import (decode side): `write_tokens` scatters `[layers, 2, tokens, kv_heads,
head_dim]` host K/V into the donated cache at the given slots (token count
padded to a power of two, padding slots dropped). It works per token, so the
two engines may use different page sizes.

The payload (`encode_payload` / `decode_payload`) is framed as
`b"RKV1" | u32 header length | header JSON | array bytes`; the header lists
the per-layer arrays by name and shape, so quantized caches can add scale
arrays without a new framing. `decode_payload` raises `PayloadError` for
anything malformed; `check_compatible` raises it for a payload this engine
cannot hold (other geometry, dtype or arrays).
"""

from __future__ import annotations

import contextvars
import dataclasses
import json
import struct
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.pow2 import next_pow2
from model.cache import KVCache

MAGIC = b"RKV1"
VERSION = 1
KV_ARRAYS = ("k", "v")  # what this engine reads and writes; quantized caches would add e.g. "k_scale"


class PayloadError(ValueError):
    """A KV payload that is malformed or does not fit this engine (an HTTP 400)."""

    param = "payload"


# --- device side -------------------------------------------------------------------------------

def _gather_pages(cache: KVCache, pages):
    return jnp.stack([jnp.stack([k[pages], v[pages]]) for k, v in zip(cache.k, cache.v)])


def _write_tokens(cache: KVCache, slots, kv):
    def put(x, new):
        num_pages, page_size, heads, dim = x.shape
        flat = x.reshape(num_pages * page_size, heads, dim).at[slots].set(new.astype(x.dtype), mode="drop")
        return flat.reshape(x.shape)

    return KVCache(k=[put(x, kv[i, 0]) for i, x in enumerate(cache.k)],
                   v=[put(x, kv[i, 1]) for i, x in enumerate(cache.v)])


_gather_jit = jax.jit(_gather_pages)
_write_jit = jax.jit(_write_tokens, donate_argnums=(0,))


def gather_pages(cache: KVCache, table: list[int]):
    """`[layers, 2, P, page_size, kv_heads, head_dim]` on device, P >= len(table) (extra pages are page 0)."""
    pages = np.zeros(next_pow2(len(table)), np.int32)
    pages[:len(table)] = table
    return _gather_jit(cache, pages)


def write_tokens(cache: KVCache, slots: np.ndarray, kv: np.ndarray) -> KVCache:
    """The cache with `kv` ([layers, 2, n, kv_heads, head_dim], host) written at `slots` ([n]); donates `cache`."""
    n = len(slots)
    size = next_pow2(n, 16)
    pad_slot = cache.num_pages * cache.page_size
    padded_slots = np.full(size, pad_slot, np.int32)
    padded_slots[:n] = slots
    padded = np.zeros(kv.shape[:2] + (size,) + kv.shape[3:], kv.dtype)
    padded[:, :, :n] = kv
    return _write_jit(cache, padded_slots, padded)


def compilation_count() -> int:
    """Executables compiled so far for the page gather and the token scatter."""
    return _gather_jit._cache_size() + _write_jit._cache_size()


def warm_up(engine) -> int:
    """Compiles the gather and the scatter for every size `engine` can ship or receive; returns how many
    executables that compiled. Call before the engine loop starts (it writes nothing: every slot is padding)."""
    before = compilation_count()
    cache = engine.runner.cache
    max_pages = -(-engine.max_model_len // cache.page_size)
    pages = 1
    while True:
        gather_pages(cache, [0] * pages)
        if pages >= max_pages:
            break
        pages *= 2
    dtype = cache.k[0].dtype
    shape = (len(cache.k), 2)
    tokens = 16
    while True:
        slots = np.full(tokens, cache.num_pages * cache.page_size, np.int64)
        cache = write_tokens(cache, slots, np.zeros(shape + (tokens,) + cache.k[0].shape[2:], dtype))
        if tokens >= engine.max_model_len:
            break
        tokens *= 2
    engine.runner.cache = cache
    return compilation_count() - before


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

    def step_result(self, k: Optional[int]):
        """The first token's logprobs in the shape of a one-row `StepResult` (for the engine's output path)."""
        from serving.model_runner import StepResult

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
    layout = getattr(engine.runner, "layout", None)
    if layout is not None:
        return ("KV transfer is implemented for single-device engines only (this one is sharded or pipelined: "
                "its cache shardings would have to be restored after the scatter)")
    cache = getattr(engine.runner, "cache", None)
    if not isinstance(cache, KVCache):
        return "KV transfer needs a runner with a plain per-layer KVCache"
    if not all(isinstance(x, jax.Array) for x in list(cache.k) + list(cache.v)):
        return ("KV transfer supports plain K/V pages only; this worker's KV cache is quantized (pages with "
                "scales), which the payload does not carry yet")
    return None


def check_import(req, imp: KVImport) -> None:
    """Raises InvalidParameterError unless `imp` can resume `req` (same prompt, one sample, logprobs shipped)."""
    from serving.sampling_params import InvalidParameterError

    p = req.params
    if req.prompt_token_ids != imp.prompt_token_ids:
        raise InvalidParameterError("prompt", "prompt: tokenizes to other token ids than the shipped KV's prompt "
                                              "(prefill and decode workers must serve the same model)")
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


def encode_header(export: PrefillExport, cfg, dtype, extra: dict) -> bytes:
    """The framing and header of a payload (the array bytes follow)."""
    shape = [export.num_tokens, cfg.num_kv_heads, cfg.head_dim]
    header = {"version": VERSION, **extra, **geometry(cfg, dtype), "page_size": export.page_size,
              "num_tokens": export.num_tokens, "prompt_token_ids": export.prompt_token_ids,
              "first_token": export.first_token, "seed": export.seed, "logprobs": export.logprobs,
              "arrays": [{"name": n, "shape": shape} for n in KV_ARRAYS]}
    blob = json.dumps(header).encode()
    return MAGIC + struct.pack("<I", len(blob)) + blob


def encode_payload(export: PrefillExport, cfg, dtype, extra: Optional[dict] = None) -> bytes:
    return encode_header(export, cfg, dtype, extra or {}) + export.host_kv().tobytes()


def decode_payload(data: bytes) -> tuple[dict, memoryview]:
    """(header, the array bytes) of a payload; raises PayloadError on bad framing."""
    if len(data) < 8 or data[:4] != MAGIC:
        raise PayloadError("not a KV payload (bad magic)")
    (n,) = struct.unpack("<I", data[4:8])
    if 8 + n > len(data):
        raise PayloadError(f"KV payload truncated inside its header ({len(data)} bytes, header of {n})")
    try:
        header = json.loads(bytes(data[8:8 + n]))
    except ValueError as e:
        raise PayloadError(f"KV payload header is not JSON: {e}") from e
    if not isinstance(header, dict) or header.get("version") != VERSION:
        raise PayloadError(f"KV payload version {header.get('version') if isinstance(header, dict) else None} "
                           f"is not {VERSION}")
    return header, memoryview(data)[8 + n:]


def check_compatible(header: dict, cfg, dtype) -> None:
    """Raises PayloadError unless this engine (config `cfg`, cache `dtype`) can hold the payload's K/V."""
    mine = geometry(cfg, dtype)
    for key, want in mine.items():
        if header.get(key) != want:
            raise PayloadError(f"KV payload {key}={header.get(key)!r} does not match this worker's {want!r} "
                               f"(prefill and decode workers must serve the same model and KV dtype)")
    names = [a.get("name") for a in header.get("arrays", []) if isinstance(a, dict)]
    if names != list(KV_ARRAYS):
        raise PayloadError(f"KV payload arrays {names} are not supported; this worker reads exactly "
                           f"{list(KV_ARRAYS)} (quantized KV with scales is not supported yet)")


def to_import(header: dict, body: memoryview, cfg, dtype) -> KVImport:
    """The checked `KVImport` of a payload (zero-copy view of `body`)."""
    check_compatible(header, cfg, dtype)
    ids = header.get("prompt_token_ids")
    n = header.get("num_tokens")
    if not isinstance(ids, list) or not ids or n != len(ids) or not all(isinstance(t, int) for t in ids):
        raise PayloadError("KV payload prompt_token_ids must be a non-empty list of num_tokens ints")
    first, seed = header.get("first_token"), header.get("seed")
    if not isinstance(first, int) or not 0 <= first < cfg.vocab_size or not isinstance(seed, int):
        raise PayloadError("KV payload first_token/seed missing or out of range")
    for a in header["arrays"]:
        if a.get("shape") != [n, cfg.num_kv_heads, cfg.head_dim]:
            raise PayloadError(f"KV payload array {a.get('name')} has shape {a.get('shape')}, expected "
                               f"{[n, cfg.num_kv_heads, cfg.head_dim]}")
    dt = np.dtype(jnp.dtype(dtype))
    shape = (cfg.num_layers, len(KV_ARRAYS), n, cfg.num_kv_heads, cfg.head_dim)
    want = int(np.prod(shape)) * dt.itemsize
    if len(body) != want:
        raise PayloadError(f"KV payload carries {len(body)} bytes of K/V, expected {want} for {n} tokens")
    kv = np.frombuffer(body, dtype=dt).reshape(shape)
    return KVImport(list(ids), first, seed, kv, header.get("logprobs"))
