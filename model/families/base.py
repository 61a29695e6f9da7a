"""The record of a model family, and the two records it is made of.

A *family* is everything that differs between kinds of decoder checkpoint:
how its Hugging Face `config.json` becomes our config, which weights and KV
cache arrays it declares (shape, dtype, logical axes), which tensor of the HF
checkpoint each weight is read from, and the blocks its forward pass is built
of. The registry (`model.families`) looks a family up by the HF
`architectures` name, so a checkpoint reaches its family's code by that name
alone and nothing else asks "is this Llama?".

This module holds only the records (no jax), so a family module and the
registry can both import it without importing each other.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    """How one tensor of a Hugging Face checkpoint becomes one of our weights."""

    ours: str  # flat name, e.g. "layers.0.wq" (`model.params.flatten_params` naming)
    hf: str  # e.g. "model.layers.0.self_attn.q_proj.weight"
    hf_shape: tuple[int, ...]
    relayout: Callable[[np.ndarray], np.ndarray]  # HF array -> ours; a view where it can be
    # (index, count) when several HF tensors stack into one of ours along a new leading dim
    # (a mixture of experts' per-expert matrices): this one is entry `index` of `count`.
    stack: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class ForwardBlocks:
    """The functions a family's forward pass is built of.

    `model.forward.forward` runs them over the layers (the same driver for every
    family); other drivers of the same weights reassemble them too (the
    pipeline-parallel forward runs `attention` and `mlp` per stage, training
    reuses them), so they are named here rather than found by import path.
    """

    norm: Callable  # (x, weight, eps) -> x
    rope: Callable  # (cfg) -> inverse frequencies
    attention: Callable  # (layer, x, k_pages, v_pages, md, layer_inputs[i], cfg, backend, layout) -> (x, k, v)
    mlp: Callable  # (layer, x, cfg, layout) -> x
    logits: Callable  # (params, x, cfg, layout) -> fp32 logits
    embed: Callable  # (params, tokens, cfg, layout) -> x [T, embed]
    # (cfg) -> pytree of arrays with a leading [num_layers] dim: what differs per layer (RoPE
    # frequencies, sliding window), as data; `attention` gets layer i's slice.
    layer_inputs: Callable
    # (params, x, md, cfg, layout) -> x: what the batch adds to the token embeddings before the first layer
    # (an encoder's learned positions and token types); None: nothing.
    position_embed: Callable | None = None


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """One kind of decoder: a registry entry (`model.families.FAMILIES`).

    `architectures` are the HF `architectures` names it serves (the lookup key);
    `model_types` the HF `model_type` values it accepts from a `config.json`
    whose `architectures` names none of ours (older exports leave the list out).
    Parameter counts and KV bytes per token are not stored here: they are
    summed from `declare_weights` / `declare_cache` (`model.families.num_params`,
    `kv_bytes_per_token`), so they cannot disagree with the arrays.

    A loaded config finds its family by `config_class` and the HF architecture it
    records (`LlamaConfig.architecture`, "LlamaForCausalLM" by default, which a
    Llama `model_config.json` leaves out).
    """

    name: str  # human name, used in messages ("a 2-layer Llama")
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    config_class: type  # the configs this family runs (`family_for_config` dispatches on it)
    config_from_hf: Callable[..., Any]  # (hf config.json dict, dtype: str | None) -> config
    declare_weights: Callable[[Any], Any]  # cfg -> pytree of `ArrayInfo` (every weight)
    declare_cache: Callable[..., Any]  # (cfg, num_pages, page_size, dtype) -> pytree of `ArrayInfo`
    checkpoint_tensors: Callable[[Any], list[TensorPlan]]  # cfg -> every HF tensor, in our order
    blocks: ForwardBlocks
