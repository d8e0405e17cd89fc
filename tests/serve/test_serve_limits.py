"""What real clients need from the server (issue 18): echoed prompts with their logprobs (lm-eval's
loglikelihood requests: ``echo``, ``logprobs``, ``max_tokens`` 0 or 1) equal to transformers'
log-softmax; limits that say no at once (prompt + max_tokens over the context: 400 naming both
numbers; a body over the size limit: 413; more prompts than the queue can ever hold: 400; a batch
admitted all or nothing); tokenization and chat templates that block neither the event loop nor
the engine thread.
"""

from __future__ import annotations

import copy
import re
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from serve_helpers import ENGINES, MODEL, engine_held, sse_events, tiny_server, wait_until

from flashpage import SamplingParams, load_tiny_model
from flashpage.serve import AsyncLLM, QueueFullError, ServerThread

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
LIMIT_BYTES = 20_000
TOL = 1e-5


@pytest.fixture(scope="module", params=ENGINES)
def served(request: pytest.FixtureRequest) -> Iterator[tuple[ServerThread, Any]]:
    """The engine in a thread of the server's process, then in its own process (``flashpage serve``'s way)."""
    with tiny_server(max_waiting_requests=8, app_kwargs={"max_request_bytes": LIMIT_BYTES},
                     engine_process=request.param == "process") as s:
        yield s


@pytest.fixture(scope="module")
def url(served: tuple[ServerThread, AsyncLLM]) -> str:
    return served[0].url


@pytest.fixture(scope="module")
def reference() -> tuple[Any, Any]:
    """The tiny model, unpatched, and its tokenizer: transformers' plain forward."""
    return load_tiny_model()


def _logsoftmax(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)


def _post(url: str, path: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": MODEL, **body}, timeout=60, **kw)


def _error(resp: httpx.Response, status: int, param: str | None) -> str:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["code"] == status and err["param"] == param, err
    return err["message"]


# --------------------------------------------------------------------------------- echo + logprobs
@pytest.mark.parametrize("max_tokens", [0, 1, 3])
def test_echo_returns_prompt_logprobs_as_lm_eval_reads_them(url: str, reference: tuple[Any, Any],
                                                            max_tokens: int) -> None:
    """lm-eval's loglikelihood request (token-id prompts, echo, logprobs=1, max_tokens 0/1): every prompt
    token with its logprob (None first) equal to transformers' log-softmax, then the generated ones."""
    model, tok = reference
    prompts = [tok("The list of numbers is returned")["input_ids"], tok("A module is")["input_ids"]]
    body = {"prompt": prompts, "echo": True, "logprobs": 2, "max_tokens": max_tokens, "temperature": 0}
    resp = _post(url, CMPL, body)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    for choice, ids in zip(data["choices"], prompts, strict=True):
        lp = choice["logprobs"]
        assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        n = len(ids) + max_tokens
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
        assert lp["tokens"][:len(ids)] == [tok.decode([t]) for t in ids]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        ref = _logsoftmax(model, ids)
        for i in range(1, len(ids)):
            assert abs(lp["token_logprobs"][i] - float(ref[i - 1, ids[i]])) <= TOL
            top = sorted(lp["top_logprobs"][i].values(), reverse=True)
            assert len(top) <= 2 and abs(top[0] - float(ref[i - 1].max())) <= TOL
        assert choice["text"].startswith(tok.decode(ids))
        assert lp["text_offset"][:2] == [0, len(lp["tokens"][0])]
        if max_tokens == 0:
            assert choice["text"] == tok.decode(ids) and choice["finish_reason"] == "length"
        else:
            assert lp["token_logprobs"][len(ids)] is not None  # the generated token follows
    assert data["usage"]["completion_tokens"] == max_tokens * len(prompts)


def test_echo_streamed_equals_echo_whole(url: str) -> None:
    """With stream=true the echoed prompt and its logprobs come in each sample's first chunk; the chunks
    joined equal the whole response."""
    body = {"prompt": "The list of numbers", "echo": True, "logprobs": 1, "max_tokens": 4, "temperature": 0}
    whole = _post(url, CMPL, body).json()["choices"][0]
    with httpx.Client(timeout=60) as c, c.stream("POST", f"{url}{CMPL}", json={**body, "stream": True}) as r:
        chunks = [e for e in sse_events(r.iter_lines()) if isinstance(e, dict)]
    assert "".join(e["choices"][0]["text"] for e in chunks) == whole["text"]
    joined = {k: [v for e in chunks for v in e["choices"][0]["logprobs"][k]] for k in whole["logprobs"]}
    assert joined == whole["logprobs"]
    only = {**body, "max_tokens": 0, "stream": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", f"{url}{CMPL}", json=only) as r:
        chunks = [e for e in sse_events(r.iter_lines()) if isinstance(e, dict)]
    assert "".join(e["choices"][0]["text"] for e in chunks) == "The list of numbers"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_max_tokens_zero_needs_echo(url: str) -> None:
    message = _error(_post(url, CMPL, {"prompt": "The list", "max_tokens": 0}), 400, "max_tokens")
    assert "only allowed with echo" in message


# -------------------------------------------------------------------------------- context length
@pytest.mark.parametrize("max_tokens", [10**9, 2**63, 100])
def test_max_tokens_beyond_the_context_is_400_naming_both_numbers(url: str, reference: tuple[Any, Any],
                                                                  max_tokens: int) -> None:
    """vLLM's answer: 400 naming the context length, the prompt's tokens and the request's, before anything
    is generated (previously: cut silently to what fits, after generating it)."""
    prompt = [5] * 999 if max_tokens == 100 else [5] * 10
    message = _error(_post(url, CMPL, {"prompt": prompt, "max_tokens": max_tokens}), 400, "max_tokens")
    total = len(prompt) + max_tokens
    assert "maximum context length (max_model_len) is 1024 tokens" in message
    assert f"requested {total} tokens ({len(prompt)} in the prompt, {max_tokens} in max_tokens)" in message
    if max_tokens > 1024:
        message = _error(_post(url, CHAT, {"messages": [{"role": "user", "content": "hi"}],
                                           "max_completion_tokens": max_tokens}), 400, "max_completion_tokens")
        assert f"{max_tokens} in max_completion_tokens" in message


# ------------------------------------------------------------------------------------ body size
def test_body_over_the_limit_is_413(url: str, served: tuple[ServerThread, AsyncLLM]) -> None:
    """Refused by its Content-Length before it is read, or (chunked, no length) once the bytes read pass the
    limit; the server serves the next request as before."""
    before = _rejected(url, "body_too_large")
    big = {"model": MODEL, "prompt": "x " * LIMIT_BYTES}
    message = _error(_post(url, CMPL, big), 413, None)
    assert f"at most {LIMIT_BYTES} bytes" in message and "--max-request-bytes" in message
    chunked = (b"x" * 4096 for _ in range(LIMIT_BYTES // 4096 + 2))
    resp = httpx.post(f"{url}{CHAT}", content=chunked, headers={"content-type": "application/json"}, timeout=60)
    assert f"more than {LIMIT_BYTES} bytes" in _error(resp, 413, None)
    assert _post(url, CMPL, {"prompt": "The list", "max_tokens": 2}).status_code == 200
    assert _rejected(url, "body_too_large") == before + 2


def _rejected(url: str, reason: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    m = re.search(rf'^flashpage_requests_rejected_total{{reason="{reason}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


# ------------------------------------------------------------------------------- batch admission
def test_batch_larger_than_the_queue_is_400_at_once(url: str, served: tuple[ServerThread, AsyncLLM]) -> None:
    """9 prompts where at most 8 can ever wait: 400 naming the limit (503 would invite endless retries)."""
    engine = served[1]
    message = _error(_post(url, CMPL, {"prompt": [[5, 6]] * 9, "max_tokens": 1}), 400, "prompt")
    assert "9 prompts" in message and "at most 8" in message and "--max-waiting-requests" in message
    assert engine.num_unfinished == 0
    assert _post(url, CMPL, {"prompt": [[5, 6]] * 8, "max_tokens": 1}).status_code == 200


def test_batch_admission_is_all_or_nothing(served: tuple[ServerThread, AsyncLLM]) -> None:
    """While the engine thread is held, 6 queued + a batch of 3 over the limit of 8 is refused whole (nothing
    of it occupies the queue), so a single request after it still gets in."""
    engine = served[1]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    with engine_held(engine):  # the engine cannot take commands: everything stays queued
        first = engine.add_requests([[5, 6]] * 6, params)
        with pytest.raises(QueueFullError, match="6 requests are waiting and this one brings 3"):
            engine.add_requests([[5, 6]] * 3, params)
        assert engine.num_unfinished == 6
        single = engine.add_request([7, 8], params)
        with pytest.raises(ValueError, match="9 prompts in one request.*max_waiting_requests=8"):
            engine.add_requests([[5, 6]] * 9, params)
    for stream in [*first, single]:
        assert list(stream)[-1].finished
    wait_until(lambda: engine.num_unfinished == 0)


# ------------------------------------------------------------------------ tokenization off-thread
class GatedTokenizer:
    """A tokenizer that, for a text containing ``GATE``, waits until released; it records which threads
    encoded text. Copies (the server's per-thread ones) share the gate and the record."""

    def __init__(self, inner: Any, gate: threading.Event, held: list[str], threads: list[str]) -> None:
        self._inner, self._gate, self._held, self._threads = inner, gate, held, threads

    def __deepcopy__(self, memo: dict[int, Any]) -> GatedTokenizer:
        return GatedTokenizer(copy.deepcopy(self._inner, memo), self._gate, self._held, self._threads)

    def __call__(self, text: Any, *args: Any, **kwargs: Any) -> Any:
        self._threads.append(threading.current_thread().name)
        texts = [text] if isinstance(text, str) else list(text)
        if any("GATE" in t for t in texts):
            self._held.append(texts[0])
            assert self._gate.wait(60), "the gate was never opened"
        return self._inner(text, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_a_slow_tokenization_delays_nobody_else() -> None:
    """A completion and a chat request stuck in tokenization: /health answers, and another client's completion
    runs to the end meanwhile; no text is ever encoded on the event loop or the engine thread."""
    gate, held, threads = threading.Event(), [], []
    tok = GatedTokenizer(load_tiny_model()[1], gate, held, threads)
    with tiny_server(tokenizer=tok, app_kwargs={"tokenizer_workers": 3}) as (server, _):
        url = server.url
        results: dict[str, httpx.Response] = {}
        bodies = {CMPL: {"prompt": "GATE The list", "max_tokens": 2},
                  CHAT: {"messages": [{"role": "user", "content": "GATE hi"}], "max_tokens": 2}}
        workers = [threading.Thread(target=lambda p=p, b=b: results.__setitem__(p, _post(url, p, b)))
                   for p, b in bodies.items()]
        for t in workers:
            t.start()
        wait_until(lambda: len(held) == 2, what="both requests held in tokenization")
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        other = _post(url, CMPL, {"prompt": "The list", "max_tokens": 4, "temperature": 0}).json()
        assert other["usage"]["completion_tokens"] == 4 and not results  # it finished while they wait
        gate.set()
        for t in workers:
            t.join(60)
        assert {p: r.status_code for p, r in results.items()} == {CMPL: 200, CHAT: 200}
    assert threads and all(name.startswith("flashpage-tokenize") for name in threads), set(threads)
