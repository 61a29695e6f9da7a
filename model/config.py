"""Model configuration: one frozen dataclass describing a Llama-3-family decoder.

The config is hashable so it can be a static argument of `jax.jit`. It loads
from our own JSON (`configs/*.json`, `model_config.json` in a checkpoint) and
from a Hugging Face `config.json` written by transformers 4 or 5.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax.numpy as jnp

CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")

_DTYPES = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 style frequency-dependent RoPE scaling (HF `rope_type: llama3`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192
    dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Storage of the linear layers' weights: None (the compute dtype) or "int8" / "fp8"
    # with per-output-channel scales (model.quant). Compute stays in `dtype`.
    weight_dtype: str | None = None

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.weight_dtype not in (None, "int8", "fp8"):
            raise ValueError(f"weight_dtype must be None, 'int8' or 'fp8', got {self.weight_dtype!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def jnp_dtype(self):
        return _DTYPES[self.dtype]

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes) -> "LlamaConfig":
        return dataclasses.replace(self, **changes)

    # --- parameter and KV arithmetic, used by the planner and the metrics ---
    def num_params(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        per_layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * per_layer + h + head

    def kv_bytes_per_token(self, bytes_per_element: int | None = None) -> int:
        if bytes_per_element is None:
            bytes_per_element = jnp.dtype(self.jnp_dtype).itemsize
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element

    # --- serialization ---
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        if d["weight_dtype"] is None:  # float checkpoints keep the config file they always had
            del d["weight_dtype"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LlamaConfig":
        d = dict(d)
        scaling = d.get("rope_scaling")
        if isinstance(scaling, dict):
            d["rope_scaling"] = RopeScaling(**scaling)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown model config fields: {sorted(unknown)}")
        return cls(**d)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)

    @classmethod
    def load(cls, path: str) -> "LlamaConfig":
        with open(path) as f:
            return cls.from_dict(json.load(f))


def config_by_name(name: str) -> LlamaConfig:
    """A named shape from `configs/` ("tiny", "llama3-8b", ...) or a path to a JSON file."""
    path = name if name.endswith(".json") else os.path.join(CONFIGS_DIR, f"{name}.json")
    if not os.path.exists(path):
        names = sorted(f[:-5] for f in os.listdir(CONFIGS_DIR) if f.endswith(".json") and not f.startswith("rules"))
        raise FileNotFoundError(f"no model config {name!r}; known: {names}")
    with open(path) as f:
        d = json.load(f)
    if "architectures" in d or "model_type" in d:
        return from_hf_config(d)
    return LlamaConfig.from_dict(d)


class UnsupportedModelError(ValueError):
    """The checkpoint is not a Llama-family decoder this stack can run."""


def from_hf_config(hf: dict[str, Any], dtype: str | None = None) -> LlamaConfig:
    """Builds a config from an HF `config.json` dict (transformers 4 or 5 layout)."""
    model_type = hf.get("model_type")
    archs = hf.get("architectures") or []
    if model_type != "llama" and "LlamaForCausalLM" not in archs:
        raise UnsupportedModelError(
            f"unsupported architecture: model_type={model_type!r}, architectures={archs}; "
            "only Llama-family checkpoints (LlamaForCausalLM) are supported"
        )
    _check_llama_features(hf)
    missing = [k for k in _HF_REQUIRED if hf.get(k) is None]
    if missing:
        raise ValueError(f"HF config lacks required fields: {missing}")
    # transformers 5 nests rope settings under `rope_parameters`; 4 keeps them flat.
    rope = hf.get("rope_parameters") or {}
    rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type") not in (None, "default") else None)
    rope_scaling = None
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "llama3":
            rope_scaling = RopeScaling(
                factor=float(scaling["factor"]),
                low_freq_factor=float(scaling["low_freq_factor"]),
                high_freq_factor=float(scaling["high_freq_factor"]),
                original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
            )
        elif kind not in (None, "default"):
            raise UnsupportedModelError(f"unsupported rope scaling type {kind!r}; supported: llama3")
    heads = hf["num_attention_heads"]
    hidden = hf["hidden_size"]
    torch_dtype = dtype or hf.get("dtype") or hf.get("torch_dtype") or "bfloat16"
    if torch_dtype not in _DTYPES:
        torch_dtype = "bfloat16"
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return LlamaConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hidden // heads,
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
        dtype=torch_dtype,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


_HF_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _check_llama_features(hf: dict[str, Any]) -> None:
    """Rejects Llama variants whose weights would load but compute something else."""
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise UnsupportedModelError("unsupported Llama variant: projections with biases "
                                    "(attention_bias / mlp_bias) are not implemented")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"unsupported activation hidden_act={act!r}; Llama uses 'silu'")
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method", "?")
        raise UnsupportedModelError(f"quantized checkpoints ({method}) are not supported; use a float checkpoint")
