// bfloat16 / float16 paged attention (included by cpu_attention.cpp after its generic float32 tile helpers and
// Task / plan_tasks): the generic tile's float32 arithmetic (attend_tile: per-key scores for decode tiles, one GEMM
// per page for tiles of kGemmRows or more (query, head) rows, the online softmax in float32) on widened copies: the
// tile's queries (times the softmax factor) once, and per page the K / V rows of the tile's KV head that some row
// sees, widened into per-thread float32 scratch (each key / value row is read from memory once per tile, as the
// float32 loops read them); decode tiles on an AVX-512 build (head dim % 16, value dim % 128) read the K / V rows in
// place instead, widening 16 halves per load in registers (page_rows_direct). The output is rounded to the query's
// dtype once; the log-sum-exp stays float32 (as flash-attn returns it for half inputs).
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

// Every tile of the call: one task per (query tile, KV head), at::parallel_for over them.
template <typename S>
void run(const HalfArgs<S>& h, int64_t batch) {
  const std::vector<Task> tasks = plan_tasks(h.f, batch, false);
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    Work<float> w;
    std::vector<float> kv;
    for (int64_t t = begin; t < end; ++t) attend_tile(h, tasks[t].b, tasks[t].h0, tasks[t].i0, tasks[t].i1, w, kv);
  });
}

}  // namespace half_attention
