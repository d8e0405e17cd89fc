"""A fused C++ paged-attention kernel for CPU tensors, JIT-built once per machine (optional).

The PyTorch reference gathers every sequence's pages into padded tensors and runs matmul +
softmax; this kernel reads K/V pages in place instead: one task per (sequence, KV head, tile of
query rows), an online softmax over the keys a row can see (causal and sliding-window masks are
intervals, so nothing is masked: only visible keys are visited), the G query heads of a GQA group
sharing each key / value load, ``at::parallel_for`` over the tasks. Decode tiles (at most 4 query
rows) of a float32 call on an AVX-512 CPU take every KV head in one task instead: a page row holds
all the heads of a token, so the task reads each page front to back (decode is bound by memory
bandwidth) and prefetches the next page; with fewer decode tiles than threads they split per head.
Decode tiles whose tables start with the same pages (prefix caching) take a cascade: their queries,
stacked per KV head, run the prefill tile's GEMM micro-kernels over the shared keys once, then each
tile resumes its own online softmax after them (``FLASHPAGE_CPU_CASCADE=0``: off). On CPUs with AVX2 + FMA
and no AVX-512 (AMD Zen 2/3, Intel client parts), decode tiles' float32 scores take a vector loop instead of a
dot per key: eight keys at a time, each with its own 8-lane sums, reduced together by one hadd tree (head dims
that are multiples of 8); measured 2x the portable loops on 64 decodes of 140-190 keys.
Same contract as the reference (docs/flash-attn-contract.md section 3): bottom-right causal,
sliding window, softcap, attention sinks, a row with no visible key returns 0. float32, float64, and
bfloat16 / float16 (``csrc/attention_half.h``: the generic tile's float32 arithmetic on the tile's queries and each
page's K / V rows widened into per-thread float32 scratch, each row read once per tile; the output rounded once, the
LSE float32, as flash-attn accumulates); anything else (ALiBi, autograd) stays on the reference.

The same library has the K/V store (:func:`store_kv`: one call writes a layer's new K and V rows
into their slots). Its C++ is ``flashpage/kernels/csrc/cpu_attention.cpp`` (with ``csrc/common.h``), built
by :mod:`flashpage.kernels.cpp_build` (``torch.utils.cpp_extension.load``, ``-march=native``) into torch's
extension cache (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) the first time a CPU
attention needs it (about a minute), and loaded from there afterwards. No compiler or no ninja: one warning,
and the reference runs. ``FLASHPAGE_CPU_ATTENTION=reference`` forces the reference;
:func:`status` says which one runs (``flashpage info`` prints it).
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashpage.kernels import cpp_build
from flashpage.kernels.cpp_build import missing_tools as _missing_tools  # a module global: tests replace it

ENV = "FLASHPAGE_CPU_ATTENTION"  # "reference" forces the PyTorch path; anything else / unset: auto
# "0": decodes that share their first pages read them each on their own (an A/B switch; read at import)
CASCADE_ENV = "FLASHPAGE_CPU_CASCADE"
_CASCADE = os.environ.get(CASCADE_ENV, "1").strip().lower() not in ("0", "false", "off", "no")
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)  # what the kernel takes
_VERSION = 15  # bump when the C++ source changes meaning (the sources' hash also rebuilds)
_SOURCES = ("cpu_attention.cpp",)  # in csrc/ (with common.h)


@dataclass(frozen=True)
class Status:
    """Which CPU attention runs: ``name`` "cpp" (the fused kernel) or "reference", and why."""

    name: str
    reason: str


_lock = threading.Lock()
_module: Callable[..., torch.Tensor] | None = None
_failure: str | None = None  # why the kernel is unavailable (set once)


def _forced_reference() -> bool:
    return os.environ.get(ENV, "").strip().lower() == "reference"


def _sources() -> list[str]:
    return [cpp_build.source(name) for name in _SOURCES]


def _build_name() -> str:
    return cpp_build.build_name("flashpage_cpu_attention", _VERSION, _sources(), cpp_build.arch_flags())


def _build() -> Callable[..., torch.Tensor]:
    """Compile (or load from torch's extension cache) and return the registered op."""
    cpp_build.jit_build(_build_name(), _sources(), cpp_build.arch_flags())
    return torch.ops.flashpage_cpu.paged_attention


def load() -> Callable[..., torch.Tensor] | None:
    """The built kernel (a torch op), building it on first use; None (after one warning) when it cannot
    be built here or is forced off with ``FLASHPAGE_CPU_ATTENTION=reference``."""
    global _module, _failure
    if _forced_reference():
        return None
    if _module is not None or _failure is not None:
        return _module
    with _lock:
        if _module is None and _failure is None:
            _failure = _missing_tools()
            if _failure is None:
                try:
                    _module = _build()
                except Exception as exc:  # a compiler error, a read-only cache, ...: the reference still runs
                    _failure = f"build failed: {type(exc).__name__}: {str(exc).strip().splitlines()[-1:]}"
            if _failure is not None:
                warnings.warn(f"flashpage: the C++ CPU attention kernel is unavailable ({_failure}); "
                              "CPU attention runs on the PyTorch reference (slower, same results).", stacklevel=3)
    return _module


def status(build: bool = False) -> Status:
    """Which CPU attention runs here. ``build``: build (or load) the kernel to find out for sure;
    otherwise report without compiling anything."""
    if _forced_reference():
        return Status("reference", f"forced by {ENV}=reference")
    if build:
        load()
    if _module is not None:
        return Status("cpp", "fused C++ paged-attention kernel (loaded)")
    if _failure is not None:
        return Status("reference", f"C++ kernel unavailable: {_failure}")
    missing = _missing_tools()
    if missing is not None:
        return Status("reference", f"C++ kernel unavailable: {missing}")
    library = _library_path()
    if library is not None and os.path.exists(library):
        return Status("cpp", f"fused C++ paged-attention kernel (built: {library})")
    return Status("cpp", "fused C++ paged-attention kernel (built on first use, about a minute, then cached)")


def _library_path() -> str | None:
    """Where torch's extension cache keeps (or will keep) this build's shared library."""
    return cpp_build.library_path(_build_name())


def store_kv(k_pages: torch.Tensor, v_pages: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor, loaded: bool | None = None) -> bool:
    """Write k (N, Hk, D) / v (N, Hk, Dv) into contiguous CPU pages (NB, P, Hk, D|Dv) at ``slots`` (N,)
    (-1: skipped) in one C++ call; False (nothing written) where it does not apply: not CPU, dtypes
    that differ from the pages', autograd, a strided last dimension, or the kernel unavailable.
    ``loaded``: whether :func:`load` gave the kernel, from a caller that looks it up once per step (None: look
    it up here)."""
    if (not k.is_cpu or not k_pages.is_cpu or k.dtype != k_pages.dtype
            or v.dtype != v_pages.dtype or k.stride(-1) != 1 or v.stride(-1) != 1
            or not (k_pages.is_contiguous() and v_pages.is_contiguous())
            or (torch.is_grad_enabled() and (k.requires_grad or v.requires_grad))):
        return False
    if not (loaded if loaded is not None else load() is not None):
        return False
    torch.ops.flashpage_cpu.store_kv(k_pages, v_pages, k, v, slots)
    return True


def eligible(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> bool:
    """Whether these tensors can take the kernel (it still may be unavailable: see :func:`load`)."""
    if q.device.type != "cpu" or q.dtype not in DTYPES or k_pages.dtype != q.dtype or v_pages.dtype != q.dtype:
        return False
    if k_pages.device.type != "cpu" or k_pages.stride(-1) != 1 or v_pages.stride(-1) != 1:
        return False
    return not (torch.is_grad_enabled() and (q.requires_grad or k_pages.requires_grad or v_pages.requires_grad))


def window_sides(causal: bool, window_size: tuple[int, int]) -> tuple[int, int]:
    """flash-attn's (left, right) window with causal folded in (right = 0); -1 = unbounded."""
    left, right = int(window_size[0]), int(window_size[1])
    return (left if left >= 0 else -1, 0 if causal else (right if right >= 0 else -1))


def paged_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor,
                    seqlens_k: torch.Tensor, cu_seqlens_q: torch.Tensor, scale: float, softcap: float,
                    window: tuple[int, int], s_aux: torch.Tensor | None, *, generic: bool = False,
                    cascade: bool | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Paged attention of packed queries, or None when the kernel is unavailable (caller falls back).

    q: (T, H, D) float32 / float64 / bfloat16 / float16 (pages of the same dtype), sequence b's rows
    ``cu_seqlens_q[b] .. cu_seqlens_q[b+1] - 1``;
    k_pages / v_pages: (NB, P, Hk, D|Dv); block_table: (B, M) int (columns past a sequence's keys
    are never read); seqlens_k: (B,) keys visible; ``window``: (left, right) with causal folded in
    (:func:`window_sides`), -1 unbounded; s_aux: (H,) sink logits or None. Returns out (T, H, Dv)
    in q's dtype and the log-sum-exp (T, H) (+inf for a row that sees no key; float32 for half-precision q, else
    q's dtype). ``generic``: the portable
    loops only; ``cascade``: decode rows whose tables start with the same pages read them once, together
    (None: ``FLASHPAGE_CPU_CASCADE``, default on).
    """
    kernel = load()
    if kernel is None:
        return None
    return run_kernel(kernel, q, k_pages, v_pages, block_table, seqlens_k, cu_seqlens_q, scale, softcap, window, s_aux,
                      generic=generic, cascade=cascade)


def run_kernel(kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]], q: torch.Tensor, k_pages: torch.Tensor,
               v_pages: torch.Tensor, block_table: torch.Tensor, seqlens_k: torch.Tensor, cu_seqlens_q: torch.Tensor,
               scale: float, softcap: float, window: tuple[int, int], s_aux: torch.Tensor | None, *,
               generic: bool = False, cascade: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`paged_attention` on a kernel :func:`load` returned (a caller that looks it up once per
    step skips the per-call environment check); same arguments and results."""
    factor = scale / softcap if softcap > 0 else scale
    if q.stride(-1) != 1:
        q = q.contiguous()
    return kernel(q, k_pages, v_pages, block_table, seqlens_k, cu_seqlens_q, factor, softcap, int(window[0]),
                  int(window[1]), s_aux, _mode(generic, _CASCADE if cascade is None else cascade))


def _mode(generic: bool, cascade: bool) -> int:
    """The kernel's ``mode`` argument (``run`` in ``csrc/cpu_attention.cpp``): 1 the portable loops only, else the fast
    paths where they apply, 0 with the cascade, 2 without."""
    return 1 if generic else 0 if cascade else 2
