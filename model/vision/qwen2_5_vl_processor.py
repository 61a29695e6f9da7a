"""Qwen2-VL / Qwen2.5-VL image preprocessing, as the checkpoint's processor
(`Qwen2VLImageProcessor`) does it, in numpy and Pillow.

resize: to the nearest multiple of patch x merge (28) on each side, the pixel count held within
[min_pixels, max_pixels] (`smart_resize`), bicubic, in 8-bit RGB; rescale by 1/255 and normalize by
CLIP's mean and std (float32); patch: the image repeated `temporal_patch_size` times along time, cut
into patches listed merge group by merge group, each flattened channels x time x row x column.
An image becomes `grid_h * grid_w / merge^2` placeholder tokens.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from PIL import Image

from model.vision.config import VisionConfig

MAX_ASPECT_RATIO = 200


@dataclasses.dataclass(frozen=True)
class ProcessedImage:
    patches: np.ndarray  # [grid_t * grid_h * grid_w, patch_dim] float32
    grid: tuple[int, int, int]  # (t, h, w) in patches
    num_tokens: int  # placeholder tokens in the prompt


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The processor's target size: sides multiples of `factor`, area within [min_pixels, max_pixels],
    the aspect ratio kept as well as those allow."""
    if min(height, width) <= 0:
        raise ValueError(f"image of size {width}x{height} is empty")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"image aspect ratio {max(height, width) / min(height, width):.0f} exceeds "
                         f"{MAX_ASPECT_RATIO}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def to_rgb(image) -> Image.Image:
    """A PIL image in RGB from a PIL image or an `[H, W, 3]` / `[H, W]` uint8 array."""
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8:
            raise ValueError(f"image arrays must be uint8 [H, W, C], got {image.dtype}")
        image = Image.fromarray(image)
    if not isinstance(image, Image.Image):
        raise TypeError(f"an image must be a PIL image or a uint8 array, got {type(image).__name__}")
    if image.mode == "RGB":
        return image
    # Every other mode goes through RGBA over white, as the processor converts it (transparent pixels white).
    rgba = image.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def num_image_tokens(height: int, width: int, v: VisionConfig) -> int:
    factor = v.patch_size * v.spatial_merge_size
    h, w = smart_resize(height, width, factor, v.min_pixels, v.max_pixels)
    return (h // v.patch_size) * (w // v.patch_size) // v.merge_unit


def preprocess(image, v: VisionConfig) -> ProcessedImage:
    image = to_rgb(image)
    factor = v.patch_size * v.spatial_merge_size
    height, width = smart_resize(image.height, image.width, factor, v.min_pixels, v.max_pixels)
    if (height, width) != (image.height, image.width):
        image = image.resize((width, height), resample=Image.Resampling.BICUBIC)
    pixels = np.asarray(image).transpose(2, 0, 1)  # [C, H, W] uint8
    pixels = (pixels.astype(np.float64) * v.rescale_factor).astype(np.float32)
    mean, std = np.asarray(v.image_mean, np.float32), np.asarray(v.image_std, np.float32)
    pixels = (pixels - mean[:, None, None]) / std[:, None, None]
    p, m, t, c = v.patch_size, v.spatial_merge_size, v.temporal_patch_size, pixels.shape[0]
    gh, gw = height // p, width // p
    patches = pixels.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    patches = np.broadcast_to(patches[:, :, :, :, :, None], patches.shape[:5] + (t,) + patches.shape[5:])
    patches = np.ascontiguousarray(patches.reshape(gh * gw, c * t * p * p))
    return ProcessedImage(patches=patches, grid=(1, gh, gw), num_tokens=gh * gw // v.merge_unit)
