"""Tiny Hugging Face checkpoints in the published quantized formats, written from a float transformers model
following each format's layout (the tensors and `quantization_config` that the quantizers write).

`fp8_block_checkpoint`: fine-grained FP8 (`quant_method` "fp8"): each linear weight `float8_e4m3fn`
[out, in] beside `weight_scale_inv` [ceil(out / 128), ceil(in / 128)], block max scaled to 448.
The float model is also returned with its linear weights replaced by the dequantized ones: the exact
reference of what the checkpoint stands for.
"""

from __future__ import annotations

import json
import os

import torch

LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_MAX = 448.0


def block_quantize_fp8(w: torch.Tensor, block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 data, fp32 scale_inv) of a [out, in] weight in blocks (partial edge blocks included)."""
    out, inp = w.shape
    bo, bi = block
    go, gi = -(-out // bo), -(-inp // bi)
    padded = torch.zeros(go * bo, gi * bi, dtype=torch.float32)
    padded[:out, :inp] = w.float()
    blocks = padded.reshape(go, bo, gi, bi)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(go * bo, gi * bi)[:out, :inp].contiguous(), scale.contiguous()


def dequantize_block_fp8(q: torch.Tensor, scale: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    rows = scale.repeat_interleave(block[0], 0)[: q.shape[0]].repeat_interleave(block[1], 1)[:, : q.shape[1]]
    return q.float() * rows


def _is_linear(name: str) -> bool:
    return name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEAR_SUFFIXES


def fp8_block_checkpoint(model, directory: str, block=(128, 128)):
    """Writes `model` (a float transformers model) as a fine-grained FP8 checkpoint in `directory`; returns
    `model` with its linear weights set to the dequantized values (in place)."""
    from safetensors.torch import save_file

    model.save_pretrained(directory)  # config, generation config
    for name in os.listdir(directory):
        if name.endswith(".safetensors") or name.endswith(".index.json"):
            os.remove(os.path.join(directory, name))
    tensors = {}
    state = model.state_dict()
    with torch.no_grad():
        for name, w in state.items():
            if name == "lm_head.weight" and model.config.tie_word_embeddings:
                continue
            if _is_linear(name):
                q, s = block_quantize_fp8(w, block)
                tensors[name], tensors[name + "_scale_inv"] = q, s
                w.copy_(dequantize_block_fp8(q, s, block).to(w.dtype))
            else:
                tensors[name] = w.contiguous()
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                  "weight_block_size": list(block),
                                  "modules_to_not_convert": [] if model.config.tie_word_embeddings else ["lm_head"]}
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
    return model
