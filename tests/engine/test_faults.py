"""Fault injection: exceptions at the worst moments must fail only what they hit, never the engine.

Faults are injected into ``flashpage.LLM`` and into patched ``model.generate()``:

- an exception raised inside the model forward (a forward pre-hook on a decoder layer) at a random
  step of ``generate()``, with other requests in flight (queued with ``add_request``);
- a ``KeyboardInterrupt`` during ``generate()`` / ``stream()`` (in the forward, or in the sampler
  after the forward);
- a failed allocation: the block manager raising ``NoFreeBlocksError`` while a step is scheduled;
- an exception inside ``step()`` with several requests in flight, at each stage of the step:
  scheduling (allocation), forward, sampling, appending the sampled tokens (some sequences got
  theirs, some not) and forking the ``n`` samples of a request.

Each time: the exception reaches the caller unchanged (type and message); ``generate()`` and
``stream()`` fail only their own requests (the queued ones keep running), ``step()`` fails nothing
(its step is rolled back and the next ``step()`` retries it); the block accounting stays consistent
(``check_invariants``, the cache holds exactly what the engine computed, no block left once the
requests finished or were aborted); and the next ``generate()`` on the same LLM is exact (greedy
output equal to transformers' ``generate()``, tie-aware). For patched ``generate()``: a forward
exception or interrupt mid-generation leaves the model, and an explicit HFPagedCache, usable and the
next ``generate()`` exact. ``test_queued_request_finished_inside_generate...``: a queued request
finishing inside ``generate()`` is reported by the next ``step()``, once.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from engine_helpers import engine_model, hf_greedy, random_prompts
from model_zoo import left_padded_batch
from reliability_helpers import (
    CallFault,
    FaultHook,
    GroupRecorder,
    assert_cache_matches_computed,
    assert_pool_clean,
    run_to_completion,
)

import flashpage
from flashpage import LLM, NoFreeBlocksError, SamplingParams
from flashpage.engine.sampler import Sampler
from flashpage.patches import HFPagedCache
from flashpage.testing import compare_greedy

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")

MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
# small blocks, a token budget that chunks the longer prompts, fewer seats than requests
POOL = dict(block_size=4, num_blocks=48, max_num_seqs=4, max_num_batched_tokens=24, check_invariants=True)
N_PROMPTS = 6
CALL_ONLY = 4  # generate() runs prompts[:4]; prompts[4:] are queued beforehand with add_request


# ------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def model() -> Iterator[torch.nn.Module]:
    m = engine_model()
    yield m
    flashpage.unpatch(m)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    shared = random_prompts(1, 9, 9, seed=11)[0]  # two prompts share a two-block prefix
    return random_prompts(N_PROMPTS - 2, 3, 30, seed=5) + random_prompts(2, 2, 12, seed=6, prefix=shared)


@pytest.fixture(scope="module")
def refs(model: torch.nn.Module, prompts: list[list[int]]) -> list[tuple[list[int], list[torch.Tensor]]]:
    """transformers' greedy generate() of every prompt: (new tokens, the logits that chose them)."""
    return [hf_greedy(model, p, MAX_NEW) for p in prompts]


def _llm(model: torch.nn.Module) -> tuple[LLM, GroupRecorder]:
    llm = LLM(model, **POOL)
    return llm, GroupRecorder(llm)


def _assert_exact(tokens: list[int], ref: tuple[list[int], list[torch.Tensor]], what: str) -> None:
    match = compare_greedy(ref[0], tokens, ref[1])
    assert match.ok, f"{what}: {match.explain()}\nref={ref[0]}\ngot={tokens}"


def _assert_outputs_exact(outputs: list[Any], refs: list[tuple[list[int], list[torch.Tensor]]], what: str) -> None:
    assert len(outputs) == len(refs)
    for i, (out, ref) in enumerate(zip(outputs, refs, strict=True)):
        assert out.finished
        for c in out.outputs:
            assert c.finish_reason in ("stop", "length"), f"{what} request {i}/{c.index}: {c.finish_reason}"
            _assert_exact(c.token_ids, ref, f"{what} request {i}/{c.index}")


def _next_generate_is_exact(llm: LLM, prompts: list[list[int]], refs: list[Any]) -> None:
    """The engine still works: a fresh generate() on the same LLM equals transformers."""
    outs = llm.generate(prompts[:CALL_ONLY], GREEDY, use_tqdm=False)
    _assert_outputs_exact(outs, refs[:CALL_ONLY], "generate() after the fault")


def _assert_consistent(llm: LLM) -> None:
    """Block accounting sound, the cache holds what the engine computed, every live sample is queued."""
    llm.kv.blocks.check_invariants()
    assert_cache_matches_computed(llm)
    queued = set(llm.scheduler.running) | set(llm.scheduler.waiting)
    for group in llm._groups.values():
        lost = [s.index for s in group.seqs if not s.finished and s not in queued]
        assert not lost, f"request {group.request_id}: samples {lost} are neither running nor waiting"


def _count_forwards(model: torch.nn.Module, prompts: list[list[int]]) -> int:
    """Forwards of the fault-free run of the scenario of test_forward_fault_at_random_step."""
    llm, _ = _llm(model)
    for p in prompts[CALL_ONLY:]:
        llm.add_request(p, GREEDY)
    with FaultHook(model.model.layers[1], []) as hook:
        llm.generate(prompts[:CALL_ONLY], GREEDY, use_tqdm=False)
    return hook.calls


@pytest.fixture(scope="module")
def clean_forwards(model: torch.nn.Module, prompts: list[list[int]]) -> int:
    return _count_forwards(model, prompts)


# ------------------------------------------------------------------------ generate(): forward faults
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_forward_fault_at_random_step_fails_the_call_only(model: torch.nn.Module, prompts: list[list[int]],
                                                          refs: list[Any], clean_forwards: int, seed: int) -> None:
    fail_at = random.Random(seed).randint(1, clean_forwards)
    llm, rec = _llm(model)
    queued = [llm.add_request(p, GREEDY) for p in prompts[CALL_ONLY:]]
    with FaultHook(model.model.layers[1], [fail_at]) as hook:
        with pytest.raises(RuntimeError, match=rf"^injected fault on call {fail_at}$"):
            llm.generate(prompts[:CALL_ONLY], GREEDY, use_tqdm=False)
    assert hook.raised == [fail_at]
    _assert_consistent(llm)
    # the call's own requests are gone (finished with "abort" unless done before the fault) ...
    called = [rid for rid in rec.groups if rid not in queued]
    assert len(called) == CALL_ONLY and set(llm._groups) <= set(queued)  # queued ones may have finished already
    for rid in called:
        out = rec.groups[rid].to_output()
        assert out.finished and {c.finish_reason for c in out.outputs} <= {"abort", "stop", "length"}
    # ... the queued requests were not failed, and both they and a new generate() are exact
    _next_generate_is_exact(llm, prompts, refs)
    finals = run_to_completion(llm, rec)
    _assert_outputs_exact([finals[rid] for rid in queued], refs[CALL_ONLY:], "queued request")
    assert_pool_clean(llm)


# ------------------------------------------------------------------------------- KeyboardInterrupt
def _interrupt(n: int) -> BaseException:
    return KeyboardInterrupt(f"injected interrupt {n}")


@pytest.mark.parametrize("where", ["forward", "sampler"])
@pytest.mark.parametrize("api", ["generate", "stream"])
def test_keyboard_interrupt(model: torch.nn.Module, prompts: list[list[int]], refs: list[Any], where: str,
                            api: str) -> None:
    llm, rec = _llm(model)
    fault: Any = (FaultHook(model.model.layers[0], [4], _interrupt) if where == "forward"
                  else CallFault(Sampler, "__call__", [4], _interrupt))
    with fault, pytest.raises(KeyboardInterrupt, match="injected interrupt 4"):
        if api == "generate":
            llm.generate(prompts[:CALL_ONLY], GREEDY, use_tqdm=False)
        else:
            for _ in llm.stream(prompts[:CALL_ONLY], GREEDY):
                pass
    assert fault.raised == [4]
    _assert_consistent(llm)
    assert_pool_clean(llm)  # every request of the interrupted call was aborted, every block is back
    assert all(g.finished for g in rec.groups.values())
    assert any("abort" in {s.finish_reason for s in g.seqs} for g in rec.groups.values())
    _next_generate_is_exact(llm, prompts, refs)  # the lock was released; the engine is exact
    assert_pool_clean(llm)


# ------------------------------------------------------------------------------ failed allocation
def _no_blocks(n: int) -> BaseException:
    return NoFreeBlocksError(3, 0, what=f"injected allocation {n}")


def test_failed_allocation_in_generate(model: torch.nn.Module, prompts: list[list[int]], refs: list[Any]) -> None:
    llm, _ = _llm(model)
    queued = llm.add_request(prompts[CALL_ONLY], GREEDY)
    with CallFault(llm.kv.blocks, "append", [7], _no_blocks) as fault:
        with pytest.raises(NoFreeBlocksError, match=r"out of KV blocks: injected allocation 7 needs 3") as info:
            llm.generate(prompts[:CALL_ONLY], GREEDY, use_tqdm=False)
    assert fault.raised == [7] and (info.value.needed, info.value.free) == (3, 0)
    _assert_consistent(llm)
    assert list(llm._groups) == [queued]
    llm.abort(queued)  # an aborted request gives every block back ...
    assert [(o.request_id, o.finish_reason) for o in llm.step()] == [(queued, "abort")]  # ... and is reported once
    assert_pool_clean(llm)
    _next_generate_is_exact(llm, prompts, refs)
    assert_pool_clean(llm)


# ----------------------------------------------------------------- step(): faults at every stage
STAGES: dict[str, Callable[[LLM, torch.nn.Module, Callable[[int], BaseException]], Any]] = {
    # scheduling: the 2nd allocation of the step fails, after the 1st chunk got its slots
    "schedule": lambda llm, m, exc: CallFault(llm.kv.blocks, "append", [2], exc),
    "forward": lambda llm, m, exc: FaultHook(m.model.layers[1], [1], exc),
    # after the forward: no token sampled for anyone
    "sampler": lambda llm, m, exc: CallFault(Sampler, "__call__", [1], exc),
    # the 1st sequence got its token, the 2nd and later did not
    "append_token": lambda llm, m, exc: CallFault(llm, "_append_token", [2], exc),
    # forking the n samples of a request whose prompt just finished
    "fork": lambda llm, m, exc: CallFault(llm.kv, "fork", [2], exc),
}
EXCEPTIONS: dict[str, Callable[[int], BaseException]] = {
    "RuntimeError": lambda n: RuntimeError(f"injected step fault {n}"),
    "KeyboardInterrupt": lambda n: KeyboardInterrupt(f"injected step fault {n}"),
    "NoFreeBlocksError": lambda n: NoFreeBlocksError(2, 1, what=f"injected step fault {n}"),
}


@pytest.mark.parametrize("exc_name", sorted(EXCEPTIONS))
@pytest.mark.parametrize("stage", sorted(STAGES))
def test_fault_inside_step_with_requests_in_flight(model: torch.nn.Module, prompts: list[list[int]],
                                                   refs: list[Any], stage: str, exc_name: str) -> None:
    llm, rec = _llm(model)
    rids = [llm.add_request(p, GREEDY) for p in prompts[:4]]
    for _ in range(2):  # mid-run: some requests decoding, some still in prefill, some queued
        llm.step()
    # a request with 3 greedy samples: its prompt is computed once, then forked
    n3 = llm.add_request(prompts[4], SamplingParams(max_tokens=MAX_NEW, temperature=0.0, n=3))
    make_exc = EXCEPTIONS[exc_name]
    before: dict[str, int] = {}
    live: list[str] = []
    with STAGES[stage](llm, model, make_exc) as fault:
        with pytest.raises(type(make_exc(0)), match="injected step fault"):
            for _ in range(100):  # the fault fires in the first step that reaches it
                before = {rid: rec.num_output(rid) for rid in rec.groups}
                live = sorted(llm._groups)
                llm.step()
    assert len(fault.raised) == 1 and n3 in live
    _assert_consistent(llm)
    # nothing failed: every request live before the step still is, no output was lost or added twice
    assert sorted(llm._groups) == live
    for rid in live:
        assert not rec.groups[rid].finished
        assert rec.num_output(rid) - before[rid] in ((0, 1) if stage == "append_token" else (0,))
    assert len(rec.groups[n3].seqs) <= 3
    # the next step() retries; every request ends exact, the 3 samples each equal to the reference
    finals = run_to_completion(llm, rec)
    _assert_outputs_exact([finals[rid] for rid in rids], refs[:4], f"after a {stage} fault")
    assert len(finals[n3].outputs) == 3
    _assert_outputs_exact([finals[n3]], [refs[4]], f"n=3 after a {stage} fault")
    assert_pool_clean(llm)
    _next_generate_is_exact(llm, prompts, refs)


def test_abort_right_after_a_failed_step_frees_everything(model: torch.nn.Module, prompts: list[list[int]],
                                                         refs: list[Any]) -> None:
    llm, rec = _llm(model)
    rids = [llm.add_request(p, GREEDY) for p in prompts]
    llm.step()
    with CallFault(Sampler, "__call__", [1]), pytest.raises(RuntimeError, match="injected fault in __call__"):
        llm.step()
    for rid in rids[::2]:
        llm.abort(rid)
    _assert_consistent(llm)
    finals = run_to_completion(llm, rec)
    assert all(c.finish_reason == "abort" for rid in rids[::2] for c in finals[rid].outputs)
    _assert_outputs_exact([finals[rid] for rid in rids[1::2]], refs[1::2], "survivor")
    assert_pool_clean(llm)


def test_queued_request_finished_inside_generate_is_reported_by_step(model: torch.nn.Module,
                                                                    prompts: list[list[int]], refs: list[Any]) -> None:
    """A request queued with add_request() that finishes while generate() runs (here a generate()
    that then fails) is computed exactly and its final output comes back from the next step()."""
    llm, rec = _llm(model)
    queued = llm.add_request(prompts[CALL_ONLY], SamplingParams(max_tokens=2, temperature=0.0))
    with FaultHook(model.model.layers[1], lambda n: n == 8), pytest.raises(RuntimeError, match="on call 8"):
        llm.generate(prompts[:CALL_ONLY], GREEDY, use_tqdm=False)
    assert rec.groups[queued].finished, "the queued request should have finished before the fault"
    assert llm.has_unfinished_requests(), "its output is still to be reported"
    reported = llm.step()
    assert [o.request_id for o in reported] == [queued] and reported[0].finished
    _assert_exact(reported[0].outputs[0].token_ids, (refs[CALL_ONLY][0][:2], refs[CALL_ONLY][1]), "queued request")
    assert not llm.has_unfinished_requests() and llm.step() == []  # reported exactly once
    assert_pool_clean(llm)


# ------------------------------------------------------------------------- patched HF generate()
HF_LENGTHS = [5, 11, 8]


@pytest.fixture(scope="module")
def hf_batch(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A left-padded batch and the unpatched model's greedy continuation of it."""
    ids, mask = left_padded_batch(HF_LENGTHS, seed=3)
    flashpage.unpatch(model)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                         do_sample=False)
    return ids, mask, ref


def _hf_generate(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, **kw: Any) -> torch.Tensor:
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                          do_sample=False, **kw)


def _assert_cache_consistent(cache: HFPagedCache) -> None:
    """Block accounting sound; each row stores exactly its real (unpadded) committed tokens."""
    cache.kv.blocks.check_invariants()
    assert cache._real.shape[1] == cache.get_seq_length()
    for row, seq in enumerate(cache.rows):
        assert cache.kv.num_tokens(seq) == int(cache._real[row].sum())


@pytest.mark.parametrize("fail_on", [1, 4], ids=["prefill", "decode"])
@pytest.mark.parametrize("exc_name", ["RuntimeError", "KeyboardInterrupt"])
def test_hf_generate_fault_leaves_model_and_cache_usable(model: torch.nn.Module, hf_batch: Any, fail_on: int,
                                                         exc_name: str) -> None:
    ids, mask, ref = hf_batch
    make_exc = EXCEPTIONS[exc_name]
    flashpage.patch(model, block_size=4)
    try:
        for explicit in (False, True):
            cache = HFPagedCache(model.config, block_size=4, growable=False, num_blocks=64) if explicit else None
            kw = {"cache": cache} if explicit else {}
            with FaultHook(model.model.layers[1], [fail_on], make_exc):
                with pytest.raises(type(make_exc(0)), match=f"injected step fault {fail_on}"):
                    _hf_generate(model, ids, mask, **kw)
            if explicit:
                # the failed forward was not committed; what the earlier forwards stored is intact
                if exc_name == "KeyboardInterrupt":  # no forward hook runs on an interrupt: the next forward rolls back
                    assert cache.plan is not None
                    cache.end_forward(ok=False)
                _assert_cache_consistent(cache)
                committed = 0 if fail_on == 1 else ids.shape[1] + fail_on - 2
                assert cache.get_seq_length() == committed
                cache.reset()  # the explicit cache takes a new batch and is exact
                assert torch.equal(_hf_generate(model, ids, mask, cache=cache), ref)
                _assert_cache_consistent(cache)
                assert cache.memory_stats().blocks_in_use > 0
            # the model is still patched and exact, with a fresh default cache
            assert flashpage.is_patched(model)
            assert torch.equal(_hf_generate(model, ids, mask), ref)
    finally:
        flashpage.unpatch(model)
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(_hf_generate(model, ids, mask), ref)


def test_interrupted_hf_generate_leaves_no_stale_planning(model: torch.nn.Module, hf_batch: Any) -> None:
    """torch runs no always_call forward hook on a KeyboardInterrupt: what the patch recorded for the
    interrupted forward must not leak into the next forward, also one of the base model called directly."""
    ids, mask, _ = hf_batch
    flashpage.unpatch(model)
    with torch.inference_mode():
        want = model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    with flashpage.patched(model, block_size=4):
        with FaultHook(model.model.layers[1], [3], _interrupt), pytest.raises(KeyboardInterrupt):
            _hf_generate(model, ids, mask)
        with torch.inference_mode():
            plain = model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            cache = HFPagedCache(model.config, block_size=4)
            paged = model.model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True).last_hidden_state
        real = mask.bool()  # padded rows are not compared
        assert torch.allclose(plain[real], want[real], atol=1e-5), "dense forward used the interrupted call's plan"
        assert torch.allclose(paged[real], want[real], atol=1e-5)
        _assert_cache_consistent(cache)
        assert cache.get_seq_length() == ids.shape[1] and cache.plan is None


def test_hf_generate_fault_then_reuse_unreset_cache(model: torch.nn.Module, hf_batch: Any) -> None:
    """A cache whose first forward failed starts over with the next batch (no reset needed)."""
    ids, mask, ref = hf_batch
    with flashpage.patched(model, block_size=4):
        cache = HFPagedCache(model.config, block_size=4)
        with FaultHook(model.model.layers[0], [1]), pytest.raises(RuntimeError, match="injected fault on call 1"):
            _hf_generate(model, ids, mask, cache=cache)
        assert cache.rows == [] and cache.get_seq_length() == 0
        cache.kv.blocks.check_invariants()
        assert cache.kv.stats().in_use == 0
        assert torch.equal(_hf_generate(model, ids, mask, cache=cache), ref)
        _assert_cache_consistent(cache)
