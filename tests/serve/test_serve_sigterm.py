"""SIGTERM drain: ``flashpage serve`` in a subprocess stops accepting but keeps listening (new requests,
on new or kept-alive connections, get 503 with Retry-After, not a refused connection or a read error),
finishes the running request, and exits 0; with a short drain timeout, a request that cannot finish in
time ends with finish_reason "abort" (its stream still closed properly) and the process still exits 0."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
from serve_helpers import MODEL, sse_events, wait_until


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _serve_process(*args: str) -> Iterator[tuple[subprocess.Popen, str]]:
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "flashpage.cli", "serve", "--port", str(port),
                             "--log-level", "warning", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            assert proc.poll() is None, f"server exited early:\n{proc.stdout.read()}"
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(up, timeout=90, what="server up")
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def _stream_in_thread(url: str, body: dict) -> tuple[threading.Thread, list, threading.Event]:
    events: list = []
    started = threading.Event()

    def run() -> None:
        try:
            with httpx.Client(timeout=60) as c, c.stream("POST", f"{url}/v1/completions", json=body) as r:
                for e in sse_events(r.iter_lines()):
                    events.append(e)
                    started.set()
        except httpx.TransportError as exc:  # the server cut the stream (drain timeout)
            events.append(exc)

    t = threading.Thread(target=run)
    t.start()
    return t, events, started


def _assert_503(resp: httpx.Response) -> None:
    assert resp.status_code == 503, resp.text
    assert resp.headers["retry-after"] == "1" and resp.json()["error"]["type"] == "service_unavailable"


def test_sigterm_drains_then_exits_0() -> None:
    """A short request finishes within the drain timeout; a long one is aborted when it expires.

    The long one is 48 samples of up to 1000 tokens (48 sequences x ~1000 decode steps: seconds even on a
    fast machine), the short one 10 tokens, the drain timeout 3 s. During the drain the listener stays
    open: a new connection and a kept-alive one both get 503 + Retry-After, /health too."""
    body = {"model": MODEL, "prompt": "The list", "temperature": 0, "ignore_eos": True, "stream": True}
    short, long, samples = 10, 1000, 48
    with _serve_process("--drain-timeout", "3") as (proc, url), httpx.Client(timeout=30) as kept:
        assert kept.get(f"{url}/health").status_code == 200  # a keep-alive connection, idle at SIGTERM
        t_long, ev_long, started_long = _stream_in_thread(url, {**body, "max_tokens": long, "n": samples})
        assert started_long.wait(30)
        t_short, ev_short, started_short = _stream_in_thread(url, {**body, "max_tokens": short})
        assert started_short.wait(30)
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: httpx.get(f"{url}/health", timeout=10).status_code == 503, timeout=10,
                   what="/health turning 503")
        _assert_503(httpx.get(f"{url}/health", timeout=10))
        new = {"model": MODEL, "prompt": "The list", "max_tokens": 2}
        _assert_503(httpx.post(f"{url}/v1/completions", json=new, timeout=10))
        _assert_503(kept.post(f"{url}/v1/completions", json=new))
        assert t_long.is_alive()  # all of that while the drain still runs
        t_short.join(60)
        t_long.join(60)
        assert proc.wait(60) == 0, proc.stdout.read()
        out = proc.stdout.read()
    for events in (ev_short, ev_long):
        assert events[-1] == "[DONE]", events[-3:]  # both streams were closed properly
    short_chunks = [e for e in ev_short if isinstance(e, dict)]
    assert len(short_chunks) == short and short_chunks[-1]["choices"][0]["finish_reason"] == "length"
    final = {}
    for e in ev_long:
        if isinstance(e, dict) and e["choices"][0]["finish_reason"]:
            final[e["choices"][0]["index"]] = e["choices"][0]["finish_reason"]
    assert final == dict.fromkeys(range(samples), "abort")
    assert "requests still running after --drain-timeout were aborted" in out
