"""AsyncLLM: a thread- and asyncio-safe front for :class:`flashpage.LLM`.

One background thread owns the engine: it applies queued ``add_request`` / ``abort`` commands
between steps, calls ``LLM.step()`` while there is work, and hands each request's outputs to its
:class:`RequestStream`. Any thread or event loop may add, abort and read streams; only the engine
thread touches the ``LLM`` (``stats()`` takes the same lock, so it never sees half a step).

The hand-off costs the engine one ``call_soon_threadsafe`` per event loop per step (all of the step's
streams woken together), not one per request and token; a consumer that falls behind may read only
the newest output (:meth:`RequestStream.latest`: outputs are cumulative, so nothing is lost), as
vLLM's output collector merges outputs its API server has not sent yet.

- ``abort()`` of an unknown or ended id is a no-op; an aborted request's stream ends with one final
  output whose finish_reason is "abort".
- A step that raises fails only the requests it was computing (``LLM.step_request_ids``): their
  streams raise :class:`RequestFailedError`, their blocks are freed, the loop keeps serving.
- ``max_waiting_requests`` bounds the requests accepted but not yet running; beyond it
  ``add_request`` raises :class:`QueueFullError` at once. ``add_requests`` queues a batch all or
  nothing, so a batch that does not fit never occupies the queue while it is turned away.
- ``close(drain_timeout)`` stops accepting, lets unfinished requests run for up to the timeout,
  aborts the rest and joins the thread.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Container, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flashpage.engine import EngineStats, RequestOutput, SamplingParams

if TYPE_CHECKING:
    from flashpage.engine.llm import LLM

log = logging.getLogger("flashpage.serve")

Prompt = str | Sequence[int]


class QueueFullError(RuntimeError):
    """Too many requests are waiting; retry later (HTTP 503 with Retry-After)."""


class EngineClosedError(RuntimeError):
    """The front is stopped or draining and accepts no new request."""


class EngineDiedError(EngineClosedError):
    """The engine process died: its requests were lost, and no request is taken until a new one runs
    (HTTP 503 with Retry-After; ``flashpage serve --max-engine-restarts``)."""


class RequestFailedError(RuntimeError):
    """The engine step computing this request raised; the request was ended (HTTP 500)."""


@dataclass(frozen=True)
class _Accepted:
    """First item of a stream once the engine queued the request (validation passed)."""


@dataclass(frozen=True)
class _Failed:
    error: BaseException


@dataclass(frozen=True)
class TokenEvent:
    """Timing of one delivered output (for metrics observers)."""

    request_id: str
    new_tokens: int
    first: bool
    seconds: float  # since arrival (first) or since the previous delivery of this request


class RequestStream:
    """Outputs of one request, in order: cumulative :class:`RequestOutput` snapshots, the last one
    with ``finished=True``. Iterate with ``async for`` on any event loop or ``for`` on any thread."""

    def __init__(self, request_id: str, on_close: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_close = on_close
        self._accepted = False
        self._stash: Any = None  # an item read ahead by latest(), returned by the next read
        self.done = False

    # engine thread ------------------------------------------------------------------
    def _put(self, item: Any) -> asyncio.AbstractEventLoop | None:
        """Queue ``item``; returns the event loop whose consumer must be woken (see :class:`_Wakeups`)."""
        self._items.put(item)
        return self._loop

    # consumers ----------------------------------------------------------------------
    async def _get(self) -> Any:
        if self._stash is not None:
            item, self._stash = self._stash, None
            return item
        self._loop = asyncio.get_running_loop()
        while True:
            try:
                return self._items.get_nowait()
            except queue.Empty:
                self._wake.clear()
                if self._items.empty():
                    await self._wake.wait()

    async def accepted(self) -> None:
        """Wait until the engine queued the request; raises its validation error (ValueError/TypeError)."""
        if not self._accepted:
            self._check(await self._get())

    def _check(self, item: Any) -> RequestOutput | None:
        if isinstance(item, _Failed):
            self.done = True
            raise item.error
        if isinstance(item, _Accepted):
            self._accepted = True
            return None
        if item.finished:
            self.done = True
        return item

    async def _get_latest(self) -> Any:
        """The next item, or when several outputs are queued the newest of them: outputs are
        cumulative, so the newest holds everything the skipped ones did (vLLM's output collector)."""
        item = await self._get()
        while isinstance(item, RequestOutput) and not item.finished:
            try:
                nxt = self._items.get_nowait()
            except queue.Empty:
                break
            if isinstance(nxt, RequestOutput):
                item = nxt
            else:  # a failure after the outputs: reported by the next read
                self._stash = nxt
                break
        return item

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._aiter(coalesce=False)

    def latest(self) -> AsyncIterator[RequestOutput]:
        """Like ``async for``, but a consumer that fell behind gets only the newest of the outputs
        queued meanwhile (one cumulative snapshot instead of one per engine step), the final one always."""
        return self._aiter(coalesce=True)

    async def _aiter(self, coalesce: bool) -> AsyncIterator[RequestOutput]:
        try:
            while not self.done:
                out = self._check(await (self._get_latest() if coalesce else self._get()))
                if out is not None:
                    yield out
        finally:
            if not self.done:  # the consumer stopped early (cancelled, disconnected): end the request
                self._on_close(self.request_id)

    def __iter__(self) -> Iterator[RequestOutput]:
        try:
            while not self.done:
                if self._stash is not None:
                    item, self._stash = self._stash, None
                else:
                    item = self._items.get()
                out = self._check(item)
                if out is not None:
                    yield out
        finally:
            if not self.done:
                self._on_close(self.request_id)


class _Wakeups:
    """Streams given items during one engine iteration, woken together: one
    ``call_soon_threadsafe`` per event loop per iteration (not one per request and token), so the
    engine thread gives the loop one hand-off per step and the loop wakes its consumers in one go."""

    def __init__(self) -> None:
        self._by_loop: dict[asyncio.AbstractEventLoop, list[RequestStream]] = {}

    def put(self, stream: RequestStream, item: Any) -> None:
        loop = stream._put(item)
        if loop is not None:
            self._by_loop.setdefault(loop, []).append(stream)

    def flush(self) -> None:
        pending, self._by_loop = self._by_loop, {}
        for loop, streams in pending.items():
            try:
                loop.call_soon_threadsafe(_wake_all, streams)
            except RuntimeError:  # the consumers' loop is closed: nobody reads these streams any more
                for stream in streams:
                    stream._on_close(stream.request_id)


def _wake_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream._wake.set()


@dataclass
class _Live:
    """Front-side state of one request."""

    stream: RequestStream
    arrival: float
    last_delivery: float | None = None


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt: Prompt
    params: SamplingParams | None
    arrival: float


@dataclass(frozen=True)
class _Abort:
    request_id: str | None  # None: every request


class AsyncLLM:
    """Run an :class:`~flashpage.LLM` in a background thread behind thread-safe calls.

    Args:
        llm: the engine; once given here, use it only through this front.
        max_waiting_requests: requests accepted but not yet running, at most (None: unbounded).
        on_tokens: called on the engine thread with a :class:`TokenEvent` per delivered output.
        on_finish: called on the engine thread with each final :class:`RequestOutput`.
    """

    restarts = 0  # engines started to replace a dead one (an engine process's count; a thread is never restarted)

    def __init__(self, llm: LLM, *, max_waiting_requests: int | None = 512,
                 on_tokens: Callable[[TokenEvent], None] | None = None,
                 on_finish: Callable[[RequestOutput], None] | None = None) -> None:
        check_max_waiting(max_waiting_requests)
        self.llm = llm
        self.max_waiting_requests = max_waiting_requests
        self.on_tokens = on_tokens
        self.on_finish = on_finish
        self._cv = threading.Condition()
        self._engine_lock = threading.RLock()
        self._commands: list[_Add | _Abort] = []  # applied in order, between steps (guarded by _cv)
        self._live: dict[str, _Live] = {}  # engine thread only
        self._pending_streams: dict[str, RequestStream] = {}  # added, not yet given to the engine (_cv)
        self._num_live = 0
        self._busy = False  # the engine has work or outputs to report (engine thread)
        self._ids = itertools.count()
        self._accepting = True
        self._stopping = False
        self._snapshot = llm.stats()
        self._wakeups = _Wakeups()  # engine thread only
        self.failed_steps = 0
        self.dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="flashpage-engine", daemon=True)
        self._thread.start()

    # --------------------------------------------------------------------- public calls
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> RequestStream:
        """Queue a request; returns its stream at once (validation errors surface from the stream)."""
        return self.add_requests([prompt], params, [request_id])[0]

    def add_requests(self, prompts: Sequence[Prompt], params: SamplingParams | None = None,
                     request_ids: Sequence[str | None] | None = None,
                     arrival: float | None = None) -> list[RequestStream]:
        """Queue several requests all or nothing: when the waiting queue cannot take them all, none is
        queued (QueueFullError; a batch larger than ``max_waiting_requests`` raises ValueError, since it
        could never fit). Returns their streams at once, in order. ``arrival``: when they arrived
        (``time.perf_counter()``; default now), for the time-to-first-token metrics."""
        with self._cv:
            if not self._accepting or self.dead is not None:
                raise EngineClosedError("the server is shutting down and accepts no new request")
            waiting = len(self._pending_streams) + self._snapshot.waiting
            rids = admit(prompts, request_ids, self.max_waiting_requests, waiting, self._pending_streams, self._ids)
            now = time.perf_counter() if arrival is None else arrival
            streams = []
            for rid, prompt in zip(rids, prompts, strict=True):
                stream = self._new_stream(rid)
                self._commands.append(_Add(rid, prompt, params, now))
                self._pending_streams[rid] = stream
                streams.append(stream)
            self._cv.notify()
        return streams

    def abort(self, request_id: str) -> None:
        """End a request; its stream gets one final output with finish_reason "abort".
        Unknown or ended ids are ignored."""
        with self._cv:
            self._commands.append(_Abort(request_id))
            self._cv.notify()

    def abort_all(self) -> None:
        """End every request accepted so far (each stream gets its final "abort" output)."""
        with self._cv:
            self._commands.append(_Abort(None))
            self._cv.notify()

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Async iterator of the request's outputs; leaving it early aborts the request."""
        stream = self.add_request(prompt, params, request_id)
        async for out in stream:
            yield out

    def _new_stream(self, request_id: str) -> RequestStream:
        return RequestStream(request_id, self.abort)

    def _flush(self) -> None:
        """Hand the iteration's outputs to their readers (once per engine iteration)."""
        self._wakeups.flush()

    def stats(self) -> EngineStats:
        """Current engine statistics (waits for a step in progress)."""
        with self._engine_lock:
            return self.llm.stats()

    def snapshot(self) -> EngineStats:
        """Statistics as of the end of the latest engine iteration (never waits)."""
        return self._snapshot

    @property
    def engine_thread_id(self) -> int | None:
        """The engine thread's native (OS) id, e.g. to bind it to cores."""
        return self._thread.native_id

    @property
    def num_unfinished(self) -> int:
        with self._cv:
            return len(self._pending_streams) + self._num_live

    @property
    def accepting(self) -> bool:
        return self._accepting and self.dead is None

    @property
    def unavailable(self) -> str | None:
        """Why the front takes no request now (``/health``'s 503 message); None while it takes them."""
        if self.dead is not None:
            return f"the engine loop died ({type(self.dead).__name__}: {self.dead})"
        return None if self._accepting else "the server is shutting down"

    @property
    def fatal_error(self) -> BaseException | None:
        """Set once the engine is gone for good (its loop died): ``flashpage serve`` then exits non-zero."""
        return self.dead

    def stop_accepting(self) -> None:
        with self._cv:
            self._accepting = False

    def close(self, drain_timeout: float = 0.0) -> bool:
        """Stop accepting, let unfinished requests run up to ``drain_timeout`` seconds, abort the rest
        and stop the thread. Returns True when every request finished on its own."""
        self.stop_accepting()
        deadline = time.monotonic() + drain_timeout
        while self.num_unfinished and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.01)
        drained = self.num_unfinished == 0
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout=max(5.0, drain_timeout))
        return drained

    # ----------------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._commands and not self._busy and not self._stopping:
                        self._cv.wait()
                    if self._stopping:
                        break
                    commands, self._commands = self._commands, []
                with self._engine_lock:
                    self._apply(commands)
                    if self.llm.has_unfinished_requests():
                        self._step()
                    self._busy = self.llm.has_unfinished_requests()
                    self._snapshot = self.llm.stats()
                self._flush()
        except BaseException as exc:  # a bug in the loop itself: fail everything, refuse new work
            log.exception("engine loop died")
            self.dead = exc
        self._shutdown()

    def _apply(self, commands: list[_Add | _Abort]) -> None:
        for cmd in commands:
            if isinstance(cmd, _Abort):
                for rid in [cmd.request_id] if cmd.request_id is not None else list(self._live):
                    self.llm.abort(rid)
            else:
                self._add(cmd)

    def _add(self, cmd: _Add) -> None:
        with self._cv:
            stream = self._pending_streams.pop(cmd.request_id)
        try:
            self.llm.add_request(cmd.prompt, cmd.params, request_id=cmd.request_id)
        except Exception as exc:  # invalid input: the caller gets the error, nothing was queued
            self._wakeups.put(stream, _Failed(exc))
            return
        self._live[cmd.request_id] = _Live(stream, cmd.arrival)
        self._set_live_count()
        self._wakeups.put(stream, _Accepted())

    def _step(self) -> None:
        try:
            outputs = self.llm.step()
        except Exception as exc:
            self._fail_step(exc)
            return
        now = time.perf_counter()
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is not None:
                self._deliver(live, out, now)

    def _deliver(self, live: _Live, out: RequestOutput, now: float) -> None:
        new = sum(len(c.token_ids) for c in out.outputs)
        if new and self.on_tokens is not None:
            first = live.last_delivery is None
            since = now - (live.arrival if first else live.last_delivery)
            _call(self.on_tokens, TokenEvent(out.request_id, new, first, since))
        if new:
            live.last_delivery = now
        self._wakeups.put(live.stream, out)
        if out.finished:
            self._end(out.request_id)
            if self.on_finish is not None:
                _call(self.on_finish, out)

    def _fail_step(self, exc: Exception) -> None:
        self.failed_steps += 1
        ids = [r for r in self.llm.step_request_ids if r in self._live]
        if not ids:  # the step failed before computing anything (scheduling): nobody can progress
            ids = list(self._live)
        if not ids:  # nothing of ours to fail: do not spin on a persistent fault
            time.sleep(0.05)
        log.error("engine step failed (%s: %s); failing requests %s", type(exc).__name__, exc, ids)
        error = RequestFailedError(f"the engine step computing this request failed: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        for rid in ids:
            live = self._live.get(rid)
            self.llm.abort(rid)  # frees its blocks; the abort report that follows is ignored
            if live is not None:
                self._wakeups.put(live.stream, _Failed(error))
                self._end(rid)

    def _end(self, rid: str) -> None:
        self._live.pop(rid, None)
        self._set_live_count()

    def _set_live_count(self) -> None:
        with self._cv:
            self._num_live = len(self._live)

    def _shutdown(self) -> None:
        """Abort what is left, report it, and fail any stream that could not be reported."""
        with self._engine_lock:
            with self._cv:
                pending = list(self._pending_streams.values())
                self._pending_streams.clear()
                self._commands = []
            closed = EngineClosedError("the server shut down before this request finished")
            for stream in pending:
                self._wakeups.put(stream, _Failed(closed))
            for rid in list(self._live):
                self.llm.abort(rid)
            for _ in range(3):
                if not self._live or not self.llm.has_unfinished_requests():
                    break
                try:
                    self._step()
                except Exception:  # reporting failed: fall through to failing the streams
                    break
            for rid, live in list(self._live.items()):
                self._wakeups.put(live.stream, _Failed(closed))
                self._end(rid)
            self._snapshot = self.llm.stats()
            self._flush()


def check_max_waiting(value: int | None) -> None:
    """ValueError unless ``max_waiting_requests`` is an int >= 1 or None."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"max_waiting_requests must be an int >= 1 or None; got {value!r}")


def admit(prompts: Sequence[Prompt], request_ids: Sequence[str | None] | None, limit: int | None, waiting: int,
          pending: Container[str], ids: Iterator[int]) -> list[str]:
    """The request ids of a batch the front may queue now (all or nothing), else the error that refuses it:
    QueueFullError when ``waiting`` requests plus these exceed ``limit`` (retry later), ValueError for a batch
    that could never fit or an id given twice or still ``pending``. Ids left None get ``req-N``."""
    given = list(request_ids) if request_ids is not None else [None] * len(prompts)
    if len(given) != len(prompts):
        raise ValueError(f"got {len(given)} request ids for {len(prompts)} prompts")
    if limit is not None and len(prompts) > limit:
        raise ValueError(f"{len(prompts)} prompts in one request, but the server queues at most {limit} "
                         f"requests (max_waiting_requests={limit}); send at most {limit} prompts per request")
    if limit is not None and waiting + len(prompts) > limit:
        raise QueueFullError(f"server is at capacity: {waiting} requests are waiting and this one brings "
                             f"{len(prompts)} (max_waiting_requests={limit}); retry later")
    rids = [rid if rid is not None else f"req-{next(ids)}" for rid in given]
    seen: set[str] = set()
    for rid in rids:
        if rid in pending or rid in seen:
            raise ValueError(f"request id {rid!r} is already in use")
        seen.add(rid)
    return rids


def _call(callback: Callable[[Any], None], arg: Any) -> None:
    """An observer's error is logged, never allowed to stop the engine thread."""
    try:
        callback(arg)
    except Exception:
        log.exception("flashpage serve: an AsyncLLM callback raised")
