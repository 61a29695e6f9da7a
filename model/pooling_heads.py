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

from model.blocks import norm
from model.cache import BatchMetadata, KVCache
from model.config import LlamaConfig, UnsupportedModelError
from model.convert_hf import ConversionError, _open, read_weights, weight_files
from model.declarations import Weights
from model.families import family_for_hf_config, from_hf_config
from model.forward import forward_hidden
from model.params import unflatten_params

SCORE_TENSOR = "score.weight"
_SUFFIXES = ("ForSequenceClassification", "Model", "ForCausalLM")


def final_hidden(params: Weights, cache: KVCache, tokens, md: BatchMetadata, cfg: LlamaConfig,
                 backend: str = "auto", layout=None, image_embeds=None):
    """`[T, embed]` every row's hidden state after the final norm (in the compute dtype), and the
    updated cache. `md.logits_indices` is not read."""
    x, cache = forward_hidden(params, cache, tokens, md, cfg, backend, layout, image_embeds)
    return norm(x, params.final_norm, cfg), cache


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
    """(our config, its family) for the HF config of a decoder base model / classifier / causal LM."""
    archs = hf.get("architectures") or []
    causal = dict(hf, architectures=[causal_architecture(a) for a in archs])
    family = family_for_hf_config(causal)
    cfg = from_hf_config(causal, dtype)
    return cfg.replace(tie_word_embeddings=True), family


def _stored(name: str, located: dict[str, str]) -> str | None:
    if name in located:
        return name
    if name.startswith("model.") and name[len("model."):] in located:  # a base model's names
        return name[len("model."):]
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
    if any(a.endswith("ForSequenceClassification") for a in hf.get("architectures") or []):
        if SCORE_TENSOR not in located:
            raise ConversionError(f"{hf_dir}: a sequence classifier without {SCORE_TENSOR}")
        with _open(located[SCORE_TENSOR]) as f:
            score = np.asarray(f.get_tensor(SCORE_TENSOR), np.float32)
        labels = int(hf.get("num_labels") or len(hf.get("id2label") or {}) or score.shape[0])
        if score.shape != (labels, cfg.hidden_size):
            raise ConversionError(f"{SCORE_TENSOR} has shape {list(score.shape)}, expected [{labels}, "
                                  f"{cfg.hidden_size}]")
    return cfg, params, score, hf
