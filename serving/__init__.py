"""The host-side serving engine: scheduling over a paged KV cache, sampling, and the APIs.

    from serving import LLM, SamplingParams
    outputs = LLM().generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))

The names below are imported on first use (PEP 562), not with the package: the engine imports jax, and
a process that only routes requests (`python -m serving.router`) must start without it.
"""

import importlib

_EXPORTS = {
    "AsyncEngine": "serving.async_engine",
    "EngineDeadError": "serving.async_engine",
    "CompletionOutput": "serving.outputs",
    "ContextLengthError": "serving.engine",
    "Engine": "serving.engine",
    "EngineConfig": "serving.engine",
    "InvalidParameterError": "serving.sampling_params",
    "LLM": "serving.llm",
    "Logprob": "serving.outputs",
    "RequestOutput": "serving.outputs",
    "SamplingParams": "serving.sampling_params",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'serving' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
