"""The registry of model families, keyed on the Hugging Face `architectures` name.

A checkpoint's `config.json` names its class (`"architectures":
["LlamaForCausalLM"]`); `family_for_hf_config` maps that name to the
`ModelFamily` that knows how to translate the config, which weights and
cache arrays it declares, which HF tensor each weight comes from, and the
blocks of its forward (`model.families.base`). Config loading
(`from_hf_config`, `config_by_name` here) and checkpoint conversion
(`model.convert_hf`) go through it, so an unsupported checkpoint gets one
error, naming what is supported, wherever it is opened.

Sizes derive from the declarations, never from a formula of their own:
`num_params` sums the declared weight shapes, `kv_bytes_per_token` the
declared cache arrays of one token (scales of a quantized cache included).
Both work from a config alone (declarations are shapes; nothing is
allocated), so the planner can size a 405B preset on a laptop.

Llama came first; Qwen2/2.5, Qwen3, Mistral, Phi-3, Gemma 2 and Gemma 3 (text)
share its config class (with their own fields set, `model.config`) and its
weight and cache declarations, and run the decoder blocks of `model.blocks`;
Mixtral, Qwen2-MoE and Qwen3-MoE share it too, with a mixture-of-experts MLP (`model.moe`);
Qwen2.5-VL shares it with an image encoder and multimodal RoPE, Gemma 3 multimodal with a SigLIP
encoder and images attended both ways (`model.vision`).
A new family is a module beside `llama.py` and one entry in `FAMILIES`.
"""

from __future__ import annotations

import functools
import json
import math
import os
from typing import Any, Iterable

import jax
import jax.numpy as jnp

from model.config import CONFIGS_DIR, LlamaConfig, ModelConfig, UnsupportedModelError
from model.families.base import ForwardBlocks, ModelFamily, TensorPlan
from model.families.encoder import ENCODER
from model.families.gemma import GEMMA2, GEMMA3
from model.families.gemma3_vl import GEMMA3_VL
from model.families.llama import LLAMA
from model.families.mistral import MISTRAL
from model.families.phi3 import PHI3
from model.families.qwen import QWEN2, QWEN3
from model.families.qwen2_5_vl import QWEN2_5_VL_FAMILY
from model.families.mixtral import MIXTRAL
from model.families.qwen2_moe import QWEN2_MOE
from model.families.qwen3_moe import QWEN3_MOE
from model.quant import KV_CACHE_DTYPE_CHOICES, is_quantized, kv_cache_dtype

__all__ = ["FAMILIES", "ForwardBlocks", "ModelFamily", "TensorPlan", "config_by_name", "family_for_architectures",
           "family_for_config", "family_for_hf_config", "from_hf_config", "kv_bytes_per_token", "num_params",
           "active_params", "expert_params", "is_expert_weight", "supported_architectures"]

FAMILIES: tuple[ModelFamily, ...] = (LLAMA, QWEN2, QWEN3, MISTRAL, PHI3, GEMMA2, GEMMA3, MIXTRAL, QWEN2_MOE, QWEN3_MOE,
                                     QWEN2_5_VL_FAMILY, GEMMA3_VL, ENCODER)


def supported_architectures() -> list[str]:
    return [a for f in FAMILIES for a in f.architectures]


def _supported_text() -> str:
    return ", ".join(f"{a} ({f.name}; model_type {', '.join(map(repr, f.model_types))})"
                     for f in FAMILIES for a in f.architectures)


def family_for_architectures(names: Iterable[str] | None, model_type: str | None = None) -> ModelFamily:
    """The family serving any of the HF `architectures` `names`; failing that, the one that
    accepts `model_type`. Raises `UnsupportedModelError` naming the supported architectures."""
    names = list(names or [])
    for family in FAMILIES:
        if any(n in family.architectures for n in names):
            return family
    for family in FAMILIES:
        if model_type is not None and model_type in family.model_types:
            return family
    raise UnsupportedModelError(f"unsupported architecture: model_type={model_type!r}, architectures={names}; "
                                f"supported: {_supported_text()}")


def family_for_hf_config(hf: dict[str, Any]) -> ModelFamily:
    """The family of an HF `config.json` dict, by its `architectures` (or `model_type`)."""
    return family_for_architectures(hf.get("architectures") or [], hf.get("model_type"))


def from_hf_config(hf: dict[str, Any], dtype: str | None = None) -> ModelConfig:
    """Builds a config from an HF `config.json` dict (transformers 4 or 5 layout).

    The registry picks the family by the dict's `architectures` (or `model_type`) and
    raises `UnsupportedModelError`, naming what is supported, for any other; the
    family translates the fields (`model.families.llama.config_from_hf`)."""
    return family_for_hf_config(hf).config_from_hf(hf, dtype)


def config_by_name(name: str) -> ModelConfig:
    """A named shape from `configs/` ("tiny", "llama3-8b", ...) or a path to a JSON file: our
    own config JSON, or an HF `config.json` (one with `architectures` or `model_type`)."""
    path = name if name.endswith(".json") else os.path.join(CONFIGS_DIR, f"{name}.json")
    if not os.path.exists(path):
        names = sorted(f[:-5] for f in os.listdir(CONFIGS_DIR) if f.endswith(".json") and not f.startswith("rules"))
        raise FileNotFoundError(f"no model config {name!r}; known: {names}")
    with open(path) as f:
        d = json.load(f)
    if "architectures" in d or "model_type" in d:
        return from_hf_config(d)
    return LlamaConfig.from_dict(d)


def family_for_config(cfg) -> ModelFamily:
    """The family that runs `cfg`: by its config class and the HF architecture it records."""
    arch = getattr(cfg, "architecture", None)
    for family in FAMILIES:
        if isinstance(cfg, family.config_class) and arch in family.architectures:
            return family
    if not any(isinstance(cfg, f.config_class) for f in FAMILIES):
        raise UnsupportedModelError(f"no model family runs a {type(cfg).__name__}; "
                                    f"supported: {', '.join(sorted({f.config_class.__name__ for f in FAMILIES}))}")
    raise UnsupportedModelError(f"no model family runs architecture {arch!r}; supported: {_supported_text()}")


def _leaves(decl):
    """Declared arrays: `ArrayInfo`s, and quantized weights / pages as one `QuantizedArray` each."""
    return jax.tree.leaves(decl, is_leaf=is_quantized)


@functools.lru_cache(maxsize=32)
def num_params(cfg) -> int:
    """Parameters of `cfg`: the elements of every declared weight. A quantized weight counts
    its data, not its per-channel scales (those are bytes, not parameters).

    Cached per config (configs are frozen and hashable, being jit-static): declaring a 405B
    model's 1,100 weights takes ~10 ms, and startup logs, `Engine.describe` and the metrics'
    cost model each ask."""
    decl = family_for_config(cfg).declare_weights(cfg)
    return sum(math.prod((w.data if is_quantized(w) else w).shape) for w in _leaves(decl))


def is_expert_weight(info) -> bool:
    """A declared weight stacked over a mixture's experts (its first logical axis `experts`)."""
    data = info.data if is_quantized(info) else info
    return bool(data.logical_axes) and data.logical_axes[0] == "experts"


@functools.lru_cache(maxsize=32)
def expert_params(cfg) -> int:
    """Parameters in the experts' weights (0 for a dense model)."""
    decl = family_for_config(cfg).declare_weights(cfg)
    return sum(math.prod((w.data if is_quantized(w) else w).shape) for w in _leaves(decl) if is_expert_weight(w))


def active_params(cfg) -> int:
    """Parameters one token computes with: every weight but the experts it is not routed to
    (`num_experts_per_tok` of `num_experts`); `num_params` for a dense model."""
    experts = expert_params(cfg)
    if not experts:
        return num_params(cfg)
    return num_params(cfg) - experts + experts * cfg.num_experts_per_tok // cfg.num_experts


def kv_bytes_per_token(cfg, dtype=None, *, bytes_per_element: float | None = None):
    """Bytes one token occupies in the KV pool: the family's cache declared with room for one
    token (one page of one slot), summed over its arrays, so K and V of every layer and, for an
    int8 / fp8 cache, the scales beside the pages (`model.quant`).

    `dtype` is the pages' storage dtype: None for the model's, an engine `kv_cache_dtype` name
    ("auto", "int8", "fp8", "bfloat16", ...) or any dtype. `bytes_per_element`, when given, prices
    the cached elements nominally (the planner's int4, a cost model's assumed width); scales keep
    their real size.
    """
    if isinstance(dtype, str) and dtype in KV_CACHE_DTYPE_CHOICES:
        dtype = kv_cache_dtype(cfg, dtype)
    elif dtype is not None:
        dtype = jnp.dtype(dtype)
    decl = family_for_config(cfg).declare_cache(cfg, 1, 1, dtype)
    total = 0
    for leaf in _leaves(decl):
        data, scales = (leaf.data, [leaf.scale]) if is_quantized(leaf) else (leaf, [])
        element = jnp.dtype(data.dtype).itemsize if bytes_per_element is None else bytes_per_element
        total += math.prod(data.shape) * element
        total += sum(math.prod(s.shape) * jnp.dtype(s.dtype).itemsize for s in scales)
    return total
