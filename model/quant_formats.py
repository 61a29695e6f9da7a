"""Quantized Hugging Face checkpoints as they are published, read into `model.quant`'s weight kinds.

`config.json`'s `quantization_config` names the format (`quant_method`). Supported:

* `"compressed-tensors"` (llm-compressor's w4a16, FP8 and int8 checkpoints): `model.quant_compressed`.
* `"gptq"`, `"awq"` (4-bit): `model.quant_gptq`.
* `"fp8"`: the fine-grained FP8 of transformers' `FineGrainedFP8Config` (Qwen3-*-FP8, DeepSeek-V3):
  every quantized linear weight is `float8_e4m3fn` `[out, in]` beside a `weight_scale_inv` `[ceil(out /
  bo), ceil(in / bi)]` (`weight_block_size` `[bo, bi]`; fp32 or bf16), the weight being
  `data * scale_inv` block by block. A dimension that is not a multiple of the block gives a partial
  edge block (DeepSeek-V3's 576-row `kv_a_proj`). It loads as `GroupQuantizedArray` kind `fp8_g<bi>`: the
  fp8 data as stored, each block's scale repeated over its `bo` rows. Activations are quantized
  per token in blocks of `bi` by the published kernels (`activation_scheme` "dynamic"); here they stay
  in the compute dtype (weight-only), which is said once in the log.

Anything else (another `quant_method`, a variant field this reader does not implement) is a
`ConversionError` naming the field and its value, raised before any tensor is read.

Tensors come off disk through the safetensors header and a memory map (`_read_raw`): safetensors'
numpy reader has no float8, and the fp8 bytes must never be widened on the host. A linear weight the
checkpoint leaves unquantized (`modules_to_not_convert`) is quantized to the same kind at load from its
float values, and logged; an untied `lm_head` left in float (the usual case) stays float
(`LlamaConfig.float_lm_head`, `head_quantized`), as the checkpoint's own runtime computes it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types
from typing import Callable

import ml_dtypes
import numpy as np
from absl import logging

from model.config import ModelConfig
from model.hf_checks import ConversionError, check_names, in_our_layout
from model.quant import grouped_kind, quantize, quantize_grouped

# safetensors dtype names -> numpy dtypes (what `_read_raw` maps).
_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "F8_E4M3": ml_dtypes.float8_e4m3fn, "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
              "U8": np.uint8}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """A recognised `quantization_config`: its method, the weight kind it loads as, and the suffixes of
    the tensors that stand for one quantized weight (`{"": data, "_scale_inv": scales}`)."""

    method: str
    weight_dtype: str
    block: tuple[int, int]
    ignore: tuple[str, ...] = ()


def checkpoint_format(hf: dict) -> QuantFormat | None:
    """The quantized format `config.json` declares (None for a float checkpoint); a `ConversionError`
    naming the field and value this reader does not support."""
    qc = hf.get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise ConversionError(f"quantization_config must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method == "fp8":
        return _fp8_format(qc)
    if method == "gptq":
        from model.quant_gptq import gptq_format
        return gptq_format(qc, QuantFormat)
    if method == "awq":
        from model.quant_gptq import awq_format
        return awq_format(qc, QuantFormat)
    if method == "compressed-tensors":
        from model.quant_compressed import compressed_format
        return compressed_format(qc, QuantFormat)
    raise ConversionError(f"quantization_config.quant_method {method!r} is not supported; supported: 'fp8' "
                 f"(fine-grained block-scaled FP8), 'gptq' (4-bit, sym), 'awq' (4-bit gemm), 'compressed-tensors' "
                 f"(w4a16, fp8, int8)")


def _fp8_format(qc: dict) -> QuantFormat:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConversionError(f"quantization_config.fmt {fmt!r} is not supported for quant_method 'fp8' (only 'e4m3')")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ConversionError(f"quantization_config.activation_scheme {scheme!r} is not supported for quant_method 'fp8' "
                     f"(only 'dynamic')")
    block = qc.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ConversionError(f"quantization_config.weight_block_size {block!r} is not supported for quant_method 'fp8' "
                     f"(a [rows, columns] block is required; per-tensor fp8 is not read)")
    ignore = qc.get("modules_to_not_convert") or ()
    return QuantFormat("fp8", f"fp8_g{block[1]}", (int(block[0]), int(block[1])), tuple(ignore))


def _header(path: str) -> tuple[dict, int]:
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            return json.loads(f.read(n)), 8 + n
    except (OSError, ValueError) as e:
        raise ConversionError(f"cannot read {path}: {e}") from None


class _Files:
    """The safetensors headers of a checkpoint's files, read once; tensors memory-mapped by name."""

    def __init__(self, located: dict[str, str]):
        self.located = located
        self._headers: dict[str, tuple[dict, int]] = {}

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        meta = self._meta(name)
        return meta["dtype"], tuple(meta["shape"])

    def _meta(self, name: str) -> dict:
        path = self.located[name]
        if path not in self._headers:
            self._headers[path] = _header(path)
        return self._headers[path][0][name]

    def read(self, name: str) -> np.ndarray:
        """The stored tensor in its stored dtype (a read-only memory map, no conversion)."""
        meta = self._meta(name)
        path = self.located[name]
        start, end = meta["data_offsets"]
        dtype = _ST_DTYPES.get(meta["dtype"])
        if dtype is None:
            raise ConversionError(f"tensor {name} in {os.path.basename(path)} has dtype {meta['dtype']}, which is not read")
        count = math.prod(meta["shape"])
        if (end - start) != count * np.dtype(dtype).itemsize:
            raise ConversionError(f"tensor {name} in {os.path.basename(path)}: its byte range does not match its shape")
        offset = self._headers[path][1] + start
        return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=tuple(meta["shape"]))


@dataclasses.dataclass(frozen=True)
class WeightReader:
    """How a format stores one quantized linear weight `t` (a plan entry); `read_quantized` does the rest."""

    marker: Callable  # t -> the tensor whose presence says `t` is quantized (FP8: `<name>_scale_inv`)
    tensor_names: Callable  # (t, located) -> the checkpoint tensors that stand for the quantized weight
    check: Callable  # (t, files, located, fmt) -> None; a ConversionError where a tensor does not fit
    weight: Callable  # (t, files, fmt, data_decl, scale_decl) -> (data, scale) in our layout


def _reader(fmt: QuantFormat) -> WeightReader:
    if fmt.method.startswith("compressed-tensors"):
        from model.quant_compressed import reader_for

        return reader_for(fmt, WeightReader)
    if fmt.method in ("gptq", "awq"):
        from model import quant_gptq

        return WeightReader(quant_gptq.marker, quant_gptq.tensor_names, quant_gptq.check, quant_gptq.weight)
    return WeightReader(lambda t: t.hf + "_scale_inv", lambda t, located: [t.hf, t.hf + "_scale_inv"],
                        _check_fp8, _fp8_weight)


def head_quantized(plan, located: dict[str, str], fmt: QuantFormat) -> bool:
    """Whether the checkpoint stores its untied output head quantized (False: float, or tied)."""
    reader = _reader(fmt)
    return any(t.ours == "lm_head" and reader.marker(t) in located for t in plan)


def read_quantized(plan, located: dict[str, str], cfg: ModelConfig, fmt: QuantFormat, decl_flat: dict) -> dict:
    """Our flat {name: array} (`model.params.flatten_params` naming of `cfg`'s declarations `decl_flat`:
    a quantized weight's `.data` and `.scale`) from a quantized checkpoint: names, shapes and dtypes
    checked from the headers first (one `ConversionError`), then read one tensor at a time."""
    files, reader = _Files(located), _reader(fmt)
    quantized = {t.hf for t in plan if reader.marker(t) in located}
    names = [n for t in plan for n in (reader.tensor_names(t, located) if t.hf in quantized else [t.hf])]
    check_names([types.SimpleNamespace(hf=n) for n in names], located, cfg,
                f"a {cfg.num_layers}-layer {fmt.method} checkpoint", f"a {cfg.num_layers}-layer model as config.json "
                f"describes it")
    if any(t.stack is not None for t in plan):
        raise ConversionError(f"quant_method {fmt.method!r}: mixture-of-experts checkpoints are not read yet")
    for t in plan:
        if t.hf in quantized:
            if t.ours + ".data" not in decl_flat:
                raise ConversionError(f"tensor {t.hf} is quantized, but {t.ours} is not a linear weight this model "
                                      f"quantizes")
            reader.check(t, files, located, fmt)
            continue
        dtype, shape = files.info(t.hf)
        if shape != tuple(t.hf_shape):
            raise ConversionError(f"tensor {t.hf} has shape {list(shape)}, but config.json implies {list(t.hf_shape)}")
        if dtype not in FLOAT_DTYPES:
            raise ConversionError(f"tensor {t.hf} has dtype {dtype} and no {reader.marker(t)} beside it")
    flat, requantized = {}, []
    for t in plan:
        if t.hf in quantized:
            data, scale = reader.weight(t, files, fmt, decl_flat[t.ours + ".data"], decl_flat[t.ours + ".scale"])
        elif t.ours + ".data" in decl_flat:  # a float linear weight (modules_to_not_convert): the model's kind
            data_decl, scale_decl = decl_flat[t.ours + ".data"], decl_flat[t.ours + ".scale"]
            w = np.asarray(t.relayout(files.read(t.hf)), np.float32)
            if grouped_kind(cfg.weight_dtype) is not None:
                q = quantize_grouped(w, data_decl.dtype, len(scale_decl.shape) - 1, fmt.block[1])
            else:  # a per-output-channel kind (int8, fp8)
                q = quantize(w, cfg.weight_dtype, len(scale_decl.shape))
            data, scale = np.asarray(q.data), np.asarray(q.scale)
            requantized.append(t.hf)
        else:
            flat[t.ours] = np.array(t.relayout(files.read(t.hf)), dtype=np.dtype(cfg.jnp_dtype), order="C")
            continue
        flat[t.ours + ".data"], flat[t.ours + ".scale"] = data, scale
    if requantized:
        logging.info("%s checkpoint: %d float linear weight(s) quantized to %s at load (%s)", fmt.method,
                     len(requantized), cfg.weight_dtype,
                     ", ".join(requantized[:3]) + (" ..." if len(requantized) > 3 else ""))
    logging.warning("%s checkpoint: weights stay %s with their scales; activations are not quantized "
                    "(weight-only: the matmuls run in %s)", fmt.method, cfg.weight_dtype, cfg.dtype)
    return flat


def _check_fp8(t, files: _Files, located, fmt: QuantFormat) -> None:
    dtype, shape = files.info(t.hf)
    if shape != tuple(t.hf_shape):
        raise ConversionError(f"tensor {t.hf} has shape {list(shape)}, but config.json implies {list(t.hf_shape)}")
    if dtype != "F8_E4M3":
        raise ConversionError(f"tensor {t.hf} has dtype {dtype}; quant_method 'fp8' stores F8_E4M3 weights")
    if len(shape) != 2:
        raise ConversionError(f"tensor {t.hf}: a block-scaled weight must be 2-D, got shape {list(shape)}")
    sdtype, sshape = files.info(t.hf + "_scale_inv")
    want = tuple(-(-n // b) for n, b in zip(shape, fmt.block))
    if sshape != want:
        raise ConversionError(f"tensor {t.hf}_scale_inv has shape {list(sshape)}; weight_block_size {list(fmt.block)} "
                     f"over {list(shape)} implies {list(want)}")
    if sdtype not in FLOAT_DTYPES:
        raise ConversionError(f"tensor {t.hf}_scale_inv has dtype {sdtype}; block scales are float")


def _fp8_weight(t, files: _Files, fmt: QuantFormat, data_decl, scale_decl) -> tuple[np.ndarray, np.ndarray]:
    """One block-scaled weight: its fp8 data relaid out as ours (a reshape of the head dims), each
    block's scale repeated over the block's rows ([out, G] -> our output dims)."""
    data = files.read(t.hf)
    out = data.shape[0]
    scale = np.asarray(files.read(t.hf + "_scale_inv"), np.float32)
    rows = np.repeat(scale, fmt.block[0], axis=0)[:out]
    return in_our_layout(t.hf, t, data, rows, data_decl, scale_decl, fmt.method)
