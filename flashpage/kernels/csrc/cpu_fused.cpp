// flashpage's one-pass C++ CPU ops for the engine's eager step: RMSNorm, activation-and-product, small-M
// linear, rotary (torch.ops.flashpage_fused, or flashpage_fused_portable when FLASHPAGE_FUSED_NS says so),
// built and called by flashpage/kernels/cpu_fused.py (whose docstring gives each op's arithmetic).

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "common.h"
#include "half.h"
#include "half_linear.h"
#include "half_fused.h"

namespace {

constexpr int64_t kGrain = 16;  // rows per parallel_for chunk at least

// exp(x) for float, Cephes' polynomial (about 1 ulp), x clamped to [-87.3, 88.3] (finite, normal).
inline float exp_f(float x) { return exp_poly(x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x)); }

inline float exp_t(float x) { return exp_f(x); }
inline double exp_t(double x) { return std::exp(x); }

constexpr double kGeluBeta = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double kGeluKappa = 0.044715;

template <typename T>
inline T act_one(T g, int act) {
  if (act == 0) return g / (T(1) + exp_t(-g));
  const T y = T(kGeluBeta) * (g + T(kGeluKappa) * g * g * g);
  const T tanh_y = T(1) - T(2) / (T(1) + exp_t(T(2) * y));
  return T(0.5) * g * (T(1) + tanh_y);
}

#if defined(__AVX512F__)
inline __m512 exp16(__m512 x) {
  return exp_poly16(_mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f)));
}

inline __m512 act16(__m512 g, int act) {
  const __m512 one = _mm512_set1_ps(1.0f);
  if (act == 0) return _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
  const __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
  const __m512 inner = _mm512_fmadd_ps(_mm512_set1_ps(float(kGeluKappa)), g3, g);
  const __m512 y = _mm512_mul_ps(_mm512_set1_ps(float(kGeluBeta)), inner);
  const __m512 e = exp16(_mm512_add_ps(y, y));
  const __m512 tanh_y = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(one, e)));
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), g), _mm512_add_ps(one, tanh_y));
}

inline __mmask16 tail_mask(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 exp8(__m256 x) {
  return exp_poly8(_mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f)));
}

inline __m256 act8(__m256 g, int act) {
  const __m256 one = _mm256_set1_ps(1.0f);
  if (act == 0) return _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
  const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
  const __m256 inner = _mm256_fmadd_ps(_mm256_set1_ps(float(kGeluKappa)), g3, g);
  const __m256 y = _mm256_mul_ps(_mm256_set1_ps(float(kGeluBeta)), inner);
  const __m256 e = exp8(_mm256_add_ps(y, y));
  const __m256 tanh_y = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(one, e)));
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), _mm256_add_ps(one, tanh_y));
}
#endif

// ------------------------------------------------------------------------------------------ rms_norm
void rms_row(const float* __restrict x, const float* __restrict w, float* __restrict y, int64_t d, float eps) {
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  if (i < d) {
    const __m512 v = _mm512_maskz_loadu_ps(tail_mask(d - i), x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const float scale = 1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(d) + eps);
  const __m512 s = _mm512_set1_ps(scale);
  for (i = 0; i + 16 <= d; i += 16)
    _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), s), _mm512_loadu_ps(w + i)));
  if (i < d) {
    const __mmask16 m = tail_mask(d - i);
    _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), s),
                                                  _mm512_maskz_loadu_ps(m, w + i)));
  }
#else
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= d; i += 16)
    for (int k = 0; k < 16; ++k) acc[k] += x[i + k] * x[i + k];
  for (int k = 0; i + k < d; ++k) acc[k] += x[i + k] * x[i + k];
  for (int width = 8; width > 0; width /= 2)
    for (int k = 0; k < width; ++k) acc[k] += acc[k + width];
  const float scale = 1.0f / std::sqrt(acc[0] / static_cast<float>(d) + eps);
  for (i = 0; i < d; ++i) y[i] = (x[i] * scale) * w[i];
#endif
}

void rms_row(const double* __restrict x, const double* __restrict w, double* __restrict y, int64_t d, double eps) {
  double acc = 0;
  for (int64_t i = 0; i < d; ++i) acc += x[i] * x[i];
  const double scale = 1.0 / std::sqrt(acc / static_cast<double>(d) + eps);
  for (int64_t i = 0; i < d; ++i) y[i] = (x[i] * scale) * w[i];
}

// The element offset of each row of x (..., n) (last dim contiguous, any strides on the leading dims: a
// (B, L, H, D) view of a fused qkv GEMM output, the gate half of a fused gate|up output), in row-major order.
std::vector<int64_t> row_offsets(const at::Tensor& x) {
  const int64_t lead = x.dim() - 1;
  int64_t rows = 1;
  for (int64_t i = 0; i < lead; ++i) rows *= x.size(i);
  std::vector<int64_t> off(rows), idx(lead, 0);
  int64_t cur = 0;
  for (int64_t r = 0; r < rows; ++r) {
    off[r] = cur;
    for (int64_t i = lead - 1; i >= 0; --i) {  // odometer over the leading dims
      if (++idx[i] < x.size(i)) {
        cur += x.stride(i);
        break;
      }
      cur -= x.stride(i) * (x.size(i) - 1);
      idx[i] = 0;
    }
  }
  return off;
}

at::Tensor last_dim_contiguous(const at::Tensor& x) { return x.stride(-1) == 1 ? x : x.contiguous(); }

// x (..., D) (rows at any strides), w (D,) -> (..., D) contiguous: x * rsqrt(mean(x^2) + eps) * (w + offset).
inline bool is_half(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

// The bfloat16 / float16 rows of rms_norm (half_fused.h): w + offset widened to float32 once per call.
template <typename S>
void rms_norm_half(const at::Tensor& x, const at::Tensor& w, at::Tensor& y, const std::vector<int64_t>& rows,
                   double eps, double offset, bool round_normed) {
  const int64_t d = x.size(-1);
  std::vector<float> wf(d);
  widen(w.data_ptr<S>(), wf.data(), d);
  for (float& v : wf) v += static_cast<float>(offset);
  const S* xp = x.data_ptr<S>();
  S* yp = y.data_ptr<S>();
  at::parallel_for(0, static_cast<int64_t>(rows.size()), kGrain, [&](int64_t r0, int64_t r1) {
    std::vector<float> scratch(d);
    for (int64_t r = r0; r < r1; ++r)
      half_fused::rms_row(xp + rows[r], wf.data(), yp + r * d, d, static_cast<float>(eps), round_normed,
                          scratch.data());
  });
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w_in, double eps, double offset, bool round_normed) {
  TORCH_CHECK(x_in.dim() >= 1 && w_in.dim() == 1 && w_in.size(0) == x_in.size(-1),
              "rms_norm: x (..., D) and w (D,) expected, got ", x_in.sizes(), " and ", w_in.sizes());
  const auto dtype = x_in.scalar_type();
  TORCH_CHECK(dtype == w_in.scalar_type() && (dtype == at::kFloat || dtype == at::kDouble || is_half(dtype)),
              "rms_norm: float32 / float64 / bfloat16 / float16 x and w of one dtype");
  const at::Tensor x = last_dim_contiguous(x_in);
  const at::Tensor w = w_in.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options());
  const int64_t d = x.size(-1);
  if (x.numel() == 0) return y;
  const std::vector<int64_t> rows = row_offsets(x);
  if (dtype == at::kBFloat16) {
    rms_norm_half<c10::BFloat16>(x, w, y, rows, eps, offset, round_normed);
    return y;
  }
  if (dtype == at::kHalf) {
    rms_norm_half<c10::Half>(x, w, y, rows, eps, offset, round_normed);
    return y;
  }
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    std::vector<scalar_t> shifted;  // w + offset (Gemma's 1 + w), once per call
    const scalar_t* wp = w.data_ptr<scalar_t>();
    if (offset != 0.0) {
      shifted.resize(d);
      for (int64_t i = 0; i < d; ++i) shifted[i] = wp[i] + static_cast<scalar_t>(offset);
      wp = shifted.data();
    }
    scalar_t* yp = y.data_ptr<scalar_t>();
    const scalar_t e = static_cast<scalar_t>(eps);
    at::parallel_for(0, static_cast<int64_t>(rows.size()), kGrain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) rms_row(xp + rows[r], wp, yp + r * d, d, e);
    });
  });
  return y;
}

// ------------------------------------------------------------------------------------- act_and_mul
void act_mul_row(const float* __restrict g, const float* __restrict u, float* __restrict o, int64_t n, int act) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(o + i, _mm512_mul_ps(act16(_mm512_loadu_ps(g + i), act), _mm512_loadu_ps(u + i)));
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    _mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(act16(_mm512_maskz_loadu_ps(m, g + i), act),
                                                  _mm512_maskz_loadu_ps(m, u + i)));
  }
  return;
#elif defined(__AVX2__) && defined(__FMA__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(o + i, _mm256_mul_ps(act8(_mm256_loadu_ps(g + i), act), _mm256_loadu_ps(u + i)));
#endif
  for (; i < n; ++i) o[i] = act_one(g[i], act) * u[i];
}

void act_mul_row(const double* __restrict g, const double* __restrict u, double* __restrict o, int64_t n, int act) {
  for (int64_t i = 0; i < n; ++i) o[i] = act_one(g[i], act) * u[i];
}

// v[0, n) = act(v[0, n)) in float32: 16 lanes (AVX-512) or 8 (AVX2 + FMA) at a time, the rest one by one.
void act_in_place(float* v, int64_t n, int act) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(v + i, act16(_mm512_loadu_ps(v + i), act));
#elif defined(__AVX2__) && defined(__FMA__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(v + i, act8(_mm256_loadu_ps(v + i), act));
#endif
  for (; i < n; ++i) v[i] = act_one(v[i], act);
}

// The bfloat16 / float16 rows of act_and_mul (half_fused.h): o = S(S(act(g)) * u).
template <typename S>
void act_and_mul_half(const at::Tensor& g, const at::Tensor& u, at::Tensor& out, const std::vector<int64_t>& g_rows,
                      const std::vector<int64_t>& u_rows, int act) {
  const int64_t n = g.size(-1);
  const S* gp = g.data_ptr<S>();
  const S* up_ = u.data_ptr<S>();
  S* op = out.data_ptr<S>();
  at::parallel_for(0, static_cast<int64_t>(g_rows.size()), kGrain, [&](int64_t r0, int64_t r1) {
    std::vector<float> scratch(2 * n);
    auto vec = [act](float* v, int64_t len) { act_in_place(v, len, act); };
    for (int64_t r = r0; r < r1; ++r)
      half_fused::act_mul_row(gp + g_rows[r], up_ + u_rows[r], op + r * n, n, vec, scratch.data());
  });
}

// gate, up (..., I), last dim contiguous (row strides free) -> act(gate) * up (..., I) contiguous.
at::Tensor act_and_mul(const at::Tensor& gate, const at::Tensor& up, int64_t act) {
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.dim() >= 1, "act_and_mul: gate and up of one shape expected, got ",
              gate.sizes(), " and ", up.sizes());
  const auto dtype = gate.scalar_type();
  TORCH_CHECK(dtype == up.scalar_type() && (dtype == at::kFloat || dtype == at::kDouble || is_half(dtype)),
              "act_and_mul: float32 / float64 / bfloat16 / float16 gate and up of one dtype");
  TORCH_CHECK(act == 0 || act == 1, "act_and_mul: act is 0 (silu) or 1 (gelu tanh), got ", act);
  at::Tensor out = at::empty(gate.sizes(), gate.options());
  if (gate.numel() == 0) return out;
  const at::Tensor g = last_dim_contiguous(gate), u = last_dim_contiguous(up);
  const std::vector<int64_t> g_rows = row_offsets(g), u_rows = row_offsets(u);
  const int64_t n = g.size(-1);
  const int a = static_cast<int>(act);
  if (is_half(dtype)) {
    if (dtype == at::kBFloat16)
      act_and_mul_half<c10::BFloat16>(g, u, out, g_rows, u_rows, a);
    else
      act_and_mul_half<c10::Half>(g, u, out, g_rows, u_rows, a);
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES(gate.scalar_type(), "act_and_mul", [&] {
    const scalar_t* gp = g.data_ptr<scalar_t>();
    const scalar_t* up_ = u.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, static_cast<int64_t>(g_rows.size()), kGrain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) act_mul_row(gp + g_rows[r], up_ + u_rows[r], op + r * n, n, a);
    });
  });
  return out;
}

// ------------------------------------------------------------------------------------- small_linear
// out rows [0, m) x columns [j0, j1) of x (m, k) . w (n, k)^T, float32. AVX2 + FMA (k % 8 == 0): eight weight
// rows at a time, each dotted with every row of x while the eight are in cache (each weight read from memory
// once per call), eight 8-lane partial sums reduced together by one hadd tree; the rest one dot() per output.
void small_linear_cols(const float* x, int64_t m, const float* w, int64_t k, float* out, int64_t n, int64_t j0,
                       int64_t j1) {
  int64_t j = j0;
#if defined(__AVX2__) && defined(__FMA__)
  if (k % 8 == 0) {
    for (; j + 8 <= j1; j += 8) {
      const float* wj = w + j * k;
      for (int64_t r = 0; r < m; ++r) {
        const float* xr = x + r * k;
        __m256 acc[8];
        for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
        for (int64_t c = 0; c < k; c += 8) {
          const __m256 xv = _mm256_loadu_ps(xr + c);
          for (int u = 0; u < 8; ++u) acc[u] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(wj + u * k + c), acc[u]);
        }
        _mm256_storeu_ps(out + r * n + j, hsum8x8(acc));
      }
    }
  }
#endif
  for (; j < j1; ++j)
    for (int64_t r = 0; r < m; ++r) out[r * n + j] = dot(x + r * k, w + j * k, k);
}

// x (..., K) float32 with few rows, w (N, K), bias (N,) or None -> (..., N): a GEMM with a handful of rows
// (decode steps of one to a few sequences), where the weights' memory traffic is the cost.
at::Tensor small_linear(const at::Tensor& x_in, const at::Tensor& w_in, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.dim() >= 1 && w_in.dim() == 2 && w_in.size(1) == x_in.size(-1),
              "small_linear: x (..., K) and w (N, K) expected, got ", x_in.sizes(), " and ", w_in.sizes());
  const auto dtype = x_in.scalar_type();
  TORCH_CHECK(w_in.scalar_type() == dtype && (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf),
              "small_linear: float32 / bfloat16 / float16 x and w of one dtype expected");
  const bool has_bias = bias.has_value() && bias->defined();
  const int64_t k = w_in.size(1), n = w_in.size(0);
  TORCH_CHECK(!has_bias || (bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == dtype),
              "small_linear: bias (N,) of x's dtype expected, got ", has_bias ? bias->sizes() : at::IntArrayRef());
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, x.options());
  if (out.numel() == 0) return out;
  const int64_t m = out.numel() / n;  // rows (K may be 0: then every output is the bias, or 0)
  if (dtype != at::kFloat) {
    const at::Tensor b32 = has_bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
    const float* bp = has_bias ? b32.data_ptr<float>() : nullptr;
    if (dtype == at::kBFloat16)
      half_linear::linear(x.data_ptr<c10::BFloat16>(), m, w.data_ptr<c10::BFloat16>(), k, bp,
                          out.data_ptr<c10::BFloat16>(), n);
    else
      half_linear::linear(x.data_ptr<c10::Half>(), m, w.data_ptr<c10::Half>(), k, bp, out.data_ptr<c10::Half>(), n);
    return out;
  }
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, (n + 7) / 8, 16, [&](int64_t b0, int64_t b1) {
    small_linear_cols(xp, m, wp, k, op, n, b0 * 8, std::min(n, b1 * 8));
  });
  if (has_bias) out.add_(*bias);
  return out;
}

// Whether small_linear in bfloat16 / float16 is the faster linear at every row count on this build, not only for
// few rows: x86-64 builds without AVX-512 (float32 FMAs / GEMMs on widened weights), where torch's own half-precision
// GEMM is scalar code. Elsewhere (AVX-512; other architectures, whose torch may have a native bfloat16 GEMM) larger
// steps keep torch's.
bool half_linear_any_rows() {
#if !defined(FLASHPAGE_HALF_AVX512) && (defined(__x86_64__) || defined(_M_X64))
  return true;
#else
  return false;
#endif
}

// ------------------------------------------------------------------------------------------ rotary
template <typename T>
inline void rotate_row(const T* __restrict x, const T* __restrict c, const T* __restrict s, T* __restrict o,
                       int64_t half) {
  for (int64_t j = 0; j < half; ++j) o[j] = x[j] * c[j] - x[j + half] * s[j];
  for (int64_t j = 0; j < half; ++j) o[j + half] = x[j + half] * c[j + half] + x[j] * s[j + half];
}

// x (B, L, H, D) any strides (last contiguous) -> out (B, L, H, D) contiguous; cos / sin (B or 1, L, D).
template <typename T>
void rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t B = x.size(0), L = x.size(1), H = x.size(2), D = x.size(3), half = D / 2;
  const int64_t xb = x.stride(0), xl = x.stride(1), xh = x.stride(2);
  const int64_t cb = cos.size(0) == 1 ? 0 : cos.stride(0), cl = cos.stride(1);
  const int64_t sb = sin.size(0) == 1 ? 0 : sin.stride(0), sl = sin.stride(1);
  const T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, B * L, kGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / L, l = r % L;
      const T* c = cp + b * cb + l * cl;
      const T* s = sp + b * sb + l * sl;
      for (int64_t h = 0; h < H; ++h) rotate_row(xp + b * xb + l * xl + h * xh, c, s, op + (r * H + h) * D, half);
    }
  });
}

// rotate() for bfloat16 / float16 (half_fused.h): each row's cos / sin widened once per (b, l).
template <typename S>
void rotate_half(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t B = x.size(0), L = x.size(1), H = x.size(2), D = x.size(3), half = D / 2;
  const int64_t xb = x.stride(0), xl = x.stride(1), xh = x.stride(2);
  const int64_t cb = cos.size(0) == 1 ? 0 : cos.stride(0), cl = cos.stride(1);
  const int64_t sb = sin.size(0) == 1 ? 0 : sin.stride(0), sl = sin.stride(1);
  const S* xp = x.data_ptr<S>();
  const S* cp = cos.data_ptr<S>();
  const S* sp = sin.data_ptr<S>();
  S* op = out.data_ptr<S>();
  at::parallel_for(0, B * L, kGrain, [&](int64_t r0, int64_t r1) {
    std::vector<float> cs(2 * D), scratch(3 * D);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / L, l = r % L;
      widen(cp + b * cb + l * cl, cs.data(), D);
      widen(sp + b * sb + l * sl, cs.data() + D, D);
      for (int64_t h = 0; h < H; ++h)
        half_fused::rotate_row(xp + b * xb + l * xl + h * xh, cs.data(), cs.data() + D, op + (r * H + h) * D, half,
                               scratch.data());
    }
  });
}

at::Tensor rotate_one(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin, int64_t unsqueeze_dim) {
  const at::Tensor x = unsqueeze_dim == 1 ? x_in.transpose(1, 2) : x_in;  // (B, L, H, D)
  TORCH_CHECK(x.size(0) == cos.size(0) || cos.size(0) == 1, "rotary: cos / sin batch ", cos.size(0),
              " does not match q / k's ", x.size(0));
  TORCH_CHECK(x.size(1) == cos.size(1) && x.size(3) == cos.size(2),
              "rotary: cos / sin (B, L, D) do not match q / k ", x_in.sizes(), " with unsqueeze_dim ", unsqueeze_dim);
  const at::Tensor xs = x.stride(3) == 1 ? x : x.contiguous();
  at::Tensor out = at::empty(xs.sizes(), xs.options());
  if (out.numel() > 0 && x.scalar_type() == at::kBFloat16)
    rotate_half<c10::BFloat16>(xs, cos, sin, out);
  else if (out.numel() > 0 && x.scalar_type() == at::kHalf)
    rotate_half<c10::Half>(xs, cos, sin, out);
  else if (out.numel() > 0)
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rotary", [&] { rotate<scalar_t>(xs, cos, sin, out); });
  return unsqueeze_dim == 1 ? out.transpose(1, 2) : out;
}

// q (B, H, L, D) / k (B, Hk, L, D) with unsqueeze_dim 1, (B, L, H, D) with 2; cos, sin (B or 1, L, D), D even:
// (q * cos + rotate_half(q) * sin, same for k), new tensors laid out (B, L, H, D).
std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos_in,
                                          const at::Tensor& sin_in, int64_t unsqueeze_dim) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && cos_in.dim() == 3 && sin_in.sizes() == cos_in.sizes(),
              "rotary: q, k (4-D) and cos, sin (B, L, D) expected, got ", q.sizes(), ", ", k.sizes(), ", ",
              cos_in.sizes(), ", ", sin_in.sizes());
  TORCH_CHECK(unsqueeze_dim == 1 || unsqueeze_dim == 2, "rotary: unsqueeze_dim is 1 or 2, got ", unsqueeze_dim);
  TORCH_CHECK(cos_in.size(2) % 2 == 0, "rotary: the head dim must be even, got ", cos_in.size(2));
  const auto dtype = q.scalar_type();
  TORCH_CHECK(k.scalar_type() == dtype && cos_in.scalar_type() == dtype && sin_in.scalar_type() == dtype &&
              (dtype == at::kFloat || dtype == at::kDouble || is_half(dtype)),
              "rotary: float32 / float64 / bfloat16 / float16 q, k, cos, sin of one dtype");
  const at::Tensor cos = cos_in.stride(2) == 1 ? cos_in : cos_in.contiguous();
  const at::Tensor sin = sin_in.stride(2) == 1 ? sin_in : sin_in.contiguous();
  return {rotate_one(q, cos, sin, unsqueeze_dim), rotate_one(k, cos, sin, unsqueeze_dim)};
}

}  // namespace

// The op namespace: flashpage_fused, or flashpage_fused_portable for the build without -march=native that
// the tests load beside it (TORCH_LIBRARY pastes its argument: the extra macro expands the name first).
#ifndef FLASHPAGE_FUSED_NS
#define FLASHPAGE_FUSED_NS flashpage_fused
#endif
#define FLASHPAGE_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)

FLASHPAGE_LIBRARY(FLASHPAGE_FUSED_NS, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps, float offset, bool round_normed=True) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.def("act_and_mul(Tensor gate, Tensor up, int act) -> Tensor");
  m.impl("act_and_mul", c10::DispatchKey::CPU, TORCH_FN(act_and_mul));
  m.def("rotary(Tensor q, Tensor k, Tensor cos, Tensor sin, int unsqueeze_dim) -> (Tensor, Tensor)");
  m.impl("rotary", c10::DispatchKey::CPU, TORCH_FN(rotary));
  m.def("small_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.impl("small_linear", c10::DispatchKey::CPU, TORCH_FN(small_linear));
  m.def("half_linear_any_rows() -> bool", TORCH_FN(half_linear_any_rows));
}
