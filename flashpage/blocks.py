"""BlockManager: which KV block holds which token of which sequence (pure Python, no torch).

A pool of ``num_blocks`` blocks of ``block_size`` token slots each (``slot = block_id *
block_size + offset``, flash-attn's paged layout). The manager keeps

- a free queue (an OrderedDict used as an O(1) LRU list) of blocks with reference count 0:
  allocation takes the head, freed blocks go to the tail, a sequence is freed tail-first so the
  first blocks of a prefix are the last to be evicted;
- reference counts, so ``fork`` shares blocks and the shared partial last block is copied on
  its next write (copy-on-write; the caller performs the copies listed by ``pop_copies``);
- prefix caching: every full block whose tokens are known gets a chained key
  ``_hash_block(parent_key, tokens)``. A hit is never trusted on the key alone: the block's
  tokens and the identity of the prefix it continues are compared exactly. Freed blocks that
  hold a key stay findable ("cached") until they are popped for reuse (lazy LRU eviction).

Exactness under hash collisions: a registered block records ``ident = (block_id, generation)``
(the generation changes whenever the block's content may change) and its parent's ident, so a
hit requires the same tokens AND the very same verified parent, all the way down the chain.
A block left unregistered because an equal block is already registered aliases that block's
ident, so its successors can still be registered and found.

Call ``pop_copies`` and perform the copies before writing the KV of the tokens just appended.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from flashpage.errors import InvariantError, NoFreeBlocksError, UnknownSequenceError

Ident = tuple[int, int]  # (block id, generation) of a registered block


def _hash_block(parent_key: int | None, tokens: tuple[int, ...]) -> int:
    """Chained key of one full block (module level so tests can force collisions)."""
    return hash((parent_key, tokens))


@dataclass(frozen=True)
class BlockStats:
    """A snapshot of the pool: ``free + cached + in_use == num_blocks``."""

    num_blocks: int
    block_size: int
    free: int  # refcount 0, not holding a cached (hashed) prefix
    cached: int  # refcount 0, still holding a hashed full block (evictable, reusable)
    in_use: int  # refcount > 0
    num_sequences: int
    prefix_queries: int  # tokens looked up in add_sequence
    prefix_hits: int  # tokens served from cache
    hit_rate: float  # prefix_hits / prefix_queries (0.0 when no queries)
    evictions: int  # hashed blocks evicted to be reused
    cow_copies: int  # copy-on-write copies made


@dataclass(eq=False)
class _Block:
    block_id: int
    ref_count: int = 0
    key: int | None = None  # chained key, set once full with known tokens (registered or alias)
    tokens: tuple[int, ...] | None = None  # this block's tokens, to verify hits
    parent: Ident | None = None  # ident of the verified block before it (None: first block)
    ident: Ident | None = None  # own ident when registered, the registered twin's when an alias
    gen: int = 0

    def reset(self) -> None:
        """Forget the content: it is about to change (new owner, or rewritten after truncate)."""
        self.key = self.tokens = self.parent = self.ident = None
        self.gen += 1


@dataclass(eq=False)
class _Seq:
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    tokens: list[int] = field(default_factory=list)  # the known leading tokens (all, unless opaque)


def _check_count(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


class BlockManager:
    """Allocates KV blocks to sequences; see the module docstring for the rules."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        _check_count("num_blocks", num_blocks, 1)
        _check_count("block_size", block_size, 1)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._table: dict[int, int] = {}  # key -> registered block id
        self._seqs: dict[Hashable, _Seq] = {}
        self._copies: list[tuple[int, int]] = []
        self._num_cached = 0
        self._prefix_queries = self._prefix_hits = self._evictions = self._cow_copies = 0

    # ------------------------------------------------------------------ internals
    def _get(self, seq_id: Hashable) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequenceError(
                f"sequence {seq_id!r} is not in the block manager: it was never added or was "
                "already freed (add it with add_sequence first)"
            ) from None

    def _registered(self, b: _Block) -> bool:
        return b.key is not None and self._table.get(b.key) == b.block_id

    def _live(self, ident: Ident | None) -> bool:
        return ident is not None and self._blocks[ident[0]].gen == ident[1]

    def _allocate(self) -> int:
        bid, _ = self._free.popitem(last=False)
        b = self._blocks[bid]
        if self._registered(b):
            del self._table[b.key]
            self._num_cached -= 1
            self._evictions += 1
        b.reset()
        b.ref_count = 1
        return bid

    def _release(self, bid: int) -> None:
        b = self._blocks[bid]
        b.ref_count -= 1
        if b.ref_count == 0:
            self._free[bid] = None
            if self._registered(b):
                self._num_cached += 1
            elif b.key is not None:
                b.reset()  # an alias nobody holds: its content cannot be found again

    def _forget(self, b: _Block) -> None:
        """Unregister a block held only by one sequence whose content is about to change."""
        if self._registered(b):
            del self._table[b.key]
        if b.key is not None:
            b.reset()

    def _invalidate(self, b: _Block) -> None:
        """Drop a block's key whoever holds it: its content is not what the key says."""
        if self._registered(b):
            del self._table[b.key]
            if b.ref_count == 0:
                self._num_cached -= 1
        if b.key is not None:
            b.reset()

    def _register(self, seq: _Seq, i: int) -> None:
        """Give the full block ``i`` of ``seq`` a key if its tokens and its prefix are known."""
        bs = self.block_size
        b = self._blocks[seq.blocks[i]]
        if not self.enable_prefix_caching or b.key is not None or len(seq.tokens) < (i + 1) * bs:
            return
        parent_key: int | None = None
        parent: Ident | None = None
        if i > 0:
            p = self._blocks[seq.blocks[i - 1]]
            if not self._live(p.ident):
                return  # the prefix is unverifiable (collision, or its registered twin was evicted)
            parent_key, parent = p.key, p.ident
        tokens = tuple(seq.tokens[i * bs : (i + 1) * bs])
        key = _hash_block(parent_key, tokens)
        other = self._table.get(key)
        if other is None:
            self._table[key] = b.block_id
            b.key, b.tokens, b.parent, b.ident = key, tokens, parent, (b.block_id, b.gen)
        elif self._blocks[other].tokens == tokens and self._blocks[other].parent == parent:
            b.key, b.tokens, b.parent, b.ident = key, tokens, parent, self._blocks[other].ident
        # else: a real key collision with other content: leave the block (and its successors) out

    def _match_prefix(self, token_ids: list[int]) -> list[int]:
        bs = self.block_size
        hits: list[int] = []
        key: int | None = None
        parent: Ident | None = None
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            key = _hash_block(key, tokens)
            bid = self._table.get(key)
            if bid is None or self._blocks[bid].tokens != tokens or self._blocks[bid].parent != parent:
                break
            hits.append(bid)
            parent = self._blocks[bid].ident
        return hits

    def _needed(self, seq: _Seq, num_tokens: int) -> int:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if num_tokens == 0:
            return 0
        bs, length = self.block_size, seq.num_tokens
        needed = -(-(length + num_tokens) // bs) - len(seq.blocks)
        if length % bs and self._blocks[seq.blocks[-1]].ref_count > 1:
            needed += 1  # copy-on-write of the shared partial last block
        return needed

    def _drop_dead_copies(self) -> None:
        self._copies = [(s, d) for s, d in self._copies if self._blocks[d].ref_count > 0]

    # ------------------------------------------------------------------ public API
    def add_sequence(self, seq_id: Hashable, token_ids: Sequence[int] | None = None) -> int:
        """Register ``seq_id``; with ``token_ids``, attach its cached prefix blocks.

        Returns the number of leading prompt tokens already cached (a multiple of block_size,
        at most ``len(token_ids) - 1``): the sequence's length. Append the rest of the prompt.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already exists; free it first or use another id")
        seq = _Seq()
        if token_ids is not None and self.enable_prefix_caching:
            prompt = list(token_ids)
            hits = self._match_prefix(prompt)
            for bid in hits:
                b = self._blocks[bid]
                if b.ref_count == 0:
                    del self._free[bid]
                    self._num_cached -= 1
                b.ref_count += 1
            seq.blocks = hits
            seq.num_tokens = len(hits) * self.block_size
            seq.tokens = prompt[: seq.num_tokens]
            self._prefix_queries += len(prompt)
            self._prefix_hits += seq.num_tokens
        self._seqs[seq_id] = seq
        return seq.num_tokens

    def append(self, seq_id: Hashable, num_tokens: int, token_ids: Sequence[int] | None = None) -> list[int]:
        """Extend ``seq_id`` by ``num_tokens`` tokens and return their slots.

        ``token_ids`` (length ``num_tokens``) makes the new full blocks cacheable; without them
        the sequence becomes opaque from here on. Raises NoFreeBlocksError, changing nothing,
        when the pool cannot hold them.
        """
        seq = self._get(seq_id)
        needed = self._needed(seq, num_tokens)
        if token_ids is not None and len(token_ids) != num_tokens:
            raise ValueError(f"token_ids has {len(token_ids)} ids but num_tokens={num_tokens}")
        if num_tokens == 0:
            return []
        if needed > len(self._free):
            raise NoFreeBlocksError(
                needed, len(self._free), what=f"appending {num_tokens} token(s) to sequence {seq_id!r}"
            )
        bs, start = self.block_size, seq.num_tokens
        if start % bs:
            last = self._blocks[seq.blocks[-1]]
            if last.ref_count > 1:
                new = self._allocate()
                last.ref_count -= 1
                seq.blocks[-1] = new
                self._copies.append((last.block_id, new))
                self._cow_copies += 1
            else:
                self._forget(last)
        end = start + num_tokens
        while len(seq.blocks) * bs < end:
            seq.blocks.append(self._allocate())
        if token_ids is not None and len(seq.tokens) == start:
            seq.tokens.extend(token_ids)
        seq.num_tokens = end
        for i in range(start // bs, end // bs):
            self._register(seq, i)
        return slot_list(seq.blocks, bs, start, end)

    def blocks_needed(self, seq_id: Hashable, num_tokens: int) -> int:
        """New blocks ``append(seq_id, num_tokens)`` would take (copy-on-write included)."""
        return self._needed(self._get(seq_id), num_tokens)

    def can_append(self, seq_id: Hashable, num_tokens: int) -> bool:
        return self.blocks_needed(seq_id, num_tokens) <= len(self._free)

    def fork(self, src_seq_id: Hashable, dst_seq_id: Hashable) -> None:
        """``dst`` shares every block of ``src`` (same length and tokens)."""
        src = self._get(src_seq_id)
        if dst_seq_id in self._seqs:
            raise ValueError(f"cannot fork into sequence {dst_seq_id!r}: it already exists")
        for bid in src.blocks:
            self._blocks[bid].ref_count += 1
        self._seqs[dst_seq_id] = _Seq(list(src.blocks), src.num_tokens, list(src.tokens))

    def free(self, seq_id: Hashable) -> None:
        """Drop the sequence; its blocks lose one reference each, last block first."""
        seq = self._get(seq_id)
        del self._seqs[seq_id]
        for bid in reversed(seq.blocks):
            self._release(bid)
        self._drop_dead_copies()

    def truncate(self, seq_id: Hashable, num_tokens: int, *, invalidate: bool = False) -> None:
        """Shorten ``seq_id`` to its first ``num_tokens`` tokens (speculative-decoding rollback).

        ``invalidate=True`` says the dropped tokens' KV was never (validly) written, e.g. the
        forward that should have written them failed: the blocks that held them lose their
        prefix-cache keys, whoever else holds them, so no later lookup can be served from them.
        """
        seq = self._get(seq_id)
        if not 0 <= num_tokens <= seq.num_tokens:
            raise ValueError(
                f"cannot truncate sequence {seq_id!r} to {num_tokens} tokens: "
                f"it has {seq.num_tokens}; use 0 <= num_tokens <= {seq.num_tokens}"
            )
        if invalidate:
            for bid in seq.blocks[num_tokens // self.block_size:]:
                self._invalidate(self._blocks[bid])
        keep = -(-num_tokens // self.block_size)
        for bid in reversed(seq.blocks[keep:]):
            self._release(bid)
        del seq.blocks[keep:]
        del seq.tokens[num_tokens:]
        seq.num_tokens = num_tokens
        if num_tokens % self.block_size:
            last = self._blocks[seq.blocks[-1]]
            if last.ref_count == 1:
                self._forget(last)  # shared: kept as is, the next append copies it
        self._drop_dead_copies()

    def grow(self, num_blocks: int) -> None:
        """Enlarge the pool to ``num_blocks``; new blocks are allocated before any cached one."""
        _check_count("num_blocks", num_blocks, self.num_blocks)
        self._blocks.extend(_Block(bid) for bid in range(self.num_blocks, num_blocks))
        for bid in reversed(range(self.num_blocks, num_blocks)):
            self._free[bid] = None
            self._free.move_to_end(bid, last=False)
        self.num_blocks = num_blocks

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (the weights that computed them changed): nothing is found by
        ``add_sequence`` again until it is recomputed. Blocks held by sequences keep their place,
        without keys. Returns how many blocks lost their key."""
        dropped = 0
        for b in self._blocks:
            if b.key is not None:
                self._invalidate(b)
                dropped += 1
        return dropped

    def block_table(self, seq_id: Hashable) -> list[int]:
        return list(self._get(seq_id).blocks)

    def num_tokens(self, seq_id: Hashable) -> int:
        return self._get(seq_id).num_tokens

    def token_ids(self, seq_id: Hashable) -> list[int] | None:
        """The sequence's tokens, or None once tokens were appended without their ids."""
        seq = self._get(seq_id)
        return list(seq.tokens) if len(seq.tokens) == seq.num_tokens else None

    def has_sequence(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    @property
    def sequences(self) -> list:
        return list(self._seqs)

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: free plus cached (evictable)."""
        return len(self._free)

    def pop_copies(self) -> list[tuple[int, int]]:
        """(src_block, dst_block) copy-on-write copies made since the last call, in order."""
        copies, self._copies = self._copies, []
        return copies

    def stats(self) -> BlockStats:
        q, h = self._prefix_queries, self._prefix_hits
        return BlockStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            free=len(self._free) - self._num_cached,
            cached=self._num_cached,
            in_use=self.num_blocks - len(self._free),
            num_sequences=len(self._seqs),
            prefix_queries=q,
            prefix_hits=h,
            hit_rate=h / q if q else 0.0,
            evictions=self._evictions,
            cow_copies=self._cow_copies,
        )

    def check_invariants(self) -> None:
        """Recount everything from scratch; raise InvariantError naming the first inconsistency."""

        def fail(msg: str) -> None:
            raise InvariantError(f"BlockManager invariant violated: {msg}")

        n, bs = self.num_blocks, self.block_size
        if len(self._blocks) != n:
            fail(f"{len(self._blocks)} block records for num_blocks={n}")
        refs = [0] * n
        for sid, seq in self._seqs.items():
            if len(seq.blocks) != -(-seq.num_tokens // bs):
                fail(f"sequence {sid!r} has {seq.num_tokens} tokens but {len(seq.blocks)} blocks")
            if len(set(seq.blocks)) != len(seq.blocks):
                fail(f"sequence {sid!r} holds a block twice: {seq.blocks}")
            if len(seq.tokens) > seq.num_tokens:
                fail(f"sequence {sid!r} records {len(seq.tokens)} token ids for {seq.num_tokens} tokens")
            for pos, bid in enumerate(seq.blocks):
                if not 0 <= bid < n:
                    fail(f"sequence {sid!r} refers to block {bid} outside the pool")
                refs[bid] += 1
                b = self._blocks[bid]
                known = seq.tokens[pos * bs : (pos + 1) * bs]
                if b.tokens is not None and tuple(known) != b.tokens[: len(known)]:
                    fail(f"block {bid} holds tokens {b.tokens} but sequence {sid!r} has {known} there")
        counts = {"free": 0, "cached": 0, "in_use": 0}
        for b in self._blocks:
            if b.ref_count != refs[b.block_id]:
                fail(f"block {b.block_id} has ref_count {b.ref_count} but {refs[b.block_id]} references")
            if (b.ref_count == 0) != (b.block_id in self._free):
                fail(f"block {b.block_id} with ref_count {b.ref_count} is wrongly in/out of the free queue")
            registered = self._registered(b)
            if b.ref_count == 0 and not registered and b.key is not None:
                fail(f"free block {b.block_id} keeps an unregistered key")
            if b.key is not None and (b.tokens is None or len(b.tokens) != bs):
                fail(f"block {b.block_id} has a key but not a full block of tokens")
            if registered and b.ident != (b.block_id, b.gen):
                fail(f"registered block {b.block_id} has ident {b.ident}")
            if not registered and self._live(b.ident):
                twin = self._blocks[b.ident[0]]
                if (twin.key, twin.tokens, twin.parent) != (b.key, b.tokens, b.parent):
                    fail(f"block {b.block_id} aliases block {twin.block_id} with other content")
            state = "in_use" if b.ref_count else ("cached" if registered else "free")
            counts[state] += 1
        if len(self._free) != counts["free"] + counts["cached"]:
            fail(f"free queue holds {len(self._free)} entries for {counts['free'] + counts['cached']} blocks")
        for key, bid in self._table.items():
            if not 0 <= bid < n or self._blocks[bid].key != key:
                fail(f"hash table entry {key} -> block {bid} does not match the block's key")
        st = self.stats()
        if (st.free, st.cached, st.in_use) != (counts["free"], counts["cached"], counts["in_use"]):
            fail(f"stats say free/cached/in_use={st.free}/{st.cached}/{st.in_use}, recount {counts}")
        if sum(counts.values()) != n:
            fail(f"free + cached + in_use = {sum(counts.values())} != num_blocks {n}")
        for src, dst in self._copies:
            if not (0 <= src < n and 0 <= dst < n) or src == dst or self._blocks[dst].ref_count == 0:
                fail(f"pending copy {src} -> {dst} refers to an invalid or unused block")


def slot_list(table: Sequence[int], block_size: int, start: int, end: int) -> list[int]:
    """The pool slots of a sequence's positions ``start .. end - 1`` whose blocks are ``table``: position p is slot
    ``table[p // block_size] * block_size + p % block_size``, built a block's run at a time (``range``, not a
    Python loop per token: a prefill step has thousands)."""
    out: list[int] = []
    for b in range(start // block_size, -(-end // block_size)):
        base = table[b] * block_size
        first = b * block_size
        out.extend(range(base + max(start - first, 0), base + min(end - first, block_size)))
    return out
