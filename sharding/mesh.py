"""The device mesh: axes ("data", "pipeline", "tensor"), built and validated once.

Every layout in Ridgeline lives on one mesh with these three named axes, even
when some have size 1, so that rule tables, the pipeline stages and the
planner all speak about the same axis names. `tensor` is the innermost
(fastest-varying) axis: consecutive devices form one tensor-parallel group, so
a TP group stays inside one host's NVLink domain as long as `tensor` does not
exceed the devices per host (`jax.devices()` lists devices host by host).
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES = ("data", "pipeline", "tensor")


class MeshError(ValueError):
    """The requested mesh cannot be built from the devices given or present."""


def make_mesh(tensor: int = 1, pipeline: int = 1, data: int = 1, devices: Sequence | None = None) -> Mesh:
    """A mesh of shape (data, pipeline, tensor) with Auto axis types.

    With `devices=None` the first `data * pipeline * tensor` devices of
    `jax.devices()` are used (so TP=2 on an 8-GPU host takes GPUs 0 and 1).
    An explicit `devices` list must hold exactly that many devices.
    """
    sizes = {"data": data, "pipeline": pipeline, "tensor": tensor}
    for name, size in sizes.items():
        if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size < 1:
            raise MeshError(f"mesh axis {name!r} must be a positive integer, got {size!r}")
    needed = math.prod(sizes.values())
    shape_text = " x ".join(f"{k}={v}" for k, v in sizes.items())
    if devices is None:
        present = jax.devices()
        if needed > len(present):
            kinds = sorted({d.platform for d in present})
            raise MeshError(
                f"mesh {shape_text} needs {needed} devices, but only {len(present)} "
                f"{'/'.join(kinds)} device(s) are present"
            )
        devices = present[:needed]
    else:
        devices = list(devices)
        if len(devices) != needed:
            raise MeshError(f"mesh {shape_text} needs {needed} devices, but {len(devices)} were given")
        if len({d.id for d in devices}) != len(devices):
            raise MeshError("the device list names the same device more than once")
    grid = np.asarray(devices, dtype=object).reshape(data, pipeline, tensor)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def mesh_axis_sizes(mesh_or_sizes) -> dict[str, int]:
    """{axis name: size} of a Mesh, or a validated copy of such a dict (for meshes that
    are only planned, not built)."""
    if isinstance(mesh_or_sizes, Mesh):
        return dict(mesh_or_sizes.shape)
    sizes = {k: int(v) for k, v in dict(mesh_or_sizes).items()}
    for name, size in sizes.items():
        if size < 1:
            raise MeshError(f"mesh axis {name!r} must be positive, got {size}")
    return sizes


def describe_mesh(mesh: Mesh) -> str:
    return " x ".join(f"{k}={v}" for k, v in mesh.shape.items()) + f" over {mesh.devices.size} device(s)"
