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

from typing import Any

import jax
import jax.numpy as jnp

from model.config import LlamaConfig
from model.params import ArrayInfo, is_array_info, pytree_dataclass

CACHE_AXES = ("pages", "page_slot", "kv_heads", "head_dim")


@pytree_dataclass
class KVCache:
    k: list  # per layer [num_pages, page_size, kv_heads, head_dim]
    v: list

    @classmethod
    def declare(cls, cfg: LlamaConfig, num_pages: int, page_size: int, dtype=None) -> "KVCache":
        dt = dtype or cfg.jnp_dtype
        info = ArrayInfo((num_pages, page_size, cfg.num_kv_heads, cfg.head_dim), dt, CACHE_AXES)
        return cls(k=[info] * cfg.num_layers, v=[info] * cfg.num_layers)

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]


def init_cache(cfg: LlamaConfig, num_pages: int, page_size: int, dtype=None, shardings=None) -> KVCache:
    decl = KVCache.declare(cfg, num_pages, page_size, dtype)

    def build():
        return jax.tree.map(lambda i: jnp.zeros(i.shape, i.dtype), decl, is_leaf=is_array_info)

    return jax.jit(build, out_shardings=shardings)()


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


def pad_slot(num_pages: int, page_size: int) -> int:
    return num_pages * page_size
