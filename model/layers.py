"""The computations a decoder is built of: norms, RoPE, paged attention, projections, and Llama's blocks.

The families (`model.families`) assemble their forward passes from these (Llama's blocks are
`attention_block`, `mlp_block`, `output_logits`, `embed_tokens` and `layer_rope`; the other dense
families' are in `model.blocks`), and `model.forward` runs a family's blocks over the layers. This
module knows no family and imports nothing above it.

Sharding is optional and outside the model: `layout` (default None) is any object with
`constrain(x, logical_axes) -> x` (`sharding.Layout` is one); with None no sharding code runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from model.cache import BatchMetadata
from model.config import LlamaConfig
from model.declarations import Layer, Weights
from model.linear import LoraWeight, PerLayer, linear
from model.quant import QuantizedArray


def rms_norm(x, weight, eps):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)


def rope_frequencies(cfg: LlamaConfig) -> jax.Array:
    """Inverse frequencies `[head_dim // 2]`, with Llama-3.1 scaling when configured."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    sc = cfg.rope_scaling
    if sc is None:
        return inv_freq
    if sc.rope_type == "linear":
        return inv_freq / sc.factor
    low_wavelen = sc.original_max_position_embeddings / sc.low_freq_factor
    high_wavelen = sc.original_max_position_embeddings / sc.high_freq_factor
    wavelen = 2 * jnp.pi / inv_freq
    smooth = (sc.original_max_position_embeddings / wavelen - sc.low_freq_factor) / (
        sc.high_freq_factor - sc.low_freq_factor
    )
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / sc.factor, inv_freq)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return jnp.where(mid, (1 - smooth) * inv_freq / sc.factor + smooth * inv_freq, scaled)


def apply_rope(x, positions, inv_freq):
    """HF's half-rotation convention: x = [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]."""
    return apply_rope_angles(x, positions.astype(jnp.float32)[:, None] * inv_freq[None, :])


def mrope_angles(rope_positions, inv_freq, sections: tuple[int, ...]):
    """Multimodal RoPE's angles `[T, d/2]`: frequency j of section s (of `sections`, which sum to
    d/2) turns by the token's position on axis s % 3 (temporal, height, width) of
    `rope_positions` `[3, T]` (`model.vision.mrope`)."""
    axis = jnp.asarray([s % 3 for s, n in enumerate(sections) for _ in range(n)], jnp.int32)
    per_freq = rope_positions.astype(jnp.float32)[axis]  # [d/2, T]
    return per_freq.T * inv_freq[None, :]


def apply_rope_angles(x, angles):
    """Rotates `x` `[T, heads, d]` by `angles` `[T, d/2]` (the half-rotation convention)."""
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, None, :]
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


def _constrain(layout, x, logical_axes):
    return x if layout is None else layout.constrain(x, logical_axes)


def paged_attention(backend, q, k, v, k_pages, v_pages, md: BatchMetadata, cfg: LlamaConfig, *,
                    sm_scale: float | None = None, window=None, soft_cap: float | None = None, span_end=None):
    """Writes this step's K/V into the cache and attends; returns (o, k_pages, v_pages).

    Pages are arrays, or `QuantizedArray`s (int8 / fp8 data + per-token scales)
    whose scales travel through the backend's optional `k_scale` / `v_scale`.
    `sm_scale` defaults to head_dim**-0.5; `window` (a traced int32 scalar) and
    `soft_cap` reach the backend only when given (`kernels_pallas.reference`); so does `span_end`
    `[T]` (bidirectional spans: Gemma 3's image tokens attend to each other both ways).
    """
    extra = {} if window is None and soft_cap is None else dict(window=window, soft_cap=soft_cap)
    if span_end is not None:
        extra["span_end"] = span_end
    sm_scale = cfg.head_dim**-0.5 if sm_scale is None else sm_scale
    if not isinstance(k_pages, QuantizedArray):
        k_pages, v_pages = backend.write_kv(k_pages, v_pages, k, v, md.slot_mapping)
        o = backend.attention(q, k_pages, v_pages, md.kv_lens, md.block_tables, md.cu_q_lens, md.num_seqs,
                              sm_scale=sm_scale, **extra)
        return o, k_pages, v_pages
    if not getattr(backend, "quantized_kv", False):
        raise ValueError(f"attention backend {backend.name!r} cannot read a quantized ({k_pages.dtype}) KV cache; "
                         "use kv_cache_dtype='auto' or a backend that supports it (reference, pallas)")
    kd, vd, ks, vs = backend.write_kv(k_pages.data, v_pages.data, k, v, md.slot_mapping,
                                      k_scale=k_pages.scale, v_scale=v_pages.scale)
    o = backend.attention(q, kd, vd, md.kv_lens, md.block_tables, md.cu_q_lens, md.num_seqs,
                          sm_scale=sm_scale, k_scale=ks, v_scale=vs, **extra)
    return o, QuantizedArray(kd, ks), QuantizedArray(vd, vs)


def _merge_heads(w, first: int):
    """A [heads, head_dim] pair of a weight's dims, starting at dim `first`, as one dim (a free
    reshape of the row-major array; a quantized weight's scale likewise where it has those dims).

    Why: XLA canonicalises a dot whose weight has several output dims to [contracting,
    non-contracting] and, with [out, in] weights, does so by transposing the whole weight on every
    call (measured on XLA CPU: batch-1 decode of a 125M model 3x slower). A 2-D [out, in] weight
    is contracted over its last dim as it is."""
    if isinstance(w, (PerLayer, LoraWeight)):  # every layer's matrix / the base under an adapter
        return w.map(functools.partial(_merge_heads, first=first))

    def merge(a):
        if a.ndim < first + 2:
            return a
        return a.reshape(a.shape[:first] + (a.shape[first] * a.shape[first + 1],) + a.shape[first + 2:])
    return QuantizedArray(merge(w.data), merge(w.scale)) if isinstance(w, QuantizedArray) else merge(w)


def head_projection(x, w):
    """x [T, embed] @ wq/wk/wv [heads, head_dim, embed] -> [T, heads, head_dim]."""
    heads, head_dim, _ = w.shape
    return linear("te,fe->tf", x, _merge_heads(w, 0)).reshape(x.shape[0], heads, head_dim)


def output_projection(o, w):
    """o [T, heads, head_dim] @ wo [embed, heads, head_dim] -> [T, embed]."""
    return linear("tf,ef->te", o.reshape(o.shape[0], -1), _merge_heads(w, 1))


def attention_block(layer: Layer, x, k_pages, v_pages, md: BatchMetadata, inv_freq, cfg: LlamaConfig, backend,
                    layout=None):
    h = rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
    q = _constrain(layout, head_projection(h, layer.wq), ("tokens", "q_heads", "head_dim"))
    k = _constrain(layout, head_projection(h, layer.wk), ("tokens", "kv_heads", "head_dim"))
    v = _constrain(layout, head_projection(h, layer.wv), ("tokens", "kv_heads", "head_dim"))
    q = apply_rope(q, md.positions, inv_freq)
    k = apply_rope(k, md.positions, inv_freq)
    o, k_pages, v_pages = paged_attention(backend, q, k, v, k_pages, v_pages, md, cfg)
    out = x + output_projection(o, layer.wo)
    return _constrain(layout, out, ("tokens", "embed")), k_pages, v_pages


def mlp_block(layer: Layer, x, cfg: LlamaConfig, layout=None):
    h = rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps)
    gate = _constrain(layout, linear("te,fe->tf", h, layer.w_gate), ("tokens", "ffw"))
    up = _constrain(layout, linear("te,fe->tf", h, layer.w_up), ("tokens", "ffw"))
    out = x + linear("tf,ef->te", jax.nn.silu(gate) * up, layer.w_down)
    return _constrain(layout, out, ("tokens", "embed"))


def output_logits(params: Weights, x, cfg: LlamaConfig, layout=None):
    x = rms_norm(x, params.final_norm, cfg.rms_norm_eps)
    head = params.embed if params.lm_head is None else params.lm_head  # both [vocab, embed]
    logits = linear("te,ve->tv", x, head, preferred_element_type=jnp.float32)
    return _constrain(layout, logits, ("tokens", "vocab"))


def embed_tokens(params: Weights, tokens, cfg: LlamaConfig, layout=None):
    return _constrain(layout, params.embed[tokens].astype(cfg.jnp_dtype), ("tokens", "embed"))


def layer_rope(cfg: LlamaConfig) -> jax.Array:
    """Llama's per-layer data: every layer's inverse frequencies, `[layers, head_dim // 2]` (all alike)."""
    inv_freq = rope_frequencies(cfg)
    return jnp.broadcast_to(inv_freq, (cfg.num_layers,) + inv_freq.shape)
