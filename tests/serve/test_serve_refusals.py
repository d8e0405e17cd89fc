"""Every request the server refuses is counted once in ``flashpage_requests_rejected_total{reason}``
(issue 21: before, only engine-level refusals were), and a served request is not counted; a
non-streaming client that disconnects leaves no "exception was never retrieved" in the log."""

from __future__ import annotations

import gc
import json
import logging
import re
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from serve_helpers import MODEL, tiny_server

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with tiny_server() as (server, _):
        yield server.url


def _rejected(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^flashpage_requests_rejected_total\{reason="(\w+)"\} (\S+)$', text, re.M)}


REFUSED = [
    (CMPL, b"{not json", 400, "invalid"),
    (CMPL, b'{"prompt": "The list", "temperature": "hot"}', 400, "invalid"),
    (CMPL, b'{"prompt": "The list", "n": 0}', 400, "invalid"),
    (CMPL, b'{"prompt": "The list", "logit_bias": {"5": 1}}', 400, "invalid"),
    (CMPL, b'{"model": "no-such-model", "prompt": "The list"}', 404, "unknown_model"),
    (CHAT, b'{"messages": []}', 400, "invalid"),
    (CHAT, b'{"messages": [{"role": "wizard", "content": "hi"}]}', 400, "invalid"),
    (CMPL, b'{"prompt": [[]]}', 400, "invalid"),
]


@pytest.mark.parametrize(("path", "body", "status", "reason"), REFUSED,
                         ids=[f"{i}-{r[3]}" for i, r in enumerate(REFUSED)])
def test_each_refused_request_is_counted_once(url: str, path: str, body: bytes, status: int, reason: str) -> None:
    before = _rejected(url)
    resp = httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"}, timeout=60)
    assert resp.status_code == status, resp.text
    after = _rejected(url)
    grown = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(after) | set(before)}
    assert {k: v for k, v in grown.items() if v} == {reason: 1.0}, (resp.text, grown)


def test_a_served_request_is_not_counted(url: str) -> None:
    before = _rejected(url)
    resp = httpx.post(f"{url}{CMPL}", json={"model": MODEL, "prompt": "The list", "max_tokens": 2}, timeout=60)
    assert resp.status_code == 200
    assert _rejected(url) == before


def test_refusals_counted_where_raised_are_not_counted_twice(url: str) -> None:
    """A prompt longer than the context is counted by its route as "context_length", and only there."""
    before = _rejected(url)
    resp = httpx.post(f"{url}{CMPL}", json={"prompt": [5] * 1100, "max_tokens": 2}, timeout=60)
    assert resp.status_code == 400
    after = _rejected(url)
    assert sum(after.values()) - sum(before.values()) == 1.0
    assert after.get("context_length", 0.0) == before.get("context_length", 0.0) + 1




def test_a_non_streaming_client_that_leaves_logs_nothing(url: str) -> None:
    """The request is aborted when the client goes; the futures that lost the race are read, so asyncio
    never logs "_GatheringFuture exception was never retrieved" (it did once per disconnect)."""
    logged: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logged.append(record.getMessage())

    handler = Collect()
    logging.getLogger("asyncio").addHandler(handler)
    try:
        host, port = url.removeprefix("http://").split(":")
        body = json.dumps({"prompt": "The list", "max_tokens": 600, "temperature": 0, "ignore_eos": True}).encode()
        for _ in range(3):
            with socket.create_connection((host, int(port))) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
                time.sleep(0.5)  # the request is running when the client leaves
            time.sleep(0.6)  # the server polls for the disconnect every 0.2 s
        gc.collect()  # asyncio logs an unretrieved exception when the future is collected
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    finally:
        logging.getLogger("asyncio").removeHandler(handler)
    assert not [m for m in logged if "never retrieved" in m], logged
