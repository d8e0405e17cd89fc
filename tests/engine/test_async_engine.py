"""AsyncLLM: the thread- and asyncio-safe engine front (no HTTP).

Outputs through the front equal offline ``LLM.generate``; abort is a no-op for unknown or ended ids
and ends a running request with exactly one "abort" output; a failing step fails only its own
requests; the waiting queue is bounded; close() drains or aborts, and every block comes back.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from flashpage import LLM, SamplingParams, load_tiny_model
from flashpage.serve import AsyncLLM, EngineClosedError, QueueFullError, RequestFailedError

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")

PROMPTS = ["The list", "A module is", "Return the number of", "If the file", "The dictionary", "This function"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


_TINY: list = []


def _tiny() -> tuple:
    """One tiny model for the module: each front's LLM uses it in turn (never two at once)."""
    if not _TINY:
        _TINY.extend(load_tiny_model())
    return _TINY[0], _TINY[1]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return [o.token_ids for o in LLM(*_tiny()).generate(PROMPTS, GREEDY, use_tqdm=False)]


def _front(**llm_kwargs: object) -> AsyncLLM:
    return AsyncLLM(LLM(*_tiny(), check_invariants=True, **llm_kwargs), max_waiting_requests=64)


@pytest.fixture
def front() -> Iterator[AsyncLLM]:
    f = _front()
    yield f
    f.close()


def _wait(cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def _all_blocks_back(front: AsyncLLM) -> None:
    _wait(lambda: front.num_unfinished == 0)
    st = front.stats()
    assert (st.running, st.waiting, st.blocks_used) == (0, 0, 0)
    front.llm.kv.blocks.check_invariants()


async def _collect(front: AsyncLLM, prompt: str, params: SamplingParams) -> list:
    return [out async for out in front.generate(prompt, params)]


def test_concurrent_async_requests_equal_offline_generate(front: AsyncLLM, reference: list[list[int]]) -> None:
    async def main() -> list[list]:
        return await asyncio.gather(*(_collect(front, p, GREEDY) for p in PROMPTS))

    runs = asyncio.run(main())
    for outs, want in zip(runs, reference, strict=True):
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]  # one final output, last
        assert outs[-1].token_ids == want
        lengths = [len(o.token_ids) for o in outs]
        assert lengths == sorted(lengths)  # cumulative snapshots
    _all_blocks_back(front)


def test_threads_add_and_read_streams(front: AsyncLLM, reference: list[list[int]]) -> None:
    got: dict[int, list[int]] = {}

    def worker(i: int) -> None:
        got[i] = list(front.add_request(PROMPTS[i], GREEDY))[-1].token_ids

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [got[i] for i in range(len(PROMPTS))] == reference
    _all_blocks_back(front)


def test_abort_running_request_reports_abort_once(front: AsyncLLM) -> None:
    front.abort("never-added")  # unknown id: no-op
    stream = front.add_request("The list", LONG, request_id="a")
    outs = []
    for out in stream:
        outs.append(out)
        if len(outs) == 3:
            threading.Thread(target=front.abort, args=("a",)).start()  # from another thread
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert sum(o.finished for o in outs) == 1 and len(outs[-1].token_ids) < LONG.max_tokens
    front.abort("a")  # ended: no-op
    _all_blocks_back(front)
    again = list(front.add_request("The list", GREEDY, request_id="a"))  # the id is free again
    assert again[-1].finish_reason in ("stop", "length")


def test_leaving_an_async_stream_early_aborts_the_request(front: AsyncLLM) -> None:
    async def main() -> int:
        n = 0
        async for _ in front.generate("The list", LONG):
            n += 1
            if n == 2:
                break
        return n

    assert asyncio.run(main()) == 2
    _all_blocks_back(front)


def test_invalid_request_raises_from_its_stream_and_queues_nothing(front: AsyncLLM) -> None:
    async def main() -> None:
        with pytest.raises(ValueError, match="prompt is empty"):
            await front.add_request([], GREEDY).accepted()
        with pytest.raises(ValueError, match="outside the vocabulary"):
            [o async for o in front.add_request([1, 10**6], GREEDY)]

    asyncio.run(main())
    assert list(front.add_request("The list", GREEDY))[-1].finished
    _all_blocks_back(front)


def test_failed_step_fails_only_its_requests(reference: list[list[int]]) -> None:
    front = _front(max_num_seqs=1)  # the second request waits, outside the failing step
    fail = threading.Event()

    def fault(*_: object) -> None:
        if fail.is_set():
            fail.clear()
            raise RuntimeError("injected fault")

    hook = front.llm.model.model.layers[0].register_forward_pre_hook(fault)
    try:
        a = front.add_request("The list", LONG, request_id="a")
        it = iter(a)
        next(it)
        b = front.add_request(PROMPTS[1], GREEDY, request_id="b")
        _wait(lambda: front.snapshot().waiting == 1)
        fail.set()
        with pytest.raises(RequestFailedError, match="injected fault"):
            list(it)
        assert list(b)[-1].token_ids == reference[1]  # b was waiting: untouched, exact
        assert front.failed_steps == 1
        _all_blocks_back(front)
        assert list(front.add_request(PROMPTS[0], GREEDY))[-1].token_ids == reference[0]  # still serving
    finally:
        hook.remove()
        front.close()


def test_waiting_queue_is_bounded() -> None:
    front = AsyncLLM(LLM(*_tiny(), max_num_seqs=1), max_waiting_requests=2)
    try:
        running = front.add_request("The list", LONG)
        it = iter(running)  # keep the iterator: dropping it early would abort the request
        next(it)
        queued = [front.add_request("A module is", LONG) for _ in range(2)]
        _wait(lambda: front.snapshot().waiting == 2)
        with pytest.raises(QueueFullError, match="max_waiting_requests=2"):
            front.add_request("If the file", GREEDY)
        for s in [running, *queued]:
            front.abort(s.request_id)
        assert all(list(s)[-1].finish_reason == "abort" for s in queued)
        _all_blocks_back(front)
    finally:
        front.close()


def test_close_drains_running_requests_then_refuses_new_ones(reference: list[list[int]]) -> None:
    front = _front()
    streams = [front.add_request(p, GREEDY) for p in PROMPTS[:3]]
    assert front.close(drain_timeout=30.0)  # every request finished on its own
    assert [list(s)[-1].token_ids for s in streams] == reference[:3]
    with pytest.raises(EngineClosedError):
        front.add_request("The list", GREEDY)


def test_close_without_drain_aborts_what_is_left() -> None:
    front = _front()
    stream = front.add_request("The list", LONG)
    it = iter(stream)
    next(it)
    assert not front.close(drain_timeout=0.0)
    rest = list(it)
    assert rest and rest[-1].finish_reason == "abort"
    assert front.stats().blocks_used == 0


def test_bad_max_waiting_requests() -> None:
    with pytest.raises(ValueError, match="max_waiting_requests must be an int >= 1"):
        AsyncLLM(object(), max_waiting_requests=0)  # type: ignore[arg-type]
