"""Replacing a running engine's weights (`LLM.get_weights`, `LLM.update_weights`).

A trainer that samples from the engine pushes its new parameters after each
optimizer step. Its parameters are a pytree of arrays, and so are the
engine's (`ModelRunner.params`), so an update is a rebinding: leaves that
already have the engine's shape, dtype and sharding are taken as they are (no
copy), any other leaf is placed with one `jax.device_put` to the engine's
sharding for it, and a float leaf of a weight the engine serves quantized
(`weight_dtype="int8"|"fp8"`) is quantized as the engine quantized it at load
(`model.quant.quantize`, one scale per output channel).

Why nothing recompiles: the step executables are keyed by the shapes, dtypes
and shardings of their arguments (`ModelRunner._program_key`, taken once), and
every new leaf has the old leaf's, so the next step runs the executable it ran
before. Placing host arrays is a transfer, not a program. What an update may
compile, once per weight shape on the first update of its kind, later updates
reusing it: the quantizer of an int8 / fp8 engine, and JAX's resharding copy
of device arrays that live on other devices than the engine's (e.g. one
device's arrays into a TP=2 engine).

Why device memory stays bounded: every leaf is validated first (structure,
shapes, dtypes; no device work), then leaves are replaced one at a time and
the engine lets go of each old leaf as soon as its replacement is placed, so
while an update runs the engine holds about one leaf more than the model
(old arrays the caller still holds, e.g. from `get_weights`, stay alive, as do
those a dispatched step still reads). A bad input therefore changes nothing;
only a device failure part-way (out of memory) can leave a mix, which is
reported, and the prefix cache is moved on even then.

When the new weights take effect: at the next dispatched step. JAX arrays are
immutable and a dispatched step holds the arrays it was given, so a step
already in flight (overlapped scheduling) finishes under the old weights.
Each update bumps `engine.weights_epoch`, which names the pages of every later
request (`block_manager.weights_digest`): no request ever reuses K/V computed
under older weights, on the device or in the host KV tier, which is keyed by
the same digests. Requests made before an update keep their old names.

Structures accepted: the engine's own (what `get_weights` returns); the
model's `Weights` with a list of layers where the engine stacked them for its
layer scan (restacked on the host); a flat dict keyed by our flat names
(`model.params.flatten_params`); a flat dict keyed by Hugging Face tensor
names (any key ending in ".weight" or ".bias"), converted by the checkpoint
converter's plan (`model.convert_hf.weights_from_hf_tensors`). A pipeline
engine's weights are staged (`sharding.pipeline.StagedWeights`): it takes its
own structure only. A draft model's weights (speculative decoding) are not
touched.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from model.params import Weights, _path_name
from model.quant import QuantizedArray, is_quantized, quantize


def get_weights(engine):
    """The engine's weights as it serves them: the placed arrays themselves (shardings, stacking,
    quantization as loaded)."""
    if engine.runner.params is None:
        raise ValueError("the weights are asleep (sleep mode): wake them first (wake_up(tags=['weights']))")
    return engine.runner.params


def update_weights(engine, weights, version: Optional[int] = None) -> int:
    """Replaces the engine's weights with `weights` (see the module docstring); returns the new
    `weight_version` (`version`, or the old one plus one). Raises ValueError, naming the leaf, for a
    wrong structure, shape or dtype, before anything is replaced."""
    _check_version(version)
    runner = engine.runner
    if runner.params is None:
        raise ValueError("the weights are asleep (sleep mode): wake them first (wake_up(tags=['weights'])), then "
                         "update them")
    weights = _engine_structure(runner.params, weights, engine.cfg)
    names, targets, treedef = _named_leaves(runner.params)
    given = _in_order(names, *_named_leaves(weights)[:2])
    placers = [_placer(name, target, leaf) for name, target, leaf in zip(names, targets, given)]
    del targets, given  # hold no old leaf here: each is let go once its replacement is placed
    try:
        _replace_leaves(runner, treedef, names, placers)
    finally:  # even a failure part-way moves the prefix cache on: its pages may hold K/V of mixed weights
        engine.weights_epoch += 1
        for part in engine.parts:  # (an image encoder's cached outputs were computed by the old weights)
            part.weights_replaced()
    engine.weight_version = engine.weight_version + 1 if version is None else int(version)
    return engine.weight_version


def _check_version(version) -> None:
    if version is not None and (isinstance(version, bool) or not isinstance(version, (int, np.integer))):
        raise ValueError(f"version: must be an integer or None, got {version!r}")


# --- structures ------------------------------------------------------------------------------------

def is_hf_dict(weights) -> bool:
    """Whether `weights` is a flat dict of Hugging Face tensor names (its keys end in .weight / .bias,
    which none of our flat names does)."""
    return isinstance(weights, Mapping) and any(isinstance(k, str) and k.endswith((".weight", ".bias"))
                                                for k in weights)


def _engine_structure(current, weights, cfg):
    """`weights` in the structure the engine holds: a Hugging Face dict converted to our `Weights`,
    per-layer weights stacked on the host where the engine scans stacked layers."""
    if is_hf_dict(weights):
        from model.convert_hf import weights_from_hf_tensors

        weights = weights_from_hf_tensors(weights, cfg)
    if hasattr(current, "stages") and isinstance(weights, Weights):
        raise ValueError("this engine runs pipeline stages and holds its weights staged "
                         "(sharding.pipeline.StagedWeights): pass the structure get_weights() returns, not the "
                         "model's Weights or a Hugging Face dict")
    if (isinstance(current, Weights) and isinstance(weights, Weights) and not isinstance(current.layers, list)
            and isinstance(weights.layers, (list, tuple))):
        weights = dataclasses.replace(weights, layers=_stack_on_host(weights.layers))
    return weights


def _stack_on_host(layers):
    """Per-layer weights as one layer of `[num_layers, ...]` leaves (what a scanning engine holds),
    stacked in host memory: device arrays come to the host first (pass get_weights()'s structure to
    skip that)."""
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *layers)


def _named_leaves(tree):
    """(flat names, leaves, treedef) of a weight tree, a `QuantizedArray` counting as one leaf."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_quantized)
    return [_path_name(path) for path, _ in flat], [leaf for _, leaf in flat], treedef


def _in_order(names: list[str], given_names: list[str], given: list) -> list:
    """The given leaves in the engine's order, matched by name (a dict flattens in its sorted key
    order), or a ValueError naming the leaves missing or unexpected."""
    if given_names == names:
        return given
    by_name = dict(zip(given_names, given))
    missing = [n for n in names if n not in by_name]
    extra = [n for n in given_names if n not in set(names)]
    if missing or extra:
        raise ValueError("weights: not the engine's structure: " + "; ".join(
            f"{what} {found[:5]}{' and more' if len(found) > 5 else ''}"
            for what, found in (("missing", missing), ("unexpected", extra)) if found))
    return [by_name[n] for n in names]


# --- validation: one placer per leaf -----------------------------------------------------------------

def _placer(name: str, target, given) -> Callable[[], object]:
    """A function placing `given` where the engine holds `target`; raises ValueError naming the leaf
    when it cannot be placed there. Only shardings and dtypes of `target` are kept, not the array."""
    if is_quantized(target):
        if is_quantized(given):
            data = _array_placer(f"{name}.data", target.data, given.data)
            scale = _array_placer(f"{name}.scale", target.scale, given.scale)
            return lambda: QuantizedArray(data(), scale())
        _check_array(name, given, target.data.shape)
        if not jnp.issubdtype(given.dtype, jnp.floating):
            raise ValueError(f"{name}: dtype {np.dtype(given.dtype)}; the engine serves this weight quantized to "
                             f"{np.dtype(target.data.dtype)} and takes it as float weights or a QuantizedArray")
        quantizer = _quantizer(np.dtype(target.data.dtype), target.scale.ndim, target.data.sharding,
                               target.scale.sharding)
        sharding = target.data.sharding
        return lambda: quantizer(jax.device_put(given, sharding))
    if is_quantized(given):
        raise ValueError(f"{name}: a QuantizedArray, but the engine serves this weight as "
                         f"{np.dtype(target.dtype)}")
    return _array_placer(name, target, given)


def _array_placer(name: str, target, given) -> Callable[[], object]:
    """Rebinds `given` when it already has the target's shape, dtype and sharding; else places it."""
    _check_array(name, given, target.shape)
    if np.dtype(given.dtype) != np.dtype(target.dtype):
        raise ValueError(f"{name}: dtype {np.dtype(given.dtype)}, but the engine serves it as "
                         f"{np.dtype(target.dtype)} (cast it first)")
    sharding = target.sharding
    if isinstance(given, jax.Array) and given.committed and given.sharding == sharding:
        return lambda: given
    return lambda: jax.device_put(given, sharding)


def _check_array(name: str, given, shape) -> None:
    if not isinstance(given, (np.ndarray, jax.Array)):
        raise ValueError(f"{name}: expected an array (numpy or jax), got {type(given).__name__}")
    if isinstance(given, jax.Array) and given.is_deleted():
        raise ValueError(f"{name}: the array was deleted")
    if tuple(given.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(given.shape)}, but the engine's is {tuple(shape)}")


@functools.cache
def _quantizer(dtype, num_out_dims: int, data_sharding, scale_sharding):
    """A float weight -> the `QuantizedArray` the engine holds (placed with its shardings): the same
    arithmetic as load-time quantization (`model.quantize.quantize_params`), one weight at a time."""
    return jax.jit(lambda w: quantize(w, dtype, num_out_dims),
                   out_shardings=QuantizedArray(data_sharding, scale_sharding))


# --- applying ------------------------------------------------------------------------------------

def _replace_leaves(runner, treedef, names: list[str], placers: list) -> None:
    """Places the leaves one at a time, the runner rebinding its params after each, so the old leaf
    it let go can be freed before the next is placed."""
    leaves = jax.tree_util.tree_flatten(runner.params, is_leaf=is_quantized)[0]
    for i, (name, place) in enumerate(zip(names, placers)):
        try:
            leaves[i] = place()
        except Exception as e:
            raise RuntimeError(f"weight update failed placing {name} ({e}); {i} of {len(names)} leaves were "
                               "replaced: update the weights again") from e
        placers[i] = None  # (it holds the caller's leaf)
        runner.params = jax.tree_util.tree_unflatten(treedef, leaves)


