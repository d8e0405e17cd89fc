"""Tensor parallelism across processes: which rank this is, and keeping every rank's engine in step.

Under ``torchrun`` a model loaded with ``from_pretrained(..., tp_plan="auto")`` is sharded over the
ranks of its tensor-parallel group; every rank runs the same program, builds its own :class:`LLM`
over its shard (its KV pool holds only its local KV heads) and feeds the same tokens to every
forward, whose all-reduces join the shards. What keeps the ranks in step (:class:`TPSync`):

- the pool: every rank takes the smallest ``num_blocks`` any rank planned, so the block accounting
  (and with it admission and preemption) is the same everywhere;
- the tokens: each step's sampled tokens are those of rank 0, broadcast to the others (greedy,
  seeded and unseeded sampling alike), so stop strings and finish reasons agree;
- aborts: an ``abort()`` made on any rank is applied on every rank when the next step starts (and
  reported by that step), so every rank ends the request after the same tokens;
- a check: before each forward the ranks compare a digest of what they scheduled (requests, token
  ids, positions) and all raise :class:`RankDivergence` if it differs, instead of silently feeding
  the all-reduce different inputs (the usual cause: ranks added different requests or in a
  different order).

This module imports neither transformers nor the cache; the engine calls it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from flashpage.errors import FlashpageError


class RankDivergence(FlashpageError, RuntimeError):
    """The tensor-parallel ranks were about to run different steps."""


@dataclass(frozen=True)
class TPInfo:
    """This process's place in a tensor-parallel group.

    Attributes:
        rank / size: rank within the group, and the group's size.
        group: the torch.distributed process group (the model's ``tp`` mesh dimension, else WORLD).
        device: where collective tensors live (CUDA for NCCL, CPU for gloo).
    """

    rank: int
    size: int
    group: Any = field(repr=False)
    device: torch.device

    @property
    def is_driver(self) -> bool:
        return self.rank == 0


def tp_info(model: Any) -> TPInfo | None:
    """The tensor-parallel group a transformers model was sharded over, or None (not sharded / size 1)."""
    size = getattr(model, "_tp_size", None)
    if not size or int(size) <= 1:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"the model is tensor-parallel (tp_size={size}) but torch.distributed is not "
                           "initialised in this process; start it with torchrun and "
                           "torch.distributed.init_process_group() before loading the model")
    group = _tp_group(model)
    backend = str(dist.get_backend(group))
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
    return TPInfo(dist.get_rank(group), dist.get_world_size(group), group, device)


def _tp_group(model: Any) -> Any:
    mesh = getattr(model, "_device_mesh", None)
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if mesh is not None and "tp" in names:
        return mesh["tp"].get_group()
    if mesh is not None and getattr(mesh, "ndim", 0) == 1:
        return mesh.get_group()
    return dist.group.WORLD


class TPSync:
    """The collectives one engine runs each step; every rank must call them in the same order."""

    def __init__(self, info: TPInfo) -> None:
        self.info = info
        self._aborts: list[str] = []  # aborts made on this rank since the last step

    # ------------------------------------------------------------------ setup
    def agree_min(self, value: int) -> int:
        """The smallest ``value`` over the ranks (the KV pool: what every rank can hold)."""
        t = torch.tensor([int(value)], dtype=torch.int64, device=self.info.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.info.group)
        return int(t.item())

    # ------------------------------------------------------------------ steps
    def note_abort(self, request_id: str) -> None:
        """Remember an abort made on this rank, for every rank to apply when the next step starts."""
        self._aborts.append(request_id)

    def exchange_aborts(self) -> list[str]:
        """Every rank's aborts since the last step, in rank order (a no-op collective when none)."""
        local, self._aborts = self._aborts, []
        counts = self._gather_ints(len(local))
        if not any(counts):
            return []
        lists: list[list[str] | None] = [None] * self.info.size
        dist.all_gather_object(lists, local, group=self.info.group)
        seen: dict[str, None] = {}
        for rank_list in lists:
            seen.update(dict.fromkeys(rank_list or ()))
        return list(seen)

    def check_step(self, digest: int, what: str) -> None:
        """Raise :class:`RankDivergence` on every rank unless all ranks scheduled the same step."""
        digests = self._gather_ints(digest)
        if len(set(digests)) > 1:
            odd = [r for r, d in enumerate(digests) if d != digests[0]]
            raise RankDivergence(
                f"tensor-parallel rank(s) {odd} scheduled a different step from rank 0 (this rank, "
                f"{self.info.rank}: {what}): the ranks would "
                "feed different inputs to the same all-reduce. Every rank must make the same calls on its LLM "
                "(same prompts, sampling params and request ids, in the same order, at the same point between "
                "steps); see README 'Tensor parallel'.")

    def same_tokens(self, tokens: list[int]) -> list[int]:
        """Rank 0's sampled tokens, on every rank."""
        t = torch.tensor(tokens, dtype=torch.int64, device=self.info.device)
        dist.broadcast(t, group=self.info.group, group_src=0)
        return t.tolist()

    def _gather_ints(self, value: int) -> list[int]:
        mine = torch.tensor([int(value)], dtype=torch.int64, device=self.info.device)
        out = [torch.empty_like(mine) for _ in range(self.info.size)]
        dist.all_gather(out, mine, group=self.info.group)
        return [int(t.item()) for t in out]


def step_digest(parts: Iterable[tuple[str, int, int, list[int]]], preempted: Iterable[tuple[str, int]]) -> int:
    """A 63-bit digest of a step: (request id, sample index, first position, token ids) per chunk, and
    the preempted samples; equal on every rank that scheduled the same step (process-independent)."""
    h = hashlib.blake2b(digest_size=8)
    for rid, index, start, ids in parts:
        h.update(f"{rid}\x00{index}\x00{start}\x00{len(ids)}\x00".encode())
        h.update(array("q", ids).tobytes())
    h.update(b"\x01")
    for rid, index in preempted:
        h.update(f"{rid}\x00{index}\x00".encode())
    return int.from_bytes(h.digest(), "little") >> 1
