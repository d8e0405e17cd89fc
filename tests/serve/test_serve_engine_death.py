"""The engine process dies (SIGKILL, as from the OOM killer) under ``flashpage serve``: its open requests fail at
once (a 503 naming the death; in a stream an error event, then ``[DONE]``), ``/health`` is 503 while no engine
runs, a new engine process is started (``--max-engine-restarts``, counted in ``flashpage_engine_restarts_total``)
and answers as the first one did; with no restart left the server exits with code 1. Without HTTP: an engine
process that cannot be built again uses up the restarts and is given up (``fatal_error``), and closing during a
restart stops the new process too. A death with no restart (EngineProcess's default):
tests/engine/test_engine_process.py.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_helpers import MODEL, metrics, sse_events, wait_until

from flashpage import LLM, load_tiny_model
from flashpage.serve import EngineDiedError
from flashpage.serve.engine_process import EngineProcess, EngineSpec, describe_exit

DEADLINE = 30.0  # seconds from the death to every open request answered (and, with no restart left, to the exit)
GREEDY = {"model": MODEL, "prompt": "The list", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
LONG = {**GREEDY, "max_tokens": 1000}  # ~1000 decode steps: still running when the engine is killed
STARTED = re.compile(r"engine process (\d+)(?:;| started \(restart (\d+) of (\d+)\))")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class _Server:
    """A ``flashpage serve`` subprocess on a loopback port, its output collected line by line."""

    proc: subprocess.Popen[str]
    url: str
    lines: list[str] = field(default_factory=list)
    reader: threading.Thread = field(init=False)

    def __post_init__(self) -> None:
        self.reader = threading.Thread(target=self._collect, daemon=True)
        self.reader.start()

    def _collect(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def engine_pids(self) -> list[int]:
        """The engine processes' ids, in the order they were started (the startup line, then each restart's)."""
        return [int(m.group(1)) for m in STARTED.finditer(self.output)]

    def wait_engine(self, count: int) -> int:
        """The id of the ``count``-th engine process, once its line is out."""
        wait_until(lambda: len(self.engine_pids()) >= count, timeout=180, what=f"engine process #{count}")
        return self.engine_pids()[count - 1]


def _engine_alive(pid: int) -> bool:
    """``pid`` is still one of our engine processes (not a reused id)."""
    try:
        return "child_entry" in Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return False


@contextmanager
def _serve(*args: str) -> Iterator[_Server]:
    """``flashpage serve`` on the built-in model, up (``/health`` 200); stopped on exit, its engine processes too."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "flashpage.cli", "serve", "--port", str(port), "--cpu-bind",
                             "none", "--log-level", "warning", "--drain-timeout", "2", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    server = _Server(proc, f"http://127.0.0.1:{port}")
    try:
        def up() -> bool:
            assert proc.poll() is None, f"server exited early:\n{server.output}"
            try:
                return httpx.get(f"{server.url}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(up, timeout=180, what="server up")
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        server.reader.join(10)
        for pid in server.engine_pids():  # an engine process outlives a killed server only briefly: make sure
            if _engine_alive(pid):
                os.kill(pid, signal.SIGKILL)


@dataclass
class _InFlight:
    """A request running in a thread: its stream's events, or its response."""

    thread: threading.Thread
    events: list[Any] = field(default_factory=list)
    response: httpx.Response | None = None
    error: BaseException | None = None
    started: threading.Event = field(default_factory=threading.Event)


def _stream(url: str, body: dict[str, Any]) -> _InFlight:
    flight = _InFlight(threading.Thread())

    def run() -> None:
        try:
            with httpx.Client(timeout=DEADLINE + 30) as c, \
                    c.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
                for event in sse_events(r.iter_lines()):
                    flight.events.append(event)
                    flight.started.set()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            flight.error = exc

    flight.thread = threading.Thread(target=run, daemon=True)
    flight.thread.start()
    return flight


def _post(url: str, body: dict[str, Any]) -> _InFlight:
    flight = _InFlight(threading.Thread())

    def run() -> None:
        try:
            flight.response = httpx.post(f"{url}/v1/completions", json=body, timeout=DEADLINE + 30)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            flight.error = exc

    flight.thread = threading.Thread(target=run, daemon=True)
    flight.thread.start()
    return flight


def _greedy_text(url: str) -> str:
    resp = httpx.post(f"{url}/v1/completions", json=GREEDY, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def _kill_with_requests_open(server: _Server, pid: int) -> tuple[_InFlight, _InFlight, float]:
    """A stream (its first chunk received) and a non-streaming request, both running in the engine process
    ``pid`` when it gets SIGKILL; returns them and the time of the kill."""
    stream = _stream(server.url, LONG)
    assert stream.started.wait(60), stream.error
    post = _post(server.url, LONG)
    wait_until(lambda: metrics(server.url)["flashpage_num_requests_running"] == 2, timeout=60,
               what="both requests running")
    os.kill(pid, signal.SIGKILL)
    return stream, post, time.monotonic()


def _assert_failed_promptly(stream: _InFlight, post: _InFlight, killed: float, pid: int) -> None:
    """Both requests answered within DEADLINE: a 503 naming the death, in the stream an error event then [DONE]."""
    for flight in (stream, post):
        flight.thread.join(max(0.0, killed + DEADLINE - time.monotonic()))
        assert not flight.thread.is_alive(), f"a request still hangs {DEADLINE:.0f} s after the engine died"
        assert flight.error is None, flight.error
    death = f"the engine process died (pid {pid} exited unexpectedly: {describe_exit(-signal.SIGKILL)})"
    assert stream.events[-1] == "[DONE]" and any("choices" in e for e in stream.events[:-2])
    error = stream.events[-2]["error"]
    assert death in error["message"] and error["code"] == 503 and error["type"] == "service_unavailable", error
    assert post.response is not None and post.response.status_code == 503, post.response
    assert post.response.headers["retry-after"] == "1"
    error = post.response.json()["error"]
    assert death in error["message"] and error["type"] == "service_unavailable", error


def test_a_killed_engine_process_is_restarted_then_the_server_exits_when_no_restart_is_left() -> None:
    """--max-engine-restarts 1. First SIGKILL: the open requests fail at once, /health is 503 until a new engine
    process is ready, which gives the same greedy text as the first; one restart counted in /metrics. Second
    SIGKILL: the open requests fail at once again, and the server exits with code 1 within DEADLINE."""
    with _serve("--max-engine-restarts", "1") as server:
        first = server.wait_engine(1)
        assert "if it dies, a new one is started (at most 1 time, --max-engine-restarts)" in server.output
        before = _greedy_text(server.url)
        stream, post, killed = _kill_with_requests_open(server, first)
        _assert_failed_promptly(stream, post, killed, first)
        health = httpx.get(f"{server.url}/health", timeout=10)  # the new engine process is still importing torch
        assert health.status_code == 503 and "starting a new one (restart 1 of 1)" in health.json()["error"]["message"]
        wait_until(lambda: httpx.get(f"{server.url}/health", timeout=10).status_code == 200, timeout=180,
                   what="/health 200 again")
        second = server.wait_engine(2)
        assert second != first and not _engine_alive(first)
        assert f"engine process {second} started (restart 1 of 1); serving again" in server.output
        assert _greedy_text(server.url) == before
        counts = metrics(server.url)
        assert counts["flashpage_engine_restarts_total"] == 1
        assert counts["flashpage_request_failures_total"] == 2
        assert counts["flashpage_num_requests_running"] == 0

        stream, post, killed = _kill_with_requests_open(server, second)
        _assert_failed_promptly(stream, post, killed, second)
        code = server.proc.wait(max(1.0, killed + DEADLINE - time.monotonic()))
        server.reader.join(10)  # all of its output
        assert code == 1, server.output
        assert "no restart left (--max-engine-restarts 1, 1 used)" in server.output
        assert "flashpage serve: stopped (the engine died, no restart left); exit code 1" in server.output


BUILT_ENV = "FLASHPAGE_TEST_BUILT_FILE"  # tiny_llm_once's marker: the engine was built once


def tiny_llm_once(spec: EngineSpec) -> LLM:
    """The built-in model's LLM the first time; every later build (a restart) fails. Run in the engine process,
    by name (EngineSpec.build)."""
    built = Path(os.environ[BUILT_ENV])
    if built.exists():
        raise RuntimeError("injected startup failure")
    built.touch()
    return LLM(*load_tiny_model(), **spec.engine.llm_kwargs())


def _our_engine_processes() -> list[int]:
    """This process's engine processes still running."""
    ours = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and _engine_alive(int(stat.parent.name)):
            ours.append(int(stat.parent.name))
    return ours


def test_an_engine_process_that_cannot_be_built_again_uses_up_the_restarts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A crash loop ends: each failed restart counts, and with none left the engine is given up (fatal_error)."""
    monkeypatch.setenv(BUILT_ENV, str(tmp_path / "built"))
    engine = EngineProcess(EngineSpec(build=tiny_llm_once), max_restarts=2)
    try:
        os.kill(engine.pid, signal.SIGKILL)
        wait_until(lambda: engine.fatal_error is not None, timeout=180, what="the engine given up")
        assert engine.restarts == 2 and not engine.accepting
        assert "no restart left (--max-engine-restarts 2, 2 used)" in (engine.unavailable or "")
        with pytest.raises(EngineDiedError, match="no restart left"):
            engine.add_request("The list")
        failures = [r.getMessage() for r in caplog.records if "failed: RuntimeError" in r.getMessage()]
        assert failures == [f"engine process restart {i} of 2 failed: RuntimeError: injected startup failure"
                            for i in (1, 2)]
    finally:
        engine.close()
    assert _our_engine_processes() == []


def test_close_during_a_restart_stops_the_new_engine_process() -> None:
    engine = EngineProcess(EngineSpec(), max_restarts=1)
    try:
        os.kill(engine.pid, signal.SIGKILL)
        wait_until(lambda: engine.restarts == 1, timeout=DEADLINE, what="a restart")
    finally:
        started = time.monotonic()
        engine.close()
    assert time.monotonic() - started < 10
    assert _our_engine_processes() == []
