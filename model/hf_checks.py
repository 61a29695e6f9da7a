"""The checks every Hugging Face checkpoint reader shares: its error type and the tensor-name check.

A module of its own so that the float converter (`model.convert_hf`) and the quantized readers
(`model.quant_formats`) both sit above it and neither imports the other to raise the same error.
"""

from __future__ import annotations

from model.config import ModelConfig

# Buffers some exporters keep in the state dict; they are recomputed, never read.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class ConversionError(ValueError):
    """The input directory cannot be converted; the message says why."""


def check_names(plan, names, cfg: ModelConfig, missing_for: str, part_of: str, sort_missing: bool = False) -> None:
    """Every planned tensor name (`plan`: items with an `.hf` name) among `names`, and no other (but
    those conversion ignores); a `ConversionError` naming the first five of either kind."""
    wanted = {t.hf for t in plan}
    missing = [t.hf for t in plan if t.hf not in names]
    if sort_missing:
        missing = sorted(set(missing))
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ConversionError(f"missing tensors for {missing_for}: {missing[:5]}{more}")
    unexpected = sorted(n for n in names if n not in wanted and not n.endswith(IGNORED_SUFFIXES)
                        and not (n == "lm_head.weight" and cfg.tie_word_embeddings))
    if unexpected:
        more = f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
        raise ConversionError(f"unexpected tensors (not part of {part_of}): {unexpected[:5]}{more}")


def in_our_layout(name: str, t, data, scale, data_decl, scale_decl, method: str):
    """A quantized weight read as `[out, in]` data and per-output-row scales (`scale`, flat or `[out, G]`), in our
    layout: the data relaid out as the plan says (`t.relayout`), the scales reshaped to the declared output
    dims; a `ConversionError` naming `name` where the family's layout is not a reshape of `[out, in]`."""
    import math

    import numpy as np

    ours = np.ascontiguousarray(t.relayout(data))
    if ours.shape != tuple(data_decl.shape) or scale.size != math.prod(scale_decl.shape):
        raise ConversionError(f"tensor {name}: its layout in this family is not a reshape of [out, in]; "
                              f"quant_method {method!r} is not read for it")
    return ours, np.ascontiguousarray(np.reshape(scale, scale_decl.shape))
