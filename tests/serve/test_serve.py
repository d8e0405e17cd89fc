"""The OpenAI-compatible server on a loopback port: the real ``openai`` client, 64 concurrent streams
equal to offline ``LLM.generate``, disconnects that give every block back, a failing step that
fails only its requests, the bounded queue (503 + Retry-After) and /health, /v1/models, /metrics.
Every test runs twice: the engine in a thread of the server's process (AsyncLLM) and in its own
process (EngineProcess, ``flashpage serve``'s default).
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from serve_helpers import (
    ENGINES,
    FAULT_FILE_ENV,
    MODEL,
    check_cache,
    in_engine,
    metrics,
    sse_events,
    tiny_server,
    wait_until,
)

from flashpage import LLM, SamplingParams, load_tiny_model
from flashpage.serve import AsyncLLM, ServerThread
from flashpage.serve.engine_process import EngineProcess

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")

PROMPTS = ["The list", "A module is", "Return the number of", "If the file", "The dictionary", "This function",
           "The default value is", "Raise an exception"]


@pytest.fixture(scope="module")
def fault_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The engine process's fault switch (serve_helpers.tiny_llm_with_fault_switch): set before it starts."""
    path = tmp_path_factory.mktemp("fault") / "armed"
    previous = os.environ.get(FAULT_FILE_ENV)
    os.environ[FAULT_FILE_ENV] = str(path)
    yield path
    if previous is None:
        os.environ.pop(FAULT_FILE_ENV, None)
    else:
        os.environ[FAULT_FILE_ENV] = previous


@pytest.fixture(scope="module", params=ENGINES)
def served(request: pytest.FixtureRequest, fault_file: Path) -> Iterator[tuple[ServerThread, Any]]:
    with tiny_server(engine_process=request.param == "process") as s:
        yield s


@pytest.fixture(scope="module")
def url(served: tuple[ServerThread, AsyncLLM]) -> str:
    return served[0].url


@pytest.fixture(scope="module")
def engine(served: tuple[ServerThread, AsyncLLM]) -> AsyncLLM:
    return served[1]


@pytest.fixture(scope="module")
def offline() -> LLM:
    """The same model, in its own LLM, for reference outputs."""
    return LLM(*load_tiny_model())


@pytest.fixture
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def _clean(engine: AsyncLLM | EngineProcess) -> None:
    wait_until(lambda: engine.num_unfinished == 0, what="no unfinished request")
    st = engine.stats()
    assert (st.running, st.waiting, st.blocks_used) == (0, 0, 0)
    in_engine(engine, check_cache)


def _fault_switch(engine: AsyncLLM | EngineProcess, fault_file: Path) -> tuple[Callable[[], None], Callable[[], None]]:
    """(arm, remove): after arm(), the engine's next forward raises "injected fault" (once)."""
    if isinstance(engine, EngineProcess):
        return fault_file.touch, lambda: fault_file.unlink(missing_ok=True)
    fail = threading.Event()

    def fault(*_: object) -> None:
        if fail.is_set():
            fail.clear()
            raise RuntimeError("injected fault")

    hook = engine.llm.model.model.layers[0].register_forward_pre_hook(fault)
    return fail.set, hook.remove


# ------------------------------------------------------------------------------ openai client
def test_openai_completions(client: openai.OpenAI, offline: LLM, engine: AsyncLLM) -> None:
    want = offline.generate(PROMPTS[:2], SamplingParams(max_tokens=10, temperature=0.0), use_tqdm=False)
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=10, temperature=0)
    assert [c.text for c in resp.choices] == [o.text for o in want]
    assert [c.index for c in resp.choices] == [0, 1]
    assert resp.usage.completion_tokens == sum(len(o.token_ids) for o in want)
    assert resp.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in want)

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want[0].token_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want[0].finish_reason

    resp = client.completions.create(model=MODEL, prompt=[455, 491], max_tokens=4, temperature=0, logprobs=2,
                                     echo=True, n=2, seed=3)
    assert len(resp.choices) == 2 and all(c.text.startswith("The list") for c in resp.choices)
    lp = resp.choices[0].logprobs  # echo: the 2 prompt tokens (the first without a logprob), then the 4 new ones
    assert len(lp.tokens) == len(lp.token_logprobs) == 6 and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and "".join(lp.tokens) == resp.choices[0].text

    batch = client.completions.create(model=MODEL, prompt=[[455, 491], [455]], max_tokens=3, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text  # greedy samples agree
    assert (batch.usage.prompt_tokens, batch.usage.completion_tokens) == (2 + 1, 4 * 3)  # a prompt counts once
    _clean(engine)


def test_openai_chat(client: openai.OpenAI, offline: LLM, engine: AsyncLLM) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a list?"}]
    tok = offline.tokenizer
    ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
              add_special_tokens=False)["input_ids"]
    want = offline.generate([ids], SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)[0]

    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                          logprobs=True, top_logprobs=3)
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == len(want.token_ids)
    assert len(choice.logprobs.content) == len(want.token_ids)
    assert all(len(e.top_logprobs) == 3 for e in choice.logprobs.content)

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=12,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0, n=2,
                                                 stream=True, stream_options={"include_usage": True}))
    texts = {i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
             for i in (0, 1)}
    assert texts[0] == texts[1] == want.text[:len(texts[0])] and texts[0]
    assert {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason} == {0, 1}
    assert chunks[-1].usage.completion_tokens == 10 and all(c.usage is None for c in chunks[:-1])

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))  # vLLM's running usage
    running = [c.usage.completion_tokens for c in chunks if c.choices and c.choices[0].delta.content]
    assert running == sorted(running) and running[-1] == 5 and chunks[-1].usage.completion_tokens == 5

    stopped = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                             stop=[want.text[3:6]])
    assert stopped.choices[0].message.content == want.text[:want.text.index(want.text[3:6])]
    assert stopped.choices[0].finish_reason == "stop"
    _clean(engine)


def test_sampling_with_seed_is_reproducible(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "prompt": "The list", "max_tokens": 12, "temperature": 0.9, "top_p": 0.9, "seed": 7,
          "extra_body": {"top_k": 20}}  # vLLM's extra sampling fields travel in extra_body
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


# ------------------------------------------------------------------------------------- load
def test_64_concurrent_streams_equal_offline_generate(url: str, offline: LLM, engine: AsyncLLM) -> None:
    prompts = [f"{PROMPTS[i % len(PROMPTS)]}{' the' * (i // len(PROMPTS))}" for i in range(64)]
    lengths = [4 + i % 13 for i in range(64)]
    want = offline.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0) for n in lengths],
                            use_tqdm=False)

    async def one(client: httpx.AsyncClient, prompt: str, n: int) -> tuple[str, str | None]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
        text, reason = "", None
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = [e async for e in _aiter_events(r)]
        assert events[-1] == "[DONE]"
        for e in events[:-1]:
            text += e["choices"][0]["text"]
            reason = e["choices"][0]["finish_reason"] or reason
        return text, reason

    async def main() -> list[tuple[str, str | None]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, lengths, strict=True)))

    got = asyncio.run(main())
    assert got == [(o.text, o.finish_reason) for o in want]
    _clean(engine)


async def _aiter_events(response: httpx.Response):
    async for line in response.aiter_lines():
        for event in sse_events(iter([line])):
            yield event


def test_disconnects_give_every_block_back(url: str, engine: AsyncLLM) -> None:
    body = {"model": MODEL, "prompt": "The list", "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    aborted_before = _aborted(url)

    def stream_then_hang_up(k: int) -> None:
        with httpx.Client(timeout=60) as c, c.stream("POST", f"{url}/v1/completions", json=body) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= 2 * k + 2:
                    break  # leaving the block closes the connection mid-stream

    threads = [threading.Thread(target=stream_then_hang_up, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    # a non-streaming request (8 samples: seconds of work) whose client gives up after 0.3 s
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json={**body, "stream": False, "n": 8}, timeout=0.3)
    wait_until(lambda: metrics(url)["flashpage_num_requests_running"] == 0, what="running requests 0")
    m = metrics(url)
    assert (m["flashpage_kv_blocks_used"], m["flashpage_num_requests_waiting"]) == (0, 0)
    assert m["flashpage_kv_blocks_free"] + m["flashpage_kv_blocks_cached"] == m["flashpage_kv_blocks_total"]
    _clean(engine)
    assert _aborted(url) - aborted_before == 7  # every one was cut short by its disconnect, none ran to the end


def _aborted(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    m = re.search(r'^flashpage_request_success_total\{finished_reason="abort"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


# -------------------------------------------------------------------------------- faults
def test_failed_step_fails_only_its_requests_and_the_server_keeps_serving(url: str, engine: AsyncLLM,
                                                                         offline: LLM, fault_file: Path) -> None:
    arm, remove = _fault_switch(engine, fault_file)
    body = {"model": MODEL, "prompt": "The list", "max_tokens": 300, "temperature": 0, "ignore_eos": True}
    try:
        with httpx.Client(timeout=60) as c, c.stream("POST", f"{url}/v1/completions",
                                                      json={**body, "stream": True}) as r:
            events = []
            for e in sse_events(r.iter_lines()):
                events.append(e)
                if len(events) == 2:
                    arm()
        assert events[-1] == "[DONE]" and "error" in events[-2]
        assert events[-2]["error"]["code"] == 500 and "injected fault" in events[-2]["error"]["message"]
        arm()
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
    finally:
        remove()
    want = offline.generate(["The list"], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)[0]
    r = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 8, "ignore_eos": False}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.text
    assert metrics(url)["flashpage_request_failures_total"] == 2
    _clean(engine)


@pytest.mark.parametrize("engine_kind", ENGINES)
def test_full_queue_answers_503_with_retry_after(engine_kind: str) -> None:
    long = {"model": MODEL, "prompt": "The list", "max_tokens": 500, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with tiny_server(max_waiting_requests=1, max_num_seqs=1, engine_process=engine_kind == "process") as (
            server, engine), httpx.Client(timeout=60) as c:
        with c.stream("POST", f"{server.url}/v1/completions", json=long) as running:
            lines = running.iter_lines()  # keep it: a dropped line iterator closes the response
            next(lines)
            with c.stream("POST", f"{server.url}/v1/completions", json=long) as queued:
                wait_until(lambda: metrics(server.url)["flashpage_num_requests_waiting"] == 1, what="1 waiting")
                r = httpx.post(f"{server.url}/v1/completions", json={**long, "stream": False}, timeout=30)
                assert r.status_code == 503 and r.headers["retry-after"] == "1"
                assert r.json()["error"]["type"] == "service_unavailable"
                assert "max_waiting_requests=1" in r.json()["error"]["message"]
                assert queued.status_code == 200
        _clean(engine)
        r = httpx.post(f"{server.url}/v1/completions", json={**long, "stream": False, "max_tokens": 3}, timeout=30)
        assert r.status_code == 200  # capacity is back


# -------------------------------------------------------------------------------- info routes
def test_health_models_metrics(url: str, engine: AsyncLLM) -> None:
    assert httpx.get(f"{url}/health").status_code == 200
    models = httpx.get(f"{url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL] and models["data"][0]["max_model_len"] == 1024
    r = httpx.get(f"{url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in ("flashpage_num_requests_running", "flashpage_num_requests_waiting", "flashpage_kv_blocks_used",
                 "flashpage_kv_blocks_free", "flashpage_kv_blocks_cached", "flashpage_prefix_cache_hit_rate",
                 "flashpage_num_preemptions_total", "flashpage_generation_tokens_total",
                 "flashpage_time_to_first_token_seconds_bucket", "flashpage_inter_token_latency_seconds_bucket",
                 "flashpage_e2e_request_latency_seconds_count", "flashpage_request_success_total"):
        assert name in r.text, name
    httpx.post(f"{url}/v1/completions", json={"prompt": "The list", "max_tokens": 5, "temperature": 0}, timeout=30)
    m = metrics(url)
    assert m["flashpage_time_to_first_token_seconds_count"] >= 1 and m["flashpage_generation_tokens_total"] >= 5
    assert m["flashpage_inter_token_latency_seconds_count"] >= 4
    assert m["flashpage_kv_blocks_total"] == engine.stats().blocks_total
    r = httpx.get(f"{url}/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
