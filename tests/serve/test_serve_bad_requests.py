"""Bad requests get a 4xx with an OpenAI-style error body naming the field, never a 500 or a dropped
connection, and the server keeps serving afterwards (checked after the whole table)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from serve_helpers import ENGINES, MODEL, tiny_server

from flashpage.serve import AsyncLLM, ServerThread

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
OK_CMPL: dict[str, Any] = {"model": MODEL, "prompt": "The list", "max_tokens": 4}
OK_CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}

# (id, path, body (dict merged over the valid one, None deletes a key; or raw bytes), status, param, message regex)
CASES: list[tuple[str, str, dict[str, Any] | bytes, int, str | None, str]] = [
    ("invalid-json", CMPL, b'{"prompt": ', 400, None, "not valid JSON"),
    ("empty-body", CMPL, b"", 400, None, "body is empty"),
    ("body-not-object", CMPL, b"[1, 2]", 400, None, "valid dictionary|object"),
    ("missing-prompt", CMPL, {"prompt": None}, 400, "prompt", "Field required"),
    ("prompt-a-number", CMPL, {"prompt": 12}, 400, "prompt", "prompt"),
    ("prompt-empty-text", CMPL, {"prompt": ""}, 400, "prompt", "prompt is empty"),
    ("prompt-empty-list", CMPL, {"prompt": []}, 400, "prompt", "prompt' is empty"),
    ("prompt-token-out-of-vocab", CMPL, {"prompt": [1, 99999]}, 400, "prompt", "outside the vocabulary"),
    ("prompt-too-long", CMPL, {"prompt": [5] * 1100}, 400, "prompt", "max_model_len"),
    ("unknown-model", CMPL, {"model": "gpt-9"}, 404, "model", "does not exist"),
    ("temperature-a-string", CMPL, {"temperature": "hot"}, 400, "temperature", "valid number"),
    ("temperature-negative", CMPL, {"temperature": -0.5}, 400, "temperature", "out of range"),
    ("top-p-zero", CMPL, {"top_p": 0}, 400, "top_p", "out of range"),
    ("top-p-above-one", CMPL, {"top_p": 1.5}, 400, "top_p", "out of range"),
    ("top-k-below-minus-one", CMPL, {"top_k": -2}, 400, "top_k", ">= -1"),
    ("max-tokens-zero", CMPL, {"max_tokens": 0}, 400, "max_tokens", "only allowed with echo"),
    ("max-tokens-negative", CMPL, {"max_tokens": -1}, 400, "max_tokens", ">= 1"),
    ("max-tokens-a-string", CMPL, {"max_tokens": "5"}, 400, "max_tokens", "valid integer"),
    ("max-tokens-a-bool", CMPL, {"max_tokens": True}, 400, "max_tokens", "valid integer"),
    ("max-tokens-a-float", CMPL, {"max_tokens": 5.5}, 400, "max_tokens", "valid integer"),
    ("n-zero", CMPL, {"n": 0}, 400, "n", "greater than or equal to 1"),
    ("seed-negative", CMPL, {"seed": -1}, 400, "seed", ">= 0"),
    ("logprobs-too-many", CMPL, {"logprobs": 50}, 400, "logprobs", r"\[0, 20\]"),
    ("stop-not-strings", CMPL, {"stop": [1]}, 400, "stop.0", "valid string"),
    ("stop-empty-string", CMPL, {"stop": [""]}, 400, "stop", "non-empty"),
    ("presence-penalty-too-big", CMPL, {"presence_penalty": 3}, 400, "presence_penalty", r"\[-2, 2\]"),
    ("min-tokens-above-max", CMPL, {"min_tokens": 9}, 400, "min_tokens", "<= max_tokens"),
    ("stream-a-string", CMPL, {"stream": "yes"}, 400, "stream", "valid boolean"),
    ("stream-options-without-stream", CMPL, {"stream_options": {"include_usage": True}}, 400, "stream_options",
     "only allowed with stream=true"),
    ("logit-bias", CMPL, {"logit_bias": {"5": 1.0}}, 400, "logit_bias", "not supported"),
    ("best-of-unlike-n", CMPL, {"best_of": 3}, 400, "best_of", "not supported"),
    ("suffix", CMPL, {"suffix": "end"}, 400, "suffix", "not supported"),
    ("stream-bad-temperature", CMPL, {"stream": True, "temperature": -1}, 400, "temperature", "out of range"),
    ("chat-missing-messages", CHAT, {"messages": None}, 400, "messages", "Field required"),
    ("chat-empty-messages", CHAT, {"messages": []}, 400, "messages", "at least 1"),
    ("chat-unknown-role", CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role", "robot"),
    ("chat-content-a-number", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content", ""),
    ("chat-message-not-object", CHAT, {"messages": ["hi"]}, 400, "messages.0", ""),
    ("chat-top-logprobs-alone", CHAT, {"top_logprobs": 2}, 400, "top_logprobs", "logprobs=true"),
    ("chat-top-logprobs-too-many", CHAT, {"logprobs": True, "top_logprobs": 25}, 400, "top_logprobs",
     r"top_logprobs=25 must be in \[0, 20\]"),
    ("chat-tool-choice-unknown", CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}],
                                        "tool_choice": {"type": "function", "function": {"name": "g"}}},
     400, "tool_choice", "not in 'tools'"),
    ("chat-json-schema-no-schema", CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     400, "response_format.json_schema.schema", "JSON schema object"),
    ("chat-both-max-tokens", CHAT, {"max_completion_tokens": 4}, 400, "max_completion_tokens", "not both"),
    ("chat-stream-bad-n", CHAT, {"stream": True, "n": -1}, 400, "n", "greater than or equal to 1"),
    ("chat-prompt-too-long", CHAT, {"messages": [{"role": "user", "content": "x " * 1100}]}, 400, "messages",
     "max_model_len"),
    ("chat-unknown-model", CHAT, {"model": "gpt-9"}, 404, "model", "does not exist"),
]


@pytest.fixture(scope="module", params=ENGINES)
def served(request: pytest.FixtureRequest) -> Iterator[tuple[ServerThread, Any]]:
    """The engine in a thread of the server's process, then in its own process (``flashpage serve``'s way)."""
    with tiny_server(engine_process=request.param == "process") as s:
        yield s


def _body(path: str, spec: dict[str, Any] | bytes) -> bytes:
    if isinstance(spec, bytes):
        return spec
    body = {**(OK_CMPL if path == CMPL else OK_CHAT), **spec}
    return json.dumps({k: v for k, v in body.items() if v is not None}).encode()


@pytest.mark.parametrize(("path", "spec", "status", "param", "message"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_request(served: tuple[ServerThread, AsyncLLM], path: str, spec: dict[str, Any] | bytes, status: int,
                     param: str | None, message: str) -> None:
    server, engine = served
    r = httpx.post(server.url + path, content=_body(path, spec), headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert error["param"] == param, error
    assert error["type"] == ("invalid_request_error" if status == 400 else "not_found_error")
    if message:
        assert re.search(message, error["message"]), error["message"]
    assert engine.snapshot().waiting == 0


def test_server_still_serves_after_the_table(served: tuple[ServerThread, AsyncLLM]) -> None:
    server, engine = served
    for path, body in ((CMPL, OK_CMPL), (CHAT, OK_CHAT)):
        r = httpx.post(server.url + path, json=body, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    st = engine.stats()
    assert (st.running, st.waiting, st.blocks_used) == (0, 0, 0)
    assert engine.failed_steps == 0
