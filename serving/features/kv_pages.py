"""The device programs that move KV pages between the pool and host memory, and the host form of K/V.

Two programs, each run over the cache by `ModelRunner.run_on_cache` (which places
the host inputs, donates and keeps the cache's shardings, so they work under
tensor and pipeline parallelism too):

* `gather` reads whole pages, K before V, with the scales of an int8 / fp8 cache
  (`[layers, 2, P, page_size, kv_heads, head_dim]` and `[layers, 2, P, page_size,
  kv_heads]`), the page count padded to a power of two so few shapes compile;
* `write` scatters per-token K/V (a `HostKV`, scales included) into the donated
  cache at token slots, the token count padded to a power of two, padding slots
  dropped.

Shipped prefills (`serving.disaggregation.kv_transfer`) and the host tier of the
prefix cache (`serving.features.host_kv_tier`) both move pages with them. A quantized
page travels as it is stored (values and per-token scales): nothing is
dequantized or quantized again.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.pow2 import next_pow2, powers_of_two
from model.cache import KVCache, StackedKVCache
from model.quant import SCALE_DTYPE, QuantizedArray, is_quantized_dtype


def _parts(x):
    """(pages, scales or None) of one cache leaf: a page array, or a `QuantizedArray` of pages and scales."""
    return (x.data, x.scale) if isinstance(x, QuantizedArray) else (x, None)


def _gather_pages(cache, pages, *, stages: int = 1):
    """(`[layers, 2, P, page_size, kv_heads, head_dim]` pages, `[layers, 2, P, page_size, kv_heads]` scales or
    None) of the page ids `pages`, K before V, global layers in order.

    `stages` > 1: a pipeline's staged cache (`sharding.pipeline`), which holds per stage-local layer j one
    `[stages * num_pages, ...]` array whose block s is stage s's pages of global layer `s * L/stages + j`;
    each stage reads its own block, and the layers come out in the unstaged order."""
    if stages > 1:
        return _gather_staged(cache, pages, stages)
    if isinstance(cache, StackedKVCache):  # layer l's page p is row l * num_pages + p
        layers = cache.num_layers

        def take(x):  # [layers * num_pages, ...] -> [layers, P, ...]
            return x.reshape((layers, x.shape[0] // layers) + x.shape[1:])[:, pages]

        (kd, ks), (vd, vs) = _parts(cache.k), _parts(cache.v)
        scales = None if ks is None else jnp.stack([take(ks), take(vs)], axis=1)
        return jnp.stack([take(kd), take(vd)], axis=1), scales
    k, v = [_parts(x) for x in cache.k], [_parts(x) for x in cache.v]
    data = jnp.stack([jnp.stack([a[0][pages], b[0][pages]]) for a, b in zip(k, v)])
    if k[0][1] is None:
        return data, None
    return data, jnp.stack([jnp.stack([a[1][pages], b[1][pages]]) for a, b in zip(k, v)])


def _write_tokens(cache, slots, kv, scales, *, cache_shardings=None, stages: int = 1):
    """(the cache with `kv` ([layers, 2, n, kv_heads, head_dim]) and, for a quantized cache, `scales`
    ([layers, 2, n, kv_heads]) written at token `slots`, None). `cache_shardings` (every leaf's, in
    `jax.tree.leaves` order) keeps a sharded cache where it was placed, so the next step's inputs match
    its executable. `stages` > 1: a pipeline's staged cache (`_gather_pages`), each stage writing its own
    layers into its own block of the page axis."""
    if stages > 1:
        new = _write_staged(cache, slots, kv, scales, stages)
    elif isinstance(cache, StackedKVCache):  # layer l's page p is row l * num_pages + p: one scatter per array
        layers, pages, page_size = cache.num_layers, cache.num_pages, cache.page_size
        page, offset = slots // page_size, slots % page_size
        rows = jnp.where(page[None, :] >= pages, layers * pages,
                         page[None, :] + (jnp.arange(layers) * pages)[:, None])  # [layers, n]; padding dropped

        def put(x, new):  # x [layers * pages, page_size, ...], new [layers, n, ...]
            return x.at[rows, offset[None, :]].set(new.astype(x.dtype), mode="drop")

        def leaf(x, j):
            d, s = _parts(x)
            return put(d, kv[:, j]) if s is None else QuantizedArray(put(d, kv[:, j]), put(s, scales[:, j]))

        new = StackedKVCache(k=leaf(cache.k, 0), v=leaf(cache.v, 1), num_layers=layers)
    else:
        def put(x, new):  # x [num_pages, page_size, ...], new [n, ...]
            flat = x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])
            return flat.at[slots].set(new.astype(x.dtype), mode="drop").reshape(x.shape)

        def leaf(x, i, j):
            d, s = _parts(x)
            return put(d, kv[i, j]) if s is None else QuantizedArray(put(d, kv[i, j]), put(s, scales[i, j]))

        new = KVCache(k=[leaf(x, i, 0) for i, x in enumerate(cache.k)],
                      v=[leaf(x, i, 1) for i, x in enumerate(cache.v)])
    if cache_shardings is not None:
        leaves, treedef = jax.tree.flatten(new)
        new = jax.tree.unflatten(treedef, [jax.lax.with_sharding_constraint(x, s)
                                           for x, s in zip(leaves, cache_shardings)])
    return new, None


def _gather_staged(cache, pages, stages: int):
    """`_gather_pages` of a staged cache: stage-local layer j's block s is global layer `s * L/stages + j`."""
    def take(x):  # [stages * num_pages, ...] -> [stages, P, ...]: each stage's pages from its own block
        return x.reshape((stages, x.shape[0] // stages) + x.shape[1:])[:, pages]

    def in_layer_order(per_local):  # [L/stages, 2, stages, P, ...] -> [L, 2, P, ...]
        x = jnp.moveaxis(per_local, 2, 0)
        return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])

    k, v = [_parts(x) for x in cache.k], [_parts(x) for x in cache.v]
    data = in_layer_order(jnp.stack([jnp.stack([take(a[0]), take(b[0])]) for a, b in zip(k, v)]))
    if k[0][1] is None:
        return data, None
    return data, in_layer_order(jnp.stack([jnp.stack([take(a[1]), take(b[1])]) for a, b in zip(k, v)]))


def _write_staged(cache, slots, kv, scales, stages: int) -> KVCache:
    """`_write_tokens` into a staged cache: global layer `s * L/stages + j` goes to block s of stage-local
    layer j's page axis. A slot past the stage's pages (the padding) is dropped."""
    def put(x, new):  # x [stages * num_pages, page_size, ...], new [stages, n, ...]
        flat = x.reshape((stages, x.shape[0] * x.shape[1] // stages) + x.shape[2:])
        return flat.at[:, slots].set(new.astype(x.dtype), mode="drop").reshape(x.shape)

    def local(a, j, kv_index):  # [L, 2, n, ...] -> [stages, n, ...]: stage-local layer j's K or V, per stage
        return a.reshape((stages, a.shape[0] // stages) + a.shape[1:])[:, j, kv_index]

    def leaf(x, j, kv_index):
        d, s = _parts(x)
        data = put(d, local(kv, j, kv_index))
        return data if s is None else QuantizedArray(data, put(s, local(scales, j, kv_index)))

    return KVCache(k=[leaf(x, j, 0) for j, x in enumerate(cache.k)],
                   v=[leaf(x, j, 1) for j, x in enumerate(cache.v)])


gather_jit = jax.jit(_gather_pages, static_argnames=("stages",))
write_jit = jax.jit(_write_tokens, static_argnames=("cache_shardings", "stages"), donate_argnums=(0,))


def cache_stages(runner) -> int:
    """How many pipeline stages split the runner's KV cache (its layout's `pipeline_parallel_size`; 1 without)."""
    return getattr(getattr(runner, "layout", None), "pipeline_parallel_size", 1)


def gather(runner, table: list[int]):
    """The pages of `table` on the device (not waited for): (pages `[layers, 2, P, page_size, kv_heads,
    head_dim]`, scales `[layers, 2, P, page_size, kv_heads]` or None), P >= len(table)."""
    return runner.run_on_cache(gather_jit, padded_pages(table), donate=False, stages=cache_stages(runner))


def write(runner, slots: np.ndarray, kv: "HostKV") -> None:
    """Writes host K/V (and scales) at token `slots` of the runner's (donated) cache."""
    pad = runner.num_pages * runner.page_size
    padded_slots, padded = padded_tokens(slots, kv, pad)
    runner.run_on_cache(write_jit, padded_slots, padded.kv, padded.scale, donate=True, stages=cache_stages(runner))


def padded_pages(table: list[int]) -> np.ndarray:
    """The page ids to gather: `table`, padded with page 0 to a power of two (few shapes compile)."""
    pages = np.zeros(next_pow2(len(table)), np.int32)
    pages[:len(table)] = table
    return pages


def padded_tokens(slots: np.ndarray, kv: "HostKV", pad_slot: int) -> tuple[np.ndarray, "HostKV"]:
    """`slots` and `kv` padded to a power-of-two token count (at least 16); padding slots are `pad_slot`,
    one past the pool, which the scatter drops."""
    n = len(slots)
    size = next_pow2(n, 16)
    padded_slots = np.full(size, pad_slot, np.int32)
    padded_slots[:n] = slots

    def pad(x):
        if x is None:
            return None
        out = np.zeros(x.shape[:2] + (size,) + x.shape[3:], x.dtype)
        out[:, :, :n] = x
        return out

    return padded_slots, HostKV(pad(kv.kv), pad(kv.scale))


def transfer_sizes(max_model_len: int, page_size: int) -> tuple[list[int], list[int]]:
    """(page counts a gather compiles for, token counts a scatter compiles for) up to `max_model_len`:
    the sizes `padded_pages` and `padded_tokens` pad to."""
    max_pages = -(-max_model_len // page_size)
    return powers_of_two(next_pow2(max_pages)), powers_of_two(next_pow2(max_model_len, 16), 16)


def compilation_count() -> int:
    """Executables compiled so far for the page gather and the token scatter."""
    return gather_jit._cache_size() + write_jit._cache_size()


def token_slots(table: list[int], page_size: int, start: int, stop: int) -> np.ndarray:
    pos = np.arange(start, stop)
    return np.asarray(table, np.int64)[pos // page_size] * page_size + pos % page_size



@dataclasses.dataclass
class HostKV:
    """A prompt's K/V on the host, per token: `kv` `[layers, 2, tokens, kv_heads, head_dim]` in the cache's
    dtype and, for an int8 / fp8 cache, `scale` `[layers, 2, tokens, kv_heads]` (fp32; a value stands for
    `kv * scale[..., None]`), else None."""

    kv: np.ndarray
    scale: Optional[np.ndarray] = None

    @classmethod
    def zeros(cls, cfg, dtype, n: int) -> "HostKV":
        shape = (cfg.num_layers, 2, n, cfg.num_kv_heads)
        scale = np.zeros(shape, SCALE_DTYPE) if is_quantized_dtype(dtype) else None
        return cls(np.zeros(shape + (cfg.head_dim,), np.dtype(dtype)), scale)

    @property
    def num_tokens(self) -> int:
        return self.kv.shape[2]

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + (0 if self.scale is None else self.scale.nbytes)

    def tokens(self, start: int, stop: int) -> "HostKV":
        """Tokens `start:stop` (views)."""
        return HostKV(self.kv[:, :, start:stop], None if self.scale is None else self.scale[:, :, start:stop])

    def layer_bytes(self) -> Iterator[bytes]:
        """Each layer's bytes as the payload body holds them: its arrays in `array_specs` order."""
        for i in range(self.kv.shape[0]):
            yield self.kv[i].tobytes() + (b"" if self.scale is None else self.scale[i].tobytes())
