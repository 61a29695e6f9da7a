"""GPTQ and AWQ 4-bit checkpoints (`quantization_config.quant_method` "gptq", as AutoGPTQ / GPTQModel publish
them) read into the grouped weight kind `int4_g<group>` (`model.quant.GroupQuantizedArray`, its 4-bit codes
held one per int8 byte).

Each quantized linear `<name>` is stored as (in = input columns, out = output rows, G = in / group):

* `<name>.qweight` int32 `[in / 8, out]`: eight 4-bit codes q per word along the input, code j of word
  i (bits 4j..4j+3) being input column 8i + j;
* `<name>.qzeros` int32 `[G, out / 8]`: the zero points packed the same way along the output; the gptq
  v1 format (`checkpoint_format` "gptq", the default) stores zero - 1;
* `<name>.scales` fp16 `[G, out]`; `<name>.g_idx` int32 `[in]`: the group of each input column.

The weight is `W[o, i] = scales[g_idx[i], o] * (q[i, o] - zero[g_idx[i], o])`. With `sym` true every zero
is 8, so `q - 8` is exactly a 4-bit code in [-8, 7]: it loads as those codes with one scale per output row and
per group of `group` consecutive input columns, never widened on the host (the step widens it inside
the jitted matmul, `model.quant.dequantize_grouped`). The zeros are checked to be 8 at load.

AWQ (`quant_method` "awq", `version` "gemm"): `qweight` int32 `[in, out / 8]` and `qzeros` `[G, out / 8]`
packed along the output in AWQ's interleaved order (`AWQ_ORDER`), zeros as stored (0..15), `scales`
fp16 `[G, out]`; it loads into the same kind with codes `q - zero` (exact in [-15, 15]).

Not read for GPTQ (a `ConversionError` naming the field): bits other than 4, `sym` false, `desc_act` true with a
`g_idx` that is not `i // group` (the groups of such a checkpoint are not contiguous), another
`checkpoint_format` than "gptq", and mixture-of-experts checkpoints.
"""

from __future__ import annotations

import math

import numpy as np

from model.hf_checks import ConversionError

PARTS = (".qweight", ".qzeros", ".scales")


def _refuser(method: str):
    def refuse(field, value, only):
        raise ConversionError(f"quantization_config.{field} {value!r} is not supported for quant_method {method!r} "
                              f"(only {only})")
    return refuse


def _group_size(qc: dict, refuse) -> int:
    group = qc.get("group_size")
    if not isinstance(group, int) or isinstance(group, bool) or group <= 0 or group % 8:
        refuse("group_size", group, "a positive multiple of 8")
    return group


def gptq_format(qc: dict, make):
    """The `QuantFormat` (built by `make(method, weight_dtype, block, ignore)`) of a GPTQ config."""
    refuse = _refuser("gptq")
    bits = qc.get("bits")
    if bits != 4:
        refuse("bits", bits, "4")
    if qc.get("sym", True) is not True:
        refuse("sym", qc.get("sym"), "true: symmetric zero points")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt != "gptq":
        refuse("checkpoint_format", fmt, "'gptq', the v1 layout")
    group = _group_size(qc, refuse)
    return make("gptq", f"int4_g{group}", (1, group), tuple(qc.get("modules_to_not_convert") or ()))


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ gemm: nibble p of a word holds output 8k + AWQ_ORDER[p]


def awq_format(qc: dict, make):
    """The `QuantFormat` of an AWQ config (version "gemm", 4-bit, zero points): codes q - zero."""
    refuse = _refuser("awq")
    if qc.get("bits") != 4:
        refuse("bits", qc.get("bits"), "4")
    if str(qc.get("version", "gemm")).lower() != "gemm":
        refuse("version", qc.get("version"), "'gemm'")
    if qc.get("zero_point", True) is not True:
        refuse("zero_point", qc.get("zero_point"), "true")
    group = _group_size(qc, refuse)
    return make("awq", f"int4_g{group}", (1, group), tuple(qc.get("modules_to_not_convert") or ()))


def unpack_int4(words: np.ndarray, axis: int) -> np.ndarray:
    """int32 words -> their eight 4-bit codes (uint8 0..15) along `axis`, code j from bits 4j..4j+3."""
    w = np.asarray(words).view(np.uint32)
    codes = np.stack([(w >> (4 * j)) & 0xF for j in range(8)], axis=axis + 1).astype(np.uint8)
    shape = list(w.shape)
    shape[axis] *= 8
    return codes.reshape(shape)


def _unpack_awq(words) -> np.ndarray:
    """AWQ's [rows, cols / 8] words -> [rows, cols] codes in column order (undoing `AWQ_ORDER`)."""
    codes = unpack_int4(words, 1)
    return codes.reshape(codes.shape[0], -1, 8)[..., np.argsort(AWQ_ORDER)].reshape(codes.shape)


# --- the format's part of `model.quant_formats.read_quantized` (a `WeightReader`) -----------------------

def _base(t) -> str:
    return t.hf[: -len(".weight")]


def marker(t) -> str:
    """The tensor that says the linear weight `t` is quantized: its `qweight` (in place of `<name>.weight`)."""
    return _base(t) + ".qweight"


def tensor_names(t, located) -> list[str]:
    base = _base(t)
    return [base + p for p in PARTS] + ([base + ".g_idx"] if base + ".g_idx" in located else [])


def check(t, files, located, fmt) -> None:
    """The packed tensors' dtypes and shapes against the weight's [out, in] and the group size, and a
    `g_idx` that keeps the groups contiguous."""
    base, group, awq = _base(t), fmt.block[1], fmt.method == "awq"
    out, inp = t.hf_shape
    words = (inp, out // 8) if awq else (inp // 8, out)
    want = {".qweight": ("I32", words), ".qzeros": ("I32", (inp // group, out // 8)),
            ".scales": (("F16", "BF16", "F32"), (inp // group, out))}
    if inp % group or out % 8:
        raise ConversionError(f"tensor {base}.qweight: [{out}, {inp}] is not whole groups of {group} inputs "
                              f"and words of 8 outputs")
    for part, (dtypes, shape) in want.items():
        dtype, got = files.info(base + part)
        if got != shape or dtype not in (dtypes if isinstance(dtypes, tuple) else (dtypes,)):
            raise ConversionError(f"tensor {base}{part} is {dtype} {list(got)}; group_size {group} over "
                                  f"[{out}, {inp}] implies {dtypes} {list(shape)}")
    if base + ".g_idx" in located:
        g_idx = np.asarray(files.read(base + ".g_idx"))
        if g_idx.shape != (inp,) or not np.array_equal(g_idx, np.arange(inp) // group):
            raise ConversionError(f"tensor {base}.g_idx is not i // group_size (desc_act true reorders the "
                                  f"groups): quantization_config.desc_act true is not supported")


def weight(t, files, fmt, data_decl, scale_decl):
    """The int8-held codes (GPTQ: q - 8; AWQ: q - zero) relaid out as ours, and the [G, out] scales as
    [out..., G]."""
    base, group = _base(t), fmt.block[1]
    scales = np.asarray(files.read(base + ".scales"), np.float32).T  # [out, G]
    if fmt.method == "awq":  # [in, out / 8] words along the output, interleaved; zeros as they are
        q, z = _unpack_awq(files.read(base + ".qweight")), _unpack_awq(files.read(base + ".qzeros"))
        data = q.T.astype(np.int8) - np.repeat(z.T.astype(np.int8), group, axis=1)  # [out, in], in [-15, 15]
    else:
        q = unpack_int4(files.read(base + ".qweight"), 0)  # [in, out], 0..15
        zeros = unpack_int4(files.read(base + ".qzeros"), 1).astype(np.int16) + 1  # gptq v1 stores zero - 1
        if not np.all(zeros == 8):
            raise ConversionError(f"tensor {base}.qzeros holds zero points other than 8: asymmetric weights "
                                  f"(quantization_config.sym false) are not supported")
        data = q.T.astype(np.int8) - 8  # [out, in], in [-8, 7]
    ours = np.ascontiguousarray(t.relayout(data))
    if ours.shape != tuple(data_decl.shape) or scales.size != math.prod(scale_decl.shape):
        raise ConversionError(f"tensor {base}.qweight: its layout in this family is not a reshape of [out, in]")
    return ours, np.ascontiguousarray(scales.reshape(scale_decl.shape))
