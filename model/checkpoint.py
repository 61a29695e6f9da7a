"""Checkpoints: orbax save and sharded restore of the weights, with their config.

A checkpoint directory holds:
  model_config.json    the `LlamaConfig`
  params/              an orbax checkpoint of the flat {"layers.0.wq": array} dict; with
                       quantized weights (`weight_dtype` in the config) the int8 / fp8 data and
                       fp32 scales as "layers.0.wq.data" / "layers.0.wq.scale"
  tokenizer.json       (optional) a Hugging Face tokenizer; without it the byte tokenizer

The params' orbax metadata carries a format number (`FORMAT_KEY`). Format 2
stores linear weights [out..., in...] (`model.declarations.linear_weight`); format 1
(no number: checkpoints written before it existed) stored them [in..., out...].
A checkpoint of another format is refused with an error that says how to
upgrade it (`python -m model.upgrade_checkpoint`), because a shape check
alone would let a square weight (e.g. w_gate when ffw == embed) load
transposed and produce garbage silently.

Restore builds abstract arrays carrying the target shardings and lets orbax
read each shard straight onto its devices, so no host ever holds a full copy
of the model.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from model.config import LlamaConfig
from model.params import Weights, abstract_params, flatten_params, unflatten_params
from model.quant import is_quantized

CONFIG_FILE = "model_config.json"
PARAMS_DIR = "params"
FORMAT_KEY = "ridgeline_checkpoint_format"
FORMAT_VERSION = 2
FORMAT_LAYOUTS = {1: "linear weights [in, out]", 2: "linear weights [out, in]"}


class CheckpointFormatError(ValueError):
    """A checkpoint written in a weight layout this code does not read."""


def save_checkpoint(directory: str, params: Weights, cfg: LlamaConfig, *, storage_dtype=None) -> None:
    """Writes params (optionally cast to `storage_dtype`, e.g. bf16 to halve the size) and config.

    Quantized weights are stored as they are (the cast applies to float weights only)."""
    directory = os.path.abspath(directory)
    os.makedirs(directory, exist_ok=True)
    if storage_dtype is not None:
        params = jax.tree.map(lambda x: x if is_quantized(x) else x.astype(storage_dtype), params,
                              is_leaf=is_quantized)
    flat = flatten_params(params)
    path = os.path.join(directory, PARAMS_DIR)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, flat, force=True,
                   custom_metadata={FORMAT_KEY: FORMAT_VERSION, "layout": FORMAT_LAYOUTS[FORMAT_VERSION]})
        ckptr.wait_until_finished()
    cfg.save(os.path.join(directory, CONFIG_FILE))


def load_config(directory: str) -> LlamaConfig:
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{directory} is not a ridgeline checkpoint: {CONFIG_FILE} is missing")
    return LlamaConfig.load(path)


def load_checkpoint(directory: str, shardings: Weights | None = None, cfg: LlamaConfig | None = None):
    """Returns (config, params). Weights are restored into `shardings` when given, and
    into the config's dtype whatever dtype they were stored in."""
    directory = os.path.abspath(directory)
    cfg = cfg or load_config(directory)
    target = flatten_params(abstract_params(cfg, shardings))
    if shardings is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=device) for k, v in target.items()}
    with ocp.StandardCheckpointer() as ckptr:
        meta = ckptr.metadata(os.path.join(directory, PARAMS_DIR))
        check_format(directory, stored_format(meta))
        stored = getattr(meta, "item_metadata", meta)
        stored = getattr(stored, "tree", stored)
        _check_matches(directory, stored, target)
        # Read in the stored dtype, then cast: the cast keeps each array's sharding.
        read_as = {k: jax.ShapeDtypeStruct(v.shape, stored[k].dtype, sharding=v.sharding) for k, v in target.items()}
        flat = ckptr.restore(os.path.join(directory, PARAMS_DIR), read_as)
    flat.update(cast_flat(flat, {k: v.dtype for k, v in target.items()}))
    return cfg, unflatten_params(cfg, flat)


def cast_flat(flat: dict, dtypes: dict) -> dict:
    """The arrays of `flat` whose dtype differs from `dtypes[name]`, cast, each keeping its sharding: on the
    host when they live in this process's host memory anyway (CPU devices), else in one program. Why not
    `astype` array by array: each cast is then an eager op of its own to trace and compile, half a second
    of a small model's start."""
    names = [k for k, v in flat.items() if v.dtype != dtypes[k]]
    if not names:
        return {}
    targets = {k: dtypes[k] for k in names}
    if all(flat[k].is_fully_addressable and d.platform == "cpu" for k in names for d in flat[k].sharding.device_set):
        return {k: jax.device_put(np.asarray(flat[k]).astype(targets[k]), flat[k].sharding) for k in names}
    cast = jax.jit(lambda xs: {k: x.astype(targets[k]) for k, x in xs.items()},
                   out_shardings={k: flat[k].sharding for k in names})
    return cast({k: flat[k] for k in names})


def stored_format(metadata) -> int:
    """The format number in an orbax checkpoint's metadata (1 when it has none)."""
    custom = getattr(metadata, "custom_metadata", None) or {}
    return int(custom.get(FORMAT_KEY, 1))


def check_format(directory: str, version: int) -> None:
    if version == FORMAT_VERSION:
        return
    if version < FORMAT_VERSION:
        raise CheckpointFormatError(
            f"checkpoint {directory} is format {version} ({FORMAT_LAYOUTS.get(version, 'unknown layout')}); this "
            f"version reads format {FORMAT_VERSION} ({FORMAT_LAYOUTS[FORMAT_VERSION]}). Upgrade it once with "
            f"`python -m model.upgrade_checkpoint --dir={directory}`")
    raise CheckpointFormatError(f"checkpoint {directory} is format {version}, newer than the format "
                                f"{FORMAT_VERSION} this version reads; update ridgeline to load it")


def _check_matches(directory: str, stored, target) -> None:
    """One clear error when the stored weights do not fit the config (instead of orbax's)."""
    missing = sorted(set(target) - set(stored))
    extra = sorted(set(stored) - set(target))
    wrong = [f"{k}: stored {tuple(stored[k].shape)}, config expects {target[k].shape}"
             for k in sorted(set(target) & set(stored)) if tuple(stored[k].shape) != tuple(target[k].shape)]
    problems = []
    if missing:
        problems.append(f"missing weights {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if extra:
        problems.append(f"weights the config does not declare {extra[:5]}{' ...' if len(extra) > 5 else ''}")
    if wrong:
        problems.append("shape mismatches: " + "; ".join(wrong[:5]) + (" ..." if len(wrong) > 5 else ""))
    if problems:
        raise ValueError(f"checkpoint {directory} does not match its model config: " + "; ".join(problems))
