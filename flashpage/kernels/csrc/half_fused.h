// bfloat16 / float16 rows of cpu_fused.cpp's RMSNorm, activation-and-product and rotary: float32 math, rounded to
// the storage dtype S where transformers' eager modules round (each of their ops on a half tensor computes in
// float32 and rounds its result), so the fused op gives the modules' own bits up to float32 rounding of the
// float32 steps (1 ulp of an intermediate, rarely visible after the final rounding):
// - RMSNorm, Llama / Qwen order (round_normed): y = S(w * S(x * rsqrt(mean(x^2) + eps))); Gemma order (not
//   round_normed): y = S(x * rsqrt(...) * (w + offset)), one rounding;
// - act_and_mul: o = S(S(act(g)) * u);
// - rotary: first half S(S(x1 c1) - S(x2 s1)), second half S(S(x2 c2) + S(x1 s2)) (q * cos + rotate_half(q) * sin).
// Included by cpu_fused.cpp after half.h and its act_one / exp helpers.
#pragma once

#include <vector>

#include "half.h"

namespace half_fused {

// One row of x (d,) -> y (d,); w (d,) already widened to float32 (with the offset added).
template <typename S>
void rms_row(const S* x, const float* w, S* y, int64_t d, float eps, bool round_normed, float* scratch) {
  widen(x, scratch, d);
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= d; i += 16)
    for (int k = 0; k < 16; ++k) acc[k] += scratch[i + k] * scratch[i + k];
  for (int k = 0; i + k < d; ++k) acc[k] += scratch[i + k] * scratch[i + k];
  for (int width = 8; width > 0; width /= 2)
    for (int k = 0; k < width; ++k) acc[k] += acc[k + width];
  const float scale = 1.0f / std::sqrt(acc[0] / static_cast<float>(d) + eps);
  if (round_normed) {
    for (i = 0; i < d; ++i) scratch[i] *= scale;
    round_through<S>(scratch, d);
    for (i = 0; i < d; ++i) scratch[i] *= w[i];
  } else
    for (i = 0; i < d; ++i) scratch[i] = (scratch[i] * scale) * w[i];
  narrow(scratch, y, d);
}

// One row: o = S(S(act(g)) * u), through float32 scratch rows (a: 2 * n floats); act_vec(v, n): v = act(v).
template <typename S, typename ActVec>
void act_mul_row(const S* g, const S* u, S* o, int64_t n, ActVec act_vec, float* a) {
  float* b = a + n;
  widen(g, a, n);
  widen(u, b, n);
  act_vec(a, n);  // a[i] = act(a[i]), 16 lanes at a time where it can (the rest: act)
  round_through<S>(a, n);
  for (int64_t i = 0; i < n; ++i) a[i] *= b[i];
  narrow(a, o, n);
}

// One head row x (D,) -> o (D,) with cos / sin rows c, s (D,) widened to float32; scratch: 3 * D floats.
template <typename S>
void rotate_row(const S* x, const float* c, const float* s, S* o, int64_t half, float* scratch) {
  float* xf = scratch;
  float* of = scratch + 2 * half;
  widen(x, xf, 2 * half);
  float* t = scratch + 4 * half;  // the two products of each output, rounded as transformers' ops round them
  for (int64_t j = 0; j < half; ++j) {
    of[j] = xf[j] * c[j];
    t[j] = xf[j + half] * s[j];
    of[j + half] = xf[j + half] * c[j + half];
    t[j + half] = xf[j] * s[j + half];
  }
  round_through<S>(of, 2 * half);
  round_through<S>(t, 2 * half);
  for (int64_t j = 0; j < half; ++j) {
    of[j] -= t[j];
    of[j + half] += t[j + half];
  }
  narrow(of, o, 2 * half);
}

}  // namespace half_fused
