"""compressed-tensors checkpoints (`quantization_config.quant_method` "compressed-tensors", what llm-compressor
writes: the "-FP8-dynamic", "-quantized.w4a16" and "-quantized.w8a8" checkpoints served with vLLM) read into
`model.quant`'s weight kinds. Read as the format's own library (`compressed_tensors.compressors`) writes it:

* `format` "pack-quantized", weights `int` 4-bit `symmetric` in groups (`strategy` "group", `group_size` G):
  `<name>.weight_packed` int32 `[out, in / 8]`, eight codes per word along the input, code j of a word in
  bits 4j..4j+3 and stored as q + 8 (q in [-8, 7]); `<name>.weight_scale` `[out, in / G]`; `<name>.weight_shape`
  int64 `[out, in]`. The weight is `scale * q`: it loads as kind `int4_g<G>`, the codes q held one per int8
  byte.
* `format` "float-quantized", weights `float` 8-bit (e4m3): `<name>.weight` float8_e4m3fn `[out, in]` and
  `<name>.weight_scale`: `[out, 1]` (`strategy` "channel") or `[1]` ("tensor") loads as kind `fp8` (one scale
  per output row; a tensor scale repeated over the rows); `[ceil(out / bo), ceil(in / bi)]` ("block",
  `block_structure` [bo, bi]) as kind `fp8_g<bi>`, as the fine-grained FP8 reader does.
* `format` "int-quantized" (or "naive-quantized"), weights `int` 8-bit `symmetric`, "channel" or "tensor":
  `<name>.weight` int8 and `<name>.weight_scale` as above: kind `int8`.

Input activations (`input_activations`, dynamic or with a static `input_scale`) are not quantized here: the
matmuls run in the compute dtype on the widened weights (weight-only, said once in the log), so a
"w8a8" checkpoint serves as "w8a16". Refused, naming the field: several config groups with different weight
schemes, asymmetric weights (zero points), `actorder` "group" (its `weight_g_idx` reorders the groups),
other bit widths, types, strategies and formats (nvfp4, mxfp4, sparse and transformed checkpoints), a
`kv_cache_scheme` (set `--kv_cache_dtype` instead) and mixture-of-experts checkpoints.
"""

from __future__ import annotations

import numpy as np

from model.hf_checks import ConversionError, in_our_layout
from model.quant_gptq import unpack_int4

METHOD = "compressed-tensors"
FORMATS = ("pack-quantized", "float-quantized", "int-quantized", "naive-quantized")


def _refuse(field: str, value, only: str):
    raise ConversionError(f"quantization_config.{field} {value!r} is not supported for quant_method {METHOD!r} "
                          f"(only {only})")


def compressed_format(qc: dict, make):
    """The `QuantFormat` (built by `make(method, weight_dtype, block, ignore)`) of a compressed-tensors config;
    its `method` names the storage ("compressed-tensors:pack", ":float", ":int")."""
    for field in ("sparsity_config", "transform_config"):
        if qc.get(field):
            _refuse(field, qc[field], "none: sparse and transformed checkpoints are not read")
    if qc.get("kv_cache_scheme"):
        _refuse("kv_cache_scheme", qc["kv_cache_scheme"], "null: quantize the KV cache with --kv_cache_dtype")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        _refuse("config_groups", groups, "one or more groups with a weights scheme")
    schemes = [g.get("weights") for g in groups.values()]
    if any(s != schemes[0] for s in schemes):
        _refuse("config_groups", sorted(groups), "groups that quantize their weights alike (one weight kind)")
    w = schemes[0]
    if not isinstance(w, dict):
        _refuse("config_groups.*.weights", w, "a weights scheme")
    formats = {g.get("format") for g in groups.values()} - {None}
    fmt = qc.get("format") if not formats else formats.pop() if len(formats) == 1 else sorted(formats)
    if fmt not in FORMATS:
        _refuse("format", fmt, f"one of {list(FORMATS)}")
    if w.get("symmetric", True) is not True:
        _refuse("config_groups.*.weights.symmetric", w.get("symmetric"), "true: no zero points")
    if w.get("dynamic", False):
        _refuse("config_groups.*.weights.dynamic", w.get("dynamic"), "false")
    if w.get("actorder") == "group":
        _refuse("config_groups.*.weights.actorder", "group", "null, 'weight' or 'static': contiguous groups")
    bits, kind, strategy = w.get("num_bits"), w.get("type", "int"), w.get("strategy")
    ignore = tuple(qc.get("ignore") or ())
    if fmt == "pack-quantized":
        if (bits, kind) != (4, "int"):
            _refuse("config_groups.*.weights.num_bits", bits, "4-bit int weights with format 'pack-quantized'")
        if strategy != "group":
            _refuse("config_groups.*.weights.strategy", strategy, "'group' for 4-bit weights")
        group = w.get("group_size")
        if not isinstance(group, int) or isinstance(group, bool) or group <= 0 or group % 8:
            _refuse("config_groups.*.weights.group_size", group, "a positive multiple of 8")
        return make(METHOD + ":pack", f"int4_g{group}", (1, group), ignore)
    storage = "float" if fmt == "float-quantized" else "int"
    if (bits, kind) != (8, storage):
        _refuse("config_groups.*.weights.num_bits", f"{bits}-bit {kind}", f"8-bit {storage} with format {fmt!r}")
    if strategy in ("channel", "tensor"):
        return make(f"{METHOD}:{storage}", "fp8" if storage == "float" else "int8", (1, 1), ignore)
    if strategy == "block" and storage == "float":
        block = w.get("block_structure")
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            _refuse("config_groups.*.weights.block_structure", block, "[rows, columns]")
        return make(f"{METHOD}:float", f"fp8_g{block[1]}", (int(block[0]), int(block[1])), ignore)
    _refuse("config_groups.*.weights.strategy", strategy,
            "'channel' or 'tensor' (and 'block' for fp8) with 8-bit weights")


# --- the format's part of `model.quant_formats.read_quantized` (a `WeightReader`) -----------------------

def _base(t) -> str:
    return t.hf[: -len(".weight")]


def _packed(fmt) -> bool:
    return fmt.method.endswith(":pack")


def reader_for(fmt, weight_reader):
    """The `WeightReader` of a compressed-tensors format (`weight_reader` builds it from the four parts)."""
    packed = _packed(fmt)

    def marker(t):
        return _base(t) + (".weight_packed" if packed else ".weight_scale")

    def tensor_names(t, located):
        base = _base(t)
        names = ([base + ".weight_packed", base + ".weight_scale", base + ".weight_shape"] if packed
                 else [t.hf, base + ".weight_scale"])
        # A static activation scale, an act-order permutation, zero points: named so the name check passes and
        # `check` refuses the last two with their reason (the first is not used: weight-only).
        return names + [base + s for s in (".input_scale", ".weight_g_idx", ".weight_zero_point")
                        if base + s in located]

    return weight_reader(marker, tensor_names, _check, _weight)


def _check(t, files, located, fmt) -> None:
    base = _base(t)
    out, inp = t.hf_shape
    for part, why in ((".weight_zero_point", "zero points (asymmetric weights)"),
                      (".weight_g_idx", "a group permutation (actorder 'group')")):
        if base + part in located:
            raise ConversionError(f"tensor {base}{part}: {why} are not supported for quant_method {METHOD!r}")
    sdtype, sshape = files.info(base + ".weight_scale")
    if sdtype not in ("F32", "F16", "BF16"):
        raise ConversionError(f"tensor {base}.weight_scale has dtype {sdtype}; scales are float")
    if _packed(fmt):
        group = fmt.block[1]
        if inp % group or inp % 8:
            raise ConversionError(f"tensor {base}.weight_packed: [{out}, {inp}] is not whole groups of {group} "
                                  "inputs")
        want = {".weight_packed": ("I32", (out, inp // 8)), ".weight_scale": (sdtype, (out, inp // group)),
                ".weight_shape": ("I64", (2,))}
        for part, (dtype, shape) in want.items():
            got_dtype, got = files.info(base + part)
            if got != shape or got_dtype != dtype:
                raise ConversionError(f"tensor {base}{part} is {got_dtype} {list(got)}; group_size {group} over "
                                      f"[{out}, {inp}] implies {dtype} {list(shape)}")
        if np.asarray(files.read(base + ".weight_shape")).tolist() != [out, inp]:
            raise ConversionError(f"tensor {base}.weight_shape does not say [{out}, {inp}]")
        return
    dtype, shape = files.info(t.hf)
    want_dtype = "F8_E4M3" if fmt.weight_dtype.startswith("fp8") else "I8"
    if shape != (out, inp) or dtype != want_dtype:
        raise ConversionError(f"tensor {t.hf} is {dtype} {list(shape)}; expected {want_dtype} [{out}, {inp}]")
    bo, bi = fmt.block
    allowed = [(out, 1), (1,), ()] if fmt.block == (1, 1) else [(-(-out // bo), -(-inp // bi))]
    if tuple(sshape) not in allowed:
        raise ConversionError(f"tensor {base}.weight_scale has shape {list(sshape)}; expected one of "
                              f"{[list(a) for a in allowed]}")


def _weight(t, files, fmt, data_decl, scale_decl):
    """(data, scale) in our layout: int4 codes or the 8-bit data relaid out as ours, the scales as
    [out..., G] (grouped kinds) or [out...] (per-channel kinds)."""
    base = _base(t)
    out, inp = t.hf_shape
    scale = np.asarray(files.read(base + ".weight_scale"), np.float32)
    if _packed(fmt):
        data = (unpack_int4(files.read(base + ".weight_packed"), 1).astype(np.int16) - 8).astype(np.int8)
    else:
        data = files.read(t.hf)
        if fmt.block == (1, 1):  # one scale per output row ("tensor": the one scale for every row)
            scale = np.broadcast_to(scale.reshape(-1, 1), (out, 1))[:, 0]
        else:  # fp8 blocks: each block's scale over its rows
            scale = np.repeat(scale, fmt.block[0], axis=0)[:out]
    return in_our_layout(base, t, data, scale, data_decl, scale_decl, METHOD)
