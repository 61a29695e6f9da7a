"""The image encoder run on a few padded patch counts, so an image of a new size compiles nothing.

`encoder.encode` compiles one program per patch grid: every new image size a client
sends would compile an encoder (seconds on a CPU, during a request). Here an image's patches are
padded up to the next of a few sizes (`bucket_sizes`: powers of two from the smallest image the
processor makes to its largest, then that largest), and the encoder runs on the padded arrays. The
padding is exact: Qwen2.5-VL's encoder attends within segments given as data (a window, or the whole
image), so the padded patches get a segment of their own (-1, which no real patch has) and no real
patch attends to them; they form whole merge groups after the real ones, and the merged rows taken
back (`restore`, padded with row 0) are cut to the image's tokens on the host. Every bucket compiles
at the engine's warm-up (`warm_up`), so after it no image size compiles anything.

An encoder kind without data-given segments runs exactly (`model.vision.encoder.encode`), one program
per grid.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from model.vision import encoder, qwen2_5_vl
from model.vision.config import QWEN2_5_VL, VisionConfig

PAD_SEGMENT = -1  # the padded patches' attention segment: no real patch's window or image id


def bucketed(v: VisionConfig) -> bool:
    """Whether this encoder kind runs padded to `bucket_sizes`."""
    return v.kind == QWEN2_5_VL


def bucket_sizes(v: VisionConfig) -> tuple[int, ...]:
    """The patch counts an image is padded to: powers of two from the processor's smallest image up to
    its largest, then the largest (each a multiple of the merge unit)."""
    unit, area = v.merge_unit, v.patch_size * v.patch_size
    most = -(-(v.max_pixels // area) // unit) * unit
    n = unit
    while n < v.min_pixels // area:
        n *= 2
    sizes = []
    while n < most:
        sizes.append(n)
        n *= 2
    return tuple(sizes) + (most,)


def bucket_for(num_patches: int, v: VisionConfig) -> int:
    for size in bucket_sizes(v):
        if size >= num_patches:
            return size
    raise ValueError(f"an image of {num_patches} patches exceeds the processor's largest "
                     f"({bucket_sizes(v)[-1]}); max_pixels={v.max_pixels}")


def padded_inputs(patches: np.ndarray, layout, size: int, v: VisionConfig) -> tuple[np.ndarray, dict]:
    """(patches, layout arrays) of one image padded to `size` patches (see the module docstring)."""
    n = patches.shape[0]
    pad = size - n
    arrays = qwen2_5_vl.layout_arrays(layout)
    out = dict(
        order=np.concatenate([arrays["order"], np.arange(n, size, dtype=np.int32)]),
        rope_hw=np.pad(arrays["rope_hw"], ((0, pad), (0, 0))),
        window_segments=np.concatenate([arrays["window_segments"], np.full(pad, PAD_SEGMENT, np.int32)]),
        image_segments=np.concatenate([arrays["image_segments"], np.full(pad, PAD_SEGMENT, np.int32)]),
        restore=np.concatenate([arrays["restore"], np.zeros(pad // v.merge_unit, np.int32)]))
    return np.pad(patches, ((0, pad), (0, 0))), out


def encode(weights, processed, v: VisionConfig) -> np.ndarray:
    """The encoder's output `[num_tokens, decoder hidden]` (float32, host) of one processed image, run
    at its bucket's size; exact (`encoder.encode`) for a kind that is not bucketed."""
    if not bucketed(v):
        return encoder.encode(weights, processed, v)
    layout = qwen2_5_vl.image_layout(processed.grid, v)
    patches, arrays = padded_inputs(processed.patches, layout, bucket_for(processed.patches.shape[0], v), v)
    out = qwen2_5_vl.encode_jit(weights, patches, arrays, v)
    return np.asarray(out, np.float32)[:layout.num_tokens]


def compilation_count() -> int:
    """Encoder programs compiled so far in this process (every grid and bucket)."""
    return qwen2_5_vl.encode_jit._cache_size()


def warm_up(weights, v: VisionConfig) -> dict:
    """Compiles the encoder at every bucket (an all-padding image: nothing real is computed)."""
    if not bucketed(v):
        return {"seconds": 0.0, "compiled": 0, "shapes": 0}
    t0, before = time.perf_counter(), compilation_count()
    sizes = bucket_sizes(v)
    for size in sizes:
        arrays = dict(order=np.arange(size, dtype=np.int32), rope_hw=np.zeros((size, 2), np.int32),
                      window_segments=np.full(size, PAD_SEGMENT, np.int32),
                      image_segments=np.full(size, PAD_SEGMENT, np.int32),
                      restore=np.zeros(size // v.merge_unit, np.int32))
        jax.block_until_ready(qwen2_5_vl.encode_jit(weights, np.zeros((size, v.patch_dim), np.float32), arrays, v))
    return {"seconds": time.perf_counter() - t0, "compiled": compilation_count() - before, "shapes": len(sizes)}
