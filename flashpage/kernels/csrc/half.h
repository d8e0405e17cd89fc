// Half-precision (bfloat16 / float16) loads and stores for flashpage's CPU extensions: rows of c10::BFloat16 /
// c10::Half widened to float32 (the math of every half-precision op here is float32, as flash-attn and oneDNN
// accumulate), and float32 rounded back to nearest-even on store (c10's conversions: what torch's own
// .to(bfloat16) / .to(float16) do). Vector paths are picked at compile time by the compiler's macros
// (__AVX512F__, __AVX512BW__, __AVX512BF16__, __F16C__: -march=native on the machine that builds it); without them
// the scalar c10 conversions run, with identical results.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

template <typename S>
inline constexpr bool kIsHalf = std::is_same_v<S, c10::BFloat16> || std::is_same_v<S, c10::Half>;

#if defined(__AVX2__) && defined(__F16C__)
// 8 halves at p widened to float32 (exact), in one register: widen's AVX2 loop and half_linear.h's tiles.
template <typename S>
inline __m256 load8(const S* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (std::is_same_v<S, c10::BFloat16>)
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  else
    return _mm256_cvtph_ps(h);
}
#endif

// dst[0, n) = float(src[0, n)): exact (every bfloat16 / float16 value is a float32).
template <typename S>
inline void widen(const S* __restrict src, float* __restrict dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<S, c10::BFloat16>) {
    for (; i + 16 <= n; i += 16) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
      _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
    }
  } else {
    for (; i + 16 <= n; i += 16)
      _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
  }
#elif defined(__AVX2__) && defined(__F16C__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// 16 float32 lanes rounded to nearest-even in S, as 16 x 16 bits (NaN: the quiet NaN c10 gives, 0x7FC0 / 0x7E00).
template <typename S>
inline __m256i to_half16(__m512 v) {
  if constexpr (std::is_same_v<S, c10::BFloat16>) {
    const __m512i b = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
  } else {
    return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
}
#endif

#if defined(__AVX2__) && defined(__F16C__) && !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__))
// 8 float32 lanes rounded to nearest-even in S, as 8 x 16 bits (to_half16's rounding, 8 lanes: AVX2 + F16C builds).
template <typename S>
inline __m128i to_half8(__m256 v) {
  if constexpr (std::is_same_v<S, c10::BFloat16>) {
    const __m256i b = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  } else {
    return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
}
#endif

// dst[0, n) = round-to-nearest-even(src[0, n)) (NaN stays NaN).
template <typename S>
inline void narrow(const float* __restrict src, S* __restrict dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), to_half16<S>(_mm512_loadu_ps(src + i)));
#elif defined(__AVX2__) && defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), to_half8<S>(_mm256_loadu_ps(src + i)));
#endif
  for (; i < n; ++i) dst[i] = static_cast<S>(src[i]);
}

// src[0, n) rounded to S and back to float32 in place (an op's result as transformers' half-precision op gives it).
template <typename S>
inline void round_through(float* __restrict v, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  for (; i + 16 <= n; i += 16) {
    const __m256i h = to_half16<S>(_mm512_loadu_ps(v + i));
    if constexpr (std::is_same_v<S, c10::BFloat16>)
      _mm512_storeu_ps(v + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
    else
      _mm512_storeu_ps(v + i, _mm512_cvtph_ps(h));
  }
#endif
  for (; i < n; ++i) v[i] = static_cast<float>(static_cast<S>(v[i]));
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FLASHPAGE_HALF_AVX512 1
// 16 halves at p (mask m: lanes to load, the others 0) widened to float32.
template <typename S>
inline __m512 load16(const S* p, __mmask16 m = 0xFFFF) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  if constexpr (std::is_same_v<S, c10::BFloat16>)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  else
    return _mm512_cvtph_ps(h);
}
#endif

#if defined(FLASHPAGE_HALF_AVX512)
// out[i] = the sum of v[i]'s 16 lanes, i < 16: one transposing tree of 15 adds and 30 shuffles (16 separate horizontal
// reductions take about 130 instructions). The lanes are added in another order than _mm512_reduce_add_ps's.
__attribute__((always_inline)) inline __m512 sum16x16(const __m512* v) {
  __m512 a[8], b[4], c[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)  // a[i]: v[2i]'s and v[2i+1]'s 256-bit halves added: [8 of v[2i] | 8 of v[2i+1]]
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)  // b[i]: 128-bit lanes [4 of v[4i] | v[4i+1] | v[4i+2] | v[4i+3]]
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)  // c[i], 128-bit lane l: 2 of v[8i+l], 2 of v[8i+l+4], interleaved
    c[i] = _mm512_add_ps(_mm512_unpacklo_ps(b[2 * i], b[2 * i + 1]), _mm512_unpackhi_ps(b[2 * i], b[2 * i + 1]));
  const __m512d c0 = _mm512_castps_pd(c[0]), c1 = _mm512_castps_pd(c[1]);
  // lane l, element e: the sum of v[l + 4e]
  const __m512 d = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c0, c1)), _mm512_castpd_ps(_mm512_unpackhi_pd(c0, c1)));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), d);
}

// out[i] = the sum of v[i]'s 16 lanes, i < 4: 9 shuffles and 7 adds (4 horizontal reductions take about 32).
__attribute__((always_inline)) inline __m128 sum4x16(const __m512* v) {
  // per 128-bit lane: [v0 0+2, v1 0+2, v0 1+3, v1 1+3], the same for v2, v3
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(v[0], v[1]), _mm512_unpackhi_ps(v[0], v[1]));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(v[2], v[3]), _mm512_unpackhi_ps(v[2], v[3]));
  // per 128-bit lane: [v0, v1, v2, v3] (that lane's four elements added)
  const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// sums[i] = the sum of v[i]'s 16 lanes, i < N: sixteen at a time, then four, then one by one.
template <int N>
__attribute__((always_inline)) inline void lane_sums(const __m512* v, float* sums) {
  int i = 0;
#pragma GCC unroll 4
  for (; i + 16 <= N; i += 16) _mm512_storeu_ps(sums + i, sum16x16(v + i));
#pragma GCC unroll 4
  for (; i + 4 <= N; i += 4) _mm_storeu_ps(sums + i, sum4x16(v + i));
#pragma GCC unroll 4
  for (; i < N; ++i) sums[i] = _mm512_reduce_add_ps(v[i]);
}
#endif
