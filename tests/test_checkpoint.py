"""orbax checkpoints: save sharded over 8 devices, restore into another sharding on 2, dtype casts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from conftest import tiny_config
from model.checkpoint import PARAMS_DIR, load_checkpoint, load_config, save_checkpoint
from model.params import Weights, flatten_params, is_array_info

CFG = tiny_config(vocab_size=96, hidden_size=64, intermediate_size=128, num_heads=8, num_kv_heads=4, head_dim=8,
                  tie_word_embeddings=False)

# Logical axis -> mesh axis. Save: embed over "x" (2), heads / ffw / vocab over "y" (4).
SAVE_RULES = {"embed": "x", "q_heads": "y", "kv_heads": "y", "ffw": "y", "vocab": "y"}
# Restore: a 1-D mesh of 2 devices, splitting different dimensions (head_dim, ffw, vocab, norms).
RESTORE_RULES = {"head_dim": "t", "ffw": "t", "vocab": "t", "norm": "t"}


def random_params(cfg, seed, shardings=None):
    """Random weights placed straight into `shardings` (numpy-generated: no per-shape compiles)."""
    rng = np.random.default_rng(seed)
    decl = Weights.declare(cfg)
    arrays = jax.tree.map(lambda i: rng.standard_normal(i.shape, np.float32).astype(i.dtype), decl,
                          is_leaf=is_array_info)
    if shardings is None:
        return jax.tree.map(jnp.asarray, arrays)
    return jax.tree.map(jax.device_put, arrays, shardings)


def shardings(cfg, mesh, rules):
    return jax.tree.map(lambda info: NamedSharding(mesh, P(*(rules.get(a) for a in info.logical_axes))),
                        Weights.declare(cfg), is_leaf=is_array_info)


@pytest.fixture(scope="module")
def meshes():
    devices = jax.devices()
    assert len(devices) >= 8, "conftest should provide 8 CPU devices"
    save_mesh = Mesh(np.array(devices[:8]).reshape(2, 4), ("x", "y"))
    restore_mesh = Mesh(np.array([devices[5], devices[2]]), ("t",))  # a device subset, in another order
    return save_mesh, restore_mesh


@pytest.fixture(scope="module")
def saved(meshes, tmp_path_factory):
    save_mesh, _ = meshes
    params = random_params(CFG, 3, shardings(CFG, save_mesh, SAVE_RULES))
    wq = params.layers[0].wq
    assert len(wq.sharding.device_set) == 8 and wq.addressable_shards[0].data.shape == (2, 8, 32)
    directory = str(tmp_path_factory.mktemp("ckpt"))
    save_checkpoint(directory, params, CFG)
    host = {k: np.asarray(v) for k, v in flatten_params(params).items()}
    return directory, host


def test_restore_on_two_devices_with_another_sharding(saved, meshes):
    directory, expected = saved
    _, restore_mesh = meshes
    target = shardings(CFG, restore_mesh, RESTORE_RULES)
    cfg, params = load_checkpoint(directory, shardings=target)
    assert cfg == CFG
    got, wanted = flatten_params(params), flatten_params(target)
    assert set(got) == set(expected)
    restore_devices = set(restore_mesh.devices.flat)
    for name, array in got.items():
        assert array.sharding == wanted[name], name
        assert array.sharding.device_set == restore_devices, name
        assert array.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(array), expected[name], err_msg=name)
    # The split really is the requested one: wq [heads, head_dim, embed] halves head_dim on each device.
    wq = params.layers[1].wq
    assert {s.data.shape for s in wq.addressable_shards} == {(8, 4, 64)}
    assert {s.data.shape for s in params.embed.addressable_shards} == {(48, 64)}


def test_restore_without_shardings(saved):
    directory, expected = saved
    _, params = load_checkpoint(directory)
    for name, array in flatten_params(params).items():
        assert array.sharding.device_set == {jax.devices()[0]}
        np.testing.assert_array_equal(np.asarray(array), expected[name], err_msg=name)


def test_restore_casts_to_config_dtype_keeping_sharding(saved, meshes):
    directory, expected = saved
    _, restore_mesh = meshes
    target = shardings(CFG, restore_mesh, RESTORE_RULES)
    _, params = load_checkpoint(directory, shardings=target, cfg=CFG.replace(dtype="bfloat16"))
    w = params.layers[0].w_gate
    assert w.dtype == jnp.bfloat16
    assert w.sharding == target.layers[0].w_gate
    np.testing.assert_array_equal(np.asarray(w), expected["layers.0.w_gate"].astype(jnp.bfloat16))


def test_bf16_storage_restored_as_fp32(meshes, tmp_path):
    save_mesh, restore_mesh = meshes
    params = random_params(CFG, 4, shardings(CFG, save_mesh, SAVE_RULES))
    save_checkpoint(str(tmp_path), params, CFG, storage_dtype=jnp.bfloat16)
    with ocp.StandardCheckpointer() as ckptr:
        meta = ckptr.metadata(str(tmp_path / PARAMS_DIR))
    meta = getattr(meta, "item_metadata", meta)
    meta = getattr(meta, "tree", meta)
    assert {m.dtype for m in meta.values()} == {jnp.dtype(jnp.bfloat16)}
    assert load_config(str(tmp_path)).dtype == "float32"

    target = shardings(CFG, restore_mesh, RESTORE_RULES)
    _, restored = load_checkpoint(str(tmp_path), shardings=target)
    for name, array in flatten_params(restored).items():
        original = np.asarray(flatten_params(params)[name])
        assert array.dtype == jnp.float32, name
        assert array.sharding == flatten_params(target)[name], name
        np.testing.assert_array_equal(np.asarray(array), original.astype(jnp.bfloat16).astype(np.float32))
    w = np.asarray(restored.layers[0].wq)
    assert not np.array_equal(w, np.asarray(params.layers[0].wq))  # bf16 rounding really happened


def test_tied_model_round_trip(tmp_path):
    cfg = tiny_config(tie_word_embeddings=True)
    params = random_params(cfg, 5)
    save_checkpoint(str(tmp_path), params, cfg)
    restored_cfg, restored = load_checkpoint(str(tmp_path))
    assert restored_cfg.tie_word_embeddings and restored.lm_head is None
    np.testing.assert_array_equal(np.asarray(restored.embed), np.asarray(params.embed))


def test_mismatched_config_is_a_clear_error(saved):
    directory, _ = saved
    with pytest.raises(ValueError, match=r"layers.0.w_gate: stored \(128, 64\), config expects \(256, 64\)"):
        load_checkpoint(directory, cfg=CFG.replace(intermediate_size=256))
    with pytest.raises(ValueError, match=r"missing weights \['layers.2"):
        load_checkpoint(directory, cfg=CFG.replace(num_layers=3))
    with pytest.raises(ValueError, match=r"does not declare \['lm_head'\]"):
        load_checkpoint(directory, cfg=CFG.replace(tie_word_embeddings=True))


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="model_config.json is missing"):
        load_checkpoint(str(tmp_path))
