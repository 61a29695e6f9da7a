"""The matmul of a group-quantized weight, dequantized inside the tile: the Pallas kernel and its reference.

A published quantized checkpoint's linear weight (`model.quant.GroupQuantizedArray`: block-scaled FP8,
or int4 from GPTQ / AWQ / compressed-tensors, its values held one per int8) is `data [N, K]` with one
fp32 scale per output row and per `group` consecutive input columns, `scale [N, G]`, G = ceil(K / group).
The product a linear layer needs is `x [M, K] @ (data * scale)^T`.

On XLA (the CPU path and the reference) the widened, scaled weight is an operand XLA builds inside the
jitted step (`grouped_matmul_reference`). On a GPU a decode step is bound by reading the weights, so the
point of the 1-byte form is that only those bytes cross HBM: the kernel loads each `[block_n, group]`
tile of `data` in its storage dtype, widens it and multiplies it by its one scale column in registers,
and feeds the tensor-core product in x's dtype, accumulating in fp32. The K loop steps one group at a
time (block_k = group), so a tile never straddles two scales; it is an `lax.fori_loop` of static length,
which Triton software-pipelines (`scf.for`).

The column tile is the largest power of two up to 128 that divides N (DeepSeek-V3's 576 rows: 64), so the
weight is not copied to pad it. Shapes no tile of 16 or more divides are padded by the wrapper (M to the
row tile; N and K to the tile and the group, with zeros, whose products add nothing): a copy of the
weight in every step, which published shapes (multiples of 64, whole groups) never pay.
Same contract as the reference; `interpret=True` runs the kernel body on CPU (the tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def grouped_matmul_reference(x, data, scale, group: int, out_dtype=None):
    """`x [M, K] @ (data [N, K] * scale [N, ceil(K / group)] over groups)^T` in `out_dtype` (default x's; fp32
    products)."""
    n, k = data.shape
    full = jnp.repeat(scale.astype(jnp.float32), group, axis=1, total_repeat_length=scale.shape[1] * group)[:, :k]
    w = data.astype(jnp.float32) * full
    return jnp.dot(x.astype(jnp.float32), w.T, precision=lax.Precision.HIGHEST).astype(out_dtype or x.dtype)


def _pow2_at_most(n: int, cap: int) -> int:
    p = 1
    while p * 2 <= min(n, cap):
        p *= 2
    return p


def _column_tile(n: int, cap: int = 128) -> int:
    """The largest power of two up to `cap` dividing `n` when it is 16 or more (no padding of the weight),
    else N's power of two up to `cap` (at least 16), which the wrapper pads to."""
    divisor = n & -n  # the largest power of two dividing n
    return min(divisor, cap) if divisor >= 16 else max(16, _pow2_at_most(n, cap))


def _kernel(x_ref, w_ref, s_ref, o_ref, *, group: int, num_groups: int, exact: bool):
    """One [block_m, block_n] output tile: the K loop a group at a time, each weight tile widened and scaled
    by its scale column before the product."""
    precision = lax.Precision.HIGHEST if exact else None

    def body(g, acc):
        cols = pl.ds(pl.multiple_of(g * group, group), group)
        x = x_ref[:, cols]  # [bm, group], the compute dtype
        w = w_ref[:, cols].astype(jnp.float32) * s_ref[:, pl.ds(g, 1)]  # [bn, group] scaled in fp32
        return acc + jnp.dot(x, w.astype(x.dtype).T, precision=precision, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, num_groups, body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("group", "out_dtype", "block_m", "block_n", "interpret", "num_warps",
                                             "num_stages"))
def grouped_matmul(x, data, scale, *, group: int, out_dtype=None, block_m: int | None = None,
                   block_n: int | None = None, interpret: bool = False, num_warps: int = 4, num_stages: int = 3):
    """`x [M, K] @ (data [N, K] * scale)^T` -> [M, N] in `out_dtype` (default x's; the fp32 accumulator
    as it is for float32, what an LM head asks for), by the Pallas kernel.

    `data`: fp8 e4m3 or int8 (int4 values); `scale`: fp32 `[N, ceil(K / group)]`; `group`: a power of two
    >= 16 (the tensor-core product's smallest K). Tiles (static): `block_m` rows of x (default: M's power
    of two up to 64, at least 16), `block_n` output columns (default `_column_tile`)."""
    m, k = x.shape
    n, k_w = data.shape
    if k_w != k or scale.shape != (n, -(-k // group)):
        raise ValueError(f"grouped_matmul: x {x.shape}, data {data.shape} and scale {scale.shape} do not agree "
                         f"(scale must be [N, ceil(K / {group})])")
    if group < 16 or group & (group - 1):
        raise ValueError(f"grouped_matmul: group must be a power of two >= 16, got {group}")
    bm = block_m or max(16, _pow2_at_most(m, 64))
    bn = block_n or _column_tile(n)
    num_groups = scale.shape[1]
    pad_m, pad_n, pad_k = -m % bm, -n % bn, num_groups * group - k
    if pad_m or pad_k:
        x = jnp.pad(x, ((0, pad_m), (0, pad_k)))
    if pad_n or pad_k:
        data = jnp.pad(data, ((0, pad_n), (0, pad_k)))
    if pad_n:
        scale = jnp.pad(scale, ((0, pad_n), (0, 0)))
    kernel = functools.partial(_kernel, group=group, num_groups=num_groups, exact=x.dtype == jnp.float32)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m + pad_m, n + pad_n), out_dtype or x.dtype),
        grid=((m + pad_m) // bm, (n + pad_n) // bn),
        in_specs=[pl.BlockSpec((bm, num_groups * group), lambda i, j: (i, 0)),
                  pl.BlockSpec((bn, num_groups * group), lambda i, j: (j, 0)),
                  pl.BlockSpec((bn, num_groups), lambda i, j: (j, 0))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="grouped_matmul",
    )(x, data, scale.astype(jnp.float32))
    return out[:m, :n]
