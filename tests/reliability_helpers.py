"""Shared helpers for the reliability suites (tests/engine/test_soak.py, test_faults.py, test_bad_input.py).

- :class:`FaultHook` / :class:`HoldHook`: forward pre-hooks that raise (any exception, also
  ``KeyboardInterrupt``) or block (on a ``threading.Event``) on chosen calls of a module;
- :class:`CallFault`: the same for any method of an object or class (the sampler, the block
  manager's ``append``, ...), calling through otherwise;
- :class:`GroupRecorder`: remembers every request group an :class:`~flashpage.LLM` enqueues, so a
  test can read a request's final output even when no public API handed it back;
- :func:`kv_state` / :func:`assert_pool_clean` / :func:`assert_cache_matches_computed`: block
  accounting snapshots and the checks made after a fault;
- :func:`run_to_completion`: step an LLM until nothing is left, returning every final output;
- :func:`check_greedy`: tie-aware comparison of a greedy output with a reference output, the
  tie gap taken from the model's own logits (EOS and stop ids masked under ``min_tokens``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from flashpage import LLM, SamplingParams
from flashpage.engine.sequence import Group
from flashpage.testing import GreedyMatch, top2_gap

TIE_TOL = 1e-4  # a near-tie: different batch layouts round differently, so greedy may flip there


# --------------------------------------------------------------------------------------- hooks
class FaultHook:
    """Forward pre-hook on ``module`` raising ``make_exc(call_number)`` on the chosen calls.

    Args:
        module: e.g. ``model.model.layers[1]`` (one call per forward of the model).
        fail_on: 1-based call numbers to fail, or a predicate on the call number.
        make_exc: builds the exception to raise (default: ``RuntimeError("injected fault ...")``).

    Use as a context manager; the hook is always removed on exit.
    """

    def __init__(self, module: torch.nn.Module, fail_on: Iterable[int] | Callable[[int], bool],
                 make_exc: Callable[[int], BaseException] | None = None) -> None:
        self.module = module
        self._fail_on = fail_on if callable(fail_on) else set(fail_on).__contains__
        self._make_exc = make_exc or (lambda n: RuntimeError(f"injected fault on call {n}"))
        self.calls = 0
        self.raised: list[int] = []
        self._handle: Any = None

    def _hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        self.calls += 1
        if self._fail_on(self.calls):
            self.raised.append(self.calls)
            raise self._make_exc(self.calls)

    def __enter__(self) -> FaultHook:
        self._handle = self.module.register_forward_pre_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.remove()


class HoldHook:
    """Forward pre-hook that, on its first call, sets ``entered`` and waits for ``release``."""

    def __init__(self, module: torch.nn.Module, timeout: float = 60.0) -> None:
        self.module = module
        self.entered = threading.Event()
        self.release = threading.Event()
        self.timeout = timeout
        self._done = False
        self._handle: Any = None

    def _hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self._done:
            return
        self._done = True
        self.entered.set()
        if not self.release.wait(self.timeout):
            raise TimeoutError("HoldHook was never released")

    def __enter__(self) -> HoldHook:
        self._handle = self.module.register_forward_pre_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self._handle.remove()


class CallFault:
    """Replace ``owner.name`` (a method of an instance, or of a class) by a wrapper that raises
    ``make_exc(call_number)`` on the chosen calls and calls the original otherwise.

    Args:
        owner: an object (the wrapper shadows the method on this instance only) or a class
            (every instance is affected, also for dunder methods such as ``__call__``).
        name: the attribute to wrap.
        fail_on: 1-based call numbers to fail, or a predicate on the call number.
        make_exc: builds the exception (default: ``RuntimeError("injected fault in NAME ...")``).

    Use as a context manager; the original is always restored on exit.
    """

    def __init__(self, owner: Any, name: str, fail_on: Iterable[int] | Callable[[int], bool],
                 make_exc: Callable[[int], BaseException] | None = None) -> None:
        self.owner = owner
        self.name = name
        self._fail_on = fail_on if callable(fail_on) else set(fail_on).__contains__
        self._make_exc = make_exc or (lambda n: RuntimeError(f"injected fault in {name} on call {n}"))
        self.calls = 0
        self.raised: list[int] = []
        self._saved: Any = None
        self._had_own = False

    def __enter__(self) -> CallFault:
        own = vars(self.owner)
        self._had_own = self.name in own
        self._saved = own.get(self.name)
        original = getattr(self.owner, self.name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self._fail_on(self.calls):
                self.raised.append(self.calls)
                raise self._make_exc(self.calls)
            return original(*args, **kwargs)

        setattr(self.owner, self.name, wrapper)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._had_own:
            setattr(self.owner, self.name, self._saved)
        else:
            delattr(self.owner, self.name)


# ------------------------------------------------------------------------------------ recorder
class GroupRecorder:
    """Records every :class:`Group` ``llm`` enqueues (add_request, generate and stream alike)."""

    def __init__(self, llm: LLM) -> None:
        self.groups: dict[str, Group] = {}
        original = llm._enqueue

        def enqueue(group: Group) -> None:
            self.groups[group.request_id] = group
            original(group)

        llm._enqueue = enqueue  # instance attribute: only this LLM is affected

    def num_output(self, request_id: str) -> int:
        return sum(s.num_output for s in self.groups[request_id].seqs)


def run_to_completion(llm: LLM, recorder: GroupRecorder, max_steps: int = 2000) -> dict[str, Any]:
    """Step ``llm`` until no request is left; the final output of every request ``recorder`` saw
    (also those finished inside a generate() or stream() call, which step() never reports)."""
    for _ in range(max_steps):
        if not llm.has_unfinished_requests():
            break
        llm.step()
    assert not llm.has_unfinished_requests(), f"requests still unfinished after {max_steps} steps"
    return {rid: g.to_output() for rid, g in recorder.groups.items()}


# ------------------------------------------------------------------------------ block accounting
@dataclass(frozen=True)
class KVState:
    """What the pool looks like: counts and each sequence's length."""

    in_use: int
    free: int
    cached: int
    num_sequences: int
    lengths: dict[Any, int] = field(default_factory=dict)


def kv_state(kv: Any) -> KVState:
    """Snapshot of a :class:`~flashpage.PagedKVCache` (or its BlockManager)."""
    blocks = getattr(kv, "blocks", kv)
    s = blocks.stats()
    return KVState(s.in_use, s.free, s.cached, s.num_sequences,
                   {sid: blocks.num_tokens(sid) for sid in blocks.sequences})


def assert_pool_clean(llm: LLM) -> None:
    """Nothing queued, no block held, the accounting consistent."""
    llm.kv.blocks.check_invariants()
    st = llm.stats()
    assert not llm.has_unfinished_requests(), f"requests left: running={st.running} waiting={st.waiting}"
    assert not llm._groups, f"groups left behind: {sorted(llm._groups)}"
    assert st.blocks_used == 0, f"{st.blocks_used} blocks still in use"
    assert st.blocks_free + st.blocks_cached == st.blocks_total
    assert llm.kv.stats().num_sequences == 0, "sequences left in the cache"


def assert_cache_matches_computed(llm: LLM) -> None:
    """Every sequence in the cache holds exactly the tokens the engine believes are computed."""
    seqs = list(llm.scheduler.running) + list(llm.scheduler.waiting)
    for seq in seqs:
        if seq.in_cache:
            have = llm.kv.num_tokens(seq.seq_id)
            assert have == seq.num_computed, (
                f"sequence {seq.seq_id} of request {seq.group.request_id}: the cache holds {have} tokens "
                f"but the engine computed {seq.num_computed}")
    held = {s.seq_id for s in seqs if s.in_cache}
    assert set(llm.kv.blocks.sequences) == held, "the cache holds sequences the engine does not know"


# ------------------------------------------------------------------------------------- greedy
def _banned(params: SamplingParams, eos_ids: Iterable[int], position: int) -> list[int]:
    if position >= params.min_tokens:
        return []
    return sorted(set(params.stop_ids) | (set() if params.ignore_eos else set(eos_ids)))


@torch.inference_mode()
def greedy_gap(model: torch.nn.Module, prompt: Sequence[int], prefix: Sequence[int], banned: Sequence[int]) -> float:
    """Top-1 minus top-2 of the model's next-token logits after ``prompt + prefix`` (banned masked)."""
    ids = torch.tensor([list(prompt) + list(prefix)])
    logits = model(input_ids=ids, use_cache=False).logits[0, -1].float()
    if banned:
        logits[list(banned)] = float("-inf")
    return top2_gap(logits)


def check_greedy(model: torch.nn.Module, prompt: Sequence[int], params: SamplingParams, eos_ids: Iterable[int],
                 reference: Sequence[int], got: Sequence[int], tol: float = TIE_TOL) -> GreedyMatch:
    """``got`` equals ``reference``, or first differs where the reference's choice was a near-tie."""
    n = min(len(reference), len(got))
    for i in range(n):
        if reference[i] != got[i]:
            gap = greedy_gap(model, prompt, reference[:i], _banned(params, eos_ids, i))
            return GreedyMatch(gap <= tol, False, i, gap)
    if len(reference) != len(got):
        return GreedyMatch(False, False, n, float("nan"))
    return GreedyMatch(True, True)


# -------------------------------------------------------------------------------------- misc
def logprob_values(output: Any) -> list[float]:
    """The chosen tokens' log-probabilities of one CompletionOutput / RequestOutput."""
    return [lp.logprob for lp in (output.logprobs or [])]


def assert_logprobs_close(got: Any, want: Any, tol: float = 1e-3) -> None:
    a, b = logprob_values(got), logprob_values(want)
    assert len(a) == len(b), f"{len(a)} logprobs vs {len(b)}"
    worst = max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)
    assert worst <= tol, f"log-probabilities differ by up to {worst:.3g}:\n got={a}\nwant={b}"
