"""Ragged paged attention as a Pallas kernel for NVIDIA GPUs.

One call serves a flattened batch in which every live sequence contributes
any number of new query tokens (a prefill chunk or a single decode token).
Semantics and argument conventions are exactly those of
`kernels_pallas.reference.ragged_paged_attention_reference`.

Lowering: Triton (`jax.experimental.pallas.triton.CompilerParams`), not Mosaic GPU
--------------------------------------------------------------------------------
Mosaic GPU is Pallas' default GPU backend and Triton is deprecated (JAX 0.11
warns when it lowers a Triton kernel), so Mosaic GPU is where this kernel must
end up. What a Mosaic GPU version meets under the pinned jax (0.10.2):

* The block-table gather itself is fine on Mosaic GPU: a `plgpu.kernel` that
  reads a page id from a GMEM block table with a dynamic index and TMA-copies
  `k_pages.at[page, :, head]` into shared memory lowers for `cuda` on CPU.
* fp32 inputs are not: Hopper's wgmma reads fp32 as tf32 (about 1e-3 relative
  error, far from the fp32 contract of ~1e-5) and Mosaic GPU only allows
  transposed operands for 16-bit types, which P @ V with row-major pages needs.
* It cannot be tested on CPU with any fidelity: the Mosaic GPU interpreter
  (`InterpretGPUParams`, in 0.10.2 and still in 0.11.1) has no `run_state`
  accumulators, no `layout_cast` and no transposed wgmma operands, which every
  flash-attention structure uses; the generic `interpret=True` path cannot run
  Mosaic GPU primitives at all. With no GPU in CI, an untestable kernel is a
  liability.
* Mosaic GPU in 0.10.2 targets Hopper and newer only.

The Triton lowering runs the same kernel body in interpret mode on CPU (so the
tests exercise the code that runs on the GPU), supports fp32 exactly
(`Precision.HIGHEST` maps to IEEE fp32 dot), bf16 through the tensor cores,
any GPU from Ampere on, and it still exists in 0.11.x. The kernel body uses
only backend-neutral Pallas (ref indexing, `jnp.dot`, `lax.fori_loop`) plus
the masked `load`/`store` of the Triton module.

Migration plan to Mosaic GPU (when the Triton backend is removed or the
interpreter grows the missing features): keep this wrapper (item metadata,
split-K combine, output layout) and replace the body with a `plgpu.kernel`
per (item, kv head, split): TMA-copy the `[page_size, head_dim]` slices named
by the block table into a multi-stage SMEM ring (one barrier per stage,
`num_arrivals` = pages per stage), wgmma Q[64, D] @ K^T and P @ V with the
online softmax in WGMMA-layout registers, and write the valid rows with a
power-of-two ladder of TMA stores (TMA boxes are static). bf16/fp16 only; fp32
stays on this path or on the XLA reference. Then point the "pallas" backend at
it and keep this kernel as "pallas_triton" while both exist.

Design
------
* Work items. Each sequence's query tokens are cut into blocks of
  `block_q = rows // group_pad` tokens; an item is one such block. The wrapper
  computes, with a few jnp ops, each item's sequence, first row, valid rows,
  the KV position of its first token and the end of the KV range it needs
  (causal, so a prefill block stops at its last token). The grid is
  (items, kv heads, kv splits); the item count has a static upper bound
  (`min(T, (T + S * (block_q - 1)) // block_q)`), and surplus items exit.
* GQA inside the kernel. Queries are laid out `[kv_heads, T * group_pad, D]`
  so one tile holds `block_q` tokens x all query heads of one KV head: each K/V
  token is read once per KV head for its whole group. Groups that are not a
  power of two (Triton needs power-of-two tiles) are padded with zero heads.
* Block tables and lengths are ordinary kernel inputs read inside the kernel
  (no scalar prefetch: that is a TPU feature). K/V rows are gathered per token
  (`page = block_table[pos // page_size]`), so any page size works and a KV
  block can span pages; positions past the KV range are masked loads.
* Online softmax in fp32, base 2 (the scale is folded with log2(e)). Rows and
  sequences that see no key produce exact zeros, never NaN: the running max
  of an empty row is treated as 0 and a zero denominator as 1.
* Split-K (flash decoding). With `num_kv_splits > 1` each item's KV range is
  cut into that many contiguous parts, each program writes a normalised
  partial output and its log-sum-exp, and a jnp epilogue merges them. The
  grid has only items x kv_heads programs: a decode batch of 8 sequences with
  8 KV heads launches 64 programs on a GPU with 132 SMs, each streaming its
  whole context, so most of the memory system idles; splitting fixes that at
  the cost of writing fp32 partials (tiny next to the KV they replace). The
  default (`_default_splits`) is computed from static shapes only: enough
  programs for about two per SM, never splitting below 512 KV tokens per part.
  That this pays off, and where the crossover lies, is for
  `benchmarks/kernel_bench.py` to measure: it times every small-batch case
  with and without splits and sweeps the split count at batch 64.

Quantized KV (int8 / fp8 pages with per-token fp32 scales `k_scale` /
`v_scale`, see `model.quant`): the kernel loads one byte per element plus one
scale per key, widens the block to the query's dtype (exact for both
formats) and folds the scales into the math instead of into the data:
`s = (q . k_int) * k_scale * sm_scale` per key column, and
`p . (v_int * v_scale) = (p * v_scale) . v_int`, so dequantization costs one
multiply per score, not per element. fp32 queries keep the exact fp32 dots.

Sliding window and soft-capping (as in the reference): with a `window` (an
int32 scalar, traced, so layers may differ) each item's KV loop starts at the
block holding its first token's earliest visible key, so blocks (and pages)
wholly before the window are never loaded, and the scores mask keys that
fall out of the window of a later row. `soft_cap` (static) applies
cap * tanh(s / cap) to the natural-unit scores before the base-2 softmax.

Bidirectional spans (`span_end`, as in the reference): each row's span end
travels beside the queries (repeated per padded group row); an item's KV
loop runs to the largest of its rows' ends (within the sequence's KV length)
and the scores mask `key < max(pos + 1, span_end)`. Without spans the kernel
is the causal one it was (a static flag).

Limits (clear errors): head_dim a power of two >= 16; each K/V page array
below 2**31 elements (Triton computes offsets in int32).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas.backend import pallas_supports_head_dim
from kernels_pallas.pow2 import next_pow2
from kernels_pallas.reference import check_kv_scales

NUM_SMS = 132  # H100/H200; only steers the split-K default.
MIN_TOKENS_PER_SPLIT = 512
MAX_SPLITS = 16
_LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """The static tiling of one call: rows per query tile, KV tokens per step, KV splits, grid items."""

    rows: int
    block_kv: int
    num_kv_splits: int
    num_items: int
    group_pad: int

    @property
    def block_q(self) -> int:
        return self.rows // self.group_pad


def kernel_config(num_tokens: int, max_seqs: int, pages_per_seq: int, page_size: int, num_q_heads: int,
                  num_kv_heads: int, dtype, *, rows: int | None = None, block_kv: int | None = None,
                  num_kv_splits: int | None = None) -> KernelConfig:
    """Fills in the tuning knobs left as None from the static shapes of a call."""
    group_pad = next_pow2(num_q_heads // num_kv_heads)
    if rows is None:
        # Decode-heavy buckets (no more tokens than sequences) get short tiles.
        rows = max(16 if num_tokens <= max_seqs else 64, group_pad)
    if rows < 16 or rows & (rows - 1) or rows % group_pad:
        raise ValueError(f"rows={rows} must be a power of two >= 16 and >= the padded group {group_pad}")
    if block_kv is None:
        block_kv = 32 if jnp.dtype(dtype) == jnp.float32 else 64
    if block_kv < 16 or block_kv & (block_kv - 1):
        raise ValueError(f"block_kv={block_kv} must be a power of two >= 16")
    block_q = rows // group_pad
    num_items = max(1, min(num_tokens, (num_tokens + max_seqs * (block_q - 1)) // block_q))
    if num_kv_splits is None:
        num_kv_splits = _default_splits(num_items * num_kv_heads, pages_per_seq * page_size)
    return KernelConfig(rows, block_kv, num_kv_splits, num_items, group_pad)


def _default_splits(programs: int, max_kv_len: int) -> int:
    if programs >= 2 * NUM_SMS:
        return 1
    want = -(-2 * NUM_SMS // programs)
    cap = max(1, max_kv_len // MIN_TOKENS_PER_SPLIT)
    return max(1, min(want, cap, MAX_SPLITS))


def _item_metadata(cu_q_lens, kv_lens, num_seqs, *, num_items, block_q, group_pad, max_kv_len, window=None,
                   span_end=None):
    """int32 [num_items, 7]: per query block its sequence, first row, valid rows, pos0, KV end
    (past its last row, or its rows' latest span end), KV start (the first key its first row's window
    sees; 0 without a window) and the window."""
    num_slots = kv_lens.shape[0]
    live_seq = jnp.arange(num_slots, dtype=jnp.int32) < num_seqs
    q_lens = jnp.where(live_seq, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    blocks = (q_lens + block_q - 1) // block_q
    cu_blocks = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(blocks, dtype=jnp.int32)])
    items = jnp.arange(num_items, dtype=jnp.int32)
    # compare_all: one small fusion; the default binary search is a loop of tiny kernels on GPU.
    seq = jnp.searchsorted(cu_blocks, items, side="right", method="compare_all").astype(jnp.int32) - 1
    seq = jnp.clip(seq, 0, num_slots - 1)
    live = items < cu_blocks[-1]
    j = items - cu_blocks[seq]
    tokens = jnp.where(live, jnp.clip(q_lens[seq] - j * block_q, 0, block_q), 0)
    first_token = cu_q_lens[seq] + j * block_q
    pos0 = kv_lens[seq] - q_lens[seq] + j * block_q
    last = pos0 + tokens
    if span_end is not None:  # the latest span end among the item's rows
        r = jnp.arange(block_q, dtype=jnp.int32)
        idx = jnp.clip(first_token[:, None] + r[None, :], 0, span_end.shape[0] - 1)
        ends = jnp.where(r[None, :] < tokens[:, None], span_end[idx], 0)
        last = jnp.maximum(last, jnp.max(ends, axis=1))
    kv_end = jnp.clip(jnp.minimum(kv_lens[seq], last), 0, max_kv_len)
    kv_end = jnp.where(live, kv_end, 0)
    if window is None:
        kv_start, win = jnp.zeros_like(pos0), jnp.zeros_like(pos0)
    else:
        win = jnp.broadcast_to(jnp.asarray(window, jnp.int32), pos0.shape)
        kv_start = jnp.where(live, jnp.clip(pos0 - win + 1, 0, max_kv_len), 0)
    meta = [seq, first_token * group_pad, tokens * group_pad, pos0, kv_end, kv_start, win]
    return jnp.stack([m.astype(jnp.int32) for m in meta], axis=1)


def _attention_kernel(meta_ref, bt_ref, q_ref, k_ref, v_ref, *refs, rows, group_pad, block_kv,
                      page_size, num_pages, pages_per_seq, num_splits, scale_log2, exact, quantized, windowed,
                      soft_cap, spans):
    if quantized:
        ks_ref, vs_ref, *refs = refs
    if spans:
        span_ref, *refs = refs
    o_ref, *lse_ref = refs
    item, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq = meta_ref[item, 0]
    row0 = meta_ref[item, 1]
    nrows = meta_ref[item, 2]
    pos0 = meta_ref[item, 3]
    kv_end = meta_ref[item, 4]
    kv_start = meta_ref[item, 5]
    window = meta_ref[item, 6]

    row = lax.broadcasted_iota(jnp.int32, (rows,), 0)
    row_ok = row < nrows
    q_pos = pos0 + row // group_pad
    head_dim = q_ref.shape[-1]
    q = pltriton.load(q_ref.at[head, pl.ds(row0, rows), :], mask=row_ok[:, None], other=0)
    q_end = q_pos + 1  # exclusive end of the keys each row sees
    if spans:
        q_end = jnp.maximum(q_end, pltriton.load(span_ref.at[pl.ds(row0, rows)], mask=row_ok, other=0))

    num_blocks = (kv_end + block_kv - 1) // block_kv
    first_block = kv_start // block_kv if windowed else 0
    per_split = (num_blocks - first_block + num_splits - 1) // num_splits
    lo = first_block + split * per_split
    hi = jnp.minimum(lo + per_split, num_blocks)
    precision = lax.Precision.HIGHEST if exact else None
    d = lax.broadcasted_iota(jnp.int32, (1, head_dim), 1)

    def kv_block(b, carry):
        m, l, acc = carry
        pos = b * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv,), 0)
        pos_ok = pos < kv_end
        page = bt_ref[seq, jnp.minimum(pos // page_size, pages_per_seq - 1)]
        page = jnp.clip(page, 0, num_pages - 1)[:, None]
        off = (pos % page_size)[:, None]
        # A float fill: Triton casts an integer 0 to fp8 pages' type only via float.
        fill = 0.0 if quantized and jnp.issubdtype(k_ref.dtype, jnp.floating) else 0
        k = pltriton.load(k_ref.at[page, off, head, d], mask=pos_ok[:, None], other=fill)
        v = pltriton.load(v_ref.at[page, off, head, d], mask=pos_ok[:, None], other=fill)
        if quantized:  # widen to the query dtype (exact); the scales multiply scores and probabilities
            k, v = k.astype(q.dtype), v.astype(q.dtype)
            k_sc = pltriton.load(ks_ref.at[page[:, 0], off[:, 0], head], mask=pos_ok, other=0)
            v_sc = pltriton.load(vs_ref.at[page[:, 0], off[:, 0], head], mask=pos_ok, other=0)
            s = jnp.dot(q, k.T, precision=precision, preferred_element_type=jnp.float32) * (
                k_sc * scale_log2)[None, :]
        else:
            s = jnp.dot(q, k.T, precision=precision, preferred_element_type=jnp.float32) * scale_log2
        if soft_cap is not None:  # in natural units: s / log2(e) is the score q.k * sm_scale
            s = (soft_cap * _LOG2E) * jnp.tanh(s * (1.0 / (soft_cap * _LOG2E)))
        visible = (pos[None, :] < q_end[:, None]) & pos_ok[None, :]
        if windowed:
            visible &= pos[None, :] > q_pos[:, None] - window
        s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - m_safe)
        p = jnp.exp2(s - m_safe[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        if quantized:
            p = p * v_sc[None, :]  # after the row sum: the denominator counts unscaled probabilities
        pv = jnp.dot(p.astype(v.dtype), v, precision=precision, preferred_element_type=jnp.float32)
        return m_new, l, acc * alpha[:, None] + pv

    init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))
    m, l, acc = lax.fori_loop(lo, hi, kv_block, init)
    out = acc / jnp.where(l > 0, l, 1.0)[:, None]
    pltriton.store(o_ref.at[split, head, pl.ds(row0, rows), :], out.astype(o_ref.dtype), mask=row_ok[:, None])
    if lse_ref:
        lse = jnp.where(l > 0, m + jnp.log2(jnp.where(l > 0, l, 1.0)), -jnp.inf)
        pltriton.store(lse_ref[0].at[split, head, pl.ds(row0, rows)], lse, mask=row_ok)


def _merge_splits(o_part, lse_part):
    """Combines normalised split outputs [K, ..., D] by their base-2 log-sum-exps [K, ...]."""
    m = jnp.max(lse_part, axis=0)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp2(lse_part - m)
    denom = jnp.sum(w, axis=0)
    out = jnp.sum(w[..., None] * o_part, axis=0)
    return out / jnp.where(denom > 0, denom, 1.0)[..., None]


def check_supported(q, k_pages, v_pages, block_tables):
    """Raises ValueError for inputs this kernel cannot serve."""
    if q.ndim != 3 or k_pages.ndim != 4 or v_pages.shape != k_pages.shape:
        raise ValueError(f"expected q [T,H,D] and k/v pages [N,page,Hkv,D]; got {q.shape}, "
                         f"{k_pages.shape}, {v_pages.shape}")
    num_q_heads, head_dim = q.shape[1:]
    num_kv_heads = k_pages.shape[2]
    if k_pages.shape[3] != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(f"q heads {num_q_heads} / head_dim {head_dim} do not fit kv pages {k_pages.shape}")
    if not pallas_supports_head_dim(head_dim):
        raise ValueError(f"head_dim must be a power of two >= 16 for the Pallas kernel, got {head_dim} "
                         "(attention_backend=auto uses the xla backend for such models)")
    if math.prod(k_pages.shape) >= 2**31:
        raise ValueError(f"K/V page array of {math.prod(k_pages.shape)} elements exceeds int32 offsets; "
                         "split the cache into smaller per-layer arrays or shard kv_heads")
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables must be [S, P], got {block_tables.shape}")


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "interpret", "rows", "block_kv",
                                             "num_kv_splits", "num_warps", "num_stages"))
def ragged_paged_attention(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, *,
                           sm_scale: float | None = None, k_scale=None, v_scale=None, window=None,
                           soft_cap: float | None = None, span_end=None, interpret: bool = False,
                           rows: int | None = None, block_kv: int | None = None, num_kv_splits: int | None = None,
                           num_warps: int = 4, num_stages: int = 2):
    """Pallas ragged paged attention; same contract as the reference.

    `k_scale` / `v_scale`: per-token scales of int8 / fp8 pages (None: float pages).
    `span_end` `[T]` int32: bidirectional spans (None: causal), as in the reference.
    Tuning knobs (static): `rows` per query tile (tokens x padded group, a
    power of two >= 16), `block_kv` KV tokens per loop step, `num_kv_splits`
    (None: from shapes), Triton `num_warps` / `num_stages`.
    """
    check_supported(q, k_pages, v_pages, block_tables)
    quantized = check_kv_scales(k_pages, v_pages, k_scale, v_scale, "attention")
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    max_seqs, pages_per_seq = block_tables.shape
    group = num_q_heads // num_kv_heads
    # The dtype the dots run in: the pages', or for quantized pages the queries'.
    compute_dtype = q.dtype if quantized else k_pages.dtype
    exact = jnp.dtype(compute_dtype) == jnp.float32
    cfg = kernel_config(num_tokens, max_seqs, pages_per_seq, page_size, num_q_heads, num_kv_heads, compute_dtype,
                        rows=rows, block_kv=block_kv, num_kv_splits=num_kv_splits)
    group_pad, splits, max_kv_len = cfg.group_pad, cfg.num_kv_splits, pages_per_seq * page_size
    if sm_scale is None:
        sm_scale = head_dim**-0.5

    cu_q_lens = cu_q_lens.astype(jnp.int32)
    kv_lens = kv_lens.astype(jnp.int32)
    meta = _item_metadata(cu_q_lens, kv_lens, jnp.asarray(num_seqs, jnp.int32), num_items=cfg.num_items,
                          block_q=cfg.block_q, group_pad=group_pad, max_kv_len=max_kv_len, window=window,
                          span_end=None if span_end is None else span_end.astype(jnp.int32))
    # [T, Hq, D] -> [Hkv, T * group_pad, D]: one tile row per (token, query head of the group).
    qg = q.astype(compute_dtype).reshape(num_tokens, num_kv_heads, group, head_dim)
    if group_pad != group:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, group_pad - group), (0, 0)))
    qg = qg.transpose(1, 0, 2, 3).reshape(num_kv_heads, num_tokens * group_pad, head_dim)

    part_rows = (splits, num_kv_heads, num_tokens * group_pad)
    out_dtype = q.dtype if splits == 1 else jnp.float32
    out_shape = [jax.ShapeDtypeStruct(part_rows + (head_dim,), out_dtype)]
    if splits > 1:
        out_shape.append(jax.ShapeDtypeStruct(part_rows, jnp.float32))
    kernel = functools.partial(
        _attention_kernel, rows=cfg.rows, group_pad=group_pad, block_kv=cfg.block_kv, page_size=page_size,
        num_pages=num_pages, pages_per_seq=pages_per_seq, num_splits=splits,
        scale_log2=float(sm_scale) * _LOG2E, exact=bool(exact), quantized=quantized, windowed=window is not None,
        soft_cap=None if soft_cap is None else float(soft_cap), spans=span_end is not None)
    scales = (k_scale.astype(jnp.float32), v_scale.astype(jnp.float32)) if quantized else ()
    # One span end per tile row (token x padded group), as the queries are laid out.
    span_rows = () if span_end is None else (jnp.repeat(span_end.astype(jnp.int32), group_pad),)
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(cfg.num_items, num_kv_heads, splits),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(meta, block_tables.astype(jnp.int32), qg, k_pages, v_pages, *scales, *span_rows)

    out = outs[0][0] if splits == 1 else _merge_splits(outs[0], outs[1])
    out = out.reshape(num_kv_heads, num_tokens, group_pad, head_dim)[:, :, :group]
    out = out.transpose(1, 0, 2, 3).reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
    # Rows of no live sequence were never written: the contract says zeros. Live
    # sequences own a prefix of the rows (cu_q_lens is non-decreasing).
    live = jnp.arange(num_tokens, dtype=jnp.int32) < cu_q_lens[jnp.asarray(num_seqs, jnp.int32)]
    return jnp.where(live[:, None, None], out, jnp.zeros((), q.dtype))
