"""Which float dtype a served model computes in (option `dtype`), and the cast into it.

Why not always the checkpoint's: XLA CPU has no fast 16-bit float matmul. It
converts each bf16 / fp16 operand to float32 before every dot, at every step,
and in the scanned layer loop (`layer_select`) those converts cover every
layer's weights each time one layer's matrix is picked. Measured on the 135M
Llama shape (30 layers, 2 CPU cores), one 16-token prefill: 3.3 s in bf16
against 0.07 s in float32 (unrolled bf16: 0.45 s). So on CPU a 16-bit
checkpoint computes in float32 unless the option says otherwise; GPUs compute
in the checkpoint's dtype, as vLLM's `--dtype auto` does.

The cast runs once, at load (`model.checkpoint.cast_flat`): float weights
take the new dtype, quantized ones keep their int8 / fp8 data and float32
scales. The KV cache follows the compute dtype unless `kv_cache_dtype` says
otherwise.
"""

from __future__ import annotations

import logging

import jax

from model.checkpoint import cast_flat
from model.params import abstract_params, flatten_params, unflatten_params

log = logging.getLogger("ridgeline.engine")

CHOICES = ("auto", "float32", "bfloat16", "float16")
SLOW_ON_CPU = ("bfloat16", "float16")  # computed in float32 there under "auto"


def resolve(choice: str, model_dtype: str, platform: str) -> str:
    """The dtype to compute in: `choice`, or for "auto" the model's (float32 on CPU for a 16-bit one)."""
    if choice not in CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(CHOICES)}; got {choice!r}")
    if choice != "auto":
        return choice
    return "float32" if platform == "cpu" and model_dtype in SLOW_ON_CPU else model_dtype


def apply(cfg, params, choice: str, platform: str | None = None, what: str = "the model"):
    """(config, params) computing in the dtype `choice` resolves to: unchanged when it is the config's;
    else the config with that dtype and its float weights cast (shardings kept)."""
    dtype = resolve(choice, cfg.dtype, platform or jax.default_backend())
    if dtype == cfg.dtype:
        return cfg, params
    if choice == "auto":
        log.info("%s computes in %s, not its checkpoint's %s: XLA CPU runs 16-bit matmuls through float32 "
                 "converts at every step (dtype=%s keeps it)", what, dtype, cfg.dtype, cfg.dtype)
    new_cfg = cfg.replace(dtype=dtype)
    flat = flatten_params(params)
    target = flatten_params(abstract_params(new_cfg))
    flat.update(cast_flat(flat, {k: v.dtype for k, v in target.items()}))
    return new_cfg, unflatten_params(new_cfg, flat)
