"""The host-side serving engine: scheduling over a paged KV cache, sampling, and the APIs.

    from serving import LLM, SamplingParams
    outputs = LLM().generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))

The names below are imported on first use (PEP 562), not with the package: the engine imports jax, and
a process that only routes requests (`python -m serving.router`) must start without it.
"""

from model.lazy_exports import lazy_exports

_EXPORTS = {
    "AsyncEngine": "serving.async_engine",
    "EngineDeadError": "serving.async_engine",
    "CompletionOutput": "serving.core.outputs",
    "ContextLengthError": "serving.core.engine",
    "Engine": "serving.core.engine",
    "EngineConfig": "serving.core.engine",
    "InvalidParameterError": "serving.core.sampling_params",
    "LLM": "serving.llm",
    "Logprob": "serving.core.outputs",
    "LoRARequest": "serving.features.lora",
    "RequestOutput": "serving.core.outputs",
    "SamplingParams": "serving.core.sampling_params",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
