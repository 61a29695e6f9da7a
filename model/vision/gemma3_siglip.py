"""Gemma 3's image encoder: a SigLIP ViT over a fixed image_size x image_size image, and the projector
that turns its patch grid into `tokens_per_image` soft tokens of the language model's width.

SigLIP: non-overlapping patch x patch patches embedded by a linear map (the checkpoint's Conv2d kernel,
flattened), a learned position embedding per patch, then pre-LayerNorm blocks of full (unmasked)
multi-head attention and a GELU (tanh) MLP, and a final LayerNorm. The projector average-pools the
grid of patch outputs to sqrt(tokens) x sqrt(tokens), normalises each pooled row with Gemma's RMSNorm
(scaled by 1 + w) and projects it to the decoder's hidden size.

Every image has the same shape, so one compiled encoder serves them all. The weights are replicated
under tensor parallelism (declared with no sharded axis): the encoder is a small share of the model
(400M of Gemma 3 4B's 4.3B parameters) and runs once per image, off the decode path, its output cached
by image content in the serving layer.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from model.declarations import normal_init, ones_init, pytree_dataclass, replicated, zeros_init
from model.layers import rms_norm
from model.vision.config import VisionConfig


@pytree_dataclass
class SiglipBlock:
    norm1: Any  # [hidden]
    norm1_bias: Any  # [hidden]
    wq: Any  # [hidden, hidden]  (heads within the rows)
    q_bias: Any  # [hidden]
    wk: Any  # [hidden, hidden]
    k_bias: Any  # [hidden]
    wv: Any  # [hidden, hidden]
    v_bias: Any  # [hidden]
    wo: Any  # [hidden, hidden]
    o_bias: Any  # [hidden]
    norm2: Any  # [hidden]
    norm2_bias: Any  # [hidden]
    fc1: Any  # [ffw, hidden]
    fc1_bias: Any  # [ffw]
    fc2: Any  # [hidden, ffw]
    fc2_bias: Any  # [hidden]

    @classmethod
    def declare(cls, v: VisionConfig, dtype) -> "SiglipBlock":
        h, f = v.hidden_size, v.intermediate_size
        square = lambda: replicated((h, h), dtype, normal_init(h))  # noqa: E731
        vec = lambda init=zeros_init: replicated((h,), dtype, init)  # noqa: E731
        return cls(norm1=vec(ones_init), norm1_bias=vec(), wq=square(), q_bias=vec(), wk=square(), k_bias=vec(),
                   wv=square(), v_bias=vec(), wo=square(), o_bias=vec(), norm2=vec(ones_init), norm2_bias=vec(),
                   fc1=replicated((f, h), dtype, normal_init(h)), fc1_bias=replicated((f,), dtype, zeros_init),
                   fc2=replicated((h, f), dtype, normal_init(f)), fc2_bias=vec())


@pytree_dataclass
class SiglipWeights:
    patch_embed: Any  # [hidden, channels * patch * patch]  (the Conv2d's kernel, flattened c, y, x)
    patch_bias: Any  # [hidden]
    positions: Any  # [num_patches, hidden]
    blocks: list  # [SiglipBlock] * depth
    post_norm: Any  # [hidden]
    post_norm_bias: Any  # [hidden]
    soft_norm: Any  # [hidden]  (the projector's RMSNorm, scaled by 1 + w)
    projection: Any  # [hidden, decoder hidden]  (stored as the checkpoint stores it: x @ projection)

    @classmethod
    def declare(cls, v: VisionConfig, dtype) -> "SiglipWeights":
        h, pd = v.hidden_size, v.in_channels * v.patch_size ** 2
        return cls(patch_embed=replicated((h, pd), dtype, normal_init(pd)),
                   patch_bias=replicated((h,), dtype, zeros_init),
                   positions=replicated((num_patches(v), h), dtype, normal_init(h)),
                   blocks=[SiglipBlock.declare(v, dtype) for _ in range(v.depth)],
                   post_norm=replicated((h,), dtype, ones_init), post_norm_bias=replicated((h,), dtype, zeros_init),
                   soft_norm=replicated((h,), dtype, zeros_init),
                   projection=replicated((h, v.out_hidden_size), dtype, normal_init(h)))


def num_patches(v: VisionConfig) -> int:
    return (v.image_size // v.patch_size) ** 2


def checkpoint_tensors(v: VisionConfig, tower: str = "vision_tower.vision_model.",
                       projector: str = "multi_modal_projector."):
    """(ours, hf name, hf shape, relayout) of every encoder tensor, ours under `vision.`; the names are
    the published checkpoints' (transformers 5 writes the tower without `vision_model.`, which
    `model.convert_hf` finds too)."""
    h, f, c, p = v.hidden_size, v.intermediate_size, v.in_channels, v.patch_size
    same = lambda w: w  # noqa: E731
    plan = [("vision.patch_embed", tower + "embeddings.patch_embedding.weight", (h, c, p, p),
             lambda w: w.reshape(w.shape[0], -1)),
            ("vision.patch_bias", tower + "embeddings.patch_embedding.bias", (h,), same),
            ("vision.positions", tower + "embeddings.position_embedding.weight", (num_patches(v), h), same)]
    for i in range(v.depth):
        ours, hf = f"vision.blocks.{i}.", f"{tower}encoder.layers.{i}."
        plan += [(ours + "norm1", hf + "layer_norm1.weight", (h,), same),
                 (ours + "norm1_bias", hf + "layer_norm1.bias", (h,), same)]
        for mine, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "out_proj")):
            bias = "o_bias" if mine == "wo" else mine[1] + "_bias"
            plan += [(ours + mine, hf + f"self_attn.{theirs}.weight", (h, h), same),
                     (ours + bias, hf + f"self_attn.{theirs}.bias", (h,), same)]
        plan += [(ours + "norm2", hf + "layer_norm2.weight", (h,), same),
                 (ours + "norm2_bias", hf + "layer_norm2.bias", (h,), same),
                 (ours + "fc1", hf + "mlp.fc1.weight", (f, h), same), (ours + "fc1_bias", hf + "mlp.fc1.bias", (f,), same),
                 (ours + "fc2", hf + "mlp.fc2.weight", (h, f), same), (ours + "fc2_bias", hf + "mlp.fc2.bias", (h,), same)]
    plan += [("vision.post_norm", tower + "post_layernorm.weight", (h,), same),
             ("vision.post_norm_bias", tower + "post_layernorm.bias", (h,), same),
             ("vision.soft_norm", projector + "mm_soft_emb_norm.weight", (h,), same),
             ("vision.projection", projector + "mm_input_projection_weight", (h, v.out_hidden_size), same)]
    return plan


def _layer_norm(x, w, b, eps):
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, -1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), -1, keepdims=True)
    out = (x32 - mean) * jax.lax.rsqrt(var + eps) * w.astype(jnp.float32) + b.astype(jnp.float32)
    return out.astype(x.dtype)


def _block(blk: SiglipBlock, x, v: VisionConfig):
    n, nh, hd = x.shape[0], v.num_heads, v.head_dim
    h = _layer_norm(x, blk.norm1, blk.norm1_bias, v.norm_eps)
    q, k, val = ((h @ w.T + b).reshape(n, nh, hd) for w, b in ((blk.wq, blk.q_bias), (blk.wk, blk.k_bias),
                                                                 (blk.wv, blk.v_bias)))
    s = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k.astype(jnp.float32)) * hd ** -0.5
    o = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, axis=-1), val.astype(jnp.float32)).astype(x.dtype)
    x = x + o.reshape(n, -1) @ blk.wo.T + blk.o_bias
    h = _layer_norm(x, blk.norm2, blk.norm2_bias, v.norm_eps)
    h = jax.nn.gelu(h @ blk.fc1.T + blk.fc1_bias, approximate=v.hidden_act != "gelu")
    return x + h @ blk.fc2.T + blk.fc2_bias


def encode(weights: SiglipWeights, pixels, v: VisionConfig):
    """Soft tokens `[tokens_per_image, decoder hidden]` of one image's normalised `pixels`
    `[channels, image_size, image_size]` (the processor's output)."""
    c, p, side = v.in_channels, v.patch_size, v.image_size // v.patch_size
    # [C, H, W] -> one row per patch (row-major over the grid), each flattened c, y, x like the kernel.
    patches = pixels.reshape(c, side, p, side, p).transpose(1, 3, 0, 2, 4).reshape(side * side, c * p * p)
    x = patches.astype(weights.patch_embed.dtype) @ weights.patch_embed.T + weights.patch_bias + weights.positions
    for blk in weights.blocks:
        x = _block(blk, x, v)
    x = _layer_norm(x, weights.post_norm, weights.post_norm_bias, v.norm_eps)
    per_side = math.isqrt(v.tokens_per_image)
    k = side // per_side
    pooled = x.astype(jnp.float32).reshape(per_side, k, per_side, k, -1).mean(axis=(1, 3)).reshape(per_side ** 2, -1)
    normed = rms_norm(pooled, weights.soft_norm.astype(jnp.float32) + 1.0, v.norm_eps)
    return (normed @ weights.projection.astype(jnp.float32)).astype(x.dtype)


encode_jit = jax.jit(encode, static_argnames=("v",))
