"""Logical-axis rules: a reviewable table from logical axis names to mesh axes.

A rule table lives in `configs/rules_<name>.json`:

    {
      "description": "...",
      "axes": {"vocab": "tensor", "embed": null, "q_heads": "tensor", ...},
      "replicate_when_fewer": ["kv_heads"]
    }

Each logical axis maps to one mesh axis, a list of mesh axes, or null
(replicated). Every weight and cache array declares its logical axes once
(`model.params`, `model.cache`); its PartitionSpec is resolved here from those
declarations and the table, never written by hand.

Resolution of one array dimension of size `n` whose logical axis maps to mesh
axes of total size `m`:
  * `n % m == 0`: the dimension is split `m` ways.
  * otherwise, if the logical axis is listed in `replicate_when_fewer`, `n < m`
    and `m % n == 0`: the dimension is replicated. This is the one exception
    to "must divide", and it exists for grouped-query attention: with fewer KV
    heads than the TP degree, every device keeps all KV heads (weights and
    cache pages) and the attention wrapper picks the head its query heads use.
  * anything else is an error naming the array, the dimension and the sizes.
A table that maps two dimensions of one array to the same mesh axis is
rejected, naming both dimensions.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Iterable, Mapping

from jax.sharding import PartitionSpec

from model.config import CONFIGS_DIR


class RuleError(ValueError):
    """A rule table that cannot shard some array on some mesh."""


@dataclasses.dataclass(frozen=True)
class Rules:
    """Logical axis -> tuple of mesh axes (empty: replicated). Hashable, so a layout
    built on it can be a static argument of `jax.jit`."""

    name: str
    axes: tuple[tuple[str, tuple[str, ...]], ...]
    replicate_when_fewer: frozenset[str] = frozenset()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], name: str = "custom") -> "Rules":
        unknown = set(d) - {"axes", "replicate_when_fewer", "description", "name"}
        if unknown:
            raise RuleError(f"rule table {name!r} has unknown keys {sorted(unknown)}")
        if "axes" not in d or not isinstance(d["axes"], Mapping):
            raise RuleError(f"rule table {name!r} needs an 'axes' object mapping logical axes to mesh axes")
        axes = []
        for logical, target in d["axes"].items():
            if target is None:
                mesh_axes: tuple[str, ...] = ()
            elif isinstance(target, str):
                mesh_axes = (target,)
            elif isinstance(target, (list, tuple)) and all(isinstance(t, str) for t in target):
                mesh_axes = tuple(target)
            else:
                raise RuleError(f"rule for logical axis {logical!r} must be null, a mesh axis name or a list "
                                f"of names, got {target!r}")
            if len(set(mesh_axes)) != len(mesh_axes):
                raise RuleError(f"rule for logical axis {logical!r} repeats a mesh axis: {list(mesh_axes)}")
            axes.append((str(logical), mesh_axes))
        fewer = frozenset(d.get("replicate_when_fewer", ()))
        missing = fewer - {a for a, _ in axes}
        if missing:
            raise RuleError(f"replicate_when_fewer names logical axes with no rule: {sorted(missing)}")
        return cls(name=str(d.get("name", name)), axes=tuple(sorted(axes)), replicate_when_fewer=fewer)

    @property
    def table(self) -> dict[str, tuple[str, ...]]:
        return dict(self.axes)

    def mesh_axes(self, logical: str, where: str = "") -> tuple[str, ...]:
        table = self.table
        if logical not in table:
            raise RuleError(f"rule table {self.name!r} has no rule for logical axis {logical!r}"
                            f"{' (used by ' + where + ')' if where else ''}; known: {sorted(table)}")
        return table[logical]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "axes": {k: (None if not v else v[0] if len(v) == 1 else list(v)) for k, v in self.axes},
            "replicate_when_fewer": sorted(self.replicate_when_fewer),
        }


def rules_path(name: str) -> str:
    return os.path.join(CONFIGS_DIR, f"rules_{name}.json")


def available_rules() -> list[str]:
    return sorted(f[len("rules_"):-len(".json")] for f in os.listdir(CONFIGS_DIR)
                  if f.startswith("rules_") and f.endswith(".json"))


def load_rules(name_or_path: "str | Rules | Mapping" = "megatron") -> Rules:
    """A rule table by name (`configs/rules_<name>.json`), by path, or from a dict."""
    if isinstance(name_or_path, Rules):
        return name_or_path
    if isinstance(name_or_path, Mapping):
        return Rules.from_dict(name_or_path)
    path = name_or_path if name_or_path.endswith(".json") else rules_path(name_or_path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no rule table {name_or_path!r}; known: {available_rules()}")
    with open(path) as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as e:
            raise RuleError(f"rule table {path} is not valid JSON: {e}") from None
    default_name = os.path.basename(path)[:-len(".json")].removeprefix("rules_")
    return Rules.from_dict(d, name=default_name)


@dataclasses.dataclass(frozen=True)
class DimResolution:
    """How one dimension came out: its mesh axes, and whether it fell back to replication."""

    logical: str | None
    size: int
    mesh_axes: tuple[str, ...]
    replicated_fallback: bool = False


def resolve_dims(logical_axes: Iterable[str | None], shape: Iterable[int | None], rules: Rules,
                 axis_sizes: Mapping[str, int], where: str = "array") -> list[DimResolution]:
    """Resolves every dimension of one array (see the module docstring for the rules).

    A `None` size (e.g. an activation's padded token count, unknown to the
    planner) is never checked for divisibility.
    """
    logical_axes, shape = tuple(logical_axes), tuple(shape)
    if len(logical_axes) != len(shape):
        raise RuleError(f"{where}: {len(logical_axes)} logical axes for a rank-{len(shape)} array")
    owner: dict[str, int] = {}
    out = []
    for i, (logical, size) in enumerate(zip(logical_axes, shape)):
        mesh_axes = () if logical is None else rules.mesh_axes(logical, where)
        for m in mesh_axes:
            if m not in axis_sizes:
                raise RuleError(f"rule {logical!r} -> {m!r} names a mesh axis the mesh does not have "
                                f"(mesh axes: {sorted(axis_sizes)})")
            if m in owner:
                j = owner[m]
                raise RuleError(
                    f"rule table {rules.name!r} maps two dimensions of {where} to mesh axis {m!r}: "
                    f"dimension {j} ({logical_axes[j]!r}) and dimension {i} ({logical!r})"
                )
            owner[m] = i
        ways = math.prod(axis_sizes[m] for m in mesh_axes)
        if size is None or ways == 1 or size % ways == 0:
            out.append(DimResolution(logical, size, mesh_axes))
        elif logical in rules.replicate_when_fewer and size < ways and ways % size == 0:
            out.append(DimResolution(logical, size, (), replicated_fallback=True))
        else:
            hint = ""
            if logical in rules.replicate_when_fewer:
                hint = f" (replication is allowed only when {ways} is a multiple of {size})"
            raise RuleError(
                f"{where}: dimension {i} ({logical!r}, size {size}) does not divide over mesh axes "
                f"{'x'.join(mesh_axes)} of total size {ways}{hint}"
            )
    return out


def spec_from_dims(dims: list[DimResolution]) -> PartitionSpec:
    parts = []
    for d in dims:
        parts.append(None if not d.mesh_axes else d.mesh_axes[0] if len(d.mesh_axes) == 1 else d.mesh_axes)
    while parts and parts[-1] is None:
        parts.pop()
    return PartitionSpec(*parts)


def resolve_spec(logical_axes, shape, rules: Rules, axis_sizes: Mapping[str, int],
                 where: str = "array") -> PartitionSpec:
    """The PartitionSpec of one array from its logical axes and the rules."""
    return spec_from_dims(resolve_dims(logical_axes, shape, rules, axis_sizes, where))


def shard_count(dims: list[DimResolution], axis_sizes: Mapping[str, int]) -> int:
    """Into how many pieces the array is cut (its bytes per device = total / this)."""
    return math.prod(axis_sizes[m] for d in dims for m in d.mesh_axes)
