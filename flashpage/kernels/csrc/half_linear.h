// x (m, k) . w (n, k)^T for bfloat16 / float16 x and w (the engine's half-precision linears), float32 sums rounded to
// the output dtype once (the bias added in float32 first):
// - builds with AVX-512 (up to a few hundred rows: decode steps, small prefills; larger steps take torch's GEMM), each
//   weight row read from memory once per pass of rows (a pass: as many rows as fit ~256 KiB, so they and a 64-row
//   block of weights stay in L2 while every tile reads them):
//   - bfloat16 on a build with __AVX512BF16__: tiles of R <= 4 rows x U <= 6 weight rows (2 x 8 for at most 8 rows),
//     32 products per vdpbf16ps (each bfloat16 product is exact in float32, summed in float32), up to 24 accumulators
//     in registers (4 x 6 measured 5% faster than 4 x 4; 6 x 4, 5 x 4 and 8 x 3 no faster than 4 x 4), their lanes
//     added by transposing trees (lane_sums in half.h: 16 horizontal reductions cost ~130 instructions, one tree
//     ~45); measured at Qwen3-0.6B's widths (8 layers' weights streamed, 1 thread, AMD EPYC Zen 4), the trees and the
//     passes of rows took the kernel from 159-185 to 174-208 GF/s at 32-1024 rows (engine/linears.py has the
//     comparison);
//   - bfloat16 / float16 on an AVX-512 build without it: the same tiles, 16 halves widened to float32 and FMA'd;
// - other builds (AVX2 CPUs, the portable build), every row count (linear_widened): torch's own half-precision GEMM
//   is scalar code there (8-10 GF/s at Qwen3-0.6B's widths on an AMD EPYC Zen 3, against 76-86 GF/s for its float32
//   GEMM), so x is widened to float32 once and
//   - steps of at most kTileRows rows (decodes) read the weights in place, 8 halves widened per load in registers,
//     tiles of 1 x 8 or 2 x 4 (rows x weight rows) float32 FMAs (few_rows_avx2; AVX2 + FMA + F16C);
//   - larger steps widen the weights a block of rows at a time (1 MiB of float32: it stays in L2 while the GEMM reads
//     it) and multiply each block through torch's float32 GEMM (MKL / oneDNN, with its own threads).
// Included by cpu_fused.cpp (after common.h and half.h).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <algorithm>
#include <vector>

#include "common.h"
#include "half.h"

namespace half_linear {

constexpr int64_t kWideRows = 8;  // calls of at most this many rows take blocks of eight weight rows

#if defined(FLASHPAGE_HALF_AVX512)
inline __mmask32 mask32(int64_t n) { return n >= 32 ? ~__mmask32(0) : (__mmask32(1) << n) - 1; }
inline __mmask16 mask16(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u); }

// sums[r * U + u] = x row r . w row u over k for an R x U tile (x and w rows at stride k); R * U accumulators
// stay in registers (one flat array, fully unrolled: GCC keeps a 2-D one on the stack). The U weight rows after
// the tile's (the next column block: streamed from memory) are prefetched into L2 (T1) as the tile's rows are read:
// into L1 (T0) they took L1 from the tile's own rows; measured with the Qwen3-0.6B shape's weights x 8 layers and its
// LM head streamed from memory, 1 thread, T1 / T0 time: 1 row 0.68, 8 rows 0.68, 20 rows 0.85, 32 rows 0.9 (a
// distance of 2 or 8 blocks, or T2, measured the same; no software prefetch: 1.25x T0's time at 20 rows).
#if defined(__AVX512BF16__)
template <int R, int U>
inline void tile_sums_dp(const c10::BFloat16* x, const c10::BFloat16* w, int64_t k, float* sums) {
  __m512 acc[R * U];
#pragma GCC unroll 24
  for (int i = 0; i < R * U; ++i) acc[i] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 32 <= k; c += 32) {  // whole vectors: plain loads (masked ones in the loop cost 12-15% here)
    __m512i wv[U];
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) {
      wv[u] = _mm512_loadu_si512(w + u * k + c);
      _mm_prefetch(reinterpret_cast<const char*>(w + (u + U) * k + c), _MM_HINT_T1);  // the next block's rows
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512i xv = _mm512_loadu_si512(x + r * k + c);
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) acc[r * U + u] = _mm512_dpbf16_ps(acc[r * U + u], (__m512bh)xv, (__m512bh)wv[u]);
    }
  }
  if (c < k) {  // the tail: masked loads (lanes past k are 0)
    const __mmask32 m = mask32(k - c);
    __m512i wv[U];
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) wv[u] = _mm512_maskz_loadu_epi16(m, w + u * k + c);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512i xv = _mm512_maskz_loadu_epi16(m, x + r * k + c);
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) acc[r * U + u] = _mm512_dpbf16_ps(acc[r * U + u], (__m512bh)xv, (__m512bh)wv[u]);
    }
  }
  lane_sums<R * U>(acc, sums);  // one transposing tree per 16 (or 4) accumulators
}
#endif

template <typename S, int R, int U>
inline void tile_sums_fma(const S* x, const S* w, int64_t k, float* sums) {
  __m512 acc[R * U];
#pragma GCC unroll 24
  for (int i = 0; i < R * U; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < k; c += 16) {
    const __mmask16 m = mask16(k - c);
    __m512 wv[U];
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) {
      wv[u] = load16(w + u * k + c, m);
      if (c % 32 == 0) _mm_prefetch(reinterpret_cast<const char*>(w + (u + U) * k + c), _MM_HINT_T1);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 xv = load16(x + r * k + c, m);
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) acc[r * U + u] = _mm512_fmadd_ps(xv, wv[u], acc[r * U + u]);
    }
  }
  lane_sums<R * U>(acc, sums);  // one transposing tree per 16 (or 4) accumulators
}

template <typename S, int R, int U>
inline void tile_sums(const S* x, const S* w, int64_t k, float* sums) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<S, c10::BFloat16>) return tile_sums_dp<R, U>(x, w, k, sums);
#endif
  tile_sums_fma<S, R, U>(x, w, k, sums);
}

// Rows [0, m) of the U weight rows at w (columns j .. j+U-1 of out), R = 4 rows at a time then the rest.
template <typename S, int U>
inline void column_block(const S* x, int64_t m, const S* w, int64_t k, float* sums, int64_t ld) {
  float t[4 * U];
  int64_t r = 0;
  for (; r + 4 <= m; r += 4) {
    tile_sums<S, 4, U>(x + r * k, w, k, t);
    for (int i = 0; i < 4; ++i) std::copy_n(t + i * U, U, sums + (r + i) * ld);
  }
  const int64_t left = m - r;
  if (left == 0) return;
  if (left == 1) tile_sums<S, 1, U>(x + r * k, w, k, t);
  if (left == 2) tile_sums<S, 2, U>(x + r * k, w, k, t);
  if (left == 3) tile_sums<S, 3, U>(x + r * k, w, k, t);
  for (int64_t i = 0; i < left; ++i) std::copy_n(t + i * U, U, sums + (r + i) * ld);
}

// sums (m, j1 - j0) float32 (row stride ld) of x . w^T for the weight rows [j0, j1).
template <typename S>
void column_sums(const S* x, int64_t m, const S* w, int64_t k, int64_t j0, int64_t j1, float* sums, int64_t ld) {
  int64_t j = j0;
  for (; m <= kWideRows && j + 8 <= j1; j += 8) {  // few rows: eight weight rows in flight (memory-bound)
    for (int64_t r = 0; r < m; r += 2) {  // the later row pairs find the eight rows in L1
      float t[16];
      if (m - r == 1)
        tile_sums<S, 1, 8>(x + r * k, w + j * k, k, t);
      else
        tile_sums<S, 2, 8>(x + r * k, w + j * k, k, t);
      for (int64_t i = 0; i < std::min<int64_t>(2, m - r); ++i) std::copy_n(t + i * 8, 8, sums + (r + i) * ld + (j - j0));
    }
  }
  for (; j + 6 <= j1; j += 6) column_block<S, 6>(x, m, w + j * k, k, sums + (j - j0), ld);  // 24 accumulators
  for (; j + 4 <= j1; j += 4) column_block<S, 4>(x, m, w + j * k, k, sums + (j - j0), ld);
  for (; j < j1; ++j) column_block<S, 1>(x, m, w + j * k, k, sums + (j - j0), ld);
}

// out (m, n) in S = round(x . w^T + bias) for the weight rows [j0, j1), through a float32 block of sums.
template <typename S>
void linear_cols(const S* x, int64_t m, const S* w, int64_t k, const float* bias, S* out, int64_t n, int64_t j0,
                 int64_t j1) {
  constexpr int64_t kBlock = 64;  // output columns per float32 block of sums
  // rows per pass: a pass's x rows (~256 KiB) and the block's 64 weight rows stay in L2 while every tile reads them
  const int64_t chunk = std::max<int64_t>(4, (int64_t(128) << 10) / std::max<int64_t>(k, 1) / 4 * 4);
  std::vector<float> sums(std::min(m, chunk) * kBlock);
  for (int64_t c0 = j0; c0 < j1; c0 += kBlock) {
    const int64_t c1 = std::min(j1, c0 + kBlock), width = c1 - c0;
    for (int64_t r0 = 0; r0 < m; r0 += chunk) {
      const int64_t rows = std::min(chunk, m - r0);
      column_sums(x + r0 * k, rows, w, k, c0, c1, sums.data(), kBlock);
      for (int64_t r = 0; r < rows; ++r) {
        float* row = sums.data() + r * kBlock;
        if (bias != nullptr)
          for (int64_t j = 0; j < width; ++j) row[j] += bias[c0 + j];
        narrow(row, out + (r0 + r) * n + c0, width);
      }
    }
  }
}

#else  // builds without AVX-512: linear_widened (see the top of this file)
constexpr int64_t kWidenedFloats = int64_t(256) << 10;  // a block of widened weights: 1 MiB (256 KiB measured slower)

template <typename S>
void widen_parallel(const S* src, float* dst, int64_t rows, int64_t k) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1)), [&](int64_t r0, int64_t r1) {
    widen(src + r0 * k, dst + r0 * k, (r1 - r0) * k);
  });
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int64_t kTileRows = 24;  // calls of at most this many rows read the weights in place (few_rows_avx2)

// sums[r * U + u] (R * U == 8) = float32 x row r (stride ldx) . w row u (stride k), the weights widened in registers
// 8 at a time; the 8 sums of lanes by one hadd tree, the tail (k % 8) added in order.
template <typename S, int R, int U>
inline void tile8(const float* x, int64_t ldx, const S* w, int64_t k, float* sums) {
  static_assert(R * U == 8, "eight accumulators");
  __m256 acc[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= k; c += 8) {
    __m256 wv[U];
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) wv[u] = load8(w + u * k + c);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * ldx + c);
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) acc[r * U + u] = _mm256_fmadd_ps(xv, wv[u], acc[r * U + u]);
    }
  }
  _mm256_storeu_ps(sums, hsum8x8(acc));
  for (; c < k; ++c)
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < U; ++u) sums[r * U + u] += x[r * ldx + c] * static_cast<float>(w[u * k + c]);
}

// Few rows (decode steps): out rows [0, m) x weight rows [j0, j1), each weight row read from memory once: eight
// weight rows per tile for one row of x, four for each pair (the later pairs find the four rows in L1).
template <typename S>
void few_rows_avx2(const float* xf, int64_t m, const S* w, int64_t k, const float* bias, S* out, int64_t n,
                   int64_t j0, int64_t j1) {
  float t[8];
  std::vector<float> row(m * 8);
  int64_t j = j0;
  const int U = m == 1 ? 8 : 4;
  for (; j + U <= j1; j += U) {
    const S* wj = w + j * k;
    if (m == 1) {
      tile8<S, 1, 8>(xf, k, wj, k, row.data());
    } else {
      for (int64_t r = 0; r < m; r += 2) {
        if (m - r == 1) {  // the last odd row: its four sums, twice over (the duplicate dropped)
          tile8<S, 2, 4>(xf + r * k, 0, wj, k, t);
        } else {
          tile8<S, 2, 4>(xf + r * k, k, wj, k, t);
          std::copy_n(t + 4, 4, row.data() + (r + 1) * 8);
        }
        std::copy_n(t, 4, row.data() + r * 8);
      }
    }
    for (int64_t r = 0; r < m; ++r) {
      float* v = row.data() + r * 8;
      if (bias != nullptr)
        for (int u = 0; u < U; ++u) v[u] += bias[j + u];
      narrow(v, out + r * n + j, U);
    }
  }
  for (; j < j1; ++j)  // the last weight rows, one at a time
    for (int64_t r = 0; r < m; ++r) {
      float v = 0.f;
      for (int64_t c = 0; c < k; ++c) v += xf[r * k + c] * static_cast<float>(w[j * k + c]);
      if (bias != nullptr) v += bias[j];
      out[r * n + j] = static_cast<S>(v);
    }
}
#endif

template <typename S>
void linear_widened(const S* x, int64_t m, const S* w, int64_t k, const float* bias, S* out, int64_t n) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor xf = at::empty({m, k}, f32);
  widen_parallel(x, xf.data_ptr<float>(), m, k);
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  if (m <= kTileRows) {
    const float* xp = xf.data_ptr<float>();
    at::parallel_for(0, (n + 7) / 8, 16, [&](int64_t b0, int64_t b1) {
      few_rows_avx2(xp, m, w, k, bias, out, n, b0 * 8, std::min(n, b1 * 8));
    });
    return;
  }
#endif
  const int64_t block = std::min(n, std::max<int64_t>(16, kWidenedFloats / std::max<int64_t>(k, 1) / 16 * 16));
  const at::Tensor wf = at::empty({block, k}, f32), of = at::empty({m, block}, f32);
  for (int64_t j0 = 0; j0 < n; j0 += block) {
    const int64_t rows = std::min(block, n - j0);
    widen_parallel(w + j0 * k, wf.data_ptr<float>(), rows, k);
    at::Tensor o = of.narrow(1, 0, rows);
    at::mm_out(o, xf, wf.narrow(0, 0, rows).t());
    const float* op = o.data_ptr<float>();
    const int64_t ld = o.stride(0);
    at::parallel_for(0, m, 64, [&](int64_t r0, int64_t r1) {
      std::vector<float> row(rows);
      for (int64_t r = r0; r < r1; ++r) {
        const float* src = op + r * ld;
        if (bias != nullptr) {
          for (int64_t j = 0; j < rows; ++j) row[j] = src[j] + bias[j0 + j];
          src = row.data();
        }
        narrow(src, out + r * n + j0, rows);
      }
    });
  }
}
#endif

// x (m, k), w (n, k) contiguous, bias float32 (n,) or nullptr -> out (m, n): over at::parallel_for column blocks
// (builds with AVX-512), or linear_widened (other builds).
template <typename S>
void linear(const S* x, int64_t m, const S* w, int64_t k, const float* bias, S* out, int64_t n) {
#if defined(FLASHPAGE_HALF_AVX512)
  at::parallel_for(0, (n + 63) / 64, 4, [&](int64_t b0, int64_t b1) {
    linear_cols(x, m, w, k, bias, out, n, b0 * 64, std::min(n, b1 * 64));
  });
#else
  linear_widened(x, m, w, k, bias, out, n);
#endif
}

}  // namespace half_linear
