"""Decoders as poolers: final hidden states instead of logits, and sequence-classification heads.

`final_hidden` runs the same forward as `model.forward.forward` (the family's blocks over the
paged cache, any ragged batch) and returns every row's hidden state after the final norm, the
input of a pooler (`model.pooling`) or of a score head, instead of the logits of a few rows.

Checkpoints a pooling model is served from (`load_decoder`):

* a decoder's base model (`Qwen3Model`, `LlamaModel`, ...: what sentence-transformers saves for
  Qwen3-Embedding), whose tensors carry no `model.` prefix and which has no output head;
* a `*ForSequenceClassification` (`Qwen3ForSequenceClassification`,
  `LlamaForSequenceClassification`): the decoder under `model.` and `score.weight`
  `[num_labels, hidden]`, a bias-free linear read on the last token (`num_labels` 1: a reward model);
* a `*ForCausalLM`, its `lm_head` left unread.

The decoder's tensors are planned by its family (`model.families`), as `model.convert_hf` plans
them; the config is the family's with the output head tied (the head is never run), so the
weights are the decoder's `Weights` and every function over them applies.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax.numpy as jnp
import numpy as np

from model.cache import BatchMetadata, KVCache
from model.config import LlamaConfig, UnsupportedModelError
from model.convert_hf import ConversionError, _open, read_weights, weight_files
from model.declarations import Weights
from model.families import family_for_hf_config, from_hf_config
from model.families import bert
from model.families.encoder import ENCODER
from model.forward import final_hidden_norm, forward_hidden
from model.params import unflatten_params

SCORE_TENSOR = "score.weight"
ENCODER_PREFIXES = ("bert.", "roberta.")  # an encoder classifier's body, under its base model's prefix
_SUFFIXES = ("ForSequenceClassification", "Model", "ForCausalLM")


def final_hidden(params: Weights, cache: KVCache, tokens, md: BatchMetadata, cfg: LlamaConfig,
                 backend: str = "auto", layout=None, image_embeds=None):
    """`[T, embed]` every row's hidden state after the final norm (in the compute dtype), and the
    updated cache. `md.logits_indices` is not read."""
    x, cache = forward_hidden(params, cache, tokens, md, cfg, backend, layout, image_embeds)
    return final_hidden_norm(params, x, cfg), cache


def score_logits(hidden, score_weight):
    """`[R, num_labels]` fp32: the classification head on pooled rows `hidden [R, embed]`."""
    return jnp.einsum("re,le->rl", hidden.astype(jnp.float32), jnp.asarray(score_weight, jnp.float32))


def causal_architecture(arch: str) -> str:
    """The `*ForCausalLM` name of a decoder's base model or classifier ("Qwen3Model" -> "Qwen3ForCausalLM")."""
    for suffix in _SUFFIXES:
        if arch.endswith(suffix):
            return arch[: -len(suffix)] + "ForCausalLM"
    return arch


def decoder_config(hf: dict[str, Any], dtype: str | None = None) -> tuple[LlamaConfig, Any]:
    """(our config, its family) for the HF config of a decoder base model / classifier / causal LM, or of an
    encoder (a family of its own architectures: `model.families.encoder`)."""
    archs = hf.get("architectures") or []
    if any(a in ENCODER.architectures for a in archs):
        return ENCODER.config_from_hf(hf, dtype), ENCODER
    causal = dict(hf, architectures=[causal_architecture(a) for a in archs])
    family = family_for_hf_config(causal)
    cfg = from_hf_config(causal, dtype)
    return cfg.replace(tie_word_embeddings=True), family


def _stored(name: str, located: dict[str, str]) -> str | None:
    if name in located:
        return name
    if name.startswith("model.") and name[len("model."):] in located:  # a base model's names
        return name[len("model."):]
    for prefix in ENCODER_PREFIXES:  # an encoder classifier's body
        if prefix + name in located:
            return prefix + name
    return None


def load_decoder(hf_dir: str, dtype: str | None = "float32"):
    """`(cfg, params, score_weight or None, hf config dict)` from a decoder checkpoint directory
    (base model, sequence classifier or causal LM, safetensors). Raises `ConversionError` for
    missing tensors or shapes other than `config.json` implies."""
    path = os.path.join(hf_dir, "config.json")
    try:
        with open(path) as f:
            hf = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConversionError(f"cannot read {path}: {e}") from None
    try:
        cfg, family = decoder_config(hf, dtype)
    except UnsupportedModelError as e:
        raise ConversionError(str(e)) from None
    located = weight_files(hf_dir)
    plan = []
    for t in family.checkpoint_tensors(cfg):
        name = _stored(t.hf, located)
        if name is None:
            raise ConversionError(f"{hf_dir}: missing tensor {t.hf} of a {cfg.num_layers}-layer {family.name}")
        plan.append(type(t)(ours=t.ours, hf=name, hf_shape=t.hf_shape, relayout=t.relayout, stack=t.stack))
    for t in plan:
        with _open(located[t.hf]) as f:
            shape = tuple(f.get_slice(t.hf).get_shape())
        if shape != t.hf_shape:
            raise ConversionError(f"tensor {t.hf} has shape {list(shape)}, but config.json implies {list(t.hf_shape)}")
    flat = read_weights(plan, located, np.dtype(cfg.jnp_dtype), progress=False)
    params = unflatten_params(cfg, {k: jnp.asarray(v) for k, v in flat.items()})
    score = None
    if family is ENCODER:
        score = encoder_head(hf, located) if cfg.architecture.endswith("ForSequenceClassification") else None
    elif any(a.endswith("ForSequenceClassification") for a in hf.get("architectures") or []):
        if SCORE_TENSOR not in located:
            raise ConversionError(f"{hf_dir}: a sequence classifier without {SCORE_TENSOR}")
        with _open(located[SCORE_TENSOR]) as f:
            weight = np.asarray(f.get_tensor(SCORE_TENSOR), np.float32)
        labels = int(hf.get("num_labels") or len(hf.get("id2label") or {}) or weight.shape[0])
        if weight.shape != (labels, cfg.hidden_size):
            raise ConversionError(f"{SCORE_TENSOR} has shape {list(weight.shape)}, expected [{labels}, "
                                  f"{cfg.hidden_size}]")
        score = LinearHead(weight)
    return cfg, params, score, hf


class LinearHead:
    """A decoder classifier's `score` head on the pooled last token: `weight [labels, hidden] @ x` (fp32, host)."""

    def __init__(self, weight: np.ndarray):
        self.weight = np.asarray(weight, np.float32)
        self.num_labels = int(self.weight.shape[0])

    def __call__(self, pooled: np.ndarray) -> np.ndarray:
        return self.weight @ np.asarray(pooled, np.float32)


class TanhHead:
    """An encoder classifier's head on the pooled first token: `out(tanh(dense(x)))` (fp32, host): BERT's pooler
    then `classifier`, XLM-RoBERTa's `classifier.dense` then `classifier.out_proj`."""

    def __init__(self, dense_w, dense_b, out_w, out_b):
        self.dense_w, self.dense_b, self.out_w, self.out_b = (np.asarray(a, np.float32)
                                                              for a in (dense_w, dense_b, out_w, out_b))
        self.num_labels = int(self.out_w.shape[0])

    def __call__(self, pooled: np.ndarray) -> np.ndarray:
        return self.out_w @ np.tanh(self.dense_w @ np.asarray(pooled, np.float32) + self.dense_b) + self.out_b


def encoder_head(hf: dict[str, Any], located: dict[str, str]) -> TanhHead:
    """The classifier head of a `BertForSequenceClassification` / `XLMRobertaForSequenceClassification`."""
    bert_style = any(a.startswith("Bert") for a in hf.get("architectures") or [])
    dense, out = ("bert.pooler.dense", "classifier") if bert_style else ("classifier.dense", "classifier.out_proj")
    arrays = []
    for name in (dense + ".weight", dense + ".bias", out + ".weight", out + ".bias"):
        if name not in located:
            raise ConversionError(f"a sequence classifier without {name}")
        with _open(located[name]) as f:
            arrays.append(f.get_tensor(name))
    return TanhHead(*arrays)


def load_encoder(hf_dir: str, dtype: str | None = "float32") -> tuple[bert.EncoderConfig, dict]:
    """`(cfg, weights)` of the dense reference (`model.families.bert.encoder_forward`) from an encoder checkpoint
    directory (config.json + safetensors)."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf = json.load(f)
    try:
        cfg = bert.config_from_hf(hf, dtype)
    except UnsupportedModelError as e:
        raise ConversionError(str(e)) from None
    prefix = bert.ENCODERS[cfg.architecture].prefix
    located = weight_files(hf_dir)
    weights = {}
    for name, shape in bert.checkpoint_shapes(cfg).items():
        stored = next((n for n in (name, prefix + name) if n in located), None)
        if stored is None:
            raise ConversionError(f"{hf_dir}: missing tensor {name} of a {cfg.num_layers}-layer {cfg.architecture}")
        with _open(located[stored]) as f:
            array = f.get_tensor(stored)
        if tuple(array.shape) != shape:
            raise ConversionError(f"tensor {stored} has shape {list(array.shape)}, but config.json implies {list(shape)}")
        weights[name] = jnp.asarray(np.asarray(array, np.float32), cfg.dtype)
    return cfg, weights
