"""Qwen2.5-VL's vision encoder: a ViT over 14x14x2 patches with 2-D rotary positions, attention
inside windows of the image on most blocks and over the whole image on a few, and a merger that
turns each 2x2 group of patches into one token of the language model's width.

The work is split where the shapes are decided:
- `image_layout(grid, cfg)` (host, numpy) computes everything that depends only on the image's patch
  grid: the order that puts each attention window's patches next to each other, each patch's (row,
  column) rotary position, the window and whole-image segment ids, and the permutation back.
- `encode(weights, patches, layout, cfg)` (pure jax) runs the blocks on patches in that order.
So one compiled encoder serves every image of one grid, and the indices are data, not branches.

Attention is dense over the image's patches with a mask "same segment" (a window, or the image on
the full-attention blocks): for a few thousand patches the mask is cheap next to the matmuls; an
image far larger would want the segment-sparse kernel instead.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from model.declarations import normal_init, ones_init, pytree_dataclass, replicated, zeros_init
from model.vision.config import VisionConfig


@pytree_dataclass
class VisionBlock:
    norm1: Any  # [hidden]
    qkv: Any  # [3 * hidden, hidden]  (q rows, k rows, v rows; heads within each)
    qkv_bias: Any  # [3 * hidden]
    proj: Any  # [hidden, hidden]
    proj_bias: Any  # [hidden]
    norm2: Any  # [hidden]
    gate: Any  # [ffw, hidden]
    gate_bias: Any  # [ffw]
    up: Any  # [ffw, hidden]
    up_bias: Any  # [ffw]
    down: Any  # [hidden, ffw]
    down_bias: Any  # [hidden]

    @classmethod
    def declare(cls, v: VisionConfig, dtype) -> "VisionBlock":
        h, f = v.hidden_size, v.intermediate_size
        return cls(norm1=replicated((h,), dtype, ones_init), qkv=replicated((3 * h, h), dtype, normal_init(h)),
                   qkv_bias=replicated((3 * h,), dtype, zeros_init), proj=replicated((h, h), dtype, normal_init(h)),
                   proj_bias=replicated((h,), dtype, zeros_init), norm2=replicated((h,), dtype, ones_init),
                   gate=replicated((f, h), dtype, normal_init(h)), gate_bias=replicated((f,), dtype, zeros_init),
                   up=replicated((f, h), dtype, normal_init(h)), up_bias=replicated((f,), dtype, zeros_init),
                   down=replicated((h, f), dtype, normal_init(f)), down_bias=replicated((h,), dtype, zeros_init))


@pytree_dataclass
class VisionWeights:
    patch_embed: Any  # [hidden, channels * time * patch * patch]  (the Conv3d's kernel, flattened)
    blocks: list  # [VisionBlock] * depth
    merger_norm: Any  # [hidden]
    merger_fc1: Any  # [hidden * merge_unit, hidden * merge_unit]
    merger_fc1_bias: Any  # [hidden * merge_unit]
    merger_fc2: Any  # [out_hidden, hidden * merge_unit]
    merger_fc2_bias: Any  # [out_hidden]

    @classmethod
    def declare(cls, v: VisionConfig, dtype) -> "VisionWeights":
        h, m = v.hidden_size, v.hidden_size * v.merge_unit
        return cls(patch_embed=replicated((h, v.patch_dim), dtype, normal_init(v.patch_dim)),
                   blocks=[VisionBlock.declare(v, dtype) for _ in range(v.depth)],
                   merger_norm=replicated((h,), dtype, ones_init),
                   merger_fc1=replicated((m, m), dtype, normal_init(m)),
                   merger_fc1_bias=replicated((m,), dtype, zeros_init),
                   merger_fc2=replicated((v.out_hidden_size, m), dtype, normal_init(m)),
                   merger_fc2_bias=replicated((v.out_hidden_size,), dtype, zeros_init))


def checkpoint_tensors(v: VisionConfig, prefix: str = "model.visual."):
    """(ours, hf name, hf shape, relayout) of every encoder tensor, ours under `vision.`."""
    h, f, m = v.hidden_size, v.intermediate_size, v.hidden_size * v.merge_unit
    p, t = v.patch_size, v.temporal_patch_size
    same = lambda w: w  # noqa: E731
    out = [("vision.patch_embed", prefix + "patch_embed.proj.weight", (h, v.in_channels, t, p, p),
            lambda w: w.reshape(w.shape[0], -1))]
    for i in range(v.depth):
        o, b = f"vision.blocks.{i}.", f"{prefix}blocks.{i}."
        out += [(o + "norm1", b + "norm1.weight", (h,), same), (o + "qkv", b + "attn.qkv.weight", (3 * h, h), same),
                (o + "qkv_bias", b + "attn.qkv.bias", (3 * h,), same),
                (o + "proj", b + "attn.proj.weight", (h, h), same),
                (o + "proj_bias", b + "attn.proj.bias", (h,), same), (o + "norm2", b + "norm2.weight", (h,), same),
                (o + "gate", b + "mlp.gate_proj.weight", (f, h), same),
                (o + "gate_bias", b + "mlp.gate_proj.bias", (f,), same),
                (o + "up", b + "mlp.up_proj.weight", (f, h), same), (o + "up_bias", b + "mlp.up_proj.bias", (f,), same),
                (o + "down", b + "mlp.down_proj.weight", (h, f), same),
                (o + "down_bias", b + "mlp.down_proj.bias", (h,), same)]
    out += [("vision.merger_norm", prefix + "merger.ln_q.weight", (h,), same),
            ("vision.merger_fc1", prefix + "merger.mlp.0.weight", (m, m), same),
            ("vision.merger_fc1_bias", prefix + "merger.mlp.0.bias", (m,), same),
            ("vision.merger_fc2", prefix + "merger.mlp.2.weight", (v.out_hidden_size, m), same),
            ("vision.merger_fc2_bias", prefix + "merger.mlp.2.bias", (v.out_hidden_size,), same)]
    return out


# --- the host-side layout of one image's patches ---

@dataclasses.dataclass(frozen=True)
class ImageLayout:
    """What the encoder needs to know about one image's patch grid (numpy, host-computed).

    Patches are fed in *window order*: the processor emits them merge-group by merge-group in raster
    order; this order lists each attention window's merge groups together, so a window is a
    contiguous run of rows. `restore` puts the merged tokens back in the processor's order."""

    grid: tuple[int, int, int]  # (t, h, w) in patches
    order: np.ndarray  # [N] int32: patch row of the processor's output at each encoder position
    rope_hw: np.ndarray  # [N, 2] int32: (row, column) of each encoder position's patch
    window_segments: np.ndarray  # [N] int32: window id of each encoder position
    image_segments: np.ndarray  # [N] int32: frame id (whole-image attention)
    restore: np.ndarray  # [N / merge_unit] int32: merged token i of the output is row restore[i]

    @property
    def num_tokens(self) -> int:
        return len(self.restore)


def image_layout(grid: tuple[int, int, int], v: VisionConfig) -> ImageLayout:
    t, h, w = (int(x) for x in grid)
    m = v.spatial_merge_size
    if h % m or w % m:
        raise ValueError(f"patch grid {h}x{w} is not a multiple of the merge size {m}")
    # (row, column) of each patch in the processor's order: merge groups in raster order, the
    # m x m patches of a group in raster order inside it; repeated per frame.
    rows = np.arange(h)[:, None].repeat(w, 1).reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).reshape(-1)
    cols = np.arange(w)[None, :].repeat(h, 0).reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).reshape(-1)
    hw = np.tile(np.stack([rows, cols], -1), (t, 1))
    # Windows of ws x ws merge groups (the last row / column of windows may be partial).
    ws = v.window_size // m // v.patch_size
    gh, gw = h // m, w // m
    group = np.arange(t * gh * gw).reshape(t, gh, gw)
    win_r, win_c = np.arange(gh) // ws, np.arange(gw) // ws
    nwr, nwc = -(-gh // ws), -(-gw // ws)
    window_of_group = (np.arange(t)[:, None, None] * nwr * nwc + win_r[None, :, None] * nwc + win_c[None, None, :])
    # Stable sort by window keeps raster order inside a window (the reference's padding-then-drop order).
    group_order = group.reshape(-1)[np.argsort(window_of_group.reshape(-1), kind="stable")]
    unit = v.merge_unit
    order = (group_order[:, None] * unit + np.arange(unit)[None, :]).reshape(-1)
    window_segments = np.repeat(np.sort(window_of_group.reshape(-1), kind="stable"), unit)
    image_segments = order // (h * w)
    return ImageLayout(grid=(t, h, w), order=order.astype(np.int32), rope_hw=hw[order].astype(np.int32),
                       window_segments=window_segments.astype(np.int32),
                       image_segments=image_segments.astype(np.int32),
                       restore=np.argsort(group_order).astype(np.int32))


# --- the encoder (pure jax) ---

def _rms_norm(x, w, eps):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return w * y.astype(x.dtype)


def _act(name: str):
    if name == "silu":
        return jax.nn.silu
    if name == "quick_gelu":
        return lambda x: x * jax.nn.sigmoid(1.702 * x)
    return lambda x: jax.nn.gelu(x, approximate=name == "gelu_pytorch_tanh")


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


def _block(blk: VisionBlock, x, cos, sin, mask, v: VisionConfig):
    n, hd = x.shape[0], v.head_dim
    hid = _rms_norm(x, blk.norm1, v.norm_eps)
    qkv = (hid @ blk.qkv.T + blk.qkv_bias).reshape(n, 3, v.num_heads, hd)
    q, k, val = _rotate(qkv[:, 0], cos, sin), _rotate(qkv[:, 1], cos, sin), qkv[:, 2]
    scores = jnp.einsum("qhd,khd->hqk", q, k, preferred_element_type=jnp.float32) * hd ** -0.5
    scores = jnp.where(mask[None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    o = jnp.einsum("hqk,khd->qhd", probs, val).reshape(n, -1)
    x = x + o @ blk.proj.T + blk.proj_bias
    hid = _rms_norm(x, blk.norm2, v.norm_eps)
    mlp = _act(v.hidden_act)(hid @ blk.gate.T + blk.gate_bias) * (hid @ blk.up.T + blk.up_bias)
    return x + mlp @ blk.down.T + blk.down_bias


def encode(weights: VisionWeights, patches, layout_arrays: dict, v: VisionConfig):
    """Image tokens `[N / merge_unit, out_hidden]` of one image's `patches` `[N, patch_dim]` (the
    processor's order). `layout_arrays` are an `ImageLayout`'s arrays (`layout_arrays(layout)`)."""
    x = patches[layout_arrays["order"]].astype(weights.patch_embed.dtype) @ weights.patch_embed.T
    hd = v.head_dim
    inv_freq = 1.0 / (v.rope_theta ** (jnp.arange(0, hd // 2, 2, dtype=jnp.float32) / (hd // 2)))
    angles = (layout_arrays["rope_hw"].astype(jnp.float32)[:, :, None] * inv_freq).reshape(x.shape[0], -1)
    cos = jnp.concatenate([jnp.cos(angles)] * 2, -1)[:, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, -1)[:, None, :]
    win, img = layout_arrays["window_segments"], layout_arrays["image_segments"]
    window_mask, image_mask = win[:, None] == win[None, :], img[:, None] == img[None, :]
    for i, blk in enumerate(weights.blocks):
        x = _block(blk, x, cos, sin, image_mask if i in v.fullatt_block_indexes else window_mask, v)
    hid = _rms_norm(x, weights.merger_norm, v.norm_eps).reshape(-1, v.hidden_size * v.merge_unit)
    hid = jax.nn.gelu(hid @ weights.merger_fc1.T + weights.merger_fc1_bias, approximate=False)
    out = hid @ weights.merger_fc2.T + weights.merger_fc2_bias
    return out[layout_arrays["restore"]]


def layout_arrays(layout: ImageLayout) -> dict:
    return dict(order=layout.order, rope_hw=layout.rope_hw, window_segments=layout.window_segments,
                image_segments=layout.image_segments, restore=layout.restore)


encode_jit = jax.jit(encode, static_argnames=("v",))
