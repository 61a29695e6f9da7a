"""The `dtype` option: which float dtype a served model computes in, and the cast into it at load."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from conftest import tiny_config
from model.params import Weights, flatten_params, is_array_info
from model.quantize import quantize_params
from serving.core import compute_dtype
from serving.core.engine import Engine, EngineConfig

BF16 = tiny_config(dtype="bfloat16", vocab_size=96)


def random_params(cfg, seed=0):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda i: jnp.asarray(rng.standard_normal(i.shape, np.float32).astype(i.dtype)),
                        Weights.declare(cfg), is_leaf=is_array_info)


@pytest.mark.parametrize("choice, model, platform, expected", [
    ("auto", "bfloat16", "cpu", "float32"),  # XLA CPU's 16-bit matmuls are the slow path
    ("auto", "float16", "cpu", "float32"),
    ("auto", "float32", "cpu", "float32"),
    ("auto", "bfloat16", "gpu", "bfloat16"),  # GPUs compute in the checkpoint's dtype
    ("auto", "float16", "cuda", "float16"),
    ("bfloat16", "bfloat16", "cpu", "bfloat16"),  # asked for: kept, even where it is slow
    ("float32", "bfloat16", "gpu", "float32"),
    ("float16", "float32", "cpu", "float16"),
])
def test_resolve(choice, model, platform, expected):
    assert compute_dtype.resolve(choice, model, platform) == expected


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="dtype must be one of"):
        compute_dtype.resolve("fp64", "float32", "cpu")


def test_cast_is_exact_and_keeps_everything_else():
    params = random_params(BF16)
    cfg, cast = compute_dtype.apply(BF16, params, "auto", platform="cpu")
    assert cfg == BF16.replace(dtype="float32")
    before, after = flatten_params(params), flatten_params(cast)
    assert before.keys() == after.keys()
    for name, array in after.items():
        assert array.dtype == jnp.float32, name
        np.testing.assert_array_equal(np.asarray(array), np.asarray(before[name]).astype(np.float32))
    # Nothing to do: the very same objects come back.
    assert compute_dtype.apply(BF16, params, "auto", platform="gpu") == (BF16, params)
    assert compute_dtype.apply(cfg, cast, "float32", platform="cpu") == (cfg, cast)


def test_quantized_weights_keep_their_data_and_scales():
    params = random_params(BF16)
    qcfg, qparams = quantize_params(params, BF16, "int8")
    cfg, cast = compute_dtype.apply(qcfg, qparams, "float32", platform="cpu")
    before, after = flatten_params(qparams), flatten_params(cast)
    changed = {k for k in after if after[k].dtype != before[k].dtype}
    assert changed and all(after[k].dtype == jnp.float32 and before[k].dtype == jnp.bfloat16 for k in changed)
    assert any(v.dtype == jnp.int8 for v in after.values())  # quantized data untouched
    for k in after.keys() - changed:
        np.testing.assert_array_equal(np.asarray(after[k]), np.asarray(before[k]))


def test_sharded_weights_stay_sharded():
    mesh = Mesh(np.array(jax.devices()[:2]), ("t",))
    rules = {"q_heads": "t", "kv_heads": "t", "ffw": "t", "vocab": "t"}
    shardings = jax.tree.map(lambda i: NamedSharding(mesh, P(*(rules.get(a) for a in i.logical_axes))),
                             Weights.declare(BF16), is_leaf=is_array_info)
    params = jax.tree.map(jax.device_put, random_params(BF16), shardings)
    _, cast = compute_dtype.apply(BF16, params, "float32", platform="cpu")
    for (name, before), after in zip(flatten_params(params).items(), flatten_params(cast).values()):
        assert after.sharding == before.sharding, name
        assert after.dtype == jnp.float32


def test_engine_computes_in_the_resolved_dtype():
    """The engine applies the option before it sizes and builds anything: config, weights and KV pool."""
    params = random_params(BF16)
    small = dict(num_pages=8, max_num_seqs=2, max_num_batched_tokens=16)
    on_cpu = Engine(BF16, params, config=EngineConfig(**small))
    assert on_cpu.cfg.dtype == "float32" and on_cpu.cache_dtype == jnp.float32
    assert {a.dtype for a in jax.tree.leaves(on_cpu.runner.params)} == {jnp.dtype(jnp.float32)}
    kept = Engine(BF16, params, config=EngineConfig(dtype="bfloat16", **small))
    assert kept.cfg.dtype == "bfloat16" and kept.cache_dtype == jnp.bfloat16
