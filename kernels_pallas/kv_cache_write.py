"""The KV-cache write as a Pallas kernel: scatter new tokens' K/V into their slots, in place.

Contract: `kernels_pallas.reference.write_kv_reference`. A token's slot is
`page * page_size + offset`; slots outside `[0, num_pages * page_size)` (the
padding slot `num_pages * page_size` in particular) are dropped.

The page arrays are aliased to the outputs (`input_output_aliases`), so under
a jit that donates the cache the write happens in the cache's own buffer and
costs only the bytes of the new tokens; without donation XLA copies first and
the result is still correct.

Grid: (token blocks, kv heads). Each program gathers `block_t` tokens' rows
of one head (`head_dim` contiguous values each) and stores them with a mask,
so a token block can touch any pages. Same lowering as the attention kernel
(Triton; see `ragged_paged_attention` for why). Masked-off lanes are pointed at
page `num_pages` (out of range): the GPU never touches them, and interpret
mode's scatter drops them instead of racing with a real write.

Quantized pages (int8 / fp8, with `k_scale` / `v_scale`): each program
quantizes its rows in registers with `kernels_pallas.kv_quant.quantize_kv`
(one scale per token and head, the function the reference uses) and stores
the bytes and the scales; the scale arrays are aliased too.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas.kv_quant import quantize_kv
from kernels_pallas.pow2 import next_pow2
from kernels_pallas.reference import check_kv_scales


def _write_kernel(slot_ref, k_new_ref, v_new_ref, *refs, block_t, num_tokens, page_size, num_pages, quantized):
    # Inputs after the new rows: the aliased caches (and scales), then the outputs in the same order.
    n = 4 if quantized else 2
    k_ref, v_ref, *scale_refs = refs[n:]
    tb, head = pl.program_id(0), pl.program_id(1)
    t = tb * block_t + lax.broadcasted_iota(jnp.int32, (block_t,), 0)
    t_ok = t < num_tokens
    t = jnp.where(t_ok, t, 0)
    slot = pltriton.load(slot_ref.at[t], mask=t_ok, other=-1)
    ok = t_ok & (slot >= 0) & (slot < num_pages * page_size)
    page = jnp.where(ok, slot // page_size, num_pages)[:, None]
    off = jnp.where(ok, slot % page_size, 0)[:, None]
    d = lax.broadcasted_iota(jnp.int32, (1, k_ref.shape[-1]), 1)
    mask = ok[:, None]
    for i, (new_ref, cache_ref) in enumerate(((k_new_ref, k_ref), (v_new_ref, v_ref))):
        rows = pltriton.load(new_ref.at[t[:, None], head, d], mask=mask, other=0)
        if not quantized:
            pltriton.store(cache_ref.at[page, off, head, d], rows.astype(cache_ref.dtype), mask=mask)
            continue
        data, scale = quantize_kv(rows, cache_ref.dtype)
        pltriton.store(cache_ref.at[page, off, head, d], data, mask=mask)
        pltriton.store(scale_refs[i].at[page[:, 0], off[:, 0], head], scale, mask=ok)


def check_supported(k_pages, v_pages, k_new, v_new, slot_mapping):
    if k_pages.ndim != 4 or v_pages.shape != k_pages.shape:
        raise ValueError(f"k/v pages must both be [N, page, Hkv, D]; got {k_pages.shape}, {v_pages.shape}")
    _, _, num_kv_heads, head_dim = k_pages.shape
    want = (slot_mapping.shape[0], num_kv_heads, head_dim)
    if k_new.shape != want or v_new.shape != want:
        raise ValueError(f"k/v new must be {want}; got {k_new.shape}, {v_new.shape}")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16 for the Pallas kernel, got {head_dim}")


@functools.partial(jax.jit, static_argnames=("interpret", "block_t"))
def write_kv(k_pages, v_pages, k_new, v_new, slot_mapping, k_scale=None, v_scale=None, *, interpret: bool = False,
             block_t: int | None = None):
    """Pallas KV-cache write; same contract as `write_kv_reference`. Returns (k_pages, v_pages),
    or (k_pages, v_pages, k_scale, v_scale) for a quantized cache."""
    check_supported(k_pages, v_pages, k_new, v_new, slot_mapping)
    quantized = check_kv_scales(k_pages, v_pages, k_scale, v_scale, "write_kv")
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    num_tokens = slot_mapping.shape[0]
    block_t = block_t or min(next_pow2(num_tokens), 32)
    kernel = functools.partial(_write_kernel, block_t=block_t, num_tokens=num_tokens, page_size=page_size,
                               num_pages=num_pages, quantized=quantized)
    caches = (k_pages, v_pages) + ((k_scale, v_scale) if quantized else ())
    return pl.pallas_call(
        kernel,
        out_shape=tuple(jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches),
        grid=(pl.cdiv(num_tokens, block_t), num_kv_heads),
        input_output_aliases={3 + i: i for i in range(len(caches))},
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="kv_cache_write",
    )(slot_mapping.astype(jnp.int32), k_new, v_new, *caches)
