"""A pure-functional Llama-3-family decoder: config, weights, paged cache, forward, and the
registry of model families (`model.families`) that maps a checkpoint's architecture to them.

The names below are imported on first use (PEP 562), not with the package: they import jax, which
`model.tokenizer` does not need, and the router (`python -m serving.router`) loads the tokenizer without it.
"""

from model.lazy_exports import lazy_exports

_EXPORTS = {
    **dict.fromkeys(("BatchMetadata", "KVCache", "cache_bytes", "init_cache", "pad_slot"), "model.cache"),
    **dict.fromkeys(("LlamaConfig", "ModelConfig", "RopeScaling"), "model.config"),
    **dict.fromkeys(("ModelFamily", "config_by_name", "family_for_architectures", "family_for_config",
                     "family_for_hf_config", "from_hf_config", "num_params"),
                    "model.families"),
    **dict.fromkeys(("forward", "forward_hidden", "forward_jit"), "model.forward"),
    **dict.fromkeys(("Layer", "Weights"), "model.declarations"),
    **dict.fromkeys(("abstract_params", "init_params", "logical_axes", "param_bytes"), "model.params"),
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
