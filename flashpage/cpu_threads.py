"""Binding this process's CPU threads to cores, as vLLM's CPU backend binds its worker's.

vLLM-CPU sets its OpenMP thread count and binds the threads to cores by default
(``VLLM_CPU_OMP_THREADS_BIND``: ``auto``, or a list such as ``0-3``); an unbound process lets the
kernel move its threads between cores, which costs cache locality and, on a machine shared with
other work, time slices. :func:`bind_cpu_threads` does the same for flashpage: it sets torch's
intra-op threads to one per core and restricts every thread of the process (the OpenMP pool
included, whatever exists by then) to those cores. ``flashpage serve`` binds by default
(``--cpu-bind auto``): it owns its process. An offline ``LLM`` runs in the caller's process and
leaves it alone unless the caller binds (``flashpage.bind_cpu_threads("auto")``).

Linux only (``os.sched_setaffinity``); elsewhere binding reports why it did nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

ENV = "FLASHPAGE_CPU_BIND"  # read by `flashpage serve` when --cpu-bind is not given


@dataclass
class CpuBinding:
    """What :func:`bind_cpu_threads` did, and what :meth:`undo` restores.

    ``cores`` is empty when nothing was bound; ``reason`` then says why."""

    cores: tuple[int, ...]
    threads: int
    reason: str
    previous_threads: int = 0
    previous_affinity: dict[int, set[int]] = field(default_factory=dict)  # thread id -> its cores before

    @property
    def bound(self) -> bool:
        return bool(self.cores)

    def describe(self) -> str:
        if not self.bound:
            return f"threads not bound ({self.reason})"
        return f"{self.threads} thread(s) bound to cores {format_cores(self.cores)} ({self.reason})"

    def undo(self) -> None:
        """Restore torch's thread count and each still-running thread's cores."""
        if not self.bound:
            return
        torch.set_num_threads(self.previous_threads)
        for tid, cores in self.previous_affinity.items():
            try:
                os.sched_setaffinity(tid, cores)
            except OSError:  # the thread has ended
                pass
        self.cores = ()
        self.reason = "undone"


def parse_cores(spec: str) -> tuple[int, ...]:
    """``"0-3,6"`` -> (0, 1, 2, 3, 6); ValueError naming the bad part."""
    cores: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if hi < lo:
                    raise ValueError
                cores.extend(range(lo, hi + 1))
            else:
                cores.append(int(part))
        except ValueError:
            raise ValueError(f"CPU cores {spec!r}: {part!r} is not a core or range; give e.g. '0-3,6', "
                             "'auto' or 'none'") from None
    if any(c < 0 for c in cores) or len(set(cores)) != len(cores):
        raise ValueError(f"CPU cores {spec!r}: give each core (>= 0) once")
    return tuple(cores)


def format_cores(cores: Sequence[int]) -> str:
    """(0, 1, 2, 5) -> ``"0-2,5"``."""
    parts: list[str] = []
    start = prev = None
    for c in sorted(cores):
        if prev is not None and c == prev + 1:
            prev = c
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = c
    if start is not None:
        parts.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(parts)


def usable_cores() -> tuple[int, ...]:
    """The cores this process may run on (all of them where the OS cannot say)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return tuple(range(os.cpu_count() or 1))


def choose_cores(spec: str | Sequence[int] | None) -> tuple[tuple[int, ...], str]:
    """The cores a ``spec`` asks for, and why: ``"auto"`` (or None) = the first N usable cores
    for N threads (``OMP_NUM_THREADS`` if set, else torch's count), nothing when N covers every
    usable core (binding would change nothing); ``"none"`` = nothing; a list = those cores."""
    usable = usable_cores()
    if spec is None or spec == "auto":
        threads = torch.get_num_threads()
        if threads >= len(usable):
            return (), f"auto: {threads} thread(s) already use every one of the {len(usable)} usable cores"
        return usable[:threads], f"auto: the first {threads} of {len(usable)} usable cores, as vLLM binds"
    if spec == "none":
        return (), "cpu-bind none"
    cores = parse_cores(spec) if isinstance(spec, str) else tuple(spec)
    missing = sorted(set(cores) - set(usable))
    if missing:
        raise ValueError(f"CPU cores {format_cores(cores)}: {format_cores(missing)} not usable by this process "
                         f"(usable: {format_cores(usable)})")
    return cores, "as asked"


def bind_cpu_threads(spec: str | Sequence[int] | None = "auto") -> CpuBinding:
    """Bind this process's threads to the cores ``spec`` names (see :func:`choose_cores`) and set
    torch's intra-op threads to one per core. Returns a :class:`CpuBinding` (``undo()`` restores)."""
    if not hasattr(os, "sched_setaffinity"):
        return CpuBinding((), torch.get_num_threads(), "this OS has no sched_setaffinity")
    cores, reason = choose_cores(spec)
    if not cores:
        return CpuBinding((), torch.get_num_threads(), reason)
    binding = CpuBinding(cores, len(cores), reason, previous_threads=torch.get_num_threads())
    torch.set_num_threads(len(cores))
    for tid in _thread_ids():
        try:
            binding.previous_affinity[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, cores)
        except OSError:  # the thread ended meanwhile
            binding.previous_affinity.pop(tid, None)
    return binding


@contextmanager
def bound_cpu_threads(spec: str | Sequence[int] | None = "auto") -> Iterator[CpuBinding]:
    """:func:`bind_cpu_threads` for the duration of a ``with`` block."""
    binding = bind_cpu_threads(spec)
    try:
        yield binding
    finally:
        binding.undo()


def _thread_ids() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]  # the calling thread
