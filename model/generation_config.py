"""A checkpoint's `generation_config.json`: its default EOS ids and sampling parameters.

Hugging Face checkpoints ship the decoding defaults their authors meant in
this file (e.g. `"temperature": 0.6, "top_p": 0.9`, or several EOS ids such
as Llama 3's `[128001, 128008, 128009]`). As vLLM's `--generation-config
auto` does, the server and `LLM` take from it the fields below as the
defaults of every request that does not set them itself; the request's own
values always win. `do_sample` and the rest of the file are not read (vLLM
does not read them either).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Optional

log = logging.getLogger(__name__)

FILE = "generation_config.json"
# generation_config.json field -> SamplingParams field.
SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
    eos_token_ids: tuple[int, ...] = ()
    sampling: dict = dataclasses.field(default_factory=dict)  # SamplingParams field -> default value


def read_generation_config(directory: Optional[str]) -> GenerationDefaults:
    """The defaults in `directory/generation_config.json`; empty ones when there is no such file."""
    path = os.path.join(directory, FILE) if directory else None
    if path is None or not os.path.isfile(path):
        return GenerationDefaults()
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    eos = raw.get("eos_token_id")
    eos = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in eos):
        raise ValueError(f"{path}: eos_token_id must be an integer or a list of integers, got {eos!r}")
    sampling = {ours: raw[theirs] for theirs, ours in SAMPLING_FIELDS.items() if raw.get(theirs) is not None}
    return GenerationDefaults(tuple(eos), sampling)
