// bfloat16 / float16 paged attention (included by cpu_attention.cpp after its generic float32 tile helpers and
// Task / plan_tasks): the generic tile's float32 arithmetic (attend_tile: per-key scores for decode tiles, one GEMM
// per page for tiles of kGemmRows or more (query, head) rows, the online softmax in float32) on widened copies: the
// tile's queries (times the softmax factor) once, and per page the K / V rows of the tile's KV head that some row
// sees, widened into per-thread float32 scratch (each key / value row is read from memory once per tile, as the
// float32 loops read them); decode tiles on an AVX-512 build (head dim % 16, value dim % 128) read the K / V rows in
// place instead, widening 16 halves per load in registers (page_rows_direct); bfloat16 prefill tiles on an
// AVX512_BF16 build run both GEMMs as vdpbf16ps on packed bfloat16 K / V / P instead (bf16_prefill). The output is
// rounded to the query's dtype once; the log-sum-exp stays float32 (as flash-attn returns it for half inputs).
#pragma once

#include "half.h"

namespace half_attention {

template <typename S>
struct HalfArgs {
  const S* q;   // (T, H, D) at f.q_t / f.q_h
  const S* k;   // (NB, P, Hk, D) at f.k_b / f.k_p / f.k_h
  const S* v;   // (NB, P, Hk, Dv)
  S* out;       // (T, H, Dv) at f.o_t / f.o_h
  Args<float> f;  // every other field (its q / k / v / out pointers unused); f.lse float32, f.sinks float32
  bool generic = false;  // the portable mode (mode 1): prefill tiles take the widened copies on every build
};

// Work's query rows, running max / sum and accumulators for rows i0 .. i1-1 of sequence b, KV head hk.
template <typename S>
void start(const HalfArgs<S>& h, int64_t b, int64_t hk, int64_t i0, int64_t i1, Work<float>& w) {
  const Args<float>& a = h.f;
  const int64_t group = a.heads / a.kv_heads, d = a.d;
  size_rows(w, (i1 - i0) * group, d, a.dv);
  for (int64_t i = i0; i < i1; ++i)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = (i - i0) * group + g, head = hk * group + g;
      float* dst = w.q.data() + r * d;
      widen(h.q + (a.cu_q[b] + i) * a.q_t + head * a.q_h, dst, d);
      for (int64_t x = 0; x < d; ++x) dst[x] *= a.factor;
      w.m[r] = a.sinks ? a.sinks[head] : -std::numeric_limits<float>::infinity();
      w.l[r] = a.sinks ? 1.0f : 0.0f;
      std::fill_n(w.acc.data() + r * a.dv, a.dv, 0.0f);
    }
}

// out rows = S(acc / l) (0 where a row saw no key and no sink), lse = m + log(l) (+inf without keys).
template <typename S>
void finish(const HalfArgs<S>& h, int64_t b, int64_t hk, int64_t i0, int64_t i1, Work<float>& w) {
  const Args<float>& a = h.f;
  const int64_t group = a.heads / a.kv_heads, dv = a.dv;
  for (int64_t i = i0; i < i1; ++i)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = (i - i0) * group + g, head = hk * group + g;
      float* o = w.acc.data() + r * dv;
      const float inv = w.l[r] > 0 ? 1.0f / w.l[r] : 0.0f;
      for (int64_t x = 0; x < dv; ++x) o[x] *= inv;
      narrow(o, h.out + (a.cu_q[b] + i) * a.o_t + head * a.o_h, dv);
      a.lse[(a.cu_q[b] + i) * a.heads + head] =
          w.l[r] > 0 ? w.m[r] + std::log(w.l[r]) : std::numeric_limits<float>::infinity();
    }
}

// Rows n of K (or V) for KV head hk from page row `first` of block blk, widened into dst (n, width) contiguous.
template <typename S>
inline void widen_rows(const S* base, int64_t blk_stride, int64_t row_stride, int64_t head_stride, int64_t blk,
                       int64_t hk, int64_t first, int64_t n, int64_t width, float* dst) {
  const S* src = base + blk * blk_stride + hk * head_stride + first * row_stride;
  for (int64_t j = 0; j < n; ++j) widen(src + j * row_stride, dst + j * width, width);
}

// Scores, softmax and P.V of the GEMM-sized tile rows on one page's widened keys kf (n, d) / values vf (n, dv).
void page_gemm(const Args<float>& a, int64_t i0, int64_t i1, int64_t shift, int64_t j0, int64_t j1, const float* kf,
               const float* vf, Work<float>& w) {
  const int64_t group = a.heads / a.kv_heads, rows = (i1 - i0) * group, n = j1 - j0, d = a.d, dv = a.dv;
  const auto opts = at::TensorOptions().dtype(at::kFloat);
  auto qt = at::from_blob(w.q.data(), {rows, d}, opts);
  auto kt = at::from_blob(const_cast<float*>(kf), {n, d}, opts);
  auto vt = at::from_blob(const_cast<float*>(vf), {n, dv}, opts);
  auto st = at::from_blob(w.s.data(), {rows, n}, opts);
  auto ot = at::from_blob(w.acc.data(), {rows, dv}, opts);
  at::mm_out(st, qt, kt.t());
  for (int64_t i = i0; i < i1; ++i) {
    int64_t s0, s1;
    row_span(a, i, shift, j0, j1, s0, s1);
    for (int64_t g = 0; g < group; ++g) {
      float* srow = w.s.data() + ((i - i0) * group + g) * n;
      if (s0 >= s1) {
        std::fill(srow, srow + n, 0.0f);
        continue;
      }
      if (a.softcap > 0)
        for (int64_t j = s0 - j0; j < s1 - j0; ++j) srow[j] = a.softcap * std::tanh(srow[j]);
      softmax_update(w, (i - i0) * group + g, dv, srow + (s0 - j0), s1 - s0, true);
      std::fill(srow, srow + (s0 - j0), 0.0f);
      std::fill(srow + (s1 - j0), srow + n, 0.0f);
    }
  }
  ot.addmm_(st, vt);
}

// The few-row tiles' loop over query rows i0 .. i1-1 on one page's keys j0 .. j1-1: for each row's visible keys
// (from s0 = j0 + off, n_i of them) scores(r0, off, n_i) fills w.s with the group's rows of n_i scores (r0: the
// group's first row in the tile), then the softcap, the online softmax, and pv(r0, off, n_i) adds P.V into w.acc.
template <typename Scores, typename PV>
inline void each_row(const Args<float>& a, int64_t i0, int64_t i1, int64_t shift, int64_t j0, int64_t j1,
                     Work<float>& w, Scores scores, PV pv) {
  const int64_t group = a.heads / a.kv_heads;
  for (int64_t i = i0; i < i1; ++i) {
    int64_t s0, s1;
    row_span(a, i, shift, j0, j1, s0, s1);
    if (s0 >= s1) continue;
    const int64_t n_i = s1 - s0, r0 = (i - i0) * group;
    scores(r0, s0 - j0, n_i);
    if (a.softcap > 0)
      for (int64_t x = 0; x < group * n_i; ++x) w.s[x] = a.softcap * std::tanh(w.s[x]);
    for (int64_t g = 0; g < group; ++g) softmax_update(w, r0 + g, a.dv, w.s.data() + g * n_i, n_i, true);
    pv(r0, s0 - j0, n_i);
  }
}

// The few-row tile on one page's widened keys / values: per query row, the group's scores per key.
void page_rows(const Args<float>& a, int64_t i0, int64_t i1, int64_t shift, int64_t j0, int64_t j1, const float* kf,
               const float* vf, Work<float>& w) {
  const int64_t group = a.heads / a.kv_heads, d = a.d, dv = a.dv;
  each_row(a, i0, i1, shift, j0, j1, w, [&](int64_t r0, int64_t off, int64_t n_i) {
    const float* k0 = kf + off * d;
    if (!qk_rows_vec(true, w.q.data() + r0 * d, group, k0, d, n_i, d, w.s.data()))
      for (int64_t j = 0; j < n_i; ++j)
        for (int64_t g = 0; g < group; ++g) w.s[g * n_i + j] = dot(w.q.data() + (r0 + g) * d, k0 + j * d, d);
  }, [&](int64_t r0, int64_t off, int64_t n_i) {
    pv_rows_vec(true, w.acc.data() + r0 * dv, w.s.data(), vf + off * dv, dv, group, n_i, dv);
  });
}

#if defined(FLASHPAGE_HALF_AVX512)
// Decode tiles read the page's half-precision K / V rows in place (no widened copy): 16 halves widened in registers
// per load, float32 FMAs (the same products and float32 sums as the widened copy's loops, in another order).
// Measured, 1 thread, AMD EPYC: 20 decoding sequences of 40-170 keys, 16 heads / 8 KV heads of 128, bfloat16,
// the widened copy's time / this one's: 2.5x per layer (1.78 / 0.70 ms; float32's decode path: 1.6 ms).
constexpr int64_t kDirectChunk = 128;  // P.V output columns per pass (8 registers per query row)

inline bool direct_ok(const Args<float>& a) { return a.d % 16 == 0 && a.dv % kDirectChunk == 0; }

// s[g * sn + j] = q row g . K row j for G query rows (stride d) and n keys (rows at stride ks), J keys at a time
// (G * J = 16 sums reduced by one tree).
template <typename S, int G, int J>
void qk_direct(const float* q, const S* k, int64_t ks, int64_t n, int64_t d, float* s, int64_t sn) {
  static_assert(G * J == 16, "one 16-sum tree per block");
  int64_t j = 0;
  for (; j + J <= n; j += J) {
    __m512 acc[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c += 16) {
      __m512 qv[G];
#pragma GCC unroll 2
      for (int g = 0; g < G; ++g) qv[g] = _mm512_loadu_ps(q + g * d + c);
#pragma GCC unroll 16
      for (int t = 0; t < J; ++t) {
        const __m512 kv = load16(k + (j + t) * ks + c);
#pragma GCC unroll 2
        for (int g = 0; g < G; ++g) acc[g * J + t] = _mm512_fmadd_ps(qv[g], kv, acc[g * J + t]);
      }
    }
    alignas(64) float sums[16];
    _mm512_store_ps(sums, sum16x16(acc));
    for (int g = 0; g < G; ++g) std::copy_n(sums + g * J, J, s + g * sn + j);
  }
  for (; j < n; ++j)
    for (int g = 0; g < G; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t c = 0; c < d; c += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * d + c), load16(k + j * ks + c), acc);
      s[g * sn + j] = _mm512_reduce_add_ps(acc);
    }
}

// o rows g < G (stride dv) += p row g (stride pn) . V (n rows at stride vs), 128 output columns per pass.
template <typename S, int G>
void pv_direct(float* o, const float* p, int64_t pn, const S* v, int64_t vs, int64_t n, int64_t dv) {
  for (int64_t c0 = 0; c0 < dv; c0 += kDirectChunk) {
    __m512 acc[G * 8];
#pragma GCC unroll 16
    for (int i = 0; i < G * 8; ++i) acc[i] = _mm512_loadu_ps(o + (i / 8) * dv + c0 + (i % 8) * 16);
    for (int64_t j = 0; j < n; ++j) {
      __m512 vv[8];
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) vv[t] = load16(v + j * vs + c0 + t * 16);
#pragma GCC unroll 2
      for (int g = 0; g < G; ++g) {
        const __m512 pj = _mm512_set1_ps(p[g * pn + j]);
#pragma GCC unroll 8
        for (int t = 0; t < 8; ++t) acc[g * 8 + t] = _mm512_fmadd_ps(pj, vv[t], acc[g * 8 + t]);
      }
    }
#pragma GCC unroll 16
    for (int i = 0; i < G * 8; ++i) _mm512_storeu_ps(o + (i / 8) * dv + c0 + (i % 8) * 16, acc[i]);
  }
}

// page_rows on one page's K / V rows in place (k / v: the page's row j0, rows at stride ks / vs).
template <typename S>
void page_rows_direct(const Args<float>& a, int64_t i0, int64_t i1, int64_t shift, int64_t j0, int64_t j1, const S* k,
                      int64_t ks, const S* v, int64_t vs, Work<float>& w) {
  const int64_t group = a.heads / a.kv_heads, d = a.d, dv = a.dv;
  each_row(a, i0, i1, shift, j0, j1, w, [&](int64_t r0, int64_t off, int64_t n_i) {
    int64_t g = 0;
    for (; g + 2 <= group; g += 2)
      qk_direct<S, 2, 8>(w.q.data() + (r0 + g) * d, k + off * ks, ks, n_i, d, w.s.data() + g * n_i, n_i);
    if (g < group) qk_direct<S, 1, 16>(w.q.data() + (r0 + g) * d, k + off * ks, ks, n_i, d, w.s.data() + g * n_i, n_i);
  }, [&](int64_t r0, int64_t off, int64_t n_i) {
    int64_t g = 0;
    for (; g + 2 <= group; g += 2)
      pv_direct<S, 2>(w.acc.data() + (r0 + g) * dv, w.s.data() + g * n_i, n_i, v + off * vs, vs, n_i, dv);
    if (g < group) pv_direct<S, 1>(w.acc.data() + (r0 + g) * dv, w.s.data() + g * n_i, n_i, v + off * vs, vs, n_i, dv);
  });
}
#endif

#if defined(FLASHPAGE_HALF_AVX512) && defined(__AVX512BF16__)
// bfloat16 prefill tiles (kGemmRows or more (query, head) rows) on an AVX512_BF16 build: vdpbf16ps (32 bfloat16
// products, exact in float32, summed into 16 float32 lanes) for both GEMMs instead of the widened float32 copies'
// at::mm_out, the online softmax in float32 in between, as flash-attn does for half inputs:
// - keys in blocks of fast::kKeyBlock (gathered across pages); per block, K packed once per tile as (d / 2, keys, 2)
//   (a 32-bit transpose of the rows' bfloat16 pairs: fast::transpose_keys) so that one broadcast query pair times
//   one vector gives 16 keys' partial scores (no horizontal sums), and V packed as (keys / 2, dv, 2) (key pairs
//   interleaved) so that one broadcast pair of P times one vector adds 16 output columns;
// - the scores are float32 sums of the bfloat16 products of q as given and K, times the softmax factor in float32
//   (and log2 e: fast::softmax_rows' base 2) when they leave the registers (one multiply per 16 scores, against
//   d / 2 vdpbf16ps): q pre-scaled and rounded to bfloat16 would move every score by up to 2^-8 of sum |q_c k_c|
//   (0.04 on a logit of 10), a rounding flash-attn does not make either (it scales the float32 scores);
// - P (float32, the running sum l taken from it unrounded) is rounded to bfloat16 for the P.V products, as
//   flash-attn rounds P to the input dtype before its P.V GEMM; the accumulators stay float32, the output is rounded
//   once (finish).
// Head dims must be even (pairs), value dims a multiple of 16; other tiles take the widened copies (page_gemm), as
// do calls in the portable mode (mode 1, `generic`).
// Measured, 1 thread, AMD EPYC (Zen 4), 16 heads / 8 KV heads of 128, pages of 128, causal, CPU time of one call,
// the widened copies' / this path's (with query_tile's 128-row tiles): 2048 queries over 2048 keys 259 / 104 ms
// (66 / 165 GFLOP/s), 1024 over 3072 328 / 129 ms, 512 over 512 16.7 / 7.9 ms, 32 sequences of 58 queries after 512
// cached keys 128 / 54 ms. About 45% of the time is the Q.K loop, 37% P.V, the rest the softmax and the packing.
// Did not pay: prefetching the next key block's K / V rows into L2 while scoring this one (5% at 32-row tiles,
// nothing at 128-row ones).
namespace bf16_prefill {

using fast::kKeyBlock;
using fast::kRowBlock;
using fast::lanes;
using fast::span_lanes;

inline bool ok(const Args<float>& a) { return a.d % 2 == 0 && a.dv % 16 == 0; }

inline __m512i pair_bcast(const uint32_t* p) { return _mm512_set1_epi32(static_cast<int>(*p)); }

// Scores of R rows (bfloat16 pairs at q, row stride dp pairs) against keys [u0, u1) packed in kt (dp rows of ldk
// pairs, zero past the block's keys): s[r * lds + j] = factor * q_r . k_j, 32 keys x R rows of accumulators per
// pass over d; rmax[r] = the largest of row r's own keys [span[2r], span[2r + 1]) (-inf if none).
template <int R>
inline void qk_block(const uint32_t* q, int64_t dp, const uint32_t* kt, int64_t ldk, int64_t u0, int64_t u1,
                     float factor, float* s, int64_t lds, const int64_t* span, float* rmax) {
  __m512 vmax[R];
  const __m512 f = _mm512_set1_ps(factor);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) vmax[r] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = u0; j < u1; j += 32) {
    __m512 acc[2 * R];
#pragma GCC unroll 16
    for (int i = 0; i < 2 * R; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t x = 0; x < dp; ++x) {
      const __m512i k0 = _mm512_loadu_si512(kt + x * ldk + j), k1 = _mm512_loadu_si512(kt + x * ldk + j + 16);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512i qb = pair_bcast(q + r * dp + x);
        acc[2 * r] = _mm512_dpbf16_ps(acc[2 * r], (__m512bh)qb, (__m512bh)k0);
        acc[2 * r + 1] = _mm512_dpbf16_ps(acc[2 * r + 1], (__m512bh)qb, (__m512bh)k1);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 a0 = _mm512_mul_ps(acc[2 * r], f), a1 = _mm512_mul_ps(acc[2 * r + 1], f);
      _mm512_mask_storeu_ps(s + r * lds + j, lanes(u1 - j), a0);
      if (u1 - j > 16) _mm512_mask_storeu_ps(s + r * lds + j + 16, lanes(u1 - j - 16), a1);
      vmax[r] = _mm512_mask_max_ps(vmax[r], span_lanes(span[2 * r], span[2 * r + 1], j), vmax[r], a0);
      vmax[r] = _mm512_mask_max_ps(vmax[r], span_lanes(span[2 * r], span[2 * r + 1], j + 16), vmax[r], a1);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) rmax[r] = _mm512_reduce_max_ps(vmax[r]);
}

inline void qk_up_to8(const uint32_t* q, int64_t dp, const uint32_t* kt, int64_t ldk, int64_t u0, int64_t u1,
                      float factor, float* s, int64_t lds, const int64_t* span, float* rmax, int64_t nr) {
  switch (nr) {
    case 8: return qk_block<8>(q, dp, kt, ldk, u0, u1, factor, s, lds, span, rmax);
    case 7: return qk_block<7>(q, dp, kt, ldk, u0, u1, factor, s, lds, span, rmax);
    case 6: return qk_block<6>(q, dp, kt, ldk, u0, u1, factor, s, lds, span, rmax);
    case 5: return qk_block<5>(q, dp, kt, ldk, u0, u1, factor, s, lds, span, rmax);
    case 4: return qk_block<4>(q, dp, kt, ldk, u0, u1, factor, s, lds, span, rmax);
    case 3: return qk_block<3>(q, dp, kt, ldk, u0, u1, factor, s, lds, span, rmax);
    case 2: return qk_block<2>(q, dp, kt, ldk, u0, u1, factor, s, lds, span, rmax);
    default: return qk_block<1>(q, dp, kt, ldk, u0, u1, factor, s, lds, span, rmax);
  }
}

// o rows r < R (stride dv) += P row r . V over key pairs [p0, p1): P as bfloat16 pairs (row stride ldp pairs),
// V packed as (pairs, dv, 2) in vp (row stride dv); R rows x C vectors of 16 columns in registers per pass.
template <int R, int C>
inline void pv_block(float* o, int64_t dv, const uint32_t* p, int64_t ldp, const uint32_t* vp, int64_t p0,
                     int64_t p1) {
  for (int64_t c0 = 0; c0 < dv; c0 += 16 * C) {
    __m512 acc[R * C];
#pragma GCC unroll 16
    for (int i = 0; i < R * C; ++i) acc[i] = _mm512_loadu_ps(o + (i / C) * dv + c0 + (i % C) * 16);
    for (int64_t x = p0; x < p1; ++x) {
      __m512i vv[C];
#pragma GCC unroll 4
      for (int t = 0; t < C; ++t) vv[t] = _mm512_loadu_si512(vp + x * dv + c0 + t * 16);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512i pb = pair_bcast(p + r * ldp + x);
#pragma GCC unroll 4
        for (int t = 0; t < C; ++t) acc[r * C + t] = _mm512_dpbf16_ps(acc[r * C + t], (__m512bh)pb, (__m512bh)vv[t]);
      }
    }
#pragma GCC unroll 16
    for (int i = 0; i < R * C; ++i) _mm512_storeu_ps(o + (i / C) * dv + c0 + (i % C) * 16, acc[i]);
  }
}

template <int R>
inline void pv_rows(float* o, int64_t dv, const uint32_t* p, int64_t ldp, const uint32_t* vp, int64_t p0,
                    int64_t p1) {
  if (dv % 64 == 0) return pv_block<R, 4>(o, dv, p, ldp, vp, p0, p1);
  pv_block<R, 1>(o, dv, p, ldp, vp, p0, p1);
}

inline void pv_up_to4(float* o, int64_t dv, const uint32_t* p, int64_t ldp, const uint32_t* vp, int64_t p0,
                      int64_t p1, int64_t nr) {
  switch (nr) {
    case 4: return pv_rows<4>(o, dv, p, ldp, vp, p0, p1);
    case 3: return pv_rows<3>(o, dv, p, ldp, vp, p0, p1);
    case 2: return pv_rows<2>(o, dv, p, ldp, vp, p0, p1);
    default: return pv_rows<1>(o, dv, p, ldp, vp, p0, p1);
  }
}

// P rows r < nr (float32 at s, stride lds) over keys [u0, u1) rounded to bfloat16 pairs in p (stride ldp pairs),
// for the even-aligned keys [u0 & ~1, u1 rounded up): 0 outside [u0, u1) (the softmax left other blocks' values
// there).
inline void round_p(const float* s, int64_t lds, int64_t nr, int64_t u0, int64_t u1, uint32_t* p, int64_t ldp) {
  const int64_t e0 = u0 & ~int64_t(1);
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t j = e0; j < u1; j += 32) {
      const __m512 lo = _mm512_maskz_loadu_ps(span_lanes(u0, u1, j), s + r * lds + j);
      const __m512 hi = _mm512_maskz_loadu_ps(span_lanes(u0, u1, j + 16), s + r * lds + j + 16);
      _mm512_storeu_si512(p + r * ldp + j / 2, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

// V rows (n of them, row pointers) packed as key pairs: vp[x * dv + c] = (V[2x][c], V[2x + 1][c]) for x < ceil(n/2),
// a missing last row 0.
inline void pack_values(const c10::BFloat16* const* vrow, int64_t n, int64_t dv, uint32_t* vp) {
  for (int64_t x = 0; 2 * x < n; ++x) {
    const c10::BFloat16* a = vrow[2 * x];
    const c10::BFloat16* b = 2 * x + 1 < n ? vrow[2 * x + 1] : nullptr;
    for (int64_t c = 0; c < dv; c += 16) {
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + c)));
      const __m512i hi = b ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + c)))
                           : _mm512_setzero_si512();
      _mm512_storeu_si512(vp + x * dv + c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

// The tile: rows i0 .. i1-1 of sequence b, KV head hk (w set up by start: m, l, acc), every visible key block.
inline void tile(const HalfArgs<c10::BFloat16>& h, int64_t b, int64_t hk, int64_t i0, int64_t i1, Work<float>& w) {
  const Args<float>& a = h.f;
  const int64_t group = a.heads / a.kv_heads, rows = (i1 - i0) * group, d = a.d, dv = a.dv, dp = d / 2;
  const int64_t shift = a.seqlens_k[b] - (a.cu_q[b + 1] - a.cu_q[b]);
  constexpr int64_t ldp = (kKeyBlock + 32) / 2;  // P pairs per row (32 keys of slack: round_p's last vector)
  static thread_local std::vector<uint32_t> qp, kt, vp, pp;
  static thread_local std::vector<const c10::BFloat16*> kv_rows;  // the block's K row pointers, then V's
  qp.resize(rows * dp);
  kt.resize(dp * kKeyBlock + 32);
  vp.resize(kKeyBlock / 2 * dv);
  pp.resize(kRowBlock * ldp);
  kv_rows.resize(2 * kKeyBlock);
  w.s.resize(kRowBlock * kKeyBlock);
  w.span.resize(2 * kRowBlock);
  const c10::BFloat16** krow = kv_rows.data();
  const c10::BFloat16** vrow = kv_rows.data() + kKeyBlock;
  int64_t* span = w.span.data();
  for (int64_t r = 0; r < rows; ++r)  // the tile's queries as bfloat16 pairs, as given
    std::memcpy(qp.data() + r * dp,
                h.q + (a.cu_q[b] + i0 + r / group) * a.q_t + (hk * group + r % group) * a.q_h, d * sizeof(uint16_t));
  // scores in base 2 (fast::softmax_rows): log2 e folded into the factor, or into the softcap's
  for (int64_t r = 0; r < rows; ++r) w.m[r] *= fast::kLog2e;
  const float factor = a.softcap > 0 ? a.factor : a.factor * fast::kLog2e, softcap2 = a.softcap * fast::kLog2e;
  int64_t lo, hi;
  tile_keys(a, b, i0, i1, lo, hi);
  for (int64_t j0 = lo; j0 < hi;) {
    const int64_t j1 = std::min(hi, (j0 / kKeyBlock + 1) * kKeyBlock), n = j1 - j0, ldk = (n + 31) / 32 * 32;
    fast::block_rows(a, h.k, h.v, b, hk, j0, j1, krow, vrow);  // the block's K / V rows (across pages)
    fast::transpose_keys(reinterpret_cast<const float* const*>(krow), n, dp, reinterpret_cast<float*>(kt.data()),
                         ldk);
    pack_values(vrow, n, dv, vp.data());
    for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
      const int64_t nr = std::min(kRowBlock, rows - r0);
      int64_t u0 = n, u1 = 0;  // the union of the rows' visible keys in the block
      for (int64_t r = 0; r < nr; ++r) {
        int64_t s0, s1;
        row_span(a, i0 + (r0 + r) / group, shift, j0, j1, s0, s1);
        span[2 * r] = s0 - j0;
        span[2 * r + 1] = s1 - j0;
        if (s0 < s1) {
          u0 = std::min(u0, s0 - j0);
          u1 = std::max(u1, s1 - j0);
        } else {
          span[2 * r] = span[2 * r + 1] = 0;
        }
      }
      if (u0 >= u1) continue;
      float* s = w.s.data();
      float rmax[kRowBlock];
      qk_up_to8(qp.data() + r0 * dp, dp, kt.data(), ldk, u0, u1, factor, s, kKeyBlock, span, rmax, nr);
      if (a.softcap > 0)
        for (int64_t r = 0; r < nr; ++r) {
          float* srow = s + r * kKeyBlock;
          const int64_t s0 = span[2 * r], s1 = span[2 * r + 1];
          for (int64_t j = s0; j < s1; ++j) srow[j] = softcap2 * std::tanh(srow[j]);
          rmax[r] = fast::row_max(srow, s0, s1);
        }
      fast::softmax_up_to8(w, r0, dv, s, kKeyBlock, u0, u1, span, rmax, nr);
      round_p(s, kKeyBlock, nr, u0, u1, pp.data(), ldp);
      for (int64_t g0 = 0; g0 < nr; g0 += 4) {  // P.V over the union of 4 rows' keys
        const int64_t ng = std::min<int64_t>(4, nr - g0);
        int64_t v0, v1;
        fast::key_union(span, g0, ng, n, v0, v1);
        if (v0 < v1)
          pv_up_to4(w.acc.data() + (r0 + g0) * dv, dv, pp.data() + g0 * ldp, ldp, vp.data(), v0 / 2, (v1 + 1) / 2,
                    ng);
      }
    }
    j0 = j1;
  }
  for (int64_t r = 0; r < rows; ++r) w.m[r] *= fast::kLn2;  // back to natural units for the log-sum-exp
}

}  // namespace bf16_prefill
#endif

// Rows i0 .. i1-1 of sequence b, KV head hk: every visible page's K / V rows widened once, then the float32 tile
// (decode tiles on an AVX-512 build: the rows read in place, page_rows_direct).
template <typename S>
void attend_tile(const HalfArgs<S>& h, int64_t b, int64_t hk, int64_t i0, int64_t i1, Work<float>& w,
                 std::vector<float>& kv) {
  const Args<float>& a = h.f;
  const int64_t group = a.heads / a.kv_heads, rows = (i1 - i0) * group;
  const int64_t shift = a.seqlens_k[b] - (a.cu_q[b + 1] - a.cu_q[b]);
  const bool gemm = rows >= kGemmRows;
  start(h, b, hk, i0, i1, w);
#if defined(FLASHPAGE_HALF_AVX512) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<S, c10::BFloat16>) {
    if (gemm && !h.generic && bf16_prefill::ok(a)) {
      bf16_prefill::tile(h, b, hk, i0, i1, w);
      finish(h, b, hk, i0, i1, w);
      return;
    }
  }
#endif
  w.s.resize((gemm ? rows : group) * a.page);
  kv.resize(a.page * (a.d + a.dv));
  float* kf = kv.data();
  float* vf = kv.data() + a.page * a.d;
  int64_t lo, hi;
  tile_keys(a, b, i0, i1, lo, hi);
  const int64_t* table = a.table + b * a.table_b;
#if defined(FLASHPAGE_HALF_AVX512)
  const bool direct = !gemm && direct_ok(a);
#endif
  for (int64_t p = lo / a.page; p * a.page < hi; ++p) {
    const int64_t j0 = std::max(lo, p * a.page), j1 = std::min(hi, (p + 1) * a.page), n = j1 - j0;
#if defined(FLASHPAGE_HALF_AVX512)
    if (direct) {
      page_rows_direct(a, i0, i1, shift, j0, j1, h.k + table[p] * a.k_b + hk * a.k_h + (j0 - p * a.page) * a.k_p,
                       a.k_p, h.v + table[p] * a.v_b + hk * a.v_h + (j0 - p * a.page) * a.v_p, a.v_p, w);
      continue;
    }
#endif
    widen_rows(h.k, a.k_b, a.k_p, a.k_h, table[p], hk, j0 - p * a.page, n, a.d, kf);
    widen_rows(h.v, a.v_b, a.v_p, a.v_h, table[p], hk, j0 - p * a.page, n, a.dv, vf);
    if (gemm)
      page_gemm(a, i0, i1, shift, j0, j1, kf, vf, w);
    else
      page_rows(a, i0, i1, shift, j0, j1, kf, vf, w);
  }
  finish(h, b, hk, i0, i1, w);
}

// Query rows per task: kQueryTile, or for bf16_prefill's tiles up to 128 while that leaves 4 tasks per thread: each
// tile packs every visible key block once, and reads it from L3 (its keys / values for one KV head: 1 MiB per 2k
// keys). Measured, 1 thread, 16 heads / 8 KV heads of 128, bfloat16, CPU time of 2048 queries over 2048 keys: 32 rows
// 115-126 ms, 64 113-117, 128 109-111, 256 108-113; 1024 over 3072 keys: 32 rows 156-159, 64 139, 128 134-138.
// The bits do not depend on the tile (key blocks are fixed multiples of 128 keys, each row's sums its own).
template <typename S>
int64_t query_tile(const HalfArgs<S>& h, int64_t batch) {
  int64_t tile = kQueryTile;
#if defined(FLASHPAGE_HALF_AVX512) && defined(__AVX512BF16__)
  if (std::is_same_v<S, c10::BFloat16> && !h.generic && bf16_prefill::ok(h.f)) {
    const int64_t want = 4 * at::get_num_threads();
    for (tile = 128; tile > kQueryTile; tile /= 2) {
      int64_t tasks = 0;
      for (int64_t b = 0; b < batch; ++b) tasks += (h.f.cu_q[b + 1] - h.f.cu_q[b] + tile - 1) / tile * h.f.kv_heads;
      if (tasks >= want) break;
    }
  }
#endif
  return tile;
}

// Every tile of the call: one task per (query tile, KV head), at::parallel_for over them.
template <typename S>
void run(const HalfArgs<S>& h, int64_t batch) {
  const std::vector<Task> tasks = plan_tasks(h.f, batch, false, query_tile(h, batch));
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    Work<float> w;
    std::vector<float> kv;
    for (int64_t t = begin; t < end; ++t) attend_tile(h, tasks[t].b, tasks[t].h0, tasks[t].i0, tasks[t].i1, w, kv);
  });
}

}  // namespace half_attention
