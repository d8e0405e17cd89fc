"""Continuous-batching engine: ``LLM``, ``SamplingParams`` and the outputs they produce.

``LLM`` (and with it transformers' modeling code and flashpage's patches) is imported on first
use, so a process that only builds requests and reads outputs (``flashpage serve``'s HTTP front,
whose engine runs in another process) stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flashpage.engine.outputs import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    StreamOutput,
    TokenLogprob,
)
from flashpage.engine.params import SamplingParams
from flashpage.engine.stats import EngineStats
from flashpage.engine.structured import StructuredOutputsParams
from flashpage.lazy import lazy_names

if TYPE_CHECKING:
    from flashpage.engine.llm import LLM

__all__ = ["LLM", "CompletionOutput", "EngineStats", "RequestMetrics", "RequestOutput", "SamplingParams",
           "StreamOutput", "StructuredOutputsParams", "TokenLogprob"]

__getattr__ = lazy_names(globals(), {"LLM": "flashpage.engine.llm"}, "flashpage.engine")
