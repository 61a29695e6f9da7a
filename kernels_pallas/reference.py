"""Plain-`jnp` references for the paged-attention and KV-cache-write kernels.

These define the semantics the Pallas kernels must match, and they are the
attention path the CPU backend serves with (XLA compiles them well enough
there; Pallas interpret mode is for tests only).

Ragged batch convention, shared by every backend:
  q            [T, q_heads, head_dim]     all sequences' new tokens, concatenated
  k/v_pages    [num_pages, page_size, kv_heads, head_dim]
  kv_lens      [S]   tokens in the cache for each sequence, new ones included
  block_tables [S, P] page ids of each sequence, in order
  cu_q_lens    [S+1] sequence i owns q rows cu_q_lens[i]:cu_q_lens[i+1]
  num_seqs     []    sequences >= num_seqs are padding
The j-th new token of sequence i sits at KV position
`kv_lens[i] - q_len[i] + j` and attends causally to positions 0..itself.
Rows that belong to no live sequence come out as zeros.

Quantized KV (optional, `model.quant`): int8 / fp8 pages come with fp32
scales `k/v_scale [num_pages, page_size, kv_heads]`, one per token and KV
head; the stored value is `page * scale`. `write_kv_*` then takes the scale
arrays too and returns them updated, and attention dequantizes what it reads.
With scales None (the default) nothing changes.

Sliding window and soft-capping (optional, for the families that use them):
`window` (an int32 scalar, traced: it may differ per layer) limits a query at
position p to keys p - window < j <= p; None means no limit. `soft_cap` (a
static float) maps every score s = q.k * sm_scale to soft_cap * tanh(s / soft_cap)
before the softmax (Gemma 2). Both default to None, the plain causal contract.

Bidirectional spans (optional, Gemma 3's images): `span_end` `[T]` int32 gives
each query row the exclusive end of the span it belongs to; the row also sees
the keys after itself up to that end (an image's tokens attend to each other
both ways). A row in no span holds 0 (anything <= its own position does), so
the mask is `key <= pos OR key < span_end`, still within the window and the
sequence's KV length. The caller guarantees the whole span is in the cache by
the end of the step (the scheduler never cuts one). None: causal everywhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.kv_quant import is_quantized_dtype, quantize_kv

TOKEN_CHUNK = 16


def check_kv_scales(k_pages, v_pages, k_scale, v_scale, where: str) -> bool:
    """Whether the cache is quantized; a clear error when pages and scales disagree."""
    quantized = is_quantized_dtype(k_pages.dtype)
    if (k_scale is None) != (v_scale is None):
        raise ValueError(f"{where}: pass both k_scale and v_scale or neither")
    if quantized and k_scale is None:
        raise ValueError(f"{where}: {k_pages.dtype} KV pages need their scales (k_scale / v_scale); "
                         "reading them as values would be garbage")
    if k_scale is not None:
        if not quantized:
            raise ValueError(f"{where}: KV scales were given for {k_pages.dtype} pages; only int8 / fp8 pages "
                             "carry scales")
        want = tuple(k_pages.shape[:3])
        if tuple(k_scale.shape) != want or tuple(v_scale.shape) != want:
            raise ValueError(f"{where}: KV scales must be {list(want)} (pages, page_size, kv_heads); got "
                             f"{list(k_scale.shape)} and {list(v_scale.shape)}")
    return k_scale is not None


def apply_soft_cap(s, soft_cap: float | None):
    """Scores s -> soft_cap * tanh(s / soft_cap); unchanged for None."""
    return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)


def in_window(key_pos, query_pos, window):
    """Whether a key is inside the query's sliding window (all True for window None)."""
    if window is None:
        return jnp.ones(jnp.broadcast_shapes(jnp.shape(key_pos), jnp.shape(query_pos)), bool)
    return key_pos > query_pos - window


def query_end(query_pos, span_end):
    """The exclusive end of the keys a query row may see: itself, or its span's end if later."""
    return query_pos + 1 if span_end is None else jnp.maximum(query_pos + 1, span_end)


def token_sequence_ids(cu_q_lens: jax.Array, num_seqs: jax.Array, num_tokens: int):
    """For every row: its sequence, its KV position offset data, and whether it is live."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    num_slots = cu_q_lens.shape[0] - 1
    seq = jnp.searchsorted(cu_q_lens, t, side="right").astype(jnp.int32) - 1
    seq = jnp.clip(seq, 0, num_slots - 1)
    live = (t < cu_q_lens[num_seqs]) & (seq < num_seqs)
    return seq, live


def ragged_paged_attention_reference(
    q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, *, sm_scale: float | None = None,
    k_scale=None, v_scale=None, window=None, soft_cap: float | None = None, span_end=None,
):
    T, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    pages_per_seq = block_tables.shape[1]
    group = num_q_heads // num_kv_heads
    max_len = pages_per_seq * page_size
    if sm_scale is None:
        sm_scale = head_dim**-0.5
    quantized = check_kv_scales(k_pages, v_pages, k_scale, v_scale, "attention")

    seq, live = token_sequence_ids(cu_q_lens, num_seqs, T)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    q_pos = kv_lens[seq] - q_len + (jnp.arange(T, dtype=jnp.int32) - cu_q_lens[seq])
    q_end = query_end(q_pos, span_end)

    chunk = min(TOKEN_CHUNK, T)
    pad = (-T) % chunk
    padded = lambda x: jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    qs = padded(q).reshape(-1, chunk, num_kv_heads, group, head_dim)
    seqs = padded(seq).reshape(-1, chunk)
    poss = padded(q_pos).reshape(-1, chunk)
    ends = padded(q_end).reshape(-1, chunk)
    lives = padded(live).reshape(-1, chunk)

    def one_chunk(args):
        qc, sc, pc, ec, lc = args
        pages = block_tables[sc]  # [C, P]
        k = k_pages[pages].reshape(chunk, max_len, num_kv_heads, head_dim)
        v = v_pages[pages].reshape(chunk, max_len, num_kv_heads, head_dim)
        if quantized:
            k = k.astype(jnp.float32) * k_scale[pages].reshape(chunk, max_len, num_kv_heads, 1)
            v = v.astype(jnp.float32) * v_scale[pages].reshape(chunk, max_len, num_kv_heads, 1)
        s = jnp.einsum("ckgd,clkd->ckgl", qc.astype(jnp.float32), k.astype(jnp.float32)) * sm_scale
        s = apply_soft_cap(s, soft_cap)
        j = jnp.arange(max_len, dtype=jnp.int32)
        visible = (j[None, :] < ec[:, None]) & (j[None, :] < kv_lens[sc][:, None]) & lc[:, None]
        visible &= in_window(j[None, :], pc[:, None], window)
        s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.exp(s - m)
        denom = jnp.sum(p, axis=-1, keepdims=True)
        o = jnp.einsum("ckgl,clkd->ckgd", p, v.astype(jnp.float32))
        o = o / jnp.where(denom > 0, denom, 1.0)
        return o.reshape(chunk, num_q_heads, head_dim).astype(q.dtype)

    out = jax.lax.map(one_chunk, (qs, seqs, poss, ends, lives))
    return out.reshape(-1, num_q_heads, head_dim)[:T]


def write_kv_reference(k_pages, v_pages, k_new, v_new, slot_mapping, k_scale=None, v_scale=None):
    """Scatters new tokens' K/V into their cache slots; out-of-range slots are dropped.

    Returns (k_pages, v_pages), or with scales (quantized pages) (k_pages, v_pages,
    k_scale, v_scale): each token's row is quantized with its own scale.
    """
    page_size = k_pages.shape[1]
    quantized = check_kv_scales(k_pages, v_pages, k_scale, v_scale, "write_kv")
    # Index (page, offset) rather than a flattened [slots, ...] view: XLA CPU
    # copies the whole donated cache around a scatter into a reshaped view
    # (every step, every layer), but updates the 4-D array in place.
    page, offset = slot_mapping // page_size, slot_mapping % page_size

    def write(pages, new):
        return pages.at[page, offset].set(new.astype(pages.dtype), mode="drop")

    if not quantized:
        return write(k_pages, k_new), write(v_pages, v_new)
    kq, ks = quantize_kv(k_new, k_pages.dtype)
    vq, vs = quantize_kv(v_new, v_pages.dtype)
    return write(k_pages, kq), write(v_pages, vq), write(k_scale, ks), write(v_scale, vs)
