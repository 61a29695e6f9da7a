"""Where the runner's arrays live and how its device calls name their programs: shardings of stacked layer
weights, the specs and zeroed copies of placed pytrees, replication over a mesh, and module-level programs
named so another process can import and run them (multi-host replay)."""

from __future__ import annotations

import functools
import importlib
import sys

import jax
import jax.numpy as jnp


def stacked_shardings(layer):
    """The shardings of stacked layer weights: one layer's (`layer`, placed arrays), with the new leading
    layer axis whole."""
    return jax.tree.map(lambda x: jax.sharding.NamedSharding(x.sharding.mesh,
                                                             jax.sharding.PartitionSpec(None, *x.sharding.spec)),
                        layer)


@functools.cache
def replicate(sharding):
    """A program that copies its inputs to `sharding` (replicated over a mesh spanning processes)."""
    return jax.jit(lambda x: x, out_shardings=sharding)


def specs_of(tree):
    """The shapes, dtypes and shardings of a pytree of placed arrays."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def zeros_like(specs):
    """Zeroed arrays of `specs_of`'s specs, each made where its sharding says (by one program, so a mesh over
    several processes makes its own shards)."""
    shardings = jax.tree.map(lambda s: s.sharding, specs)
    return jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), specs), out_shardings=shardings)()


def program_ref(jitted) -> tuple[str, str]:
    """(module, name) of a module-level program, so another process can import it (`program`)."""
    module = sys.modules.get(getattr(jitted, "__module__", None) or "")
    for name, value in (vars(module) if module is not None else {}).items():
        if value is jitted:
            return module.__name__, name
    raise ValueError(f"{jitted!r} is not a module-level name, so the other processes cannot run it")


def program(ref: tuple[str, str]):
    module, name = ref
    return getattr(importlib.import_module(module), name)
