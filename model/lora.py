"""LoRA adapters in the PEFT format, and how their slots enter the forward pass.

An adapter directory as `peft`'s `save_pretrained` writes it holds `adapter_config.json` (rank `r`,
`lora_alpha`, `use_rslora`, `target_modules`, ...) and `adapter_model.safetensors`, whose tensors are
named after the base model's modules (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`,
`[r, in]`, and `...lora_B.weight`, `[out, r]`). PEFT computes `base(x) + B A x * scaling`, with
scaling `lora_alpha / r` (`lora_alpha / sqrt(r)` under rsLoRA).

`load_adapter` reads one against a base config: each module's base tensor is found through the
family's own checkpoint plan (`model.families`: the HF tensor each of our weights is read from and how
it is re-laid out), so an adapter fits exactly the weights the checkpoint converter would fill, in
every family (Phi-3's fused `qkv_proj` / `gate_up_proj` split as their base weights are). Whatever
does not fit (a shape, a module this model has no adapter slot for, a rank above the server's
maximum, a missing file, a PEFT option these products do not compute, such as DoRA) is refused with
a `LoraError` that names it.

On the device the adapters of all `slots` live in one pytree of stacked arrays per target weight
(`declare_slots`), an input of the step, so changing which adapters occupy the slots changes data,
never the program. `attach` wraps each target weight of the layers in a `model.linear.LoraWeight`
holding its slots' A/B and every token's slot; `model.linear.linear` then adds the delta, so the
blocks of every family run unchanged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from model.linear import LoraWeight

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# Our linear weights an adapter may target (the dense layers' `model.layer_select.MATRICES`, also the
# attention of the mixtures of experts), with how many leading dims of each are output dims.
TARGETS = {"wq": 2, "wk": 2, "wv": 2, "wo": 1, "w_gate": 1, "w_up": 1, "w_down": 1}
PREFIX = "base_model.model."
# adapter_config.json fields that change what the adapter computes beyond B A x * scaling: refused
# when set to anything but their no-op value.
UNSUPPORTED_OPTIONS = {"use_dora": (False, None), "fan_in_fan_out": (False, None), "bias": ("none", None),
                       "modules_to_save": (None, [], ()), "alpha_pattern": (None, {}),
                       "layer_replication": (None, []), "lora_bias": (False, None), "use_qalora": (False, None)}


class LoraError(ValueError):
    """An adapter that cannot be served with this base model; the message says why."""


class LoraNotFoundError(LoraError):
    """The adapter's path does not exist."""


@dataclasses.dataclass(frozen=True)
class LoraAdapter:
    """One adapter read from disk, on the host: per (layer, target weight) its `A` `[r, in]` and its
    `B` `[out, r]` (scaling folded in), laid out as our weight is (its input and output dims each
    flattened). `digest` names the exact weights (a prefix cache keyed by it can never serve pages
    computed under other weights of the same name)."""

    name: str
    path: str
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    weights: dict  # (layer, target) -> (A, B) numpy
    digest: bytes

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _read_config(path: str) -> dict:
    if not os.path.isdir(path):
        raise LoraNotFoundError(f"LoRA adapter path {path!r} does not exist or is not a directory")
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        raise LoraError(f"LoRA adapter {path!r}: no {CONFIG_FILE}")
    try:
        with open(cfg_path) as f:
            conf = json.load(f)
    except (OSError, ValueError) as e:
        raise LoraError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not valid JSON ({e})") from None
    if not isinstance(conf, dict):
        raise LoraError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not a JSON object")
    if conf.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"LoRA adapter {path!r}: peft_type {conf.get('peft_type')!r} is not LORA")
    for key, allowed in UNSUPPORTED_OPTIONS.items():
        if key in conf and conf[key] not in allowed:
            raise LoraError(f"LoRA adapter {path!r}: {key}={conf[key]!r} is not supported (only plain LoRA: "
                            f"base(x) + B A x * scaling)")
    for key in ("r", "lora_alpha"):
        if not isinstance(conf.get(key), (int, float)) or isinstance(conf.get(key), bool) or conf[key] <= 0:
            raise LoraError(f"LoRA adapter {path!r}: {CONFIG_FILE} needs a positive {key}, got {conf.get(key)!r}")
    return conf


def _read_tensors(path: str) -> tuple[dict, bytes]:
    from safetensors import SafetensorError
    from safetensors.numpy import load

    weights_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        raise LoraError(f"LoRA adapter {path!r}: no {WEIGHTS_FILE}"
                        + (" (adapter_model.bin, the pickle format, is not read)"
                           if os.path.exists(os.path.join(path, "adapter_model.bin")) else ""))
    with open(weights_path, "rb") as f:
        raw = f.read()
    try:
        tensors = load(raw)
    except (SafetensorError, ValueError, TypeError) as e:
        raise LoraError(f"LoRA adapter {path!r}: {WEIGHTS_FILE} is not a safetensors file ({e})") from None
    return tensors, raw


def _base_plans(cfg) -> dict:
    """HF module name (`model.layers.0.self_attn.q_proj`) -> the plans of our target weights read from
    its weight (several for a fused module), and every linear module name for messages."""
    from model.families import family_for_config

    plans: dict[str, list] = {}
    for plan in family_for_config(cfg).checkpoint_tensors(cfg):
        if plan.hf.endswith(".weight") and len(plan.hf_shape) == 2:
            plans.setdefault(plan.hf[:-len(".weight")], []).append(plan)
    return plans


def _target_of(plan) -> Optional[tuple[int, str]]:
    """(layer, our weight name) of a plan whose weight an adapter may target, else None."""
    parts = plan.ours.split(".")
    if len(parts) == 3 and parts[0] == "layers" and parts[2] in TARGETS and plan.stack is None:
        return int(parts[1]), parts[2]
    return None


def _index_maps(plan, n_out: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols): our weight (output dims, input dims each flattened) is the HF weight's rows `rows`
    and columns `cols`. Found by re-laying out an array of flat HF indices the way the converter re-lays
    the weight; a re-layout that is not a selection of rows and columns is an error."""
    out_dim, in_dim = plan.hf_shape
    idx = np.asarray(plan.relayout(np.arange(out_dim * in_dim, dtype=np.int64).reshape(out_dim, in_dim)))
    flat = idx.reshape(math.prod(idx.shape[:n_out]), -1)
    rows, cols = flat[:, 0] // in_dim, flat[0, :] % in_dim
    if not np.array_equal(flat, rows[:, None] * in_dim + cols[None, :]):
        raise LoraError(f"{plan.hf}: its base weight is re-laid out in a way adapters cannot follow")
    return rows, cols


def load_adapter(path: str, cfg, max_rank: int, name: Optional[str] = None, dtype=np.float32) -> LoraAdapter:
    """Reads and checks the PEFT adapter in directory `path` against base config `cfg`; raises
    `LoraError` naming what does not fit."""
    conf = _read_config(path)
    tensors, raw = _read_tensors(path)
    plans = _base_plans(cfg)
    rslora = bool(conf.get("use_rslora", False))
    alpha = float(conf["lora_alpha"])
    pairs: dict[str, dict] = {}
    for key, value in tensors.items():
        module, sep, rest = key.rpartition(".lora_")
        if not sep or rest not in ("A.weight", "B.weight"):
            kind = "embedding adapters" if "lora_embedding" in key else "this tensor"
            raise LoraError(f"LoRA adapter {path!r}: {kind} ({key}) is not supported; adapters hold lora_A / "
                            f"lora_B weights of linear layers")
        module = module[len(PREFIX):] if module.startswith(PREFIX) else module
        if module not in plans and "model." + module in plans:  # trained on a base model (an embedder's)
            module = "model." + module
        pairs.setdefault(module, {})[rest[0]] = value
    if not pairs:
        raise LoraError(f"LoRA adapter {path!r}: {WEIGHTS_FILE} holds no lora_A / lora_B weights")
    weights = {}
    ranks, modules = set(), set()
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoraError(f"LoRA adapter {path!r}: {module} has lora_{''.join(ab)} but not both lora_A and lora_B")
        targets = [(p, _target_of(p)) for p in plans.get(module, [])]
        if not targets or any(t is None for _, t in targets):
            known = sorted({m.rsplit(".", 1)[-1] for m, ps in plans.items() if all(_target_of(p) for p in ps)})
            why = ("is not a module of this model" if not targets else
                   "is not a linear layer adapters can target here (expert and output-head weights are not)")
            raise LoraError(f"LoRA adapter {path!r}: target module {module} {why}; supported target modules: "
                            f"{', '.join(known)}")
        a, b = np.asarray(ab["A"]), np.asarray(ab["B"])
        out_dim, in_dim = targets[0][0].hf_shape
        r = a.shape[0] if a.ndim == 2 else -1
        if a.shape != (r, in_dim) or b.shape != (out_dim, r):
            raise LoraError(f"LoRA adapter {path!r}: {module} has lora_A {list(a.shape)} and lora_B {list(b.shape)}, "
                            f"but the base weight is [{out_dim}, {in_dim}] (expected [r, {in_dim}] and [{out_dim}, r])")
        if r > max_rank:
            raise LoraError(f"LoRA adapter {path!r}: rank {r} of {module} exceeds max_lora_rank={max_rank}")
        scaling = alpha / math.sqrt(r) if rslora else alpha / r
        a32, b32 = a.astype(np.float32), b.astype(np.float32) * np.float32(scaling)
        for plan, (layer, target) in targets:
            rows, cols = _index_maps(plan, TARGETS[target])
            weights[(layer, target)] = (a32[:, cols].astype(dtype), b32[rows, :].astype(dtype))
        ranks.add(r)
        modules.add(module.rsplit(".", 1)[-1])
    digest = hashlib.blake2b(raw + json.dumps(conf, sort_keys=True).encode(), digest_size=16).digest()
    rank = max(ranks)
    return LoraAdapter(name or os.path.basename(os.path.normpath(path)), path, rank,
                       alpha / math.sqrt(rank) if rslora else alpha / rank, tuple(sorted(modules)), weights, digest)


# --- slots on the device --------------------------------------------------------------------------


def target_shapes(cfg) -> dict[str, tuple[int, int]]:
    """Our target weights in `cfg`'s layers -> (flat output, flat input) sizes."""
    from model.families import family_for_config, is_expert_weight

    layer = family_for_config(cfg).declare_weights(cfg).layers[0]
    shapes = {}
    for name, n_out in TARGETS.items():
        info = getattr(layer, name, None)
        if info is None or is_expert_weight(info):  # a mixture's experts (same names): no adapter slots
            continue
        shape = tuple(getattr(info, "data", info).shape)
        shapes[name] = (math.prod(shape[:n_out]), math.prod(shape[n_out:]))
    return shapes


def declare_slots(cfg, slots: int, rank: int, dtype) -> dict:
    """{target: (A, B)} `jax.ShapeDtypeStruct`s of every layer's slots: A `[layers, slots * rank, in]`,
    B `[layers, out, slots * rank]`."""
    width = slots * rank
    return {name: (jax.ShapeDtypeStruct((cfg.num_layers, width, i), dtype),
                   jax.ShapeDtypeStruct((cfg.num_layers, o, width), dtype))
            for name, (o, i) in target_shapes(cfg).items()}


def slot_arrays(adapter: Optional[LoraAdapter], cfg, rank: int, dtype) -> dict:
    """One slot's contents on the host, {target: (A `[layers, rank, in]`, B `[layers, out, rank]`)}: the
    adapter's matrices zero-padded to `rank` (zeros where it has no weight; all zeros for None)."""
    out = {}
    for name, (o, i) in target_shapes(cfg).items():
        a = np.zeros((cfg.num_layers, rank, i), dtype)
        b = np.zeros((cfg.num_layers, o, rank), dtype)
        for layer in range(cfg.num_layers):
            got = None if adapter is None else adapter.weights.get((layer, name))
            if got is not None:
                r = got[0].shape[0]
                a[layer, :r], b[layer, :, :r] = got
        out[name] = (a, b)
    return out


def write_slot(slots: dict, slot, contents: dict) -> dict:
    """`slots` with slot `slot` (traced) replaced by `contents` (`slot_arrays`' layout, whose A's second
    dim is the slot rank). The slot arrays may group their layers in more leading dims than one (the
    pipeline's `[stages, layers per stage, ...]`, `sharding.pipeline`): the contents' layer dim is
    reshaped to them, row-major, so global layer `s * L/p + j` lands in stage `s`, row `j`."""
    rank = next(iter(contents.values()))[0].shape[1]
    start = slot * rank
    out = {}
    for name, (a, b) in slots.items():
        new_a = contents[name][0].reshape(a.shape[:-2] + (rank, a.shape[-1])).astype(a.dtype)
        new_b = contents[name][1].reshape(b.shape[:-1] + (rank,)).astype(b.dtype)
        out[name] = (jax.lax.dynamic_update_slice_in_dim(a, new_a, start, axis=a.ndim - 2),
                     jax.lax.dynamic_update_slice_in_dim(b, new_b, start, axis=b.ndim - 1))
    return out


def attach_layer(layer, slots_of_layer: dict, token_slot, rank: int):
    """One layer whose target weights carry their adapters (`{target: (A [slots * rank, in], B [out,
    slots * rank])}`) and each token's slot, as `model.linear.LoraWeight`s."""
    return dataclasses.replace(layer, **{name: LoraWeight(getattr(layer, name), a, b, token_slot, rank)
                                         for name, (a, b) in slots_of_layer.items()})


def attach(params, slots: dict, token_slot, rank: int):
    """`params` whose layers' target weights carry the adapters of every slot and each token's slot
    (`token_slot` `[T]`, -1: none), as `model.linear.LoraWeight`s. Layers as a list (unrolled, or picked
    per layer inside a scan) get their own slice; stacked layers (`stack_layers`) get the stacks, and
    the token slots repeated per layer so the scan slices them alike."""
    layers = params.layers
    if isinstance(layers, (list, tuple)):
        new = [attach_layer(layer, {name: (a[i], b[i]) for name, (a, b) in slots.items()}, token_slot, rank)
               for i, layer in enumerate(layers)]
    else:
        num_layers = next(iter(slots.values()))[0].shape[0]
        per_layer = jnp.broadcast_to(token_slot, (num_layers,) + token_slot.shape)
        new = dataclasses.replace(layers, **{name: LoraWeight(getattr(layers, name), a, b, per_layer, rank)
                                             for name, (a, b) in slots.items()})
    return dataclasses.replace(params, layers=new)


def slot_axes(layer, name: str, stacked: bool = False, drop: tuple = ()):
    """(mesh, the mesh axes of the base weight's flat input dim, those of its flat output dim) of target
    `name` in `layer` (its arrays' shardings; `stacked`: a leading layer dim to skip), leaving out the
    axes in `drop` (the pipeline's stage axis); None where the weight is not on a mesh."""
    base = getattr(layer, name)
    sharding = getattr(getattr(base, "data", base), "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return None
    spec = tuple(sharding.spec) + (None,) * (len(base.shape) - len(sharding.spec))
    spec = spec[1:] if stacked else spec

    def keep(axes):
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        axes = tuple(a for a in axes if a not in drop)
        return None if not axes else axes[0] if len(axes) == 1 else axes

    return sharding.mesh, keep(spec[TARGETS[name]]), keep(spec[0])


def slot_shardings(params, slots_decl: dict) -> dict:
    """Where each slot array lives: A split like its base weight's input dim, B like its output dim, so
    the delta's products shard as the base product does (None where the params are not sharded)."""
    layer = params.layers[0] if isinstance(params.layers, (list, tuple)) else params.layers
    stacked = not isinstance(params.layers, (list, tuple))
    out = {}
    P = jax.sharding.PartitionSpec
    for name in slots_decl:
        axes = slot_axes(layer, name, stacked)
        if axes is None:
            return None
        mesh, in_axes, out_axes = axes
        out[name] = (jax.sharding.NamedSharding(mesh, P(None, None, in_axes)),
                     jax.sharding.NamedSharding(mesh, P(None, out_axes, None)))
    return out


def check_model(cfg) -> None:
    """Refuses a base model whose layers no adapter can reach."""
    if not target_shapes(cfg):
        raise LoraError("this model's layers have no linear weights adapters can target")


def zeros_like_tree(decl: dict, shardings: Optional[dict]) -> dict:
    """The empty slots (every adapter all zeros), placed: made by one program with those output
    shardings, so it works on a mesh spanning processes too (each process makes its own shards)."""
    def zeros():
        return {k: (jnp.zeros(a.shape, a.dtype), jnp.zeros(b.shape, b.dtype)) for k, (a, b) in decl.items()}
    if shardings is None:
        return zeros()
    return jax.jit(zeros, out_shardings=shardings)()


__all__ = ["LoraAdapter", "LoraError", "TARGETS", "attach", "attach_layer", "declare_slots", "load_adapter",
           "slot_arrays", "slot_axes", "slot_shardings", "target_shapes", "write_slot", "zeros_like_tree", "check_model"]
