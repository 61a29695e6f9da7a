"""The per-row sampling parameters of a step, declared once.

Each entry says what one sampling parameter is on the device: its name (the
field in the step's packed buffers and in `sampler.SamplingInputs`), its
dtype, how many values a row holds, the value of a row that does not use it
(padding rows, and rows of requests that leave it off), and how a request's
`SamplingParams` (and effective seed) give its value. Packing
(`input_batch.pack_step`), the step's unpacking (`model_runner.unpack_step`),
the draft model's packing and the sampler all read this table, so adding a
sampling parameter that acts on the device is its entry here and the code in
`sampler.py` that applies it.

A request's values are computed once, when it is made (`row_values`), and
copied into every row it samples.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np


def _as_int32(x: int) -> int:
    return ((x + 2**31) % 2**32) - 2**31


def _seed_words(request) -> tuple[int, int]:
    """The request's effective seed as the two int32 words of a threefry key."""
    seed = request.seed % 2**64
    return _as_int32(seed >> 32), _as_int32(seed & 0xFFFFFFFF)


# Counts past int32 mean the same as the largest int32: top_k beyond the vocabulary keeps every token,
# and min_tokens beyond any context window holds off EOS for the whole request.
_INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class RowParam:
    name: str
    dtype: Any  # np.int32 or np.float32: which of the step's two buffers holds it
    off: Any  # a row that does not use it
    of_request: Callable  # request -> its value (a scalar, or a tuple of `width` values)
    width: int = 1  # values per row
    device_dtype: Any = None  # the dtype the step reads it as (bit-cast from `dtype`), if another
    filters: bool = False  # a row not at `off` needs the sampler's sorting path (top-k / top-p style)
    help: str = ""


ROW_PARAMS: tuple[RowParam, ...] = (
    RowParam("temperature", np.float32, 0.0, lambda r: float(r.params.temperature), help="0 = greedy"),
    RowParam("top_k", np.int32, 0, lambda r: min(max(int(r.params.top_k), 0), _INT32_MAX), filters=True,
             help="<= 0 = off"),
    RowParam("top_p", np.float32, 1.0, lambda r: float(r.params.top_p), filters=True, help="1 = off"),
    RowParam("min_p", np.float32, 0.0, lambda r: float(r.params.min_p), help="0 = off"),
    # Read by `serving.features.sampling_controls.apply` for rows that hold a slot (a request using any of them does).
    RowParam("presence_penalty", np.float32, 0.0, lambda r: float(r.params.presence_penalty), help="0 = off"),
    RowParam("frequency_penalty", np.float32, 0.0, lambda r: float(r.params.frequency_penalty), help="0 = off"),
    RowParam("repetition_penalty", np.float32, 1.0, lambda r: float(r.params.repetition_penalty), help="1 = off"),
    RowParam("min_tokens", np.int32, 0, lambda r: min(int(r.params.min_tokens), _INT32_MAX),
             help="EOS and stop token ids are banned while token_index < min_tokens"),
    RowParam("key_data", np.int32, 0, _seed_words, width=2, device_dtype=np.uint32,
             help="the threefry key words of the request's seed"),
)
BY_NAME = {p.name: p for p in ROW_PARAMS}


def row_values(request) -> dict:
    """{parameter name: value} of a request, computed once per request."""
    return {p.name: p.of_request(request) for p in ROW_PARAMS}


def needs_filter(values: dict) -> bool:
    """Whether a (sampled, not greedy) row with these values needs the sampler's sorting path."""
    return any(values[p.name] != p.off for p in ROW_PARAMS if p.filters)


def buffer_fields(dtype, rows: int) -> tuple[tuple[str, int], ...]:
    """(name, size) of the parameters that live in the buffer of `dtype`, for `rows` rows."""
    return tuple((p.name, rows * p.width) for p in ROW_PARAMS if p.dtype is dtype)


def reset(views: dict) -> None:
    """Sets every row of every parameter to its `off` value (a fresh step's buffers)."""
    for p in ROW_PARAMS:
        views[p.name][...] = p.off


def write_row(views: dict, row: int, values: dict) -> None:
    """Copies one request's values into logit row `row`."""
    for name, value in values.items():
        views[name][row] = value


def shaped(views: dict, rows: int) -> None:
    """Gives multi-value parameters their [rows, width] shape (views of numpy or jax buffers)."""
    for p in ROW_PARAMS:
        if p.width > 1:
            views[p.name] = views[p.name].reshape(rows, p.width)
