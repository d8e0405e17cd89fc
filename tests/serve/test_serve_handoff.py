"""The server's hot path between the engine thread and the event loop (flashpage/serve/async_engine.py).

- One hand-off per engine iteration: the engine thread wakes an event loop with one
  ``call_soon_threadsafe`` per step, not one per request and token.
- ``RequestStream.latest()``: a consumer that fell behind gets only the newest cumulative output, which
  holds everything the skipped ones did (text and tokens equal offline ``generate``); a failure queued
  after outputs is still raised; plain ``async for`` keeps every output.
- ``flashpage serve --cpu-bind``: the engine thread is bound, the HTTP front keeps the process's cores.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import pytest
import torch

from flashpage import LLM, SamplingParams, load_tiny_model
from flashpage.serve import AsyncLLM, RequestFailedError
from flashpage.serve.async_engine import RequestStream, _Failed

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")

PROMPTS = ["The list", "A module is", "Return the number of", "If the file", "The dictionary", "This function",
           "An optional argument", "The key"]
PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any]:
    return load_tiny_model()


@pytest.fixture(scope="module")
def reference(tiny: tuple[Any, Any]) -> list[tuple[list[int], str]]:
    outs = LLM(*tiny).generate(PROMPTS, PARAMS, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs]


class _CountingLoop(asyncio.SelectorEventLoop):
    """An event loop that counts the wake-ups other threads ask of it."""

    def __init__(self) -> None:
        super().__init__()
        self.threadsafe_calls = 0

    def call_soon_threadsafe(self, *args: Any, **kwargs: Any) -> Any:
        self.threadsafe_calls += 1
        return super().call_soon_threadsafe(*args, **kwargs)


def test_one_wakeup_per_engine_step_not_per_request(tiny: tuple[Any, Any],
                                                    reference: list[tuple[list[int], str]]) -> None:
    front = AsyncLLM(LLM(*tiny, check_invariants=True))
    loop = _CountingLoop()
    try:
        async def consume(stream: RequestStream) -> tuple[list[int], str, int]:
            n, last = 0, None
            async for out in stream:
                n, last = n + 1, out
            assert last is not None
            return last.outputs[0].token_ids, last.outputs[0].text, n

        async def main() -> list[tuple[list[int], str, int]]:
            streams = front.add_requests(PROMPTS, PARAMS)  # queued together: one engine batch
            return await asyncio.gather(*(consume(s) for s in streams))

        steps_before = front.stats().steps
        results = loop.run_until_complete(main())
        steps = front.stats().steps - steps_before
    finally:
        loop.close()
        front.close()
    assert [(ids, text) for ids, text, _ in results] == reference
    delivered = sum(n for _, _, n in results)
    assert delivered >= len(PROMPTS) * PARAMS.max_tokens  # every output reached its consumer
    # one wake-up per engine iteration (+1 for the acceptances), where per-output wake-ups would be 8x more
    assert loop.threadsafe_calls <= steps + 2, (loop.threadsafe_calls, steps, delivered)
    assert loop.threadsafe_calls * 4 < delivered


def _finished_stream(front: AsyncLLM, prompt: str) -> RequestStream:
    """A stream whose request ran to the end before anyone read it (every output is queued)."""
    stream = front.add_request(prompt, PARAMS)
    deadline = time.monotonic() + 60
    while front.num_unfinished:
        assert time.monotonic() < deadline, "the request did not finish"
        time.sleep(0.01)
    return stream


def test_latest_skips_to_the_newest_cumulative_output(tiny: tuple[Any, Any],
                                                      reference: list[tuple[list[int], str]]) -> None:
    front = AsyncLLM(LLM(*tiny, check_invariants=True))
    try:
        async def read(stream: RequestStream, coalesce: bool) -> list[Any]:
            return [out async for out in (stream.latest() if coalesce else stream)]

        behind = asyncio.run(read(_finished_stream(front, PROMPTS[0]), coalesce=True))
        every = asyncio.run(read(_finished_stream(front, PROMPTS[0]), coalesce=False))
    finally:
        front.close()
    assert len(behind) == 1 and behind[0].finished  # nothing but the final, complete output
    assert (behind[0].outputs[0].token_ids, behind[0].outputs[0].text) == reference[0]
    assert len(every) >= PARAMS.max_tokens and every[-1].outputs[0].text == reference[0][1]


def test_latest_still_raises_a_failure_queued_after_outputs(tiny: tuple[Any, Any]) -> None:
    front = AsyncLLM(LLM(*tiny, check_invariants=True))
    try:
        stream = front.add_request(PROMPTS[1], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))

        async def read() -> list[Any]:
            await stream.accepted()
            seen = []
            deadline = time.monotonic() + 60
            while stream._items.qsize() < 3:  # a few outputs queued, the request still running
                assert time.monotonic() < deadline
                await asyncio.sleep(0.005)
            stream._items.put(_Failed(RequestFailedError("step failed")))  # as the engine reports a failure
            with pytest.raises(RequestFailedError, match="step failed"):
                async for out in stream.latest():
                    seen.append(out)
            return seen

        seen = asyncio.run(read())
    finally:
        front.close()
    assert len(seen) == 1 and not seen[0].finished and len(seen[0].outputs[0].token_ids) >= 3


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="binding needs Linux sched_setaffinity")
def test_cpu_bind_binds_the_engine_thread_not_the_front(tiny: tuple[Any, Any]) -> None:
    from flashpage.serve.server import bind_engine_threads

    front = AsyncLLM(LLM(*tiny))
    me = threading.get_native_id()
    before, threads = os.sched_getaffinity(me), torch.get_num_threads()
    core = sorted(before)[-1]
    try:
        note = bind_engine_threads(str(core), front)
        assert os.sched_getaffinity(front.engine_thread_id) == {core}
        assert os.sched_getaffinity(me) == before  # the caller (the event loop's thread) keeps its cores
        assert f"bound to cores {core}" in note and "engine thread" in note
        last = None
        for out in front.add_request(PROMPTS[3], PARAMS):  # the bound engine still serves
            last = out
        assert last is not None and last.finished and len(last.outputs[0].token_ids) == PARAMS.max_tokens
    finally:
        front.close()
        os.sched_setaffinity(me, before)
        torch.set_num_threads(threads)
