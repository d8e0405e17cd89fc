"""The scheduler alone (no model): admission order, the token budget and chunked prefill, the
prefill cap beside decodes, ``max_num_seqs``, preemption of the newest running sequence, prefix hits
at admission, and rollback of a failed step. A step is simulated: each chunk's tokens count as
computed, and an emitting chunk appends one sampled token."""

from __future__ import annotations

import itertools

from flashpage.cache import PagedKVCache
from flashpage.engine.outputs import RequestMetrics
from flashpage.engine.params import SamplingParams
from flashpage.engine.scheduler import Schedule, Scheduler
from flashpage.engine.sequence import Group, Seq, SeqStatus

BLOCK = 4
_rid = itertools.count()


def _scheduler(num_blocks: int = 32, max_num_seqs: int = 8, budget: int = 64, prefix: bool = True,
               max_prefill_with_decodes: int | None = None) -> Scheduler:
    kv = PagedKVCache(1, 1, 4, num_blocks=num_blocks, block_size=BLOCK, enable_prefix_caching=prefix)
    return Scheduler(kv, max_num_seqs, budget, max_prefill_with_decodes)


def _seq(sched: Scheduler, prompt: list[int]) -> Seq:
    group = Group(f"r{next(_rid)}", None, list(prompt), SamplingParams(max_tokens=100), RequestMetrics(0.0))
    seq = group.new_seq(0, prompt)
    sched.add(seq)
    return seq


def _run(sched: Scheduler, schedule: Schedule, token: int = 7) -> None:
    """What the engine does after the forward: advance each chunk, append a token where it emits."""
    for chunk in schedule.chunks:
        chunk.seq.num_computed += chunk.num_tokens
        if chunk.emits:
            chunk.seq.token_ids.append(token)


def _sizes(schedule: Schedule) -> list[tuple[int, int]]:
    return [(c.seq.seq_id, c.num_tokens) for c in schedule.chunks]


def test_waiting_sequences_are_admitted_in_arrival_order_within_the_budget() -> None:
    sched = _scheduler(budget=20)
    a, b, c = (_seq(sched, list(range(100 * i, 100 * i + 8))) for i in range(1, 4))
    step = sched.schedule()
    # a and b whole (8 + 8), c chunked to the 4 tokens left
    assert _sizes(step) == [(a.seq_id, 8), (b.seq_id, 8), (c.seq_id, 4)]
    assert all(ch.admitted for ch in step.chunks)
    assert [ch.emits for ch in step.chunks] == [True, True, False]
    _run(sched, step)
    step = sched.schedule()
    # decodes first, then the rest of c's prompt
    assert _sizes(step) == [(a.seq_id, 1), (b.seq_id, 1), (c.seq_id, 4)]
    assert step.chunks[2].start == 4 and step.chunks[2].emits


def test_max_num_seqs_bounds_the_running_set() -> None:
    sched = _scheduler(max_num_seqs=2)
    seqs = [_seq(sched, [1 + i, 2, 3]) for i in range(3)]
    step = sched.schedule()
    assert [ch.seq for ch in step.chunks] == seqs[:2]
    assert list(sched.waiting) == [seqs[2]] and seqs[2].status is SeqStatus.WAITING
    _run(sched, step)
    sched.remove(seqs[0])
    step = sched.schedule()
    assert [ch.seq for ch in step.chunks] == [seqs[1], seqs[2]]


def test_prefill_beside_decodes_is_capped() -> None:
    sched = _scheduler(budget=64, max_prefill_with_decodes=6)
    a = _seq(sched, [1, 2, 3])
    _run(sched, sched.schedule())
    b = _seq(sched, list(range(10, 30)))
    step = sched.schedule()
    assert _sizes(step) == [(a.seq_id, 1), (b.seq_id, 6)]


def test_admission_takes_prefix_hits_of_full_blocks() -> None:
    sched = _scheduler()
    prompt = list(range(1, 11))  # two full blocks and 2 tokens
    a = _seq(sched, prompt)
    _run(sched, sched.schedule())
    b = _seq(sched, prompt[:8] + [50, 51, 52])
    step = sched.schedule()
    chunk = next(ch for ch in step.chunks if ch.seq is b)
    assert (chunk.start, chunk.num_tokens) == (8, 3)
    assert b.group.metrics.cached_prompt_tokens == 8
    assert a.num_computed == 10


def test_the_newest_running_sequence_is_preempted_when_the_pool_is_full() -> None:
    sched = _scheduler(num_blocks=4, budget=64)  # 16 slots
    a = _seq(sched, [1, 2, 3, 4, 5, 6, 7])
    b = _seq(sched, [11, 12, 13, 14, 15, 16, 17])
    _run(sched, sched.schedule())  # 2 blocks each; both decode into block 2's last slot
    _run(sched, sched.schedule())  # 8 tokens each: the next decode needs a new block for each
    assert a.num_computed == b.num_computed == 8
    step = sched.schedule()
    assert step.preempted == [b] and b.status is SeqStatus.WAITING and b.num_computed == 0
    assert _sizes(step) == [(a.seq_id, 1)]
    assert b.group.metrics.preemptions == 1 and sched.num_preemptions == 1
    assert list(sched.waiting) == [b]
    assert b.token_ids[-2:] == [7, 7]  # its output so far is kept for the recompute


def test_a_sequence_outgrowing_the_pool_alone_preempts_itself_and_waits_first() -> None:
    """The engine ends a request at the pool's capacity before this (finish_reason 'length'); the
    scheduler alone neither loops nor loses the sequence: it is preempted and waits first in line."""
    sched = _scheduler(num_blocks=2, budget=64)
    a = _seq(sched, list(range(1, 9)))  # exactly the pool
    b = _seq(sched, [20, 21])
    _run(sched, sched.schedule())  # a's 8 tokens fill the pool; b does not fit and waits
    assert sched.running == [a] and list(sched.waiting) == [b]
    step = sched.schedule()
    assert step.preempted == [a] and step.chunks == []
    assert list(sched.waiting) == [a, b] and not a.in_cache and a.num_computed == 0  # first come, first served
    assert sched.kv.blocks.num_free_blocks == 2


def test_rollback_gives_back_the_step_and_requeues_admissions_first() -> None:
    sched = _scheduler(num_blocks=8)
    a = _seq(sched, [1, 2, 3])
    _run(sched, sched.schedule())
    free_before = sched.kv.blocks.num_free_blocks
    b = _seq(sched, [4, 5, 6, 7, 8])
    c = _seq(sched, [9, 10])
    step = sched.schedule()
    assert [ch.seq for ch in step.chunks] == [a, b, c]
    sched.rollback(step)
    assert sched.kv.blocks.num_free_blocks == free_before
    assert list(sched.waiting) == [b, c] and sched.running == [a]
    assert a.num_computed == 3 and b.num_computed == 0 and not b.in_cache
    # the step again, as if nothing happened
    step = sched.schedule()
    assert [(ch.seq, ch.start, ch.num_tokens) for ch in step.chunks] == [(a, 3, 1), (b, 0, 5), (c, 0, 2)]


def test_removing_a_sequence_frees_its_blocks() -> None:
    sched = _scheduler(num_blocks=8, prefix=False)
    a = _seq(sched, list(range(1, 10)))
    _run(sched, sched.schedule())
    assert sched.kv.blocks.num_free_blocks == 8 - 3
    sched.remove(a)
    assert sched.kv.blocks.num_free_blocks == 8 and not sched.has_work()
