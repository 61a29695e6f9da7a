"""Each layer's matrices picked by `lax.switch` inside the scanned forward: how XLA CPU scans over layers.

Why: the usual scan over layers (`model.params.stack_layers`) stacks every
weight as `[layers, ...]` and the loop body slices layer i out of it. XLA's
GPU compiler hands such a slice to its matmul in place; XLA CPU's dot cannot
read it in place, so it copies every matrix of every layer on every step
(batch-1 decode of an 8-layer 1024x2816 MLP: 4x slower than the unrolled
program). Here the layers keep their own arrays and every matmul of the loop
body is a `lax.switch` over the layer index whose branch j is that matmul on
layer j's matrix: each branch's dot reads its weight where it lies, and the
step still traces and optimises one layer body whatever the depth (a branch
is a single dot).

The rest of a layer (norm scales, biases) is small: it is stacked once per
step, before the loop, and sliced, as in the stacked scan. A mixture of experts' layer keeps the
stacked scan (its experts feed grouped products, not `linear`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from model.params import Layer
from model.quant import linear


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


# The weights of a dense `Layer` that the blocks use only through `linear` (the ones a switch picks).
MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def selects_layers(layers, platform: str) -> bool:
    """Whether a scan over these layers on `platform` should pick their matrices by switch (True on
    XLA CPU for the dense families' `Layer`) rather than slice a stack (`model.params.stack_layers`)."""
    return platform == "cpu" and type(layers[0]) is Layer


def split_layers(layers: list) -> tuple[dict, Layer]:
    """(matrices, rest): every layer's `MATRICES` as a tuple per name, and one `Layer` of the other weights
    stacked `[layers, ...]` (its matrices None), which the scan slices as it slices stacked weights."""
    matrices = {name: tuple(getattr(layer, name) for layer in layers) for name in MATRICES}
    rest = [dataclasses.replace(layer, **dict.fromkeys(MATRICES)) for layer in layers]
    return matrices, jax.tree.map(lambda *xs: jnp.stack(xs), *rest)


def layer_view(matrices: dict, rest: Layer, index) -> Layer:
    """Layer `index` (traced): `rest`, its slice of `split_layers`' stack, with its matrices as `PerLayer`."""
    return dataclasses.replace(rest, **{name: PerLayer(arrays, index) for name, arrays in matrices.items()})
