"""The pooling settings of a checkpoint, read as sentence-transformers writes them.

A sentence-transformers model directory lists its modules in `modules.json`: the transformer,
then a `Pooling` module (its settings in `<path>/config.json`, usually `1_Pooling/config.json`),
and optionally `Normalize` (the embedding is L2-normalized) and others. Two layouts of the
pooling file exist:

* sentence-transformers 6.x: `{"embedding_dimension": 16, "pooling_mode": "mean", "include_prompt": true}`;
* older releases (and most published models, Qwen3-Embedding among them): one boolean per mode,
  `pooling_mode_cls_token`, `pooling_mode_mean_tokens`, `pooling_mode_lasttoken`, ...

The prompt limit is `max_seq_length` in `sentence_bert_config.json` (older layout) or the
tokenizer's `model_max_length` in `tokenizer_config.json` (6.x saves it there). `config.json`
may declare Matryoshka training (`is_matryoshka`, `matryoshka_dimensions`), which bounds the
`dimensions` a request may ask for. `--pooler_config` overrides any field (`with_overrides`).

Without a sentence-transformers config the defaults follow the architecture: last-token for a
decoder (and for sequence classifiers, whose score head reads the last token), CLS for an encoder.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

# Our pooler names (`model.pooling.POOLING_TYPES`) for sentence-transformers' modes.
_ST_MODES = {"cls": "cls", "mean": "mean", "lasttoken": "last", "last": "last"}
_LEGACY_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                "pooling_mode_lasttoken": "last", "pooling_mode_max_tokens": "max",
                "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                "pooling_mode_weightedmean_tokens": "weightedmean"}
POOLING_TYPES = ("last", "cls", "mean", "all")
ENCODER_ARCHITECTURES = ("BertModel", "XLMRobertaModel", "BertForSequenceClassification",
                         "XLMRobertaForSequenceClassification")
# A tokenizer's model_max_length above this is transformers' "no limit" placeholder.
_NO_LIMIT = 10**8


class PoolingConfigError(ValueError):
    """A pooling config that cannot be served as written; the message says which file and field."""


@dataclasses.dataclass(frozen=True)
class PoolingConfig:
    pooling_type: str = "last"  # one of POOLING_TYPES
    normalize: bool = False
    max_seq_length: int | None = None  # the longest prompt, in tokens (None: the model's positions)
    embedding_dimension: int | None = None
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    include_prompt: bool = True
    # Where each field came from, for messages: "modules.json", "1_Pooling/config.json", "default", ...
    source: str = "default"

    def __post_init__(self):
        if self.pooling_type not in POOLING_TYPES:
            raise PoolingConfigError(f"pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}")
        if self.max_seq_length is not None and self.max_seq_length <= 0:
            raise PoolingConfigError(f"max_seq_length must be positive, got {self.max_seq_length}")

    def check_dimensions(self, dimensions: int | None, hidden_size: int) -> int | None:
        """`dimensions` of a request, checked: within the embedding, and one of the Matryoshka
        dimensions when the model lists them; a model not trained for it refuses any other than
        its full size. Raises `PoolingConfigError` naming the allowed values."""
        if dimensions is None:
            return None
        full = self.embedding_dimension or hidden_size
        if dimensions == full:
            return dimensions
        if not self.is_matryoshka and not self.matryoshka_dimensions:
            raise PoolingConfigError(f"this model does not support matryoshka representation: dimensions "
                                     f"{dimensions} (its embeddings have {full})")
        if not 0 < dimensions <= full:
            raise PoolingConfigError(f"dimensions must be in 1..{full}, got {dimensions}")
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            raise PoolingConfigError(f"dimensions {dimensions} is not one of the model's matryoshka dimensions "
                                     f"{list(self.matryoshka_dimensions)}")
        return dimensions

    def with_overrides(self, overrides: dict[str, Any] | None) -> "PoolingConfig":
        """The config with `overrides` (what `--pooler_config` passes: a dict of these fields, or of
        vLLM's names `pooling_type` "LAST" / "CLS" / "MEAN" / "ALL" and `normalize`) applied."""
        if not overrides:
            return self
        known = {f.name for f in dataclasses.fields(self)} - {"source"}
        unknown = sorted(set(overrides) - known - {"dimensions"})
        if unknown:
            raise PoolingConfigError(f"unknown pooler_config fields {unknown}; known: {sorted(known)}")
        changes = {k: v for k, v in overrides.items() if k in known}
        if "pooling_type" in changes:
            changes["pooling_type"] = _our_mode(str(changes["pooling_type"]).lower(), "pooler_config")
        if changes.get("matryoshka_dimensions") is not None:
            changes["matryoshka_dimensions"] = tuple(int(d) for d in changes["matryoshka_dimensions"])
        return dataclasses.replace(self, **changes, source="pooler_config")


def _our_mode(mode: str, where: str) -> str:
    if mode in POOLING_TYPES:
        return mode
    if mode in _ST_MODES:
        return _ST_MODES[mode]
    raise PoolingConfigError(f"{where}: pooling mode {mode!r} is not supported (supported: cls, mean, lasttoken)")


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise PoolingConfigError(f"cannot read {path}: {e}") from None


def _module_kind(entry: dict) -> str:
    """The class name of a modules.json entry ("Pooling", "Normalize", "Transformer", ...)."""
    return str(entry.get("type", "")).rsplit(".", 1)[-1]


def read_pooling_file(path: str) -> dict[str, Any]:
    """`{pooling_type, embedding_dimension, include_prompt}` from a Pooling module's config.json, either layout."""
    d = _read_json(path)
    name = os.path.join(os.path.basename(os.path.dirname(path)), os.path.basename(path))
    if "pooling_mode" in d:
        modes = d["pooling_mode"]
        modes = [modes] if isinstance(modes, str) else list(modes)
    else:
        modes = [_LEGACY_KEYS[k] for k in _LEGACY_KEYS if d.get(k)]
    if len(modes) != 1:
        raise PoolingConfigError(f"{name}: exactly one pooling mode is supported, got {modes or 'none'}")
    return {"pooling_type": _our_mode(modes[0], name),
            "embedding_dimension": d.get("embedding_dimension", d.get("word_embedding_dimension")),
            "include_prompt": bool(d.get("include_prompt", True))}


def _max_seq_length(model_dir: str) -> int | None:
    path = os.path.join(model_dir, "sentence_bert_config.json")
    if os.path.isfile(path):
        value = _read_json(path).get("max_seq_length")
        if value is not None:
            return int(value)
    path = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.isfile(path):
        value = _read_json(path).get("model_max_length")
        if isinstance(value, (int, float)) and 0 < value < _NO_LIMIT:
            return int(value)
    return None


def default_pooling_type(architectures) -> str:
    return "cls" if any(a in ENCODER_ARCHITECTURES for a in architectures or ()) else "last"


def load_pooling_config(model_dir: str, overrides: dict[str, Any] | None = None) -> PoolingConfig:
    """The pooling config of the checkpoint at `model_dir` (its sentence-transformers files, else the
    architecture's default), then `overrides`."""
    hf_path = os.path.join(model_dir, "config.json")
    hf = _read_json(hf_path) if os.path.isfile(hf_path) else {}
    fields: dict[str, Any] = {"pooling_type": default_pooling_type(hf.get("architectures")), "source": "default"}
    modules_path = os.path.join(model_dir, "modules.json")
    if os.path.isfile(modules_path):
        modules = _read_json(modules_path)
        if not isinstance(modules, list):
            raise PoolingConfigError(f"{modules_path} does not hold a list of modules")
        kinds = [_module_kind(m) for m in modules]
        for m in modules:
            if _module_kind(m) == "Pooling":
                fields.update(read_pooling_file(os.path.join(model_dir, m.get("path") or "", "config.json")))
        fields["normalize"] = "Normalize" in kinds
        fields["source"] = "modules.json"
    length = _max_seq_length(model_dir)
    if length is not None:
        fields["max_seq_length"] = length
    dims = hf.get("matryoshka_dimensions")
    fields["is_matryoshka"] = bool(hf.get("is_matryoshka", False) or dims)
    fields["matryoshka_dimensions"] = tuple(int(d) for d in dims) if dims else None
    return PoolingConfig(**fields).with_overrides(overrides)
