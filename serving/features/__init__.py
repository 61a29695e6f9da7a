"""Features that reach the engine only as step parts (`serving.core.step_parts.StepPart`).

`serving.core` names no feature of this package and imports nothing from it
(`tools/import_graph.py` checks that): `build_parts` makes the parts the
options ask for, in one place, and the caller hands them to the engine
(`Engine(parts=...)`, which `serving.LLM` does).

| module | part | options |
|---|---|---|
| `host_kv_tier` | the host tier of the prefix cache and swap preemption | kv_offload_bytes, kv_offloading_size, preemption_mode |
| `kv_pages` | (no part) the device programs that gather and scatter KV pages, shared by the host tier and KV transfer | |
| `kv_exports` | requests whose prompt K/V is shipped once their first token is drawn (disaggregated serving) | (always on) |
| `kv_imports` | requests resuming a prefill another engine shipped (disaggregated serving) | (always on) |
| `structured_output` (+ `reasoning_phase`) | structured outputs and reasoning requests' thinking phase: a grammar per request, its token bitmask in every step | structured_outputs_whitespace (always on) |
| `sampling_controls` | logit bias, allowed / bad words, min_tokens, the penalties: per-slot device rows, applied in the step | (always on) |
| `logits_processors` | custom logits processors, run inside the step | logits_processors |
| `weight_updates` | (no part) replacing a running engine's weights, and `sleep_mode` (no part) giving its device memory back | |
| `pause` | pausing generation (abort, wait, keep) and resuming it, by holding the engine's steps | (always on) |
| `multimodal` | a vision-language model's images: placed in the prompt at admission (encoder outputs cached by image digest), their rows and positions in every step | encoder_cache_mb, limit_mm_per_prompt (a model with a vision tower) |
| `serving.spec_decode` (not here: a package of its own) | speculative decoding: `SpecVerifier` checks the drafts in the step, `SpecDecoder` proposes them and keeps what was accepted | speculative_method, num_speculative_tokens, speculative_model |
| `pooling` (+ `pooling_config`, `pooling_models`) | pooling requests: embeddings, classifier / reward scores of a prompt's final hidden states, read back from the step | runner, pooler_config |
| `lora` | LoRA adapters: registration, admission by adapter, device slots adapting the weights in the step | enable_lora, max_loras, max_lora_rank, max_cpu_loras |
"""

from __future__ import annotations

from serving.features import host_kv_tier
from serving.features.kv_exports import KVExports
from serving.features.kv_imports import KVImports
from serving.features.logits_processors import LogitsProcessors, ProcessorConfig
from serving.features.lora import LoraManager
from serving.features.multimodal import Multimodal
from serving.features.pause import GenerationPause
from serving.features.pooling import BidirectionalPooling, PoolingPart
from serving.features.sampling_controls import SamplingControlsPart
from serving.features.structured_output import StructuredOutputsPart


def build_parts(options: dict, cfg, draft=None, pooling=None) -> list:
    """The step parts `options` (every option of `serving.core.engine_args`, resolved) ask for, for a model of
    config `cfg`: parts, and functions that build one from the engine (`Engine(parts=...)`), in the order the
    engine calls them. `draft`: an in-memory (config, params) draft model for speculative_method "draft" in
    place of the speculative_model checkpoint. `pooling`: the `pooling.PoolingModel` of a pooling checkpoint
    (runner=pooling), whose requests the pooling part serves. Raises ValueError naming the option when one cannot be built
    (before anything loads)."""
    parts = []
    tier = []  # the host tier, once the engine has built it
    if host_kv_tier.capacity_from_options(options):
        def build_tier(engine):
            tier.append(host_kv_tier.for_engine(engine))  # (a tier: the engine's options are these options)
            return tier[0]

        parts.append(build_tier)
    # Applied to the logits in this order: sampling controls, a grammar's mask, then the custom processors.
    parts.append(SamplingControlsPart(options["max_num_seqs"], cfg.vocab_size))
    parts.append(GenerationPause())
    parts.append(StructuredOutputsPart(cfg.vocab_size, bool(options.get("structured_outputs_whitespace"))))
    if cfg.vision is not None:  # (pipeline stages: the rows merge before the first stage, `sharding.pipeline`)
        parts.append(Multimodal(cfg, cache_bytes=options["encoder_cache_mb"] << 20,
                                limit_per_prompt=options["limit_mm_per_prompt"]))
    if options.get("enable_lora"):
        parts.append(LoraManager(cfg, max_loras=options["max_loras"], max_lora_rank=options["max_lora_rank"],
                                 max_cpu_loras=options["max_cpu_loras"]))
    if options.get("logits_processors"):
        parts.append(LogitsProcessors(options["logits_processors"],
                                      ProcessorConfig(vocab_size=cfg.vocab_size, max_num_seqs=options["max_num_seqs"])))
    if pooling is None and cfg.bidirectional:
        raise ValueError(f"runner: {cfg.architecture} is an encoder, which embeds, classifies and scores (runner=pooling "
                         "or auto); it does not generate")
    if pooling is not None and cfg.bidirectional:  # an encoder: whole prompts, attention both ways
        parts.append(BidirectionalPooling(pooling, cfg.hidden_size, cfg.max_position_embeddings - cfg.position_offset,
                                          cfg.type_vocab_size))
    elif pooling is not None:
        parts.append(PoolingPart(pooling, cfg.hidden_size))
    if options.get("speculative_method"):  # last: its drafts see the other parts' state (a grammar's)
        from serving.spec_decode import SpecDecoder
        from serving.spec_decode.verifier import SpecVerifier

        parts.append(SpecVerifier(options["speculative_method"], options["num_speculative_tokens"],
                                  options["max_num_seqs"], cfg.vocab_size))
        parts.append(lambda engine: SpecDecoder.for_engine(engine, draft=draft))
    # Last: an import is checked against the request as the other parts admitted it (its adapter), and an
    # import's write must not land on a page before the host tier has copied it out.
    parts.append(lambda engine: KVImports.for_engine(engine, before_write=tier[0].flush if tier else None))
    parts.append(KVExports())
    return parts
