"""Features that reach the engine only as step parts (`serving.core.step_parts.StepPart`).

`serving.core` names no feature of this package and imports nothing from it
(`tools/import_graph.py` checks that): `build_parts` makes the parts the
options ask for, in one place, and the caller hands them to the engine
(`Engine(parts=...)`, which `serving.LLM` does).
"""

from __future__ import annotations

from serving.features.logits_processors import LogitsProcessors, ProcessorConfig


def build_parts(options: dict, cfg) -> list:
    """The step parts `options` (every option of `serving.core.engine_args`, resolved) ask for, for a model of
    config `cfg`; raises ValueError naming the option when one cannot be built."""
    parts = []
    if options.get("logits_processors"):
        parts.append(LogitsProcessors(options["logits_processors"],
                                      ProcessorConfig(vocab_size=cfg.vocab_size, max_num_seqs=options["max_num_seqs"])))
    return parts
