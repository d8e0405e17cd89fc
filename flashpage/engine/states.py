"""Per-sequence recurrent-state slots for hybrid models in the engine, and the step layout they need.

Linear-attention / SSM layers (Qwen3-Next's gated delta net, Mamba mixers, LFM2's short convs, ...)
carry a fixed-size state per sequence instead of per-token K/V. transformers' recurrent layers
treat every batch row as one sequence, so a model with such layers cannot run the engine's packed
``[1, T]`` row of many sequences. Here:

- :class:`StateSlots` owns one pool tensor ``[n_slots, *state_shape]`` per (layer, kind, index)
  state; a sequence gets a slot when its first chunk is computed, a forked sample copies its
  parent's slot, and a slot is released once its sequence has left the KV cache (finished,
  aborted, preempted). A sequence recomputed from its first token starts from a fresh state, so
  preemption by recompute is exact.
- :func:`stateful_forward` runs one engine step as a few ``[B, L]`` forwards of equal-length rows:
  all decodes (one token after a state) together as ``[B, 1]``, their states gathered from the slots
  to ``[B, ...]`` and scattered back; prompt chunks grouped by length, those that start their
  sequences (fresh state) apart from those that continue them (state gathered). No padding: a
  padded row would feed the pads into the recurrent state.

Nothing here imports transformers: the cache object hands states over as plain tensors
(``read_states`` / ``load_states``, see ``flashpage.patches.hf_cache.HFPagedCache``).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from flashpage.engine.multimodal import language_model_inputs, row_inputs
from flashpage.plan import InputLayout

StateKey = Hashable  # (layer index, "conv" | "recurrent", state index)
INITIAL_SLOTS = 8


@dataclass
class StateSlots:
    """Recurrent states of every live sequence: one pool ``[capacity, *shape]`` per state key.

    Pools are created at the first :meth:`scatter` (shapes and dtypes come from the model) and
    doubled when more sequences are live than slots.

    Attributes:
        pools: state key -> ``(capacity, *state_shape)`` tensor.
        previous: the layers' has-previous-state flags after a forward (the same for every sequence).
        slot_of: sequence id -> slot row.
    """

    capacity: int = INITIAL_SLOTS
    pools: dict[StateKey, torch.Tensor] = field(default_factory=dict)
    previous: dict[Hashable, bool] = field(default_factory=dict)
    slot_of: dict[Hashable, int] = field(default_factory=dict)
    free_slots: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.free_slots = list(range(self.capacity - 1, -1, -1))

    # ------------------------------------------------------------- lifecycle
    def slot(self, seq_id: Hashable) -> int:
        """The slot of ``seq_id``, allocated (growing the pools) if it has none."""
        if seq_id in self.slot_of:
            return self.slot_of[seq_id]
        if not self.free_slots:
            self._grow(2 * self.capacity)
        slot = self.free_slots.pop()
        self.slot_of[seq_id] = slot
        return slot

    def release(self, seq_id: Hashable) -> None:
        """Give back ``seq_id``'s slot (no-op without one)."""
        slot = self.slot_of.pop(seq_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    def release_unless(self, alive: Callable[[Hashable], bool]) -> None:
        """Release the slots of sequences for which ``alive(seq_id)`` is False."""
        for seq_id in [s for s in self.slot_of if not alive(s)]:
            self.release(seq_id)

    def fork(self, src: Hashable, dst: Hashable) -> None:
        """``dst`` continues from ``src``'s current state (a copy: they diverge from here)."""
        if src not in self.slot_of:
            return
        with torch.inference_mode():  # the pools are made inside the engine's inference-mode forward
            a, b = self.slot_of[src], self.slot(dst)
            for pool in self.pools.values():
                pool[b].copy_(pool[a])

    # -------------------------------------------------------------- transfer
    def gather(self, seq_ids: Sequence[Hashable]) -> dict[StateKey, torch.Tensor]:
        """``{key: (len(seq_ids), *shape)}``: copies of the sequences' states, in order."""
        if not self.pools:
            return {}
        index = self._index(seq_ids)
        return {key: pool.index_select(0, index.to(pool.device)) for key, pool in self.pools.items()}

    def scatter(self, seq_ids: Sequence[Hashable], states: dict[StateKey, torch.Tensor],
                previous: dict[Hashable, bool]) -> None:
        """Store ``states`` (each ``(len(seq_ids), *shape)``) as the sequences' current states."""
        for seq_id in seq_ids:
            self.slot(seq_id)
        for key, value in states.items():
            pool = self.pools.get(key)
            if pool is None:
                pool = self.pools[key] = value.new_zeros((self.capacity, *value.shape[1:]))
            elif pool.shape[1:] != value.shape[1:] or pool.dtype != value.dtype:
                raise RuntimeError(
                    f"state {key} of this forward has shape {tuple(value.shape[1:])} / {value.dtype} per sequence, "
                    f"but earlier forwards gave {tuple(pool.shape[1:])} / {pool.dtype}: this model's recurrent "
                    "state is not of fixed size, which the engine's state slots need")
            pool.index_copy_(0, self._index(seq_ids).to(pool.device), value)
        self.previous.update(previous)

    # -------------------------------------------------------------- reporting
    def bytes_per_sequence(self) -> int:
        """State bytes one sequence holds (all state layers); 0 before the first forward."""
        return sum(p[0].numel() * p.element_size() for p in self.pools.values())

    def allocated_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.pools.values())

    # ----------------------------------------------------------------- inner
    def _index(self, seq_ids: Sequence[Hashable]) -> torch.Tensor:
        return torch.tensor([self.slot_of[s] for s in seq_ids], dtype=torch.long)

    def _grow(self, capacity: int) -> None:
        for key, pool in self.pools.items():
            bigger = pool.new_zeros((capacity, *pool.shape[1:]))
            bigger[: self.capacity].copy_(pool)
            self.pools[key] = bigger
        self.free_slots.extend(range(capacity - 1, self.capacity - 1, -1))
        self.capacity = capacity


@dataclass(frozen=True)
class _Forward:
    """One forward of a stateful step: its chunks (``[rows, length]`` input) and packed offsets."""

    chunks: tuple[Any, ...]
    offsets: tuple[int, ...]  # packed index of each chunk's first token
    fresh: bool  # the chunks start their sequences (no previous state)


def recurrent_states_of(model: Any, cache: Any) -> StateSlots | None:
    """State slots for a model whose cache has recurrent layers (None when it has none). A pure
    state-space model (Mamba: no attention layer) gets them too; its pool holds no pages, and its
    blocks only count tokens."""
    return StateSlots() if cache.has_states else None


CONTINUATION_NOISE = 10.0  # a chunk continues a state exactly when it errs at most this many times the noise
CONTINUATION_FLOOR = 1e-4  # ... or at most this much (relative to the state's largest value)


def continues_chunks(run: Callable[[list[list[int]]], dict[StateKey, torch.Tensor]], tokens: Sequence[int]) -> bool:
    """Whether the model's recurrent layers continue a multi-token input from a previous state.

    Some do not: transformers' Mamba-1 mixers (Mamba, Falcon-Mamba, Jamba, Zamba) use the state only
    for a one-token input and restart the scan from zero otherwise, which ``generate()`` never meets
    (one prefill, then single tokens) but a chunked prompt does. ``run(parts)`` feeds the parts one
    forward after another to a fresh cache and returns the states after the last. The states after
    ``tokens[:-2]`` then the last two must equal those after the whole input in one forward, within
    ``CONTINUATION_NOISE`` times the difference the exact path (``tokens[:-1]`` then the last one)
    already shows, or ``CONTINUATION_FLOOR``.
    """
    whole = run([list(tokens)])
    decoded = run([list(tokens[:-1]), list(tokens[-1:])])
    chunked = run([list(tokens[:-2]), list(tokens[-2:])])

    def relative(states: dict[StateKey, torch.Tensor]) -> float:
        return max((float((states[k].float() - t.float()).abs().max() / t.float().abs().max().clamp_min(1e-30))
                    for k, t in whole.items()), default=0.0)

    return relative(chunked) <= max(CONTINUATION_NOISE * relative(decoded), CONTINUATION_FLOOR)


def restart_from_scratch(seqs: Sequence[Any], kv: Any, slots: StateSlots) -> None:
    """These sequences' states cannot be rolled back: recompute them from their first token
    (their K/V are dropped too, so pages and states agree)."""
    for seq in seqs:
        if seq.in_cache and kv.has_sequence(seq.seq_id):
            kv.truncate(seq.seq_id, 0, invalidate=True)
        seq.num_computed = 0
        slots.release(seq.seq_id)


def split_forwards(chunks: Sequence[Any]) -> list[_Forward]:
    """Chunks that can share a ``[rows, length]`` input: decodes (one token after a state) together,
    and chunks of equal length that all start their sequences, or all continue them, together."""
    offsets = [0]
    for c in chunks:
        offsets.append(offsets[-1] + c.num_tokens)
    groups: dict[tuple[bool, int], list[int]] = {}
    for i, c in enumerate(chunks):
        groups.setdefault((c.start == 0, c.num_tokens), []).append(i)
    return [_Forward(tuple(chunks[i] for i in members), tuple(offsets[i] for i in members), fresh)
            for (fresh, _), members in groups.items()]


def stateful_forward(model: Any, kv: Any, cache: Any, cache_kwarg: str, device: torch.device, slots: StateSlots,
                     chunks: Sequence[Any], keep: Sequence[int], token_by_token: bool = False) -> torch.Tensor:
    """Run one engine step on a model with recurrent layers (see the module docstring).

    Args:
        kv: the engine's PagedKVCache (slots of every chunk already allocated by the scheduler).
        cache: the engine's HFPagedCache over ``kv`` (has ``read_states`` / ``load_states``).
        chunks: the step's chunks (``seq``, ``start``, ``num_tokens``, ``token_ids``).
        keep: packed row indices whose logits are wanted (as the packed ``[1, T]`` forward numbers
            the step's tokens, chunk after chunk).
        token_by_token: chunks that continue a sequence run one token at a time (a model whose
            recurrent layers do not continue a multi-token input from a state, see :func:`continues_chunks`).

    Returns:
        (len(keep), V) logits, row ``i`` for packed position ``keep[i]``.
    """
    slots.release_unless(kv.has_sequence)
    ends = [0]
    for c in chunks:
        ends.append(ends[-1] + c.num_tokens)
    rows: list[torch.Tensor | None] = [None] * len(keep)
    for fwd in split_forwards(chunks):
        wanted = _wanted(fwd, keep, ends, chunks)
        positions = sorted({t for _, _, t in wanted})
        run = _run_token_by_token if token_by_token and not fwd.fresh and fwd.chunks[0].num_tokens > 1 else _run
        logits = run(model, kv, cache, cache_kwarg, device, slots, fwd, positions)  # runs even if none are kept
        for i, b, t in wanted:
            rows[i] = logits[b, positions.index(t)]
    return torch.stack(rows) if rows else torch.empty((0, 0), device=device)


def _wanted(fwd: _Forward, keep: Sequence[int], ends: Sequence[int], chunks: Sequence[Any]
            ) -> list[tuple[int, int, int]]:
    """(output row, input row, position in the row) of each kept packed index this forward computes."""
    out = []
    for i, packed in enumerate(keep):
        chunk = chunks[bisect.bisect_right(ends, packed) - 1]
        for b, c in enumerate(fwd.chunks):
            if c is chunk:
                out.append((i, b, packed - fwd.offsets[b]))
    return out


def _run(model: Any, kv: Any, cache: Any, cache_kwarg: str, device: torch.device, slots: StateSlots,
         fwd: _Forward, positions: list[int]) -> torch.Tensor:
    """One forward of ``fwd``'s chunks as ``[rows, length]``; states in from and back to the slots.
    Returns (rows, len(positions), V) logits (positions: indices into the row; at least one)."""
    seq_ids = [c.seq.seq_id for c in fwd.chunks]
    rows, length = len(fwd.chunks), fwd.chunks[0].num_tokens
    cache.load_states(None if fwd.fresh else slots.gather(seq_ids), slots.previous)
    plan = kv.plan(seq_ids, [c.num_tokens for c in fwd.chunks], allocated=True, layout=InputLayout(rows, length),
                   context_lens=[c.start for c in fwd.chunks])
    cache.set_plan(plan, device)
    ids = torch.tensor([c.token_ids for c in fwd.chunks], device=device)
    pos = torch.tensor([list(range(c.start, c.start + c.num_tokens)) for c in fwd.chunks], device=device)
    keep = torch.tensor(positions or [length - 1], dtype=torch.long, device=device)
    inputs, deep = row_inputs(model, fwd.chunks, ids, pos)  # image requests: their embeddings (engine/multimodal.py)
    with language_model_inputs(model, deep):
        logits = model(**inputs, use_cache=True, logits_to_keep=keep, **{cache_kwarg: cache}).logits
    if logits.shape[1] != keep.numel():  # a model that ignores logits_to_keep (xLSTM): every position's
        logits = logits.index_select(1, keep)
    states, previous = cache.read_states()
    slots.scatter(seq_ids, states, previous)
    return logits


@dataclass(frozen=True)
class _Token:
    """One token of a chunk, as a chunk of its own (``seq``, ``start``, ``num_tokens``, ``token_ids``)."""

    seq: Any
    start: int
    token_ids: tuple[int, ...]
    num_tokens: int = 1


def _run_token_by_token(model: Any, kv: Any, cache: Any, cache_kwarg: str, device: torch.device, slots: StateSlots,
                        fwd: _Forward, positions: list[int]) -> torch.Tensor:
    """``fwd``'s continuing chunks as ``[rows, 1]`` forwards, one per token, each from the state the one
    before left (what ``generate()`` does after its prefill). Returns what :func:`_run` returns."""
    kept: list[torch.Tensor] = []
    logits = None
    for j in range(fwd.chunks[0].num_tokens):
        tokens = tuple(_Token(c.seq, c.start + j, (c.token_ids[j],)) for c in fwd.chunks)
        logits = _run(model, kv, cache, cache_kwarg, device, slots, _Forward(tokens, fwd.offsets, False), [0])
        if j in positions:
            kept.append(logits[:, 0])
    return torch.stack(kept, dim=1) if kept else logits
