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
is a single dot). The switch itself is `model.linear` (`PerLayer`, `selected_linear`):
`linear` dispatches on the weight's form, so the blocks call it unchanged.

The rest of a layer (norm scales, biases) is small: it is stacked once per
step, before the loop, and sliced, as in the stacked scan. A mixture of experts' layer keeps the
stacked scan (its experts feed grouped products, not `linear`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from model.declarations import Layer
from model.linear import PerLayer

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
