"""`linear`: the matmul of a linear layer, whatever form its weight takes.

A weight reaches `linear` as a float array, a `QuantizedArray` (int8 / fp8 data with per-output-channel
scales, `model.quant`), a `GroupQuantizedArray` (a published checkpoint's fp8 data with one scale per
output row and input group: XLA widens and scales it inside the jitted step, or with the Pallas backends
on one device `kernels_pallas.grouped_matmul` does it inside the tile), or a `PerLayer`: every layer's matrix and the traced index of the layer that
reads it, what the scanned forward on XLA CPU passes (`model.layer_select`), where each matmul is a
`lax.switch` over the layers whose branch j is that matmul on layer j's matrix (`selected_linear`).
`linear` and `selected_linear` call each other, so they live here together: `model.layer_select` builds
the `PerLayer`s, and the blocks call `linear` the same way whatever their weights are.

A `LoraWeight` is a base weight (any of those forms) with the stacked low-rank adapters of every
adapter slot and each token's slot (`model.lora`): `linear` adds the token's adapter delta to the base
product, so every family that computes its projections with `linear` serves adapters.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from model.quant import GroupQuantizedArray, QuantizedArray, dequantize_grouped


def linear(spec: str, x, w, **kwargs):
    """`jnp.einsum(spec, x, w)` for a float or a `QuantizedArray` weight.

    Quantized: the einsum runs on `data` widened to x's dtype and its output is
    scaled per output channel: the scale holds the weight's leading (output)
    dims, which every einsum over an [out..., in...] weight writes as the
    output's trailing dims, in the same order, so the scale broadcasts onto
    them. `model.forward` runs 2-D ones ("te,fe->tf", "tf,ef->te", "te,ve->tv",
    the attention weights through 2-D views); the 3-D forms ("te,hde->thd",
    "thd,ehd->te") work the same way. A float weight
    takes exactly the old path, so unquantized programs are unchanged.
    """
    if isinstance(w, PerLayer):  # one matrix per layer, picked inside a scan (`model.layer_select`)
        return selected_linear(spec, x, w, **kwargs)
    if isinstance(w, LoraWeight):  # the base product plus each token's adapter delta (`model.lora`)
        return lora_linear(spec, x, w, **kwargs)
    if isinstance(w, GroupQuantizedArray):  # group-wise scales (`model.quant`): applied to the widened data
        kernel = _GROUPED_KERNEL.get()
        if kernel is not None and set(kwargs) <= {"preferred_element_type"} and _is_x_times_w_transposed(spec, x, w):
            return kernel(x, w.data, w.scale, group=w.group, out_dtype=kwargs.get("preferred_element_type"))
        return jnp.einsum(spec, x, dequantize_grouped(w, x.dtype), **kwargs)
    if not isinstance(w, QuantizedArray):
        return jnp.einsum(spec, x, w, **kwargs)
    out = jnp.einsum(spec, x, w.data.astype(x.dtype), **kwargs)
    if out.shape[out.ndim - w.scale.ndim:] != w.scale.shape:
        raise ValueError(f"linear {spec!r}: the output's trailing dims {out.shape} do not match the weight's "
                         f"output dims {w.scale.shape}; weights are [out..., in...]")
    return (out.astype(jnp.float32) * w.scale).astype(out.dtype)


# The kernel a traced 2-D product with a group-quantized weight runs in: None (XLA widens and scales the
# weight as the product's operand) or a backend's `grouped_matmul` (the Pallas one reads the weight in its
# 1-byte storage form and scales it inside the tile). Set for one forward by `grouped_matmul_kernel`:
# `model.forward` takes it from its attention backend on one device.
_GROUPED_KERNEL: contextvars.ContextVar = contextvars.ContextVar("grouped_matmul_kernel", default=None)


@contextlib.contextmanager
def grouped_matmul_kernel(kernel):
    """Traces the products with group-quantized weights inside the block with `kernel` (see above)."""
    token = _GROUPED_KERNEL.set(kernel)
    try:
        yield
    finally:
        _GROUPED_KERNEL.reset(token)


def _is_x_times_w_transposed(spec: str, x, w) -> bool:
    """Whether `spec` is a 2-D `x [M, K] @ w [N, K]^T` ("te,fe->tf"), the kernel's one form."""
    ins, _, out = spec.replace(" ", "").partition("->")
    a, _, b = ins.partition(",")
    return (x.ndim == 2 and w.data.ndim == 2 and len(a) == len(b) == 2 and a[1] == b[1] and out == a[0] + b[0]
            and a[0] != b[0])


@dataclasses.dataclass(frozen=True)
class PerLayer:
    """One matrix of every layer (`arrays[j]`: layer j's, an array or a `QuantizedArray`) and the
    traced index of the layer that reads it. `linear` on it runs the matmul on `arrays[index]`."""

    arrays: tuple
    index: Any

    @property
    def shape(self):
        return self.arrays[0].shape

    @property
    def dtype(self):
        return self.arrays[0].dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def map(self, fn) -> "PerLayer":
        """The same selection over `fn` of every layer's matrix (a reshape, say)."""
        return PerLayer(tuple(fn(a) for a in self.arrays), self.index)


jax.tree_util.register_dataclass(PerLayer, data_fields=["arrays", "index"], meta_fields=[])


def _branch(spec, w, kwargs, x):
    return linear(spec, x, w, **kwargs)


def selected_linear(spec: str, x, w: PerLayer, **kwargs):
    """`linear(spec, x, w.arrays[w.index])`, with no copy of the chosen matrix."""
    return jax.lax.switch(w.index, [functools.partial(_branch, spec, a, kwargs) for a in w.arrays], x)


@dataclasses.dataclass(frozen=True)
class LoraWeight:
    """A base weight (`[out..., in...]`, any form `linear` takes) with the low-rank adapters of every
    slot and each token's slot.

    `a` is `[slots * rank, in]` and `b` `[out, slots * rank]` (the base's input and output dims each
    flattened, row-major; slot s owns rows / columns `s * rank:(s + 1) * rank`, zero-padded past its
    adapter's rank, its scaling folded into `b`); `token_slot` `[T]` int32 names each token's slot, -1
    for none (the base model alone). `rank` is static. Shape and dtype are the base weight's, so code
    that reshapes a weight's head dims (`model.layers._merge_heads`) maps over `base` with `map`."""

    base: Any
    a: Any
    b: Any
    token_slot: Any
    rank: int = 1

    @property
    def shape(self):
        return self.base.shape

    @property
    def dtype(self):
        return self.base.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def map(self, fn) -> "LoraWeight":
        """`fn` of the base weight (a reshape of its dims), the adapters as they are (already flat)."""
        return dataclasses.replace(self, base=fn(self.base))


jax.tree_util.register_dataclass(LoraWeight, data_fields=["base", "a", "b", "token_slot"], meta_fields=["rank"])


def lora_delta(x, w: LoraWeight):
    """Each token's adapter delta `B_s A_s x` (s its slot), as two dense 2-D products over every slot.

    Why dense: `x A^T` for all slots at once is one `[T, in] x [in, slots*rank]` matmul; the columns of the
    slots a token does not use are zeroed (one mask), and the second matmul with `B` sums only its own
    slot's. The extra work is `slots * rank / out` of the base product (4 x 16 / 4096 = 1.6% for a 7B
    projection), no gather of per-token matrices, and the same two 2-D dots whatever the mix of adapters,
    so the program is one shape for every batch. A slot of -1 matches no column: the delta is 0."""
    tokens = x.shape[0]
    x2 = x.reshape(tokens, -1)
    h = jnp.einsum("ti,ri->tr", x2, w.a.astype(x.dtype))
    slot_of_column = jnp.arange(h.shape[1], dtype=jnp.int32) // w.rank
    h = jnp.where(slot_of_column[None, :] == w.token_slot[:, None], h, jnp.zeros((), h.dtype))
    return jnp.einsum("tr,or->to", h, w.b.astype(x.dtype))


def lora_linear(spec: str, x, w: LoraWeight, **kwargs):
    """`linear(spec, x, w.base)` plus the adapter delta of each token (tokens are x's leading dim; the
    delta's flat output dims reshape to the product's trailing ones). A step whose tokens all run the
    base model skips the adapter products (a `lax.cond`), so enabling LoRA costs base-only traffic
    almost nothing."""
    out = linear(spec, x, w.base, **kwargs)
    return jax.lax.cond(jnp.any(w.token_slot >= 0),
                        lambda: out + lora_delta(x, w).reshape(out.shape).astype(out.dtype), lambda: out)
