"""Running the app: ``flashpage serve`` (uvicorn in the foreground, SIGTERM drains and exits 0)
and :class:`ServerThread` (uvicorn on a loopback port in a background thread, for tests/benches).

Shutdown on SIGTERM or Ctrl+C (a drain): the front stops accepting, but the listening socket stays
open, so new requests (on new or kept-alive connections) get 503 with Retry-After and ``/health``
turns 503; running requests finish for up to ``drain_timeout`` seconds, then the rest are aborted
(their responses end properly: finish_reason "abort", then ``[DONE]``); only then does uvicorn close
the socket and the connections, the engine thread stops, and the process exits 0. A second signal
during the drain aborts what runs and exits at once.

If the engine process dies (``--engine-process``, the default), its open requests fail at once (503, or an
error event in a stream) and a new one is started, at most ``--max-engine-restarts`` times (default
:data:`DEFAULT_MAX_ENGINE_RESTARTS`); ``/health`` is 503 meanwhile. Once no restart is left (or a thread
engine's loop died), the server stops as on SIGTERM and exits with :data:`ENGINE_DIED_EXIT_CODE`, for a
supervisor to restart it: it never stays up without an engine.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn

from flashpage.engine.config import EngineConfig
from flashpage.engine.loading import TINY_MODEL_NAME
from flashpage.serve.async_engine import AsyncLLM
from flashpage.serve.engine_process import EngineProcess, EngineSpec
from flashpage.serve.media import DEFAULT_IMAGE_LIMIT, DEFAULT_MAX_IMAGE_BYTES, MediaOptions

DEFAULT_MAX_ENGINE_RESTARTS = 3  # --max-engine-restarts: engine processes started to replace dead ones, at most
ENGINE_DIED_EXIT_CODE = 1  # the exit code once the engine died with no restart left


@dataclass
class ServeOptions:
    """``flashpage serve`` arguments; ``engine`` holds the LLM options (a mapping of LLM keyword arguments is
    taken too, and checked into an :class:`~flashpage.engine.config.EngineConfig`)."""

    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    max_waiting_requests: int = 512
    max_request_bytes: int | None = None  # None: the app's default (DEFAULT_MAX_REQUEST_BYTES)
    drain_timeout: float = 30.0
    chat_template: str | None = None
    log_level: str = "info"
    cpu_bind: str = "none"  # --cpu-bind (flashpage/cpu_threads.py), applied once the engine is built
    engine_process: bool = False  # the engine in its own process (the CLI's default), else a thread of this one
    max_engine_restarts: int = DEFAULT_MAX_ENGINE_RESTARTS  # engine process only: restarts after a death, at most
    engine: EngineConfig = field(default_factory=EngineConfig)
    limit_mm_per_prompt: int = DEFAULT_IMAGE_LIMIT  # images per chat request (serve/media.py)
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES  # one image's bytes, at most
    allowed_local_media_path: str | None = None  # file:// image URLs read under this directory only (None: refused)

    def __post_init__(self) -> None:
        self.engine = as_engine_config(self.engine)

    @property
    def media(self) -> MediaOptions:
        return MediaOptions(self.limit_mm_per_prompt, self.max_image_bytes, self.allowed_local_media_path)


def as_engine_config(engine: EngineConfig | Mapping[str, Any] | None) -> EngineConfig:
    """``engine`` as an EngineConfig (a mapping's None values meaning "not given")."""
    if isinstance(engine, EngineConfig):
        return engine
    return EngineConfig.from_options(engine or {})


FLUSH_SECONDS = 5.0  # after the drain: time for aborted requests' final events to reach their clients


class _DrainingServer(uvicorn.Server):
    """uvicorn.Server that drains on SIGTERM/SIGINT before uvicorn closes anything: the engine front
    stops accepting (new requests get 503 + Retry-After from the app while the socket stays open),
    running requests get up to ``drain_timeout`` seconds, what still runs then is aborted, and only
    once nothing is left (or a second signal) is uvicorn told to exit. An engine gone for good (its
    ``fatal_error``: no restart left) makes it exit too, within a tick (0.1 s), its clients already failed."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM | EngineProcess, drain_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_timeout = drain_timeout
        self.drainer: threading.Thread | None = None
        self.cut = threading.Event()
        self.stop = threading.Event()
        self.engine_failed: BaseException | None = None

    async def on_tick(self, counter: int) -> bool:
        fatal = self.engine.fatal_error
        if fatal is not None and self.engine_failed is None:
            self.engine_failed = fatal
            print(f"flashpage serve: stopping, exit code {ENGINE_DIED_EXIT_CODE}: {fatal}", file=sys.stderr,
                  flush=True)
            self.engine.stop_accepting()
            self.should_exit = True
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.engine.stop_accepting()
        if self.drainer is None:
            self.drainer = threading.Thread(target=self._drain, args=(sig, frame), name="flashpage-drain",
                                            daemon=True)
            self.drainer.start()
            return
        self.stop.set()  # a second signal: stop draining now
        self._abort_rest()
        super().handle_exit(sig, frame)

    def _drain(self, sig: int, frame: Any) -> None:
        if not self._wait_idle(self.drain_timeout):
            self._abort_rest()
            self._wait_idle(FLUSH_SECONDS)
        super().handle_exit(sig, frame)

    def _wait_idle(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while self.engine.num_unfinished and time.monotonic() < deadline and not self.stop.is_set():
            self.stop.wait(0.02)
        return self.engine.num_unfinished == 0

    def _abort_rest(self) -> None:
        if self.engine.num_unfinished:
            self.cut.set()
            self.engine.abort_all()


def read_chat_template(path: str | None) -> str | None:
    if path is None:
        return None
    p = Path(path).expanduser()
    if not p.is_file():
        raise OSError(f"--chat-template {path}: no such file; give a Jinja template file")
    return p.read_text()


def build_llm(model_name: str | None, engine: EngineConfig | Mapping[str, Any]) -> Any:
    """The :class:`~flashpage.LLM` ``flashpage serve`` runs: the model loaded in ``engine.dtype`` onto
    ``engine.device``, the rest of ``engine`` its options; a vision-language checkpoint's processor
    (``AutoProcessor``) too, for images in chat requests."""
    from flashpage.engine import LLM, loading

    engine = as_engine_config(engine)
    model, tokenizer = loading.load_model(model_name, dtype=engine.dtype, device=engine.device,
                                          label=f"--model {model_name}")
    processor = loading.load_processor(model_name, model)
    return LLM(model, tokenizer, processor=processor, **engine.llm_kwargs(drop=("dtype", "device")))


def build_engine(options: ServeOptions) -> AsyncLLM | EngineProcess:
    """The server's engine: in its own process (``options.engine_process``, bound there with
    ``--cpu-bind``), else an engine thread of this process."""
    if options.engine_process:
        spec = EngineSpec(options.model, options.engine, options.cpu_bind)
        return EngineProcess(spec, max_waiting_requests=options.max_waiting_requests,
                             max_restarts=options.max_engine_restarts)
    llm = build_llm(options.model, options.engine)
    return AsyncLLM(llm, max_waiting_requests=options.max_waiting_requests)


def _dtype(name: str | None) -> dict[str, Any]:
    if name is None:
        return {}
    import torch

    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"--dtype {name}: not a torch dtype; use float32, float16 or bfloat16")
    return {"dtype": value}


def bind_engine_threads(spec: str, engine: AsyncLLM) -> str:
    """Bind the engine thread (and the OpenMP threads it starts) to the cores ``spec`` names, as
    vLLM binds its engine process; the HTTP front (event loop, tokenizer threads) keeps the process's
    cores, as vLLM's API server process does, so serving a client never takes the engine's core.
    Returns what was done, for the log."""
    from flashpage.cpu_threads import bind_cpu_threads

    binding = bind_cpu_threads(spec)
    if not binding.bound:
        return binding.describe()
    engine_tid = engine.engine_thread_id
    for tid, cores in binding.previous_affinity.items():
        if tid != engine_tid:
            try:
                os.sched_setaffinity(tid, cores)
            except OSError:  # the thread has ended
                pass
    return f"{binding.describe()}: the engine thread; the HTTP front keeps the process's cores"


def run_server(options: ServeOptions, engine: AsyncLLM | None = None) -> int:
    """Serve until SIGTERM/SIGINT, then drain and return 0. ``engine``: one already built (tensor
    parallel rank 0, see :mod:`flashpage.serve.tp`); default: built from ``options``."""
    template = read_chat_template(options.chat_template)
    built = engine if engine is not None else build_engine(options)
    try:
        return _serve(options, built, template)  # closes the engine once uvicorn has stopped
    except BaseException:  # failed before that (e.g. building the app): the engine (thread or process) stops too
        built.close(drain_timeout=0.0)
        raise


def _serve(options: ServeOptions, engine: AsyncLLM | EngineProcess, template: str | None) -> int:
    from flashpage.serve.app import build_app

    if isinstance(engine, EngineProcess):  # bound in its own process, after the model loaded
        print(f"flashpage serve: engine process {engine.pid}; CPU {engine.binding}; "
              f"{_restart_policy(engine.max_restarts)}", file=sys.stderr, flush=True)
    elif options.cpu_bind != "none":  # after the model loaded: bad arguments fail first, loading threads are bound too
        print(f"flashpage serve: CPU {bind_engine_threads(options.cpu_bind, engine)}", file=sys.stderr)
    name = options.served_model_name or options.model or TINY_MODEL_NAME
    limits = {"max_request_bytes": options.max_request_bytes} if options.max_request_bytes is not None else {}
    app = build_app(engine, name, chat_template=template, close_on_shutdown=False, media=options.media, **limits)
    # uvicorn's own graceful shutdown starts after the drain: only final events are left to send
    config = uvicorn.Config(app, host=options.host, port=options.port, log_level=options.log_level,
                            timeout_graceful_shutdown=FLUSH_SECONDS, lifespan="on")
    server = _DrainingServer(config, engine, options.drain_timeout)
    # uvicorn re-raises the signal it handled once it is done; these handlers make that a no-op,
    # so a drained server exits 0 instead of dying by SIGTERM
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        server.stop.set()
        engine.close(drain_timeout=0.0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if server.engine_failed is not None:
        print(f"flashpage serve: stopped (the engine died, no restart left); exit code {ENGINE_DIED_EXIT_CODE}",
              file=sys.stderr)
        return ENGINE_DIED_EXIT_CODE
    how = "requests still running after --drain-timeout were aborted" if server.cut.is_set() \
        else "all requests finished"
    print(f"flashpage serve: stopped ({how})", file=sys.stderr)
    return 0 if server.started else 1


def _restart_policy(max_restarts: int) -> str:
    """What the server does when its engine process dies, for the startup line."""
    if max_restarts == 0:
        return "if it dies, the server exits (--max-engine-restarts 0)"
    times = "time" if max_restarts == 1 else "times"
    return f"if it dies, a new one is started (at most {max_restarts} {times}, --max-engine-restarts)"


class ServerThread:
    """Serve ``app`` on ``host`` (a free port unless given) in a daemon thread; a context manager.

    ``url`` is the base URL (``http://127.0.0.1:PORT``). Leaving the block shuts uvicorn down
    (and with it the app's engine, when the app closes it on shutdown) and joins the thread.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, startup_timeout: float = 30.0) -> None:
        self.app, self.host, self.port, self.startup_timeout = app, host, port, startup_timeout
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> ServerThread:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       name="flashpage-uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        if self.server is not None:
            self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout)

    def __exit__(self, *exc: object) -> None:
        self.stop()
