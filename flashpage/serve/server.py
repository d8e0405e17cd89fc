"""Running the app: ``flashpage serve`` (uvicorn in the foreground, SIGTERM drains and exits 0)
and :class:`ServerThread` (uvicorn on a loopback port in a background thread, for tests/benches).

Shutdown on SIGTERM or Ctrl+C: the front stops accepting (``/health`` turns 503, new requests get
503), uvicorn closes the listening socket, running requests finish for up to ``drain_timeout``
seconds (then they are cancelled and aborted), the engine thread stops, and the process exits 0.
"""

from __future__ import annotations

import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn

from flashpage.serve.async_engine import AsyncLLM

TINY_MODEL_NAME = "flashpage-tiny"


@dataclass
class ServeOptions:
    """``flashpage serve`` arguments; ``engine`` holds the LLM keyword arguments."""

    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    max_waiting_requests: int = 512
    drain_timeout: float = 30.0
    chat_template: str | None = None
    log_level: str = "info"
    engine: dict[str, Any] = field(default_factory=dict)


class _DrainingServer(uvicorn.Server):
    """uvicorn.Server that, on SIGTERM/SIGINT, stops the engine front from accepting and, after
    ``drain_timeout`` seconds, aborts what still runs: those streams end properly (finish_reason
    "abort", then ``[DONE]``) before uvicorn's own, later, timeout would cut their connections."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, drain_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_timeout = drain_timeout
        self.timer: threading.Timer | None = None
        self.cut = threading.Event()

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.engine.stop_accepting()
        if self.timer is None:
            self.timer = threading.Timer(self.drain_timeout, self._cut)
            self.timer.daemon = True
            self.timer.start()
        super().handle_exit(sig, frame)

    def _cut(self) -> None:
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


def build_engine(options: ServeOptions) -> AsyncLLM:
    from flashpage.commands import load_model
    from flashpage.engine import LLM

    model, tokenizer = load_model(options.model, **_dtype(options.engine.pop("dtype", None)))
    device = options.engine.pop("device", None)
    if device is not None:
        model = model.to(device)
    llm = LLM(model, tokenizer, **options.engine)
    return AsyncLLM(llm, max_waiting_requests=options.max_waiting_requests)


def _dtype(name: str | None) -> dict[str, Any]:
    if name is None:
        return {}
    import torch

    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"--dtype {name}: not a torch dtype; use float32, float16 or bfloat16")
    return {"dtype": value}


def run_server(options: ServeOptions, engine: AsyncLLM | None = None) -> int:
    """Serve until SIGTERM/SIGINT, then drain and return 0. ``engine``: one already built (tensor
    parallel rank 0, see :mod:`flashpage.serve.tp`); default: built from ``options``."""
    from flashpage.serve.app import build_app

    template = read_chat_template(options.chat_template)
    engine = engine if engine is not None else build_engine(options)
    name = options.served_model_name or options.model or TINY_MODEL_NAME
    app = build_app(engine, name, chat_template=template, close_on_shutdown=False)
    config = uvicorn.Config(app, host=options.host, port=options.port, log_level=options.log_level,
                            timeout_graceful_shutdown=options.drain_timeout + 5.0, lifespan="on")
    server = _DrainingServer(config, engine, options.drain_timeout)
    # uvicorn re-raises the signal it handled once it is done; these handlers make that a no-op,
    # so a drained server exits 0 instead of dying by SIGTERM
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        engine.close(drain_timeout=0.0)
        if server.timer is not None:
            server.timer.cancel()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    how = "requests still running after --drain-timeout were aborted" if server.cut.is_set() \
        else "all requests finished"
    print(f"flashpage serve: stopped ({how})", file=sys.stderr)
    return 0 if server.started else 1


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
