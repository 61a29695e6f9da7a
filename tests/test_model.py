"""The model core: dense training forward == paged serving forward, weight declarations, pack_batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from conftest import tiny_config
from model.cache import init_cache, pack_batch, pad_slot
from model.families import config_by_name, num_params
from model.forward import forward
from model.params import (ArrayInfo, Weights, abstract_params, flatten_params, init_params, is_array_info,
                          logical_axes, unflatten_params)
from model.train import forward_dense

PAGE_SIZE, NUM_PAGES = 4, 16


def random_params(cfg, seed):
    """Random weights at 1/sqrt(fan_in) scale with random norms (numpy-generated: no per-shape compiles)."""
    rng = np.random.default_rng(seed)

    def one(name, info):
        if info.logical_axes == ("norm",):
            x = 1.0 + 0.3 * rng.standard_normal(info.shape)
        else:  # [out..., in...]: wo's input is (q_heads, head_dim), every other weight's its last dim
            fan_in = info.shape[1] * info.shape[2] if name.endswith("wo") else info.shape[-1]
            x = rng.standard_normal(info.shape) / (1.0 if name == "embed" else np.sqrt(fan_in))
        return jnp.asarray(x, info.dtype)

    decl = flatten_params(Weights.declare(cfg))
    return unflatten_params(cfg, {name: one(name, info) for name, info in decl.items()})


_forward = jax.jit(forward, static_argnames=("cfg", "backend"))
_dense = jax.jit(forward_dense, static_argnames=("cfg",))


@pytest.mark.parametrize("dtype,tied,tol", [("float32", False, 1e-5), ("float32", True, 1e-5),
                                            ("bfloat16", False, 6e-2)])
def test_dense_training_forward_equals_paged_forward(dtype, tied, tol):
    """Three ragged sequences through the paged forward in one call vs the dense causal forward.

    The dense side runs them as one right-padded [3, 12] batch: causality makes the
    padding invisible to the real positions, which are the only rows compared.
    """
    cfg = tiny_config(dtype=dtype, tie_word_embeddings=tied)
    params = random_params(cfg, seed=1)
    lengths = (12, 5, 9)
    rng = np.random.default_rng(2)
    seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in lengths]
    tables = [[7, 2, 11], [0, 5], [14, 3, 9]]  # scattered pages; 12, 5, 9 tokens fill 3, 2, 3 of them
    tokens, md = pack_batch([(s, 0, t) for s, t in zip(seqs, tables)], page_size=PAGE_SIZE, num_pages=NUM_PAGES,
                            num_tokens=32, max_seqs=4, pages_per_seq=4, logits_rows=32, all_logits=True)
    cache = init_cache(cfg, NUM_PAGES, PAGE_SIZE)
    paged, cache = _forward(params, cache, tokens, md, cfg, backend="reference")
    paged = np.asarray(paged, np.float32)
    padded = np.zeros((len(seqs), max(lengths)), np.int32)
    for b, s in enumerate(seqs):
        padded[b, :len(s)] = s
    dense = np.asarray(_dense(params, jnp.asarray(padded), cfg), np.float32)
    assert np.abs(dense).max() > 1.0
    row = 0
    for b, s in enumerate(seqs):
        np.testing.assert_allclose(paged[row:row + len(s)], dense[b, :len(s)], atol=tol, rtol=tol)
        row += len(s)
    # Padding tokens (rows 26..31) wrote nowhere: pages outside every block table are still zero.
    unused = sorted(set(range(NUM_PAGES)) - {p for t in tables for p in t})
    for k in cache.k + cache.v:
        assert not np.any(np.asarray(k)[unused])
        assert np.any(np.asarray(k)[tables[0]])


# --- declarations ---

def test_abstract_params_follow_declarations_at_8b_scale():
    cfg = config_by_name("llama3-8b")
    abstract = flatten_params(abstract_params(cfg))
    # Linear weights are [out..., in...], like Hugging Face's (and the head like the embedding table).
    assert abstract["layers.31.wq"].shape == (32, 128, 4096)
    assert abstract["layers.0.wk"].shape == (8, 128, 4096)
    assert abstract["layers.0.wo"].shape == (4096, 32, 128)
    assert abstract["layers.0.w_gate"].shape == (14336, 4096)
    assert abstract["layers.0.w_down"].shape == (4096, 14336)
    assert abstract["embed"].shape == (128256, 4096) and abstract["lm_head"].shape == (128256, 4096)
    assert {a.dtype for a in abstract.values()} == {jnp.dtype(jnp.bfloat16)}
    assert sum(int(np.prod(a.shape)) for a in abstract.values()) == num_params(cfg)
    axes = logical_axes(cfg)
    assert axes.layers[0].wq == ("q_heads", "head_dim", "embed") and axes.lm_head == ("vocab", "embed")
    assert axes.layers[0].wo == ("embed", "q_heads", "head_dim") and axes.layers[0].w_down == ("embed", "ffw")
    assert len(abstract) == 2 + 9 * 32 + 1


def test_init_params_follows_declarations_and_shardings():
    cfg = tiny_config(num_layers=1, vocab_size=96)
    mesh = Mesh(np.array(jax.devices()[:2]), ("t",))
    rules = {"q_heads": "t", "kv_heads": "t", "ffw": "t", "vocab": "t"}
    decl = flatten_params(Weights.declare(cfg))
    shardings = jax.tree.map(lambda i: NamedSharding(mesh, P(*(rules.get(a) for a in i.logical_axes))),
                             Weights.declare(cfg), is_leaf=is_array_info)
    params = flatten_params(init_params(cfg, jax.random.key(0), shardings=shardings))
    assert set(params) == set(decl)
    for name, info in decl.items():
        x = params[name]
        assert x.shape == info.shape and x.dtype == info.dtype, name
        assert x.sharding == flatten_params(shardings)[name], name
        v = np.asarray(x)
        if info.logical_axes == ("norm",):
            assert np.all(v == 1.0), name
        else:  # normal_init(fan_in): std 1/sqrt(fan_in); [out..., in...]: the input is the last dim (wo: two)
            fan_in = info.shape[1] * info.shape[2] if name.endswith("wo") else info.shape[-1]
            assert abs(v.std() * np.sqrt(fan_in) - 1.0) < 0.15, name
    assert not np.allclose(np.asarray(params["layers.0.wq"])[0], np.asarray(params["layers.0.wq"])[1])


def test_unflatten_round_trip_and_missing():
    cfg = tiny_config(tie_word_embeddings=True)
    params = random_params(cfg, seed=5)
    flat = flatten_params(params)
    assert "lm_head" not in flat
    again = unflatten_params(cfg, flat)
    assert again.lm_head is None and again.layers[1].w_up is flat["layers.1.w_up"]
    del flat["layers.1.wv"]
    with pytest.raises(KeyError, match="layers.1.wv"):
        unflatten_params(cfg, flat)


def test_array_info_rank_mismatch():
    with pytest.raises(ValueError, match="differ in rank"):
        ArrayInfo((4, 4), jnp.float32, ("embed",))


# --- pack_batch ---

PACK = dict(page_size=4, num_pages=8, num_tokens=12, max_seqs=3, pages_per_seq=3)


def test_pack_batch_layout():
    # seq 0: prefill of 5 tokens (one full page + 1); seq 1: a decode at position 8 (first slot of its 3rd page).
    tokens, md = pack_batch([([10, 11, 12, 13, 14], 0, [6, 1]), ([20], 8, [3, 0, 5])], **PACK)
    pad = pad_slot(8, 4)
    assert pad == 32
    np.testing.assert_array_equal(tokens, [10, 11, 12, 13, 14, 20] + [0] * 6)
    np.testing.assert_array_equal(md.positions[:6], [0, 1, 2, 3, 4, 8])
    np.testing.assert_array_equal(md.slot_mapping, [24, 25, 26, 27, 4, 20] + [pad] * 6)
    np.testing.assert_array_equal(md.cu_q_lens, [0, 5, 6, 6])
    np.testing.assert_array_equal(md.kv_lens, [5, 9, 0])
    np.testing.assert_array_equal(md.block_tables, [[6, 1, 0], [3, 0, 5], [0, 0, 0]])
    assert md.num_seqs == 2
    np.testing.assert_array_equal(md.logits_indices, [4, 5])  # each sequence's last token


def test_pack_batch_logit_rows():
    chunks = [([1, 2, 3], 0, [0]), ([4, 5], 6, [1, 2])]
    _, md = pack_batch(chunks, logits_rows=4, **PACK)
    np.testing.assert_array_equal(md.logits_indices, [2, 4, 0, 0])  # padded with row 0
    _, md = pack_batch(chunks, all_logits=True, logits_rows=6, **PACK)
    np.testing.assert_array_equal(md.logits_indices, [0, 1, 2, 3, 4, 0])
    with pytest.raises(ValueError, match="logit rows exceed"):
        pack_batch(chunks, all_logits=True, logits_rows=4, **PACK)


def test_pack_batch_exact_fit():
    """Exactly num_tokens tokens and max_seqs sequences, the last page filled to its final slot."""
    tokens, md = pack_batch([([1] * 4, 0, [0]), ([2] * 4, 4, [1, 2]), ([3] * 4, 8, [3, 4, 5])], **PACK)
    assert not np.any(md.slot_mapping == pad_slot(8, 4))
    np.testing.assert_array_equal(md.slot_mapping[8:], [20, 21, 22, 23])
    np.testing.assert_array_equal(md.cu_q_lens, [0, 4, 8, 12])
    assert md.num_seqs == 3


@pytest.mark.parametrize("chunks,match", [
    ([([1] * 13, 0, [0, 1, 2])], "exceeds 12"),
    ([([1], 0, [0])] * 4, "exceeds 12 / 3"),
    ([([1], 0, [0, 1, 2, 3])], "exceeds pages_per_seq=3"),
    ([([], 0, [0])], "at least one token"),
    ([([1], -1, [0])], "start >= 0"),
    ([([1, 2], 3, [0])], "position 4 is beyond its 1 pages"),
    ([([1], 4, [0, 8])], "outside"),
])
def test_pack_batch_rejects(chunks, match):
    with pytest.raises(ValueError, match=match):
        pack_batch(chunks, **PACK)
