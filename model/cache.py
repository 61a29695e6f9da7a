"""The paged KV cache and the metadata of a flattened ragged token batch.

Cache layout: per layer, K and V pages of shape
`[num_pages, page_size, kv_heads, head_dim]`. One array per layer (not one
`[layers, ...]` stack) for the same reason the weights are per layer: each
layer's update is then an in-place scatter into its own donated buffer, with no
slice-and-restack of the whole cache on XLA CPU. The kv_heads axis is the one
tensor parallelism shards.

A token's cache *slot* is `page * page_size + offset`. Padding tokens carry the
slot `num_pages * page_size` (one past the end), which every cache write drops.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from model.config import LlamaConfig
from model.declarations import ArrayInfo, is_array_info, pytree_dataclass
from model.quant import SCALE_DTYPE, QuantizedArray, is_quantized_dtype, kv_cache_dtype

CACHE_AXES = ("pages", "page_slot", "kv_heads", "head_dim")
SCALE_AXES = CACHE_AXES[:3]  # one scale per (page, slot, kv head) of a quantized cache


@pytree_dataclass
class KVCache:
    k: list  # per layer [num_pages, page_size, kv_heads, head_dim], or a QuantizedArray of that and its scales
    v: list

    @classmethod
    def declare(cls, cfg: LlamaConfig, num_pages: int, page_size: int, dtype=None) -> "KVCache":
        """`dtype` int8 / fp8 (or "int8" / "fp8") declares each layer's pages as a `QuantizedArray`:
        the pages in that dtype plus fp32 scales `[num_pages, page_size, kv_heads]` (`model.quant`)."""
        dt = kv_cache_dtype(cfg, dtype) if isinstance(dtype, str) else (dtype or cfg.jnp_dtype)
        shape = (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        info = ArrayInfo(shape, dt, CACHE_AXES)
        if is_quantized_dtype(dt):
            info = QuantizedArray(data=info, scale=ArrayInfo(shape[:3], SCALE_DTYPE, SCALE_AXES))
        return cls(k=[info] * cfg.num_layers, v=[info] * cfg.num_layers)

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]


@dataclasses.dataclass(frozen=True)
class StackedKVCache:
    """Every layer's pages in one array each for K and V, `[num_layers * num_pages, page_size,
    kv_heads, head_dim]`: layer i's page p is row `i * num_pages + p`.

    The form `model.forward` scans over layers with (`jax.lax.scan`, so a deep model compiles
    one layer body, not one per layer). The layers share one page axis rather than a
    `[layers, pages, ...]` stack because then each layer's attention reads and writes the whole
    array with offset page ids and slots, the backends unchanged: taking layer i's slice of a
    stack inside the loop would copy that layer's whole pool every step on XLA CPU.
    """

    k: Any  # [num_layers * num_pages, page_size, kv_heads, head_dim], or a QuantizedArray of that and its scales
    v: Any
    num_layers: int

    @classmethod
    def declare(cls, cfg: LlamaConfig, num_pages: int, page_size: int, dtype=None) -> "StackedKVCache":
        layer = KVCache.declare(cfg, num_pages, page_size, dtype).k[0]
        info = jax.tree.map(lambda i: ArrayInfo((cfg.num_layers * i.shape[0],) + i.shape[1:], i.dtype, i.logical_axes),
                            layer, is_leaf=is_array_info)
        return cls(k=info, v=info, num_layers=cfg.num_layers)

    @property
    def _pages(self):
        return self.k.data if isinstance(self.k, QuantizedArray) else self.k

    @property
    def num_pages(self) -> int:
        """Pages per layer (what page ids and the block manager count)."""
        return self._pages.shape[0] // self.num_layers

    @property
    def page_size(self) -> int:
        return self._pages.shape[1]


jax.tree_util.register_dataclass(StackedKVCache, data_fields=["k", "v"], meta_fields=["num_layers"])


def layer_offsets(md: "BatchMetadata", layer, num_layers: int, num_pages: int, page_size: int) -> "BatchMetadata":
    """`md` for layer `layer` (a traced index) of a `StackedKVCache`: page ids and slots moved to that
    layer's rows; a padding slot (`num_pages * page_size`) stays padding, one past the whole array."""
    pad = num_pages * page_size
    slots = jnp.where(md.slot_mapping >= pad, num_layers * pad, md.slot_mapping + layer * pad)
    return dataclasses.replace(md, slot_mapping=slots, block_tables=md.block_tables + layer * num_pages)


def init_cache(cfg: LlamaConfig, num_pages: int, page_size: int, dtype=None, shardings=None,
               stacked: bool = False):
    """A zeroed cache: per-layer arrays (`KVCache`), or with `stacked` one `StackedKVCache`."""
    return cache_builder(cfg, num_pages, page_size, dtype, shardings, stacked)()


def cache_builder(cfg: LlamaConfig, num_pages: int, page_size: int, dtype=None, shardings=None,
                  stacked: bool = False):
    """The jitted, argument-free program `init_cache` runs (for callers that keep its executable)."""
    decl = (StackedKVCache if stacked else KVCache).declare(cfg, num_pages, page_size, dtype)

    def build():
        return jax.tree.map(lambda i: jnp.zeros(i.shape, i.dtype), decl, is_leaf=is_array_info)

    return jax.jit(build, out_shardings=shardings)


def cache_bytes(cache: KVCache) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))


@pytree_dataclass
class BatchMetadata:
    """Everything the forward pass needs to know about a flattened ragged batch.

    T is the padded token count, S the padded sequence count, P the padded
    pages-per-sequence, R the number of logit rows. Sequence i owns tokens
    `cu_q_lens[i]:cu_q_lens[i+1]`; sequences at index >= num_seqs are padding
    (their q and kv lengths are 0).
    """

    positions: Any  # [T] int32: absolute position of each token (its KV index)
    slot_mapping: Any  # [T] int32: cache slot to write each token's K/V (pad: num_slots)
    cu_q_lens: Any  # [S+1] int32: query start offsets, non-decreasing
    kv_lens: Any  # [S] int32: cached tokens of each sequence after this step
    block_tables: Any  # [S, P] int32: page ids of each sequence
    num_seqs: Any  # [] int32: live sequences
    logits_indices: Any  # [R] int32: token rows whose logits are returned
    # [3, T] int32 multimodal RoPE positions (temporal, height, width; `model.vision.mrope`) of a
    # config with `mrope_section`; None for every other model (RoPE turns by `positions`).
    rope_positions: Any = None
    # [T] int32 the exclusive end of the bidirectional span each token is in (an image's tokens, for a
    # config whose `vision.bidirectional`; 0 for a token in none), or None: attention is causal.
    span_end: Any = None
    # [T] int32 each token's token type (a cross-encoder's second text: 1), for a config with `type_vocab_size`;
    # None: every token type 0.
    token_types: Any = None


def pad_slot(num_pages: int, page_size: int) -> int:
    return num_pages * page_size


def fill_ragged(num_new, starts, tables, page_size: int, *, positions, slots, cu_q_lens, kv_lens,
                block_tables) -> np.ndarray:
    """Writes the layout of a ragged batch into padded numpy arrays (views of one buffer or not).

    Sequence i brings `num_new[i]` tokens at positions `starts[i]`, ... and holds the pages `tables[i]`:
    its tokens' positions and cache slots, its query offsets, KV length and block table are written;
    every entry past the live ones is left as it was (the caller's padding). Vectorised over tokens:
    the engine packs every step with it (`serving.core.input_batch.pack_step`), and `pack_batch` builds a
    `BatchMetadata` with it. Returns the end offset of each sequence's tokens (`cu_q_lens[1:n + 1]`).
    """
    n = len(num_new)
    cu = np.cumsum(num_new)
    total = int(cu[-1]) if n else 0
    cu_q_lens[0] = 0
    cu_q_lens[1:n + 1] = cu
    cu_q_lens[n + 1:] = total
    seq_of = np.repeat(np.arange(n), num_new)
    pos = np.arange(total) - (cu - num_new)[seq_of] + starts[seq_of]
    positions[:total] = pos
    for i, table in enumerate(tables):
        block_tables[i, :len(table)] = table
    np.maximum(block_tables, 0, out=block_tables)  # released pages (-1, before a sliding window) read as page 0
    slots[:total] = block_tables[seq_of, pos // page_size] * page_size + pos % page_size
    kv_lens[:n] = starts + num_new
    return cu


def pack_batch(chunks, *, page_size: int, num_pages: int, num_tokens: int, max_seqs: int, pages_per_seq: int,
               logits_rows: int | None = None, all_logits: bool = False):
    """Host-side packing of a ragged batch into padded numpy arrays (tests and benchmarks that call the
    model directly; the engine packs its steps with `serving.core.input_batch.pack_step`, on the same
    `fill_ragged`).

    `chunks` is a list of (token_ids, start_position, block_table): the new
    tokens of one sequence, the position of the first of them, and the pages
    holding the sequence. Returns (tokens [T], BatchMetadata of numpy arrays).
    Logit rows are each sequence's last token (or every token with
    `all_logits`), padded with row 0 up to `logits_rows`.
    """
    total = sum(len(t) for t, _, _ in chunks)
    if total > num_tokens or len(chunks) > max_seqs:
        raise ValueError(f"batch of {total} tokens / {len(chunks)} seqs exceeds {num_tokens} / {max_seqs}")
    for i, (ids, start, table) in enumerate(chunks):
        n = len(ids)
        if len(table) > pages_per_seq:
            raise ValueError(f"block table of {len(table)} pages exceeds pages_per_seq={pages_per_seq}")
        table = np.asarray(table, np.int32)
        # Broken chunks would otherwise index out of bounds or silently write nowhere.
        if n == 0 or start < 0:
            raise ValueError(f"chunk {i}: needs at least one token and start >= 0 (got {n} tokens at {start})")
        if start + n > len(table) * page_size:
            raise ValueError(f"chunk {i}: position {start + n - 1} is beyond its {len(table)} pages of {page_size}")
        used = table[:(start + n + page_size - 1) // page_size]
        if used.min() < 0 or used.max() >= num_pages:
            raise ValueError(f"chunk {i}: block table {table.tolist()} has page ids outside [0, {num_pages})")
    tokens = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slots = np.full(num_tokens, pad_slot(num_pages, page_size), np.int32)
    cu = np.zeros(max_seqs + 1, np.int32)
    kv_lens = np.zeros(max_seqs, np.int32)
    tables = np.zeros((max_seqs, pages_per_seq), np.int32)
    num_new = np.array([len(ids) for ids, _, _ in chunks], np.int64)
    ends = fill_ragged(num_new, np.array([start for _, start, _ in chunks], np.int64),
                       [np.asarray(table, np.int32) for _, _, table in chunks], page_size, positions=positions,
                       slots=slots, cu_q_lens=cu, kv_lens=kv_lens, block_tables=tables)
    if chunks:
        tokens[:total] = np.concatenate([np.asarray(ids, np.int32) for ids, _, _ in chunks])
    rows = []
    for n, end in zip(num_new.tolist(), ends.tolist()):
        rows.extend(range(end - n, end) if all_logits else [end - 1])
    logits_rows = logits_rows or len(rows)
    if len(rows) > logits_rows:
        raise ValueError(f"{len(rows)} logit rows exceed logits_rows={logits_rows}")
    logits_indices = np.zeros(logits_rows, np.int32)
    logits_indices[:len(rows)] = rows
    md = BatchMetadata(positions=positions, slot_mapping=slots, cu_q_lens=cu, kv_lens=kv_lens,
                       block_tables=tables, num_seqs=np.int32(len(chunks)), logits_indices=logits_indices)
    return tokens, md
