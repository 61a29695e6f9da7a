"""The group-quantized matmul (`kernels_pallas.grouped_matmul`): the Pallas kernel against its reference in
interpret mode, its lowering for cuda, and its compile to PTX for an H100 where the cuda12 plugin is installed.

Weights come from quantizing random normals in groups (`model.quant.quantize_grouped`): fp8 e4m3 as the
block-scaled checkpoints store them, int4 values held in int8 as GPTQ / AWQ / compressed-tensors' unpack
to. Shapes cover one row (a batch-1 decode), rows and columns no tile divides, a partial last group
(K not a multiple of the group) and DeepSeek-V3's 576-row projection.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from kernels_pallas.grouped_matmul import grouped_matmul, grouped_matmul_reference
from model.quant import GroupQuantizedArray, quantize_grouped

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def int4_grouped(w, group: int) -> GroupQuantizedArray:
    """`w` [N, K] as int4 values in [-8, 7] (held in int8) with one scale per row and group, the form a
    GPTQ / AWQ / compressed-tensors W4A16 checkpoint unpacks to."""
    n, k = w.shape
    groups = -(-k // group)
    padded = np.pad(w, ((0, 0), (0, groups * group - k))).reshape(n, groups, group)
    scale = np.maximum(np.abs(padded).max(axis=-1), 1e-6) / 7.0
    data = np.clip(np.round(padded / scale[..., None]), -8, 7).reshape(n, -1)[:, :k]
    return GroupQuantizedArray(jnp.asarray(data, jnp.int8), jnp.asarray(scale, jnp.float32), group)


CASES = [  # (rows M, outputs N, inputs K, group)
    (1, 128, 256, 128),  # a batch-1 decode
    (5, 96, 384, 128),  # rows and columns no tile divides
    (16, 576, 256, 128),  # DeepSeek-V3's kv_a_proj rows
    (33, 64, 200, 32),  # a partial last group
    (64, 256, 512, 64),
]


@pytest.mark.parametrize("kind", ["fp8", "int4"])
@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("m,n,k,group", CASES, ids=[f"{m}x{n}x{k}g{g}" for m, n, k, g in CASES])
def test_the_kernel_matches_the_reference(kind, x_dtype, m, n, k, group):
    rng = np.random.default_rng(m * 1000 + n + k)
    w = rng.standard_normal((n, k)).astype(np.float32)
    q = (quantize_grouped(jnp.asarray(w), jnp.float8_e4m3fn, 1, group) if kind == "fp8" else int4_grouped(w, group))
    x = jnp.asarray(rng.standard_normal((m, k)), x_dtype)
    want = grouped_matmul_reference(x, q.data, q.scale, group)
    got = grouped_matmul(x, q.data, q.scale, group=group, interpret=True)
    assert got.shape == (m, n) and got.dtype == x_dtype
    scale = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
    assert err <= TOL[x_dtype] * scale, (err, scale)
    # The reference is the product with the weight the form stands for (`model.quant.dequantize_grouped`).
    from model.quant import dequantize_grouped

    dense = np.asarray(x, np.float32) @ np.asarray(dequantize_grouped(q), np.float32).T
    assert np.allclose(np.asarray(want, np.float32), dense, rtol=TOL[x_dtype], atol=TOL[x_dtype] * scale)


def test_an_lm_head_gets_the_fp32_accumulator():
    """`out_dtype=float32` (what `linear`'s `preferred_element_type` asks for the LM head): bf16 inputs, the
    product returned in fp32 as accumulated."""
    rng = np.random.default_rng(7)
    q = quantize_grouped(jnp.asarray(rng.standard_normal((320, 256)), jnp.float32), jnp.float8_e4m3fn, 1, 128)
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.bfloat16)
    got = grouped_matmul(x, q.data, q.scale, group=128, out_dtype=jnp.float32, interpret=True)
    want = grouped_matmul_reference(x, q.data, q.scale, 128, out_dtype=jnp.float32)
    assert got.dtype == jnp.float32 and got.shape == (3, 320)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-2 * float(jnp.abs(want).max()))


def test_bad_shapes_and_groups_are_refused():
    x = jnp.zeros((4, 256), jnp.float32)
    data = jnp.zeros((64, 256), jnp.int8)
    with pytest.raises(ValueError, match="scale must be"):
        grouped_matmul(x, data, jnp.ones((64, 3), jnp.float32), group=128)
    with pytest.raises(ValueError, match="power of two >= 16"):
        grouped_matmul(x, data, jnp.ones((64, 32), jnp.float32), group=8)


# --- for the GPU, on this CPU machine (tests/test_kernels_lowering.py, serving.aot) ---

@pytest.mark.parametrize("storage", [jnp.float8_e4m3fn, jnp.int8], ids=["fp8", "int4-in-int8"])
def test_the_kernel_lowers_for_cuda_reading_the_weight_in_its_storage_dtype(storage):
    """Llama-3-8B's MLP up projection at a 64-row decode: one Triton kernel, one tensor-core product in a
    software-pipelined K loop, and the weight loaded as 1-byte values (its HBM traffic is the quantized
    form's), widened in registers."""
    from test_kernels_lowering import lower_for_cuda, op_counts

    sds = jax.ShapeDtypeStruct
    _, kernels = lower_for_cuda(lambda x, d, s: grouped_matmul(x, d, s, group=128), sds((64, 4096), jnp.bfloat16),
                                sds((14336, 4096), storage), sds((14336, 32), jnp.float32))
    assert len(kernels) == 1
    counts = op_counts(kernels[0])
    assert counts["tt.dot"] == 1 and counts["scf.for"] == 1 and counts["tt.load"] >= 3
    loaded = "f8E4M3FN" if storage == jnp.float8_e4m3fn else "i8"
    assert f"tensor<128x128x{loaded}>" in kernels[0]  # a [block_n, group] weight tile, 1 byte per value


def test_the_kernel_compiles_to_ptx_for_one_h100_without_spills():
    pytest.importorskip("jax_plugins.xla_cuda12", reason="compiling for a GPU needs the cuda12 extra: "
                        "pip install -e '.[cuda12]'")
    from serving import aot
    from serving.gpu_targets import get_target

    if aot.ptxas_path() is None:
        pytest.skip("ptxas not found (the nvidia-cuda-nvcc-cu12 wheel of the cuda12 extra)")
    target = get_target("h100-sxm")
    mesh = aot.gpu_mesh(target, 1, 1)
    on = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    args = [jax.ShapeDtypeStruct(s, d, sharding=on)
            for s, d in (((64, 4096), jnp.bfloat16), ((14336, 4096), jnp.float8_e4m3fn), ((14336, 32), jnp.float32))]
    entry, _ = aot.compile_program("grouped_matmul", jax.jit(lambda x, d, s: grouped_matmul(x, d, s, group=128)),
                                   args, {}, target)
    assert "error" not in entry, entry.get("error")
    kernels = [k for k in entry["kernels"] if "grouped_matmul" in k["name"]]
    assert kernels and all(k["registers"] and k["spill_bytes"] == 0 for k in kernels), kernels


@pytest.mark.parametrize("weight_dtype", ["fp8_g32", "int4_g32"])
def test_the_pallas_backend_runs_the_models_grouped_products_in_the_kernel(weight_dtype):
    """A model with a published checkpoint's grouped weights, one step through the Pallas backend (interpreted)
    and through the reference: the same logits, and the Pallas program holds the grouped kernel for its
    projections while the reference's holds none."""
    import functools

    from conftest import tiny_config
    from model.cache import KVCache, pack_batch
    from model.forward import forward
    from model.params import init_params

    cfg = tiny_config(weight_dtype=weight_dtype, num_layers=1)
    params = init_params(cfg, jax.random.key(5))
    assert isinstance(params.layers[0].wq, GroupQuantizedArray)
    rng = np.random.RandomState(3)
    pages, ps, per_seq = 16, 8, 4
    shape = (pages, ps, cfg.num_kv_heads, cfg.head_dim)
    cache = KVCache(k=[jnp.asarray(rng.standard_normal(shape), jnp.float32)],
                    v=[jnp.asarray(rng.standard_normal(shape), jnp.float32)])
    tables = [list(rng.permutation(pages)[i * per_seq:(i + 1) * per_seq]) for i in range(2)]
    pack = functools.partial(pack_batch, page_size=ps, num_pages=pages, num_tokens=16, max_seqs=2,
                             pages_per_seq=per_seq, all_logits=True, logits_rows=16)
    tokens, md = pack([(list(rng.randint(0, cfg.vocab_size, 1)), 11, tables[0]),
                       (list(rng.randint(0, cfg.vocab_size, 9)), 3, tables[1])])
    run = jax.jit(lambda p, c, t, m, backend: forward(p, c, t, m, cfg, backend), static_argnames="backend")
    got, _ = run(params, cache, tokens, md, backend="pallas_interpret")
    want, _ = run(params, cache, tokens, md, backend="reference")
    got, want = np.asarray(got)[:10], np.asarray(want)[:10]
    assert np.abs(want).max() > 1e-3
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    text = run.lower(params, cache, tokens, md, backend="pallas_interpret").as_text()
    assert "grouped_matmul" in text
    assert "grouped_matmul" not in run.lower(params, cache, tokens, md, backend="reference").as_text()
