"""Encoders: BERT and XLM-RoBERTa (embedders such as bge / e5 / MiniLM, bge-m3, and cross-encoder rerankers).

Bidirectional attention over a padded batch `[B, L]` with an attention mask, learned absolute
positions, token type embeddings, LayerNorm after each residual ("post-LN") and a GELU MLP,
with biases everywhere. XLM-RoBERTa is the same network; its positions start after the padding
id (`padding_idx + 1`, counted over the non-padding tokens, as transformers numbers them) and it
has one token type.

Unlike the decoder families (`model.families.FAMILIES`) an encoder has no KV cache and no
ragged paged forward: it is not a registry entry, and `encoder_forward` is a plain dense forward
(a whole prompt in one call). Its record is `ENCODERS`, keyed on the HF architecture name.

Heads (`classifier_logits`):

* `BertForSequenceClassification`: the pooler (dense + tanh on the first token), then `classifier`;
* `XLMRobertaForSequenceClassification`: `classifier.dense` + tanh on the first token, then
  `classifier.out_proj` (no pooler).

Weights are a flat dict of arrays named as in the HF checkpoint, without the `bert.` / `roberta.`
prefix a classifier adds (`model.pooling_heads.load_encoder` strips it): linear weights stay `[out, in]`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from model.config import UnsupportedModelError

_ACTS = {"gelu": lambda x: jax.nn.gelu(x, approximate=False), "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
         "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True), "relu": jax.nn.relu}


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    pad_token_id: int = 0
    # XLM-RoBERTa numbers positions from pad_token_id + 1 over the non-padding tokens; BERT from 0.
    positions_after_padding: bool = False
    num_labels: int = 0  # 0: no classifier head (a base model)
    classifier: str | None = None  # "bert" (pooler + classifier) or "roberta" (dense + out_proj)
    dtype: str = "float32"

    def __post_init__(self):
        if self.hidden_act not in _ACTS:
            raise UnsupportedModelError(f"unsupported encoder activation {self.hidden_act!r} (supported: {sorted(_ACTS)})")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclasses.dataclass(frozen=True)
class EncoderKind:
    architectures: tuple[str, ...]
    prefix: str  # the base model's prefix in a classifier's checkpoint
    positions_after_padding: bool
    classifier: str


BERT = EncoderKind(("BertModel", "BertForSequenceClassification"), "bert.", False, "bert")
XLM_ROBERTA = EncoderKind(("XLMRobertaModel", "XLMRobertaForSequenceClassification"), "roberta.", True, "roberta")
ENCODERS = {a: kind for kind in (BERT, XLM_ROBERTA) for a in kind.architectures}


def is_encoder(hf: dict[str, Any]) -> bool:
    return any(a in ENCODERS for a in hf.get("architectures") or [])


def config_from_hf(hf: dict[str, Any], dtype: str | None = None) -> EncoderConfig:
    archs = [a for a in hf.get("architectures") or [] if a in ENCODERS]
    if not archs:
        raise UnsupportedModelError(f"not an encoder: architectures={hf.get('architectures')}; "
                                    f"supported: {', '.join(ENCODERS)}")
    arch, kind = archs[0], ENCODERS[archs[0]]
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise UnsupportedModelError(f"{arch}: position_embedding_type={hf['position_embedding_type']!r} "
                                    "is not implemented (supported: 'absolute')")
    classifier = arch.endswith("ForSequenceClassification")
    labels = int(hf.get("num_labels") or len(hf.get("id2label") or {}) or 2) if classifier else 0
    return EncoderConfig(
        architecture=arch, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
        intermediate_size=hf["intermediate_size"], max_position_embeddings=hf["max_position_embeddings"],
        type_vocab_size=hf.get("type_vocab_size", 2), layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
        hidden_act=hf.get("hidden_act", "gelu"), pad_token_id=hf.get("pad_token_id") or 0,
        positions_after_padding=kind.positions_after_padding, num_labels=labels,
        classifier=kind.classifier if classifier else None,
        dtype=dtype or hf.get("dtype") or hf.get("torch_dtype") or "float32")


def checkpoint_shapes(cfg: EncoderConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor we read (base-model names) and its shape."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    shapes = {"embeddings.word_embeddings.weight": (cfg.vocab_size, h),
              "embeddings.position_embeddings.weight": (cfg.max_position_embeddings, h),
              "embeddings.token_type_embeddings.weight": (cfg.type_vocab_size, h),
              "embeddings.LayerNorm.weight": (h,), "embeddings.LayerNorm.bias": (h,)}
    for i in range(cfg.num_layers):
        p = f"encoder.layer.{i}."
        for name in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            shapes[p + name + ".weight"], shapes[p + name + ".bias"] = (h, h), (h,)
        for name in ("attention.output.LayerNorm", "output.LayerNorm"):
            shapes[p + name + ".weight"], shapes[p + name + ".bias"] = (h,), (h,)
        shapes[p + "intermediate.dense.weight"], shapes[p + "intermediate.dense.bias"] = (f, h), (f,)
        shapes[p + "output.dense.weight"], shapes[p + "output.dense.bias"] = (h, f), (h,)
    if cfg.classifier == "bert":
        shapes.update({"pooler.dense.weight": (h, h), "pooler.dense.bias": (h,),
                       "classifier.weight": (cfg.num_labels, h), "classifier.bias": (cfg.num_labels,)})
    elif cfg.classifier == "roberta":
        shapes.update({"classifier.dense.weight": (h, h), "classifier.dense.bias": (h,),
                       "classifier.out_proj.weight": (cfg.num_labels, h), "classifier.out_proj.bias": (cfg.num_labels,)})
    return shapes


def layer_norm(x, w, b, eps):
    """LayerNorm in fp32, back in `x`'s dtype (the reference's and `model.families.encoder`'s)."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps) * w.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


def _dense(x, weights, name):
    return jnp.einsum("...i,oi->...o", x, weights[name + ".weight"]) + weights[name + ".bias"]


def positions(input_ids, attention_mask, cfg: EncoderConfig):
    """`[B, L]` position ids: 0.. for BERT; XLM-RoBERTa's `pad + 1 + (count of non-padding tokens so far)`."""
    if not cfg.positions_after_padding:
        return jnp.broadcast_to(jnp.arange(input_ids.shape[1]), input_ids.shape)
    real = (input_ids != cfg.pad_token_id).astype(jnp.int32)
    return jnp.cumsum(real, axis=1) * real + cfg.pad_token_id


def encoder_forward(weights, input_ids, attention_mask, cfg: EncoderConfig, token_type_ids=None):
    """`[B, L, hidden]` the last layer's hidden states of a padded batch (`attention_mask` 1 on tokens)."""
    if token_type_ids is None:
        token_type_ids = jnp.zeros_like(input_ids)
    w = weights
    x = (w["embeddings.word_embeddings.weight"][input_ids]
         + w["embeddings.position_embeddings.weight"][positions(input_ids, attention_mask, cfg)]
         + w["embeddings.token_type_embeddings.weight"][token_type_ids])
    x = layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], cfg.layer_norm_eps)
    b, length, nh, hd = input_ids.shape[0], input_ids.shape[1], cfg.num_heads, cfg.head_dim
    bias = jnp.where(attention_mask[:, None, None, :] > 0, 0.0, jnp.finfo(jnp.float32).min)
    act = _ACTS[cfg.hidden_act]
    for i in range(cfg.num_layers):
        p = f"encoder.layer.{i}."
        q, k, v = (_dense(x, w, p + f"attention.self.{n}").reshape(b, length, nh, hd) for n in ("query", "key", "value"))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(hd) + bias
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1).astype(v.dtype), v).reshape(b, length, -1)
        x = layer_norm(x + _dense(o, w, p + "attention.output.dense"), w[p + "attention.output.LayerNorm.weight"],
                        w[p + "attention.output.LayerNorm.bias"], cfg.layer_norm_eps)
        h = act(_dense(x, w, p + "intermediate.dense"))
        x = layer_norm(x + _dense(h, w, p + "output.dense"), w[p + "output.LayerNorm.weight"],
                        w[p + "output.LayerNorm.bias"], cfg.layer_norm_eps)
    return x


def classifier_logits(weights, hidden, cfg: EncoderConfig):
    """`[B, num_labels]` fp32: a sequence classifier's head on the first token of `hidden [B, L, E]`."""
    first = hidden[:, 0].astype(jnp.float32)
    w = {k: v.astype(jnp.float32) for k, v in weights.items() if k.startswith(("pooler.", "classifier."))}
    if cfg.classifier == "bert":
        return _dense(jnp.tanh(_dense(first, w, "pooler.dense")), w, "classifier")
    if cfg.classifier == "roberta":
        return _dense(jnp.tanh(_dense(first, w, "classifier.dense")), w, "classifier.out_proj")
    raise ValueError(f"{cfg.architecture} has no classifier head")
