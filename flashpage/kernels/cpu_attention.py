"""A fused C++ paged-attention kernel for CPU tensors, JIT-built once per machine (optional).

The PyTorch reference gathers every sequence's pages into padded tensors and runs matmul +
softmax; this kernel reads K/V pages in place instead: one task per (sequence, KV head, tile of
query rows), an online softmax over the keys a row can see (causal and sliding-window masks are
intervals, so nothing is masked: only visible keys are visited), the G query heads of a GQA group
sharing each key / value load, ``at::parallel_for`` over the tasks. Same contract as the reference
(shared/design/flash-attn-contract.md section 3): bottom-right causal, sliding window, softcap,
attention sinks, a row with no visible key returns 0. float32 and float64 only; anything else
(half types, ALiBi, LSE, autograd) stays on the reference.

It is built with ``torch.utils.cpp_extension.load_inline`` into torch's extension cache
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) the first time a CPU attention
needs it (about a minute), and loaded from there afterwards. No compiler or no ninja: one warning,
and the reference runs. ``FLASHPAGE_CPU_ATTENTION=reference`` forces the reference;
:func:`status` says which one runs (``flashpage info`` prints it).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

ENV = "FLASHPAGE_CPU_ATTENTION"  # "reference" forces the PyTorch path; anything else / unset: auto
_DTYPES = (torch.float32, torch.float64)
_VERSION = 3  # bump when the C++ source changes meaning (the source hash also rebuilds)

_SOURCE = r"""
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kQueryTile = 32;  // query rows per task: long prefills split into several tasks
constexpr int64_t kGemmRows = 16;   // tiles with this many (query, head) rows use GEMMs per page

template <typename T>
struct Args {
  const T* q; int64_t q_t, q_h;                 // (T, H, D), last dim contiguous
  const T* k; int64_t k_b, k_p, k_h;            // (NB, P, Hk, D)
  const T* v; int64_t v_b, v_p, v_h;            // (NB, P, Hk, Dv)
  T* out; int64_t o_t, o_h;                     // (T, H, Dv)
  T* lse;                                       // (T, H): log-sum-exp per row, +inf without keys
  const int64_t* table; int64_t table_b, table_w;
  const int64_t* seqlens_k;
  const int64_t* cu_q;                          // (B + 1,) first query row per sequence
  const T* sinks;                               // (H,) or nullptr
  int64_t heads, kv_heads, d, dv, page;
  T factor, softcap;                            // q is multiplied by factor; softcap 0 = off
  int64_t left, right;                          // window sides, -1 unbounded (causal: right = 0)
};

template <typename T>
struct Work {  // per-thread scratch, reused across tasks
  std::vector<T> q, acc, m, l, s;
};

// Fixed-width lane loops: GCC vectorizes them without -ffast-math (no reassociation needed).
template <typename T>
inline T dot(const T* __restrict a, const T* __restrict b, int64_t n) {
  constexpr int kLanes = 64 / sizeof(T);  // two AVX2 registers (one AVX-512) of partial sums
  T acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int k = 0; k < kLanes; ++k) acc[k] += a[i + k] * b[i + k];
  T s = 0;
  for (int k = 0; k < kLanes; ++k) s += acc[k];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

template <typename T>
inline void axpy(T* __restrict o, const T* __restrict v, T p, int64_t n) {
  for (int64_t x = 0; x < n; ++x) o[x] += p * v[x];
}

template <typename T>
inline void scale_row(T* __restrict o, T alpha, int64_t n) {
  for (int64_t x = 0; x < n; ++x) o[x] *= alpha;
}

// s[j] = exp(s[j] - m) for s[j] <= m; returns the sum. float: Cephes' expf polynomial (about 1 ulp),
// written so that GCC vectorizes it; double: std::exp.
inline float exp_nonpositive(float x) {
  x = x < -87.3f ? -87.3f : x;  // exp(-87.3) ~ 1e-38: below, 0 for every purpose here
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

inline float exp_shifted(float* __restrict s, int64_t n, float m) {
  for (int64_t j = 0; j < n; ++j) s[j] = exp_nonpositive(s[j] - m);
  constexpr int kLanes = 16;
  float acc[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int k = 0; k < kLanes; ++k) acc[k] += s[j + k];
  float sum = 0;
  for (int k = 0; k < kLanes; ++k) sum += acc[k];
  for (; j < n; ++j) sum += s[j];
  return sum;
}

inline double exp_shifted(double* s, int64_t n, double m) {
  double sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    s[j] = std::exp(s[j] - m);
    sum += s[j];
  }
  return sum;
}

// o (R x dv, row stride dv) += p (R x n, row stride n) . V (n rows at stride vs): the R rows'
// accumulators stay in registers over the keys, one block of dv at a time (GCC vector types).
template <typename T, int R>
void pv_fixed(T* o, const T* p, const T* v, int64_t vs, int64_t n, int64_t dv) {
  constexpr int W = 64 / sizeof(T);
  typedef T V __attribute__((vector_size(64)));
  int64_t x = 0;
  for (; x + W <= dv; x += W) {
    V acc[R];
    for (int r = 0; r < R; ++r) std::memcpy(&acc[r], o + r * dv + x, sizeof(V));
    for (int64_t j = 0; j < n; ++j) {
      V vv;
      std::memcpy(&vv, v + j * vs + x, sizeof(V));
      for (int r = 0; r < R; ++r) acc[r] += p[r * n + j] * vv;
    }
    for (int r = 0; r < R; ++r) std::memcpy(o + r * dv + x, &acc[r], sizeof(V));
  }
  for (; x < dv; ++x)
    for (int r = 0; r < R; ++r) {
      T acc = o[r * dv + x];
      for (int64_t j = 0; j < n; ++j) acc += p[r * n + j] * v[j * vs + x];
      o[r * dv + x] = acc;
    }
}

template <typename T>
void pv_rows(T* o, const T* p, const T* v, int64_t vs, int64_t rows, int64_t n, int64_t dv) {
  switch (rows) {
    case 8: return pv_fixed<T, 8>(o, p, v, vs, n, dv);
    case 4: return pv_fixed<T, 4>(o, p, v, vs, n, dv);
    case 2: return pv_fixed<T, 2>(o, p, v, vs, n, dv);
    case 1: return pv_fixed<T, 1>(o, p, v, vs, n, dv);
    default:
      for (int64_t r = 0; r < rows; ++r) pv_fixed<T, 1>(o + r * dv, p + r * n, v, vs, n, dv);
  }
}

// The tile's queries times the softmax factor, and the running max / sum initialised (sinks: the
// sink logit is a key every row sees, with no value).
template <typename T>
void start_tile(const Args<T>& a, int64_t b, int64_t hk, int64_t i0, int64_t i1, Work<T>& w) {
  const int64_t group = a.heads / a.kv_heads, d = a.d;
  const int64_t rows = (i1 - i0) * group;
  w.q.resize(rows * a.d);
  w.acc.assign(rows * a.dv, T(0));
  w.m.resize(rows);
  w.l.resize(rows);
  for (int64_t i = i0; i < i1; ++i) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = (i - i0) * group + g, h = hk * group + g;
      const T* src = a.q + (a.cu_q[b] + i) * a.q_t + h * a.q_h;
      T* dst = w.q.data() + r * d;
      for (int64_t x = 0; x < d; ++x) dst[x] = src[x] * a.factor;
      w.m[r] = a.sinks ? a.sinks[h] : -std::numeric_limits<T>::infinity();
      w.l[r] = a.sinks ? T(1) : T(0);
    }
  }
}

// out rows = acc / l, or 0 where a row saw no key (and no sink).
template <typename T>
void finish_tile(const Args<T>& a, int64_t b, int64_t hk, int64_t i0, int64_t i1, const Work<T>& w) {
  const int64_t group = a.heads / a.kv_heads, dv = a.dv;
  for (int64_t i = i0; i < i1; ++i) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = (i - i0) * group + g, h = hk * group + g;
      T* dst = a.out + (a.cu_q[b] + i) * a.o_t + h * a.o_h;
      const T* o = w.acc.data() + r * dv;
      const T inv = w.l[r] > 0 ? T(1) / w.l[r] : T(0);
      for (int64_t x = 0; x < dv; ++x) dst[x] = o[x] * inv;
      a.lse[(a.cu_q[b] + i) * a.heads + h] =
          w.l[r] > 0 ? w.m[r] + std::log(w.l[r]) : std::numeric_limits<T>::infinity();
    }
  }
}

// Online-softmax update of row r with scores s[0, n) (softcap already applied): s becomes the
// probabilities relative to the new running max; acc row is rescaled when the max grows.
template <typename T>
inline void softmax_update(Work<T>& w, int64_t r, int64_t dv, T* s, int64_t n) {
  T cmax = -std::numeric_limits<T>::infinity();
  for (int64_t j = 0; j < n; ++j) cmax = std::max(cmax, s[j]);
  if (cmax > w.m[r]) {
    const T alpha = std::exp(w.m[r] - cmax);  // exp(-inf) = 0 on a row's first keys
    w.l[r] *= alpha;
    scale_row(w.acc.data() + r * dv, alpha, dv);
    w.m[r] = cmax;
  }
  w.l[r] += exp_shifted(s, n, w.m[r]);
}

// The keys row i of sequence b sees, within [j0, j1): row i sees [i + shift - left, i + shift + right].
template <typename T>
inline void row_span(const Args<T>& a, int64_t i, int64_t shift, int64_t j0, int64_t j1, int64_t& s0, int64_t& s1) {
  s0 = j0;
  s1 = j1;
  if (a.left >= 0) s0 = std::max(s0, i + shift - a.left);
  if (a.right >= 0) s1 = std::min(s1, i + shift + a.right + 1);
}

// Rows i0 .. i1-1 of sequence b, KV head hk, every head of the group. Few rows (decodes): scalar
// loops per key. Many rows (prefill tiles): one GEMM per page for Q.K^T and one for P.V, on the
// pages in place (strided views, no copy).
template <typename T>
void attend_tile(const Args<T>& a, int64_t b, int64_t hk, int64_t i0, int64_t i1, Work<T>& w) {
  const int64_t group = a.heads / a.kv_heads, d = a.d, dv = a.dv;
  const int64_t sq = a.cu_q[b + 1] - a.cu_q[b], shift = a.seqlens_k[b] - sq;
  const int64_t sk = std::min(a.seqlens_k[b], a.table_w * a.page);  // keys past the table do not exist
  const int64_t rows = (i1 - i0) * group;
  const bool gemm = rows >= kGemmRows;
  start_tile(a, b, hk, i0, i1, w);
  w.s.resize((gemm ? rows : group) * a.page);
  int64_t lo = 0, hi = sk;  // keys the whole tile can see
  if (a.left >= 0) lo = std::max<int64_t>(0, i0 + shift - a.left);
  if (a.right >= 0) hi = std::min<int64_t>(sk, i1 - 1 + shift + a.right + 1);
  const int64_t* table = a.table + b * a.table_b;
  const auto opts = at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value);
  for (int64_t p = lo / a.page; p * a.page < hi; ++p) {
    const int64_t blk = table[p];
    const T* kp = a.k + blk * a.k_b + hk * a.k_h;
    const T* vp = a.v + blk * a.v_b + hk * a.v_h;
    const int64_t j0 = std::max(lo, p * a.page), j1 = std::min(hi, (p + 1) * a.page), n = j1 - j0;
    const T* k0 = kp + (j0 - p * a.page) * a.k_p;
    const T* v0 = vp + (j0 - p * a.page) * a.v_p;
    if (gemm) {
      auto qt = at::from_blob(w.q.data(), {rows, d}, opts);
      auto kt = at::from_blob(const_cast<T*>(k0), {n, d}, {a.k_p, 1}, opts);
      auto vt = at::from_blob(const_cast<T*>(v0), {n, dv}, {a.v_p, 1}, opts);
      auto st = at::from_blob(w.s.data(), {rows, n}, opts);
      auto ot = at::from_blob(w.acc.data(), {rows, dv}, opts);
      at::mm_out(st, qt, kt.t());
      for (int64_t i = i0; i < i1; ++i) {
        int64_t s0, s1;
        row_span(a, i, shift, j0, j1, s0, s1);
        for (int64_t g = 0; g < group; ++g) {
          const int64_t r = (i - i0) * group + g;
          T* srow = w.s.data() + r * n;
          if (s0 >= s1) {
            std::fill(srow, srow + n, T(0));
            continue;
          }
          if (a.softcap > 0)
            for (int64_t j = s0 - j0; j < s1 - j0; ++j) srow[j] = a.softcap * std::tanh(srow[j]);
          softmax_update(w, r, dv, srow + (s0 - j0), s1 - s0);
          std::fill(srow, srow + (s0 - j0), T(0));
          std::fill(srow + (s1 - j0), srow + n, T(0));
        }
      }
      ot.addmm_(st, vt);
      continue;
    }
    for (int64_t i = i0; i < i1; ++i) {
      int64_t s0, s1;
      row_span(a, i, shift, j0, j1, s0, s1);
      if (s0 >= s1) continue;
      // the group's rows together: each key / value row is loaded once for all of them
      const int64_t n_i = s1 - s0, r0 = (i - i0) * group;
      const T* kj0 = k0 + (s0 - j0) * a.k_p;
      for (int64_t j = 0; j < n_i; ++j)
        for (int64_t g = 0; g < group; ++g) {
          const T s = dot(w.q.data() + (r0 + g) * d, kj0 + j * a.k_p, d);
          w.s[g * n_i + j] = a.softcap > 0 ? a.softcap * std::tanh(s) : s;
        }
      for (int64_t g = 0; g < group; ++g) softmax_update(w, r0 + g, dv, w.s.data() + g * n_i, n_i);
      for (int64_t g = 0; g < group; g += 8) {
        const int64_t rows_g = std::min<int64_t>(8, group - g);
        pv_rows(w.acc.data() + (r0 + g) * dv, w.s.data() + g * n_i, v0 + (s0 - j0) * a.v_p, a.v_p, rows_g, n_i,
                dv);
      }
    }
  }
  finish_tile(a, b, hk, i0, i1, w);
}

template <typename T>
void run(const Args<T>& a, int64_t batch) {
  std::vector<int64_t> tasks;  // (sequence, first query row) pairs
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < a.cu_q[b + 1] - a.cu_q[b]; i += kQueryTile) {
      tasks.push_back(b);
      tasks.push_back(i);
    }
  const int64_t n = static_cast<int64_t>(tasks.size() / 2) * a.kv_heads;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    Work<T> w;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t task = t / a.kv_heads, hk = t % a.kv_heads;
      const int64_t b = tasks[2 * task], i0 = tasks[2 * task + 1];
      const int64_t i1 = std::min(i0 + kQueryTile, a.cu_q[b + 1] - a.cu_q[b]);
      attend_tile(a, b, hk, i0, i1, w);
    }
  });
}

}  // namespace

// q (T, H, D) with rows cu_q[b] .. cu_q[b+1]-1 for sequence b; returns out (T, H, Dv), lse (T, H).
std::tuple<at::Tensor, at::Tensor> paged_attention(
    const at::Tensor& q, const at::Tensor& k_pages, const at::Tensor& v_pages, const at::Tensor& block_table,
    const at::Tensor& seqlens_k, const at::Tensor& cu_seqlens_q, double factor, double softcap, int64_t left,
    int64_t right, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && k_pages.dim() == 4 && v_pages.dim() == 4, "paged_attention: bad ranks");
  TORCH_CHECK(q.stride(2) == 1 && k_pages.stride(3) == 1 && v_pages.stride(3) == 1,
              "paged_attention: last dims must be contiguous");
  TORCH_CHECK(k_pages.scalar_type() == q.scalar_type() && v_pages.scalar_type() == q.scalar_type(),
              "paged_attention: q and pages must share a dtype");
  auto table = block_table.to(at::kLong).contiguous();
  auto lens = seqlens_k.to(at::kLong).contiguous();
  auto cu = cu_seqlens_q.to(at::kLong).contiguous();
  const int64_t batch = table.size(0);
  TORCH_CHECK(lens.numel() == batch && cu.numel() == batch + 1, "paged_attention: batch mismatch");
  auto out = at::empty({q.size(0), q.size(1), v_pages.size(3)}, q.options());
  auto lse = at::empty({q.size(0), q.size(1)}, q.options());
  if (cu[batch].item<int64_t>() != q.size(0) || cu[0].item<int64_t>() != 0) {  // rows no sequence owns: 0, +inf
    out.zero_();
    lse.fill_(std::numeric_limits<double>::infinity());
  }
  at::Tensor sink_t;
  if (sinks.has_value() && sinks->defined()) sink_t = sinks->to(q.scalar_type()).contiguous();
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "paged_attention", [&] {
    Args<scalar_t> a;
    a.q = q.data_ptr<scalar_t>(); a.q_t = q.stride(0); a.q_h = q.stride(1);
    a.k = k_pages.data_ptr<scalar_t>(); a.k_b = k_pages.stride(0); a.k_p = k_pages.stride(1);
    a.k_h = k_pages.stride(2);
    a.v = v_pages.data_ptr<scalar_t>(); a.v_b = v_pages.stride(0); a.v_p = v_pages.stride(1);
    a.v_h = v_pages.stride(2);
    a.out = out.data_ptr<scalar_t>(); a.o_t = out.stride(0); a.o_h = out.stride(1);
    a.lse = lse.data_ptr<scalar_t>();
    a.table = table.data_ptr<int64_t>(); a.table_b = table.stride(0); a.table_w = table.size(1);
    a.seqlens_k = lens.data_ptr<int64_t>();
    a.cu_q = cu.data_ptr<int64_t>();
    a.sinks = sink_t.defined() ? sink_t.data_ptr<scalar_t>() : nullptr;
    a.heads = q.size(1); a.kv_heads = k_pages.size(2); a.d = q.size(2); a.dv = v_pages.size(3);
    a.page = k_pages.size(1);
    a.factor = static_cast<scalar_t>(factor); a.softcap = static_cast<scalar_t>(softcap);
    a.left = left; a.right = right;
    run(a, batch);
  });
  return {out, lse};
}

TORCH_LIBRARY(flashpage_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k_pages, Tensor v_pages, Tensor block_table, Tensor seqlens_k, "
        "Tensor cu_seqlens_q, float factor, float softcap, int left, int right, Tensor? sinks) -> (Tensor, Tensor)");
  m.impl("paged_attention", c10::DispatchKey::CPU, TORCH_FN(paged_attention));
}
"""


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


def _arch_flags() -> list[str]:
    """-march=native where the compiler supports it (x86-64, aarch64): the build is per machine."""
    return ["-march=native"] if platform.machine().lower() in ("x86_64", "amd64", "aarch64", "arm64") else []


def _build_name() -> str:
    """Extension name: the source, flags and this CPU (-march=native builds are per CPU model)."""
    cpu = platform.machine() + platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            cpu += "".join(line for line in fh.read().splitlines()[:40] if line.startswith(("model name", "flags")))
    except OSError:
        pass
    digest = hashlib.sha1((_SOURCE + cpu + " ".join(_arch_flags()) + torch.__version__).encode()).hexdigest()
    return f"flashpage_cpu_attention_v{_VERSION}_{digest[:12]}"


def _missing_tools() -> str | None:
    """Why a build cannot start here (no C++ compiler / no ninja), or None."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None and shutil.which("g++") is None:
        return f"no C++ compiler ({cxx!r} / g++ not on PATH)"
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        try:  # the ninja wheel (a core dependency) outside an activated venv: its binary is not on PATH
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except (ImportError, AttributeError):
            pass
    if not cpp_extension.is_ninja_available():
        return "ninja not found (pip install ninja)"
    return None


def _build() -> Callable[..., torch.Tensor]:
    """Compile (or load from torch's extension cache) and return the registered op."""
    import inspect

    from torch.utils import cpp_extension

    extra = {}
    if "no_implicit_headers" in inspect.signature(cpp_extension.load_inline).parameters:
        extra["no_implicit_headers"] = True  # the source includes only the ATen headers it needs: faster build
    cpp_extension.load_inline(
        name=_build_name(), cpp_sources=[_SOURCE], functions=None, is_python_module=False,
        extra_cflags=["-O3", "-fopenmp", "-fno-math-errno", *_arch_flags()], extra_ldflags=["-fopenmp"],
        verbose=False, **extra,
    )
    return torch.ops.flashpage_cpu.paged_attention


def load() -> Callable[..., torch.Tensor] | None:
    """The built kernel (a torch op), building it on first use; None (after one warning) when it cannot
    be built here or is forced off with ``FLASHPAGE_CPU_ATTENTION=reference``."""
    global _module, _failure
    if _module is not None or _forced_reference():
        return None if _forced_reference() else _module
    if _failure is not None:
        return None
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
    try:
        from torch.utils import cpp_extension

        name = _build_name()
        return os.path.join(cpp_extension._get_build_directory(name, verbose=False), f"{name}.so")
    except Exception:  # a private torch helper: only used for the report
        return None


def eligible(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> bool:
    """Whether these tensors can take the kernel (it still may be unavailable: see :func:`load`)."""
    if q.device.type != "cpu" or q.dtype not in _DTYPES or k_pages.dtype != q.dtype or v_pages.dtype != q.dtype:
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
                    window: tuple[int, int], s_aux: torch.Tensor | None,
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Paged attention of packed queries, or None when the kernel is unavailable (caller falls back).

    q: (T, H, D) float32/float64, sequence b's rows ``cu_seqlens_q[b] .. cu_seqlens_q[b+1] - 1``;
    k_pages / v_pages: (NB, P, Hk, D|Dv); block_table: (B, M) int (columns past a sequence's keys
    are never read); seqlens_k: (B,) keys visible; ``window``: (left, right) with causal folded in
    (:func:`window_sides`), -1 unbounded; s_aux: (H,) sink logits or None. Returns out (T, H, Dv)
    in q's dtype and the log-sum-exp (T, H) (+inf for a row that sees no key).
    """
    kernel = load()
    if kernel is None:
        return None
    factor = scale / softcap if softcap > 0 else scale
    if q.stride(-1) != 1:
        q = q.contiguous()
    return kernel(q, k_pages, v_pages, block_table, seqlens_k, cu_seqlens_q, factor, softcap, int(window[0]),
                  int(window[1]), s_aux)
