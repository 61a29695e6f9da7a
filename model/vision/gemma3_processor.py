"""Gemma 3 image preprocessing, as the checkpoint's processor (`Gemma3ImageProcessor`, SigLIP's) does it
with pan-and-scan off (its default), in numpy and Pillow.

resize: to the encoder's image_size x image_size (the aspect ratio is not kept), bilinear, in 8-bit
RGB; rescale by 1/255 and normalize by mean and std 0.5 (float32), channels first. Every image becomes
the same `tokens_per_image` soft tokens in the prompt (the processor writes them between the
begin-of-image and end-of-image tokens).
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from model.vision.config import VisionConfig
from model.vision.qwen2_5_vl_processor import ProcessedImage, to_rgb


def preprocess(image, v: VisionConfig) -> ProcessedImage:
    """`patches` holds the whole normalised image `[channels, image_size, image_size]`; `grid` is (1,
    patches per side, patches per side)."""
    image = to_rgb(image)
    if min(image.width, image.height) <= 0:
        raise ValueError(f"image of size {image.width}x{image.height} is empty")
    size = v.image_size
    if (image.width, image.height) != (size, size):
        image = image.resize((size, size), resample=Image.Resampling.BILINEAR)
    pixels = np.asarray(image).transpose(2, 0, 1)  # [C, H, W] uint8
    pixels = (pixels.astype(np.float64) * v.rescale_factor).astype(np.float32)
    mean, std = np.asarray(v.image_mean, np.float32), np.asarray(v.image_std, np.float32)
    pixels = np.ascontiguousarray((pixels - mean[:, None, None]) / std[:, None, None])
    side = size // v.patch_size
    return ProcessedImage(patches=pixels, grid=(1, side, side), num_tokens=v.tokens_per_image)
