"""glibc malloc settings for CPU engine steps: a step's large temporaries stay in the heap between steps.

A CPU step allocates and frees the same large tensors every time (activations ``[T, hidden]``, the fused
gate/up output ``[T, 2 * intermediate]``, attention scratch, logits rows): torch's CPU allocator takes
them from ``malloc`` and gives them back with ``free``. glibc serves a request of at least
``M_MMAP_THRESHOLD`` bytes (128 KiB at start; each freed mapping raises it to that mapping's size, up
to 32 MiB) with its own ``mmap`` and ``munmap``s it on ``free``, and gives the heap's free top back to
the OS once it exceeds ``M_TRIM_THRESHOLD`` (twice the mmap threshold). Each step then faults its
temporaries in again, a 4 KiB page at a time, the kernel zeroing every page: on the built-in model a
2048-token prefill step took 5-12 thousand minor faults, every round of ``bench engine`` 13-43
thousand (docs/benchmarks.md). On a VM that reports freed pages to its host a fault also costs the
host's work.

:func:`tune_malloc` sets, once per process (``LLM`` calls it when it runs on CPU):

- ``M_MMAP_THRESHOLD`` = 32 MiB (the largest glibc accepts; a set value also stops the adaptation):
  requests below it come from the heap, whose freed chunks the next step reuses without faults;
  larger ones (a big model's KV pool, a 7B model's MLP output at 2048 tokens) are still mapped.
- ``M_TRIM_THRESHOLD`` = 1 GiB: the heap keeps up to that much free memory at its top instead of
  returning it after every step. The cost: the process keeps what its largest step needed
  (tens of MiB for the bench models) between steps, as jemalloc / tcmalloc (which vLLM's CPU
  backend preloads when it ships one) keep theirs.

``FLASHPAGE_MALLOC=system`` leaves malloc alone. So does a malloc setting already in the environment
(``MALLOC_*_`` variables, ``glibc.malloc`` tunables) and a preloaded malloc (``LD_PRELOAD`` naming
jemalloc, tcmalloc or mimalloc). Elsewhere than glibc (musl, macOS, Windows) it does nothing and says why.

:func:`page_out` hands the resident pages of tensors that live in a file mapping back to the kernel
(``madvise(MADV_PAGEOUT)``, Linux >= 5.4). transformers loads a safetensors checkpoint in its own dtype as
tensors backed by a private mapping of the file: clean pages the kernel reads back from the file on the next
access, so a reader later sees the same values. Pages written since (copy on write: a weight update) are
anonymous, and without swap the kernel leaves them alone; so do anonymous tensors (a model built in memory or
converted to another dtype). The engine pages out a linear's original weight once it runs on the packed copy
(``engine/linears.py``). With ``keep_cached`` the pages leave only this process's mapping and stay in the page
cache, for a tensor read back a row at a time (an embedding table the LM head is tied to). :func:`resident_bytes`
reads the process's resident set, to say what that released.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import os
import sys
import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

ENV = "FLASHPAGE_MALLOC"
CHOICES = ("tuned", "system")  # tuned: the settings below when an LLM runs on CPU (default); system: glibc's own
MALLOC_ENVS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_",
               "MALLOC_ARENA_MAX")
PRELOADED_MALLOCS = ("jemalloc", "tcmalloc", "mimalloc")


@dataclass(frozen=True)
class MallocSetting:
    """One ``mallopt(param, value)`` call."""

    name: str
    param: int  # glibc's malloc.h constant
    value: int  # bytes


SETTINGS = (MallocSetting("M_MMAP_THRESHOLD", -3, 32 << 20), MallocSetting("M_TRIM_THRESHOLD", -1, 1 << 30))


@dataclass(frozen=True)
class MallocTuning:
    """What :func:`tune_malloc` did (``applied``) or would do (:func:`malloc_plan`), and why.

    ``settings``: the settings glibc accepted (empty when nothing was set); ``refused``: those it
    returned 0 for."""

    applied: bool
    reason: str
    glibc: str | None  # glibc's version, None elsewhere
    settings: tuple[MallocSetting, ...] = ()
    refused: tuple[str, ...] = ()

    def describe(self) -> str:
        if not self.settings:
            return f"glibc malloc left alone ({self.reason})"
        what = ", ".join(f"{s.name}={_size(s.value)}" for s in self.settings)
        refused = f"; glibc refused {', '.join(self.refused)}" if self.refused else ""
        verb = "set" if self.applied else "an LLM on CPU sets"
        return f"glibc {self.glibc}: {verb} {what}{refused} ({self.reason}; {ENV}=system leaves malloc alone)"


@dataclass(frozen=True)
class MallocProbe:
    """What glibc did with one ``malloc(nbytes)`` / ``free``, read from ``mallinfo2()``."""

    nbytes: int
    mapped: bool  # served by its own mmap (mallinfo2 hblkhd grew by nbytes)
    kept: bool  # from the heap, and the heap did not shrink on free (not trimmed back to the OS)


_lock = threading.Lock()
_done: MallocTuning | None = None


def _size(n: int) -> str:
    return f"{n >> 30} GiB" if n >= 1 << 30 and not n % (1 << 30) else f"{n >> 20} MiB"


@functools.cache
def _libc() -> Any | None:
    """The C library as ctypes sees it, when it is glibc (it has ``gnu_get_libc_version``); else None. Opened
    once per process: a ``CDLL`` is a reference cycle (it caches its functions), so one per call would leave
    cyclic garbage behind every caller."""
    try:
        libc = ctypes.CDLL(None)
        version = libc.gnu_get_libc_version
    except (OSError, AttributeError, TypeError):  # Windows has no CDLL(None); musl / macOS lack the symbol
        return None
    version.restype = ctypes.c_char_p
    return libc


def glibc_version() -> str | None:
    """glibc's version string (``"2.36"``), None when this process's C library is not glibc."""
    libc = _libc()
    return None if libc is None else libc.gnu_get_libc_version().decode()


def choice() -> str:
    """``FLASHPAGE_MALLOC`` (``tuned`` when unset); ValueError naming the choices for anything else."""
    value = os.environ.get(ENV, "").strip().lower() or "tuned"
    if value not in CHOICES:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: expected one of {', '.join(CHOICES)} (tuned: the default, "
                         "malloc keeps a CPU step's temporaries between steps; system: glibc's own settings)")
    return value


def _left_alone_reason() -> str | None:
    """Why the environment rules malloc out of tuning, or None."""
    if choice() == "system":
        return f"{ENV}=system"
    preload = os.environ.get("LD_PRELOAD", "")
    named = [m for m in PRELOADED_MALLOCS if m in preload]
    if named:
        return f"LD_PRELOAD replaces malloc ({named[0]})"
    set_envs = [e for e in MALLOC_ENVS if e in os.environ]
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        set_envs.append("GLIBC_TUNABLES")
    if set_envs:
        return f"the environment sets malloc: {', '.join(set_envs)}"
    return None


def _left_alone(version: str | None) -> MallocTuning | None:
    """The outcome for a process whose malloc is not to be tuned (not glibc, or the environment says so);
    None when :data:`SETTINGS` apply."""
    if version is None:
        return MallocTuning(False, "not glibc: nothing to set", None)
    reason = _left_alone_reason()
    return None if reason is None else MallocTuning(False, reason, version)


def malloc_plan() -> MallocTuning:
    """What :func:`tune_malloc` would do in this process now (nothing is set), for ``flashpage info``."""
    if _done is not None:
        return _done
    version = glibc_version()
    return _left_alone(version) or MallocTuning(False, "not set yet in this process", version, SETTINGS)


def tune_malloc() -> MallocTuning:
    """Apply :data:`SETTINGS` with ``mallopt`` once per process (later calls return the first call's
    result); nothing where the module docstring says so. ValueError for an unknown ``FLASHPAGE_MALLOC``."""
    global _done
    with _lock:
        if _done is not None:
            return _done
        libc = _libc()
        version = None if libc is None else libc.gnu_get_libc_version().decode()
        left = _left_alone(version)
        if left is not None:
            _done = left
            return _done
        assert libc is not None
        libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        libc.mallopt.restype = ctypes.c_int
        accepted = tuple(s for s in SETTINGS if libc.mallopt(s.param, s.value) == 1)
        refused = tuple(s.name for s in SETTINGS if s not in accepted)
        _done = MallocTuning(bool(accepted), "an LLM runs on CPU", version, accepted, refused)
        return _done


def malloc_tuning() -> MallocTuning | None:
    """What :func:`tune_malloc` did in this process; None before its first call."""
    return _done


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def mallinfo2() -> dict[str, int] | None:
    """glibc's ``mallinfo2()`` (main arena: heap bytes, mmapped bytes ``hblkhd``, free bytes ``fordblks``...),
    None without glibc >= 2.33."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return {name: int(getattr(info, name)) for name, _ in _Mallinfo2._fields_}


def probe(nbytes: int = 16 << 20) -> MallocProbe | None:
    """``malloc(nbytes)`` then ``free``: whether glibc mapped it and whether the heap kept it after ``free``.
    Defaults (fresh process, 16 MiB): mapped, not kept; tuned: from the heap, kept. None without mallinfo2."""
    libc = _libc()
    if mallinfo2() is None:
        return None
    assert libc is not None
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    before = mallinfo2()
    ptr = libc.malloc(nbytes)
    if not ptr:
        raise MemoryError(f"malloc({nbytes}) failed")
    during = mallinfo2()
    libc.free(ptr)
    after = mallinfo2()
    assert before is not None and during is not None and after is not None
    mapped = during["hblkhd"] - before["hblkhd"] >= nbytes
    kept = not mapped and after["arena"] >= during["arena"] and after["fordblks"] >= nbytes
    return MallocProbe(nbytes, mapped, kept)


# ------------------------------------------------------------------ file-backed pages handed back
MADV_PAGEOUT = 21  # linux/mman.h (Linux >= 5.4; older kernels answer EINVAL)
MADV_DONTNEED = 4
_madvise: Any = None


def _page_size() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 4096


def _madvise_fn() -> Any | None:
    """libc's ``madvise`` through ctypes (errno kept), None off Linux or without it."""
    global _madvise
    if _madvise is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).madvise
        except (OSError, AttributeError, TypeError):
            fn = False
        else:
            fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            fn.restype = ctypes.c_int
        _madvise = fn
    return _madvise or None


def file_mappings() -> list[tuple[int, int]]:
    """Sorted ``(start, end)`` address ranges of this process's mappings of files (``/proc/self/maps`` lines
    with an inode; adjacent ones merged); empty off Linux."""
    if not sys.platform.startswith("linux"):
        return []
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    spans = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) >= 6 and fields[4] != "0":
            lo, hi = fields[0].split("-")
            spans.append((int(lo, 16), int(hi, 16)))
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):  # adjacent mappings (one file mapped in parts) as one range
        if merged and merged[-1][1] == lo:
            merged[-1] = (merged[-1][0], hi)
        else:
            merged.append((lo, hi))
    return merged


def _in_file_mapping(lo: int, hi: int, spans: list[tuple[int, int]]) -> bool:
    """Whether [lo, hi) lies inside one of ``spans`` (sorted, disjoint)."""
    i = bisect.bisect_right(spans, (lo, float("inf"))) - 1
    return i >= 0 and spans[i][0] <= lo and hi <= spans[i][1]


def page_out(tensors: Sequence[Any], spans: list[tuple[int, int]] | None = None, keep_cached: bool = False) -> int:
    """``madvise(MADV_PAGEOUT)`` on the whole pages inside each contiguous CPU tensor's data that lie in a file
    mapping (``spans``: :func:`file_mappings`, read now when not given); returns the bytes advised (0 off Linux,
    for anonymous memory, or where the kernel refuses). A page shared with a neighbouring tensor is left alone,
    as is every page of a tensor elsewhere than one mapping.

    ``keep_cached``: the mapping lets go of the pages but the page cache keeps them (``MADV_DONTNEED`` on the
    pages that are still the file's, :func:`_file_page_runs`), so a later read maps a page back without reading
    the file, while the kernel may still reclaim them as any cached file. For a tensor read a row at a time
    afterwards (an embedding table): a page read back from a slow disk costs milliseconds. Pages this process
    wrote since mapping the file (copies on write, anonymous) are left alone: ``MADV_DONTNEED`` would drop them."""
    fn = _madvise_fn()
    if fn is None or not sys.platform.startswith("linux") or not tensors:
        return 0
    spans = file_mappings() if spans is None else spans
    page = _page_size()
    advised = 0
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
            continue
        start = t.data_ptr()
        lo = -(-start // page) * page
        hi = (start + t.numel() * t.element_size()) // page * page
        if hi <= lo or not _in_file_mapping(lo, hi, spans):
            continue
        if not keep_cached:
            advised += hi - lo if fn(lo, hi - lo, MADV_PAGEOUT) == 0 else 0
            continue
        for a, b in _file_page_runs(lo, hi, page):
            advised += b - a if fn(a, b - a, MADV_DONTNEED) == 0 else 0
    return advised


_PAGEMAP_SWAPPED, _PAGEMAP_FILE = 1 << 62, 1 << 61  # /proc/PID/pagemap entry bits (Documentation/admin-guide/mm)
_PAGEMAP_PRESENT = 1 << 63


def _file_page_runs(lo: int, hi: int, page: int) -> list[tuple[int, int]]:
    """Address runs ``[a, b)`` of the pages in ``[lo, hi)`` (page-aligned, in a private file mapping) that are still
    the file's: in the page cache or not mapped yet, not anonymous copies this process wrote (present without the
    file bit, or swapped). Empty when ``/proc/self/pagemap`` cannot be read."""
    count = (hi - lo) // page
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(lo // page * 8)
            raw = f.read(count * 8)
    except OSError:
        return []
    if len(raw) != count * 8:
        return []
    entries = array("Q")
    entries.frombytes(raw)
    runs: list[tuple[int, int]] = []
    start = None
    for i, entry in enumerate(entries):
        written = entry & _PAGEMAP_SWAPPED or (entry & _PAGEMAP_PRESENT and not entry & _PAGEMAP_FILE)
        if not written and start is None:
            start = i
        elif written and start is not None:
            runs.append((lo + start * page, lo + i * page))
            start = None
    if start is not None:
        runs.append((lo + start * page, hi))
    return runs


def trim_heap() -> bool:
    """glibc's ``malloc_trim(0)``: the heap's free pages (its top and whole free pages inside it) go back to the
    OS. Packing leaves tens of MiB-sized holes (the stacked temporaries of fused weights) that a step never
    fills; the trim threshold (:data:`SETTINGS`) would keep them. True when glibc released memory."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim.argtypes = (ctypes.c_size_t,)
    libc.malloc_trim.restype = ctypes.c_int
    return bool(libc.malloc_trim(0))


def resident_bytes() -> int | None:
    """This process's resident set now (``/proc/self/statm``), None where unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _page_size()
    except (OSError, ValueError, IndexError):
        return None
