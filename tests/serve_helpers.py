"""Shared pieces of the server tests: a tiny-model server on a loopback port, SSE reading, metrics."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from flashpage import LLM, load_tiny_model
from flashpage.serve import AsyncLLM, ServerThread, build_app

MODEL = "flashpage-tiny"


@contextmanager
def tiny_server(max_waiting_requests: int = 512, app_kwargs: dict[str, Any] | None = None, tokenizer: Any = None,
                **llm_kwargs: Any) -> Iterator[tuple[ServerThread, AsyncLLM]]:
    """A server of the built-in model on 127.0.0.1 (free port), shut down (engine included) on exit.
    ``app_kwargs`` go to ``build_app``; ``tokenizer`` replaces the model's."""
    model, tok = load_tiny_model()
    engine = AsyncLLM(LLM(model, tokenizer or tok, check_invariants=True, **llm_kwargs),
                      max_waiting_requests=max_waiting_requests)
    try:
        with ServerThread(build_app(engine, MODEL, **(app_kwargs or {}))) as server:
            yield server, engine
    finally:
        engine.close()


def sse_events(lines: Iterator[str]) -> Iterator[dict[str, Any] | str]:
    """The ``data:`` payloads of a server-sent event stream (JSON objects, then "[DONE]")."""
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            yield payload if payload == "[DONE]" else json.loads(payload)


def metrics(url: str) -> dict[str, float]:
    """Unlabelled samples of ``GET /metrics``."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\w+) ([-+\w.]+)$", text, re.M)}


def wait_until(cond: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        time.sleep(0.02)
