"""The host-side serving engine: scheduling over a paged KV cache, sampling, and the APIs.

    from serving import LLM, SamplingParams
    outputs = LLM().generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
"""

from serving.async_engine import AsyncEngine, EngineDeadError
from serving.engine import ContextLengthError, Engine, EngineConfig
from serving.llm import LLM
from serving.outputs import CompletionOutput, Logprob, RequestOutput
from serving.sampling_params import InvalidParameterError, SamplingParams

__all__ = ["AsyncEngine", "EngineDeadError", "CompletionOutput", "ContextLengthError", "Engine", "EngineConfig", "InvalidParameterError",
           "LLM", "Logprob", "RequestOutput", "SamplingParams"]
