// flashpage's C++ CPU paged-attention kernel and K/V store: the ops flashpage_cpu::paged_attention and
// flashpage_cpu::store_kv (torch.ops.flashpage_cpu), which flashpage/kernels/cpu_attention.py builds with
// torch.utils.cpp_extension.load once per machine (-O3 -fopenmp -fno-math-errno -march=native) and calls.
// The design notes (tiles, decode paths, cascade, masks) are in that module's docstring.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <type_traits>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#include <cstring>
#include <limits>
#include <vector>

#include "common.h"
#include "half.h"

namespace {

constexpr int64_t kQueryTile = 32;  // query rows per task: long prefills split into several tasks
constexpr int64_t kDecodeRows = 4;  // float32 AVX-512 tiles with at most this many query rows: attend_decode
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
  std::vector<int64_t> span;  // per row: its visible keys [span[2r], span[2r + 1]) within the page
};


#if defined(__AVX2__) && defined(__FMA__)
// float32 scores s[r * n + j] = q_r . k_j of `rows` query rows (row stride d) and n keys (row stride ks), for
// d % 8 == 0 (AVX2 + FMA): eight keys at a time, each with its own 8-lane partial sums, reduced together by
// one hadd tree into the eight scores; a key costs d / 8 FMAs per row instead of a dot with a scalar reduction.
inline void qk_rows_avx2(const float* q, int64_t rows, const float* k, int64_t ks, int64_t n, int64_t d, float* s) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* qr = q + r * d;
    float* sr = s + r * n;
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      __m256 acc[8];
      for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
      for (int64_t x = 0; x < d; x += 8) {
        const __m256 qv = _mm256_loadu_ps(qr + x);
        for (int u = 0; u < 8; ++u) acc[u] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + (j + u) * ks + x), acc[u]);
      }
      _mm256_storeu_ps(sr + j, hsum8x8(acc));
    }
    for (; j < n; ++j) sr[j] = dot(qr, k + j * ks, d);
  }
}

// o (R rows, row stride dv) += p (R rows, row stride n) . V (n rows at stride vs), float32 AVX2 + FMA: the R rows'
// accumulators for 16 (then 8) columns stay in registers over the keys; each value vector is loaded once for
// the R rows.
template <int R>
inline void pv_avx2(float* o, const float* p, const float* v, int64_t vs, int64_t n, int64_t dv) {
  int64_t x = 0;
  for (; x + 16 <= dv; x += 16) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) {
      acc[r][0] = _mm256_loadu_ps(o + r * dv + x);
      acc[r][1] = _mm256_loadu_ps(o + r * dv + x + 8);
    }
    for (int64_t j = 0; j < n; ++j) {
      const __m256 v0 = _mm256_loadu_ps(v + j * vs + x), v1 = _mm256_loadu_ps(v + j * vs + x + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 pb = _mm256_broadcast_ss(p + r * n + j);
        acc[r][0] = _mm256_fmadd_ps(pb, v0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(pb, v1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(o + r * dv + x, acc[r][0]);
      _mm256_storeu_ps(o + r * dv + x + 8, acc[r][1]);
    }
  }
  for (; x + 8 <= dv; x += 8) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_loadu_ps(o + r * dv + x);
    for (int64_t j = 0; j < n; ++j) {
      const __m256 v0 = _mm256_loadu_ps(v + j * vs + x);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + r * n + j), v0, acc[r]);
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(o + r * dv + x, acc[r]);
  }
  for (; x < dv; ++x)
    for (int r = 0; r < R; ++r) {
      float acc = o[r * dv + x];
      for (int64_t j = 0; j < n; ++j) acc += p[r * n + j] * v[j * vs + x];
      o[r * dv + x] = acc;
    }
}

inline void pv_rows_avx2(float* o, const float* p, const float* v, int64_t vs, int64_t rows, int64_t n, int64_t dv) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) pv_avx2<4>(o + r * dv, p + r * n, v, vs, n, dv);
  for (; r + 2 <= rows; r += 2) pv_avx2<2>(o + r * dv, p + r * n, v, vs, n, dv);
  for (; r < rows; ++r) pv_avx2<1>(o + r * dv, p + r * n, v, vs, n, dv);
}

inline float hmax8(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float hsum8(__m256 x) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

// max of s[0, n)
inline float max_avx2(const float* s, int64_t n) {
  __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + j));
  float m = hmax8(vmax);
  for (; j < n; ++j) m = std::max(m, s[j]);
  return m;
}

// s[j] = exp(s[j] - m) (s[j] <= m) for j < n; returns their sum (8 lanes, then the tail).
inline float exp_shifted_avx2(float* s, int64_t n, float m) {
  const __m256 vm = _mm256_set1_ps(m), lo = _mm256_set1_ps(-87.3f);
  __m256 sum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp_poly8(_mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm), lo));
    _mm256_storeu_ps(s + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  float total = hsum8(sum);
  for (; j < n; ++j) {
    s[j] = exp_poly(std::max(s[j] - m, -87.3f));
    total += s[j];
  }
  return total;
}
#endif

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
  return exp_poly(x < -87.3f ? -87.3f : x);  // exp(-87.3) ~ 1e-38: below, 0 for every purpose here
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
// sink logit is a key every row sees, with no value). KV heads h0 .. h1-1: row r = ((hk - h0) * (i1 - i0) +
// i - i0) * group + g holds query row i, head hk * group + g.
// init_rows fills the rows from `at` on (w already sized); start_tile sizes w for one tile and fills it.
template <typename T>
void init_rows(const Args<T>& a, int64_t b, int64_t h0, int64_t h1, int64_t i0, int64_t i1, Work<T>& w, int64_t at) {
  const int64_t group = a.heads / a.kv_heads, d = a.d;
  for (int64_t hk = h0; hk < h1; ++hk)
    for (int64_t i = i0; i < i1; ++i)
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = at + ((hk - h0) * (i1 - i0) + i - i0) * group + g, h = hk * group + g;
        const T* src = a.q + (a.cu_q[b] + i) * a.q_t + h * a.q_h;
        T* dst = w.q.data() + r * d;
        for (int64_t x = 0; x < d; ++x) dst[x] = src[x] * a.factor;
        w.m[r] = a.sinks ? a.sinks[h] : -std::numeric_limits<T>::infinity();
        w.l[r] = a.sinks ? T(1) : T(0);
        std::fill_n(w.acc.data() + r * a.dv, a.dv, T(0));
      }
}

template <typename T>
void size_rows(Work<T>& w, int64_t rows, int64_t d, int64_t dv) {
  w.q.resize(rows * d);
  w.acc.resize(rows * dv);
  w.m.resize(rows);
  w.l.resize(rows);
}

template <typename T>
void start_tile(const Args<T>& a, int64_t b, int64_t h0, int64_t h1, int64_t i0, int64_t i1, Work<T>& w) {
  size_rows(w, (h1 - h0) * (i1 - i0) * (a.heads / a.kv_heads), a.d, a.dv);
  init_rows(a, b, h0, h1, i0, i1, w, 0);
}

// out rows = acc / l, or 0 where a row saw no key (and no sink); rows ordered as in start_tile.
template <typename T>
void finish_tile(const Args<T>& a, int64_t b, int64_t h0, int64_t h1, int64_t i0, int64_t i1, const Work<T>& w) {
  const int64_t group = a.heads / a.kv_heads, dv = a.dv;
  for (int64_t hk = h0; hk < h1; ++hk)
    for (int64_t i = i0; i < i1; ++i)
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = ((hk - h0) * (i1 - i0) + i - i0) * group + g, h = hk * group + g;
        T* dst = a.out + (a.cu_q[b] + i) * a.o_t + h * a.o_h;
        const T* o = w.acc.data() + r * dv;
        const T inv = w.l[r] > 0 ? T(1) / w.l[r] : T(0);
        for (int64_t x = 0; x < dv; ++x) dst[x] = o[x] * inv;
        a.lse[(a.cu_q[b] + i) * a.heads + h] =
            w.l[r] > 0 ? w.m[r] + std::log(w.l[r]) : std::numeric_limits<T>::infinity();
      }
}

// max of s[0, n): 8 lanes where `vec` (float32, AVX2 + FMA build), else one by one.
template <typename T>
inline T max_of(bool vec, const T* s, int64_t n) {
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float>) {
    if (vec) return max_avx2(s, n);
  }
#endif
  T cmax = -std::numeric_limits<T>::infinity();
  for (int64_t j = 0; j < n; ++j) cmax = std::max(cmax, s[j]);
  return cmax;
}

// exp_shifted on 8 lanes where `vec` (float32, AVX2 + FMA build), else the portable loop.
template <typename T>
inline T exp_shifted_vec(bool vec, T* s, int64_t n, T m) {
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float>) {
    if (vec) return exp_shifted_avx2(s, n, m);
  }
#endif
  return exp_shifted(s, n, m);
}

// Online-softmax update of row r with scores s[0, n) (softcap already applied): s becomes the
// probabilities relative to the new running max; acc row is rescaled when the max grows.
// `vec`: float32 takes the 8-lane max and exp (AVX2 + FMA builds).
template <typename T>
inline void softmax_update(Work<T>& w, int64_t r, int64_t dv, T* s, int64_t n, bool vec = false) {
  const T cmax = max_of(vec, s, n);
  if (cmax > w.m[r]) {
    const T alpha = std::exp(w.m[r] - cmax);  // exp(-inf) = 0 on a row's first keys
    w.l[r] *= alpha;
    scale_row(w.acc.data() + r * dv, alpha, dv);
    w.m[r] = cmax;
  }
  w.l[r] += exp_shifted_vec(vec, s, n, w.m[r]);
}

// The keys row i of sequence b sees, within [j0, j1): row i sees [i + shift - left, i + shift + right].
template <typename T>
inline void row_span(const Args<T>& a, int64_t i, int64_t shift, int64_t j0, int64_t j1, int64_t& s0, int64_t& s1) {
  s0 = j0;
  s1 = j1;
  if (a.left >= 0) s0 = std::max(s0, i + shift - a.left);
  if (a.right >= 0) s1 = std::min(s1, i + shift + a.right + 1);
}

// The keys [lo, hi) some row of the tile i0 .. i1-1 of sequence b can see (keys past the table do not exist).
template <typename T>
inline void tile_keys(const Args<T>& a, int64_t b, int64_t i0, int64_t i1, int64_t& lo, int64_t& hi) {
  const int64_t shift = a.seqlens_k[b] - (a.cu_q[b + 1] - a.cu_q[b]);
  lo = 0;
  hi = std::min(a.seqlens_k[b], a.table_w * a.page);
  if (a.left >= 0) lo = std::max<int64_t>(0, i0 + shift - a.left);
  if (a.right >= 0) hi = std::min<int64_t>(hi, i1 - 1 + shift + a.right + 1);
}

// The scores s[r * n + j] of `rows` query rows against n keys through the vector loop (float32, AVX2 + FMA,
// d % 8 == 0, `vec`: not the portable mode), or false: the caller's per-key loop.
template <typename T>
inline bool qk_rows_vec(bool vec, const T* q, int64_t rows, const T* k, int64_t ks, int64_t n, int64_t d, T* s) {
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float>) {
    if (vec && d % 8 == 0) {
      qk_rows_avx2(q, rows, k, ks, n, d, s);
      return true;
    }
  }
#endif
  return false;
}

// o (rows, row stride dv) += p (rows, row stride n) . V through the AVX2 loop (float32, `vec`), else the portable one.
template <typename T>
inline void pv_rows_vec(bool vec, T* o, const T* p, const T* v, int64_t vs, int64_t rows, int64_t n, int64_t dv) {
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float>) {
    if (vec) return pv_rows_avx2(o, p, v, vs, rows, n, dv);
  }
#endif
  for (int64_t g = 0; g < rows; g += 8) pv_rows(o + g * dv, p + g * n, v, vs, std::min<int64_t>(8, rows - g), n, dv);
}

// Rows i0 .. i1-1 of sequence b, KV head hk, every head of the group. Few rows (decodes): loops per key,
// 8-lane AVX2 scores, softmax and P.V where `vec` (float32 on an AVX2 + FMA build), scalar otherwise. Many
// rows (prefill tiles): one GEMM per page for Q.K^T and one for P.V, on the pages in place (strided views, no
// copy), the softmax as for decodes.
template <typename T>
void attend_tile(const Args<T>& a, int64_t b, int64_t hk, int64_t i0, int64_t i1, Work<T>& w, bool vec) {
  const int64_t group = a.heads / a.kv_heads, d = a.d, dv = a.dv;
  const int64_t sq = a.cu_q[b + 1] - a.cu_q[b], shift = a.seqlens_k[b] - sq;
  const int64_t sk = std::min(a.seqlens_k[b], a.table_w * a.page);  // keys past the table do not exist
  const int64_t rows = (i1 - i0) * group;
  const bool gemm = rows >= kGemmRows;
  start_tile(a, b, hk, hk + 1, i0, i1, w);
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
          softmax_update(w, r, dv, srow + (s0 - j0), s1 - s0, vec);
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
      if (!qk_rows_vec(vec, w.q.data() + r0 * d, group, kj0, a.k_p, n_i, d, w.s.data()))
        for (int64_t j = 0; j < n_i; ++j)
          for (int64_t g = 0; g < group; ++g) w.s[g * n_i + j] = dot(w.q.data() + (r0 + g) * d, kj0 + j * a.k_p, d);
      if (a.softcap > 0)
        for (int64_t x = 0; x < group * n_i; ++x) w.s[x] = a.softcap * std::tanh(w.s[x]);
      for (int64_t g = 0; g < group; ++g) softmax_update(w, r0 + g, dv, w.s.data() + g * n_i, n_i, vec);
      pv_rows_vec(vec, w.acc.data() + r0 * dv, w.s.data(), v0 + (s0 - j0) * a.v_p, a.v_p, group, n_i, dv);
    }
  }
  finish_tile(a, b, hk, hk + 1, i0, i1, w);
}


#if defined(__AVX512F__)
// ---------------------------------------------------------------- float32, AVX-512
// Scores without a horizontal sum per key: 16 keys' partial dot products (one vector each) are
// reduced together by a shuffle tree into one vector of 16 scores; P.V keeps R rows x NV vectors of
// accumulators in registers. Used for every tile of a float32 call on a CPU with AVX-512.
namespace fast {

inline __mmask16 lanes(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u); }

// r[k] (k = 0..15) -> one vector whose lane k is the sum of r[k]'s 16 lanes.
inline __m512 hsum16(__m512* r) {
  __m512 t[8], u[4], w[2];
  for (int p = 0; p < 8; ++p)  // [a0+a2, a1+a3, b0+b2, b1+b3] (128-bit lanes) for a = r[2p], b = r[2p+1]
    t[p] = _mm512_add_ps(_mm512_shuffle_f32x4(r[2 * p], r[2 * p + 1], 0x44),
                         _mm512_shuffle_f32x4(r[2 * p], r[2 * p + 1], 0xEE));
  for (int q = 0; q < 4; ++q)  // 128-bit lane L: key 4q + L's four partial sums
    u[q] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * q], t[2 * q + 1], 0x88),
                         _mm512_shuffle_f32x4(t[2 * q], t[2 * q + 1], 0xDD));
  for (int q = 0; q < 2; ++q)  // lane L: [x02, y02, x13, y13] for keys x = 8q + L, y = 8q + 4 + L
    w[q] = _mm512_add_ps(_mm512_unpacklo_ps(u[2 * q], u[2 * q + 1]), _mm512_unpackhi_ps(u[2 * q], u[2 * q + 1]));
  // lane L: keys L, 4 + L, 8 + L, 12 + L: position 4L + m holds key 4m + L
  const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x44), _mm512_shuffle_ps(w[0], w[1], 0xEE));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, f);
}

// s[j] = q . k_j for j in [0, n): q (d floats, d <= 16 NQ), key j at k + j * ks.
template <int NQ>
void qk_row(const float* q, const float* k, int64_t ks, int64_t n, int64_t d, float* s) {
  const __mmask16 tail = lanes(d - 16 * (NQ - 1));
  __m512 qv[NQ];
  for (int c = 0; c < NQ; ++c) qv[c] = _mm512_maskz_loadu_ps(c == NQ - 1 ? tail : __mmask16(0xFFFF), q + 16 * c);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t nk = std::min<int64_t>(16, n - j0);
    __m512 r[16];
    for (int j = 0; j < 16; ++j) {
      r[j] = _mm512_setzero_ps();
      if (j >= nk) continue;
      const float* kj = k + (j0 + j) * ks;
      for (int c = 0; c < NQ; ++c)
        r[j] = _mm512_fmadd_ps(qv[c], _mm512_maskz_loadu_ps(c == NQ - 1 ? tail : __mmask16(0xFFFF), kj + 16 * c),
                               r[j]);
    }
    _mm512_mask_storeu_ps(s + j0, lanes(nk), hsum16(r));
  }
}

using QkFn = void (*)(const float*, const float*, int64_t, int64_t, int64_t, float*);
inline QkFn qk_for(int64_t d) {
  switch ((d + 15) / 16) {
    case 1: return qk_row<1>;
    case 2: return qk_row<2>;
    case 3: return qk_row<3>;
    case 4: return qk_row<4>;
    case 5: return qk_row<5>;
    case 6: return qk_row<6>;
    case 7: return qk_row<7>;
    case 8: return qk_row<8>;
    default: return nullptr;
  }
}

// The value rows P.V reads: row j at v + j * vs (one page), or behind row pointers (a key block across
// pages); at(x): the same rows from column x on.
struct StridedRows {
  const float* v;
  int64_t vs;
  const float* operator[](int64_t j) const { return v + j * vs; }
  StridedRows at(int64_t x) const { return {v + x, vs}; }
};
struct PointedRows {
  const float* const* vrow;
  int64_t x;
  const float* operator[](int64_t j) const { return vrow[j] + x; }
  PointedRows at(int64_t dx) const { return {vrow, x + dx}; }
};

// o[r] (R rows at stride ldo, NV vectors, the last one masked) += sum_j p[r][j] v[j] for j in [j0, j1):
// rows of p at stride ldp.
// Always inlined: out of line, GCC 12 stores the accumulators to the stack on every key.
template <int R, int NV, class Rows>
__attribute__((always_inline)) inline void pv_block(float* o, int64_t ldo, const float* p, int64_t ldp, Rows v,
                                                    int64_t j0, int64_t j1, __mmask16 tail) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c)
      acc[r][c] = _mm512_maskz_loadu_ps(c == NV - 1 ? tail : __mmask16(0xFFFF), o + r * ldo + 16 * c);
  for (int64_t j = j0; j < j1; ++j) {
    const float* vj = v[j];
    __m512 vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = _mm512_maskz_loadu_ps(c == NV - 1 ? tail : __mmask16(0xFFFF), vj + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512 pb = _mm512_set1_ps(p[r * ldp + j]);
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_fmadd_ps(pb, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c)
      _mm512_mask_storeu_ps(o + r * ldo + 16 * c, c == NV - 1 ? tail : __mmask16(0xFFFF), acc[r][c]);
}

// R rows' accumulators (o, stride dv) += P (rows at stride ldp) . V over keys [j0, j1), 64 columns at a time.
template <int R, class Rows>
void pv_rows(float* o, int64_t dv, const float* p, int64_t ldp, Rows v, int64_t j0, int64_t j1) {
  for (int64_t x = 0; x < dv; x += 64) {
    const int64_t width = std::min<int64_t>(64, dv - x);
    const __mmask16 tail = lanes(width - 16 * ((width - 1) / 16));
    switch ((width + 15) / 16) {
      case 1: pv_block<R, 1>(o + x, dv, p, ldp, v.at(x), j0, j1, tail); break;
      case 2: pv_block<R, 2>(o + x, dv, p, ldp, v.at(x), j0, j1, tail); break;
      case 3: pv_block<R, 3>(o + x, dv, p, ldp, v.at(x), j0, j1, tail); break;
      default: pv_block<R, 4>(o + x, dv, p, ldp, v.at(x), j0, j1, tail); break;
    }
  }
}

// [v0, v1): the union of rows r0 .. r0+nr-1's visible key spans [span[2r], span[2r + 1]) (v0 >= v1: none), what a
// P.V pass over those rows together reads.
inline void key_union(const int64_t* span, int64_t r0, int64_t nr, int64_t n, int64_t& v0, int64_t& v1) {
  v0 = n;
  v1 = 0;
  for (int64_t r = r0; r < r0 + nr; ++r)
    if (span[2 * r] < span[2 * r + 1]) {
      v0 = std::min(v0, span[2 * r]);
      v1 = std::max(v1, span[2 * r + 1]);
    }
}

// [u0, u1): the union of rows r0 .. r0+nr-1's visible keys in the page (span[2r], span[2r+1]; empty:
// u0 >= u1). Inside it, each row's scores (s, rows of n) outside its own span are zeroed, so P.V can
// run over the union for all of them.
inline void union_span(const int64_t* span, float* s, int64_t n, int64_t r0, int64_t nr, int64_t& u0, int64_t& u1) {
  key_union(span, r0, nr, n, u0, u1);
  for (int64_t r = r0; r < r0 + nr && u0 < u1; ++r) {
    float* srow = s + r * n;
    const int64_t s0 = std::max(u0, std::min(span[2 * r], u1)), s1 = std::max(s0, span[2 * r + 1]);
    std::fill(srow + u0, srow + s0, 0.f);
    std::fill(srow + std::min(s1, u1), srow + u1, 0.f);
  }
}

// pv_rows for nr = 1..4 rows (4, 2 + 1, 2 or 1 rows of register accumulators).
inline void pv_up_to4(float* o, int64_t dv, const float* p, int64_t ldp, const float* v, int64_t vs, int64_t j0,
                      int64_t j1, int64_t nr) {
  switch (nr) {
    case 4: pv_rows<4>(o, dv, p, ldp, StridedRows{v, vs}, j0, j1); break;
    case 3: pv_rows<2>(o, dv, p, ldp, StridedRows{v, vs}, j0, j1);
            pv_rows<1>(o + 2 * dv, dv, p + 2 * ldp, ldp, StridedRows{v, vs}, j0, j1); break;
    case 2: pv_rows<2>(o, dv, p, ldp, StridedRows{v, vs}, j0, j1); break;
    default: pv_rows<1>(o, dv, p, ldp, StridedRows{v, vs}, j0, j1); break;
  }
}

// exp(x) for x <= 0, 16 lanes: the scalar exp_nonpositive's polynomial.
inline __m512 exp_nonpositive(__m512 x) { return exp_poly16(_mm512_max_ps(x, _mm512_set1_ps(-87.3f))); }

// softmax_update for float32 rows, 16 lanes at a time (the running max, then exp and sum).
inline void softmax_update(Work<float>& w, int64_t r, int64_t dv, float* s, int64_t n) {
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < n; j += 16) vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(vmax, lanes(n - j), s + j));
  const float cmax = _mm512_reduce_max_ps(vmax);
  if (cmax > w.m[r]) {
    const float alpha = std::exp(w.m[r] - cmax);
    w.l[r] *= alpha;
    scale_row(w.acc.data() + r * dv, alpha, dv);
    w.m[r] = cmax;
  }
  const __m512 m = _mm512_set1_ps(w.m[r]);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = lanes(n - j);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), m));
    _mm512_mask_storeu_ps(s + j, k, e);
    sum = _mm512_mask_add_ps(sum, k, sum, e);
  }
  w.l[r] += _mm512_reduce_add_ps(sum);
}

// 2^x for x <= 0, 16 lanes (0 below about -150; larger x overflow to inf): 2^r for r = x - round(x) in
// [-0.5, 0.5] by a degree-6 polynomial fitted for relative error (1.9e-9, about 1e-7 evaluated in float32),
// times 2^round(x). Three operations fewer than exp_poly16 (no ln 2 reduction, no clamp: scalef saturates).
inline __m512 exp2_nonpositive(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 y = _mm512_set1_ps(1.535086630610749e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.339997397735715e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(9.618470445275307e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.550328642129898e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(2.4022647738456726e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(6.931471824645996e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}

constexpr float kLog2e = 1.44269504088896341f, kLn2 = 0.693147180559945309f;

// Lanes j .. j+15 that fall in [s0, s1), as a mask.
inline __mmask16 span_lanes(int64_t s0, int64_t s1, int64_t j) {
  const int64_t lo = std::clamp<int64_t>(s0 - j, 0, 16), hi = std::clamp<int64_t>(s1 - j, 0, 16);
  return __mmask16(((1u << hi) - 1u) & ~((1u << lo) - 1u));
}

// Scores of R query rows (at q, row stride d) against keys [u0, u1) held transposed in kt (d rows of ldk
// floats, zero past the block's keys, readable up to column u0 + 32 * ceil((u1 - u0) / 32)):
// s[r * lds + j] for j in [u0, u1). R rows x 2 vectors of 16 keys stay in registers over d (a GEMM
// micro-kernel: every key vector is loaded once for the R rows); on the way out, rmax[r] = the largest
// score of row r within its own keys [span[2r], span[2r + 1]) (-inf if none).
template <int R>
inline void qk_block(const float* q, int64_t d, const float* kt, int64_t ldk, int64_t u0, int64_t u1, float* s,
                     int64_t lds, const int64_t* span, float* rmax) {
  __m512 vmax[R];
  for (int r = 0; r < R; ++r) vmax[r] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = u0; j < u1; j += 32) {
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t x = 0; x < d; ++x) {
      const __m512 k0 = _mm512_loadu_ps(kt + x * ldk + j), k1 = _mm512_loadu_ps(kt + x * ldk + j + 16);
      for (int r = 0; r < R; ++r) {
        const __m512 qb = _mm512_set1_ps(q[r * d + x]);
        acc[r][0] = _mm512_fmadd_ps(qb, k0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(qb, k1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm512_mask_storeu_ps(s + r * lds + j, lanes(u1 - j), acc[r][0]);
      if (u1 - j > 16) _mm512_mask_storeu_ps(s + r * lds + j + 16, lanes(u1 - j - 16), acc[r][1]);
      vmax[r] = _mm512_mask_max_ps(vmax[r], span_lanes(span[2 * r], span[2 * r + 1], j), vmax[r], acc[r][0]);
      vmax[r] = _mm512_mask_max_ps(vmax[r], span_lanes(span[2 * r], span[2 * r + 1], j + 16), vmax[r], acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) rmax[r] = _mm512_reduce_max_ps(vmax[r]);
}

// dst[c * ds + i] = src[i][x + c] for i < 16 (0 for i >= rows), c < cols (a 16 x 16 block through
// registers: unpack, shuffle, then two 128-bit lane exchanges); src: 16 row pointers (rows of them read).
inline void transpose16(const float* const* src, int64_t x, int64_t rows, int64_t cols, float* dst, int64_t ds) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = i < rows ? _mm512_maskz_loadu_ps(lanes(cols), src[i] + x) : _mm512_setzero_ps();
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 4; ++i) {
      t[8 * h + i] = _mm512_shuffle_f32x4(r[8 * h + i], r[8 * h + 4 + i], 0x88);
      t[8 * h + 4 + i] = _mm512_shuffle_f32x4(r[8 * h + i], r[8 * h + 4 + i], 0xDD);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xDD);
  }
  for (int c = 0; c < cols; ++c) _mm512_storeu_ps(dst + c * ds, r[c]);
}

constexpr int64_t kTileRows = 16;   // tiles with this many (query, head) rows take prefill_tile
constexpr int64_t kKeyBlock = 128;  // keys prefill_tile scores at once, across pages when they are smaller
constexpr int64_t kRowBlock = 8;    // rows it scores, normalises and multiplies by V together

// A key block [j0, j1) of sequence b, KV head hk, as row pointers: key j - j0 at krow[j - j0], its value at
// vrow[j - j0] (the block may span several pages). The pages' base pointers k / v are a's (float32) or the
// half call's (attention_half.h), with a's strides.
template <typename T>
inline void block_rows(const Args<float>& a, const T* k_pages, const T* v_pages, int64_t b, int64_t hk, int64_t j0,
                       int64_t j1, const T** krow, const T** vrow) {
  const int64_t* table = a.table + b * a.table_b;
  for (int64_t j = j0; j < j1;) {
    const int64_t p = j / a.page, blk = table[p], end = std::min(j1, (p + 1) * a.page);
    const T* k = k_pages + blk * a.k_b + hk * a.k_h + (j - p * a.page) * a.k_p;
    const T* v = v_pages + blk * a.v_b + hk * a.v_h + (j - p * a.page) * a.v_p;
    for (; j < end; ++j, k += a.k_p, v += a.v_p) {
      krow[j - j0] = k;
      vrow[j - j0] = v;
    }
  }
}

// The block's n keys transposed into kt (d rows of ldk floats, zero from n to ldk, ldk a multiple of 32).
inline void transpose_keys(const float* const* krow, int64_t n, int64_t d, float* kt, int64_t ldk) {
  for (int64_t j = 0; j < ldk; j += 16) {
    const int64_t keys = std::max<int64_t>(0, std::min<int64_t>(16, n - j));  // 0: a block of padding
    for (int64_t x = 0; x < d; x += 16)
      transpose16(krow + j, x, keys, std::min<int64_t>(16, d - x), kt + x * ldk + j, ldk);
  }
}

inline void pv_ptr_up_to4(float* o, int64_t dv, const float* p, int64_t ldp, const float* const* vrow, int64_t j0,
                          int64_t j1, int64_t nr) {
  switch (nr) {
    case 4: pv_rows<4>(o, dv, p, ldp, PointedRows{vrow, 0}, j0, j1); break;
    case 3: pv_rows<3>(o, dv, p, ldp, PointedRows{vrow, 0}, j0, j1); break;
    case 2: pv_rows<2>(o, dv, p, ldp, PointedRows{vrow, 0}, j0, j1); break;
    default: pv_rows<1>(o, dv, p, ldp, PointedRows{vrow, 0}, j0, j1); break;
  }
}

inline void qk_up_to8(const float* q, int64_t d, const float* kt, int64_t ldk, int64_t u0, int64_t u1, float* s,
                      int64_t lds, const int64_t* span, float* rmax, int64_t nr) {
  switch (nr) {
    case 8: return qk_block<8>(q, d, kt, ldk, u0, u1, s, lds, span, rmax);
    case 7: return qk_block<7>(q, d, kt, ldk, u0, u1, s, lds, span, rmax);
    case 6: return qk_block<6>(q, d, kt, ldk, u0, u1, s, lds, span, rmax);
    case 5: return qk_block<5>(q, d, kt, ldk, u0, u1, s, lds, span, rmax);
    case 4: return qk_block<4>(q, d, kt, ldk, u0, u1, s, lds, span, rmax);
    case 3: return qk_block<3>(q, d, kt, ldk, u0, u1, s, lds, span, rmax);
    case 2: return qk_block<2>(q, d, kt, ldk, u0, u1, s, lds, span, rmax);
    default: return qk_block<1>(q, d, kt, ldk, u0, u1, s, lds, span, rmax);
  }
}

// The online-softmax step of R rows r0 .. r0+R-1 on their scores s[u0, u1) (rows at stride lds; base 2: the
// logits times log2 e, as the running max w.m), row r seeing [span[2r], span[2r + 1]) of them with largest
// score rmax[r]: each accumulator row and sum rescaled only when its running max grows, then one pass over the
// union for all R rows together (independent exp chains) that leaves 2^(s - max) on a row's own keys and 0 on
// the rest (P for the P.V over the union).
template <int R>
inline void softmax_rows(Work<float>& w, int64_t r0, int64_t dv, float* s, int64_t lds, int64_t u0, int64_t u1,
                         const int64_t* span, const float* rmax) {
  __m512 m[R], sum[R];
  for (int r = 0; r < R; ++r) {
    float& mr = w.m[r0 + r];
    if (rmax[r] > mr) {
      const float alpha = std::exp2(mr - rmax[r]);  // 2^-inf = 0 on a row's first keys
      w.l[r0 + r] *= alpha;
      scale_row(w.acc.data() + (r0 + r) * dv, alpha, dv);
      mr = rmax[r];
    }
    m[r] = _mm512_set1_ps(mr);
    sum[r] = _mm512_setzero_ps();
  }
  for (int64_t j = u0; j < u1; j += 16) {
    const __mmask16 k = lanes(u1 - j);
    for (int r = 0; r < R; ++r) {
      const __mmask16 own = span_lanes(span[2 * r], span[2 * r + 1], j) & k;
      const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(own, s + r * lds + j), m[r]);
      const __m512 p = _mm512_maskz_mov_ps(own, exp2_nonpositive(x));
      _mm512_mask_storeu_ps(s + r * lds + j, k, p);
      sum[r] = _mm512_add_ps(sum[r], p);
    }
  }
  for (int r = 0; r < R; ++r) w.l[r0 + r] += _mm512_reduce_add_ps(sum[r]);
}

inline void softmax_up_to8(Work<float>& w, int64_t r0, int64_t dv, float* s, int64_t lds, int64_t u0, int64_t u1,
                           const int64_t* span, const float* rmax, int64_t nr) {
  switch (nr) {
    case 8: return softmax_rows<8>(w, r0, dv, s, lds, u0, u1, span, rmax);
    case 4: return softmax_rows<4>(w, r0, dv, s, lds, u0, u1, span, rmax);
    default:
      for (int64_t r = 0; r < nr; ++r)
        softmax_rows<1>(w, r0 + r, dv, s + r * lds, lds, u0, u1, span + 2 * r, rmax + r);
  }
}

// The largest of s[s0, s1) (-inf when empty).
inline float row_max(const float* s, int64_t s0, int64_t s1) {
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = s0; j < s1; j += 16) vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(vmax, lanes(s1 - j), s + j));
  return _mm512_reduce_max_ps(vmax);
}

// A prefill tile (kTileRows rows or more) of sequence b, KV head hk: keys in blocks of kKeyBlock (gathered
// across pages, K transposed once per block), then kRowBlock rows at a time: their scores against the union
// of their visible keys (qk_block), each row's online softmax over its own keys (zeros around them), P.V for
// 4 rows at a time. The rows' scores stay in a kRowBlock x kKeyBlock buffer (L1) between the three steps.
// prefill_keys is its walk over keys [lo, hi) of sequence b's pages (KV head hk) for the `rows` rows set up in
// w, row r seeing keys [s0, s1) of [j0, j1) as row_keys(r, j0, j1, s0, s1) says; the cascade's shared stage
// runs it too, on several sequences' rows stacked.
template <class RowKeys>
inline void prefill_keys(const Args<float>& a, int64_t b, int64_t hk, int64_t lo, int64_t hi, int64_t rows,
                         RowKeys row_keys, Work<float>& w) {
  const int64_t d = a.d, dv = a.dv;
  // scores in base 2 (softmax_rows): log2 e folded into q, or into the softcap's factor
  for (int64_t r = 0; r < rows; ++r) w.m[r] *= kLog2e;
  if (a.softcap <= 0)
    for (float& x : w.q) x *= kLog2e;
  const float softcap2 = a.softcap * kLog2e;
  static thread_local std::vector<float> kt;  // the block's keys transposed, padded to 32 columns (+ 32 slack)
  static thread_local std::vector<const float*> kv_rows;  // K row pointers, then V row pointers
  kt.resize(d * kKeyBlock + 32);
  kv_rows.resize(2 * kKeyBlock);
  w.s.resize(kRowBlock * kKeyBlock);
  w.span.resize(2 * kRowBlock);
  const float** krow = kv_rows.data();
  const float** vrow = kv_rows.data() + kKeyBlock;
  int64_t* span = w.span.data();
  for (int64_t j0 = lo; j0 < hi;) {
    const int64_t j1 = std::min(hi, (j0 / kKeyBlock + 1) * kKeyBlock), n = j1 - j0, ldk = (n + 31) / 32 * 32;
    block_rows(a, a.k, a.v, b, hk, j0, j1, krow, vrow);
    transpose_keys(krow, n, d, kt.data(), ldk);
    for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
      const int64_t nr = std::min(kRowBlock, rows - r0);
      int64_t u0 = n, u1 = 0;  // the union of the rows' visible keys in the block
      for (int64_t r = 0; r < nr; ++r) {
        int64_t s0, s1;
        row_keys(r0 + r, j0, j1, s0, s1);
        span[2 * r] = s0 - j0;
        span[2 * r + 1] = s1 - j0;
        if (s0 < s1) {
          u0 = std::min(u0, s0 - j0);
          u1 = std::max(u1, s1 - j0);
        }
      }
      if (u0 >= u1) continue;
      float* s = w.s.data();
      float rmax[kRowBlock];
      qk_up_to8(w.q.data() + r0 * d, d, kt.data(), ldk, u0, u1, s, kKeyBlock, span, rmax, nr);
      if (a.softcap > 0)
        for (int64_t r = 0; r < nr; ++r) {
          float* srow = s + r * kKeyBlock;
          const int64_t s0 = span[2 * r], s1 = span[2 * r + 1];
          for (int64_t j = s0; j < s1; ++j) srow[j] = softcap2 * std::tanh(srow[j]);
          rmax[r] = row_max(srow, s0, s1);
        }
      softmax_up_to8(w, r0, dv, s, kKeyBlock, u0, u1, span, rmax, nr);
      for (int64_t h0 = 0; h0 < nr; h0 += 4) {
        const int64_t nh = std::min<int64_t>(4, nr - h0);
        int64_t v0, v1;
        key_union(span, h0, nh, n, v0, v1);
        if (v0 < v1) pv_ptr_up_to4(w.acc.data() + (r0 + h0) * dv, dv, s + h0 * kKeyBlock, kKeyBlock, vrow, v0, v1, nh);
      }
    }
    j0 = j1;
  }
  for (int64_t r = 0; r < rows; ++r) w.m[r] *= kLn2;  // back to natural units for the log-sum-exp
}

inline void prefill_tile(const Args<float>& a, int64_t b, int64_t hk, int64_t i0, int64_t i1, Work<float>& w) {
  const int64_t group = a.heads / a.kv_heads;
  const int64_t shift = a.seqlens_k[b] - (a.cu_q[b + 1] - a.cu_q[b]);
  start_tile(a, b, hk, hk + 1, i0, i1, w);
  int64_t lo, hi;
  tile_keys(a, b, i0, i1, lo, hi);
  prefill_keys(a, b, hk, lo, hi, (i1 - i0) * group,
               [&](int64_t r, int64_t j0, int64_t j1, int64_t& s0, int64_t& s1) {
                 row_span(a, i0 + r / group, shift, j0, j1, s0, s1);
               }, w);
  finish_tile(a, b, hk, hk + 1, i0, i1, w);
}


// The same tile as attend_tile, float32, fewer than kTileRows rows (prefill_tile takes larger ones): per
// page, each row's visible keys scored (qk_row), its online softmax updated, then P.V for 4 rows at a
// time over the union of their visible keys.
inline void attend_tile(const Args<float>& a, int64_t b, int64_t hk, int64_t i0, int64_t i1, Work<float>& w,
                        QkFn qk) {
  const int64_t group = a.heads / a.kv_heads, d = a.d, dv = a.dv;
  const int64_t sq = a.cu_q[b + 1] - a.cu_q[b], shift = a.seqlens_k[b] - sq;
  const int64_t sk = std::min(a.seqlens_k[b], a.table_w * a.page);
  const int64_t rows = (i1 - i0) * group;
  start_tile(a, b, hk, hk + 1, i0, i1, w);
  w.s.resize(rows * a.page);
  w.span.resize(2 * rows);
  int64_t* span = w.span.data();
  int64_t lo = 0, hi = sk;
  if (a.left >= 0) lo = std::max<int64_t>(0, i0 + shift - a.left);
  if (a.right >= 0) hi = std::min<int64_t>(sk, i1 - 1 + shift + a.right + 1);
  const int64_t* table = a.table + b * a.table_b;
  for (int64_t p = lo / a.page; p * a.page < hi; ++p) {
    const int64_t blk = table[p];
    const int64_t j0 = std::max(lo, p * a.page), j1 = std::min(hi, (p + 1) * a.page), n = j1 - j0;
    const float* k0 = a.k + blk * a.k_b + hk * a.k_h + (j0 - p * a.page) * a.k_p;
    const float* v0 = a.v + blk * a.v_b + hk * a.v_h + (j0 - p * a.page) * a.v_p;
    for (int64_t r = 0; r < rows; ++r) {
      int64_t s0, s1;
      row_span(a, i0 + r / group, shift, j0, j1, s0, s1);
      s0 -= j0;
      s1 -= j0;
      span[2 * r] = s0;
      span[2 * r + 1] = s1;
      if (s0 >= s1) continue;
      float* srow = w.s.data() + r * n;
      qk(w.q.data() + r * d, k0 + s0 * a.k_p, a.k_p, s1 - s0, d, srow + s0);
      if (a.softcap > 0)
        for (int64_t j = s0; j < s1; ++j) srow[j] = a.softcap * std::tanh(srow[j]);
      softmax_update(w, r, dv, srow + s0, s1 - s0);
    }
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      const int64_t nr = std::min<int64_t>(4, rows - r0);
      int64_t u0, u1;
      union_span(span, w.s.data(), n, r0, nr, u0, u1);
      if (u0 >= u1) continue;
      float* o = w.acc.data() + r0 * dv;
      const float* pr = w.s.data() + r0 * n;
      pv_up_to4(o, dv, pr, n, v0, a.v_p, u0, u1, nr);
    }
  }
  finish_tile(a, b, hk, hk + 1, i0, i1, w);
}

// A page's visible rows as a task reads them: K / V of the first one (head h0) and how many.
struct PageRows {
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t n = 0;
};

// Page p of sequence b, keys [lo, hi) of it, heads from h0.
inline PageRows page_rows(const Args<float>& a, int64_t b, int64_t h0, int64_t p, int64_t lo, int64_t hi) {
  const int64_t blk = a.table[b * a.table_b + p];
  const int64_t j0 = std::max(lo, p * a.page), j1 = std::min(hi, (p + 1) * a.page);
  return {a.k + blk * a.k_b + h0 * a.k_h + (j0 - p * a.page) * a.k_p,
          a.v + blk * a.v_b + h0 * a.v_h + (j0 - p * a.page) * a.v_p, j1 - j0};
}

// A decode tile's online-softmax state after keys [0, keys) (a cascade's shared stage), its rows ordered as in
// start_tile; keys 0: none (start from scratch).
struct Resume {
  int64_t keys = 0;
  const float* m = nullptr;
  const float* l = nullptr;
  const float* acc = nullptr;
};

// The first page a decode tile reads (n = 0: it reads none), from key `skip` on.
inline PageRows first_page(const Args<float>& a, int64_t b, int64_t h0, int64_t i0, int64_t i1, int64_t skip) {
  int64_t lo, hi;
  tile_keys(a, b, i0, i1, lo, hi);
  lo = std::max(lo, skip);
  return lo < hi ? page_rows(a, b, h0, lo / a.page, lo, hi) : PageRows{};
}

// Software prefetch of rows r0 .. r1-1 (row r at base + r * stride, `width` floats): every cache line.
inline void prefetch_rows(const float* base, int64_t stride, int64_t width, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const uintptr_t start = reinterpret_cast<uintptr_t>(base + r * stride);
    for (uintptr_t line = start & ~uintptr_t(63); line < start + 4 * width; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
  }
}

constexpr int64_t kKeyChunk = 64;    // keys per step of a decode tile's walk over a page's K rows
constexpr int64_t kValueChunk = 64;  // and over its V rows
constexpr int64_t kPrefetchBytes = 128 << 10;  // of the next page's K (and V) rows: all of a small page

// A decode tile (few query rows) for KV heads h0 .. h1-1 together. The flash-attn page keeps a token's heads
// in one row, so each page's K rows and then its V rows are read front to back, a chunk of rows (every head) at a
// time, while the next page (`after` once this tile's pages run out: the following task's first) is
// prefetched one chunk's share per step. Same results as attend_tile on each head.
inline void attend_decode(const Args<float>& a, int64_t b, int64_t h0, int64_t h1, int64_t i0, int64_t i1,
                          Work<float>& w, QkFn qk, PageRows after, const Resume& resume) {
  const int64_t group = a.heads / a.kv_heads, d = a.d, dv = a.dv, nh = h1 - h0;
  const int64_t shift = a.seqlens_k[b] - (a.cu_q[b + 1] - a.cu_q[b]);
  const int64_t per_head = (i1 - i0) * group, rows = nh * per_head;
  const int64_t k_width = (nh - 1) * a.k_h + d, v_width = (nh - 1) * a.v_h + dv;
  start_tile(a, b, h0, h1, i0, i1, w);
  w.s.resize(rows * a.page);
  w.span.resize(2 * rows);
  int64_t* span = w.span.data();
  int64_t lo, hi;
  tile_keys(a, b, i0, i1, lo, hi);
  if (resume.keys > 0) {  // the cascade's shared stage saw keys [0, resume.keys): continue from its state
    std::copy_n(resume.m, rows, w.m.data());
    std::copy_n(resume.l, rows, w.l.data());
    std::copy_n(resume.acc, rows * dv, w.acc.data());
    lo = std::max(lo, resume.keys);
  }
  for (int64_t p = lo / a.page; p * a.page < hi; ++p) {
    const PageRows cur = page_rows(a, b, h0, p, lo, hi);
    const PageRows next = (p + 1) * a.page < hi ? page_rows(a, b, h0, p + 1, lo, hi) : after;
    const int64_t j0 = std::max(lo, p * a.page), n = cur.n;
    const int64_t ahead_k = std::min(next.n, std::max<int64_t>(1, kPrefetchBytes / (4 * a.k_p)));
    const int64_t ahead_v = std::min(next.n, std::max<int64_t>(1, kPrefetchBytes / (4 * a.v_p)));
    for (int64_t r = 0; r < rows; ++r) {
      row_span(a, i0 + (r / group) % (i1 - i0), shift, j0, j0 + n, span[2 * r], span[2 * r + 1]);
      span[2 * r] -= j0;
      span[2 * r + 1] -= j0;
    }
    for (int64_t c = 0, chunks = (n + kKeyChunk - 1) / kKeyChunk; c < chunks; ++c) {  // scores, chunk by chunk
      prefetch_rows(next.k, a.k_p, k_width, ahead_k * c / chunks, ahead_k * (c + 1) / chunks);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t s0 = std::max(span[2 * r], c * kKeyChunk), s1 = std::min(span[2 * r + 1], (c + 1) * kKeyChunk);
        if (s0 < s1)
          qk(w.q.data() + r * d, cur.k + (r / per_head) * a.k_h + s0 * a.k_p, a.k_p, s1 - s0, d,
             w.s.data() + r * n + s0);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t s0 = span[2 * r], s1 = span[2 * r + 1];
      if (s0 >= s1) continue;
      float* srow = w.s.data() + r * n;
      if (a.softcap > 0)
        for (int64_t j = s0; j < s1; ++j) srow[j] = a.softcap * std::tanh(srow[j]);
      softmax_update(w, r, dv, srow + s0, s1 - s0);
    }
    // P.V in blocks of up to 4 rows of one head over the union of their visible keys (zeros around each
    // row's own); block (r0, nr) keeps its union in span[2 * r0], span[2 * r0 + 1]
    for (int64_t r0 = 0; r0 < rows; r0 += std::min<int64_t>(4, per_head - r0 % per_head)) {
      const int64_t nr = std::min<int64_t>(4, per_head - r0 % per_head);
      int64_t u0, u1;
      union_span(span, w.s.data(), n, r0, nr, u0, u1);
      span[2 * r0] = u0;
      span[2 * r0 + 1] = u1;
    }
    for (int64_t c = 0, chunks = (n + kValueChunk - 1) / kValueChunk; c < chunks; ++c) {  // values
      prefetch_rows(next.v, a.v_p, v_width, ahead_v * c / chunks, ahead_v * (c + 1) / chunks);
      for (int64_t r0 = 0; r0 < rows; r0 += std::min<int64_t>(4, per_head - r0 % per_head)) {
        const int64_t nr = std::min<int64_t>(4, per_head - r0 % per_head);
        const int64_t x0 = std::max(span[2 * r0], c * kValueChunk);
        const int64_t x1 = std::min(span[2 * r0 + 1], (c + 1) * kValueChunk);
        if (x0 >= x1) continue;
        float* o = w.acc.data() + r0 * dv;
        const float* pr = w.s.data() + r0 * n;
        const float* v = cur.v + (r0 / per_head) * a.v_h;
        pv_up_to4(o, dv, pr, n, v, a.v_p, x0, x1, nr);
      }
    }
  }
  finish_tile(a, b, h0, h1, i0, i1, w);
}

// Cascade attention for decode tiles that share their first pages (prefix caching: a system prompt, a few-shot
// prefix, n samples of one prompt). Their queries are stacked and run through prefill_keys over the shared
// pages once per KV head (register-blocked GEMM micro-kernels, each shared K / V row read once for all of
// them); each tile's own decode then resumes from that state over its remaining keys. Same online softmax,
// so the same result up to float rounding (the shared stage sums in base 2, in another order).
constexpr int64_t kCascadeRows = 8;  // stacked (query, head) rows per KV head a group needs to take the cascade

struct Cascade {
  std::vector<int64_t> keys;    // per sequence: shared keys its decode resumes after (0: not in a group)
  std::vector<int64_t> first;   // per sequence: its first state row (rows as attend_decode's, KV heads 0 ..)
  std::vector<std::vector<int64_t>> groups;  // the sequences of each group (the first one's table is read)
  std::vector<float> m, l, acc;  // the state rows

  Resume resume(const Args<float>& a, int64_t b, int64_t h0, int64_t i0, int64_t i1) const {
    if (keys.empty() || keys[b] == 0) return {};
    const int64_t row = first[b] + h0 * (i1 - i0) * (a.heads / a.kv_heads);
    return {keys[b], m.data() + row, l.data() + row, acc.data() + row * a.dv};
  }
};

// How many leading keys every query row of sequence b's decode sees (its first row sees the fewest: causal rows
// see up to their own position), or 0 where the tile cannot take the cascade (not a whole-sequence decode
// tile, or a left window).
inline int64_t visible_to_all(const Args<float>& a, int64_t b) {
  const int64_t sq = a.cu_q[b + 1] - a.cu_q[b];
  if (sq < 1 || sq > kDecodeRows || a.left >= 0) return 0;
  int64_t lo, hi;
  tile_keys(a, b, 0, 1, lo, hi);
  return hi;
}

// Groups: sequences whose tables start with the same block, sharing their longest common run of full pages
// that every member's rows see; a group needs two members and kCascadeRows stacked rows per KV head.
inline Cascade plan_cascade(const Args<float>& a, int64_t batch) {
  Cascade c;
  const int64_t group = a.heads / a.kv_heads;
  std::vector<std::pair<int64_t, int64_t>> by_first;  // (first block, sequence)
  for (int64_t b = 0; b < batch; ++b)
    if (visible_to_all(a, b) >= a.page) by_first.push_back({a.table[b * a.table_b], b});
  if (by_first.size() < 2) return c;
  std::sort(by_first.begin(), by_first.end());
  c.keys.assign(batch, 0);
  c.first.assign(batch, 0);
  int64_t state_rows = 0;
  for (size_t s = 0; s < by_first.size();) {
    size_t e = s;
    while (e < by_first.size() && by_first[e].first == by_first[s].first) ++e;
    const int64_t b0 = by_first[s].second;
    int64_t pages = visible_to_all(a, b0) / a.page, rows = 0;
    for (size_t k = s; k < e; ++k) {
      const int64_t b = by_first[k].second;
      int64_t same = 0;
      const int64_t limit = std::min(pages, visible_to_all(a, b) / a.page);
      while (same < limit && a.table[b * a.table_b + same] == a.table[b0 * a.table_b + same]) ++same;
      pages = same;
      rows += (a.cu_q[b + 1] - a.cu_q[b]) * group;
    }
    if (e - s >= 2 && pages > 0 && rows >= kCascadeRows) {
      std::vector<int64_t> members;
      for (size_t k = s; k < e; ++k) {
        const int64_t b = by_first[k].second;
        members.push_back(b);
        c.keys[b] = pages * a.page;
        c.first[b] = state_rows;
        state_rows += a.kv_heads * (a.cu_q[b + 1] - a.cu_q[b]) * group;
      }
      c.groups.push_back(std::move(members));
    }
    s = e;
  }
  c.m.resize(state_rows);
  c.l.resize(state_rows);
  c.acc.resize(state_rows * a.dv);
  return c;
}

// Group gi's shared stage for KV head hk: its members' rows stacked, prefill_keys over the shared keys (all
// visible to all), the state saved where each member's decode resumes.
inline void shared_stage(const Args<float>& a, Cascade& c, int64_t gi, int64_t hk, Work<float>& w) {
  const std::vector<int64_t>& members = c.groups[gi];
  const int64_t group = a.heads / a.kv_heads, dv = a.dv, keys = c.keys[members[0]];
  int64_t rows = 0;
  for (int64_t b : members) rows += (a.cu_q[b + 1] - a.cu_q[b]) * group;
  size_rows(w, rows, a.d, dv);
  int64_t at = 0;
  for (int64_t b : members) {
    const int64_t sq = a.cu_q[b + 1] - a.cu_q[b];
    init_rows(a, b, hk, hk + 1, 0, sq, w, at);
    at += sq * group;
  }
  prefill_keys(a, members[0], hk, 0, keys, rows,
               [](int64_t, int64_t j0, int64_t j1, int64_t& s0, int64_t& s1) { s0 = j0; s1 = j1; }, w);
  at = 0;
  for (int64_t b : members) {
    const int64_t n = (a.cu_q[b + 1] - a.cu_q[b]) * group, row = c.first[b] + hk * n;
    std::copy_n(w.m.data() + at, n, c.m.data() + row);
    std::copy_n(w.l.data() + at, n, c.l.data() + row);
    std::copy_n(w.acc.data() + at * dv, n * dv, c.acc.data() + row * dv);
    at += n;
  }
}

}  // namespace fast
#endif


struct Task {
  int64_t b, i0, i1, h0, h1;  // sequence b's query rows i0 .. i1-1, KV heads h0 .. h1-1
  bool decode;                // fast::attend_decode (h0 .. h1-1 together); else one attend_tile, h1 = h0 + 1
};

// The tasks: query tiles of `tile` rows (kQueryTile; bfloat16's vdpbf16ps prefill tiles take larger ones, see
// half_attention::query_tile), one per KV head; a decode tile (float32 AVX-512) covers all the KV
// heads in one task, unless there are fewer decode tiles than threads (then one task per head again).
template <typename T>
std::vector<Task> plan_tasks(const Args<T>& a, int64_t batch, bool fast, int64_t tile = kQueryTile) {
  int64_t decode_tiles = 0;
  for (int64_t b = 0; b < batch && fast; ++b)
    for (int64_t i = 0; i < a.cu_q[b + 1] - a.cu_q[b]; i += kQueryTile)
      decode_tiles += std::min(kQueryTile, a.cu_q[b + 1] - a.cu_q[b] - i) <= kDecodeRows;
  const int64_t heads_per_decode = decode_tiles < at::get_num_threads() ? 1 : a.kv_heads;
  std::vector<Task> tasks;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i0 = 0; i0 < a.cu_q[b + 1] - a.cu_q[b]; i0 += tile) {
      const int64_t i1 = std::min(i0 + tile, a.cu_q[b + 1] - a.cu_q[b]);
      const bool decode = fast && i1 - i0 <= kDecodeRows;
      const int64_t step = decode ? heads_per_decode : 1;
      for (int64_t h0 = 0; h0 < a.kv_heads; h0 += step)
        tasks.push_back({b, i0, i1, h0, std::min(h0 + step, a.kv_heads), decode});
    }
  return tasks;
}

#include "attention_half.h"  // bfloat16 / float16: half_attention::run (uses the generic tile helpers above)

// mode: 0 the fast paths where they apply (float32, AVX-512) with the cascade, 1 the generic loops only,
// 2 the fast paths without the cascade.
template <typename T>
void run(const Args<T>& a, int64_t batch, int64_t mode) {
  bool fast = false;
#if defined(__AVX512F__)
  fast::QkFn qk = nullptr;
  if constexpr (std::is_same_v<T, float>) qk = mode == 1 ? nullptr : fast::qk_for(a.d);
  fast = qk != nullptr;
  fast::Cascade cascade;
  if constexpr (std::is_same_v<T, float>) {
    if (fast && mode == 0) cascade = fast::plan_cascade(a, batch);
    const int64_t stages = static_cast<int64_t>(cascade.groups.size()) * a.kv_heads;
    if (stages > 0)
      at::parallel_for(0, stages, 1, [&](int64_t begin, int64_t end) {
        Work<float> w;
        for (int64_t t = begin; t < end; ++t) fast::shared_stage(a, cascade, t / a.kv_heads, t % a.kv_heads, w);
      });
  }
#endif
  const std::vector<Task> tasks = plan_tasks(a, batch, fast);
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    Work<T> w;
    for (int64_t t = begin; t < end; ++t) {
      const Task& k = tasks[t];
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<T, float>) {
        if (k.decode) {
          const Task* nx = t + 1 < end && tasks[t + 1].decode ? &tasks[t + 1] : nullptr;
          const fast::PageRows after = nx ? fast::first_page(a, nx->b, nx->h0, nx->i0, nx->i1,
                                                             cascade.resume(a, nx->b, nx->h0, nx->i0, nx->i1).keys)
                                          : fast::PageRows{};
          fast::attend_decode(a, k.b, k.h0, k.h1, k.i0, k.i1, w, qk, after, cascade.resume(a, k.b, k.h0, k.i0, k.i1));
          continue;
        }
        if (fast && (k.i1 - k.i0) * (a.heads / a.kv_heads) >= fast::kTileRows) {
          fast::prefill_tile(a, k.b, k.h0, k.i0, k.i1, w);
          continue;
        }
        if (fast) {
          fast::attend_tile(a, k.b, k.h0, k.i0, k.i1, w, qk);
          continue;
        }
      }
#endif
      attend_tile(a, k.b, k.h0, k.i0, k.i1, w, mode != 1);
    }
  });
}

}  // namespace

// The bfloat16 / float16 call (attention_half.h): the tensors' pointers and strides, then half_attention::run.
// mode 1 (the portable loops) keeps bfloat16 prefill tiles on the widened float32 copies, as builds without
// AVX512_BF16 run them (the tests compare both; the bench's old / new switch).
template <typename S>
void run_half(const at::Tensor& q, const at::Tensor& k_pages, const at::Tensor& v_pages, at::Tensor& out,
              at::Tensor& lse, const at::Tensor& table, const at::Tensor& lens, const at::Tensor& cu,
              const at::Tensor& sink_t, double factor, double softcap, int64_t left, int64_t right, int64_t mode) {
  half_attention::HalfArgs<S> h;
  h.generic = mode == 1;
  h.q = q.data_ptr<S>(); h.k = k_pages.data_ptr<S>(); h.v = v_pages.data_ptr<S>(); h.out = out.data_ptr<S>();
  Args<float>& a = h.f;
  a.q = nullptr; a.k = nullptr; a.v = nullptr; a.out = nullptr;
  a.q_t = q.stride(0); a.q_h = q.stride(1);
  a.k_b = k_pages.stride(0); a.k_p = k_pages.stride(1); a.k_h = k_pages.stride(2);
  a.v_b = v_pages.stride(0); a.v_p = v_pages.stride(1); a.v_h = v_pages.stride(2);
  a.o_t = out.stride(0); a.o_h = out.stride(1);
  a.lse = lse.data_ptr<float>();
  a.table = table.data_ptr<int64_t>(); a.table_b = table.stride(0); a.table_w = table.size(1);
  a.seqlens_k = lens.data_ptr<int64_t>();
  a.cu_q = cu.data_ptr<int64_t>();
  a.sinks = sink_t.defined() ? sink_t.data_ptr<float>() : nullptr;
  a.heads = q.size(1); a.kv_heads = k_pages.size(2); a.d = q.size(2); a.dv = v_pages.size(3);
  a.page = k_pages.size(1);
  a.factor = static_cast<float>(factor); a.softcap = static_cast<float>(softcap);
  a.left = left; a.right = right;
  half_attention::run(h, table.size(0));
}

// q (T, H, D) with rows cu_q[b] .. cu_q[b+1]-1 for sequence b; returns out (T, H, Dv), lse (T, H) (float32 for
// bfloat16 / float16 q, else q's dtype).
std::tuple<at::Tensor, at::Tensor> paged_attention(
    const at::Tensor& q, const at::Tensor& k_pages, const at::Tensor& v_pages, const at::Tensor& block_table,
    const at::Tensor& seqlens_k, const at::Tensor& cu_seqlens_q, double factor, double softcap, int64_t left,
    int64_t right, const std::optional<at::Tensor>& sinks, int64_t mode) {
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
  const int64_t* cu_rows = cu.data_ptr<int64_t>();
  TORCH_CHECK(cu_rows[0] >= 0 && cu_rows[batch] <= q.size(0), "paged_attention: cu_seqlens_q (", cu_rows[0], " .. ",
              cu_rows[batch], ") does not fit q's ", q.size(0), " rows");
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(cu_rows[b] <= cu_rows[b + 1], "paged_attention: cu_seqlens_q must not decrease");
  const bool half = q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf;
  auto out = at::empty({q.size(0), q.size(1), v_pages.size(3)}, q.options());
  auto lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(half ? at::kFloat : q.scalar_type()));
  if (cu_rows[batch] != q.size(0) || cu_rows[0] != 0) {  // rows no sequence owns: 0, +inf
    out.zero_();
    lse.fill_(std::numeric_limits<double>::infinity());
  }
  at::Tensor sink_t;
  if (sinks.has_value() && sinks->defined()) sink_t = sinks->to(lse.scalar_type()).contiguous();
  if (half) {
    if (q.scalar_type() == at::kBFloat16)
      run_half<c10::BFloat16>(q, k_pages, v_pages, out, lse, table, lens, cu, sink_t, factor, softcap, left, right,
                              mode);
    else
      run_half<c10::Half>(q, k_pages, v_pages, out, lse, table, lens, cu, sink_t, factor, softcap, left, right, mode);
    return {out, lse};
  }
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
    run(a, batch, mode);
  });
  return {out, lse};
}

// k (N, Hk, D) / v (N, Hk, Dv) rows into pages (NB, P, Hk, D|Dv) at slots (N,) (block * P + offset); a slot
// of -1 writes nothing. One call for both tensors (the store every layer makes once per step).
void store_kv(at::Tensor k_pages, at::Tensor v_pages, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slots) {
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k_pages.dim() == 4 && v_pages.dim() == 4, "store_kv: bad ranks");
  TORCH_CHECK(k_pages.is_contiguous() && v_pages.is_contiguous(), "store_kv: pages must be contiguous");
  TORCH_CHECK(k.scalar_type() == k_pages.scalar_type() && v.scalar_type() == v_pages.scalar_type(),
              "store_kv: K/V and pages must share a dtype");
  TORCH_CHECK(k.size(1) == k_pages.size(2) && k.size(2) == k_pages.size(3) && v.size(1) == v_pages.size(2) &&
              v.size(2) == v_pages.size(3) && k.size(0) == v.size(0) && slots.numel() == k.size(0),
              "store_kv: shapes do not match the pages");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "store_kv: K/V last dims must be contiguous");
  auto idx = slots.to(at::kLong).contiguous();
  const int64_t* sl = idx.data_ptr<int64_t>();
  const int64_t n = k.size(0), hk = k.size(1), limit = k_pages.size(0) * k_pages.size(1);
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(sl[t] >= -1 && sl[t] < limit, "store_kv: slot ", sl[t], " is outside the pages (", limit, " slots)");
  const int64_t elem = k.element_size();
  auto copy = [&](const at::Tensor& src, at::Tensor& pages) {
    const char* base = static_cast<const char*>(src.data_ptr());
    char* dst = static_cast<char*>(pages.data_ptr());
    const int64_t row = pages.size(2) * pages.size(3) * elem, d = src.size(2) * elem;
    for (int64_t t = 0; t < n; ++t) {
      if (sl[t] < 0) continue;
      for (int64_t h = 0; h < hk; ++h)
        std::memcpy(dst + sl[t] * row + h * d, base + (t * src.stride(0) + h * src.stride(1)) * elem, d);
    }
  };
  copy(k, k_pages);
  copy(v, v_pages);
}

TORCH_LIBRARY(flashpage_cpu, m) {
  m.def("store_kv(Tensor(a!) k_pages, Tensor(b!) v_pages, Tensor k, Tensor v, Tensor slots) -> ()");
  m.impl("store_kv", c10::DispatchKey::CPU, TORCH_FN(store_kv));
  m.def("paged_attention(Tensor q, Tensor k_pages, Tensor v_pages, Tensor block_table, Tensor seqlens_k, "
        "Tensor cu_seqlens_q, float factor, float softcap, int left, int right, Tensor? sinks, int mode) -> "
        "(Tensor, Tensor)");
  m.impl("paged_attention", c10::DispatchKey::CPU, TORCH_FN(paged_attention));
}
