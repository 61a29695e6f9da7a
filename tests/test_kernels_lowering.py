"""The Pallas kernels lower for the `cuda` platform, checked on a CPU-only machine.

`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))` runs the whole
Pallas -> Triton lowering. It targets an abstract H200 (compute capability
9.0): jax 0.10 falls back to 9.0 without a GPU anyway, while jax 0.11 asks the
abstract mesh's device for the GPU kind and refuses to lower without one.
On top of that we parse the Triton module carried by the custom call, run the
MLIR verifier on it and check its shape: two `tt.dot`s (Q K^T and P V), the
KV loop as an `scf.for` (Triton only software-pipelines `scf.for`, a
`scf.while` would serialise loads and math), IEEE fp32 dots for fp32 inputs
(not tf32), and the write kernel aliased onto the donated cache. What is not
checked here: Triton's own passes and PTX generation, which run inside XLA on
the GPU.
"""

from __future__ import annotations

import collections
import re

import pytest

import jax
import jax.numpy as jnp
from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib.mlir import ir
from jax._src.lib.triton import dialect as tt_dialect

from kernels_pallas.kv_cache_write import write_kv
from kernels_pallas.ragged_paged_attention import ragged_paged_attention

from jax.experimental.pallas import triton as pltriton

TRITON_TARGET = getattr(pltriton, "CUSTOM_CALL_TARGET_NAME", "__gpu$xla.gpu.triton")
H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=None)
sds = jax.ShapeDtypeStruct


def _custom_calls(op, found):
    op = getattr(op, "operation", op)
    if op.name == "stablehlo.custom_call":
        found.append(op)
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                _custom_calls(inner, found)
    return found


def lower_for_cuda(fn, *args, donate_argnums=()):
    """Lowers `fn` for cuda; returns (stablehlo text, [verified Triton module text per kernel])."""
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=H200)):
        traced = jax.jit(fn, donate_argnums=donate_argnums).trace(*args)
        lowered = traced.lower(lowering_platforms=("cuda",))
    kernels = []
    for op in _custom_calls(lowered.compiler_ir("stablehlo").operation, []):
        if ir.StringAttr(op.attributes["call_target_name"]).value != TRITON_TARGET:
            continue
        config = ir.DictAttr(op.attributes["mhlo.backend_config"])
        ctx = jax_mlir.JaxIrContext()
        tt_dialect.register_dialect(ctx)
        with ctx:
            module = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes)
            assert module.operation.verify()
            kernels.append(str(module))
    return lowered.as_text(), kernels


def op_counts(module_text):
    return collections.Counter(re.findall(r"\b((?:tt|scf)\.\w+)", module_text))


def attention_args(dtype, *, tokens, seqs, q_heads, kv_heads, head_dim, page_size, num_pages=64, pages_per_seq=8):
    return (sds((tokens, q_heads, head_dim), dtype), sds((num_pages, page_size, kv_heads, head_dim), dtype),
            sds((num_pages, page_size, kv_heads, head_dim), dtype), sds((seqs,), jnp.int32),
            sds((seqs, pages_per_seq), jnp.int32), sds((seqs + 1,), jnp.int32), sds((), jnp.int32))


ATTENTION_CASES = [
    # Llama-3-8B heads, decode bucket (tokens == seqs): 16-row tiles, default split heuristic.
    pytest.param(jnp.bfloat16, dict(tokens=64, seqs=64, q_heads=32, kv_heads=8, head_dim=128, page_size=16),
                 dict(), id="bf16-llama8b-decode"),  # 64 items x 8 heads: no split
    # Mixed bucket: 64-row tiles.
    pytest.param(jnp.bfloat16, dict(tokens=256, seqs=16, q_heads=32, kv_heads=8, head_dim=128, page_size=16),
                 dict(num_kv_splits=1), id="bf16-llama8b-mixed"),
    pytest.param(jnp.bfloat16, dict(tokens=8, seqs=8, q_heads=8, kv_heads=1, head_dim=64, page_size=64),
                 dict(num_kv_splits=4), id="bf16-g8-ps64-split4"),
    pytest.param(jnp.float32, dict(tokens=32, seqs=4, q_heads=24, kv_heads=8, head_dim=64, page_size=8),
                 dict(num_kv_splits=2), id="f32-g3pad-ps8-split2"),
]


@pytest.mark.parametrize("dtype,shape,kwargs", ATTENTION_CASES)
def test_attention_lowers_for_cuda(dtype, shape, kwargs):
    args = attention_args(dtype, **shape)
    hlo, kernels = lower_for_cuda(lambda *a: ragged_paged_attention(*a, **kwargs), *args)
    assert len(kernels) == 1, hlo
    counts = op_counts(kernels[0])
    assert counts["tt.dot"] == 2
    assert counts["scf.for"] == 1 and counts["scf.while"] == 0
    # One masked store of the output rows; with KV splits also the log-sum-exp.
    assert counts["tt.store"] == (2 if kwargs.get("num_kv_splits", 1) > 1 else 1)
    if dtype == jnp.float32:
        assert "inputPrecision = tf32" not in kernels[0]
    # Page gathers are pointer loads, not whole-array copies: K, V, q and the block table.
    assert counts["tt.load"] >= 4


def test_attention_split_default_for_small_decode_batches():
    # One decode sequence with 8 KV heads cannot fill a GPU without splitting its context.
    args = attention_args(jnp.bfloat16, tokens=1, seqs=1, q_heads=32, kv_heads=8, head_dim=128, page_size=16,
                          pages_per_seq=2048)
    _, kernels = lower_for_cuda(ragged_paged_attention, *args)
    assert op_counts(kernels[0])["tt.store"] == 2  # partial output and log-sum-exp


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_write_kv_lowers_for_cuda_in_place(dtype):
    pages = sds((64, 16, 8, 128), dtype)
    new = sds((48, 8, 128), dtype)
    hlo, kernels = lower_for_cuda(write_kv, pages, pages, new, new, sds((48,), jnp.int32), donate_argnums=(0, 1))
    assert len(kernels) == 1
    assert op_counts(kernels[0])["tt.store"] == 2
    assert "output_operand_aliases" in hlo and hlo.count("tf.aliasing_output") == 2


def test_model_forward_lowers_for_cuda_with_pallas_backend():
    from conftest import tiny_config
    from model.cache import BatchMetadata, KVCache
    from model.forward import forward
    from model.params import Weights, is_array_info

    cfg = tiny_config(dtype="bfloat16")
    to_sds = lambda tree: jax.tree.map(lambda i: sds(i.shape, i.dtype), tree, is_leaf=is_array_info)
    params = to_sds(Weights.declare(cfg))
    cache = to_sds(KVCache.declare(cfg, num_pages=32, page_size=16))

    t, s = 16, 4
    md = BatchMetadata(positions=sds((t,), jnp.int32), slot_mapping=sds((t,), jnp.int32),
                       cu_q_lens=sds((s + 1,), jnp.int32), kv_lens=sds((s,), jnp.int32),
                       block_tables=sds((s, 8), jnp.int32), num_seqs=sds((), jnp.int32),
                       logits_indices=sds((s,), jnp.int32))
    fn = lambda p, c, tok, m: forward(p, c, tok, m, cfg, backend="pallas")
    _, kernels = lower_for_cuda(fn, params, cache, sds((t,), jnp.int32), md, donate_argnums=(1,))
    # Both kernels are in the program (jit deduplicates identical per-layer calls).
    names = sorted(re.match(r"module @(\w+)", k).group(1) for k in kernels)
    assert names == ["kv_cache_write", "ragged_paged_attention"]
