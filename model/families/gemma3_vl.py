"""Gemma 3 multimodal (`Gemma3ForConditionalGeneration`): the Gemma 3 text decoder
(`model.families.gemma`) with a SigLIP image encoder and a projector to soft tokens
(`model.vision.gemma3_siglip`).

`config.json` holds the decoder's fields under `text_config` and the encoder's under `vision_config`;
`image_token_index` is the soft token an image's embeddings take the place of, `boi_token_index` /
`eoi_token_index` the tokens around them, `mm_tokens_per_image` how many there are. A chat's image part
becomes begin-of-image, the soft token (expanded to `mm_tokens_per_image` by the engine) and
end-of-image, as the HF processor writes it (`VisionConfig.image_prompt_ids`).

The decoder attends among one image's soft tokens both ways, causally elsewhere
(`VisionConfig.bidirectional`); that mask lives in the attention backends (`span_end`).

Tensors are named as the published checkpoints name them (`language_model.model.*`,
`vision_tower.vision_model.*`, `multi_modal_projector.*`); transformers 5 writes the tower without
`vision_model.` and 4.52-4.57 nest everything under `model.`, which `model.convert_hf` finds too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from model.config import LlamaConfig, UnsupportedModelError
from model.declarations import Weights
from model.families.base import TensorPlan
from model.families.decoder import checkpoint_tensors as decoder_tensors
from model.families.decoder import family_entry, refuse
from model.families.gemma import gemma3_config_from_hf, gemma_norm
from model.vision.config import GEMMA3_SIGLIP, HALF, VisionConfig
from model.vision.gemma3_siglip import SiglipWeights
from model.vision.gemma3_siglip import checkpoint_tensors as vision_tensors

ARCH = "Gemma3ForConditionalGeneration"
# What transformers' Gemma3Processor writes on each side of an image's begin / soft tokens / end in the
# rendered text (its `full_image_sequence`), before tokenizing: a blank line.
GEMMA3_IMAGE_MARGIN = "\n\n"


def vision_config_from_hf(hf: dict[str, Any], out_hidden: int) -> VisionConfig:
    v = hf.get("vision_config") or {}
    refuse(v, ARCH, num_channels=(None, 3), hidden_act=(None, "gelu_pytorch_tanh", "gelu"))
    boi, eoi, image = hf.get("boi_token_index"), hf.get("eoi_token_index"), hf["image_token_index"]
    return VisionConfig(kind=GEMMA3_SIGLIP, depth=int(v.get("num_hidden_layers", 27)),
                        hidden_size=int(v.get("hidden_size", 1152)),
                        intermediate_size=int(v.get("intermediate_size", 4304)),
                        num_heads=int(v.get("num_attention_heads", 16)), out_hidden_size=out_hidden,
                        patch_size=int(v.get("patch_size", 14)), in_channels=3,
                        hidden_act=v.get("hidden_act", "gelu_pytorch_tanh"),
                        norm_eps=float(v.get("layer_norm_eps", 1e-6)), image_size=int(v.get("image_size", 896)),
                        tokens_per_image=int(hf.get("mm_tokens_per_image", 256)), image_mean=HALF, image_std=HALF,
                        image_prompt_ids=(int(boi), int(image), int(eoi)) if boi is not None and eoi is not None else (),
                        image_text_margin=GEMMA3_IMAGE_MARGIN)


def config_from_hf(hf: dict[str, Any], dtype: str | None = None) -> LlamaConfig:
    if "image_token_index" not in hf:
        raise UnsupportedModelError(f"{ARCH} config has no image_token_index")
    text = dict(hf.get("text_config") or {})
    for key in ("tie_word_embeddings", "dtype", "torch_dtype"):
        if key in hf and key not in text:
            text[key] = hf[key]
    text.setdefault("num_hidden_layers", 34)
    cfg = gemma3_config_from_hf(text, dtype, arch=ARCH)
    return cfg.replace(vision=vision_config_from_hf(hf, cfg.hidden_size), image_token_id=int(hf["image_token_index"]))


def declare_weights(cfg: LlamaConfig) -> Weights:
    return dataclasses.replace(Weights.declare(cfg), vision=SiglipWeights.declare(cfg.vision, cfg.jnp_dtype))


def checkpoint_tensors(cfg: LlamaConfig) -> list[TensorPlan]:
    text = [dataclasses.replace(t, hf="language_model." + t.hf) for t in decoder_tensors(cfg)]
    return text + [TensorPlan(ours, hf, shape, relayout) for ours, hf, shape, relayout in vision_tensors(cfg.vision)]


GEMMA3_VL = dataclasses.replace(family_entry("Gemma 3 multimodal", (ARCH,), ("gemma3",), config_from_hf,
                                             norm=gemma_norm),
                                declare_weights=declare_weights, checkpoint_tensors=checkpoint_tensors)
