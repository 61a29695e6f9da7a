"""The shape of a vision encoder and of its image preprocessing: one frozen, hashable record.

It is a field of the decoder's config (`LlamaConfig.vision`), so it is static under `jit` and
saved in `model_config.json` with the rest. The preprocessing fields come from the checkpoint's
`preprocessor_config.json` when conversion finds one (the processor's defaults otherwise): they
decide the number of placeholder tokens an image becomes, which the prompt must agree on.

This module imports nothing of the model, so `model.config` can import it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

QWEN2_5_VL = "qwen2_5_vl"
GEMMA3_SIGLIP = "gemma3_siglip"  # Gemma 3's SigLIP encoder and its projector to soft tokens
VISION_KINDS = (QWEN2_5_VL, GEMMA3_SIGLIP)

# OpenAI CLIP's normalisation, the Qwen2-VL processor's default.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# ImageNet "standard" normalisation (x - 0.5) / 0.5, the Gemma 3 (SigLIP) processor's default.
HALF = (0.5, 0.5, 0.5)


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    kind: str  # which encoder: one of VISION_KINDS
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int  # the decoder's hidden size: what one merged token becomes
    patch_size: int = 14
    in_channels: int = 3
    temporal_patch_size: int = 2  # a still image is repeated this many times along time
    spatial_merge_size: int = 2  # merge_size x merge_size patches become one token
    window_size: int = 112  # pixels on a side of one attention window (windowed blocks)
    fullatt_block_indexes: tuple[int, ...] = ()  # the blocks that attend over the whole image
    rope_theta: float = 10000.0
    hidden_act: str = "silu"
    # The ids one image occupies in a prompt before its placeholder is expanded (Qwen2.5-VL: vision
    # start, the image pad, vision end): what a chat's image part becomes. Empty: the image token alone.
    image_prompt_ids: tuple[int, ...] = ()
    # Text a chat's image part gets on each side of those ids, as the checkpoint's processor writes it
    # (Gemma 3's processor: a blank line, "\n\n", before and after); tokenized with the text around it.
    image_text_margin: str = ""
    norm_eps: float = 1e-6
    # --- preprocessing (the checkpoint processor's settings) ---
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    # --- fixed-size encoders (Gemma 3's SigLIP): every image is resized to image_size x image_size and
    # becomes tokens_per_image soft tokens (the patch grid average-pooled); 0 for the others ---
    image_size: int = 0
    tokens_per_image: int = 0

    def __post_init__(self):
        if self.kind not in VISION_KINDS:
            raise ValueError(f"vision kind must be one of {VISION_KINDS}, got {self.kind!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if self.hidden_act not in ("silu", "gelu", "gelu_pytorch_tanh", "quick_gelu"):
            raise ValueError(f"unsupported vision hidden_act {self.hidden_act!r}")
        if self.kind == GEMMA3_SIGLIP:
            side, per_side = self.image_size // max(self.patch_size, 1), math.isqrt(max(self.tokens_per_image, 0))
            if (self.image_size <= 0 or self.image_size % self.patch_size or per_side <= 0
                    or per_side * per_side != self.tokens_per_image or side % per_side):
                raise ValueError(f"image_size {self.image_size} / patch_size {self.patch_size} must give a square "
                                 f"patch grid that pools evenly to tokens_per_image {self.tokens_per_image} "
                                 "(a square number)")

    @property
    def bidirectional(self) -> bool:
        """Whether the decoder attends among one image's tokens both ways (Gemma 3), not causally:
        steps then carry each image token's span end (`kernels_pallas.reference`, `span_end`) and a
        prefill chunk never ends inside an image (`serving.features.multimodal`)."""
        return self.kind == GEMMA3_SIGLIP

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch: channels x time x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size ** 2

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in ("fullatt_block_indexes", "image_mean", "image_std", "image_prompt_ids"):
            d[k] = list(d[k])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "VisionConfig":
        d = dict(d)
        for k in ("fullatt_block_indexes", "image_mean", "image_std", "image_prompt_ids"):
            if k in d:
                d[k] = tuple(d[k])
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown vision config fields: {sorted(unknown)}")
        return cls(**d)


PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def with_processor_settings(v: VisionConfig, processor: dict[str, Any]) -> VisionConfig:
    """`v` with the preprocessing settings of a checkpoint's `preprocessor_config.json` (or the
    `image_processor` entry of `processor_config.json`): pixel bounds, mean, std, rescale factor."""
    processor = processor.get("image_processor", processor)
    if v.kind == GEMMA3_SIGLIP and processor.get("do_pan_and_scan"):
        raise ValueError("the image processor's do_pan_and_scan=True is not implemented (images are taken whole, "
                         "the processor's default)")
    size = processor.get("size") or {}
    changes: dict[str, Any] = {}
    if v.kind == QWEN2_5_VL:  # (Gemma 3's size is its encoder's image_size: position embeddings fix it)
        min_pixels = processor.get("min_pixels", size.get("shortest_edge", size.get("min_pixels")))
        max_pixels = processor.get("max_pixels", size.get("longest_edge", size.get("max_pixels")))
        if min_pixels is not None:
            changes["min_pixels"] = int(min_pixels)
        if max_pixels is not None:
            changes["max_pixels"] = int(max_pixels)
    elif size.get("height") not in (None, v.image_size) or size.get("width") not in (None, v.image_size):
        raise ValueError(f"the image processor's size {size} differs from the encoder's image_size {v.image_size}")
    for key in ("image_mean", "image_std"):
        if processor.get(key) is not None:
            changes[key] = tuple(float(x) for x in processor[key])
    if processor.get("rescale_factor") is not None:
        changes["rescale_factor"] = float(processor["rescale_factor"])
    return dataclasses.replace(v, **changes)
