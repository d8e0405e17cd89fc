"""EngineProcess: :class:`AsyncLLM`'s interface with the engine in its own process (``flashpage serve``'s default).

In one process, the HTTP front (event loop, JSON, SSE, tokenization) and the engine thread take turns
on one interpreter lock: every token a client receives is Python work that the engine's step waits
for. vLLM splits its server into an API-server process and an engine-core process; this is the same
split. The child process builds the model and the :class:`~flashpage.LLM`, binds its threads
(``--cpu-bind``) and runs an :class:`AsyncLLM` loop; the parent keeps the HTTP front and talks to the
child over one duplex pipe (pickled tuples):

- parent -> child: ``("add", request_id, prompt, params, arrival)``, ``("abort", request_id | None)``,
  ``("call", call_id, name, args)`` (``stats``, ``prepare_structured_outputs``, ``run``), ``("close",)``;
- child -> parent: ``("ready", tokenizer, max_model_len, stats, binding, processor, images_refused)`` or
  ``("error", exc)`` once at start, then per engine iteration with output ``("batch", items, token_events, stats,
  failed_steps)``, ``("reply", call_id, ok, value)``, and ``("closed",)`` last.

Each iteration sends only what is new: a request's first item (accepted, or its validation error), then
per output the new token ids, the text added, new logprobs and the finish reason; the parent rebuilds the
cumulative :class:`RequestOutput` snapshots its streams hand out, so everything above this class (the app,
metrics, ``latest()`` coalescing) is unchanged. Prompts arrive tokenized (the front tokenizes), so the
child's tokenizer only detokenizes and checks stop strings.

If the child dies (the OOM killer, a crash in native code), every open stream and waiting call fails at once
with :class:`EngineDiedError` naming how it died, and new requests are refused (``/health`` turns 503); then a
new child is started (at most ``max_restarts`` times, ``flashpage serve --max-engine-restarts``) and serving
goes on. With no restart left, :attr:`EngineProcess.fatal_error` is set, for the server to exit non-zero:
nothing hangs, and the server never lingers without an engine.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from multiprocessing.connection import Connection
from typing import Any

from flashpage.engine import EngineStats, RequestOutput, SamplingParams
from flashpage.engine.config import EngineConfig
from flashpage.engine.outputs import CompletionOutput, RequestMetrics, TokenLogprob
from flashpage.serve.async_engine import (
    AsyncLLM,
    EngineClosedError,
    EngineDiedError,
    Prompt,
    RequestStream,
    TokenEvent,
    _Accepted,
    _call,
    _Failed,
    _Wakeups,
    admit,
    check_max_waiting,
)

log = logging.getLogger("flashpage.serve")

STARTUP_TIMEOUT = 900.0  # seconds for the child to load the model and build the engine
_METRIC_FIELDS = tuple(f.name for f in fields(RequestMetrics))


@dataclass
class EngineSpec:
    """What the child process builds: ``flashpage serve``'s model options and LLM keyword arguments.

    ``build`` (default :func:`flashpage.serve.server.build_llm`) must be importable by name, since the child
    is a fresh interpreter; it gets this spec and returns an :class:`~flashpage.LLM`.
    """

    model: str | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)  # a mapping of LLM keyword arguments is taken too
    cpu_bind: str = "none"
    build: Callable[[EngineSpec], Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.engine, EngineConfig):
            self.engine = EngineConfig.from_options(self.engine or {})


@dataclass(frozen=True)
class _Pickled:
    """A prompt dict (image tensors) pickled by plain pickle: the pipe's pickler would share tensor storage through
    file descriptors, which only multiprocessing's own children can receive."""

    data: bytes


def _portable_prompt(prompt: Any) -> Any:
    return _Pickled(pickle.dumps(prompt)) if isinstance(prompt, dict) else prompt


# ------------------------------------------------------------------------------------------ child side
class _Outbox:
    """The child's stand-in for a request's stream: items go to the next batch message."""

    def __init__(self, request_id: str, engine: _ChildEngine) -> None:
        self.request_id = request_id
        self._engine = engine

    def _put(self, item: Any) -> None:
        self._engine._outbox.append((self.request_id, self._engine._encode(self.request_id, item)))

    def _on_close(self, request_id: str) -> None:  # never called: no event loop reads an outbox
        return None


@dataclass
class _Sent:
    """How much of one request the parent has: per sample (tokens, text, logprobs)."""

    samples: dict[int, tuple[int, str, int]] = field(default_factory=dict)
    prompt_logprobs: int = 0
    header: bool = False


class _ChildEngine(AsyncLLM):
    """The child's AsyncLLM: each iteration's items and token events leave in one pipe message."""

    def __init__(self, llm: Any, conn: Connection) -> None:
        self._conn = conn
        self._send_lock = threading.Lock()
        self._outbox: list[tuple[str, tuple[Any, ...]]] = []
        self._events: list[TokenEvent] = []
        self._sent: dict[str, _Sent] = {}
        super().__init__(llm, max_waiting_requests=None, on_tokens=self._note_tokens)

    def _note_tokens(self, event: TokenEvent) -> None:
        self._events.append(event)

    def _new_stream(self, request_id: str) -> RequestStream:
        return _Outbox(request_id, self)  # type: ignore[return-value]

    def send(self, message: tuple[Any, ...]) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _flush(self) -> None:
        if not self._outbox and not self._events:
            return
        items, self._outbox = self._outbox, []
        events, self._events = self._events, []
        try:
            self.send(("batch", items, events, self._snapshot, self.failed_steps))
        except (OSError, ValueError):  # the parent is gone: the command loop sees EOF and closes
            pass

    def _encode(self, rid: str, item: Any) -> tuple[Any, ...]:
        if isinstance(item, _Accepted):
            return ("accepted",)
        if isinstance(item, _Failed):
            self._sent.pop(rid, None)
            return ("failed", _portable(item.error))
        if item.finished:
            return _delta(item, self._sent.pop(rid, None) or _Sent())
        return _delta(item, self._sent.setdefault(rid, _Sent()))


def _delta(out: RequestOutput, sent: _Sent) -> tuple[Any, ...]:
    """What ``out`` adds to what the parent has of this request (``sent``, updated). Token ids and
    logprobs only grow; the text is sent from the first character that changed (normally only appended)."""
    samples = []
    for comp in out.outputs:
        tokens, text, lps = sent.samples.get(comp.index, (0, "", 0))
        keep = len(text) if comp.text.startswith(text) else 0
        new_lps = comp.logprobs[lps:] if comp.logprobs is not None else None
        samples.append((comp.index, comp.token_ids[tokens:], keep, comp.text[keep:], comp.finish_reason, new_lps))
        sent.samples[comp.index] = (len(comp.token_ids), comp.text,
                                    len(comp.logprobs) if comp.logprobs is not None else 0)
    prompt_lps = None
    if out.prompt_logprobs is not None:
        prompt_lps = out.prompt_logprobs[sent.prompt_logprobs:]
        sent.prompt_logprobs = len(out.prompt_logprobs)
    header = None
    if not sent.header:
        header, sent.header = (out.prompt, out.prompt_token_ids), True
    metrics = tuple(getattr(out.metrics, name) for name in _METRIC_FIELDS)
    return ("output", out.finished, samples, metrics, prompt_lps, header)


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _child_main(conn: Connection, spec: EngineSpec) -> None:
    """The engine process: build, report ready (or the error), then apply the parent's commands."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # the parent decides when the engine stops (it drains first)
        signal.signal(sig, signal.SIG_IGN)
    try:
        llm = _build(spec)
        binding = _bind(spec.cpu_bind)
        engine = _ChildEngine(llm, conn)
        tokenizer = pickle.dumps(llm.tokenizer)
        processor = pickle.dumps(getattr(llm, "processor", None))
        from flashpage.serve.media import images_refused

        refused = images_refused(llm)
    except BaseException as exc:
        conn.send(("error", _portable(exc)))
        conn.close()
        return
    engine.send(("ready", tokenizer, llm.max_model_len, engine.snapshot(), binding, processor, refused))
    _command_loop(conn, engine)


def _build(spec: EngineSpec) -> Any:
    if spec.build is not None:
        return spec.build(spec)
    from flashpage.serve.server import build_llm

    return build_llm(spec.model, spec.engine)


def _bind(spec: str) -> str:
    if spec == "none":
        return "not bound (--cpu-bind none)"
    from flashpage.cpu_threads import bind_cpu_threads

    return f"{bind_cpu_threads(spec).describe()}: the engine process"


def _command_loop(conn: Connection, engine: _ChildEngine) -> None:
    calls = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="flashpage-engine-call")
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the parent is gone: stop
                break
            kind = msg[0]
            if kind == "add":
                _, rid, prompt, params, arrival = msg
                if isinstance(prompt, _Pickled):
                    prompt = pickle.loads(prompt.data)
                engine.add_requests([prompt], params, [rid], arrival=arrival)
            elif kind == "abort":
                engine.abort_all() if msg[1] is None else engine.abort(msg[1])
            elif kind == "call":
                calls.submit(_answer, engine, *msg[1:])
            elif kind == "close":
                break
    finally:
        engine.close(drain_timeout=0.0)
        calls.shutdown(wait=True)
        try:
            engine.send(("closed",))
        except (OSError, ValueError):
            pass
        conn.close()


def _answer(engine: _ChildEngine, call_id: int, name: str, args: tuple[Any, ...]) -> None:
    try:
        if name == "stats":
            value, ok = engine.stats(), True
        elif name == "prepare_structured_outputs":
            value, ok = engine.llm.prepare_structured_outputs(*args), True
        elif name == "run":
            with engine._engine_lock:  # between steps, never in the middle of one
                value, ok = args[0](engine.llm, *args[1:]), True
        else:
            value, ok = ValueError(f"the engine process has no call {name!r}"), False
    except Exception as exc:
        value, ok = _portable(exc), False
    try:
        engine.send(("reply", call_id, ok, value))
    except (OSError, ValueError):
        pass


# ----------------------------------------------------------------------------------------- parent side
def _start_child(spec: EngineSpec) -> tuple[Connection, subprocess.Popen[bytes]]:
    """A fresh interpreter running :func:`child_entry` on one end of a socket pair; returns the other end.

    A plain ``python -c`` child, not multiprocessing's ``spawn``: that re-imports the caller's main module
    in the child, which a script without an ``if __name__ == "__main__":`` guard cannot survive. The child
    gets this process's ``sys.path`` (so ``spec.build`` imports there as here) and the pickled spec first.
    """
    ours, theirs = socket.socketpair()
    with theirs:
        fd = theirs.fileno()
        code = f"from flashpage.serve.engine_process import child_entry; child_entry({fd})"
        proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[fd])
    conn = Connection(ours.detach())
    conn.send((list(sys.path), pickle.dumps(spec)))
    return conn, proc


def child_entry(fd: int) -> None:
    """The engine process's entry point (see :func:`_start_child`)."""
    conn = Connection(fd)
    try:
        path, spec = conn.recv()
        sys.path[:] = path
        spec = pickle.loads(spec)
    except BaseException as exc:
        conn.send(("error", _portable(exc)))
        return
    _child_main(conn, spec)


def _kill_at_exit(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(5.0)


@dataclass
class RemoteLLM:
    """What the HTTP front reads of the engine's :class:`~flashpage.LLM` (the app's ``engine.llm``)."""

    tokenizer: Any
    max_model_len: int
    _call: Callable[..., Any]
    processor: Any = None  # a vision-language model's processor (the front renders and processes images)
    images_refused: str | None = "no processor"  # why the engine takes no images (None: it does; serve/media.py)

    def prepare_structured_outputs(self, spec: Any) -> None:
        """Compile a constraint in the engine process (ValueError naming the field if it is invalid)."""
        self._call("prepare_structured_outputs", spec)


@dataclass
class _Open:
    """Parent-side state of one request: its stream and the cumulative output rebuilt from deltas."""

    stream: RequestStream
    accepted: bool = False
    prompt: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    samples: dict[int, CompletionOutput] = field(default_factory=dict)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def apply(self, rid: str, finished: bool, samples: list[tuple[Any, ...]], metrics: tuple[Any, ...],
              prompt_lps: list[TokenLogprob | None] | None, header: tuple[Any, ...] | None) -> RequestOutput:
        """The next cumulative output: this one's lists are new objects, so earlier snapshots never change."""
        if header is not None:
            self.prompt, self.prompt_token_ids = header[0], list(header[1])
        for index, new_ids, keep, text, reason, new_lps in samples:
            prev = self.samples.get(index)
            if prev is None:
                prev = CompletionOutput(index, [], "", None, None)
            lps = None if new_lps is None else [*(prev.logprobs or []), *new_lps]
            self.samples[index] = CompletionOutput(index, prev.token_ids + new_ids, prev.text[:keep] + text, reason,
                                                   lps)
        if prompt_lps is not None:
            self.prompt_logprobs = [*(self.prompt_logprobs or []), *prompt_lps]
        outputs = [self.samples[i] for i in sorted(self.samples)]
        return RequestOutput(rid, self.prompt, self.prompt_token_ids, outputs, finished,
                             RequestMetrics(*metrics), self.prompt_logprobs)


@dataclass(frozen=True)
class _Ready:
    """What a started engine process reports once its engine is built."""

    tokenizer: bytes  # pickled
    max_model_len: int
    snapshot: EngineStats
    binding: str
    processor: bytes = b""  # pickled (None when the model has none)
    images_refused: str | None = None


def describe_exit(code: int | None) -> str:
    """How a process ended, for a log line: "killed by signal 9 (SIGKILL)", "exit code 1"."""
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        return f"killed by signal {-code} ({name})"
    return f"exit code {code}"


def check_max_restarts(value: int) -> None:
    """ValueError unless ``max_restarts`` is an int >= 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"--max-engine-restarts must be a number of restarts >= 0; got {value!r}")


def _join(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    """``proc``'s exit code, killing it if it has not exited within ``timeout`` seconds."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        return proc.returncode


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        log.warning("the engine process %d did not stop; killing it", proc.pid)
        _kill_at_exit(proc)


def _await_ready(conn: Connection, proc: subprocess.Popen[bytes], timeout: float,
                 cancelled: Callable[[], bool] = lambda: False) -> _Ready:
    """The child's ready report, or its startup error raised here (the child is then stopped). ``cancelled``
    is checked every 0.1 s: once true, the child is killed and EngineClosedError raised."""
    deadline = time.monotonic() + timeout
    try:
        while not conn.poll(0.1):
            if cancelled():
                raise EngineClosedError("the server shut down while the engine process was starting")
            if time.monotonic() >= deadline:
                raise RuntimeError(f"the engine process did not start within {timeout:.0f} s")
        msg = conn.recv()
    except (EOFError, OSError):
        msg = ("error", RuntimeError(f"the engine process exited while starting ({describe_exit(_join(proc, 5.0))}); "
                                     "see its output above"))
    except BaseException:
        _kill_at_exit(proc)
        raise
    if msg[0] == "error":
        _join(proc, 10.0)
        raise msg[1]
    return _Ready(*msg[1:])


class EngineProcess:
    """Run the engine in a child process behind :class:`AsyncLLM`'s calls (see the module docstring).

    Args:
        spec: what the child builds (model, LLM keyword arguments, ``--cpu-bind``).
        max_waiting_requests: requests accepted but not yet running, at most (None: unbounded).
        on_tokens / on_finish: as :class:`AsyncLLM`'s, called on this process's reader thread.
        startup_timeout: seconds the child may take to report ready (at start and at each restart).
        max_restarts: engine processes started, at most, to replace one that died (``--max-engine-restarts``).
            When the engine process dies, its open requests fail at once (:class:`EngineDiedError`) and new ones
            are refused (``/health`` 503) until a new one is ready; with no restart left, :attr:`fatal_error`
            is set and nothing is served any more.

    Raises the child's own error (ValueError, OSError, ...) when the engine cannot be built.
    """

    def __init__(self, spec: EngineSpec, *, max_waiting_requests: int | None = 512,
                 on_tokens: Callable[[TokenEvent], None] | None = None,
                 on_finish: Callable[[RequestOutput], None] | None = None,
                 startup_timeout: float = STARTUP_TIMEOUT, max_restarts: int = 0) -> None:
        check_max_waiting(max_waiting_requests)
        check_max_restarts(max_restarts)
        self.spec, self.startup_timeout = spec, startup_timeout
        self.max_waiting_requests = max_waiting_requests
        self.on_tokens, self.on_finish = on_tokens, on_finish
        self.max_restarts = max_restarts
        self.restarts = 0  # engine processes started to replace one that died (failed starts included)
        self._lock = threading.Lock()
        self._open: dict[str, _Open] = {}
        self._unacked = 0
        self._ids = itertools.count()
        self._call_ids = itertools.count()
        self._replies: dict[int, concurrent.futures.Future[Any]] = {}
        self._accepting = True
        self._closing = False
        self._wakeups = _Wakeups()
        self._send_lock = threading.Lock()
        self.dead: BaseException | None = None  # why no engine process serves now (None: one does)
        self.fatal_error: BaseException | None = None  # set once none ever will again
        self.failed_steps = 0  # engine steps that raised (as of the latest batch of the current engine process)
        self._conn, self._proc = self._spawn()
        ready = _await_ready(self._conn, self._proc, startup_timeout)
        self._snapshot, self.binding = ready.snapshot, ready.binding
        self.llm = RemoteLLM(pickle.loads(ready.tokenizer), ready.max_model_len, self._call,
                             pickle.loads(ready.processor) if ready.processor else None, ready.images_refused)
        self._reader = threading.Thread(target=self._supervise, name="flashpage-engine-reader", daemon=True)
        self._reader.start()

    def _spawn(self) -> tuple[Connection, subprocess.Popen[bytes]]:
        conn, proc = _start_child(self.spec)
        weakref.finalize(self, _kill_at_exit, proc)  # an owner that never calls close()
        return conn, proc

    # --------------------------------------------------------------------- AsyncLLM's calls
    @property
    def pid(self) -> int | None:
        """The engine process's id (the current one's, after a restart)."""
        return self._proc.pid

    @property
    def engine_thread_id(self) -> None:
        """None: the engine runs in another process, bound there (:attr:`binding` says how)."""
        return None

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> RequestStream:
        """Queue a request; returns its stream at once (validation errors surface from the stream)."""
        return self.add_requests([prompt], params, [request_id])[0]

    def add_requests(self, prompts: Sequence[Prompt], params: SamplingParams | None = None,
                     request_ids: Sequence[str | None] | None = None) -> list[RequestStream]:
        """:meth:`AsyncLLM.add_requests`: all or nothing, QueueFullError / ValueError / EngineClosedError
        (EngineDiedError while no engine process runs)."""
        with self._lock:
            if self.dead is not None:
                raise EngineDiedError(str(self.dead))
            if not self._accepting:
                raise EngineClosedError("the server is shutting down and accepts no new request")
            waiting = self._unacked + self._snapshot.waiting
            rids = admit(prompts, request_ids, self.max_waiting_requests, waiting, self._open, self._ids)
            now = time.perf_counter()  # CLOCK_MONOTONIC: the child's clock too
            streams = []
            for rid, prompt in zip(rids, prompts, strict=True):
                stream = RequestStream(rid, self.abort)
                self._open[rid] = _Open(stream)
                self._unacked += 1
                streams.append(stream)
                self._send(("add", rid, _portable_prompt(prompt), params, now))
        return streams

    def abort(self, request_id: str) -> None:
        """End a request; its stream gets one final "abort" output. Unknown or ended ids are ignored."""
        self._send(("abort", request_id))

    def abort_all(self) -> None:
        self._send(("abort", None))

    def stats(self) -> EngineStats:
        """Current engine statistics, asked of the engine process."""
        return self._call("stats")

    def run_in_engine(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(llm, *args)`` in the engine process, between two steps; returns its value or raises its error.
        ``fn``, ``args`` and the value cross the pipe pickled: ``fn`` must be a module-level function.
        For inspection (``lambda``s do not pickle), e.g. checking the cache's invariants in a test."""
        return self._call("run", fn, *args)

    def snapshot(self) -> EngineStats:
        """Statistics as of the engine's latest iteration that produced output (never waits)."""
        return self._snapshot

    @property
    def num_unfinished(self) -> int:
        with self._lock:
            return len(self._open)

    @property
    def accepting(self) -> bool:
        return self._accepting and self.dead is None

    @property
    def unavailable(self) -> str | None:
        """Why no request is taken now (``/health``'s 503 message): the engine process died (and whether a new
        one is starting), or the server is shutting down; None while requests are taken."""
        dead = self.dead
        if dead is not None:
            return str(dead)
        return None if self._accepting else "the server is shutting down"

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False

    def close(self, drain_timeout: float = 0.0) -> bool:
        """Stop accepting, let unfinished requests run up to ``drain_timeout`` seconds, abort the rest, stop
        the engine process (or one being restarted). Returns True when every request finished on its own."""
        self.stop_accepting()
        deadline = time.monotonic() + drain_timeout
        while self.num_unfinished and time.monotonic() < deadline and self.dead is None:
            time.sleep(0.01)
        drained = self.num_unfinished == 0
        with self._lock:
            self._closing = True
        self._send(("close",))
        self._reader.join(timeout=max(10.0, drain_timeout))
        _join(self._proc, 10.0)
        self._conn.close()
        self._fail_open(EngineClosedError("the server shut down before this request finished"))
        return drained

    # --------------------------------------------------------------------------- plumbing
    def _send(self, message: tuple[Any, ...]) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError) as exc:  # the child is gone; the reader fails what is open
            if message[0] == "add":
                raise EngineDiedError("the engine process died; no request is taken until a new one runs") from exc

    def _call(self, name: str, *args: Any) -> Any:
        """Run ``name`` in the engine process and return its value (or raise its error)."""
        call_id = next(self._call_ids)
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self.dead is not None:
                raise EngineDiedError(str(self.dead))
            self._replies[call_id] = future
        self._send(("call", call_id, name, args))
        return future.result()

    def _supervise(self) -> None:
        """The reader thread: deliver the engine process's messages; when it dies, fail what was open and start
        a new one (up to ``max_restarts``), else stop serving for good."""
        try:
            while (death := self._read(self._conn, self._proc)) is not None:
                if not self._restart(death):
                    return
            closed = EngineClosedError("the server shut down before this request finished")
            self._stop_serving(closed, closed)
        except BaseException as exc:  # a bug here: fail everything rather than hang the clients
            log.exception("engine reader died")
            _kill(self._proc)
            error = EngineDiedError(f"the server's engine reader failed: {type(exc).__name__}: {exc}")
            self._stop_serving(error, error, fatal=True)

    def _read(self, conn: Connection, proc: subprocess.Popen[bytes]) -> str | None:
        """Deliver messages until the engine process closes (None) or dies (what happened, once its requests
        failed). The process is checked every second too, in case another process holds its end of the pipe."""
        try:
            while True:
                if not conn.poll(1.0):
                    if proc.poll() is None:
                        continue
                    raise EOFError("the engine process exited")
                msg = conn.recv()
                if msg[0] == "batch":
                    self._deliver(*msg[1:])
                elif msg[0] == "reply":
                    self._reply(*msg[1:])
                elif msg[0] == "closed":
                    return None
        except (EOFError, OSError):
            if self._closing:
                return None
            return self._died(proc)

    def _died(self, proc: subprocess.Popen[bytes]) -> str:
        """The engine process died: refuse new requests, fail the open ones and any call waiting for it.
        Returns the death's description."""
        death = f"the engine process died (pid {proc.pid} exited unexpectedly: {describe_exit(_join(proc, 5.0))})"
        with self._lock:
            restarting = self._accepting and self.restarts < self.max_restarts
            fatal = self._accepting and not restarting
            plan = self._plan(restarting)
            failed = len(self._open)
            self._snapshot = replace(self._snapshot, running=0, waiting=0)
        log.error("%s; %d open request(s) failed; %s", death, failed, plan)
        advice = ": retry shortly" if restarting else ""
        self._stop_serving(EngineDiedError(f"{death}; {plan}{advice}"),
                           EngineDiedError(f"{death} before this request finished; {plan}{advice}"), fatal)
        return death

    def _plan(self, restarting: bool) -> str:
        """What happens after a death (for the log and the clients); called with ``_lock`` held."""
        if restarting:
            return f"starting a new one (restart {self.restarts + 1} of {self.max_restarts})"
        if not self._accepting:
            return "the server is shutting down"
        return f"no restart left (--max-engine-restarts {self.max_restarts}, {self.restarts} used): the server stops"

    def _stop_serving(self, dead: BaseException, failure: BaseException, fatal: bool = False) -> None:
        """Take no request (``dead`` says why), fail the open ones and waiting calls with ``failure``."""
        with self._lock:
            self.dead = dead
            if fatal:
                self.fatal_error = dead
            replies, self._replies = self._replies, {}
        self._fail_open(failure)
        for future in replies.values():
            future.set_exception(failure)

    def _restart(self, death: str) -> bool:
        """Start engine processes until one is ready (True) or no restart is left, or the server stops (False)."""
        while True:
            with self._lock:
                if self._closing or not self._accepting or self.fatal_error is not None:
                    return False
                if self.restarts >= self.max_restarts:
                    self.fatal_error = self.dead = EngineDiedError(f"{death}; {self._plan(False)}")
                    log.error("the engine process could not be restarted; %s", self._plan(False))
                    return False
                self.dead = EngineDiedError(f"{death}; {self._plan(True)}: retry shortly")
                self.restarts += 1
                attempt = f"restart {self.restarts} of {self.max_restarts}"
            try:
                conn, proc = self._spawn()
            except OSError as exc:
                log.error("engine process %s failed: %s", attempt, exc)
                continue
            try:
                ready = _await_ready(conn, proc, self.startup_timeout, cancelled=lambda: self._closing)
            except BaseException as exc:
                conn.close()
                if not self._closing:
                    log.error("engine process %s failed: %s: %s", attempt, type(exc).__name__, exc)
                continue
            if self._adopt(conn, proc, ready):
                log.warning("engine process %d started (%s); serving again", proc.pid, attempt)
                return True

    def _adopt(self, conn: Connection, proc: subprocess.Popen[bytes], ready: _Ready) -> bool:
        """Serve with this (ready) engine process, unless the server stopped meanwhile (then it is stopped)."""
        with self._lock, self._send_lock:
            adopted = not self._closing and self._accepting
            if adopted:
                self._conn, self._proc = conn, proc
                self._snapshot, self.binding, self.failed_steps = ready.snapshot, ready.binding, 0
                self.dead = None
        if not adopted:
            conn.close()  # the child sees EOF and exits
            _join(proc, 10.0)
        return adopted

    def _deliver(self, items: list[tuple[str, tuple[Any, ...]]], events: list[TokenEvent],
                 snapshot: EngineStats, failed_steps: int) -> None:
        finals = []
        with self._lock:
            self._snapshot, self.failed_steps = snapshot, failed_steps
            for rid, item in items:
                req = self._open.get(rid)
                if req is None:
                    continue
                value = self._item(rid, req, item)
                if isinstance(value, _Failed) or (isinstance(value, RequestOutput) and value.finished):
                    self._open.pop(rid, None)
                    if isinstance(value, RequestOutput):
                        finals.append(value)
                self._wakeups.put(req.stream, value)
        for event in events:
            if self.on_tokens is not None:
                _call(self.on_tokens, event)
        for out in finals:
            if self.on_finish is not None:
                _call(self.on_finish, out)
        self._wakeups.flush()

    def _item(self, rid: str, req: _Open, item: tuple[Any, ...]) -> Any:
        kind = item[0]
        if kind == "output":
            return req.apply(rid, *item[1:])
        if not req.accepted:
            req.accepted = True
            self._unacked -= 1
        if kind == "failed":
            return _Failed(item[1])
        return _Accepted()

    def _reply(self, call_id: int, ok: bool, value: Any) -> None:
        with self._lock:
            future = self._replies.pop(call_id, None)
        if future is None:
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def _fail_open(self, error: BaseException) -> None:
        with self._lock:
            pending, self._open = self._open, {}
            self._unacked = 0
        wakeups = _Wakeups()  # its own: close() may run this while the reader thread still delivers
        for req in pending.values():
            wakeups.put(req.stream, _Failed(error))
        wakeups.flush()
