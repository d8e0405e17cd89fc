"""Continuous-batching engine: ``LLM``, ``SamplingParams`` and the outputs they produce."""

from flashpage.engine.llm import LLM, EngineStats
from flashpage.engine.outputs import (
           CompletionOutput,
           RequestMetrics,
           RequestOutput,
           StreamOutput,
           TokenLogprob,
)
from flashpage.engine.params import SamplingParams
from flashpage.engine.structured import StructuredOutputsParams

__all__ = ["LLM", "CompletionOutput", "EngineStats", "RequestMetrics", "RequestOutput", "SamplingParams",
           "StreamOutput", "StructuredOutputsParams", "TokenLogprob"]
