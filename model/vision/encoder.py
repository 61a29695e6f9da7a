"""One entry point per step of turning an image into placeholder embeddings, whatever the encoder:
`preprocess` (host: the checkpoint processor's pixels), `encode` (device: the encoder's output rows,
one per placeholder token) and `prompt_positions` (host: the decoder's positions of a prompt holding
images, for a model with multimodal RoPE). The serving layer calls only these, so a new encoder is a
branch here and a module beside `qwen2_5_vl` (Gemma 3's: `gemma3_siglip`, `gemma3_processor`).
`encoder_buckets` runs `encode` padded to a few sizes, so a new image size compiles nothing.
"""

from __future__ import annotations

import numpy as np

from model.vision import gemma3_processor, gemma3_siglip, mrope, qwen2_5_vl, qwen2_5_vl_processor
from model.vision.config import GEMMA3_SIGLIP, QWEN2_5_VL, VisionConfig


def preprocess(image, v: VisionConfig):
    """A `ProcessedImage` (patches, grid, num_tokens) of a PIL image or uint8 array."""
    if v.kind == QWEN2_5_VL:
        return qwen2_5_vl_processor.preprocess(image, v)
    if v.kind == GEMMA3_SIGLIP:
        return gemma3_processor.preprocess(image, v)
    raise ValueError(f"no preprocessing for vision kind {v.kind!r}")


def encode(weights, processed, v: VisionConfig) -> np.ndarray:
    """The encoder's output `[num_tokens, decoder hidden]` (float32, on the host) of one processed image."""
    if v.kind == QWEN2_5_VL:
        layout = qwen2_5_vl.layout_arrays(qwen2_5_vl.image_layout(processed.grid, v))
        out = qwen2_5_vl.encode_jit(weights, processed.patches, layout, v)
        return np.asarray(out, np.float32)
    if v.kind == GEMMA3_SIGLIP:
        return np.asarray(gemma3_siglip.encode_jit(weights, processed.patches, v), np.float32)
    raise ValueError(f"no encoder for vision kind {v.kind!r}")


def prompt_positions(cfg, token_ids, processed_images) -> tuple[np.ndarray | None, int]:
    """([3, len] positions, delta) of a prompt for a multimodal-RoPE decoder; (None, 0) for any other."""
    if not cfg.mrope_section:
        return None, 0
    return mrope.prompt_positions(token_ids, cfg.image_token_id, [p.grid for p in processed_images],
                                  cfg.vision.spatial_merge_size)
