"""Scheduler: which sequences compute how many tokens in the next step, and their KV slots.

Under a token budget (``max_num_batched_tokens``): running decodes first, then running prefills
(long prompts are chunked across steps), then waiting sequences in arrival order while
``max_num_seqs`` and the KV pool allow. Slots are allocated as each chunk is scheduled, so a
request admitted after another one in the same step already finds that one's full prompt blocks
in the prefix cache (their K/V are written earlier in the same forward, layer by layer, before
attention reads them). When the pool cannot hold a running sequence's next tokens, the newest
running sequence not yet scheduled is preempted by recompute: its blocks are freed (full ones
stay hashed, so resuming mostly hits the prefix cache) and it goes back to the front of the
queue with its output so far intact.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from flashpage.cache import PagedKVCache
from flashpage.engine import prompt_logprobs
from flashpage.engine.sequence import Seq, SeqStatus


@dataclass
class Chunk:
    """``num_tokens`` tokens of ``seq`` starting at ``start``, computed this step into ``slots``.

    A verification chunk (speculative decoding, ``engine/spec.py``) ends with ``draft``: proposed tokens that
    are not (yet) the sequence's; its last ``1 + len(draft)`` rows all emit logits."""

    seq: Seq
    start: int
    num_tokens: int
    slots: list[int]
    admitted: bool = False  # the sequence entered the running set in this step
    draft: list[int] = field(default_factory=list)  # proposed tokens computed after the sequence's own

    @property
    def emits(self) -> bool:
        """This chunk reaches the end of the sequence: its last logits give the next token."""
        return self.start + self.num_tokens - len(self.draft) == len(self.seq.token_ids)

    @property
    def num_emitting_rows(self) -> int:
        """Logits rows this chunk yields: 1 + len(draft) when it emits, else 0."""
        return 1 + len(self.draft) if self.emits else 0

    @property
    def token_ids(self) -> list[int]:
        if self.draft:
            return self.seq.token_ids[self.start:] + self.draft
        return self.seq.token_ids[self.start:self.start + self.num_tokens]


@dataclass
class Schedule:
    chunks: list[Chunk] = field(default_factory=list)
    preempted: list[Seq] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    """Admission, chunking, slot allocation and preemption over one :class:`PagedKVCache`."""

    def __init__(self, kv: PagedKVCache, max_num_seqs: int, max_num_batched_tokens: int,
                 max_prefill_with_decodes: int | None = None, generate_layout: bool = False) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # prompt tokens a step may add while it also decodes. Default: the whole budget, as vLLM's V1
        # scheduler (its long_prefill_token_threshold is 0 by default); a lower cap bounds what prefill adds
        # to every running request's time per output token, at the cost of more, smaller steps
        self.max_prefill_with_decodes = max_prefill_with_decodes or max_num_batched_tokens
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.num_preemptions = 0
        # chunks cut as generate() computes tokens: a whole prompt, then one token at a time (engine/solo.py)
        self.generate_layout = generate_layout

    # ----------------------------------------------------------------- queues
    def add(self, seq: Seq) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def add_running_after(self, parent: Seq, child: Seq) -> None:
        """Insert a forked sample right after its parent (it already has the parent's blocks)."""
        child.status = SeqStatus.RUNNING
        self.running.insert(self.running.index(parent) + 1, child)

    def remove(self, seq: Seq) -> None:
        """Take a sequence out of the queues and free its blocks (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def rollback(self, schedule: Schedule) -> None:
        """Undo a step whose forward failed: its slots are given back and the blocks it should have
        filled leave the prefix cache. Sequences admitted in the step go back to the front of the
        queue (their prefix hits may have been blocks of this very step); running ones keep their
        place, with their cache as before the step."""
        for chunk in reversed(schedule.chunks):
            seq = chunk.seq
            if seq.in_cache:
                self.kv.truncate(seq.seq_id, chunk.start, invalidate=True)
        for chunk in reversed(schedule.chunks):
            seq = chunk.seq
            if chunk.admitted and seq.status is SeqStatus.RUNNING:
                self.running.remove(seq)
                self._release(seq)
                seq.num_computed = 0
                seq.status = SeqStatus.WAITING
                self.waiting.appendleft(seq)

    # --------------------------------------------------------------- schedule
    def schedule(self, proposals: Mapping[int, list[int]] | None = None) -> Schedule:
        """The next step. ``proposals`` (seq_id -> proposed tokens, speculative decoding) are appended to those
        sequences' decode chunks where the budget and the pool allow without preempting anyone."""
        out = Schedule()
        try:
            self._schedule(out, proposals or {})
        except BaseException:
            # an allocation failed (or an interrupt arrived) halfway: give back this step's slots, and
            # the prefix hits of an admission cut short, so the queues and the cache agree again
            self.rollback(out)
            for seq in self.waiting:
                if seq.in_cache:
                    self._release(seq)
                    seq.num_computed = 0
            raise
        return out

    def _schedule(self, out: Schedule, proposals: Mapping[int, list[int]]) -> None:
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()
        decodes = [s for s in self.running if s.remaining == 1]
        prefills = [s for s in self.running if s.remaining > 1]
        for i, seq in enumerate(decodes + prefills):
            if seq.status is not SeqStatus.RUNNING or budget <= 0:
                continue
            if seq.remaining > 1 and decodes and out.chunks:  # prefill after decodes: keep the step short
                budget = min(budget, self.max_prefill_with_decodes - self._prefill_tokens(out))
                if budget <= 0:
                    break
            n = self._chunk_tokens(seq, budget)
            if not n:
                continue
            draft = self._draft(seq, proposals.get(seq.seq_id), budget, len(decodes) - i - 1)
            if not self._make_room(seq, n, scheduled, out):
                continue
            out.chunks.append(self._allocate(seq, n, draft=draft))
            scheduled.add(seq.seq_id)
            budget -= n + len(draft)
        if not out.preempted:
            if any(c.num_tokens - len(c.draft) == 1 for c in out.chunks):
                budget = min(budget, self.max_prefill_with_decodes - self._prefill_tokens(out))
            self._admit(out, budget)

    @staticmethod
    def _prefill_tokens(out: Schedule) -> int:
        return sum(c.num_tokens for c in out.chunks if c.num_tokens - len(c.draft) > 1)

    def _draft(self, seq: Seq, proposal: list[int] | None, budget: int, decodes_after: int) -> list[int]:
        """The part of ``proposal`` a decode of ``seq`` carries: within the budget left after one token for
        each decode still to schedule, and within the free blocks left after one for each of them (a
        proposal never makes anyone wait or be preempted)."""
        if not proposal or seq.remaining != 1 or self.generate_layout:
            return []
        draft = list(proposal[:max(0, budget - 1 - decodes_after)])
        while draft and self.kv.blocks.blocks_needed(seq.seq_id, 1 + len(draft)) + decodes_after \
                > self.kv.blocks.num_free_blocks:
            draft.pop()
        return draft

    def _allocate(self, seq: Seq, n: int, admitted: bool = False, draft: list[int] | None = None) -> Chunk:
        """Slots for ``n`` of ``seq``'s tokens from ``num_computed`` (and its proposed tokens ``draft`` after
        them: their full blocks are keyed for the prefix cache now and unkeyed if they are rejected)."""
        start = seq.num_computed
        draft = draft or []
        slots = self.kv.blocks.append(seq.seq_id, n + len(draft), seq.cache_keys(start, start + n, draft))
        return Chunk(seq, start, n + len(draft), slots, admitted, draft)

    def _fits(self, seq: Seq, n: int) -> bool:
        return self.kv.blocks.blocks_needed(seq.seq_id, n) <= self.kv.blocks.num_free_blocks

    def _make_room(self, seq: Seq, n: int, scheduled: set[int], out: Schedule) -> bool:
        """Preempt newest running sequences until ``seq``'s chunk fits; False if ``seq`` itself went."""
        while not self._fits(seq, n):
            victim = next((s for s in reversed(self.running) if s.seq_id not in scheduled), None)
            if victim is None:
                raise RuntimeError("scheduler: KV pool too small for the scheduled sequences alone")
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Seq, out: Schedule) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        seq.group.metrics.preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)
        self.waiting.appendleft(seq)

    def _admit(self, out: Schedule, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.in_cache:
                # a request still owed prompt logprobs computes its whole prompt: no prefix hits
                cached = self.kv.add_sequence(seq.seq_id,
                                              None if prompt_logprobs.pending(seq)
                                              else seq.cache_keys(0, len(seq.token_ids)))
                seq.in_cache = True
                seq.num_computed = cached
                if seq.num_output == 0:
                    seq.group.metrics.cached_prompt_tokens = cached
            n = self._chunk_tokens(seq, budget)
            if not n or not self._fits(seq, n):
                self._release(seq)  # give back its prefix hits; it stays first in line
                seq.num_computed = 0
                break
            chunk = self._allocate(seq, n, admitted=True)  # may raise: then the sequence is still first in line
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.chunks.append(chunk)
            budget -= n

    def _chunk_tokens(self, seq: Seq, budget: int) -> int:
        """Tokens of ``seq`` this step computes within ``budget`` (0: none this step). With ``generate_layout``
        as generate() computes them: the whole prompt from the first token (or nothing this step), then one
        token per chunk (a preempted sequence recomputes its outputs one at a time)."""
        if self.generate_layout:
            n = seq.num_prompt if seq.num_computed == 0 else 1
            return n if n <= budget else 0
        return _whole_spans(seq, min(seq.remaining, budget))

    def _release(self, seq: Seq) -> None:
        if seq.in_cache:
            self.kv.free(seq.seq_id)
            seq.in_cache = False


def _whole_spans(seq: Seq, n: int) -> int:
    """``n`` tokens of ``seq`` from ``num_computed``, cut so no chunk ends inside a span of prompt tokens that attend
    both ways (Gemma 3 images: engine/multimodal.py TwoWay); 0: none this step."""
    two_way = getattr(getattr(seq.group, "mm", None), "two_way", None)
    return n if two_way is None else two_way.cut(seq.num_computed, n)
