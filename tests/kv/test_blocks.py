"""Unit tests for flashpage.blocks.BlockManager (pure Python, CPU, milliseconds)."""

from __future__ import annotations

import pytest

import flashpage.blocks as blocks_mod
from flashpage.blocks import BlockManager, BlockStats
from flashpage.errors import InvariantError, NoFreeBlocksError, UnknownSequenceError


def make(num_blocks: int = 8, block_size: int = 4, **kw) -> BlockManager:
    return BlockManager(num_blocks, block_size, **kw)


def add_prompt(m: BlockManager, sid, prompt: list[int]) -> int:
    """What an engine does: look up the prefix, then append the rest of the prompt."""
    covered = m.add_sequence(sid, prompt)
    m.append(sid, len(prompt) - covered, prompt[covered:])
    m.check_invariants()
    return covered


def snapshot(m: BlockManager):
    seqs = {s: (m.block_table(s), m.num_tokens(s), m.token_ids(s)) for s in m.sequences}
    return seqs, m.stats(), list(m._free), dict(m._table), list(m._copies)


# ---------------------------------------------------------------- construction and errors
@pytest.mark.parametrize("nb,bs", [(0, 4), (-1, 4), (4, 0), (4, -2), (4.0, 4), (True, 4)])
def test_bad_constructor_args(nb, bs):
    with pytest.raises(ValueError, match="must be an int >= 1"):
        BlockManager(nb, bs)


def test_empty_pool_state():
    m = make(5, 3)
    assert (m.num_blocks, m.block_size, m.enable_prefix_caching) == (5, 3, True)
    assert m.num_free_blocks == 5 and m.sequences == []
    assert m.stats() == BlockStats(5, 3, 5, 0, 0, 0, 0, 0, 0.0, 0, 0)
    m.check_invariants()


def test_unknown_sequence_errors():
    m = make()
    for call in (
        lambda: m.append("x", 1),
        lambda: m.free("x"),
        lambda: m.block_table("x"),
        lambda: m.num_tokens("x"),
        lambda: m.token_ids("x"),
        lambda: m.truncate("x", 0),
        lambda: m.blocks_needed("x", 1),
        lambda: m.fork("x", "y"),
    ):
        with pytest.raises(UnknownSequenceError, match="'x'.*never added or was already freed"):
            call()
    assert not m.has_sequence("x")


def test_double_free_message_and_keyerror():
    m = make()
    m.add_sequence(7)
    m.append(7, 3)
    m.free(7)
    with pytest.raises(KeyError) as ei:  # UnknownSequenceError is a KeyError
        m.free(7)
    assert isinstance(ei.value, UnknownSequenceError)
    assert "7" in str(ei.value) and "already freed" in str(ei.value)


def test_duplicate_add_and_fork_target():
    m = make()
    m.add_sequence("a")
    with pytest.raises(ValueError, match="'a' already exists"):
        m.add_sequence("a", [1, 2])
    m.add_sequence("b")
    with pytest.raises(ValueError, match="'b'"):
        m.fork("a", "b")


def test_bad_counts():
    m = make()
    m.add_sequence(0)
    with pytest.raises(ValueError, match=">= 0"):
        m.append(0, -1)
    with pytest.raises(ValueError, match=">= 0"):
        m.blocks_needed(0, -1)
    with pytest.raises(ValueError, match="token_ids has 2"):
        m.append(0, 3, [1, 2])
    m.append(0, 2)
    for k in (-1, 3):
        with pytest.raises(ValueError, match="0 <= num_tokens <= 2"):
            m.truncate(0, k)
    m.check_invariants()


# ---------------------------------------------------------------- allocation and slots
def test_append_slots_and_head_first_allocation():
    m = make(8, 4)
    assert m.add_sequence(0) == 0
    assert m.append(0, 0) == []
    assert m.block_table(0) == []
    assert m.append(0, 6, list(range(6))) == [0, 1, 2, 3, 4, 5]
    assert m.block_table(0) == [0, 1]
    assert m.append(0, 3, [6, 7, 8]) == [6, 7, 8]
    assert m.block_table(0) == [0, 1, 2]
    m.add_sequence(1)
    assert m.append(1, 1) == [12]
    assert m.num_tokens(0) == 9 and m.token_ids(0) == list(range(9))
    assert m.num_free_blocks == 4
    st = m.stats()
    assert (st.free, st.cached, st.in_use, st.num_sequences) == (4, 0, 4, 2)
    m.check_invariants()


def test_no_free_blocks_changes_nothing():
    m = make(3, 2)
    m.add_sequence("a")
    m.append("a", 3, [1, 2, 3])
    m.add_sequence("b")
    before = snapshot(m)
    assert m.blocks_needed("b", 3) == 2 and not m.can_append("b", 3)
    with pytest.raises(NoFreeBlocksError) as ei:
        m.append("b", 3, [4, 5, 6])
    assert (ei.value.needed, ei.value.free) == (2, 1)
    assert "'b'" in str(ei.value)
    assert snapshot(m) == before
    assert m.can_append("b", 2) and m.can_append("a", 3)
    m.check_invariants()


def test_no_free_blocks_counts_cow():
    m = make(3, 2)
    m.add_sequence("a")
    m.append("a", 3)  # blocks 0, 1 (partial)
    m.fork("a", "b")
    m.add_sequence("c")
    m.append("c", 2)  # takes the last block
    before = snapshot(m)
    assert m.blocks_needed("b", 1) == 1  # only the copy-on-write block
    with pytest.raises(NoFreeBlocksError):
        m.append("b", 1)
    assert snapshot(m) == before


# ---------------------------------------------------------------- prefix caching
def test_prefix_hit_leaves_at_least_one_token():
    m = make(16, 4)
    prompt = list(range(8))  # exactly two full blocks
    assert add_prompt(m, "a", prompt) == 0
    assert add_prompt(m, "b", prompt) == 4  # never the whole prompt
    assert m.block_table("b")[0] == m.block_table("a")[0]
    assert m.block_table("b")[1] != m.block_table("a")[1]
    assert add_prompt(m, "c", prompt + [8]) == 8  # 9 tokens: both full blocks reusable
    assert m.block_table("c")[:2] == m.block_table("a")
    assert add_prompt(m, "d", prompt[:1]) == 0
    assert m.add_sequence("e", []) == 0
    st = m.stats()
    assert (st.prefix_queries, st.prefix_hits) == (8 + 8 + 9 + 1, 12)
    assert st.hit_rate == pytest.approx(12 / 26)


def test_prefix_partial_match_and_divergence():
    m = make(16, 2)
    add_prompt(m, "a", [1, 2, 3, 4, 5, 6, 7])
    assert add_prompt(m, "b", [1, 2, 3, 4, 9, 9, 7]) == 4
    assert add_prompt(m, "c", [9, 2, 3, 4, 5]) == 0  # same later blocks, different first block
    assert m.block_table("c")[1] != m.block_table("a")[1]


def test_prefix_hit_from_cached_after_free_and_refcount():
    m = make(8, 2)
    add_prompt(m, "a", [1, 2, 3, 4, 5])
    table = m.block_table("a")
    m.free("a")
    st = m.stats()
    assert (st.cached, st.free, st.in_use) == (2, 6, 0)  # blocks [1,2] and [3,4] stay findable
    assert m.add_sequence("b", [1, 2, 3, 4, 5, 6]) == 4
    assert m.block_table("b") == table[:2]
    st = m.stats()
    assert (st.cached, st.in_use) == (0, 2)
    m.fork("b", "c")
    assert m._blocks[table[0]].ref_count == 2
    m.check_invariants()


def test_opaque_tokens_are_never_hashed():
    m = make(8, 2)
    m.add_sequence("a", [1, 2, 3])
    m.append("a", 2, [1, 2])
    m.append("a", 3)  # tokens unknown from here
    assert m.token_ids("a") is None
    m.append("a", 1, [4])  # still opaque: the ids after an unknown gap are not recorded
    assert m.token_ids("a") is None
    assert len(m._table) == 1  # only the first block
    m.truncate("a", 2)  # back inside the known prefix
    assert m.token_ids("a") == [1, 2]
    m.check_invariants()


def test_prefix_caching_disabled():
    m = make(8, 2, enable_prefix_caching=False)
    add_prompt(m, "a", [1, 2, 3, 4, 5])
    m.free("a")
    assert add_prompt(m, "b", [1, 2, 3, 4, 5]) == 0
    st = m.stats()
    assert (st.cached, st.prefix_queries, st.prefix_hits, st.hit_rate) == (0, 0, 0, 0.0)


def _constant_hash(parent, tokens):
    return 0


def _parent_blind_hash(parent, tokens):
    return hash(tokens)


def test_hash_collision_is_verified(monkeypatch):
    monkeypatch.setattr(blocks_mod, "_hash_block", _constant_hash)
    m = make(16, 2)
    add_prompt(m, "a", [1, 2, 3, 4, 5])  # [1,2] registered under key 0; [3,4] collides: left out
    assert len(m._table) == 1
    assert add_prompt(m, "b", [7, 8, 3, 4, 5]) == 0  # same key 0, other tokens: no hit
    assert add_prompt(m, "c", [1, 2, 3, 4, 5]) == 2  # the verified block only
    assert add_prompt(m, "d", [1, 2, 1, 2, 5]) == 2  # key 0 -> block [1,2] but parent differs
    m.check_invariants()


def test_parent_collision_is_verified(monkeypatch):
    """Equal tokens after a different prefix must not hit, even when the keys cannot tell."""
    monkeypatch.setattr(blocks_mod, "_hash_block", _parent_blind_hash)
    m = make(16, 2)
    add_prompt(m, "a", [1, 2, 3, 4, 0])
    assert add_prompt(m, "b", [5, 6, 3, 4, 0]) == 0
    assert add_prompt(m, "c", [1, 2, 3, 4, 0]) == 4
    m.check_invariants()


def test_evicted_parent_generation_blocks_wrong_hit(monkeypatch):
    """A child registered under an alias of an evicted parent must not follow new content.

    The key ignores each block's first token, so [1,2] and [9,2] collide. "b" computes [1,2]
    itself (an alias of "a"'s block) and registers [3,4] as its child. Once "a"'s [1,2] is
    evicted and [9,2] takes over the key, [9,2,3,4] must not reach that [3,4].
    """
    monkeypatch.setattr(blocks_mod, "_hash_block", lambda parent, tokens: hash((parent, tokens[1:])))
    m = make(6, 2)
    assert m.add_sequence("a", [1, 2, 3]) == 0
    assert m.add_sequence("b", [1, 2, 3, 4, 0]) == 0
    m.append("a", 3, [1, 2, 3])  # blocks 0 ([1,2], registered) and 1
    m.append("b", 5, [1, 2, 3, 4, 0])  # blocks 2 (alias of 0), 3 ([3,4], child of block 0), 4
    assert m.add_sequence("probe", [1, 2, 3, 4, 0]) == 4  # the alias chain is found
    m.free("probe")
    m.free("a")  # free queue: 5, 1, 0
    m.add_sequence("d")
    m.append("d", 6, [9, 2, 7, 7, 7, 7])  # blocks 5, 1, 0: evicts [1,2]; [9,2] takes its key
    assert m.stats().evictions == 1
    m.check_invariants()
    assert m.add_sequence("e", [9, 2, 3, 4, 0]) == 2  # [9,2] only, never "b"'s [3,4]
    assert m.add_sequence("f", [1, 2, 3, 4, 0]) == 0
    m.check_invariants()


# ---------------------------------------------------------------- LRU eviction order
def test_lru_eviction_order_tail_first():
    m = make(6, 2)
    add_prompt(m, "a", [1, 2, 3, 4, 5, 6, 7])  # blocks 0 1 2 3 (3 is partial)
    add_prompt(m, "b", [8, 9, 10])  # blocks 4 5
    m.free("a")  # tail-first: 3, 2, 1, 0 ; 3 is partial (free), 0..2 cached
    m.free("b")  # 5 (partial), 4 (cached)
    assert list(m._free) == [3, 2, 1, 0, 5, 4]
    st = m.stats()
    assert (st.free, st.cached, st.in_use) == (2, 4, 0)
    m.add_sequence("c")
    assert m.append("c", 4) == [6, 7, 4, 5]  # blocks 3 (free) then 2: evicts [5,6]
    st = m.stats()
    assert (st.evictions, st.cached) == (1, 3)
    # the first two blocks of "a" (evicted last) still hit; the third is gone
    assert m.add_sequence("d", [1, 2, 3, 4, 5, 6, 7]) == 4
    assert m.block_table("d") == [0, 1]
    m.check_invariants()


def test_least_recently_freed_evicted_first():
    m = make(4, 1)
    add_prompt(m, "old", [1, 2])
    add_prompt(m, "new", [3, 4])
    m.free("old")  # 1, 0
    m.free("new")  # 3, 2
    m.add_sequence("x")
    m.append("x", 2)  # bs=1: every block is full and hashed; "old" was freed first, tail-first
    assert m.block_table("x") == [1, 0]
    assert m.stats().evictions == 2
    assert m.add_sequence("y", [1, 2, 9]) == 0
    assert m.add_sequence("z", [3, 4, 9]) == 2


def test_grow_adds_free_blocks_first():
    m = make(2, 2)
    add_prompt(m, "a", [1, 2, 3])
    m.free("a")
    m.grow(4)
    assert m.num_blocks == 4 and m.num_free_blocks == 4
    m.add_sequence("b")
    m.append("b", 4)
    assert m.block_table("b") == [2, 3]  # the new blocks go before the cached ones
    assert m.add_sequence("c", [1, 2, 3]) == 2
    with pytest.raises(ValueError):
        m.grow(3)
    m.check_invariants()


# ---------------------------------------------------------------- fork and copy-on-write
def test_fork_then_both_append_cow():
    m = make(8, 4)
    add_prompt(m, "a", [1, 2, 3, 4, 5, 6])  # blocks 0 (full), 1 (2 tokens)
    m.fork("a", "b")
    assert m.block_table("b") == [0, 1] and m.num_tokens("b") == 6
    assert m.token_ids("b") == [1, 2, 3, 4, 5, 6]
    assert m.blocks_needed("a", 1) == 1 and m.blocks_needed("b", 2) == 1
    assert m.blocks_needed("a", 3) == 2
    assert m.append("a", 1, [7]) == [2 * 4 + 2]  # a copies block 1 into block 2
    assert m.block_table("a") == [0, 2]
    assert m.pop_copies() == [(1, 2)] and m.pop_copies() == []
    assert m.blocks_needed("b", 1) == 0  # b is now the only owner of block 1
    assert m.append("b", 1, [8]) == [1 * 4 + 2]
    assert m.pop_copies() == []
    assert m._blocks[0].ref_count == 2 and m._blocks[1].ref_count == 1
    assert m.stats().cow_copies == 1
    m.check_invariants()
    m.free("a")
    m.free("b")
    st = m.stats()
    assert (st.in_use, st.free + st.cached) == (0, 8)
    m.check_invariants()


def test_fork_full_last_block_needs_no_copy():
    m = make(8, 2)
    add_prompt(m, "a", [1, 2, 3, 4])
    m.fork("a", "b")
    assert m.blocks_needed("b", 1) == 1
    m.append("b", 1, [5])
    m.append("a", 1, [6])
    assert m.pop_copies() == []
    assert m.block_table("a")[:2] == m.block_table("b")[:2]


def test_fork_of_fork_both_cow_in_order():
    m = make(8, 4)
    m.add_sequence("a")
    m.append("a", 2)
    m.fork("a", "b")
    m.fork("a", "c")
    m.append("a", 1)
    m.append("b", 1)
    m.append("c", 1)  # last owner: writes in place
    assert m.pop_copies() == [(0, 1), (0, 2)]
    assert [m.block_table(s) for s in "abc"] == [[1], [2], [0]]
    m.check_invariants()


def test_freed_cow_target_drops_pending_copy():
    m = make(4, 4)
    m.add_sequence("a")
    m.append("a", 2)
    m.fork("a", "b")
    m.append("b", 1)
    m.free("b")
    assert m.pop_copies() == []
    m.check_invariants()


# ---------------------------------------------------------------- truncate
def test_truncate_and_reappend():
    m = make(8, 4)
    add_prompt(m, "a", list(range(10)))  # blocks 0 1 2 ; 0 and 1 hashed
    m.truncate("a", 6)  # block 2 dropped, block 1 now partial: its hash goes
    assert m.block_table("a") == [0, 1] and m.num_tokens("a") == 6
    assert m.token_ids("a") == list(range(6))
    assert len(m._table) == 1
    assert m.stats().free == 7 - 1
    assert m.append("a", 3, [60, 70, 80]) == [6, 7, 12]  # block 1 refilled in place, then block 3
    assert m.pop_copies() == []
    m.check_invariants()
    assert add_prompt(m, "b", [0, 1, 2, 3, 4, 5, 60, 70, 0]) == 8  # the new content is cached
    assert add_prompt(m, "c", list(range(10))) == 4  # the old content is not
    m.truncate("a", 0)
    assert m.block_table("a") == [] and m.token_ids("a") == []
    m.check_invariants()


def test_truncate_to_block_boundary_keeps_hash():
    m = make(8, 2)
    add_prompt(m, "a", [1, 2, 3, 4, 5])
    m.truncate("a", 4)
    assert len(m._table) == 2
    m.append("a", 1, [6])
    assert add_prompt(m, "b", [1, 2, 3, 4, 9]) == 4


def test_truncate_shared_block_then_cow():
    m = make(8, 2)
    add_prompt(m, "a", [1, 2, 3, 4])
    m.fork("a", "b")
    m.truncate("b", 3)  # block 1 shared: kept and still hashed for "a"
    assert len(m._table) == 2
    assert m.blocks_needed("b", 1) == 1
    assert m.append("b", 1, [9]) == [2 * 2 + 1]
    assert m.pop_copies() == [(1, 2)]
    assert add_prompt(m, "c", [1, 2, 3, 4, 0]) == 4
    m.check_invariants()


def test_truncate_shared_then_other_freed_unregisters_on_write():
    m = make(8, 2)
    add_prompt(m, "a", [1, 2, 3, 4])
    m.fork("a", "b")
    m.truncate("b", 3)
    m.free("a")  # b is now the only owner of the still-hashed block 1
    m.check_invariants()
    assert m.blocks_needed("b", 1) == 0
    m.append("b", 1, [9])  # written in place: the old hash must go
    assert add_prompt(m, "c", [1, 2, 3, 4, 0]) == 2
    assert add_prompt(m, "d", [1, 2, 3, 9, 0]) == 4
    m.check_invariants()


# ---------------------------------------------------------------- stats and invariants
def test_stats_counts():
    m = make(4, 2)
    add_prompt(m, "a", [1, 2, 3, 4, 5])
    m.fork("a", "b")
    m.append("b", 1, [6])
    m.free("a")
    st = m.stats()
    assert st == BlockStats(
        num_blocks=4,
        block_size=2,
        free=1,
        cached=0,
        in_use=3,
        num_sequences=1,
        prefix_queries=5,
        prefix_hits=0,
        hit_rate=0.0,
        evictions=0,
        cow_copies=1,
    )
    assert st.free + st.cached + st.in_use == st.num_blocks


def test_check_invariants_detects_corruption():
    m = make(4, 2)
    add_prompt(m, "a", [1, 2, 3])
    m._blocks[0].ref_count += 1
    with pytest.raises(InvariantError, match="block 0 has ref_count 2 but 1 references"):
        m.check_invariants()
    m._blocks[0].ref_count -= 1
    m._seqs["a"].blocks.append(3)
    with pytest.raises(InvariantError, match="'a' has 3 tokens but 3 blocks"):
        m.check_invariants()
    m._seqs["a"].blocks.pop()
    m._free[0] = None
    with pytest.raises(InvariantError, match="free queue"):
        m.check_invariants()
    del m._free[0]
    m._copies.append((0, 3))
    with pytest.raises(InvariantError, match="pending copy 0 -> 3"):
        m.check_invariants()
    m._copies.clear()
    m.check_invariants()
    assert issubclass(InvariantError, AssertionError)
