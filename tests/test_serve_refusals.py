"""Every request the server refuses is counted once in ``flashpage_requests_rejected_total{reason}``
(issue 21: before, only engine-level refusals were), and a served request is not counted."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest

from tests.serve_helpers import MODEL, tiny_server

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


