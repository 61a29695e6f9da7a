"""Forward blocks of the decoder families beyond Llama (Qwen2/3, Mistral, Phi-3, Gemma 2/3).

The same pass as Llama's blocks (`model.forward`), with what these families
turn on through their config (`model.config.LlamaConfig`, all off for Llama):
q/k/v biases, per-head q/k RMSNorm, sliding-window attention, `(offset + w)`
RMSNorm, scaled embeddings, GeGLU, norms after attention and MLP ("sandwich"),
`query_pre_attn_scalar`, and attention / final-logit soft-capping. The config
fields are static, so a feature that is off costs nothing in the compiled
program; Llama keeps its own blocks, so its program is exactly what it was.

What differs between the layers of one model (Gemma's alternating local and
global layers: window and RoPE base) is per-layer data, `layer_inputs(cfg)`,
whose slice `[i]` each layer receives: every layer runs the same code on the
same weight structure, so the layers can be scanned.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from model.cache import BatchMetadata
from model.config import FULL_ATTENTION, SLIDING_ATTENTION, LlamaConfig
from model.declarations import Layer, Weights, pytree_dataclass
from model.layers import (_constrain, apply_rope_angles, head_projection, mrope_angles, output_projection,
                          paged_attention, rms_norm, rope_frequencies)
from model.linear import linear

# The window of a full-attention layer in a model that also has sliding ones: wider than any
# context, so the mask passes every key and the kernels start at the first page.
NO_WINDOW = 2**30


@pytree_dataclass
class LayerInputs:
    """Per-layer data, each leaf with a leading [layers] dim (a layer sees its own slice)."""

    inv_freq: jax.Array  # [layers, head_dim // 2]
    window: jax.Array | None  # [layers] int32 (NO_WINDOW on full layers); None when no layer slides


def layer_inputs(cfg: LlamaConfig) -> LayerInputs:
    kinds = cfg.layer_types or ((SLIDING_ATTENTION if cfg.sliding_window else FULL_ATTENTION),) * cfg.num_layers
    global_freq = rope_frequencies(cfg)
    local_freq = global_freq if cfg.rope_local_theta is None else rope_frequencies(
        cfg.replace(rope_theta=cfg.rope_local_theta, rope_scaling=None))
    inv_freq = jnp.stack([local_freq if k == SLIDING_ATTENTION else global_freq for k in kinds])
    window = None
    if cfg.sliding_window is not None:
        window = jnp.array([w or NO_WINDOW for w in cfg.layer_windows()], jnp.int32)
    return LayerInputs(inv_freq=inv_freq, window=window)


def norm(x, weight, cfg: LlamaConfig):
    """RMSNorm scaling by (cfg.norm_offset + w), in fp32 (Gemma's (1 + w); plain w otherwise)."""
    w = weight.astype(jnp.float32)
    return rms_norm(x, w + cfg.norm_offset if cfg.norm_offset else w, cfg.rms_norm_eps)


def _activation(cfg: LlamaConfig):
    return jax.nn.silu if cfg.hidden_act == "silu" else (lambda g: jax.nn.gelu(g, approximate=True))


def soft_cap(x, cap: float | None):
    return x if cap is None else cap * jnp.tanh(x / cap)


def attention_block(layer: Layer, x, k_pages, v_pages, md: BatchMetadata, inputs: LayerInputs, cfg: LlamaConfig,
                    backend, layout=None):
    h = norm(x, layer.attn_norm, cfg)
    q, k, v = (head_projection(h, w) for w in (layer.wq, layer.wk, layer.wv))
    if cfg.attention_bias:
        q, k, v = (a + b.astype(a.dtype) for a, b in ((q, layer.q_bias), (k, layer.k_bias), (v, layer.v_bias)))
    q = _constrain(layout, q, ("tokens", "q_heads", "head_dim"))
    k = _constrain(layout, k, ("tokens", "kv_heads", "head_dim"))
    v = _constrain(layout, v, ("tokens", "kv_heads", "head_dim"))
    if cfg.qk_norm:
        q, k = norm(q, layer.q_norm, cfg), norm(k, layer.k_norm, cfg)
    if cfg.mrope_section:  # multimodal positions (`model.vision.mrope`), given per token by the batch
        angles = mrope_angles(md.rope_positions, inputs.inv_freq, cfg.mrope_section)
    else:
        angles = md.positions.astype(jnp.float32)[:, None] * inputs.inv_freq[None, :]
    q, k = apply_rope_angles(q, angles), apply_rope_angles(k, angles)
    # Gemma 3 attends among one image's tokens both ways (each token's span end comes with the batch).
    span_end = md.span_end if cfg.vision is not None and cfg.vision.bidirectional else None
    o, k_pages, v_pages = paged_attention(backend, q, k, v, k_pages, v_pages, md, cfg, sm_scale=cfg.attention_scale,
                                          window=inputs.window, soft_cap=cfg.attn_logit_softcap, span_end=span_end)
    out = output_projection(o, layer.wo)
    if cfg.sandwich_norms:
        out = norm(out, layer.post_attn_norm, cfg)
    return _constrain(layout, x + out, ("tokens", "embed")), k_pages, v_pages


def mlp_block(layer: Layer, x, cfg: LlamaConfig, layout=None):
    h = norm(x, layer.mlp_norm, cfg)
    gate = _constrain(layout, linear("te,fe->tf", h, layer.w_gate), ("tokens", "ffw"))
    up = _constrain(layout, linear("te,fe->tf", h, layer.w_up), ("tokens", "ffw"))
    out = linear("tf,ef->te", _activation(cfg)(gate) * up, layer.w_down)
    if cfg.sandwich_norms:
        out = norm(out, layer.post_mlp_norm, cfg)
    return _constrain(layout, x + out, ("tokens", "embed"))


def embed_tokens(params: Weights, tokens, cfg: LlamaConfig, layout=None):
    x = params.embed[tokens].astype(cfg.jnp_dtype)
    if cfg.scale_embeddings:  # sqrt(hidden) rounded to the compute dtype first, as transformers does
        x = x * jnp.asarray(math.sqrt(cfg.hidden_size), cfg.jnp_dtype)
    return _constrain(layout, x, ("tokens", "embed"))


def output_logits(params: Weights, x, cfg: LlamaConfig, layout=None):
    x = norm(x, params.final_norm, cfg)
    head = params.embed if params.lm_head is None else params.lm_head
    logits = soft_cap(linear("te,ve->tv", x, head, preferred_element_type=jnp.float32), cfg.final_logit_softcap)
    return _constrain(layout, logits, ("tokens", "vocab"))
