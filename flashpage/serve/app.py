"""The OpenAI-compatible HTTP server: a FastAPI app over an :class:`AsyncLLM`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or server-sent events
ending in ``data: [DONE]`` with ``stream: true``), ``GET /v1/models``, ``GET /health`` (503 while
draining) and ``GET /metrics`` (Prometheus). Errors are OpenAI-shaped bodies: 400 naming the bad
field, 404 for an unknown model, 503 with Retry-After when the waiting queue is full, 500 when the
engine step computing a request failed (in a stream: an error event, then ``[DONE]``).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from flashpage.engine import RequestOutput, SamplingParams
from flashpage.serve import protocol as P
from flashpage.serve import responses as R
from flashpage.serve import structured as S
from flashpage.serve.async_engine import (
    AsyncLLM,
    EngineClosedError,
    QueueFullError,
    RequestFailedError,
    RequestStream,
)
from flashpage.serve.metrics import CONTENT_TYPE, ServeMetrics

log = logging.getLogger("flashpage.serve")
RETRY_AFTER_SECONDS = 1
CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, the access log shows it


@dataclass
class ServerState:
    """What every handler needs. ``tokenizer`` is the front's own copy (the engine thread uses its own)."""

    engine: AsyncLLM
    tokenizer: Any
    model_name: str
    max_model_len: int
    metrics: ServeMetrics
    chat_template: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    token_text: R.TokenText = field(init=False)

    def __post_init__(self) -> None:
        self.token_text = R.TokenText(self.tokenizer)


def build_app(engine: AsyncLLM, model_name: str, *, chat_template: str | None = None,
              metrics: ServeMetrics | None = None, close_on_shutdown: bool = True) -> FastAPI:
    """The server's app. With ``close_on_shutdown`` the engine is closed when the app shuts down."""
    tokenizer = _own_copy(engine.llm.tokenizer)
    if metrics is None:
        metrics = ServeMetrics(engine.snapshot)
        engine.on_tokens, engine.on_finish = metrics.on_tokens, metrics.on_finish
    state = ServerState(engine, tokenizer, model_name, engine.llm.max_model_len, metrics, chat_template)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if close_on_shutdown:
            await asyncio.to_thread(engine.close, 0.0)

    app = FastAPI(title="flashpage", lifespan=lifespan)
    app.state.flashpage = state
    _add_error_handlers(app, state)
    _add_info_routes(app, state)
    _add_generation_routes(app, state)
    return app


def _own_copy(tokenizer: Any) -> Any:
    """A tokenizer for the event loop's thread: the engine thread encodes and decodes with the original,
    and a Rust tokenizer used from two threads at once can fail ("Already borrowed")."""
    if tokenizer is None:
        return None
    try:
        return copy.deepcopy(tokenizer)
    except Exception:  # not copyable: share it (correct, if slower under contention)
        log.warning("could not copy the tokenizer; the server shares the engine's")
        return tokenizer


# ------------------------------------------------------------------------------------------ errors
def _error_response(err: P.APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _add_error_handlers(app: FastAPI, state: ServerState) -> None:
    @app.exception_handler(P.APIError)
    async def api_error(_: Request, err: P.APIError) -> JSONResponse:
        return _error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(P.APIError(str(exc.detail), exc.status_code, kind))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return _error_response(P.APIError(f"internal error: {type(exc).__name__}: {exc}", 500, "internal_error"))


# ---------------------------------------------------------------------------------- info routes
def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> Response:
        if state.engine.accepting:
            return JSONResponse({})
        return _error_response(P.APIError("the server is shutting down", 503, "service_unavailable"))

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "flashpage",
             "root": state.model_name, "parent": None, "max_model_len": state.max_model_len}]})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)


# ----------------------------------------------------------------------------- generation routes
def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = P.parse(P.CompletionRequest, await request.body())
        P.check_completion(req)
        _check_model(state, req.model)
        structured = S.structured_from(req.response_format, req.structured_outputs)
        params = P.sampling_params(req, P.completion_max_tokens(req), P.completion_logprobs(req),
                                   structured=structured)
        prompts = P.completion_prompts(req)
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = await _submit(state, prompts, params, rid, "prompt")
        echoes = [_echo_text(state, p) if req.echo else None for p in prompts]
        job = _Job(state, rid, "text_completion", params, streams, req.stream_options)
        if req.stream:
            return _sse(job.completion_events(echoes))
        outs = await _collect(request, state, streams)
        if outs is None:
            return Response(status_code=CLIENT_CLOSED)
        choices = [R.completion_choice(i * params.n + c.index, c, state.token_text, echoes[i])
                   for i, out in enumerate(outs) for c in out.outputs]
        return JSONResponse({**job.header(), "choices": choices, "usage": R.usage(outs)})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req = P.parse(P.ChatRequest, await request.body())
        P.check_chat(req)
        _check_model(state, req.model)
        tools = S.tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls)
        structured = _chat_structured(req, tools)
        ids = _chat_prompt(state, req, tools)
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = limit if limit is not None else max(1, state.max_model_len - len(ids))
        params = P.sampling_params(req, max_tokens, P.chat_logprobs(req), renames={"logprobs": "top_logprobs"},
                                   structured=structured)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await _submit(state, [ids], params, rid, "messages")
        job = _Job(state, rid, "chat.completion", params, streams, req.stream_options, tools=tools)
        if req.stream:
            return _sse(job.chat_events())
        outs = await _collect(request, state, streams)
        if outs is None:
            return Response(status_code=CLIENT_CLOSED)
        choices = [_with_tools(R.chat_choice(c.index, c, state.token_text), tools) for c in outs[0].outputs]
        return JSONResponse({**job.header(), "choices": choices, "usage": R.usage(outs)})


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise P.APIError(f"The model `{model}` does not exist; this server serves `{state.model_name}`",
                         404, "not_found_error", "model")


def _echo_text(state: ServerState, prompt: str | list[int]) -> str:
    if isinstance(prompt, str):
        return prompt
    return state.tokenizer.decode(prompt, skip_special_tokens=False) if state.tokenizer is not None else ""


def _chat_structured(req: P.ChatRequest, tools: S.ToolPlan) -> Any:
    """The chat request's constraint: a forced tool call's schema, else response_format / structured_outputs."""
    forced = S.tool_constraint(tools)
    if forced is not None and (req.response_format or req.structured_outputs):
        raise P.APIError(f"tool_choice {tools.mode!r} forces the output's format: give no 'response_format' "
                         "or 'structured_outputs' with it", param="tool_choice")
    return forced or S.structured_from(req.response_format, req.structured_outputs)


def _with_tools(choice: dict[str, Any], tools: S.ToolPlan) -> dict[str, Any]:
    """A chat choice with its text as tool calls where the tool plan makes it one."""
    if tools.mode == "none":
        return choice
    message, reason = S.tool_message(choice["message"]["content"], choice["finish_reason"], tools)
    return {**choice, "message": message, "finish_reason": reason}


def _chat_prompt(state: ServerState, req: P.ChatRequest, tools: S.ToolPlan | None = None) -> list[int]:
    tok = state.tokenizer
    if tok is None:
        raise P.APIError("this model has no tokenizer, so chat is unavailable; use /v1/completions with token ids",
                         param="messages")
    template = state.chat_template or getattr(tok, "chat_template", None)
    if not template:
        raise P.APIError("the model's tokenizer has no chat template; use /v1/completions, or start the server "
                         "with --chat-template FILE", param="messages")
    messages = S.template_messages(req.messages)
    extra = {"tools": [{"type": "function", "function": t} for t in tools.tools]} if tools and tools.tools else {}
    try:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=req.add_generation_prompt,
                                       chat_template=template, **extra)
    except Exception as exc:  # the template refused these messages (e.g. roles out of order)
        raise P.APIError(f"the chat template rejected the messages: {exc}", param="messages") from None
    return list(tok(text, add_special_tokens=False)["input_ids"])


async def _submit(state: ServerState, prompts: list[Any], params: SamplingParams, rid: str,
                  prompt_param: str) -> list[RequestStream]:
    """Queue one engine request per prompt and wait until the engine accepted them all."""
    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(prompts):
            streams.append(state.engine.add_request(prompt, params, f"{rid}-{i}"))
        for s in streams:
            await s.accepted()
    except BaseException as exc:
        for s in streams:
            state.engine.abort(s.request_id)
        if isinstance(exc, QueueFullError):
            state.metrics.rejected.labels(reason="queue_full").inc()
            raise P.APIError(str(exc), 503, "service_unavailable",
                             headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        if isinstance(exc, EngineClosedError):
            state.metrics.rejected.labels(reason="shutting_down").inc()
            raise P.APIError(str(exc), 503, "service_unavailable",
                             headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        if isinstance(exc, (ValueError, TypeError)):
            state.metrics.rejected.labels(reason="invalid").inc()
            raise P.engine_error(exc, prompt_param) from None
        raise
    return streams


async def _final(stream: RequestStream) -> RequestOutput:
    last = None
    async for out in stream:
        last = out
    assert last is not None
    return last


async def _wait_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.2)


async def _collect(request: Request, state: ServerState,
                   streams: list[RequestStream]) -> list[RequestOutput] | None:
    """Every stream's final output (None if the client went away); all are aborted unless finished."""
    gathered = asyncio.ensure_future(asyncio.gather(*(_final(s) for s in streams)))
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({gathered, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if gathered not in done:
            return None
        return gathered.result()
    except RequestFailedError as exc:
        state.metrics.failed.inc()
        raise P.APIError(str(exc), 500, "internal_error") from None
    except EngineClosedError as exc:
        raise P.APIError(str(exc), 503, "service_unavailable") from None
    finally:
        watcher.cancel()
        gathered.cancel()
        for s in streams:
            if not s.done:
                state.engine.abort(s.request_id)


# ------------------------------------------------------------------------------------- streaming
def _sse(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        async for event in events:
            yield f"data: {json.dumps(event, separators=(',', ':'))}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


_END = object()


@dataclass
class _Job:
    """One HTTP request's engine requests, streamed as OpenAI chunks."""

    state: ServerState
    rid: str
    kind: str
    params: SamplingParams
    streams: list[RequestStream]
    stream_options: P.StreamOptions | None
    created: int = field(default_factory=lambda: int(time.time()))
    latest: dict[int, RequestOutput] = field(default_factory=dict)  # newest output per prompt
    tools: S.ToolPlan | None = None  # chat: how the output may become tool calls

    def header(self, chunk: bool = False) -> dict[str, Any]:
        kind = self.kind + (".chunk" if chunk and self.kind == "chat.completion" else "")
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.state.model_name}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body = {**self.header(chunk=True), "choices": choices}
        if self.include_usage:  # usage so far with continuous_usage_stats (vLLM), else only in the last chunk
            continuous = self.stream_options is not None and self.stream_options.continuous_usage_stats
            body["usage"] = R.usage(list(self.latest.values())) if continuous and self.latest else None
        return body

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) from every stream as they come; aborts all on exit or failure."""
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        async def pump(i: int, s: RequestStream) -> None:
            try:
                async for out in s:
                    queue.put_nowait((i, out))
            except Exception as exc:  # a failed step (RequestFailedError) or a closed engine
                queue.put_nowait((i, exc))
            queue.put_nowait((i, _END))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is _END:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    self.latest[i] = item
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            for s in self.streams:
                if not s.done:
                    self.state.engine.abort(s.request_id)

    async def _guarded(self, events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        """Pass events through; a failed request becomes one error event (then the stream ends)."""
        try:
            async for event in events:
                yield event
        except (RequestFailedError, EngineClosedError) as exc:
            self.state.metrics.failed.inc()
            yield P.APIError(str(exc), 500, "internal_error").body()

    def completion_events(self, echoes: list[str | None]) -> AsyncIterator[dict[str, Any]]:
        return self._guarded(self._completion_events(echoes))

    async def _completion_events(self, echoes: list[str | None]) -> AsyncIterator[dict[str, Any]]:
        cursors: dict[tuple[int, int], R.SampleCursor] = {}
        echoed: set[tuple[int, int]] = set()
        finals: dict[int, RequestOutput] = {}
        tok = self.state.token_text
        n = self.params.n
        async for i, out in self.outputs():
            for c in out.outputs:
                key = (i, c.index)
                cursor = cursors.setdefault(key, R.SampleCursor(self.params.stop_strings))
                delta = cursor.advance(c)
                if delta is not None:
                    prefix = (echoes[i] or "") if key not in echoed else ""
                    echoed.add(key)
                    yield self.chunk([R.completion_chunk_choice(i * n + c.index, delta, tok, prefix)])
            if out.finished:
                finals[i] = out
        if self.include_usage:
            yield {**self.header(chunk=True), "choices": [], "usage": R.usage([finals[i] for i in sorted(finals)])}

    def chat_events(self) -> AsyncIterator[dict[str, Any]]:
        return self._guarded(self._chat_events())

    async def _chat_events(self) -> AsyncIterator[dict[str, Any]]:
        for index in range(self.params.n):
            yield self.chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                               "finish_reason": None}])
        cursors: dict[int, R.SampleCursor] = {}
        tool_streams: dict[int, S.ToolStream] = {}
        final: RequestOutput | None = None
        async for _, out in self.outputs():
            for c in out.outputs:
                cursor = cursors.setdefault(c.index, R.SampleCursor(self.params.stop_strings))
                delta = cursor.advance(c)
                if delta is None:
                    continue
                choice = R.chat_chunk_choice(c.index, delta, self.state.token_text)
                if self.tools is not None and (self.tools.mode == "named" or self.tools.buffered):
                    ts = tool_streams.setdefault(c.index, S.ToolStream(self.tools))
                    body = ts.delta(delta.text, delta.finish_reason)
                    if body is None:
                        continue
                    choice = {**choice, "delta": body[0], "finish_reason": body[1]}
                yield self.chunk([choice])
            if out.finished:
                final = out
        if self.include_usage and final is not None:
            yield {**self.header(chunk=True), "choices": [], "usage": R.usage([final])}

