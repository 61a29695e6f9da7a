"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): a Qwen2 decoder with multimodal RoPE and a
windowed ViT image encoder (`model.vision.qwen2_5_vl`).

The decoder is Qwen2's (q/k/v biases, the blocks of `model.blocks`), its rotary positions
three-dimensional (`mrope_section`, `model.vision.mrope`); the encoder's weights are `Weights.vision`.
`config.json` is read in both layouts transformers writes: the text fields under `text_config`
(transformers 5) or at the top (4), `vision_config` nested in both. Tensors are named as the
published checkpoints name them (`model.layers.*`, `visual.*`, `lm_head.weight`), which is also what
transformers 5 writes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from model.config import LlamaConfig
from model.declarations import Weights
from model.families.base import TensorPlan
from model.families.decoder import checkpoint_tensors as decoder_tensors
from model.families.decoder import family_entry, refuse
from model.families.llama import common_fields
from model.vision.config import QWEN2_5_VL, VisionConfig
from model.vision.qwen2_5_vl import VisionWeights
from model.vision.qwen2_5_vl import checkpoint_tensors as vision_tensors

ARCH = "Qwen2_5_VLForConditionalGeneration"


def vision_config_from_hf(v: dict[str, Any], out_hidden: int) -> VisionConfig:
    rope = v.get("rope_parameters") or {}
    return VisionConfig(kind=QWEN2_5_VL, depth=int(v["depth"]), hidden_size=int(v["hidden_size"]),
                        intermediate_size=int(v["intermediate_size"]), num_heads=int(v["num_heads"]),
                        out_hidden_size=int(v.get("out_hidden_size", out_hidden)),
                        patch_size=int(v.get("patch_size", 14)), in_channels=int(v.get("in_channels", 3)),
                        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
                        spatial_merge_size=int(v.get("spatial_merge_size", 2)),
                        window_size=int(v.get("window_size", 112)),
                        fullatt_block_indexes=tuple(int(i) for i in v.get("fullatt_block_indexes", ())),
                        rope_theta=float(rope.get("rope_theta", 10000.0)), hidden_act=v.get("hidden_act", "silu"))


def config_from_hf(hf: dict[str, Any], dtype: str | None = None) -> LlamaConfig:
    text = dict(hf.get("text_config") or hf)
    for key in ("tie_word_embeddings", "dtype", "torch_dtype"):
        if key in hf and key not in text:
            text[key] = hf[key]
    refuse(text, ARCH, hidden_act=(None, "silu"), use_sliding_window=(None, False))
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or hf.get("rope_scaling") or {})
    section = rope.get("mrope_section")
    if not section:
        raise ValueError(f"{ARCH} config has no mrope_section in rope_parameters / rope_scaling")
    theta = rope.get("rope_theta", text.get("rope_theta", 1000000.0))
    fields = common_fields(text, dtype, rope={"rope_theta": theta})
    if "image_token_id" not in hf:
        raise ValueError(f"{ARCH} config has no image_token_id")
    vision = vision_config_from_hf(hf["vision_config"], fields["hidden_size"])
    if hf.get("vision_start_token_id") is not None and hf.get("vision_end_token_id") is not None:
        vision = dataclasses.replace(vision, image_prompt_ids=(int(hf["vision_start_token_id"]),
                                                               int(hf["image_token_id"]),
                                                               int(hf["vision_end_token_id"])))
    return LlamaConfig(**fields, architecture=ARCH, attention_bias=True, vision=vision,
                       image_token_id=int(hf["image_token_id"]), mrope_section=tuple(int(s) for s in section))


def declare_weights(cfg: LlamaConfig) -> Weights:
    return dataclasses.replace(Weights.declare(cfg), vision=VisionWeights.declare(cfg.vision, cfg.jnp_dtype))


def checkpoint_tensors(cfg: LlamaConfig) -> list[TensorPlan]:
    return decoder_tensors(cfg) + [TensorPlan(ours, hf, shape, relayout)
                                   for ours, hf, shape, relayout in vision_tensors(cfg.vision, "visual.")]


QWEN2_5_VL_FAMILY = dataclasses.replace(
    family_entry("Qwen2.5-VL", (ARCH,), ("qwen2_5_vl",), config_from_hf),
    declare_weights=declare_weights, checkpoint_tensors=checkpoint_tensors)
