"""Shared pieces of the server tests: a tiny-model server on a loopback port, SSE reading, metrics."""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from flashpage import LLM, load_tiny_model
from flashpage.serve import AsyncLLM, ServerThread, build_app
from flashpage.serve.engine_process import EngineProcess, EngineSpec

MODEL = "flashpage-tiny"
ENGINES = ("thread", "process")  # where a test server's engine runs: AsyncLLM here, or EngineProcess


FAULT_FILE_ENV = "FLASHPAGE_TEST_FAULT_FILE"  # the engine process's fault switch: a file that exists arms it


def tiny_llm_with_fault_switch(spec: EngineSpec) -> LLM:
    """The built-in model's LLM (``spec.engine`` options) whose next forward raises "injected fault"
    once the file named by ``$FLASHPAGE_TEST_FAULT_FILE`` exists (the file is removed): a fault switch that
    reaches into an engine process (run there by name: EngineSpec.build)."""
    model, tok = load_tiny_model()
    path = os.environ.get(FAULT_FILE_ENV)

    def fault(*_: object) -> None:
        if path is not None and os.path.exists(path):
            os.remove(path)
            raise RuntimeError("injected fault")

    model.model.layers[0].register_forward_pre_hook(fault)
    return LLM(model, tok, **spec.engine.llm_kwargs())


def check_cache(llm: LLM) -> None:
    """The KV cache's invariants (run in the engine's process, between steps)."""
    llm.kv.blocks.check_invariants()


def in_engine(engine: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(llm, *args)`` where the engine's LLM lives: here (AsyncLLM) or in its process (EngineProcess)."""
    if isinstance(engine, EngineProcess):
        return engine.run_in_engine(fn, *args)
    with engine._engine_lock:
        return fn(engine.llm, *args)


def hold_while(llm: LLM, hold: str, started: str) -> None:
    """Keep the engine lock (no step, no command applied) while the file ``hold`` exists; ``started`` is
    created once held."""
    Path(started).touch()
    while os.path.exists(hold):
        time.sleep(0.01)


@contextmanager
def engine_held(engine: Any) -> Iterator[None]:
    """The engine applies no command and runs no step inside the block: its thread waits for the engine
    lock, here (AsyncLLM) or in the engine process (EngineProcess)."""
    if not isinstance(engine, EngineProcess):
        with engine._engine_lock:
            yield
        return
    with tempfile.TemporaryDirectory() as tmp:
        hold, started = Path(tmp, "hold"), Path(tmp, "started")
        hold.touch()
        holder = threading.Thread(target=engine.run_in_engine, args=(hold_while, str(hold), str(started)))
        holder.start()
        try:
            wait_until(started.exists, what="the engine process held")
            yield
        finally:
            hold.unlink()
            holder.join(30)


@contextmanager
def tiny_server(max_waiting_requests: int = 512, app_kwargs: dict[str, Any] | None = None, tokenizer: Any = None,
                engine_process: bool = False, **llm_kwargs: Any) -> Iterator[tuple[ServerThread, Any]]:
    """A server of the built-in model on 127.0.0.1 (free port), shut down (engine included) on exit.
    ``app_kwargs`` go to ``build_app``; ``tokenizer`` replaces the model's. ``engine_process``: the engine
    runs in its own process (:class:`EngineProcess`, built by :func:`tiny_llm_with_fault_switch`), as under
    ``flashpage serve``; else in a thread of this one (:class:`AsyncLLM`)."""
    engine: Any
    if engine_process:
        assert tokenizer is None, "an engine process builds its own tokenizer"
        spec = EngineSpec(engine={"check_invariants": True, **llm_kwargs}, build=tiny_llm_with_fault_switch)
        engine = EngineProcess(spec, max_waiting_requests=max_waiting_requests)
    else:
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
