"""The OpenAI-compatible HTTP server: a FastAPI app over an :class:`AsyncLLM`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or server-sent events
ending in ``data: [DONE]`` with ``stream: true``), ``GET /v1/models``, ``GET /health`` (503 while
draining or while no engine process runs) and ``GET /metrics`` (Prometheus). Errors are OpenAI-shaped
bodies: 400 naming the bad field, 404 for an unknown model, 503 with Retry-After when the waiting queue
is full or the engine process died (its open requests too: the message says how it died), 500 when the
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
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from flashpage.engine import RequestOutput, SamplingParams
from flashpage.engine import chat as C
from flashpage.engine.limits import context_overflow
from flashpage.serve import media as M
from flashpage.serve import protocol as P
from flashpage.serve import responses as R
from flashpage.serve import structured as S
from flashpage.serve.async_engine import (
    AsyncLLM,
    EngineClosedError,
    EngineDiedError,
    QueueFullError,
    RequestFailedError,
    RequestStream,
)
from flashpage.serve.metrics import CONTENT_TYPE, ServeMetrics
from flashpage.serve.tokenize import DEFAULT_WORKERS, TokenizerPool

log = logging.getLogger("flashpage.serve")
RETRY_AFTER_SECONDS = 1
DEFAULT_MAX_REQUEST_BYTES = 8 << 20  # 8 MiB: a 2048-token prompt as ids is ~12 KB, as text ~10 KB
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
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    tokenizer_workers: int = DEFAULT_WORKERS
    media: M.MediaOptions = field(default_factory=M.MediaOptions)
    processor: Any = None  # a vision-language model's processor (images; its chat template)
    images_refused: str | None = "no processor"  # why the model takes no images (None: it does)
    created: int = field(default_factory=lambda: int(time.time()))
    token_text: R.TokenText = field(init=False)
    pool: TokenizerPool = field(init=False)  # tokenization, chat templates, images: off the loop and the engine

    def __post_init__(self) -> None:
        self.token_text = R.TokenText(self.tokenizer)
        self.pool = TokenizerPool(self.tokenizer, self.tokenizer_workers, self.processor)


def build_app(engine: AsyncLLM, model_name: str, *, chat_template: str | None = None,
              metrics: ServeMetrics | None = None, close_on_shutdown: bool = True,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, tokenizer_workers: int = DEFAULT_WORKERS,
              media: M.MediaOptions | None = None) -> FastAPI:
    """The server's app. With ``close_on_shutdown`` the engine is closed when the app shuts down.
    Request bodies over ``max_request_bytes`` get 413; prompts are tokenized and chat templates applied
    on ``tokenizer_workers`` threads. ``media``: which images chat requests may carry (serve/media.py)."""
    if isinstance(max_request_bytes, bool) or not isinstance(max_request_bytes, int) or max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be a number of bytes >= 1; got {max_request_bytes!r}")
    tokenizer = _own_copy(engine.llm.tokenizer)
    if metrics is None:
        metrics = ServeMetrics(engine.snapshot, restarts=lambda: engine.restarts)
        engine.on_tokens, engine.on_finish = metrics.on_tokens, metrics.on_finish
    state = ServerState(engine, tokenizer, model_name, engine.llm.max_model_len, metrics, chat_template,
                        max_request_bytes, tokenizer_workers, media or M.MediaOptions(),
                        _own_copy(getattr(engine.llm, "processor", None)), M.images_refused(engine.llm))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        state.pool.close()
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


def _unavailable(message: str) -> P.APIError:
    """503 with Retry-After: shutting down, or no engine process runs now (it died)."""
    return P.APIError(message, 503, "service_unavailable", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


_GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
_REFUSAL_REASONS = {404: "unknown_model", 413: "body_too_large"}  # else "invalid"


def _add_error_handlers(app: FastAPI, state: ServerState) -> None:
    @app.exception_handler(P.APIError)
    async def api_error(request: Request, err: P.APIError) -> JSONResponse:
        if request.url.path in _GENERATION_PATHS and err.status < 500:  # a refusal (503s: counted where raised)
            state.metrics.rejected.count_uncounted(_REFUSAL_REASONS.get(err.status, "invalid"))
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
        return _error_response(_unavailable(state.engine.unavailable or "the server is shutting down"))

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "flashpage",
             "root": state.model_name, "parent": None, "max_model_len": state.max_model_len,
             # images in chat content parts (image_url); flashpage's field, as vLLM has none
             "capabilities": {"vision": state.images_refused is None}}]})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)


# ----------------------------------------------------------------------------- generation routes
def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = P.parse(P.CompletionRequest, await _read_body(request, state))
        P.check_completion(req)
        _check_model(state, req.model)
        structured = S.request_structured(req)
        await _prepare(state, structured, S.constraint_param(req))
        params = P.sampling_params(req, P.completion_max_tokens(req), P.completion_logprobs(req),
                                   structured=structured, prompt_logprobs=P.completion_prompt_logprobs(req))
        prompts = P.completion_prompts(req)
        _check_batch(state, len(prompts))
        ids = await _encode(state, prompts)
        for p in ids:
            _check_context(state, len(p), params.max_tokens, "max_tokens", "prompt")
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = await _submit(state, ids, params, rid, "prompt")
        echoes = [await _echo_text(state, p) if req.echo else None for p in prompts]
        job = _Job(state, rid, "text_completion", params, streams, req.stream_options, P.echo_only(req))
        if req.stream:
            return _sse(job.completion_events(echoes))
        outs = await _collect(request, state, streams)
        if outs is None:
            return Response(status_code=CLIENT_CLOSED)
        outs = [job.visible(o) for o in outs]
        choices = [R.completion_choice(i * params.n + c.index, c, state.token_text, echoes[i], job.echo_logprobs(out))
                   for i, out in enumerate(outs) for c in out.outputs]
        return JSONResponse({**job.header(), "choices": choices, "usage": R.usage(outs)})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req = P.parse(P.ChatRequest, await _read_body(request, state))
        P.check_chat(req)
        _check_model(state, req.model)
        tools = S.tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls)
        structured = _chat_structured(req, tools)
        await _prepare(state, structured, S.constraint_param(req, tools))
        prompt = await _chat_prompt(state, req, tools)
        ids = prompt if isinstance(prompt, list) else prompt["prompt_token_ids"]
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = limit if limit is not None else max(1, state.max_model_len - len(ids))
        _check_context(state, len(ids), max_tokens,
                       "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens", "messages")
        params = P.sampling_params(req, max_tokens, P.chat_logprobs(req), renames={"logprobs": "top_logprobs"},
                                   structured=structured)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await _submit(state, [prompt], params, rid, "messages")
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


async def _read_body(request: Request, state: ServerState) -> bytes:
    """The request body, refused with 413 beyond ``max_request_bytes`` (by its Content-Length before
    reading anything, else as soon as the bytes read exceed it)."""
    limit = state.max_request_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(state, f"{int(declared)} bytes", limit)
    parts: list[bytes] = []
    size = 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise _too_large(state, f"more than {limit} bytes", limit)
        parts.append(part)
    return b"".join(parts)


def _too_large(state: ServerState, size: str, limit: int) -> P.APIError:
    state.metrics.rejected.labels(reason="body_too_large").inc()
    return P.APIError(f"request body is {size}; this server accepts at most {limit} bytes per request "
                      "(flashpage serve --max-request-bytes): send fewer or shorter prompts per request",
                      413, "invalid_request_error")


def _check_batch(state: ServerState, num_prompts: int) -> None:
    """A request with more prompts than the waiting queue can ever hold: 400 at once (never 503: retrying
    cannot help), before anything is tokenized or queued."""
    limit = state.engine.max_waiting_requests
    if limit is not None and num_prompts > limit:
        state.metrics.rejected.labels(reason="batch_too_large").inc()
        raise P.APIError(f"this request has {num_prompts} prompts, but the server queues at most {limit} requests "
                         f"(--max-waiting-requests {limit}): send at most {limit} prompts per request", param="prompt")


def _check_context(state: ServerState, num_prompt: int, max_tokens: int, tokens_param: str,
                   prompt_param: str) -> None:
    """prompt + max_tokens beyond the model's context: 400 naming both numbers (vLLM's answer)."""
    problem = context_overflow(num_prompt, max_tokens, state.max_model_len)
    if problem is not None:
        state.metrics.rejected.labels(reason="context_length").inc()
        fits = num_prompt < state.max_model_len
        raise P.APIError(problem.replace("max_tokens", tokens_param), param=tokens_param if fits else prompt_param)


async def _encode(state: ServerState, prompts: list[str | list[int]]) -> list[list[int]]:
    """Token ids of the prompts, encoded on the tokenizer pool (text prompts need a tokenizer)."""
    if state.tokenizer is None and any(isinstance(p, str) for p in prompts):
        raise P.APIError("this model has no tokenizer: send prompts as token ids", param="prompt")
    return await state.pool.encode(prompts)


async def _echo_text(state: ServerState, prompt: str | list[int]) -> str:
    if isinstance(prompt, str):
        return prompt
    return await state.pool.decode(prompt) if state.tokenizer is not None else ""


def _chat_structured(req: P.ChatRequest, tools: S.ToolPlan) -> Any:
    """The chat request's constraint: a forced tool call's schema, else response_format / structured_outputs."""
    forced = S.tool_constraint(tools)
    if forced is not None and S.request_structured(req) is not None:
        raise P.APIError(f"tool_choice {tools.mode!r} forces the output's format: give no 'response_format' "
                         "or 'structured_outputs' with it", param="tool_choice")
    return forced or S.request_structured(req)


async def _prepare(state: ServerState, spec: Any, param: str) -> None:
    """Compile a constraint on a worker thread (cached in the engine): a 400 naming ``param`` if it cannot be."""
    if spec is None:
        return
    try:
        await state.pool.run(lambda _tok: state.engine.llm.prepare_structured_outputs(spec))
    except ValueError as exc:
        raise P.APIError(str(exc), param=param) from None
    except EngineClosedError as exc:  # the engine process died meanwhile
        state.metrics.rejected.labels(reason="engine_unavailable").inc()
        raise _unavailable(str(exc)) from None


def _with_tools(choice: dict[str, Any], tools: S.ToolPlan) -> dict[str, Any]:
    """A chat choice with its text as tool calls where the tool plan makes it one."""
    if tools.mode == "none":
        return choice
    message, reason = S.tool_message(choice["message"]["content"], choice["finish_reason"], tools)
    return {**choice, "message": message, "finish_reason": reason}


async def _chat_prompt(state: ServerState, req: P.ChatRequest,
                       tools: S.ToolPlan | None = None) -> list[int] | dict[str, Any]:
    """The chat request's prompt: token ids, or with images the engine's prompt dict (ids and image tensors)."""
    num_images = M.count_images(req.messages)
    M.check_images(num_images, state.images_refused, state.model_name, state.media)
    tok = state.tokenizer
    on_processor = state.processor is not None and state.chat_template is None \
        and not getattr(tok, "chat_template", None)  # a VLM checkpoint keeping its template on the processor only
    if num_images or on_processor:
        return await _processor_chat_prompt(state, req, tools)
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
        return await state.pool.chat(messages, template, req.add_generation_prompt, **extra)
    except Exception as exc:  # the template refused these messages (e.g. roles out of order)
        raise P.APIError(f"the chat template rejected the messages: {exc}", param="messages") from None


async def _processor_chat_prompt(state: ServerState, req: P.ChatRequest,
                                 tools: S.ToolPlan | None) -> list[int] | dict[str, Any]:
    """Messages with images (or a template on the processor only) rendered as ``LLM.chat`` renders them, the
    images read and the processor run on a tokenizer thread (serve/media.py)."""
    base = S.template_messages(req.messages)
    tool_list = [{"type": "function", "function": t} for t in tools.tools] if tools and tools.tools else None

    def work(tok: Any, processor: Any) -> list[int] | dict[str, Any]:
        messages = M.part_messages(req.messages, base, state.media)  # APIError(400) for an unreadable image
        try:
            prompt = C.render(messages, tok, processor, chat_template=state.chat_template,
                              add_generation_prompt=req.add_generation_prompt, continue_final_message=False,
                              tools=tool_list, chat_template_kwargs=None)
        except Exception as exc:  # the template refused these messages
            raise P.APIError(f"the chat template rejected the messages: {exc}", param="messages") from None
        out = M.processed(processor, prompt)
        return out["prompt_token_ids"] if "multi_modal_data" not in out else out

    return await state.pool.run_with_processor(work)


async def _submit(state: ServerState, prompts: list[Any], params: SamplingParams, rid: str,
                  prompt_param: str) -> list[RequestStream]:
    """Queue one engine request per prompt, all or none, and wait until the engine accepted them all."""
    streams: list[RequestStream] = []
    try:
        streams = state.engine.add_requests(prompts, params, [f"{rid}-{i}" for i in range(len(prompts))])
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
            reason = "engine_unavailable" if isinstance(exc, EngineDiedError) else "shutting_down"
            state.metrics.rejected.labels(reason=reason).inc()
            raise _unavailable(str(exc)) from None
        if isinstance(exc, (ValueError, TypeError)):
            state.metrics.rejected.labels(reason="invalid").inc()
            raise P.engine_error(exc, prompt_param) from None
        raise
    return streams


async def _final(stream: RequestStream) -> RequestOutput:
    last = None
    async for out in stream.latest():
        last = out
    assert last is not None
    return last


async def _wait_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.2)


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


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
    except EngineClosedError as exc:  # shut down, or the engine process died (the message says how)
        if isinstance(exc, EngineDiedError):
            state.metrics.failed.inc()
        raise _unavailable(str(exc)) from None
    finally:
        for fut in (watcher, gathered):  # a result that lost the race is read here, never logged as
            fut.cancel()                 # "exception was never retrieved" when the client went away
            fut.add_done_callback(_retrieve)
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
    echo_only: bool = False  # echo with max_tokens=0: the engine's one generated token is not shown
    created: int = field(default_factory=lambda: int(time.time()))
    latest: dict[int, RequestOutput] = field(default_factory=dict)  # newest output per prompt
    tools: S.ToolPlan | None = None  # chat: how the output may become tool calls

    def visible(self, out: RequestOutput) -> RequestOutput:
        """What the client sees of ``out``: without the generated token under ``echo_only``."""
        return R.without_output(out) if self.echo_only else out

    def echo_logprobs(self, out: RequestOutput) -> dict[str, Any] | None:
        """The echoed prompt's logprobs object (echo with logprobs), else None."""
        if out.prompt_logprobs is None:
            return None
        return R.prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs, self.state.token_text)

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
        """(prompt index, output) from every stream as they come, the newest only where the client fell
        behind (outputs are cumulative: nothing is lost); aborts all on exit or failure."""
        try:
            if len(self.streams) == 1:  # the common case: no pump task, no queue
                async for out in self.streams[0].latest():
                    self.latest[0] = out
                    yield 0, out
            else:
                async with aclosing(self._merged()) as merged:  # its pump tasks end with this generator
                    async for i, out in merged:
                        yield i, out
        finally:
            for s in self.streams:
                if not s.done:
                    self.state.engine.abort(s.request_id)

    async def _merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every stream's outputs through one queue, in arrival order."""
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        async def pump(i: int, s: RequestStream) -> None:
            try:
                async for out in s.latest():
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

    async def _guarded(self, events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        """Pass events through; a failed request becomes one error event (then the stream ends): 500 for a
        failed engine step, 503 when the server shut down or the engine process died (the message says how)."""
        try:
            async for event in events:
                yield event
        except RequestFailedError as exc:
            self.state.metrics.failed.inc()
            yield P.APIError(str(exc), 500, "internal_error").body()
        except EngineClosedError as exc:
            self.state.metrics.failed.inc()
            yield _unavailable(str(exc)).body()

    def completion_events(self, echoes: list[str | None]) -> AsyncIterator[dict[str, Any]]:
        return self._guarded(self._completion_events(echoes))

    async def _completion_events(self, echoes: list[str | None]) -> AsyncIterator[dict[str, Any]]:
        cursors: dict[tuple[int, int], R.SampleCursor] = {}
        echoed: set[tuple[int, int]] = set()
        finals: dict[int, RequestOutput] = {}
        tok = self.state.token_text
        n = self.params.n
        async for i, out in self.outputs():
            out = self.visible(out)
            for c in out.outputs:
                key = (i, c.index)
                cursor = cursors.setdefault(key, R.SampleCursor(self.params.stop_strings))
                delta = cursor.advance(c)
                if delta is not None:
                    first = key not in echoed
                    prefix = (echoes[i] or "") if first else ""
                    prefix_lps = self.echo_logprobs(out) if first else None
                    echoed.add(key)
                    yield self.chunk([R.completion_chunk_choice(i * n + c.index, delta, tok, prefix, prefix_lps,
                                                                len(echoes[i] or ""))])
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

