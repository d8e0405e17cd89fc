"""flashpage's server: an async, thread-safe engine front and an OpenAI-compatible HTTP API.

``AsyncLLM`` (no extra needed) runs a :class:`flashpage.LLM` in a background thread;
``build_app`` / ``run_server`` (``pip install 'flashpage[serve]'``: FastAPI, uvicorn,
prometheus_client) serve it over HTTP, as ``flashpage serve`` does.
"""

from __future__ import annotations

import importlib
from typing import Any

from flashpage.serve.async_engine import (
    AsyncLLM,
    EngineClosedError,
    EngineDiedError,
    QueueFullError,
    RequestFailedError,
    RequestStream,
    TokenEvent,
)

_LAZY = {"build_app": "flashpage.serve.app", "ServeMetrics": "flashpage.serve.metrics",
         "ServerThread": "flashpage.serve.server", "run_server": "flashpage.serve.server"}

__all__ = ["AsyncLLM", "EngineClosedError", "EngineDiedError", "QueueFullError", "RequestFailedError", "RequestStream",
           "TokenEvent", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'flashpage.serve' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
