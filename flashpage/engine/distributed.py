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
  ids, positions, speculative proposals) and all raise :class:`RankDivergence` if it differs,
  instead of silently feeding the all-reduce different inputs (the usual cause: ranks added different requests or in a
  different order).

Two ways to drive the ranks. SPMD (the default): every rank runs the same program and makes the
same calls on its LLM. Driver/followers (:func:`drive` on rank 0, :func:`follow` on the others):
only rank 0 adds requests (a server, a script reading input); at the start of each step it
broadcasts what it added and aborted since the last step, and the followers step the same engine.

The engine calls this module; it never imports the cache, and transformers only inside
:func:`load_tp_model` (``LLM(path, tensor_parallel_size=N)``).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import sys
from array import array
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NoReturn

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
        group: a gloo group over the model's tensor-parallel ranks, for the engine's small messages
            (host-side ints: no GPU sync, and an idle follower may wait ``control_timeout()`` long
            where an NCCL collective would time out after 10 minutes).
        device: where those messages live (the CPU).
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
    # every rank of the world must create a group (new_group is collective): LLM() runs on every rank
    control = dist.new_group(dist.get_process_group_ranks(group), backend="gloo", timeout=control_timeout())
    return TPInfo(dist.get_rank(group), dist.get_world_size(group), control, torch.device("cpu"))


def control_timeout() -> timedelta:
    """How long a rank waits for the others at a step boundary: ``FLASHPAGE_TP_TIMEOUT_S`` seconds,
    default 30 days (a follower of an idle server waits there; torchrun ends every rank if one dies)."""
    raw = os.environ.get("FLASHPAGE_TP_TIMEOUT_S", str(30 * 24 * 3600))
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"FLASHPAGE_TP_TIMEOUT_S={raw!r}: give a number of seconds") from None
    if not seconds > 0:
        raise ValueError(f"FLASHPAGE_TP_TIMEOUT_S={raw!r}: give a positive number of seconds")
    return timedelta(seconds=seconds)


def check_tp_size(model: Any, size: int) -> None:
    """Refuse ``tensor_parallel_size=size`` for a model sharded over another number of ranks."""
    check_tp_size_arg(size)
    have = int(getattr(model, "_tp_size", None) or 1)
    if have != size:
        raise ValueError(f"tensor_parallel_size={size} but the model is sharded over {have} rank(s); load it with "
                         f"from_pretrained(..., tp_plan='auto') under torchrun --nproc-per-node {size}, or give "
                         "LLM the checkpoint path and tensor_parallel_size")


def load_tp_model(path: Any, dtype: Any, size: int, device: Any = None) -> Any:
    """``from_pretrained(path, tp_plan="auto", tp_size=size)`` under torchrun, the process group
    started here if the script did not (NCCL with CUDA, else gloo)."""
    from transformers import AutoModelForCausalLM

    check_tp_size_arg(size)
    if device is not None:
        raise ValueError("device= cannot be combined with tensor_parallel_size: each rank uses cuda:LOCAL_RANK "
                         "(or the CPU); omit device")
    if not dist.is_initialized() and "WORLD_SIZE" not in os.environ:
        raise RuntimeError(f"tensor_parallel_size={size} needs one process per rank: run this script with "
                           f"torchrun --nproc-per-node {size} (flashpage serve --tensor-parallel-size starts them "
                           "itself)")
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if dist.get_world_size() % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the {dist.get_world_size()} ranks "
                         "torchrun started")
    try:  # transformers' newer spelling; tp_plan= / tp_size= still work and are deprecated
        from transformers import DistributedConfig
    except ImportError:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, tp_plan="auto", tp_size=size).eval()
    config = DistributedConfig(tp_plan="auto", tp_size=size)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, distributed_config=config).eval()


def check_tp_size_arg(size: object) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {size!r}")


def _tp_group(model: Any) -> Any:
    mesh = getattr(model, "_device_mesh", None)
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if mesh is not None and "tp" in names:
        return mesh["tp"].get_group()
    if mesh is not None and getattr(mesh, "ndim", 0) == 1:
        return mesh.get_group()
    return dist.group.WORLD


@dataclass(frozen=True)
class NewRequest:
    """A request rank 0 added (driver mode), as the followers rebuild it."""

    request_id: str
    prompt: str | None
    token_ids: list[int]
    params: Any  # flashpage.SamplingParams


@dataclass
class StepInputs:
    """What changes before a step schedules: requests added (followers only) and aborted (any rank)."""

    adds: list[NewRequest] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    stop: bool = False  # driver mode: rank 0 released its followers


log = logging.getLogger("flashpage.tp")
_ABORTS, _DIGEST = 1, 2  # what a _gather_ints call is for


class TPSync:
    """The collectives one engine runs each step; every rank must call them in the same order.

    ``role`` is "spmd" (every rank makes the same calls), or "driver" (rank 0) / "follower" (the
    others) between :func:`drive` and the end of :func:`follow`.
    """

    def __init__(self, info: TPInfo) -> None:
        self.info = info
        self.role = "spmd"
        self.stopped = False  # follower: rank 0 has released this rank
        self.next_auto_id = 0  # follower, once released: rank 0's next automatic request id
        self._aborts: list[str] = []  # aborts made on this rank since the last step
        self._adds: list[NewRequest] = []  # driver: requests added since the last step

    # ------------------------------------------------------------------ setup
    def agree_min(self, value: int) -> int:
        """The smallest ``value`` over the ranks (the KV pool: what every rank can hold)."""
        t = torch.tensor([int(value)], dtype=torch.int64, device=self.info.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.info.group)
        return int(t.item())

    # ------------------------------------------------------------------ steps
    def note_add(self, request: NewRequest) -> None:
        """Driver: remember a request for the followers to add at the next step."""
        if self.role == "driver":
            self._adds.append(request)

    def exchange(self) -> StepInputs:
        """The inputs every rank applies before this step schedules."""
        if self.role == "spmd":
            return StepInputs(aborts=self.exchange_aborts())
        return self._broadcast_inputs(stop=False)

    def release_followers(self, next_auto_id: int) -> None:
        """Driver: tell the followers to return from :func:`follow` (in place of a step), and from which
        number on automatic request ids continue (so they match again in SPMD)."""
        self._broadcast_inputs(stop=True, next_auto_id=next_auto_id)

    def _broadcast_inputs(self, stop: bool, next_auto_id: int = 0) -> StepInputs:
        driver = self.info.is_driver
        mine = StepInputs(self._adds, self._aborts, stop) if driver else StepInputs()
        self._adds, self._aborts = [], []
        header = torch.tensor([len(mine.adds), len(mine.aborts), int(stop), next_auto_id], dtype=torch.int64,
                              device=self.info.device)
        dist.broadcast(header, group=self.info.group, group_src=0)
        n_adds, n_aborts, stopping, self.next_auto_id = header.tolist()
        if n_adds or n_aborts:
            box: list[Any] = [mine if driver else None]
            dist.broadcast_object_list(box, group=self.info.group, group_src=0, device=self.info.device)
            mine = box[0]
        self.stopped = bool(stopping) and not driver
        return StepInputs([] if driver else mine.adds, mine.aborts, bool(stopping))  # rank 0 has its adds

    def note_abort(self, request_id: str) -> None:
        """Remember an abort made on this rank, for every rank to apply when the next step starts."""
        self._aborts.append(request_id)

    def exchange_aborts(self) -> list[str]:
        """Every rank's aborts since the last step, in rank order (a no-op collective when none)."""
        local, self._aborts = self._aborts, []
        counts = self._gather_ints(_ABORTS, len(local))
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
        digests = self._gather_ints(_DIGEST, digest)
        if len(set(digests)) > 1:
            odd = [r for r, d in enumerate(digests) if d != digests[0]]
            raise RankDivergence(
                f"tensor-parallel rank(s) {odd} scheduled a different step from rank 0 (this rank, "
                f"{self.info.rank}: {what}): the ranks would "
                "feed different inputs to the same all-reduce. Every rank must make the same calls on its LLM "
                "(same prompts, sampling params and request ids, in the same order, at the same point between "
                "steps); see docs/tensor-parallel.md.")

    def same_proposals(self, proposals: list[list[int]]) -> list[list[int]]:
        """Rank 0's speculative proposals (one list per sequence asked, engine/spec.py), on every rank."""
        box: list[Any] = [proposals]
        dist.broadcast_object_list(box, group=self.info.group, group_src=0, device=self.info.device)
        return box[0]

    def same_tokens(self, tokens: list[int]) -> list[int]:
        """Rank 0's sampled tokens, on every rank."""
        t = torch.tensor(tokens, dtype=torch.int64, device=self.info.device)
        dist.broadcast(t, group=self.info.group, group_src=0)
        return t.tolist()

    def _gather_ints(self, kind: int, value: int) -> list[int]:
        """Every rank's ``value``; ``kind`` names the call, so ranks at different calls raise, not mix."""
        mine = torch.tensor([kind, int(value)], dtype=torch.int64, device=self.info.device)
        out = [torch.empty_like(mine) for _ in range(self.info.size)]
        dist.all_gather(out, mine, group=self.info.group)
        pairs = [t.tolist() for t in out]
        if any(k != kind for k, _v in pairs):
            calls = [k for k, _v in pairs]
            raise RankDivergence(f"tensor-parallel ranks are at different points of a step (calls {calls}, "
                                 f"this rank {self.info.rank}): every rank must step its LLM the same number of "
                                 "times; in driver mode rank 0 runs drive() while the others run follow()")
        return [v for _k, v in pairs]


def step_digest(parts: Iterable[tuple[str, int, int, list[int]]], preempted: Iterable[tuple[str, int]],
                drafts: Iterable[int] = ()) -> int:
    """A 63-bit digest of a step: (request id, sample index, first position, token ids) per chunk, and
    the preempted samples; equal on every rank that scheduled the same step (process-independent).
    ``drafts``: how many of each chunk's tokens are speculative proposals (its last ones; the token ids
    include them); a step without any hashes as before."""
    h = hashlib.blake2b(digest_size=8)
    for rid, index, start, ids in parts:
        h.update(f"{rid}\x00{index}\x00{start}\x00{len(ids)}\x00".encode())
        h.update(array("q", ids).tobytes())
    h.update(b"\x01")
    for rid, index in preempted:
        h.update(f"{rid}\x00{index}\x00".encode())
    counts = list(drafts)
    if any(counts):
        h.update(b"\x02" + array("q", counts).tobytes())
    return int.from_bytes(h.digest(), "little") >> 1


def _sync_of(llm: Any) -> TPSync:
    sync = getattr(llm, "_tp", None)
    if sync is None:
        raise ValueError("this LLM is not tensor-parallel (its model was not loaded with tp_plan= under torchrun); "
                         "drive()/follow() are for tensor-parallel ranks only")
    return sync


@contextmanager
def drive(llm: Any) -> Iterator[Any]:
    """Rank 0: ``with drive(llm): ...`` makes this rank the only one that adds requests; the other
    ranks, in :func:`follow`, receive them at each step. Leaving the block releases the followers."""
    sync = _sync_of(llm)
    if not sync.info.is_driver:
        raise ValueError(f"drive() runs on tensor-parallel rank 0; this is rank {sync.info.rank}: call follow(llm)")
    sync.role = "driver"
    try:
        yield llm
    finally:
        auto_id = next(llm._ids)  # followers continue automatic request ids from here, as rank 0 does
        sync.release_followers(auto_id)
        llm._ids = itertools.count(auto_id + 1)
        sync.role = "spmd"


def follow(llm: Any, max_failed_steps: int = 3) -> int:
    """Ranks other than 0: step ``llm`` in lockstep with rank 0's :func:`drive` block until it ends;
    returns the number of steps run.

    A step that raises on every rank (a bad request, :class:`RankDivergence`) is survived as on rank 0,
    whose front aborts that step's requests and goes on; ``max_failed_steps`` failures in a row end
    the follower with the last error (a broken group must not spin)."""
    sync = _sync_of(llm)
    if sync.info.is_driver:
        raise ValueError("follow() runs on tensor-parallel ranks other than 0; rank 0 drives: with drive(llm): ...")
    sync.role, sync.stopped = "follower", False
    steps = failed = 0
    try:
        while True:
            try:
                llm.step()
                failed = 0
            except Exception as exc:
                failed += 1
                if failed >= max_failed_steps:
                    raise
                log.warning("tensor-parallel follower: step failed on rank %d (%s: %s); following on",
                            sync.info.rank, type(exc).__name__, exc)
            if sync.stopped:
                llm._ids = itertools.count(sync.next_auto_id + 1)
                return steps
            steps += 1
    finally:
        sync.role, sync.stopped = "spmd", False


def end_rank(code: int) -> NoReturn:
    """End this torchrun rank with ``code`` once its process group is destroyed: flush logging and
    stdio, then ``os._exit`` past interpreter teardown. gloo's threads can abort a normally exiting
    process in C++ static destructors ("terminate called without an active exception", SIGABRT:
    about one run in ten here), turning a clean stop into a failed torchrun."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def sync_rng(model: Any) -> None:
    """Give every rank rank 0's global RNG state (CPU and current CUDA device), so a sampling
    ``model.generate()`` draws the same tokens on every rank of a tensor-parallel model. Not needed
    for :class:`flashpage.LLM`, which broadcasts its tokens."""
    size = getattr(model, "_tp_size", None)
    if not size or int(size) <= 1:
        return
    group = _tp_group(model)
    cuda = "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available()
    states: list[Any] = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state())
    box: list[Any] = [states]
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.broadcast_object_list(box, group=group, group_src=0, device=device)
    torch.set_rng_state(box[0][0])
    if len(box[0]) > 1 and torch.cuda.is_available():
        torch.cuda.set_rng_state(box[0][1])
