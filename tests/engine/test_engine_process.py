"""EngineProcess (the engine in its own process, ``flashpage serve``'s default) against the same LLM in this
process: every output field equal (samples, text, logprobs, prompt logprobs), snapshots that never change
once handed out, the child's errors raised here with their type and message, a drained close, and a child
that dies failing its requests instead of hanging them (its restarts: tests/serve/test_serve_engine_death.py). The HTTP
server over it: tests/test_serve*.py."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
from serve_helpers import wait_until

from flashpage import LLM, SamplingParams, load_tiny_model
from flashpage.cli import _serve_engine_process
from flashpage.serve.async_engine import EngineClosedError, EngineDiedError
from flashpage.serve.engine_process import EngineProcess, EngineSpec

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")

PROMPTS = ["The list", "A module is", "Return the number of"]
LLM_KWARGS = {"block_size": 16, "max_num_seqs": 8}


@pytest.fixture(scope="module")
def engine() -> Iterator[EngineProcess]:
    proc = EngineProcess(EngineSpec(engine={"check_invariants": True, **LLM_KWARGS}))
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(*load_tiny_model(), **LLM_KWARGS)


def _max_model_len(llm: LLM, extra: int) -> int:
    return llm.max_model_len + extra


def _refuse(llm: LLM) -> None:
    raise ValueError("refused in the engine process")


def _assert_same_logprobs(got: list[Any], want: list[Any]) -> None:
    """Same tokens and top-k ids; log-probabilities equal up to float32 rounding: the child schedules the
    requests as they arrive, so a token may be computed in a step of other rows than here (steps of at most
    four rows take the small-M linear, larger ones oneDNN: README, Engine API, cpu_prepack)."""
    assert [(e.token_id, list(e.top)) for e in got] == [(e.token_id, list(e.top)) for e in want]
    for g, w in zip(got, want, strict=True):
        assert g.logprob == pytest.approx(w.logprob, abs=1e-5)
        assert all(g.top[k] == pytest.approx(w.top[k], abs=1e-5) for k in w.top)


def _final(stream: Any) -> Any:
    return list(stream)[-1]


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, prompt_logprobs=2),
    SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=11, n=2),
    SamplingParams(max_tokens=40, temperature=0.0, stop=[" the", "\n"]),
], ids=["logprobs", "n2-seeded", "stop-strings"])
def test_outputs_equal_the_same_llm_in_this_process(engine: EngineProcess, offline: LLM,
                                                    params: SamplingParams) -> None:
    want = offline.generate(PROMPTS, params, use_tqdm=False)
    streams = engine.add_requests(PROMPTS, params)
    for stream, ref in zip(streams, want, strict=True):
        got = _final(stream)
        assert got.finished and got.prompt_token_ids == ref.prompt_token_ids
        assert [(c.index, c.token_ids, c.text, c.finish_reason) for c in got.outputs] == \
               [(c.index, c.token_ids, c.text, c.finish_reason) for c in ref.outputs]
        for a, b in zip(got.outputs, ref.outputs, strict=True):
            assert (a.logprobs is None) == (b.logprobs is None)
            if a.logprobs is not None:
                _assert_same_logprobs(a.logprobs, b.logprobs)
        if params.prompt_logprobs is not None:
            assert len(got.prompt_logprobs) == len(ref.prompt_token_ids) and got.prompt_logprobs[0] is None
            _assert_same_logprobs(got.prompt_logprobs[1:], ref.prompt_logprobs[1:])
        assert got.metrics.first_token_time is not None and got.metrics.finish_time is not None
    wait_until(lambda: engine.num_unfinished == 0, what="no unfinished request")
    assert engine.stats().blocks_used == 0


def test_snapshots_never_change_once_handed_out(engine: EngineProcess) -> None:
    stream = engine.add_request("The list", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    seen = [(out, list(out.token_ids), out.text) for out in stream]
    assert len(seen) >= 2 and seen[-1][0].finished and len(seen[-1][1]) == 24
    for out, ids, text in seen:  # every snapshot still holds what it held when it was read
        assert (out.token_ids, out.text) == (ids, text)
    for (_, a, ta), (_, b, tb) in zip(seen, seen[1:], strict=False):
        assert b[:len(a)] == a and tb.startswith(ta)


def test_errors_cross_with_their_type_and_the_engine_keeps_serving(engine: EngineProcess) -> None:
    bad = engine.add_request([1] * 5000, SamplingParams(max_tokens=4))  # longer than max_model_len
    with pytest.raises(ValueError, match="max_model_len"):
        list(bad)
    with pytest.raises(ValueError, match="refused in the engine process"):
        engine.run_in_engine(_refuse)
    assert engine.run_in_engine(_max_model_len, 5) == engine.llm.max_model_len + 5
    with pytest.raises(ValueError, match="prompts in one request.*max_waiting_requests=512"):
        engine.add_requests([[5, 6]] * 513, SamplingParams(max_tokens=1))
    assert _final(engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0))).finished


def test_abort_ends_the_stream_and_frees_its_blocks(engine: EngineProcess) -> None:
    stream = engine.add_request("The list", SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True))
    outs = []
    for out in stream:
        outs.append(out)
        if len(outs) == 3:
            engine.abort(stream.request_id)
    assert outs[-1].finished and outs[-1].finish_reason == "abort" and len(outs[-1].token_ids) < 1000
    wait_until(lambda: engine.num_unfinished == 0, what="no unfinished request")
    assert engine.stats().blocks_used == 0


def test_startup_error_is_raised_here_with_its_message() -> None:
    with pytest.raises(OSError, match="--model ./no-such-checkpoint: no such directory"):
        EngineProcess(EngineSpec(model="./no-such-checkpoint"))


def test_close_drains_then_stops_the_process() -> None:
    proc = EngineProcess(EngineSpec(engine=LLM_KWARGS))
    stream = proc.add_request("The list", SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert proc.close(drain_timeout=60) is True
    assert _final(stream).finish_reason == "length"
    assert proc._proc.returncode == 0 and not proc.accepting
    with pytest.raises(EngineClosedError):
        proc.add_request("The list")


def test_a_dead_engine_process_fails_its_requests_instead_of_hanging() -> None:
    proc = EngineProcess(EngineSpec(engine=LLM_KWARGS))
    try:
        stream = proc.add_request("The list", SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True))
        it = iter(stream)
        next(it)
        pid = proc.pid
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineDiedError, match=rf"engine process died \(pid {pid} exited unexpectedly: killed by "
                                                  r"signal 9 \(SIGKILL\)\) before this request finished; no restart"):
            for _ in it:
                pass
        wait_until(lambda: not proc.accepting, what="the front stops accepting")
        assert proc.fatal_error is not None and proc.restarts == 0  # max_restarts=0 (the default): gone for good
        assert "no restart left" in (proc.unavailable or "")
        with pytest.raises(EngineDiedError, match="no restart left"):
            proc.add_request("The list")
        with pytest.raises(EngineDiedError):
            proc.stats()
        assert proc.num_unfinished == 0
    finally:
        proc.close()


def test_serve_runs_the_engine_in_its_own_process_unless_tensor_parallel() -> None:
    assert _serve_engine_process(None, 1) is True
    assert _serve_engine_process(False, 1) is False
    assert _serve_engine_process(None, 2) is False
    with pytest.raises(ValueError, match="--engine-process with --tensor-parallel-size 2"):
        _serve_engine_process(True, 2)
