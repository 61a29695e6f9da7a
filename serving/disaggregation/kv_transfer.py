"""Moving a finished prefill's KV between engines: the hooks the engine calls, the payload.

The device programs it runs (the page gather and the token scatter) are
`serving.features.kv_pages`'s, shared with the prefix cache's host tier; the model
runner only runs them over its cache (`ModelRunner.run_on_cache`, which places
the host inputs, donates and keeps the cache's shardings), so they work under
tensor parallelism too, and `serving.core` never imports this package.

Export (prefill side): a request made with the request argument `kv_export`, an
`Exporter`, hands it the block table of its prompt when it samples its first
token (the `serving.features.kv_exports` part); the exporter runs one jitted gather (`gather_jit`,
page count padded to a power of two so few shapes compile) into a
`[layers, 2, pages, page_size, kv_heads, head_dim]` device array, plus for an
int8 / fp8 cache the `[layers, 2, pages, page_size, kv_heads]` fp32 scales
beside it. Nothing waits for them on the engine thread; the HTTP handler
copies them to host once (`PrefillExport.host_kv`) and cuts them to the
prompt's tokens.

Import (decode side): a request made with the request argument `kv_import`, a
`KVImport`, is admitted by the `serving.features.kv_imports` part, which then calls `KVImport.write` with the slots' pages; that
scatters the host K/V (and scales) into the donated cache at the token slots
(`write_jit`, token count padded to a power of two, padding slots dropped, a
sharded cache kept in its shardings). It works per token, so the two engines
may use different page sizes. A quantized page is shipped as it is stored
(the int8 / fp8 values and their per-token scales): nothing is dequantized or
quantized again, so the decode side holds the same bits as the prefill side.

The payload is signed and read under size caps by
`serving.disaggregation.kv_wire` (its framing and tags); this module says what
its header holds (`payload_header`: the per-layer arrays by name, shape and
dtype, `array_specs`) and how many array bytes an engine accepts after it
(`body_bytes`: the same geometry and KV dtype, at most the tokens the pool and
context window hold). A payload whose KV dtype differs from the worker's cache
(an int8 payload to a float worker, a float payload to an fp8 one, ...) is
refused: pages cannot be converted without changing the tokens that follow.
`PayloadError` is an authenticated payload this engine cannot hold;
`to_import` turns a checked one into a `KVImport` (the prompt, its K/V, the
first token, seed, logprobs and the request's cache salt).

A prompt holding images ships what the decode side needs of them, so it never
runs the encoder: the header's `images` list each image's content digest (hex),
first placeholder position, patch grid and token count, and `mrope_delta` the
multimodal-RoPE offset of positions after the prompt; the body ends with the
images' encoder outputs (`image_embeds`, float32 `[image tokens, hidden]`, after
the last layer). The decode side rebuilds the request's images from them
(`serving.features.multimodal.EncodedImage`): the digests name its prefix-cache
blocks as the prefill side's, the positions continue past the prompt, and a
recompute after preemption has the embeddings it needs.
"""

from __future__ import annotations

import contextvars
import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from model.families import kv_bytes_per_token
from model.quant import SCALE_DTYPE, is_quantized_dtype
from serving.core.block_manager import is_cache_salt
from serving.features.multimodal import Encoded, EncodedImage
# The device programs and the host form of K/V (the prefix cache's host tier runs them too); imported
# under the names this module has always offered.
from serving.features.kv_pages import (  # noqa: F401
    HostKV, _gather_pages, _parts, _write_tokens, cache_stages, compilation_count, gather, gather_jit,
    padded_pages, padded_tokens, token_slots, transfer_sizes, write, write_jit)
from serving.disaggregation import kv_wire
from serving.features.lora import request_adapter

VERSION = 4  # 3: each array lists its dtype, int8 / fp8 pages with "k_scale" / "v_scale"; 4: "images", "mrope_delta"
KV_ARRAYS = ("k", "v")  # the arrays of every payload
SCALE_ARRAYS = ("k_scale", "v_scale")  # added after them for an int8 / fp8 cache: one scale per token and KV head


class PayloadError(kv_wire.WireError):
    """An authenticated KV payload that does not fit this engine (an HTTP 400, or 413 when too large)."""


# --- the device programs (`gather`, `write`) are `serving.features.kv_pages`'s --------------------------

def warm_up(engine) -> int:
    """Compiles the gather and the scatter for every size `engine` can ship or receive; returns how many
    executables that compiled. Call before the engine loop starts (it writes nothing: every slot is padding)."""
    runner = engine.runner
    before = compilation_count()
    page_counts, token_counts = transfer_sizes(engine.max_model_len, runner.page_size)
    for n in page_counts:
        gather(runner, [0] * n)
    pad = runner.num_pages * runner.page_size
    for n in token_counts:
        write(runner, np.full(n, pad, np.int64), HostKV.zeros(runner.cfg, runner.kv_dtype, n))
    jax.block_until_ready(gather(runner, [0]))  # it reads the cache the writes leave: they are done too
    return compilation_count() - before


# --- what crosses between the engine and its callers ---------------------------------------------

@dataclasses.dataclass
class PrefillExport:
    """What a prefill produced, handed to the `Exporter`'s callback on the engine thread."""

    prompt_token_ids: list[int]
    first_token: int
    seed: int
    page_size: int
    pages: Any  # device array [layers, 2, P, page_size, kv_heads, head_dim] (not yet on host)
    logprobs: Optional[dict]  # the first token's chosen_logprob, rank, top_ids, top_logprobs (or None)
    cache_salt: Optional[str] = None  # the request's prefix-cache salt (the decode side keeps it)
    scales: Any = None  # int8 / fp8 cache: device array [layers, 2, P, page_size, kv_heads] (fp32), else None
    lora: Optional[dict] = None  # the LoRA adapter the K/V was computed under (`lora_identity`), None: the base
    images: tuple = ()  # the prompt's images: (first placeholder position, `EncodedImage`), in prompt order
    mrope_delta: int = 0  # multimodal RoPE: positions past the prompt are (index + mrope_delta)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def image_embeds(self) -> np.ndarray:
        """The images' encoder outputs, concatenated in prompt order (float32 `[image tokens, hidden]`)."""
        return _concat_embeds([im for _, im in self.images])

    def host_kv(self) -> HostKV:
        """Copies the pages (and scales) to host (blocking) and cuts them to the prompt's tokens."""
        def cut(x):
            if x is None:
                return None
            x = np.asarray(x)
            layers, two, pages, ps = x.shape[:4]
            return np.ascontiguousarray(x.reshape(layers, two, pages * ps, *x.shape[4:])[:, :, :self.num_tokens])

        return HostKV(cut(self.pages), cut(self.scales))


def first_logprobs(result, row: int) -> Optional[dict]:
    """The logprobs of row `row` of a step's `StepResult`, as a payload carries them (None without)."""
    if result.chosen_logprob is None:
        return None
    return {"chosen_logprob": float(result.chosen_logprob[row]), "rank": int(result.rank[row]),
            "top_ids": [int(x) for x in result.top_ids[row]],
            "top_logprobs": [float(x) for x in result.top_logprobs[row]], "kept": int(result.kept[row])}


class Exporter:
    """A request's `kv_export`: called by the engine when the request's first token is sampled, before a
    finish frees its pages; gathers the prompt's pages on the device and hands `callback` a `PrefillExport`."""

    def __init__(self, callback: Callable[[PrefillExport], Any]):
        self.callback = callback

    def check(self, engine, req) -> None:
        """Every engine exports KV (any cache form, layout or mesh), and any request may be exported: nothing
        to refuse. (The hooks' interface: `KVImport.check` does refuse an import that cannot resume its request.)"""

    def export(self, runner, req, table: list[int], first_token: int, result, row: int) -> None:
        """`table`: the pages of the prompt; `result`, `row`: the step's output and the first token's row."""
        pages, scales = gather(runner, table)
        images, delta = request_images(req)
        self.callback(PrefillExport(list(req.prompt_token_ids), int(first_token), req.seed, runner.page_size,
                                    pages, first_logprobs(result, row), req.cache_salt, scales, lora_identity(req),
                                    images, delta))


def request_images(req) -> tuple[tuple, int]:
    """((first placeholder position, `EncodedImage`) of each image of the request's prompt, the prompt's
    multimodal-RoPE delta); ((), 0) for a text prompt."""
    ri = req.prompt_content
    if ri is None:
        return (), 0
    return tuple((im.start, EncodedImage(im.digest, im.encoded)) for im in ri.images), int(ri.delta)


def _concat_embeds(images) -> np.ndarray:
    if not images:
        return np.zeros((0, 0), np.float32)
    return np.ascontiguousarray(np.concatenate([im.encoded.embeds for im in images]), np.float32)


def lora_identity(req) -> Optional[dict]:
    """The LoRA adapter a request runs with, as a payload names it: {"name", "digest" (hex of its
    weights' digest)}; None for the base model. K/V computed under one adapter resumes only a request of
    the same adapter with the same weights."""
    adapter = request_adapter(req)
    if adapter is None:
        return None
    return {"name": adapter.name, "digest": adapter.digest.hex()}


@dataclasses.dataclass
class KVImport:
    """A prompt's K/V and first token, to be resumed by `Engine` instead of computed (a request's
    `kv_import`: the engine reads `first_token`, `seed` and `step_result`, and calls `write`)."""

    prompt_token_ids: list[int]
    first_token: int
    seed: int
    kv: HostKV
    logprobs: Optional[dict] = None
    cache_salt: Optional[str] = None  # the salt the prefill side used; the resumed request keeps it
    lora: Optional[dict] = None  # the LoRA adapter the prefill side ran (`lora_identity`)
    images: tuple = ()  # the prompt's images as the prefill side placed them: (start, `EncodedImage`)
    mrope_delta: int = 0

    @property
    def encoded_images(self) -> list:
        """The shipped images, to stand in a prompt's "multi_modal_data" in place of pixels (the decode
        side never encodes them again)."""
        return [im for _, im in self.images]

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
            np.asarray(lp["top_logprobs"], np.float32)[None], np.asarray([lp["kept"]], np.int64)))

    def check(self, engine, req) -> None:
        """Raises InvalidParameterError unless this import can resume `req` (every engine imports KV)."""
        check_import(req, self)

    def write(self, runner, table: list[int], start: int, stop: int) -> None:
        """Writes tokens `start:stop` into the request's pages `table` (the engine admitted it)."""
        write(runner, token_slots(table, runner.page_size, start, stop), self.kv.tokens(start, stop))


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
    if lora_identity(req) != imp.lora:
        shipped = "the base model" if imp.lora is None else f"LoRA adapter {imp.lora['name']!r}"
        raise InvalidParameterError("model", f"model: the shipped KV was computed under {shipped}, not the "
                                             f"adapter of this request (or other weights under its name)")
    if p.n != 1 or p.prompt_logprobs is not None:
        raise InvalidParameterError("n", "n: a disaggregated request must have n=1 and no prompt logprobs")
    if imp.kv.num_tokens != len(req.prompt_token_ids):
        raise InvalidParameterError("prompt", "prompt: the shipped KV does not cover the prompt")
    images, delta = request_images(req)
    if [(s, im.digest) for s, im in images] != [(s, im.digest) for s, im in imp.images] or delta != imp.mrope_delta:
        raise InvalidParameterError("multi_modal_data", "multi_modal_data: the request's images are not the "
                                                        "shipped KV's (pass `KVImport.encoded_images`), or "
                                                        "their multimodal positions differ")
    try:
        imp.step_result(p.logprobs)
    except PayloadError as e:
        raise InvalidParameterError("logprobs", f"logprobs: {e}") from e


# The import an internal decode route hands to the OpenAI handler it calls (read by the HTTP layer).
current_import: contextvars.ContextVar[Optional[KVImport]] = contextvars.ContextVar("kv_import", default=None)


def part_args() -> dict:
    """The request arguments (`Engine.make_request(part_args=...)`) of the import in the current context (none
    outside a decode route)."""
    imp = current_import.get()
    return {} if imp is None else {"kv_import": imp}


# --- the payload ---------------------------------------------------------------------------------

def dtype_name(dtype) -> str:
    """The name a payload gives a KV dtype ("float32", "bfloat16", "int8", "float8_e4m3fn", ...)."""
    return np.dtype(jnp.dtype(dtype)).name


def geometry(cfg, dtype) -> dict:
    return {"num_layers": cfg.num_layers, "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "dtype": dtype_name(dtype)}


def array_specs(cfg, dtype, num_tokens: int) -> list[dict]:
    """The per-layer arrays of a payload from a cache of `dtype`, in body order: K and V pages, then for an
    int8 / fp8 cache their scales (one per token and KV head)."""
    pages = [num_tokens, cfg.num_kv_heads, cfg.head_dim]
    out = [{"name": n, "shape": pages, "dtype": dtype_name(dtype)} for n in KV_ARRAYS]
    if is_quantized_dtype(dtype):
        out += [{"name": n, "shape": pages[:2], "dtype": dtype_name(SCALE_DTYPE)} for n in SCALE_ARRAYS]
    return out


def payload_header(export: PrefillExport, cfg, dtype, extra: dict) -> dict:
    """The header of the payload that ships `export` (the array bytes follow it)."""
    images = [{"digest": im.digest.hex(), "start": start, "grid": [int(x) for x in im.encoded.grid],
               "num_tokens": im.encoded.num_tokens} for start, im in export.images]
    return {"version": VERSION, **extra, **geometry(cfg, dtype), "page_size": export.page_size,
            "num_tokens": export.num_tokens, "prompt_token_ids": export.prompt_token_ids,
            "first_token": export.first_token, "seed": export.seed, "logprobs": export.logprobs,
            "cache_salt": export.cache_salt, "lora": export.lora, "arrays": array_specs(cfg, dtype, export.num_tokens),
            "images": images, "mrope_delta": export.mrope_delta}


def payload_chunks(export: PrefillExport, host: HostKV):
    """The payload body's pieces in order: each layer's arrays, then the images' encoder outputs (if any)."""
    yield from host.layer_bytes()
    if export.images:
        yield export.image_embeds().tobytes()


def encode_payload(export: PrefillExport, cfg, dtype, keys: kv_wire.SigningKeys,
                   extra: Optional[dict] = None) -> bytes:
    """The whole signed payload in memory (the HTTP route streams the same bytes layer by layer)."""
    return kv_wire.sign_payload(keys, payload_header(export, cfg, dtype, extra or {}),
                                b"".join(payload_chunks(export, export.host_kv())))


def max_header_bytes(max_model_len: int) -> int:
    """The largest header a worker reads: the prompt's ids and the client's request echoed, generously."""
    return 2**20 + 256 * max_model_len


def max_payload_bytes(cfg, dtype, max_tokens: int) -> int:
    """The largest payload a worker holding at most `max_tokens` tokens per request accepts."""
    embeds = 4 * cfg.hidden_size if getattr(cfg, "vision", None) is not None else 0  # float32 image rows
    return (kv_wire.PREFIX_BYTES + max_header_bytes(max_tokens) + 2 * kv_wire.TAG_BYTES
            + (kv_bytes_per_token(cfg, dtype) + embeds) * max_tokens)


def body_bytes(header: dict, cfg, dtype, max_tokens: int) -> int:
    """The array bytes that must follow `header`; raises PayloadError unless this engine (config `cfg`,
    cache `dtype`, at most `max_tokens` tokens per request) can hold the payload's K/V."""
    if header.get("version") != VERSION:
        raise PayloadError(f"KV payload version {header.get('version')!r} is not {VERSION}")
    mine = geometry(cfg, dtype)
    if header.get("dtype") != mine["dtype"]:
        raise PayloadError(f"KV payload dtype {header.get('dtype')!r} does not match this worker's KV cache dtype "
                           f"{mine['dtype']!r}: prefill and decode workers must use the same kv_cache_dtype (pages "
                           f"are shipped as stored, int8 / fp8 ones with their scales, never converted)")
    for key, want in mine.items():
        if header.get(key) != want:
            raise PayloadError(f"KV payload {key}={header.get(key)!r} does not match this worker's {want!r} "
                               f"(prefill and decode workers must serve the same model and KV dtype)")
    n = header.get("num_tokens")
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= max_tokens:
        raise PayloadError(f"KV payload num_tokens={n!r} is not in [1, {max_tokens}] (this worker's context "
                           f"window and pool)", status=413 if isinstance(n, int) and n > max_tokens else 400)
    arrays, want = header.get("arrays"), array_specs(cfg, dtype, n)
    names = [a.get("name") for a in arrays if isinstance(a, dict)] if isinstance(arrays, list) else None
    if names != [a["name"] for a in want]:
        raise PayloadError(f"KV payload arrays {names} are not those of a {mine['dtype']} KV cache; this worker "
                           f"reads exactly {[a['name'] for a in want]}")
    for got, spec in zip(arrays, want):
        if got != spec:
            raise PayloadError(f"KV payload array {spec['name']} is {got}, expected {spec}")
    # what the cache holds per token, scales included, then the images' encoder outputs
    return n * kv_bytes_per_token(cfg, dtype) + 4 * cfg.hidden_size * image_tokens(header, cfg)


def image_tokens(header: dict, cfg) -> int:
    """How many encoder output rows the payload's `images` announce; raises PayloadError unless they are
    well formed, lie inside the prompt in order, and this worker's model takes images."""
    images = header.get("images", [])
    if images == []:
        return 0
    n = header.get("num_tokens")
    if not isinstance(images, list):
        raise PayloadError("KV payload images must be a list")
    if getattr(cfg, "vision", None) is None:
        raise PayloadError("the KV payload carries images, but this worker's model does not take images")
    merge = cfg.vision.spatial_merge_size
    total, end = 0, 0
    for i, im in enumerate(images):
        ok = isinstance(im, dict) and set(im) == {"digest", "start", "grid", "num_tokens"}
        grid = im.get("grid") if ok else None
        ok = ok and isinstance(im["digest"], str) and len(im["digest"]) == 32 and _is_hex(im["digest"])
        ok = ok and isinstance(grid, list) and len(grid) == 3 and all(_is_count(g) and g > 0 for g in grid)
        ok = ok and _is_count(im["start"]) and _is_count(im["num_tokens"]) and im["num_tokens"] > 0
        if not ok:
            raise PayloadError(f"KV payload images[{i}] must be {{digest: 32 hex digits, start, grid: [t, h, w], "
                               f"num_tokens}}")
        if im["num_tokens"] * merge * merge != grid[0] * grid[1] * grid[2]:
            raise PayloadError(f"KV payload images[{i}]: {im['num_tokens']} tokens do not match grid {grid}")
        if im["start"] < end or im["start"] + im["num_tokens"] > n:
            raise PayloadError(f"KV payload images[{i}] overlaps another image or lies past the prompt")
        end = im["start"] + im["num_tokens"]
        total += im["num_tokens"]
    return total


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _is_hex(s: str) -> bool:
    try:
        bytes.fromhex(s)
    except ValueError:
        return False
    return True


def decode_payload(data: bytes, keys: kv_wire.SigningKeys, cfg, dtype, max_tokens: int) -> tuple[dict, memoryview]:
    """(header, the array bytes) of a signed payload in memory; raises `kv_wire.WireError` (PayloadError
    for one this engine cannot hold)."""
    return kv_wire.read_payload_bytes(data, keys, max_header_bytes(max_tokens),
                                      lambda h: body_bytes(h, cfg, dtype, max_tokens))


def _host_arrays(body, cfg, dtype, n: int) -> HostKV:
    """The body's arrays as views: per layer, K and V pages, then (int8 / fp8) K and V scales."""
    dtype = np.dtype(jnp.dtype(dtype))
    pages = (2, n, cfg.num_kv_heads, cfg.head_dim)
    raw = np.frombuffer(body, np.uint8, count=n * kv_bytes_per_token(cfg, dtype)).reshape(cfg.num_layers, -1)
    split = int(np.prod(pages)) * dtype.itemsize
    kv = raw[:, :split].view(dtype).reshape((cfg.num_layers,) + pages)
    if not is_quantized_dtype(dtype):
        return HostKV(kv)
    return HostKV(kv, raw[:, split:].view(np.dtype(SCALE_DTYPE)).reshape((cfg.num_layers,) + pages[:3]))


def to_import(header: dict, body: memoryview, cfg, dtype) -> KVImport:
    """The checked `KVImport` of an authenticated payload (zero-copy views of `body`)."""
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
    lora = header.get("lora")
    if lora is not None and not (isinstance(lora, dict) and set(lora) == {"name", "digest"}
                                 and all(isinstance(v, str) and v for v in lora.values())):
        raise PayloadError("KV payload lora must be null or {\"name\": str, \"digest\": str}")
    images, delta = _shipped_images(header, body[want - 4 * cfg.hidden_size * image_tokens(header, cfg):], ids, cfg)
    return KVImport(list(ids), first, seed, _host_arrays(body, cfg, dtype, len(ids)), header.get("logprobs"), salt,
                    lora, images, delta)


def _shipped_images(header: dict, embeds, ids: list[int], cfg) -> tuple[tuple, int]:
    """((start, `EncodedImage`) of each shipped image, the multimodal-RoPE delta) of a checked payload;
    `embeds`: the body's encoder output bytes. Each image's placeholders must be image tokens of the prompt."""
    delta = header.get("mrope_delta", 0)
    if not isinstance(delta, int) or isinstance(delta, bool):
        raise PayloadError("KV payload mrope_delta must be an integer")
    images = header.get("images", [])
    if not images:
        return (), delta
    rows = np.frombuffer(embeds, np.float32).reshape(-1, cfg.hidden_size)
    out, row = [], 0
    for i, im in enumerate(images):
        start, count = im["start"], im["num_tokens"]
        if any(t != cfg.image_token_id for t in ids[start:start + count]):
            raise PayloadError(f"KV payload images[{i}] does not cover image placeholder tokens of the prompt")
        encoded = Encoded(rows[row:row + count], tuple(im["grid"]))
        out.append((start, EncodedImage(bytes.fromhex(im["digest"]), encoded)))
        row += count
    return tuple(out), delta
