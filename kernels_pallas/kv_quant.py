"""The rounding step shared by every quantizer: fp32 -> int8 / fp8 (e4m3) with one scale per row.

It lives beside the kernels because the Pallas cache-write kernel runs
`quantize_kv` inside its body (plain jnp ops that Triton lowers), and the
reference write calls the same function, so both store identical bytes.
`model.quant` builds the weight quantizer on `to_storage` too. The reasons
for the formats and the per-token granularity are in `model.quant`.
"""

from __future__ import annotations

import jax.numpy as jnp

# The largest magnitude each storage dtype represents (a row's max maps here).
QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


def is_quantized_dtype(dtype) -> bool:
    return dtype is not None and jnp.dtype(dtype) in QMAX


def to_storage(x, dtype):
    """Already-scaled fp32 values (|x| <= qmax) to the storage dtype.

    int8 rounds to nearest (halves up) as floor(x + 0.5): the same two ops in
    XLA, Pallas interpret mode and Triton, so the reference and the kernels
    produce identical bytes. fp8 rounds to nearest even in the cast.
    """
    dtype = jnp.dtype(dtype)
    qmax = QMAX[dtype]
    x = jnp.clip(x, -qmax, qmax)
    if dtype == jnp.dtype(jnp.int8):
        return jnp.floor(x + 0.5).astype(jnp.int8)
    return x.astype(dtype)


def quantize_kv(rows, dtype):
    """Rows `[..., head_dim]` (any float) -> (data in `dtype`, fp32 scale `[...]`), one scale per row."""
    dtype = jnp.dtype(dtype)
    qmax = QMAX[dtype]
    r = rows.astype(jnp.float32)
    amax = jnp.max(jnp.abs(r), axis=-1)
    inv = jnp.where(amax > 0, qmax / jnp.where(amax > 0, amax, 1.0), 0.0)
    return to_storage(r * inv[..., None], dtype), amax * (1.0 / qmax)
