"""The encoder family: BERT and XLM-RoBERTa run by the engine's paged step (embedders and cross-encoders).

An encoder is a registry family like the decoders, so the engine serves it with everything else it has
(continuous batching, tensor parallelism, load-time quantization, LoRA, the server and the router). What
differs, all in this module:

* **attention is bidirectional within a prompt**: each token's span end (`BatchMetadata.span_end`, the
  mechanism Gemma 3's images use, which every attention backend takes) is its prompt's end, set by the
  pooling part, which also keeps an encoder prompt in one step (never chunked: a token must see the
  ones after it) and off the prefix cache (a page's K/V depend on the tokens after it);
* **post-LN blocks with biases**: LayerNorm after each residual, q/k/v/o and MLP biases, a plain GELU
  MLP (`w_up`, `w_down`; no gate), no RoPE;
* **learned absolute positions and token types** added to the token embeddings, then a LayerNorm
  (`position_embed`, after `embed`): positions from 0 (BERT) or after the padding id (XLM-RoBERTa,
  `position_offset`), token types from `BatchMetadata.token_types` (a cross-encoder's second segment);
* **no final norm** (the last layer ends with one) and no output head: generation is refused (the
  pooling part admits pooling requests only), the logits a step computes for its drawn token are the
  tied embeddings' and unused.

`model.families.bert` keeps the dense reference forward over padded batches (`encoder_forward`) and
the classifier heads; this family's checkpoint names and shapes are the same (`checkpoint_shapes`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from model.blocks import LayerInputs
from model.cache import BatchMetadata, KVCache
from model.config import LlamaConfig
from model.declarations import ArrayInfo, linear_weight, normal_init, ones_init, pytree_dataclass, zeros_init
from model.families import bert
from model.families.base import ForwardBlocks, ModelFamily, TensorPlan
from model.families.decoder import _bias_heads, _identity, _split_in_heads, _split_out_heads
from model.layers import _constrain, head_projection, output_projection, paged_attention
from model.linear import linear

ARCHITECTURES = ("BertModel", "XLMRobertaModel", "BertForSequenceClassification",
                 "XLMRobertaForSequenceClassification")


@pytree_dataclass
class EncoderLayer:
    # Linear weights are [out..., in...] as the decoders' (`model.declarations.linear_weight`).
    wq: Any  # [heads, head_dim, embed]
    wk: Any
    wv: Any
    q_bias: Any  # [heads, head_dim]
    k_bias: Any
    v_bias: Any
    wo: Any  # [embed, heads, head_dim]
    o_bias: Any  # [embed]
    attn_norm: Any  # [embed]: the LayerNorm after the attention's residual
    attn_norm_bias: Any
    w_up: Any  # [ffw, embed]
    up_bias: Any  # [ffw]
    w_down: Any  # [embed, ffw]
    down_bias: Any  # [embed]
    mlp_norm: Any  # [embed]: the LayerNorm after the MLP's residual
    mlp_norm_bias: Any

    @classmethod
    def declare(cls, cfg: LlamaConfig) -> "EncoderLayer":
        h, f, d, n, dt = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_heads, cfg.jnp_dtype
        lin = functools.partial(linear_weight, cfg)

        def vec(size, axis, init=zeros_init):
            return ArrayInfo((size,), dt, (axis,), init)

        def heads(axis):
            return ArrayInfo((n, d), dt, (axis, "head_dim"), zeros_init)

        return cls(
            wq=lin(ArrayInfo((n, d, h), dt, ("q_heads", "head_dim", "embed"), normal_init(h)), 2),
            wk=lin(ArrayInfo((n, d, h), dt, ("kv_heads", "head_dim", "embed"), normal_init(h)), 2),
            wv=lin(ArrayInfo((n, d, h), dt, ("kv_heads", "head_dim", "embed"), normal_init(h)), 2),
            q_bias=heads("q_heads"), k_bias=heads("kv_heads"), v_bias=heads("kv_heads"),
            wo=lin(ArrayInfo((h, n, d), dt, ("embed", "q_heads", "head_dim"), normal_init(n * d))),
            o_bias=vec(h, "norm"), attn_norm=vec(h, "norm", ones_init), attn_norm_bias=vec(h, "norm"),
            w_up=lin(ArrayInfo((f, h), dt, ("ffw", "embed"), normal_init(h))), up_bias=vec(f, "ffw"),
            w_down=lin(ArrayInfo((h, f), dt, ("embed", "ffw"), normal_init(f))), down_bias=vec(h, "norm"),
            mlp_norm=vec(h, "norm", ones_init), mlp_norm_bias=vec(h, "norm"),
        )


@pytree_dataclass
class EncoderWeights:
    embed: Any  # [vocab, embed]
    positions: Any  # [max_position_embeddings, embed]
    token_types: Any  # [type_vocab_size, embed]
    embed_norm: Any  # [embed]
    embed_norm_bias: Any
    layers: list
    final_norm: Any = None  # (none: the last layer ends with its LayerNorm)
    lm_head: Any = None  # (none: an encoder has no output head)

    @classmethod
    def declare(cls, cfg: LlamaConfig) -> "EncoderWeights":
        h, dt = cfg.hidden_size, cfg.jnp_dtype
        return cls(
            embed=ArrayInfo((cfg.vocab_size, h), dt, ("vocab", "embed"), normal_init(h)),
            positions=ArrayInfo((cfg.max_position_embeddings, h), dt, (None, "embed"), normal_init(h)),
            token_types=ArrayInfo((max(cfg.type_vocab_size, 1), h), dt, (None, "embed"), normal_init(h)),
            embed_norm=ArrayInfo((h,), dt, ("norm",), ones_init),
            embed_norm_bias=ArrayInfo((h,), dt, ("norm",), zeros_init),
            layers=[EncoderLayer.declare(cfg) for _ in range(cfg.num_layers)],
        )


def config_from_hf(hf: dict[str, Any], dtype: str | None = None) -> LlamaConfig:
    enc = bert.config_from_hf(hf, dtype)  # checks what the dense reference checks
    return LlamaConfig(
        vocab_size=enc.vocab_size, hidden_size=enc.hidden_size, intermediate_size=enc.intermediate_size,
        num_layers=enc.num_layers, num_heads=enc.num_heads, num_kv_heads=enc.num_heads, head_dim=enc.head_dim,
        rms_norm_eps=enc.layer_norm_eps, tie_word_embeddings=True, max_position_embeddings=enc.max_position_embeddings,
        dtype=enc.dtype, architecture=enc.architecture, attention_bias=True, bidirectional=True,
        hidden_act={"gelu": "gelu", "relu": "relu"}.get(enc.hidden_act, "gelu_tanh"),
        position_offset=enc.pad_token_id + 1 if enc.positions_after_padding else 0,
        type_vocab_size=enc.type_vocab_size)


def checkpoint_tensors(cfg: LlamaConfig) -> list[TensorPlan]:
    """The body's tensors, named as a base model saves them (a classifier prefixes them: `bert.`, `roberta.`)."""
    h, f, v, d, n = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim, cfg.num_heads
    plan = [TensorPlan("embed", "embeddings.word_embeddings.weight", (v, h), _identity),
            TensorPlan("positions", "embeddings.position_embeddings.weight", (cfg.max_position_embeddings, h),
                       _identity),
            TensorPlan("token_types", "embeddings.token_type_embeddings.weight", (max(cfg.type_vocab_size, 1), h),
                       _identity),
            TensorPlan("embed_norm", "embeddings.LayerNorm.weight", (h,), _identity),
            TensorPlan("embed_norm_bias", "embeddings.LayerNorm.bias", (h,), _identity)]
    for i in range(cfg.num_layers):
        p, a = f"layers.{i}.", f"encoder.layer.{i}."
        for ours, theirs in (("q", "query"), ("k", "key"), ("v", "value")):
            plan += [TensorPlan(p + "w" + ours, a + f"attention.self.{theirs}.weight", (n * d, h), _split_out_heads(n, d)),
                     TensorPlan(p + ours + "_bias", a + f"attention.self.{theirs}.bias", (n * d,), _bias_heads(n, d))]
        plan += [TensorPlan(p + "wo", a + "attention.output.dense.weight", (h, n * d), _split_in_heads(n, d)),
                 TensorPlan(p + "o_bias", a + "attention.output.dense.bias", (h,), _identity),
                 TensorPlan(p + "attn_norm", a + "attention.output.LayerNorm.weight", (h,), _identity),
                 TensorPlan(p + "attn_norm_bias", a + "attention.output.LayerNorm.bias", (h,), _identity),
                 TensorPlan(p + "w_up", a + "intermediate.dense.weight", (f, h), _identity),
                 TensorPlan(p + "up_bias", a + "intermediate.dense.bias", (f,), _identity),
                 TensorPlan(p + "w_down", a + "output.dense.weight", (h, f), _identity),
                 TensorPlan(p + "down_bias", a + "output.dense.bias", (h,), _identity),
                 TensorPlan(p + "mlp_norm", a + "output.LayerNorm.weight", (h,), _identity),
                 TensorPlan(p + "mlp_norm_bias", a + "output.LayerNorm.bias", (h,), _identity)]
    return plan


def _activation(cfg: LlamaConfig):
    if cfg.hidden_act == "relu":
        return jax.nn.relu
    return functools.partial(jax.nn.gelu, approximate=cfg.hidden_act != "gelu")


def embed_tokens(params: EncoderWeights, tokens, cfg: LlamaConfig, layout=None):
    return _constrain(layout, params.embed[tokens].astype(cfg.jnp_dtype), ("tokens", "embed"))


def position_embed(params: EncoderWeights, x, md: BatchMetadata, cfg: LlamaConfig, layout=None):
    """The token embeddings `x` plus each token's position and token-type embeddings, then the embeddings'
    LayerNorm."""
    types = jnp.zeros_like(md.positions) if md.token_types is None else md.token_types
    x = (x + params.positions[md.positions + cfg.position_offset].astype(x.dtype)
         + params.token_types[types].astype(x.dtype))
    return _constrain(layout, bert.layer_norm(x, params.embed_norm, params.embed_norm_bias, cfg.rms_norm_eps),
                      ("tokens", "embed"))


def attention_block(layer: EncoderLayer, x, k_pages, v_pages, md: BatchMetadata, inputs, cfg: LlamaConfig,
                    backend, layout=None):
    q, k, v = (head_projection(x, w) + b.astype(x.dtype) for w, b in ((layer.wq, layer.q_bias),
                                                                       (layer.wk, layer.k_bias),
                                                                       (layer.wv, layer.v_bias)))
    q = _constrain(layout, q, ("tokens", "q_heads", "head_dim"))
    k = _constrain(layout, k, ("tokens", "kv_heads", "head_dim"))
    v = _constrain(layout, v, ("tokens", "kv_heads", "head_dim"))
    # Both ways within the prompt: every token's span ends at its prompt's end (the pooling part's field).
    o, k_pages, v_pages = paged_attention(backend, q, k, v, k_pages, v_pages, md, cfg, sm_scale=cfg.attention_scale,
                                          span_end=md.span_end)
    out = output_projection(o, layer.wo) + layer.o_bias.astype(x.dtype)
    x = bert.layer_norm(x + out, layer.attn_norm, layer.attn_norm_bias, cfg.rms_norm_eps)
    return _constrain(layout, x, ("tokens", "embed")), k_pages, v_pages


def mlp_block(layer: EncoderLayer, x, cfg: LlamaConfig, layout=None):
    h = linear("te,fe->tf", x, layer.w_up) + layer.up_bias.astype(x.dtype)
    h = _constrain(layout, _activation(cfg)(h), ("tokens", "ffw"))
    out = linear("tf,ef->te", h, layer.w_down) + layer.down_bias.astype(x.dtype)
    return _constrain(layout, bert.layer_norm(x + out, layer.mlp_norm, layer.mlp_norm_bias, cfg.rms_norm_eps),
                      ("tokens", "embed"))


def output_logits(params: EncoderWeights, x, cfg: LlamaConfig, layout=None):
    """The tied embeddings' logits (an encoder has no head; the token a pooling request draws is unused)."""
    return _constrain(layout, linear("te,ve->tv", x, params.embed, preferred_element_type=jnp.float32),
                      ("tokens", "vocab"))


def layer_inputs(cfg: LlamaConfig) -> LayerInputs:
    """No per-layer data (no RoPE, no windows): a one-wide placeholder the scan slices."""
    return LayerInputs(inv_freq=jnp.zeros((cfg.num_layers, 1), jnp.float32), window=None)


ENCODER = ModelFamily(
    name="encoder (BERT / XLM-RoBERTa)",
    architectures=ARCHITECTURES,
    model_types=("bert", "xlm-roberta"),
    config_class=LlamaConfig,
    config_from_hf=config_from_hf,
    declare_weights=EncoderWeights.declare,
    declare_cache=KVCache.declare,
    checkpoint_tensors=checkpoint_tensors,
    blocks=ForwardBlocks(norm=lambda x, w, eps: x, rope=lambda cfg: None, attention=attention_block, mlp=mlp_block,
                         logits=output_logits, embed=embed_tokens, layer_inputs=layer_inputs,
                         position_embed=position_embed),
)
