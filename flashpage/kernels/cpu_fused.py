"""One-pass C++ CPU ops for the engine's eager step: RMSNorm, activation-and-product, small-M linear, rotary
(optional).

An eager float32 RMSNorm is five or six ATen passes over the hidden state (pow, mean, add, rsqrt, mul,
mul), ``silu(gate) * up`` two (three with the allocation of the activation), the half-rotation RoPE
three or four per tensor. These ops do each in one pass per row, ``at::parallel_for`` over rows:

- :func:`rms_norm`: x (..., D), w (D,) -> ``x * rsqrt(mean(x^2) + eps) * (w + offset)`` (offset 0:
  Llama / Qwen; 1: Gemma). The sum of squares accumulates in float32 over 16 lanes (element i in lane
  ``i % 16``, the tail in the first lanes), the lanes are then added pairwise (a tree); the mean is that
  sum / D, the scale ``1 / sqrt(mean + eps)``, and each output ``(x * scale) * (w + offset)``, as
  transformers' modules order it. float64: one sequential double sum.
- :func:`act_and_mul`: gate, up (..., I) -> ``act(gate) * up`` as a new contiguous tensor; gate and up
  may be row-strided views (the two halves of one fused gate|up GEMM output). ``act``: "silu"
  (``g / (1 + exp(-g))``) or "gelu_tanh" (``g / 2 * (1 + tanh(sqrt(2 / pi) * (g + 0.044715 g^3)))``,
  tanh as ``1 - 2 / (1 + exp(2y))``); float32 exp is Cephes' polynomial (about 1 ulp).
- :func:`small_linear`: x (..., K) with a few rows (decode steps of one to four sequences), w (N, K), bias
  -> ``x @ w.T + bias`` (..., N), float32: each weight row read from memory once for all rows (AVX2 + FMA:
  eight weight rows at a time, eight 8-lane partial sums reduced by one ``hadd`` tree; portable: one dot per
  output). For the engine's linears where oneDNN's per-call cost exceeds the work
  (:mod:`flashpage.engine.linears`).
- :func:`rotary`: q (B, H, L, D), k (B, Hk, L, D) with cos / sin (B, L, D) (``unsqueeze_dim=1``), or
  q (B, L, H, D) with ``unsqueeze_dim=2``; D even, any strides with a contiguous last dim:
  ``x * cos + rotate_half(x) * sin`` for both, as new tensors (the inputs are never written: a model may
  still read them), laid out (B, L, H, D) in memory whatever the logical order, so the attention's
  transpose back to packed (T, H, D) rows is a view.

bfloat16 / float16 (``csrc/half.h``, ``half_fused.h``, ``half_linear.h``): float32 math on widened rows, rounded to
the dtype where transformers' eager modules round (each of their half-precision ops computes in float32 and rounds
its result): RMSNorm ``S(w * S(x * scale))`` (Llama / Qwen; Gemma's ``S(x * scale * (1 + w))`` with
``round_normed=False``), ``S(S(act(g)) * up)``, rotary ``S(S(x * cos) + S(rotate_half(x) * sin))``, so the fused
ops give the modules' own bits up to float32 rounding of an intermediate. ``small_linear`` in half precision:
float32 sums rounded once (AVX-512 BF16 ``vdpbf16ps`` where the build has ``__AVX512BF16__``, widened FMAs on
other AVX-512 builds, up to four rows at a time over each weight row; on builds without AVX-512, where torch's own
half-precision GEMM is scalar code, few rows as AVX2 FMAs on weights widened in registers and more as torch's float32
GEMM on weights widened a block at a time: the faster linear at every row count there, ``Ops.half_any_rows``).

float32 takes AVX-512 where the build has ``__AVX512F__``, 8-lane AVX2 + FMA for act_and_mul where it has those
(RMSNorm's and rotary's portable loops vectorize as they are), and portable loops otherwise; float64 the
portable loops. Results differ from torch's ops by float32 rounding only. The C++ is
``flashpage/kernels/csrc/cpu_fused.cpp`` (with ``csrc/common.h``), built like
:mod:`flashpage.kernels.cpu_attention` by :mod:`flashpage.kernels.cpp_build`: ``torch.utils.cpp_extension.load``
into torch's extension cache on first use (under a minute), one warning and ``None`` from :func:`load` without a
compiler or ninja, and the callers keep their torch ops. :mod:`flashpage.engine.fastpath` decides when
they run (``FLASHPAGE_FASTPATH=torch``: its torch forms only).
"""

from __future__ import annotations

import os
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from flashpage.kernels import cpp_build
from flashpage.kernels.cpp_build import missing_tools as _missing_tools  # a module global: tests replace it

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # act_and_mul's codes
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
HALF = (torch.bfloat16, torch.float16)
_VERSION = 6  # bump when the C++ source changes meaning (the sources' hash also rebuilds)
_SOURCES = ("cpu_fused.cpp",)  # in csrc/ (with common.h)
_PORTABLE_FLAGS = ("-DFLASHPAGE_FUSED_NS=flashpage_fused_portable",)  # no -march=native; ops in another namespace
# the tests' third build: -march=native without AVX-512 BF16 (the widened-FMA half-precision linear of AVX-512 CPUs
# that lack it), its ops in a third namespace
_NO_BF16_FLAGS = ("-mno-avx512bf16", "-DFLASHPAGE_FUSED_NS=flashpage_fused_nobf16")


@dataclass(frozen=True)
class Ops:
    """The built ops (``torch.ops.flashpage_fused`` overloads, looked up once: a call skips the packet)."""

    rms_norm: Any
    act_and_mul: Any
    rotary: Any
    small_linear: Any
    half_any_rows: bool = False  # small_linear in half precision is the faster linear at every row count here


@dataclass(frozen=True)
class Status:
    """Whether the fused C++ ops are available: ``name`` "cpp" or "torch", and why."""

    name: str
    reason: str


_lock = threading.Lock()
_ops: Ops | None = None
_failure: str | None = None  # why the ops are unavailable (set once)


def _sources() -> list[str]:
    return [cpp_build.source(name) for name in _SOURCES]


def _flags(portable: bool | str) -> list[str]:
    if portable == "no_bf16":
        return [*cpp_build.arch_flags(), *_NO_BF16_FLAGS]
    return list(_PORTABLE_FLAGS) if portable else cpp_build.arch_flags()


def _build_name(portable: bool | str = False) -> str:
    suffix = {False: "", True: "_portable", "no_bf16": "_nobf16"}[portable]
    return cpp_build.build_name(f"flashpage_cpu_fused{suffix}", _VERSION, _sources(), _flags(portable))


def _build(portable: bool | str = False) -> Ops:
    """Compile (or load from torch's extension cache) and return the registered ops. ``portable``: True, the
    build without -march=native (no AVX-512 path); "no_bf16", -march=native without AVX-512 BF16; each with its
    ops in another namespace (for the tests)."""
    cpp_build.jit_build(_build_name(portable), _sources(), _flags(portable))
    ns = {False: torch.ops.flashpage_fused, True: torch.ops.flashpage_fused_portable,
          "no_bf16": torch.ops.flashpage_fused_nobf16}[portable]
    return Ops(ns.rms_norm.default, ns.act_and_mul.default, ns.rotary.default, ns.small_linear.default,
               bool(ns.half_linear_any_rows.default()))


def load() -> Ops | None:
    """The built ops, building them on first use; None (after one warning) when they cannot be built here."""
    global _ops, _failure
    if _ops is not None or _failure is not None:
        return _ops
    with _lock:
        if _ops is None and _failure is None:
            _failure = _missing_tools()
            if _failure is None:
                try:
                    _ops = _build()
                except Exception as exc:  # a compiler error, a read-only cache, ...: the torch ops still run
                    _failure = f"build failed: {type(exc).__name__}: {str(exc).strip().splitlines()[-1:]}"
            if _failure is not None:
                warnings.warn(f"flashpage: the fused C++ CPU ops are unavailable ({_failure}); the engine's "
                              "norms / rotary / MLP activations run as torch ops (slower, same results).",
                              stacklevel=3)
    return _ops


def loaded() -> Ops | None:
    """The ops if already built or loaded in this process (never builds)."""
    return _ops


def status() -> Status:
    """Whether the ops are (or can be) built here, without compiling anything."""
    if _ops is not None:
        return Status("cpp", "one-pass C++ RMSNorm / activation-and-product / rotary (loaded)")
    reason = _failure or _missing_tools()
    if reason is not None:
        return Status("torch", f"C++ ops unavailable: {reason}")
    library = _library_path()
    if library is not None and os.path.exists(library):
        return Status("cpp", "one-pass C++ RMSNorm / activation-and-product / rotary (built, loaded on first use)")
    return Status("cpp", "one-pass C++ RMSNorm / activation-and-product / rotary (built on first use, then cached)")


def _library_path() -> str | None:
    """Where torch's extension cache keeps (or will keep) this build's shared library."""
    return cpp_build.library_path(_build_name())


def eligible(*tensors: torch.Tensor) -> bool:
    """Whether these tensors can take the ops: CPU, one float32 / float64 / bfloat16 / float16 dtype, no autograd to
    record."""
    dtype = tensors[0].dtype
    if dtype not in _DTYPES:
        return False
    for t in tensors:  # loops, not generators: this runs several times per layer of every step
        if not t.is_cpu or t.dtype != dtype:
            return False
    if torch.is_grad_enabled():
        for t in tensors:
            if t.requires_grad:
                return False
    return True


def rms_norm(ops: Ops, x: torch.Tensor, w: torch.Tensor, eps: float, offset: float = 0.0,
             round_normed: bool = True) -> torch.Tensor:
    """x (..., D), w (D,) -> (..., D) contiguous: ``x * rsqrt(mean(x^2, -1) + eps) * (w + offset)``.
    Half precision: ``round_normed`` rounds the normalised x to x's dtype before the weight (Llama / Qwen order),
    else one rounding at the end (Gemma order); no effect on float32 / float64."""
    return ops.rms_norm(x, w, eps, offset, round_normed)


def act_and_mul(ops: Ops, gate: torch.Tensor, up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """gate, up (..., I) (row-strided views allowed) -> ``act(gate) * up`` (..., I) contiguous;
    ``act`` "silu" or "gelu_tanh"."""
    return ops.act_and_mul(gate, up, ACTIVATIONS[act])


def small_linear(ops: Ops, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) with a few rows, w (N, K), bias (N,) or None, all float32 / bfloat16 / float16 of one dtype ->
    ``x @ w.T + bias`` (..., N) (half precision: float32 sums, one rounding)."""
    return ops.small_linear(x, w, bias)


def rotary(ops: Ops, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, L, D), k (B, Hk, L, D) (``unsqueeze_dim=1``) or (B, L, H, D) (2); cos, sin (B or 1, L, D);
    D even -> new (q, k) rotated by the half-rotation RoPE (inputs untouched)."""
    return ops.rotary(q, k, cos, sin, unsqueeze_dim)
