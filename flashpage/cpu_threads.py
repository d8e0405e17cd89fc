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

:class:`ThreadGovernor`: the engine's steps drop to one intra-op thread while other processes keep the
cores busy (OpenMP's spinning workers wait for descheduled siblings at every parallel region), and go
back to the caller's count when the cores free up.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

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


GOVERNOR_ENV = "FLASHPAGE_ADAPTIVE_THREADS"  # "0": engine steps always use torch's thread count


def run_queue_wait_ns() -> int | None:
    """Nanoseconds this process's threads have spent runnable but waiting for a core (the second field of
    each ``/proc/self/task/*/schedstat``), summed; None where the OS does not say (not Linux)."""
    if not os.path.isdir("/proc/self/task"):
        return None
    total = 0
    for tid in _thread_ids():
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):  # the thread ended meanwhile, or no schedstat
            continue
    return total


@dataclass
class ThreadGovernor:
    """Intra-op threads for the engine's steps when other processes share the cores.

    OpenMP's worker threads spin at the end of every parallel region for the others; when a core is
    taken by another process, a step's hundreds of small parallel regions each wait for a descheduled
    thread, and a 2-thread engine on a shared 2-core machine ran 10x slower than with one thread
    (``flashpage bench engine --quick``, load average 9: 7.7 vs 82.5 tok/s). The governor watches how long
    the process's threads wait for a core (``run_queue_wait_ns``) per thread-second of step time, over
    windows of ``window_s``: above ``down_at``, steps run on one thread (the caller's count is restored
    after every step: nothing outside the engine changes); on one thread, a window below ``up_at`` tries
    the caller's count again, at most every ``backoff_s`` seconds (doubled after each failed try, up to
    ``max_backoff_s``). A no-op on one thread, off Linux, on GPU models and with ``FLASHPAGE_ADAPTIVE_THREADS=0``.
    """

    enabled: bool = True
    window_s: float = 0.5
    down_at: float = 0.35
    up_at: float = 0.05
    backoff_s: float = 10.0
    max_backoff_s: float = 120.0
    reduced: bool = False  # steps run on one thread
    reduced_steps: int = 0  # steps that ran on one thread instead of the caller's count
    _wait: float = 0.0  # seconds to wait (from the window's end) before trying the caller's count again
    _retry_at: float = 0.0
    _window_start: float = 0.0
    _window_busy: float = 0.0  # thread-seconds of steps in this window
    _window_wait_ns: int = 0  # run-queue wait at the window's start
    _step_start: float = 0.0
    _caller_threads: int = 0

    @classmethod
    def for_device(cls, device: Any) -> ThreadGovernor:
        """On for CPU models on Linux unless ``FLASHPAGE_ADAPTIVE_THREADS=0``; it starts on one thread when the
        load average already covers every usable core (other processes' work: the engine has not run yet)."""
        on = (getattr(device, "type", str(device)) == "cpu" and os.environ.get(GOVERNOR_ENV, "1") != "0"
              and run_queue_wait_ns() is not None)
        busy = on and os.getloadavg()[0] >= len(usable_cores())
        return cls(enabled=on, reduced=busy, _wait=cls.backoff_s if busy else 0.0,
                   _retry_at=time.perf_counter() + cls.backoff_s if busy else 0.0)

    def begin(self) -> None:
        """Before a step: one thread while reduced (the caller's count is kept to restore)."""
        self._caller_threads = torch.get_num_threads()
        self._step_start = time.perf_counter()
        if self.enabled and self.reduced and self._caller_threads > 1:
            torch.set_num_threads(1)
            self.reduced_steps += 1

    def end(self) -> None:
        """After a step (also a failed one): the caller's count back; a window's verdict when one is over."""
        now = time.perf_counter()
        used = torch.get_num_threads()
        if used != self._caller_threads:
            torch.set_num_threads(self._caller_threads)
        if not self.enabled or self._caller_threads <= 1:
            return
        self._window_busy += (now - self._step_start) * used
        if now - self._window_start < self.window_s:
            return
        wait_ns = run_queue_wait_ns()
        if wait_ns is None:
            return
        if self._window_start > 0.0 and self._window_busy > 0.0:
            self.decide((wait_ns - self._window_wait_ns) / 1e9 / self._window_busy, now)
        self._window_start, self._window_busy, self._window_wait_ns = now, 0.0, wait_ns

    def decide(self, waiting: float, now: float) -> None:
        """One window's verdict: ``waiting`` = run-queue seconds per thread-second of step time."""
        if not self.reduced and waiting > self.down_at:
            self.reduced = True
            self._wait = min(self.max_backoff_s, self._wait * 2) if self._wait else self.backoff_s
            self._retry_at = now + self._wait
        elif not self.reduced and waiting < self.up_at:
            self._wait = 0.0  # the caller's count held for a whole window: the next fall waits the least
        elif self.reduced and waiting < self.up_at and now >= self._retry_at:
            self.reduced = False
