"""`linear`: the matmul of a linear layer, whatever form its weight takes.

A weight reaches `linear` as a float array, a `QuantizedArray` (int8 / fp8 data with per-output-channel
scales, `model.quant`), or a `PerLayer`: every layer's matrix and the traced index of the layer that
reads it, what the scanned forward on XLA CPU passes (`model.layer_select`), where each matmul is a
`lax.switch` over the layers whose branch j is that matmul on layer j's matrix (`selected_linear`).
`linear` and `selected_linear` call each other, so they live here together: `model.layer_select` builds
the `PerLayer`s, and the blocks call `linear` the same way whatever their weights are.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from model.quant import QuantizedArray


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
    if not isinstance(w, QuantizedArray):
        return jnp.einsum(spec, x, w, **kwargs)
    out = jnp.einsum(spec, x, w.data.astype(x.dtype), **kwargs)
    if out.shape[out.ndim - w.scale.ndim:] != w.scale.shape:
        raise ValueError(f"linear {spec!r}: the output's trailing dims {out.shape} do not match the weight's "
                         f"output dims {w.scale.shape}; weights are [out..., in...]")
    return (out.astype(jnp.float32) * w.scale).astype(out.dtype)


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
