"""A pure-functional Llama-3-family decoder: config, weights, paged cache, forward."""

from model.cache import BatchMetadata, KVCache, cache_bytes, init_cache, pad_slot
from model.config import LlamaConfig, RopeScaling, config_by_name, from_hf_config
from model.forward import forward, forward_hidden, forward_jit
from model.params import Layer, Weights, abstract_params, init_params, logical_axes, param_bytes

__all__ = [
    "BatchMetadata", "KVCache", "LlamaConfig", "Layer", "RopeScaling", "Weights", "abstract_params",
    "cache_bytes", "config_by_name", "forward", "forward_hidden", "forward_jit", "from_hf_config",
    "init_cache", "init_params", "logical_axes", "pad_slot", "param_bytes",
]
