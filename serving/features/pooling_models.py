"""Which checkpoints serve pooling, and loading them: a decoder read in place, its pooling config and score head.

`runner` (the option, as vLLM's `--runner`) decides: "pooling", "generate", or "auto", which pools for a
Hugging Face checkpoint that is a decoder's base model (`Qwen3Model`: what sentence-transformers saves for
Qwen3-Embedding) or an encoder (`BertModel`, `XLMRobertaModel`), a sequence classifier
(`Qwen3ForSequenceClassification`, `LlamaForSequenceClassification`, `BertForSequenceClassification`,
`XLMRobertaForSequenceClassification`: rerankers and reward models) or any checkpoint with a
sentence-transformers `modules.json`.

A pooling decoder is read in place (`model.pooling_heads.load_decoder`: the family's tensors, with or without
the `model.` prefix, and `score.weight`), not converted to a Ridgeline checkpoint: its weights are the
decoder's `Weights`, so tensor parallelism, load-time quantization and LoRA apply as for generation. The
pooling config comes from the sentence-transformers files (`pooling_config.load_pooling_config`), overridden
by the `pooler_config` option (JSON).

Encoders (`BertModel`, `XLMRobertaModel` and their classifiers) are a registry family of their own
(`model.families.encoder`), read in place the same way; their classifier heads (BERT's pooler and classifier,
XLM-RoBERTa's dense and out_proj) are host functions (`model.pooling_heads.TanhHead`), a decoder classifier's
`score` a `LinearHead`. `serving.features.build_parts` serves an encoder with `BidirectionalPooling`.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from serving.features.pooling import PoolingModel
from serving.features.pooling_config import (ENCODER_ARCHITECTURES, PoolingConfig, PoolingConfigError,
                                             load_pooling_config)

RUNNERS = ("auto", "generate", "pooling")


def _hf_config(directory: str) -> Optional[dict]:
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def serves_pooling(directory: str, runner: str = "auto") -> bool:
    """Whether the checkpoint at `directory` is a Hugging Face checkpoint read in place as a pooling model under
    option `runner` (`load`). A Ridgeline checkpoint under runner=pooling loads as for generation and pools
    as `default_model` says."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {RUNNERS}, got {runner!r}")
    hf = _hf_config(directory)
    archs = (hf or {}).get("architectures") or []
    encoders = [a for a in archs if a in ENCODER_ARCHITECTURES]
    if runner == "generate" and encoders:
        raise ValueError(f"runner: {encoders[0]} is an encoder, which embeds, classifies and scores (runner=pooling "
                         "or auto); it does not generate")
    if hf is None:  # a Ridgeline checkpoint (converted from a causal LM): loaded as it is
        return False
    if runner != "auto":
        return runner == "pooling"
    return (os.path.isfile(os.path.join(directory, "modules.json"))
            or any(a.endswith("ForSequenceClassification") or (a.endswith("Model") and not a.endswith("LMHeadModel"))
                   for a in archs))


def parse_pooler_config(value) -> Optional[dict]:
    """The `pooler_config` option (a JSON object as text, a dict, or None) as a dict of overrides."""
    if value is None or isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise PoolingConfigError(f"pooler_config: not JSON ({e}): {value!r}") from None
    if not isinstance(parsed, dict):
        raise PoolingConfigError(f"pooler_config: expected a JSON object, got {value!r}")
    return parsed


def default_model(directory: Optional[str], pooler_config=None) -> PoolingModel:
    """The pooling of a model served with runner=pooling that is not a pooling checkpoint (a causal LM, a
    Ridgeline checkpoint, an in-memory model): its directory's sentence-transformers files if any, else last-token
    pooling without normalization, then `pooler_config`."""
    overrides = parse_pooler_config(pooler_config)
    if directory:
        return PoolingModel(load_pooling_config(directory, overrides))
    return PoolingModel(PoolingConfig().with_overrides(overrides))


def load(directory: str, pooler_config=None):
    """(config, params, tokenizer, `PoolingModel`) of the Hugging Face pooling checkpoint at `directory`."""
    from model.pooling_heads import load_decoder
    from model.tokenizer import load_tokenizer

    hf = _hf_config(directory)
    if hf is None:
        raise ValueError(f"{directory}: runner=pooling needs a Hugging Face checkpoint (config.json and "
                         "safetensors) of a decoder base model or sequence classifier")
    cfg, params, head, hf = load_decoder(directory, dtype=None)
    config = load_pooling_config(directory, parse_pooler_config(pooler_config))
    labels = {int(k): v for k, v in (hf.get("id2label") or {}).items()} if head is not None else None
    return cfg, params, load_tokenizer(directory, cfg.vocab_size), PoolingModel(config, head, labels)
