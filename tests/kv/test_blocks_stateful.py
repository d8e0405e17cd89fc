"""Hypothesis state machine for flashpage.blocks.BlockManager.

The model simulates the physical KV pages: writing token ``t`` at position ``p`` of a sequence
stores the whole prefix ``tokens[:p + 1]`` in that slot (a KV entry depends on every earlier
token). Copy-on-write copies are applied the way an engine applies them (before the new
tokens' writes). After every rule each position of each sequence must read back its own
prefix: this checks prefix hits, copy-on-write, truncation and eviction together. A second
machine runs the same rules with a hash that collides all the time.
"""

from __future__ import annotations

from unittest import mock

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import flashpage.blocks as blocks_mod
from flashpage.blocks import BlockManager
from flashpage.errors import NoFreeBlocksError

TOKENS = st.lists(st.integers(0, 2), max_size=14)  # a small alphabet: prefixes collide often


class BlockMachine(RuleBasedStateMachine):
    hash_fn = None  # replaces flashpage.blocks._hash_block when set

    def __init__(self) -> None:
        super().__init__()
        self._patch = None
        if self.hash_fn is not None:
            self._patch = mock.patch.object(blocks_mod, "_hash_block", self.hash_fn)
            self._patch.start()
        self.m: BlockManager | None = None
        self.model: dict[int, list[int]] = {}  # seq -> every token (also those passed opaquely)
        self.known: dict[int, int] = {}  # seq -> how many leading tokens the manager was told
        self.pages: dict[int, tuple[int, ...]] = {}  # slot -> the prefix whose KV it holds
        self.next_id = 0

    def teardown(self) -> None:
        if self._patch is not None:
            self._patch.stop()

    @initialize(
        num_blocks=st.integers(3, 14),
        block_size=st.integers(1, 4),
        caching=st.sampled_from([True, True, True, False]),
    )
    def init(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.m = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)

    # ------------------------------------------------------------------ helpers
    def slot(self, seq: int, pos: int) -> int:
        bs = self.m.block_size
        return self.m.block_table(seq)[pos // bs] * bs + pos % bs

    def snapshot(self):
        m = self.m
        seqs = {s: (m.block_table(s), m.num_tokens(s), m.token_ids(s)) for s in m.sequences}
        return seqs, m.stats(), list(m._free), dict(m._table), list(m._copies)

    def do_append(self, seq: int, tokens: list[int], with_ids: bool) -> None:
        m = self.m
        n = len(tokens)
        needed = m.blocks_needed(seq, n)
        free_before = m.num_free_blocks
        assert m.can_append(seq, n) == (needed <= free_before)
        if needed > free_before:
            before = self.snapshot()
            with pytest.raises(NoFreeBlocksError) as ei:
                m.append(seq, n, tokens if with_ids else None)
            assert (ei.value.needed, ei.value.free) == (needed, free_before)
            assert self.snapshot() == before
            return
        start = m.num_tokens(seq)
        slots = m.append(seq, n, tokens if with_ids else None)
        assert len(slots) == n == len(set(slots))
        assert m.num_free_blocks == free_before - needed
        bs = m.block_size
        for src, dst in m.pop_copies():  # an engine copies the pages before writing new KV
            for off in range(bs):
                if src * bs + off in self.pages:
                    self.pages[dst * bs + off] = self.pages[src * bs + off]
        self.model[seq].extend(tokens)
        if with_ids and self.known[seq] == start:
            self.known[seq] += n
        for i, s in enumerate(slots):
            assert s == self.slot(seq, start + i)
            self.pages[s] = tuple(self.model[seq][: start + i + 1])

    # ------------------------------------------------------------------ rules
    @rule(prompt=TOKENS)
    def add(self, prompt: list[int]) -> None:
        """add_sequence with a prompt, then (when the pool allows) append the rest of it."""
        m, sid = self.m, self.next_id
        self.next_id += 1
        before = m.stats()
        covered = m.add_sequence(sid, prompt)
        bs = m.block_size
        assert covered % bs == 0 and covered <= max(len(prompt) - 1, 0)
        if not m.enable_prefix_caching:
            assert covered == 0
        after = m.stats()
        assert after.prefix_hits - before.prefix_hits == covered
        self.model[sid] = list(prompt[:covered])
        self.known[sid] = covered
        assert m.num_tokens(sid) == covered and m.token_ids(sid) == prompt[:covered]
        for pos in range(covered):  # each reused slot holds exactly this prompt's prefix
            assert self.pages.get(self.slot(sid, pos)) == tuple(prompt[: pos + 1])
        if m.can_append(sid, len(prompt) - covered):
            self.do_append(sid, list(prompt[covered:]), with_ids=True)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 2), max_size=6), with_ids=st.booleans())
    def append(self, data, tokens: list[int], with_ids: bool) -> None:
        seq = data.draw(st.sampled_from(sorted(self.model)))
        self.do_append(seq, tokens, with_ids)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), extra=st.integers(1, 8))
    def append_too_many(self, data, extra: int) -> None:
        """An append one block beyond the pool: must raise and change nothing."""
        seq = data.draw(st.sampled_from(sorted(self.model)))
        n = (self.m.num_free_blocks + 1) * self.m.block_size + extra
        self.do_append(seq, [0] * n, with_ids=data.draw(st.booleans()))

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fork(self, data) -> None:
        src = data.draw(st.sampled_from(sorted(self.model)))
        dst = self.next_id
        self.next_id += 1
        self.m.fork(src, dst)
        self.model[dst] = list(self.model[src])
        self.known[dst] = self.known[src]
        assert self.m.block_table(dst) == self.m.block_table(src)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data) -> None:
        seq = data.draw(st.sampled_from(sorted(self.model)))
        self.m.free(seq)
        del self.model[seq], self.known[seq]
        assert not self.m.has_sequence(seq)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def truncate(self, data) -> None:
        seq = data.draw(st.sampled_from(sorted(self.model)))
        k = data.draw(st.integers(0, len(self.model[seq])))
        self.m.truncate(seq, k)
        del self.model[seq][k:]
        self.known[seq] = min(self.known[seq], k)

    @rule()
    def free_all(self) -> None:
        for seq in list(self.model):
            self.m.free(seq)
        self.model.clear()
        self.known.clear()
        st_ = self.m.stats()
        assert st_.in_use == 0 and st_.free + st_.cached == st_.num_blocks
        assert self.m.num_free_blocks == self.m.num_blocks

    # ------------------------------------------------------------------ invariants
    @invariant()
    def consistent(self) -> None:
        m = self.m
        if m is None:
            return
        m.check_invariants()
        assert sorted(m.sequences) == sorted(self.model)
        bs = m.block_size
        for seq, tokens in self.model.items():
            assert m.num_tokens(seq) == len(tokens)
            assert len(m.block_table(seq)) == -(-len(tokens) // bs)
            known = self.known[seq]
            assert m.token_ids(seq) == (tokens if known == len(tokens) else None)
            for pos in range(len(tokens)):
                assert self.pages.get(self.slot(seq, pos)) == tuple(tokens[: pos + 1]), (seq, pos)
        st_ = m.stats()
        assert st_.free + st_.cached + st_.in_use == st_.num_blocks
        assert st_.num_sequences == len(self.model)
        if not self.model:
            assert st_.in_use == 0


class CollidingBlockMachine(BlockMachine):
    """Keys ignore the parent and all but one token: most lookups hit a wrong candidate."""

    hash_fn = staticmethod(lambda parent, tokens: tokens[-1] % 2)


SETTINGS = settings(
    max_examples=200, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestBlockMachine = BlockMachine.TestCase
TestBlockMachine.settings = SETTINGS
TestCollidingBlockMachine = CollidingBlockMachine.TestCase
TestCollidingBlockMachine.settings = settings(SETTINGS, max_examples=100)
