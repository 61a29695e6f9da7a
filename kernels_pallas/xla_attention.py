"""Paged attention in plain XLA, organised for the CPU: the "xla" backend.

Same contract as `kernels_pallas.reference` (which stays the oracle), but the
work is cut differently. The reference gathers the whole context of every
query row, so a prefill chunk of n tokens over a context of L costs n x L
gathered K/V rows. Here the unit of work is an *item*: up to `B` consecutive
query rows of one sequence. An item gathers its sequence's pages once and
attends all its rows against them with one matrix product, so the same chunk
costs ceil(n / B) x L gathered rows and the products have B x group rows
instead of group rows.

Items are built on device from `cu_q_lens` (sequence i contributes
ceil(q_len_i / B) of them), so the host contract is unchanged. Their count is
bounded statically by min(T, ceil(T / B) + S). They run in chunks sized to
keep their whole page tables' K/V near `CHUNK_BYTES`; a chunk with no live
item is skipped by `lax.cond`, so padding costs (almost) nothing. Within a
chunk the tables are read `ITEM_BLOCK_PAGES` pages at a time, merged
flash-style, and the blocks past the chunk's last visible key are skipped:
a prompt's early rows see a small part of the bucket's P pages (a 256-token
prompt in a 512-token bucket: a quarter of them on average). Blocks of 4-8
pages measured best; 8 costs fewer steps over long contexts.

`B` is chosen from the static step shape: ~T / S rows, a power of two in
[1, MAX_ROWS_PER_ITEM]. A prefill-heavy bucket gets up to 16 rows per item.

A decode-only bucket (T < 2 S) gets B = 1, and there the unit of work is
smaller still: one (row, block) *pair* for every `PAIR_PAGES` pages the row
can see (`_attend_by_pairs`). A row at position `pos` has
`pos // page_size + 1` visible pages, so the work follows the live context
rather than the bucket's P pages per row (a decode batch whose contexts span
30-500 tokens in a 512-token bucket reads about half of what P x S pages
would be). Pairs are processed in chunks of ~`PAGE_CHUNK_BYTES`, chunks past
the live pairs skipped; each pair's partial softmax (max, sum, weighted V) is
merged into its row's running result, flash-decoding style with the split at
block boundaries. (The same pairs with B > 1 rows were measured too: no
faster than items for prefill.)

Two cases go around the pairs. When all one-row items' page tables fit in
one chunk (batch-1 decode, small decode batches) each item gathers its pages
as one block and the partial softmaxes merge elementwise, without the pairs'
scatter-merges (`_attend_by_row_blocks`). And in a step with B > 1, the
sequences of one query row (the decodes of a mixed step) get no B-row item,
which would gather a whole page table for one live row: they are one-row
items of their own, through the same one-row path.

Measured on the 2-core CPU against the reference, one layer of the 125M shape
(4 KV heads x 3, head_dim 64, fp32): a 512-token prefill over 1,000 cached
tokens 5x faster, two 256-token prompts ~4x, 31 decodes plus a 225-token
prefill chunk ~2x; decode batches 1.2x at full contexts and ~2x when the
contexts spread over the bucket (docs/performance.md has the table).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.reference import apply_soft_cap, check_kv_scales, in_window, query_end

MAX_ROWS_PER_ITEM = 16
# Gathered K (and again V) per chunk of items: small enough to stay in cache
# (1-2 MiB measured best on the 2-core CPU; 8 MiB was ~1.5x slower, one chunk
# of everything ~2x).
CHUNK_BYTES = 2 * 2**20
# The same for the pages of one-row items (`_attend_by_pairs`): 1 MiB measured best.
PAGE_CHUNK_BYTES = 2**20
# Pages of a multi-row item's table attended per block.
ITEM_BLOCK_PAGES = 8
# Pages of a one-row item attended per (row, block) pair: 4 measured 10-30% faster than one page a
# pair on the decode batches of the 125M shape (fewer, larger products and merges), 2 and 8 in between.
PAIR_PAGES = 4


def _merge_block(m_run, l_run, o_run, s, weighted_values, key_axis: int = -1):
    """One block of keys into a running softmax: scores `s` with the block's keys along `key_axis`
    (-inf where masked), the running max and sum (`s`'s shape without that axis) and weighted values
    [..., D]; `weighted_values(p)` is the block's p @ V."""
    m_new = jnp.maximum(m_run, jnp.max(s, axis=key_axis))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # rows with nothing visible yet
    p = jnp.exp(s - jnp.expand_dims(m_safe, key_axis))
    alpha = jnp.exp(jnp.where(jnp.isfinite(m_run), m_run - m_safe, -jnp.inf))
    return m_new, l_run * alpha + jnp.sum(p, axis=key_axis), o_run * alpha[..., None] + weighted_values(p)


def _gather_pages(k_pages, v_pages, k_scale, v_scale, ids):
    """K and V of the pages `ids` [n, w], as float32 `[n, w * page_size, kv_heads, head_dim]`, int8/fp8
    pages multiplied by their per-token scales (None for float pages)."""
    n, w = ids.shape
    _, page_size, num_kv_heads, head_dim = k_pages.shape
    k = k_pages[ids].reshape(n, w * page_size, num_kv_heads, head_dim).astype(jnp.float32)
    v = v_pages[ids].reshape(n, w * page_size, num_kv_heads, head_dim).astype(jnp.float32)
    if k_scale is not None:
        k = k * k_scale[ids].reshape(n, w * page_size, num_kv_heads, 1)
        v = v * v_scale[ids].reshape(n, w * page_size, num_kv_heads, 1)
    return k, v


def _visible_pages(pos, end, window, page_size: int, num_pages: int):
    """First and last (inclusive) page a one-row item at `pos` reads: from the page of its window's
    first key (page 0 without a window) to the page of its last visible key, `end - 1`."""
    first = jnp.zeros_like(pos) if window is None else jnp.maximum(pos - window + 1, 0) // page_size
    return first, jnp.minimum((end - 1) // page_size, num_pages - 1)


def rows_per_item(num_tokens: int, num_seqs: int) -> int:
    """Query rows per item for a step of `num_tokens` rows and `num_seqs` sequence slots."""
    b = 1
    while b * 2 <= min(MAX_ROWS_PER_ITEM, num_tokens // max(1, num_seqs)):
        b *= 2
    return b


def _items(cu_q_lens, kv_lens, num_seqs, num_items: int, b: int, skip_one_row: bool = False):
    """Per item: its sequence, first row, first query position and live-row count. With
    `skip_one_row`, sequences of one query row (decodes) get no item."""
    num_slots = kv_lens.shape[0]
    q_len = cu_q_lens[1:] - cu_q_lens[:-1]
    q_len = jnp.where(jnp.arange(num_slots) < num_seqs, q_len, 0)
    blocks = (q_len + b - 1) // b
    if skip_one_row:
        blocks = jnp.where(q_len == 1, 0, blocks)
    ends = jnp.cumsum(blocks)
    j = jnp.arange(num_items, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(ends, j, side="right"), 0, num_slots - 1).astype(jnp.int32)
    block = j - (ends[seq] - blocks[seq])
    live = j < ends[-1]
    offset = block * b
    n_rows = jnp.where(live, jnp.minimum(b, q_len[seq] - offset), 0)
    first_row = cu_q_lens[seq] + offset
    first_pos = kv_lens[seq] - q_len[seq] + offset
    return seq, first_row, first_pos, n_rows


def ragged_paged_attention_xla(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, *,
                               sm_scale: float | None = None, k_scale=None, v_scale=None,
                               window=None, soft_cap: float | None = None, span_end=None,
                               rows: int | None = None, chunk_bytes: int | None = None,
                               block_pages: int | None = None):
    """`k_scale`/`v_scale` `[pages, page_size, kv_heads]`: per-token scales of int8/fp8 pages
    (None for float pages), applied to the gathered rows as in the reference. `window` / `soft_cap` /
    `span_end` as in the reference; a one-row item skips the pages wholly before its window and reads
    the pages up to its span's end. `rows`, `chunk_bytes` and `block_pages` override how the work is cut
    (rows per item, `CHUNK_BYTES` / `PAGE_CHUNK_BYTES`, `ITEM_BLOCK_PAGES` and `PAIR_PAGES`): the tests
    use them to reach every path on small shapes."""
    T, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    S, P = block_tables.shape
    group = num_q_heads // num_kv_heads
    L = P * page_size
    if sm_scale is None:
        sm_scale = head_dim**-0.5
    check_kv_scales(k_pages, v_pages, k_scale, v_scale, "attention")
    b = rows or rows_per_item(T, S)
    num_items = min(T, -(-T // b) + S)
    if b == 1:
        seq, row, pos, n_rows = _items(cu_q_lens, kv_lens, num_seqs, num_items, 1)
        end = query_end(pos, None if span_end is None else span_end[jnp.minimum(row, T - 1)])
        end = end if span_end is None else jnp.minimum(end, kv_lens[seq])  # a span never reaches past the cache
        o = _attend_one_row_items(q, k_pages, v_pages, k_scale, v_scale, block_tables, seq, row, pos, end, n_rows > 0,
                                  sm_scale=sm_scale, chunk_bytes=chunk_bytes or PAGE_CHUNK_BYTES, window=window,
                                  soft_cap=soft_cap, pair_pages=block_pages or PAIR_PAGES)
        out = jnp.zeros((T, num_q_heads, head_dim), q.dtype)
        return out.at[jnp.where(n_rows > 0, row, T)].set(o, mode="drop")  # T: dropped

    # The decodes of a mixed step are one-row items of their own (below): in a B-row item a
    # decode would gather its whole page table for one live row of B.
    seq, first_row, first_pos, n_rows = _items(cu_q_lens, kv_lens, num_seqs, num_items, b, skip_one_row=True)
    r = jnp.arange(b, dtype=jnp.int32)
    row_ok = r[None, :] < n_rows[:, None]  # [I, B]
    rows_idx = jnp.where(row_ok, first_row[:, None] + r[None, :], T)  # T: dropped on the way out
    q_items = q[jnp.minimum(rows_idx, T - 1)]  # [I, B, H, D]
    pos = first_pos[:, None] + r[None, :]  # [I, B]
    ends = query_end(pos, None if span_end is None else span_end[jnp.minimum(rows_idx, T - 1)])  # [I, B]
    tables = block_tables[seq]  # [I, P]
    lens = kv_lens[seq]  # [I]

    item_bytes = L * num_kv_heads * head_dim * 4
    per_chunk = max(1, min(num_items, (chunk_bytes or CHUNK_BYTES) // item_bytes))
    w = min(P, block_pages or ITEM_BLOCK_PAGES)
    num_blocks = -(-P // w)
    if num_blocks * w > P:  # whole blocks: the extra pages are masked off (past every key)
        tables = jnp.pad(tables, ((0, 0), (0, num_blocks * w - P)))
    num_chunks = -(-num_items // per_chunk)
    pad = num_chunks * per_chunk - num_items

    def chunked(x):
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape((num_chunks, per_chunk) + x.shape[1:])

    def attend(qc, tc, pc, ec, okc, lc):
        # The item's pages a block of `w` at a time, merged flash-style; blocks past the chunk's last
        # visible key are skipped (a prompt's early rows see a fraction of the bucket's P pages).
        n = qc.shape[0]
        qg = qc.reshape(n, b, num_kv_heads, group, head_dim).astype(jnp.float32)
        ok_end = jnp.where(okc, jnp.minimum(ec, lc[:, None]), 0)  # [n, B]: keys before this are candidates
        last = jnp.max(ok_end)

        def block(c, carry):
            m_run, l_run, o_run = carry  # [n, K, B, G] twice, [n, K, B, G, D]
            ids = jax.lax.dynamic_slice_in_dim(tc, c * w, w, axis=1)  # [n, w]
            k, v = _gather_pages(k_pages, v_pages, k_scale, v_scale, ids)
            s = apply_soft_cap(jnp.einsum("nbkgd,nlkd->nkbgl", qg, k) * sm_scale, soft_cap)
            j = c * w * page_size + jnp.arange(w * page_size, dtype=jnp.int32)
            visible = (j[None, None, :] < ok_end[:, :, None]) & in_window(j[None, None, :], pc[:, :, None], window)
            s = jnp.where(visible[:, None, :, None, :], s, -jnp.inf)
            return _merge_block(m_run, l_run, o_run, s, lambda p: jnp.einsum("nkbgl,nlkd->nkbgd", p, v))

        init = (jnp.full((n, num_kv_heads, b, group), -jnp.inf, jnp.float32),
                jnp.zeros((n, num_kv_heads, b, group), jnp.float32),
                jnp.zeros((n, num_kv_heads, b, group, head_dim), jnp.float32))
        _, l_run, o_run = jax.lax.fori_loop(
            0, num_blocks, lambda c, carry: jax.lax.cond(c * w * page_size < last, block, lambda c, x: x, c, carry),
            init)
        o = o_run / jnp.where(l_run > 0, l_run, 1.0)[..., None]
        return jnp.transpose(o, (0, 2, 1, 3, 4)).reshape(n, b, num_q_heads, head_dim).astype(q.dtype)

    def one_chunk(args):
        qc, tc, pc, ec, okc, lc = args
        empty = jnp.zeros(qc.shape, q.dtype)
        return jax.lax.cond(jnp.any(okc), lambda: attend(qc, tc, pc, ec, okc, lc), lambda: empty)

    xs = tuple(chunked(x) for x in (q_items, tables, pos, ends, row_ok, lens))
    # Always through the loop, even for one chunk: gathering straight from the
    # freshly written pages made XLA CPU copy the whole donated pool per layer
    # (a 1-token step of the 125M shape went from 38 ms to 410 ms).
    out_items = jax.lax.map(one_chunk, xs).reshape((num_chunks * per_chunk, b, num_q_heads, head_dim))
    out_items = out_items[:num_items]
    out = jnp.zeros((T, num_q_heads, head_dim), q.dtype)
    out = out.at[rows_idx.reshape(-1)].set(out_items.reshape(-1, num_q_heads, head_dim), mode="drop")

    num_one = min(S, T)
    q_len = cu_q_lens[1:] - cu_q_lens[:-1]
    one_row = (q_len == 1) & (jnp.arange(S) < num_seqs)
    (seq1,) = jnp.nonzero(one_row, size=num_one, fill_value=0)
    seq1 = seq1.astype(jnp.int32)
    live1 = jnp.arange(num_one) < jnp.sum(one_row)
    row1 = jnp.minimum(cu_q_lens[seq1], T - 1)
    pos1 = kv_lens[seq1] - 1
    end1 = query_end(pos1, None if span_end is None else span_end[row1])
    end1 = end1 if span_end is None else jnp.minimum(end1, kv_lens[seq1])
    o1 = _attend_one_row_items(q, k_pages, v_pages, k_scale, v_scale, block_tables, seq1, row1, pos1, end1, live1,
                               sm_scale=sm_scale, chunk_bytes=chunk_bytes or PAGE_CHUNK_BYTES, window=window,
                               soft_cap=soft_cap, pair_pages=block_pages or PAIR_PAGES)
    return out.at[jnp.where(live1, row1, T)].set(o1, mode="drop")


def _attend_one_row_items(q, k_pages, v_pages, k_scale, v_scale, block_tables, seq, row, pos, end, live, *,
                          sm_scale, chunk_bytes, window=None, soft_cap=None, pair_pages=PAIR_PAGES):
    """Attention of one-row items -> `[items, q_heads, head_dim]`: all of them in one block of pages
    when every item's page table fits in `chunk_bytes` (batch-1 decode, small batches), by (row, block
    of `pair_pages` pages) pairs otherwise, whose work follows the live contexts. Within one block both
    compute the same products; the block saves the pairs' scatter-merges."""
    _, page_size, num_kv_heads, head_dim = k_pages.shape
    page_bytes = page_size * num_kv_heads * head_dim * 4
    args = (q, k_pages, v_pages, k_scale, v_scale, block_tables, seq, row, pos, end, live)
    kwargs = dict(sm_scale=sm_scale, chunk_bytes=chunk_bytes, window=window, soft_cap=soft_cap)
    if seq.shape[0] * block_tables.shape[1] * page_bytes <= chunk_bytes:
        return _attend_by_row_blocks(*args, **kwargs)
    return _attend_by_pairs(*args, **kwargs, pair_pages=pair_pages)


def _attend_by_pairs(q, k_pages, v_pages, k_scale, v_scale, block_tables, seq, row, pos, end, live, *, sm_scale,
                     chunk_bytes, window=None, soft_cap=None, pair_pages=PAIR_PAGES):
    """One query row per item (`row`, at position `pos` of sequence `seq`, seeing keys before `end`;
    `live` marks real items): attention over the item's visible pages, a (row, block of `pair_pages`
    pages) pair at a time."""
    T, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    S, P = block_tables.shape
    group = num_q_heads // num_kv_heads
    num_items = seq.shape[0]
    u = min(pair_pages, P)
    L = u * page_size

    # Pairs, item-major: item i owns pairs [ends[i] - n_pairs[i], ends[i]). Their count is dynamic;
    # the arrays are sized for the worst case and only the first `num_pairs` are ever read.
    first_page, last_page = _visible_pages(pos, end, window, page_size, P)
    n_pairs = jnp.where(live, (last_page - first_page) // u + 1, 0)
    ends = jnp.cumsum(n_pairs)
    num_pairs = ends[-1]
    max_pairs = num_items * -(-P // u)
    per_chunk = max(1, min(max_pairs, chunk_bytes // (L * num_kv_heads * head_dim * 4)))
    cap = -(-max_pairs // per_chunk) * per_chunk
    j = jnp.arange(cap, dtype=jnp.int32)
    pair_item = jnp.minimum(jnp.searchsorted(ends, j, side="right"), num_items - 1).astype(jnp.int32)
    pair_page = first_page[pair_item] + (j - (ends[pair_item] - n_pairs[pair_item])) * u  # the block's first page
    pair_live = j < num_pairs
    # Pages past the row's last one re-read its last page (cached) and are masked off by position.
    pages = jnp.minimum(pair_page[:, None] + jnp.arange(u, dtype=jnp.int32), last_page[pair_item][:, None])
    pair_ids = block_tables[seq[pair_item][:, None], jnp.clip(pages, 0, P - 1)]  # [cap, u]
    pair_item = jnp.where(pair_live, pair_item, num_items)  # dead pairs land in a spare row
    qg = q.reshape(T, num_kv_heads, group, head_dim).astype(jnp.float32)
    token = jnp.arange(L, dtype=jnp.int32)

    def body(c, carry):
        m_run, l_run, o_run = carry  # [I+1, K, G], [I+1, K, G], [I+1, K, G, D]
        start = c * per_chunk
        ids = jax.lax.dynamic_slice_in_dim(pair_ids, start, per_chunk)
        item = jax.lax.dynamic_slice_in_dim(pair_item, start, per_chunk)
        page = jax.lax.dynamic_slice_in_dim(pair_page, start, per_chunk)
        safe_item = jnp.minimum(item, num_items - 1)
        k, v = _gather_pages(k_pages, v_pages, k_scale, v_scale, ids)
        qc = qg[row[safe_item]]  # [C, K, G, D]
        # Products, not multiply-and-reduce: XLA CPU runs these as batched dots, 10-30% faster.
        s = apply_soft_cap(jnp.einsum("ckgd,ctkd->ctkg", qc, k) * sm_scale, soft_cap)  # [C, L, K, G]
        key_pos = page[:, None] * page_size + token[None, :]
        visible = (key_pos < end[safe_item][:, None]) & (item < num_items)[:, None]
        visible &= in_window(key_pos, pos[safe_item][:, None], window)
        s = jnp.where(visible[:, :, None, None], s, -jnp.inf)
        m = jnp.max(s, axis=1)  # [C, K, G]; -inf only for dead pairs
        p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)[:, None])
        l_pair = jnp.sum(p, axis=1)
        o_pair = jnp.einsum("ctkg,ctkd->ckgd", p, v)
        m_new = m_run.at[item].max(m)
        alpha = jnp.exp(jnp.where(jnp.isfinite(m_run), m_run - m_new, -jnp.inf))
        beta = jnp.exp(jnp.where(jnp.isfinite(m), m - m_new[item], -jnp.inf))
        l_run = (l_run * alpha).at[item].add(l_pair * beta)
        o_run = (o_run * alpha[..., None]).at[item].add(o_pair * beta[..., None])
        return m_new, l_run, o_run

    init = (jnp.full((num_items + 1, num_kv_heads, group), -jnp.inf, jnp.float32),
            jnp.zeros((num_items + 1, num_kv_heads, group), jnp.float32),
            jnp.zeros((num_items + 1, num_kv_heads, group, head_dim), jnp.float32))

    def maybe_body(c, carry):  # chunks past the live pairs cost (almost) nothing
        return jax.lax.cond(c * per_chunk < num_pairs, body, lambda c, carry: carry, c, carry)

    # A static trip count with skipped chunks, not a loop bounded by `num_pairs`: with that
    # dynamic bound XLA CPU copied the whole donated pool twice per layer when the step's
    # K/V write became a dynamic-update-slice (one-token steps: ~200 ms instead of ~25 ms).
    # Reading the pages inside the loop also keeps it from copying the pool.
    _, l_run, o_run = jax.lax.fori_loop(0, cap // per_chunk, maybe_body, init)
    o = o_run[:num_items] / jnp.where(l_run[:num_items] > 0, l_run[:num_items], 1.0)[..., None]
    return o.reshape(num_items, num_q_heads, head_dim).astype(q.dtype)


def _attend_by_row_blocks(q, k_pages, v_pages, k_scale, v_scale, block_tables, seq, row, pos, end, live, *,
                          sm_scale, chunk_bytes, window=None, soft_cap=None):
    """One query row per item, as `_attend_by_pairs`, but a block of `W` pages of every item at a time."""
    T, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    S, P = block_tables.shape
    group = num_q_heads // num_kv_heads
    num_items = seq.shape[0]

    first_page, last_page = _visible_pages(pos, end, window, page_size, P)
    n_pages = jnp.where(live, last_page - first_page + 1, 0)
    page_bytes = page_size * num_kv_heads * head_dim * 4
    w = max(1, min(P, chunk_bytes // (num_items * page_bytes)))
    num_blocks = -(-P // w)
    L = w * page_size
    tables = block_tables[seq]  # [I, P]
    qg = q[row].reshape(num_items, num_kv_heads, group, head_dim).astype(jnp.float32)
    token = jnp.arange(L, dtype=jnp.int32)
    most = jnp.max(n_pages)

    def body(c, carry):
        m_run, l_run, o_run = carry  # [I, K, G], [I, K, G], [I, K, G, D]
        page = first_page[:, None] + c * w + jnp.arange(w, dtype=jnp.int32)[None, :]  # [I, W]
        # Pages past an item's last one re-read its last page (cached) and are masked off.
        ids = jnp.take_along_axis(tables, jnp.minimum(page, last_page[:, None]).clip(0, P - 1), axis=1)
        k, v = _gather_pages(k_pages, v_pages, k_scale, v_scale, ids)
        # Keys before heads in the scores, as in the pairs: XLA CPU's product is faster that way.
        s = apply_soft_cap(jnp.einsum("ikgd,ilkd->ilkg", qg, k) * sm_scale, soft_cap)
        key_pos = (first_page[:, None] + c * w) * page_size + token[None, :]  # [I, L]
        visible = (key_pos < end[:, None]) & live[:, None]
        visible &= in_window(key_pos, pos[:, None], window)
        s = jnp.where(visible[:, :, None, None], s, -jnp.inf)
        return _merge_block(m_run, l_run, o_run, s, lambda p: jnp.einsum("ilkg,ilkd->ikgd", p, v), key_axis=1)

    init = (jnp.full((num_items, num_kv_heads, group), -jnp.inf, jnp.float32),
            jnp.zeros((num_items, num_kv_heads, group), jnp.float32),
            jnp.zeros((num_items, num_kv_heads, group, head_dim), jnp.float32))

    def maybe_body(c, carry):
        return jax.lax.cond(c * w < most, body, lambda c, carry: carry, c, carry)

    _, l_run, o_run = jax.lax.fori_loop(0, num_blocks, maybe_body, init)
    o = o_run / jnp.where(l_run > 0, l_run, 1.0)[..., None]
    return o.reshape(num_items, num_q_heads, head_dim).astype(q.dtype)
