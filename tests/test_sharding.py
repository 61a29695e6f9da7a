"""Mesh construction, rule tables and the checker, and shardings derived from declarations."""

import json

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import sharding
from conftest import tiny_config
from model.cache import KVCache, init_cache, pack_batch
from model.forward import forward
from model.params import abstract_params, is_array_info
from sharding.rules import RuleError


def tp_config(**overrides):
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_heads=8, num_kv_heads=2,
                tie_word_embeddings=True)
    base.update(overrides)
    return tiny_config(**base)


def megatron_with(**changes):
    d = sharding.load_rules("megatron").to_dict()
    d["axes"].update(changes)
    return d


# ---------------------------------------------------------------------------- mesh

def test_mesh_axes_and_subset_of_devices():
    mesh = sharding.make_mesh(tensor=2, pipeline=2)
    assert mesh.axis_names == ("data", "pipeline", "tensor")
    assert dict(mesh.shape) == {"data": 1, "pipeline": 2, "tensor": 2}
    # tensor is innermost: a TP group is consecutive devices.
    assert [d.id for d in mesh.devices[0, 0]] == [0, 1]
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_mesh_errors_are_clear():
    with pytest.raises(sharding.MeshError, match=r"tensor=16 needs 16 devices, but only 8"):
        sharding.make_mesh(tensor=16)
    with pytest.raises(sharding.MeshError, match=r"needs 4 devices, but 3 were given"):
        sharding.make_mesh(tensor=2, data=2, devices=jax.devices()[:3])
    with pytest.raises(sharding.MeshError, match="'tensor' must be a positive integer"):
        sharding.make_mesh(tensor=0)


# ---------------------------------------------------------------------------- rule tables

def test_megatron_table_is_data_and_round_trips(tmp_path):
    rules = sharding.load_rules("megatron")
    assert rules.table["q_heads"] == ("tensor",) and rules.table["embed"] == ()
    assert "kv_heads" in rules.replicate_when_fewer
    path = tmp_path / "rules_mine.json"
    path.write_text(json.dumps(rules.to_dict()))
    again = sharding.load_rules(str(path))
    assert again.axes == rules.axes and again.replicate_when_fewer == rules.replicate_when_fewer
    with pytest.raises(FileNotFoundError, match="megatron"):
        sharding.load_rules("no-such-table")


def test_double_mapped_mesh_axis_is_rejected_naming_both_dimensions():
    cfg, mesh = tp_config(), sharding.make_mesh(tensor=2)
    bad = megatron_with(head_dim="tensor")  # q_heads and head_dim of wq both on 'tensor'
    with pytest.raises(RuleError) as e:
        sharding.check_rules(bad, cfg, mesh)
    msg = str(e.value)
    assert "two dimensions of layers.0.wq to mesh axis 'tensor'" in msg
    assert "dimension 0 ('q_heads')" in msg and "dimension 1 ('head_dim')" in msg
    # The same table is refused wherever shardings are derived from it.
    with pytest.raises(RuleError, match="dimension 0 \\('vocab'\\) and dimension 1 \\('embed'\\)"):
        sharding.param_shardings(cfg, mesh, megatron_with(embed="tensor"))


def test_indivisible_dimension_is_rejected():
    with pytest.raises(RuleError, match=r"'vocab', size 100\) does not divide over mesh axes tensor of total size 8"):
        sharding.check_rules("megatron", tp_config(vocab_size=100), {"data": 1, "pipeline": 1, "tensor": 8})


def test_kv_heads_replicate_only_when_fewer_and_a_divisor():
    sizes = {"data": 1, "pipeline": 1, "tensor": 8}
    notes = sharding.check_rules("megatron", tp_config(num_kv_heads=2), sizes)
    assert notes == ["kv_heads (size 2) is replicated: fewer than the devices of its mesh axes"]
    assert sharding.check_rules("megatron", tp_config(num_kv_heads=8), sizes) == []
    # 3 KV heads cannot be copied evenly onto 4 devices.
    with pytest.raises(RuleError, match="replication is allowed only when 4 is a multiple of 3"):
        sharding.check_rules("megatron", tp_config(num_heads=12, num_kv_heads=3), dict(sizes, tensor=4))
    # Without the exception in the table, fewer KV heads is an ordinary divisibility error.
    strict = dict(sharding.load_rules("megatron").to_dict(), replicate_when_fewer=[])
    with pytest.raises(RuleError, match="'kv_heads', size 2"):
        sharding.check_rules(strict, tp_config(num_kv_heads=2), sizes)


def test_table_must_cover_every_logical_axis_and_name_real_mesh_axes():
    d = sharding.load_rules("megatron").to_dict()
    del d["axes"]["ffw"]
    with pytest.raises(RuleError, match=r"no rule for logical axis 'ffw' \(used by layers.0.w_gate\)"):
        sharding.check_rules(d, tp_config(), {"data": 1, "pipeline": 1, "tensor": 2})
    with pytest.raises(RuleError, match="'model'"):
        sharding.check_rules(megatron_with(ffw="model"), tp_config(), {"data": 1, "pipeline": 1, "tensor": 2})
    with pytest.raises(RuleError, match="a query head must live with its KV head"):
        sharding.check_rules(megatron_with(q_heads=None), tp_config(num_kv_heads=4),
                             {"data": 1, "pipeline": 1, "tensor": 2})


# ---------------------------------------------------------------------------- derived shardings

def test_megatron_param_and_cache_specs():
    mesh = sharding.make_mesh(tensor=2)
    ps = sharding.param_shardings(tp_config(), mesh, "megatron")
    layer = ps.layers[1]
    # Weights are [out..., in...]: column-parallel splits the leading (output) dim, row-parallel the input.
    assert layer.wq.spec == P("tensor") and layer.wk.spec == P("tensor")  # column-parallel
    assert layer.w_gate.spec == P("tensor") and layer.w_up.spec == P("tensor")
    assert layer.wo.spec == P(None, "tensor") and layer.w_down.spec == P(None, "tensor")  # row-parallel
    assert ps.embed.spec == P("tensor") and ps.lm_head is None  # tied: one vocab-parallel table
    assert layer.attn_norm.spec == P() and ps.final_norm.spec == P()
    untied = sharding.param_shardings(tp_config(tie_word_embeddings=False), mesh)
    assert untied.lm_head.spec == P("tensor")  # [vocab, embed] like the table
    cs = sharding.cache_shardings(tp_config(), mesh, "megatron", num_pages=8, page_size=4)
    assert [c.spec for c in cs.k + cs.v] == [P(None, None, "tensor")] * 4
    # Fewer KV heads than devices: the wk/wv weights and the cache are replicated.
    mesh8 = sharding.make_mesh(tensor=8)
    assert sharding.param_shardings(tp_config(), mesh8).layers[0].wk.spec == P()
    assert sharding.cache_shardings(tp_config(), mesh8, num_pages=8, page_size=4).k[0].spec == P()


def test_shardings_follow_the_table_not_the_code():
    mesh = sharding.make_mesh(tensor=2)
    ps = sharding.param_shardings(tp_config(), mesh, megatron_with(ffw=None, vocab=None))
    assert ps.layers[0].w_gate.spec == P() and ps.layers[0].w_down.spec == P() and ps.embed.spec == P()


def test_arrays_land_in_their_shards():
    cfg, mesh = tp_config(num_kv_heads=4, num_layers=1), sharding.make_mesh(tensor=4)
    rng = np.random.default_rng(0)
    host = jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(np.float32), abstract_params(cfg))
    params = jax.device_put(host, sharding.param_shardings(cfg, mesh))
    cache = init_cache(cfg, 8, 4, shardings=sharding.cache_shardings(cfg, mesh, num_pages=8, page_size=4))
    wq = params.layers[0].wq
    assert {s.data.shape for s in wq.addressable_shards} == {(2, 16, 64)}
    assert {s.data.shape for s in params.layers[0].w_down.addressable_shards} == {(64, 32)}
    assert {s.data.shape for s in cache.k[0].addressable_shards} == {(8, 4, 1, 16)}
    # Shards are pieces of one array: putting them back gives the full weight.
    np.testing.assert_array_equal(np.concatenate([np.asarray(s.data) for s in wq.addressable_shards], axis=0),
                                  np.asarray(wq))


def test_layout_is_hashable_and_absent_layout_adds_no_sharding_ops():
    mesh = sharding.make_mesh(tensor=2)
    assert hash(sharding.Layout.create(mesh)) == hash(sharding.Layout.create(mesh, "megatron"))
    cfg = tp_config(num_layers=1)
    params, cache = abstract_params(cfg), jax.tree.map(
        lambda i: jax.ShapeDtypeStruct(i.shape, i.dtype), KVCache.declare(cfg, 4, 4), is_leaf=is_array_info)

    tokens, md = pack_batch([([5, 6, 7], 0, [0])], page_size=4, num_pages=4, num_tokens=4, max_seqs=2,
                            pages_per_seq=2)
    plain = str(jax.make_jaxpr(lambda *a: forward(*a, cfg, "reference"))(params, cache, tokens, md))
    assert "sharding_constraint" not in plain and "shard_map" not in plain
    layout = sharding.Layout.create(mesh)
    tp = str(jax.make_jaxpr(lambda *a: forward(*a, cfg, "reference", layout))(params, cache, tokens, md))
    assert "sharding_constraint" in tp and "shard_map" in tp


def test_checkpoint_restores_straight_into_tp_shardings(tmp_path):
    from model.checkpoint import load_checkpoint, save_checkpoint

    cfg = tp_config(num_layers=1)
    rng = np.random.default_rng(1)
    host = jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(np.float32), abstract_params(cfg))
    save_checkpoint(str(tmp_path / "ckpt"), host, cfg)
    layout = sharding.Layout.create(sharding.make_mesh(tensor=4))
    _, params = load_checkpoint(str(tmp_path / "ckpt"), shardings=layout.param_shardings(cfg))
    assert params.layers[0].w_up.sharding.spec == P("tensor")
    assert {s.data.shape for s in params.layers[0].w_up.addressable_shards} == {(32, 64)}
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(host)):
        np.testing.assert_array_equal(np.asarray(a), b)
