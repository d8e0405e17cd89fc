"""Structured outputs and tool calls through ``flashpage serve`` with the real ``openai`` client.

64 concurrent requests (chat ``response_format`` json_schema / json_object, completions with vLLM's
``structured_outputs`` regex / choice, forced tool calls; half of them streamed): every output that
ends with ``finish_reason`` "stop" / "tool_calls" parses and validates against its schema. The
schemas are bounded, so those requests must end that way (not "length") within ``max_tokens``.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from serve_helpers import ENGINES, MODEL, tiny_server

from flashpage.serve import AsyncLLM, ServerThread, build_app
from flashpage.serve import structured as S

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {"item": {"enum": ["tea", "cake", "soup"]},
                                          "count": {"type": "integer", "minimum": 1, "maximum": 9},
                                          "notes": {"type": "array", "items": {"type": "string", "maxLength": 5},
                                                    "maxItems": 2}},
         "required": ["item", "count", "notes"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                            "unit": {"enum": ["C", "F"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"],
    "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
MAX_TOKENS = 64
USER = [{"role": "user", "content": "Tell me about the weather in the list of items"}]


@pytest.fixture(scope="module", params=ENGINES)
def served(request: pytest.FixtureRequest) -> Iterator[tuple[ServerThread, Any]]:
    """The engine in a thread of the server's process, then in its own process (``flashpage serve``'s way)."""
    with tiny_server(max_num_seqs=64, engine_process=request.param == "process") as s:
        yield s


@pytest.fixture(scope="module")
def url(served: tuple[ServerThread, AsyncLLM]) -> str:
    return served[0].url


@pytest.fixture
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _valid(text: str, schema: dict[str, Any]) -> None:
    jsonschema.validate(json.loads(text), schema)


def _check_calls(calls: list[Any], parallel: bool = True) -> None:
    assert calls and (parallel or len(calls) == 1)
    for call in calls:
        assert call.type == "function" and call.id
        _valid(call.function.arguments, SCHEMAS[call.function.name])


# -------------------------------------------------------------------------------- one at a time
def test_response_format_json_schema_and_json_object(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=MAX_TOKENS, n=3, seed=4,
                                       temperature=1.0, response_format=fmt)
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        _valid(choice.message.content, PERSON)
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=MAX_TOKENS, temperature=0,
                                       response_format={"type": "json_object"})
    (choice,) = r.choices
    if choice.finish_reason == "stop":  # free-form strings may also run to max_tokens ("length")
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.finish_reason == "length" and choice.message.content.startswith("{")


def test_completions_structured_outputs(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=["The date is", "Today is"], max_tokens=MAX_TOKENS,
                                  temperature=1.0, seed=1, extra_body={"structured_outputs": {"regex": DATE}})
    assert all(c.finish_reason == "stop" and re.fullmatch(DATE, c.text) for c in r.choices), r.choices
    r = client.completions.create(model=MODEL, prompt="Is it true?", max_tokens=8, n=4, temperature=1.0,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert all(c.text in ("yes", "no", "maybe") and c.finish_reason == "stop" for c in r.choices)
    r = client.completions.create(model=MODEL, prompt="Is it true?", max_tokens=8, temperature=0,
                                  extra_body={"guided_choice": ["yes", "no"]})  # vLLM's older name
    assert r.choices[0].text in ("yes", "no")
    r = client.completions.create(model=MODEL, prompt="An order:", max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "o", "schema": ORDER}}})
    assert r.choices[0].finish_reason == "stop"
    _valid(r.choices[0].text, ORDER)


def test_named_tool_choice_forces_the_function(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice=choice,
                                       max_tokens=MAX_TOKENS, temperature=0)
    (c,) = r.choices
    assert c.finish_reason == "stop" and c.message.content in ("", None)  # as vLLM: content "", reason as generated
    _check_calls(c.message.tool_calls)
    assert c.message.tool_calls[0].function.name == "get_weather"
    streamed = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice=choice,
                                              max_tokens=MAX_TOKENS, temperature=0, stream=True)
    name, args, reasons = None, "", []
    for chunk in streamed:
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                name = tc.function.name or name
                args += tc.function.arguments or ""
            if ch.finish_reason:
                reasons.append(ch.finish_reason)
    assert name == "get_weather" and reasons == ["stop"]
    assert args == c.message.tool_calls[0].function.arguments  # streamed deltas add up to the same call


def test_required_tool_choice_and_parallel_calls(client: openai.OpenAI) -> None:
    for parallel in (True, False):
        r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=parallel, max_tokens=2 * MAX_TOKENS,
                                           temperature=1.0, seed=3, n=2)
        for c in r.choices:
            assert c.finish_reason == "tool_calls", c
            _check_calls(c.message.tool_calls, parallel)
    stream = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=2 * MAX_TOKENS, temperature=0,
                                            stream=True)
    calls, reasons = [], []
    for chunk in stream:
        for ch in chunk.choices:
            calls += ch.delta.tool_calls or []
            reasons += [ch.finish_reason] if ch.finish_reason else []
    assert reasons == ["tool_calls"] and len(calls) == 1
    _valid(calls[0].function.arguments, SCHEMAS[calls[0].function.name])


def test_auto_and_none_return_text_and_a_conversation_with_tool_results(client: openai.OpenAI) -> None:
    for tool_choice in ("auto", "none"):
        r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice=tool_choice,
                                           max_tokens=12, temperature=0)
        assert r.choices[0].message.tool_calls in (None, []) and r.choices[0].message.content
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone":"UTC"}'}}
    history = USER + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    assert r.choices[0].message.content


def test_auto_parses_a_json_tool_call() -> None:
    plan = S.tool_plan(TOOLS, "auto", None)
    msg, reason = S.tool_message('{"name": "get_time", "parameters": {"zone": "CET"}}', "stop", plan)
    assert reason == "tool_calls" and msg["content"] is None
    assert msg["tool_calls"][0]["function"] == {"name": "get_time", "arguments": '{"zone": "CET"}'}
    msg, reason = S.tool_message('[{"name": "get_time", "arguments": {}}, {"name": "nope"}]', "stop", plan)
    assert reason == "stop" and msg["content"].startswith("[")  # names a function not in tools: plain text


def test_tools_are_rendered_by_the_chat_template(served: tuple[ServerThread, AsyncLLM]) -> None:
    template = ("{% if tools %}tools: {% for t in tools %}{{ t.function.name }} {% endfor %}\n{% endif %}"
                "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    engine = served[1]
    with ServerThread(build_app(engine, MODEL, chat_template=template, close_on_shutdown=False)) as server:
        c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        with_tools = c.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="none",
                                               max_tokens=1, temperature=0)
    tok = engine.llm.tokenizer
    expected = tok.apply_chat_template(USER, tools=TOOLS, chat_template=template, tokenize=False,
                                       add_generation_prompt=True)
    assert expected.startswith("tools: get_weather get_time")
    assert with_tools.usage.prompt_tokens == len(tok(expected, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strng"}}}}, "response_format"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "structured_outputs"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_structured_requests_name_the_field(url: str, body: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": USER, "max_tokens": 4, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


# ----------------------------------------------------------------------------- 64 concurrent
def _request(i: int) -> tuple[str, dict[str, Any], Any]:
    """(endpoint, arguments, checker) of the i-th concurrent request."""
    stream = i % 2 == 1
    common = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": i, "stream": stream}
    kind = i % 6
    if kind == 0:
        fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
        return "chat", {**common, "messages": USER, "response_format": fmt}, ("json", PERSON)
    if kind == 1:
        fmt = {"type": "json_schema", "json_schema": {"name": "o", "schema": ORDER}}
        return "chat", {**common, "messages": USER, "response_format": fmt}, ("json", ORDER)
    if kind == 2:
        return "chat", {**common, "messages": USER, "tools": TOOLS, "tool_choice": "required",
                        "max_tokens": 2 * MAX_TOKENS}, ("calls", None)
    if kind == 3:
        return "chat", {**common, "messages": USER, "tools": TOOLS,
                        "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, ("named", "get_time")
    if kind == 4:
        extra = {"structured_outputs": {"regex": DATE}}
        return "completion", {**common, "prompt": f"Date {i}:", "extra_body": extra}, ("regex", DATE)
    return "chat", {**common, "messages": USER, "response_format": {"type": "json_object"}}, ("object", None)


async def _run(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None, list[Any] | None]:
    """(text, finish reason, tool calls) of request i, streamed or not."""
    endpoint, args, _ = _request(i)
    create = client.chat.completions.create if endpoint == "chat" else client.completions.create
    resp = await create(**args)
    if not args["stream"]:
        c = resp.choices[0]
        if endpoint == "completion":
            return c.text, c.finish_reason, None
        return c.message.content or "", c.finish_reason, c.message.tool_calls
    text, reason, calls = "", None, {}
    async for chunk in resp:
        for c in chunk.choices:
            reason = c.finish_reason or reason
            if endpoint == "completion":
                text += c.text
                continue
            text += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"name": None, "args": ""})
                entry["name"] = tc.function.name or entry["name"]
                entry["args"] += tc.function.arguments or ""
    merged = [type("Call", (), {"type": "function", "id": "streamed",
                                "function": type("Fn", (), {"name": v["name"], "arguments": v["args"]})})
              for _, v in sorted(calls.items())]
    return text, reason, merged or None


def test_64_concurrent_constrained_requests(url: str, served: tuple[ServerThread, AsyncLLM]) -> None:
    async def main() -> list[tuple[str, str | None, list[Any] | None]]:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300,
                                      http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=64))) as c:
            return await asyncio.gather(*(_run(c, i) for i in range(64)))

    results = asyncio.run(main())
    for i, (text, reason, calls) in enumerate(results):
        kind, arg = _request(i)[2]
        if kind == "object":
            assert reason in ("stop", "length")
            if reason == "stop":
                assert isinstance(json.loads(text), dict)
            continue
        if kind == "calls":
            assert reason == "tool_calls", (i, text, reason)
            _check_calls(calls)
        elif kind == "named":
            assert reason == "stop" and calls[0].function.name == arg, (i, calls)
            _check_calls(calls)
        elif kind == "regex":
            assert reason == "stop" and re.fullmatch(arg, text), (i, text)
        else:
            assert reason == "stop", (i, text, reason)
            _valid(text, arg)
    st = served[1].stats()
    assert (st.running, st.waiting) == (0, 0)
