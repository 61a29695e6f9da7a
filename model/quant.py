"""Weight-only and KV-cache quantization: int8 and fp8 (e4m3) with scales.

Decode is memory-bound: every step streams all weights plus every live
sequence's cached K/V. Storing them in one byte instead of two halves what a
step reads (and doubles the tokens a KV pool holds). Compute stays in the
model's dtype: values are widened on the fly, so nothing here needs int8 or
fp8 matmul units.

Weights (`quantize`, `model.linear.linear`)
-------------------------------------------
A matrix becomes a `QuantizedArray(data, scale)`: `data` in int8 or
float8_e4m3fn with the weight's shape, `scale` fp32 with the weight's *output*
dimensions only, which lead (weights are [out..., in...], `model.params`): one
scale per output channel, i.e. per (head, head_dim) row of wq/wk/wv, per embed
row of wo, per ffw row of w_gate/w_up, per vocab row of lm_head. The output
channel is the right granularity because the scale then factors out of the
contraction:

    einsum(x, data * scale) == einsum(x, data) * scale

so `model.linear.linear` casts `data` to the activation dtype (exact: int8 and e4m3 values
are all representable in bf16), runs the same einsum as the float model and
multiplies its *output* by the scale: no dequantized copy of the weight, and
on GPU XLA fuses the widening convert into the matmul's operand load, so the
matmul reads one byte per weight. Per-output-channel also fits sharding: the
scale carries the output dimensions' logical axes, so the same rule table
splits it exactly as it splits the data's output rows (`model.params` declares
both).

int8 is symmetric (`scale = max|w| / 127`, round to nearest, no zero point:
Llama weights are centred on zero). fp8 e4m3 scales the channel's max to 448
(its largest finite value) and rounds to nearest even; it keeps ~2 significant
decimal digits at every magnitude, where int8 loses relative precision on
small weights but is exact in absolute steps. Which one wins on quality is
measured, not assumed (`benchmarks/quant_quality.py`, docs/quantization.md).

Only the linear layers (attention and MLP projections, and an untied lm_head)
are quantized. The embedding table stays in the model dtype: a step gathers
a handful of its rows, so quantizing it saves memory but not bandwidth, and a
tied table is then also the exact output projection. Norms stay as they are.

KV cache (`kernels_pallas.kv_quant.quantize_kv`)
------------------------------------------------
Pages hold int8 or fp8 K/V plus one fp32 scale per (token, KV head) in a
`[pages, page_size, kv_heads]` array beside each page array. Per token rather
than per page because a page fills one decode token at a time: a per-page
scale is fixed by the tokens written first, so a later token with a larger
magnitude is clipped unless the whole page is re-read and rescaled on every
write (and a copy-on-write or prefix-cached page would have to carry its
scale history). Per-token scales make every write independent, exact to its
own range, and keep copy-on-write a plain page copy. The price is 4 bytes per
token per head, 3% of an int8 row at head_dim 128 (6% at 64). The benchmark
also measures the error an (ideal, offline) per-page scale would give on the
embedded model's real K/V, which is the lower bound of what per-page could do.

Whole models
------------
This module is a leaf the families build on. What needs a config's family (its declarations)
sits above the registry: `model.quantize.quantize_params` (float weights -> the quantized
weights a config declares) and `model.families.kv_bytes_per_token` (a KV pool's bytes per token,
scales included).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.kv_quant import QMAX, is_quantized_dtype, quantize_kv, to_storage  # noqa: F401

# Names accepted for weight and KV quantization, and their storage dtypes.
QUANT_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
SCALE_DTYPE = jnp.float32
SCALE_BYTES = 4

WEIGHT_DTYPE_CHOICES = ("auto", "int8", "fp8")
# Weight kinds a published quantized checkpoint loads as (`model.quant_formats`): "<storage>_g<group>",
# data in the storage dtype with one scale per output row and per `group` consecutive input columns.
# "int4_g<group>": GPTQ / AWQ 4-bit codes less their zero point (`model.quant_gptq`), held one per int8
# byte (XLA CPU refuses committed jnp.int4 arguments to compiled programs: their layout is not the packed one).
GROUPED_STORAGE = {"fp8": jnp.float8_e4m3fn, "int4": jnp.int8}
_GROUPED = re.compile(r"(fp8|int4)_g([1-9][0-9]*)")
KV_CACHE_DTYPE_CHOICES = ("auto", "int8", "fp8", "bfloat16", "float16", "float32")


class _ShapedByData:
    """An array stand-in whose shape and dtype are its `data`'s (so code that reads a weight's shape works
    on quantized weights unchanged)."""

    @property
    def shape(self):
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def ndim(self) -> int:
        return len(self.data.shape)


@dataclasses.dataclass(frozen=True)
class QuantizedArray(_ShapedByData):
    """A quantized tensor: `data` (int8 / fp8) and `scale` (fp32) over its leading dims.

    For a weight ([out..., in...]), `scale` has the weight's output dims
    (`data.shape[:scale.ndim]`); for a KV page array, every dim but head_dim
    (`data.shape[:-1]`). Either field may also hold an `ArrayInfo` or
    `ShapeDtypeStruct` (declarations, abstract trees).
    """

    data: Any
    scale: Any


jax.tree_util.register_dataclass(QuantizedArray, data_fields=["data", "scale"], meta_fields=[])


def is_quantized(x) -> bool:
    return isinstance(x, (QuantizedArray, GroupQuantizedArray))


def storage_dtype(name: str):
    """The jnp dtype of a quantization name ("int8" or "fp8")."""
    if name not in QUANT_DTYPES:
        raise ValueError(f"quantized dtype must be one of {sorted(QUANT_DTYPES)}, got {name!r}")
    return QUANT_DTYPES[name]


def quantize(w: jax.Array, name_or_dtype, num_out_dims: int) -> QuantizedArray:
    """Per-output-channel quantization of a weight whose first `num_out_dims` dims are its
    outputs (the trailing, contracted input dims share each channel's scale).

    Error bound (per element, `s` = its channel's scale): int8 |w - dq| <= s / 2;
    fp8 e4m3 |w - dq| <= max(|w| / 16, s / 1024) (3 mantissa bits; subnormals
    below 2**-6 * s have absolute steps of 2**-9 * s).
    """
    dtype = jnp.dtype(storage_dtype(name_or_dtype) if isinstance(name_or_dtype, str) else name_or_dtype)
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=tuple(range(num_out_dims, w.ndim)), keepdims=True)  # [out..., 1...]
    inv = jnp.where(amax > 0, QMAX[dtype] / jnp.where(amax > 0, amax, 1.0), 0.0)
    scale = (amax / QMAX[dtype]).reshape(w.shape[:num_out_dims])
    return QuantizedArray(to_storage(w32 * inv, dtype), scale.astype(SCALE_DTYPE))


def dequantize(q: QuantizedArray, dtype=jnp.float32) -> jax.Array:
    """The weight the quantized form stands for (tests, conversions; `model.linear` never builds it)."""
    data = q.data.astype(jnp.float32)
    scale = q.scale.astype(jnp.float32)
    scale = scale.reshape(scale.shape + (1,) * (data.ndim - scale.ndim))  # leading dims: pad on the right
    return (data * scale).astype(dtype)


# --------------------------------------------------------------------------- grouped weights

@dataclasses.dataclass(frozen=True)
class GroupQuantizedArray(_ShapedByData):
    """A weight quantized in groups along its input: `data` (fp8 e4m3) with the weight's shape
    [out..., in...], `scale` fp32 `[out..., G]`: one scale per output row and per `group` consecutive
    entries of the flattened input dims (G = ceil(in / group); the last group may be partial).

    This is the form of the published block-scaled FP8 checkpoints (`model.quant_formats`): a
    [128, 128] block's scale is repeated over the block's 128 rows, which costs 4 bytes per 128
    weights (3% of the fp8 data) and makes every output row independent, so the rows shard, reshape
    (`reshape`: the heads of wq split or merged) and slice like the data's. `model.linear.linear`
    widens `data` and applies the scales on the fly (`dequantize_grouped` inside the jitted step),
    so the host never holds a 16-bit copy."""

    data: Any
    scale: Any
    group: int = 128

    def reshape(self, *shape) -> "GroupQuantizedArray":
        """The same weight under another [out..., in...] split of its dims (the products of the output
        and of the input dims unchanged): the scale's output dims follow the data's."""
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)
        out = math.prod(self.scale.shape[:-1])
        k = next((k for k in range(len(shape) + 1) if math.prod(shape[:k]) == out), None)
        if k is None or math.prod(shape) != math.prod(self.data.shape):
            raise ValueError(f"cannot reshape a grouped weight {self.data.shape} to {shape}")
        return GroupQuantizedArray(self.data.reshape(shape), self.scale.reshape(shape[:k] + self.scale.shape[-1:]),
                                   self.group)


jax.tree_util.register_dataclass(GroupQuantizedArray, data_fields=["data", "scale"], meta_fields=["group"])


def grouped_kind(name) -> tuple[Any, int] | None:
    """(storage dtype, group) of a grouped weight kind ("fp8_g128"), None for any other name."""
    m = _GROUPED.fullmatch(name) if isinstance(name, str) else None
    return None if m is None else (GROUPED_STORAGE[m.group(1)], int(m.group(2)))


def _group_scales_full(scale, group: int, width: int):
    """[out..., G] scales -> [out..., width]: each scale over its group's columns."""
    return jnp.repeat(scale, group, axis=-1, total_repeat_length=scale.shape[-1] * group)[..., :width]


def quantize_grouped(w, dtype, num_out_dims: int, group: int) -> GroupQuantizedArray:
    """`w` ([out..., in...], its first `num_out_dims` dims the outputs) in groups of `group` input columns,
    each group's max scaled to the storage dtype's largest value (random weights, float checkpoint
    tensors a quantized one leaves unquantized)."""
    dtype = jnp.dtype(dtype)
    out_shape = w.shape[:num_out_dims]
    w2 = jnp.asarray(w, jnp.float32).reshape(out_shape + (-1,))
    width = w2.shape[-1]
    groups = -(-width // group)
    padded = jnp.pad(w2, [(0, 0)] * num_out_dims + [(0, groups * group - width)])
    amax = jnp.max(jnp.abs(padded.reshape(out_shape + (groups, group))), axis=-1)
    scale = amax / QMAX[dtype]
    inv = jnp.where(amax > 0, 1.0 / jnp.where(amax > 0, scale, 1.0), 0.0)
    data = to_storage(w2 * _group_scales_full(inv, group, width), dtype)
    return GroupQuantizedArray(data.reshape(w.shape), scale.astype(SCALE_DTYPE), group)


def dequantize_grouped(q: GroupQuantizedArray, dtype=jnp.float32) -> jax.Array:
    """The weight a grouped form stands for, computed in `dtype` (jnp: the reference, and what the
    jitted `model.linear.linear` runs, XLA fusing it into the matmul's operand)."""
    out_shape = q.scale.shape[:-1]
    data = q.data.astype(dtype).reshape(out_shape + (-1,))
    full = _group_scales_full(q.scale.astype(dtype), q.group, data.shape[-1])
    return (data * full).reshape(q.data.shape)


# --------------------------------------------------------------------------- KV cache

def kv_cache_dtype(cfg, name: str | None):
    """The storage dtype of the KV pages for an engine's `kv_cache_dtype` ("auto": the model's)."""
    if name in (None, "auto"):
        return cfg.jnp_dtype
    if name in QUANT_DTYPES:
        return QUANT_DTYPES[name]
    if name in ("bfloat16", "float16", "float32"):
        return jnp.dtype(name)
    raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPE_CHOICES)}, got {name!r}")


def _check_choice(option: str, name, choices) -> str:
    """`name` if it is one of `choices` ("auto" for None); otherwise an error naming `option`."""
    if name is None:
        return "auto"
    if name not in choices:
        raise ValueError(f"{option} must be one of {list(choices)}, got {name!r}")
    return name


def check_weight_dtype(name) -> str:
    if grouped_kind(name) is not None:  # a published checkpoint's kind (`model.quant_formats`)
        return name
    return _check_choice("weight_dtype", name, WEIGHT_DTYPE_CHOICES)


def check_kv_cache_dtype(name) -> str:
    return _check_choice("kv_cache_dtype", name, KV_CACHE_DTYPE_CHOICES)


def streamed_weight_bytes(params, cfg) -> int:
    """Bytes a forward step reads from the weights: all of them except an untied embedding
    table, of which a step gathers only a few rows."""
    total = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))
    if not cfg.tie_word_embeddings and getattr(params, "embed", None) is not None:
        e = params.embed
        total -= math.prod(e.shape) * jnp.dtype(e.dtype).itemsize
    return int(total)


def numpy_quantize_error(x: np.ndarray, dtype, group_axes: tuple[int, ...]) -> float:
    """Relative RMS error of quantizing `x` with one scale per group (max over `group_axes`).

    An offline yardstick for scale granularity (per token vs per page), used by the benchmark.
    """
    dtype = jnp.dtype(dtype)
    x = np.asarray(x, np.float32)
    amax = np.max(np.abs(x), axis=group_axes, keepdims=True)
    inv = np.where(amax > 0, QMAX[dtype] / np.where(amax > 0, amax, 1.0), 0.0)
    q = np.asarray(to_storage(jnp.asarray(x * inv), dtype)).astype(np.float32)
    deq = q * (amax / QMAX[dtype])
    return float(np.sqrt(np.mean((deq - x) ** 2) / max(np.mean(x ** 2), 1e-30)))
