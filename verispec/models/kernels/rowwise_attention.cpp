// Batch-invariant attention of decode and verify rows, one call per sequence and layer (verispec's
// rowwise attention, verispec/models/attention.py, without its Python loop over positions).
//
// Why: the Python version runs ~10 torch operations per query position and layer (two small
// matrix products, the scaling, the softmax, conversions, the copy out), ~50 us each position on
// a 2-core machine: ~11 ms of a 1.5B verify step over 8 tokens, more than the products' work.
// Here each (position, key/value head) is one task whose loops depend only on that position: its
// keys are the cached prefix then, in a token tree, its ancestors in node order (a chain is the tree
// where every earlier node is an ancestor), cut to the last `window` keys on sliding layers. So a token's
// output is the same bits whether it is decoded alone, verified beside drafts, in a tree or in a
// batch, which is what lossless greedy speculation needs; which thread runs a task never changes
// its arithmetic.
//
// A task is one position and key/value head, with the query heads that share it: scores s_j =
// (q . k_j) * scale (AVX2: 8 lanes of multiply-adds over D, then a fixed pairwise sum), the
// softmax numerators e_j = exp(s_j - max) and their sum in key order, out = (sum_j e_j v_j) / sum
// in key order. The build uses -ffp-contract=off, as the int4 kernel's does.
//
// With AVX-512 the same task runs in 16-lane vectors throughout (attend512): the scores of 16 keys
// at a time, their lane sums reduced together by one fixed butterfly; exp by a polynomial in
// vectors; the softmax sum and the value sums in 16 lanes. The scalar exp and the per-key horizontal
// sums were most of the 8-lane loop's time: it ran at ~50 GFLOP/s on a Zen 5 core pair, so the
// 1.5B's 28 layers took 5 ms per decoded token at a 1500-token context and 32 ms for a 6-token
// verify step, as much as the forward's Linears. With AVX2 alone the same task runs in 8-lane
// vectors (attend256: 8 keys a block, their sums by one fixed hadd tree, the same exp polynomial);
// on a Zen 3 core pair that took a 1.5B verify step over 5 tokens at a 900-token context from ~22 to
// ~8-13 ms of attention. Every number still comes from operations fixed by D, the position's own keys
// and their count, so the invariance above holds; the AVX-512 and AVX2 builds round differently, as
// builds for different CPUs may. Two later changes left every bit as it was: the AVX-512 scores take
// a few keys at a time for all heads of the task (dot_block), and the tasks run head by head, so a
// thread's keys and values stay in its cache across positions; a 137-token prompt onto an 800-token
// cache of the 1.5B (28 layers) went from ~83 to ~67 ms of attention on a Zen 5 core pair.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
// exp(x) for x <= 0 in 16 lanes: x = n ln2 + r with |r| <= ln2 / 2, e^r by Cephes' degree-6
// polynomial (within ~2 ulp of expf), times 2^n. Below -87.3 the result is 0 (e^x underflows).
inline __m512 exp512(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_maskz_scalef_ps(static_cast<__mmask16>(~tiny), p, n);
}

// Lane i of the result: the sum of acc[i]'s 16 lanes, by the same butterfly for every i (halves,
// then quarters, then pairs of lanes), so a score's bits do not depend on its neighbours. Lane
// 4b + t of the last step holds input 4t + b, hence the order the inputs are taken in.
inline __m512 sum16(const __m512* acc) {
  __m512 a[16], b[8], c[4], d[2];
  for (int i = 0; i < 16; ++i) a[i] = acc[4 * (i % 4) + i / 4];
  for (int k = 0; k < 8; ++k)
    b[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0xEE));
  for (int k = 0; k < 4; ++k)
    c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], 0xDD));
  for (int k = 0; k < 2; ++k)
    d[k] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * k], c[2 * k + 1], 0x44),
                         _mm512_shuffle_ps(c[2 * k], c[2 * k + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
}

// The value sums of G query heads, CP 16-float chunks of D at a time, key by key in key order (the
// G x CP accumulators stay in registers), each head's divided by its softmax sum at the end. Head g's
// softmax numerators are e[g * stride + j].
template <int G, int CP>
void weigh_values(const float* values, const std::vector<int64_t>& idx, int64_t D, const float* e,
                  int64_t stride, const float* inv, float* out) {
  const int64_t m = static_cast<int64_t>(idx.size());
  for (int64_t c = 0; c < D; c += 16 * CP) {
    __m512 acc[G][CP];
    for (int g = 0; g < G; ++g)
      for (int h = 0; h < CP; ++h) acc[g][h] = _mm512_setzero_ps();
    for (int64_t j = 0; j < m; ++j) {
      const float* v = values + idx[j] * D + c;
      __m512 vc[CP];
      for (int h = 0; h < CP; ++h) vc[h] = _mm512_loadu_ps(v + 16 * h);
      for (int g = 0; g < G; ++g) {
        const __m512 w = _mm512_set1_ps(e[g * stride + j]);
        for (int h = 0; h < CP; ++h) acc[g][h] = _mm512_fmadd_ps(w, vc[h], acc[g][h]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int h = 0; h < CP; ++h)
        _mm512_storeu_ps(out + g * D + c + 16 * h, _mm512_mul_ps(acc[g][h], _mm512_set1_ps(inv[g])));
  }
}

template <int G>
void weigh_values_of(const float* values, const std::vector<int64_t>& idx, int64_t D, const float* e,
                     int64_t stride, const float* inv, float* out) {
  // As many value chunks at once as the G x CP accumulators, CP chunks and a weight leave registers
  // for: a chunk loaded serves G heads, a weight CP chunks (loads, not products, bound this loop).
  if (G <= 6 && D % 64 == 0)
    weigh_values<G, 4>(values, idx, D, e, stride, inv, out);
  else if (D % 32 == 0)
    weigh_values<G, 2>(values, idx, D, e, stride, inv, out);
  else
    weigh_values<G, 1>(values, idx, D, e, stride, inv, out);
}

// The 16 lane vectors of q_g . k_i (i < 16) for G query heads: acc[g][i] = sum over the 16-float
// chunks c of D, in order, of q_g[c] * k_i[c], as one head and key at a time would sum them. KB
// keys at a time, every head's accumulators in registers: a key chunk loaded serves G heads and a
// query chunk KB keys (one head at a time loaded a key chunk per product, and the loads bound it).
template <int G>
void dot_block(const float* q, const float* const* k, int64_t D, __m512 (*acc)[16]) {
  constexpr int KB = G <= 2 ? 8 : (G <= 6 ? 4 : 2);
  for (int i0 = 0; i0 < 16; i0 += KB) {
    __m512 a[G][KB];
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < KB; ++i) a[g][i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < D; c += 16) {
      __m512 kc[KB];
      for (int i = 0; i < KB; ++i) kc[i] = _mm512_loadu_ps(k[i0 + i] + c);
      for (int g = 0; g < G; ++g) {
        const __m512 qc = _mm512_loadu_ps(q + g * D + c);
        for (int i = 0; i < KB; ++i) a[g][i] = _mm512_fmadd_ps(qc, kc[i], a[g][i]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < KB; ++i) acc[g][i0 + i] = a[g][i];
  }
}

// attend() in 16-lane vectors, for D a multiple of 16 (at most 1024) and at most 8 query heads per
// key/value head.
void attend512(const float* q, const float* keys, const float* values, const std::vector<int64_t>& idx,
               int64_t groups, int64_t D, float scale, std::vector<float>& scores, float* out) {
  static const float zeros[1024] = {};  // the missing keys of a last block of fewer than 16
  const int64_t m = static_cast<int64_t>(idx.size());
  const int64_t padded = (m + 15) / 16 * 16;
  scores.resize(groups * padded);
  const __m512 vscale = _mm512_set1_ps(scale);
  alignas(64) __m512 acc[8][16];
  for (int64_t j0 = 0; j0 < m; j0 += 16) {
    const float* k[16];
    for (int64_t i = 0; i < 16; ++i) k[i] = j0 + i < m ? keys + idx[j0 + i] * D : zeros;
    switch (groups) {
      case 1: dot_block<1>(q, k, D, acc); break;
      case 2: dot_block<2>(q, k, D, acc); break;
      case 3: dot_block<3>(q, k, D, acc); break;
      case 4: dot_block<4>(q, k, D, acc); break;
      case 5: dot_block<5>(q, k, D, acc); break;
      case 6: dot_block<6>(q, k, D, acc); break;
      case 7: dot_block<7>(q, k, D, acc); break;
      default: dot_block<8>(q, k, D, acc); break;
    }
    for (int64_t g = 0; g < groups; ++g)
      _mm512_storeu_ps(scores.data() + g * padded + j0, _mm512_mul_ps(sum16(acc[g]), vscale));
  }
  // Softmax numerators in place and their sums: 16 lanes over the keys in order, then a fixed sum
  // of the lanes; a last block of fewer than 16 keys is masked (0 in the sums).
  float inv[8];
  const __mmask16 tail = static_cast<__mmask16>(m % 16 == 0 ? 0xFFFF : (1u << (m % 16)) - 1);
  for (int64_t g = 0; g < groups; ++g) {
    float* e = scores.data() + g * padded;
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t j0 = 0; j0 < m; j0 += 16) {
      const __mmask16 live = j0 + 16 <= m ? static_cast<__mmask16>(0xFFFF) : tail;
      top = _mm512_mask_max_ps(top, live, top, _mm512_loadu_ps(e + j0));
    }
    const __m512 vtop = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 total = _mm512_setzero_ps();
    for (int64_t j0 = 0; j0 < m; j0 += 16) {
      const __mmask16 live = j0 + 16 <= m ? static_cast<__mmask16>(0xFFFF) : tail;
      const __m512 x = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(_mm512_loadu_ps(e + j0), vtop)));
      _mm512_storeu_ps(e + j0, x);
      total = _mm512_add_ps(total, x);
    }
    const __m256 upper = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(total), 1));
    const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(total), upper);
    const __m128 quarter = _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
    const __m128 pair = _mm_add_ps(quarter, _mm_movehl_ps(quarter, quarter));
    inv[g] = 1.f / _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
  }
  switch (groups) {
    case 1: weigh_values_of<1>(values, idx, D, scores.data(), padded, inv, out); break;
    case 2: weigh_values_of<2>(values, idx, D, scores.data(), padded, inv, out); break;
    case 3: weigh_values_of<3>(values, idx, D, scores.data(), padded, inv, out); break;
    case 4: weigh_values_of<4>(values, idx, D, scores.data(), padded, inv, out); break;
    case 5: weigh_values_of<5>(values, idx, D, scores.data(), padded, inv, out); break;
    case 6: weigh_values_of<6>(values, idx, D, scores.data(), padded, inv, out); break;
    case 7: weigh_values_of<7>(values, idx, D, scores.data(), padded, inv, out); break;
    default: weigh_values_of<8>(values, idx, D, scores.data(), padded, inv, out); break;
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// exp(x) for x <= 0 in 8 lanes: exp512's reduction and polynomial; 2^n built in the exponent bits
// (n >= -126 above the cut-off, so a normal float). Below -87.3 the result is 0.
inline __m256 exp256(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  const __m256 tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// Lane i of the result: the sum of acc[i]'s 8 lanes, ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)) for
// every i, so a score's bits do not depend on its neighbours.
inline __m256 sum8(const __m256* acc) {
  const __m256 t0 = _mm256_hadd_ps(acc[0], acc[1]), t1 = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 t2 = _mm256_hadd_ps(acc[4], acc[5]), t3 = _mm256_hadd_ps(acc[6], acc[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// weigh_values in 8-lane chunks: CP chunks of D at a time, G x CP accumulators in registers.
template <int G, int CP>
void weigh_values256(const float* values, const std::vector<int64_t>& idx, int64_t D, const float* e,
                     int64_t stride, const float* inv, float* out) {
  const int64_t m = static_cast<int64_t>(idx.size());
  for (int64_t c = 0; c < D; c += 8 * CP) {
    __m256 acc[G][CP];
    for (int g = 0; g < G; ++g)
      for (int h = 0; h < CP; ++h) acc[g][h] = _mm256_setzero_ps();
    for (int64_t j = 0; j < m; ++j) {
      const float* v = values + idx[j] * D + c;
      __m256 vc[CP];
      for (int h = 0; h < CP; ++h) vc[h] = _mm256_loadu_ps(v + 8 * h);
      for (int g = 0; g < G; ++g) {
        const __m256 w = _mm256_broadcast_ss(e + g * stride + j);
        for (int h = 0; h < CP; ++h) acc[g][h] = _mm256_fmadd_ps(w, vc[h], acc[g][h]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int h = 0; h < CP; ++h)
        _mm256_storeu_ps(out + g * D + c + 8 * h, _mm256_mul_ps(acc[g][h], _mm256_set1_ps(inv[g])));
  }
}

template <int G>
void weigh_values256_of(const float* values, const std::vector<int64_t>& idx, int64_t D, const float* e,
                        int64_t stride, const float* inv, float* out) {
  if (G <= 6 && D % 16 == 0)  // 2G accumulators, two value chunks and a weight: 15 of 16 registers
    weigh_values256<G, 2>(values, idx, D, e, stride, inv, out);
  else
    weigh_values256<G, 1>(values, idx, D, e, stride, inv, out);
}

// attend512 in 8-lane vectors, for D a multiple of 8 (at most 1024) and at most 8 query heads per
// key/value head: the scores of 8 keys at a time (their lane sums by sum8), exp by exp256, the
// softmax sum and the value sums in 8 lanes. The scalar exp and a horizontal sum per key and head
// made the loop below ~575 cycles a key on a Zen 3 core (1.5B, 6 heads a key/value head, D 128).
void attend256(const float* q, const float* keys, const float* values, const std::vector<int64_t>& idx,
               int64_t groups, int64_t D, float scale, std::vector<float>& scores, float* out) {
  static const float zeros[1024] = {};  // the missing keys of a last block of fewer than 8
  const int64_t m = static_cast<int64_t>(idx.size());
  const int64_t padded = (m + 7) / 8 * 8;
  scores.resize(groups * padded);
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t j0 = 0; j0 < m; j0 += 8) {
    const float* k[8];
    for (int64_t i = 0; i < 8; ++i) k[i] = j0 + i < m ? keys + idx[j0 + i] * D : zeros;
    for (int64_t g = 0; g < groups; ++g) {
      __m256 acc[8];
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
      for (int64_t c = 0; c < D; c += 8) {
        const __m256 qc = _mm256_loadu_ps(q + g * D + c);
        for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k[i] + c), acc[i]);
      }
      _mm256_storeu_ps(scores.data() + g * padded + j0, _mm256_mul_ps(sum8(acc), vscale));
    }
  }
  // Softmax numerators in place and their sums: 8 lanes over the keys in order, then a fixed sum
  // of the lanes; the lanes of a last block of fewer than 8 keys are left out (0 in the sums).
  float inv[8];
  const int64_t whole = m / 8 * 8;
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 tail = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(m - whole)), lane));
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  for (int64_t g = 0; g < groups; ++g) {
    float* e = scores.data() + g * padded;
    __m256 top = ninf;
    for (int64_t j0 = 0; j0 < whole; j0 += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(e + j0));
    if (whole < m) top = _mm256_max_ps(top, _mm256_blendv_ps(ninf, _mm256_loadu_ps(e + whole), tail));
    __m128 t4 = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    t4 = _mm_max_ps(t4, _mm_movehl_ps(t4, t4));
    t4 = _mm_max_ss(t4, _mm_shuffle_ps(t4, t4, 1));
    const __m256 vtop = _mm256_set1_ps(_mm_cvtss_f32(t4));
    __m256 total = _mm256_setzero_ps();
    for (int64_t j0 = 0; j0 < padded; j0 += 8) {
      __m256 x = exp256(_mm256_sub_ps(_mm256_loadu_ps(e + j0), vtop));
      if (j0 == whole) x = _mm256_and_ps(x, tail);
      _mm256_storeu_ps(e + j0, x);
      total = _mm256_add_ps(total, x);
    }
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(total), _mm256_extractf128_ps(total, 1));
    const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
    inv[g] = 1.f / _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
  }
  switch (groups) {
    case 1: weigh_values256_of<1>(values, idx, D, scores.data(), padded, inv, out); break;
    case 2: weigh_values256_of<2>(values, idx, D, scores.data(), padded, inv, out); break;
    case 3: weigh_values256_of<3>(values, idx, D, scores.data(), padded, inv, out); break;
    case 4: weigh_values256_of<4>(values, idx, D, scores.data(), padded, inv, out); break;
    case 5: weigh_values256_of<5>(values, idx, D, scores.data(), padded, inv, out); break;
    case 6: weigh_values256_of<6>(values, idx, D, scores.data(), padded, inv, out); break;
    case 7: weigh_values256_of<7>(values, idx, D, scores.data(), padded, inv, out); break;
    default: weigh_values256_of<8>(values, idx, D, scores.data(), padded, inv, out); break;
  }
}
#endif

// Scores of the `groups` query heads q[g * D ...] that share one key/value head against the keys
// at idx, then their softmax-weighted sums of the values into out[g * D ...] (heads of one
// position are D apart in both). The order of every sum is fixed by D and idx alone.
void attend(const float* q, const float* keys, const float* values, const std::vector<int64_t>& idx,
            int64_t groups, int64_t D, float scale, std::vector<float>& scores, float* out) {
#if defined(__AVX512F__)
  if (D % 16 == 0 && D <= 1024 && groups <= 8 && !idx.empty())
    return attend512(q, keys, values, idx, groups, D, scale, scores, out);
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  if (D % 8 == 0 && D <= 1024 && groups <= 8 && !idx.empty())
    return attend256(q, keys, values, idx, groups, D, scale, scores, out);
#endif
  const int64_t m = static_cast<int64_t>(idx.size());
  scores.assign(groups * m, 0.f);
#if defined(__AVX2__) && defined(__FMA__)
  const bool vector = D % 8 == 0 && groups <= 8;
#else
  const bool vector = false;
#endif
  if (vector) {
#if defined(__AVX2__) && defined(__FMA__)
    for (int64_t j = 0; j < m; ++j) {
      const float* k = keys + idx[j] * D;
      __m256 acc[8];
      for (int64_t g = 0; g < groups; ++g) acc[g] = _mm256_setzero_ps();
      for (int64_t c = 0; c < D; c += 8) {
        const __m256 kc = _mm256_loadu_ps(k + c);
        for (int64_t g = 0; g < groups; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + c), kc, acc[g]);
      }
      for (int64_t g = 0; g < groups; ++g) {
        const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[g]), _mm256_extractf128_ps(acc[g], 1));
        const __m128 p = _mm_add_ps(h, _mm_movehl_ps(h, h));
        scores[g * m + j] = _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps(p, p, 1))) * scale;
      }
    }
#endif
  } else {
    for (int64_t j = 0; j < m; ++j)
      for (int64_t g = 0; g < groups; ++g) {
        const float* k = keys + idx[j] * D;
        float acc = 0.f;
        for (int64_t d = 0; d < D; ++d) acc += q[g * D + d] * k[d];
        scores[g * m + j] = acc * scale;
      }
  }
  std::vector<float> inv(groups);
  for (int64_t g = 0; g < groups; ++g) {  // softmax numerators in place, in key order
    float* e = scores.data() + g * m;
    float top = -INFINITY;
    for (int64_t j = 0; j < m; ++j) top = std::max(top, e[j]);
    float total = 0.f;
    for (int64_t j = 0; j < m; ++j) {
      e[j] = std::exp(e[j] - top);
      total += e[j];
    }
    inv[g] = 1.f / total;
  }
  if (vector) {
#if defined(__AVX2__) && defined(__FMA__)
    for (int64_t c = 0; c < D; c += 8) {
      __m256 acc[8];
      for (int64_t g = 0; g < groups; ++g) acc[g] = _mm256_setzero_ps();
      for (int64_t j = 0; j < m; ++j) {
        const __m256 vc = _mm256_loadu_ps(values + idx[j] * D + c);
        for (int64_t g = 0; g < groups; ++g) acc[g] = _mm256_fmadd_ps(_mm256_set1_ps(scores[g * m + j]), vc, acc[g]);
      }
      for (int64_t g = 0; g < groups; ++g) _mm256_storeu_ps(out + g * D + c, _mm256_mul_ps(acc[g], _mm256_set1_ps(inv[g])));
    }
#endif
  } else {
    for (int64_t g = 0; g < groups; ++g) {
      float* o = out + g * D;
      for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
      for (int64_t j = 0; j < m; ++j) {
        const float w = scores[g * m + j];
        const float* v = values + idx[j] * D;
        for (int64_t d = 0; d < D; ++d) o[d] += w * v[d];
      }
      for (int64_t d = 0; d < D; ++d) o[d] *= inv[g];
    }
  }
}

// query [H, n, D], keys / values [Hkv, capacity, D] (the sequence's buffers, new tokens already
// written at start..start+n-1), tree: [n, n] bool (row s: the nodes s attends to) or undefined
// for a causal chain. Returns [n, H, D].
at::Tensor rowwise_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                             int64_t start, int64_t window, const std::optional<at::Tensor>& tree,
                             double scale) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat &&
                  values.scalar_type() == at::kFloat,
              "rowwise_attention: float32 only");
  TORCH_CHECK(query.dim() == 3 && keys.dim() == 3 && values.sizes() == keys.sizes(), "rowwise_attention: bad shapes");
  // [n, H, D] queries (one copy), so a position's heads sharing a key/value head are contiguous
  const at::Tensor qs = query.transpose(0, 1).contiguous();
  const at::Tensor k = keys.contiguous(), v = values.contiguous();  // the buffers: no copy
  const int64_t n = qs.size(0), H = qs.size(1), D = qs.size(2);
  const int64_t Hkv = k.size(0), capacity = k.size(1);
  TORCH_CHECK(k.size(2) == D && Hkv > 0 && H % Hkv == 0, "rowwise_attention: heads do not match");
  TORCH_CHECK(start >= 0 && start + n <= capacity, "rowwise_attention: positions past the buffer");
  const int64_t groups = H / Hkv;
  // Each query's key positions in the buffer, in order: the prefix, then its path in the tree.
  std::vector<std::vector<int64_t>> seen(n);
  at::Tensor mask;
  if (tree.has_value() && tree->defined()) {
    mask = tree->to(at::kBool).contiguous();
    TORCH_CHECK(mask.dim() == 2 && mask.size(0) == n && mask.size(1) >= n, "rowwise_attention: tree mask must be [n, n]");
  }
  for (int64_t s = 0; s < n; ++s) {
    std::vector<int64_t> path;
    if (mask.defined()) {
      const bool* row = mask.data_ptr<bool>() + s * mask.size(1);
      for (int64_t j = 0; j < n; ++j)
        if (row[j]) path.push_back(start + j);
    } else {
      for (int64_t j = 0; j <= s; ++j) path.push_back(start + j);
    }
    const int64_t total = start + static_cast<int64_t>(path.size());
    const int64_t lo = window > 0 ? std::max<int64_t>(0, total - window) : 0;
    std::vector<int64_t>& keys_of = seen[s];
    keys_of.reserve(total - lo);
    for (int64_t j = lo; j < start; ++j) keys_of.push_back(j);
    const int64_t skip = std::max<int64_t>(0, lo - start);
    for (size_t j = static_cast<size_t>(skip); j < path.size(); ++j) keys_of.push_back(path[j]);
  }
  at::Tensor out = at::empty({n, H, D}, qs.options());
  const float* qp = qs.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  // Tasks by key/value head, then position: a thread takes one head's positions one after another,
  // so that head's keys and values stay in its cache from one position to the next (position-major,
  // the heads took turns and each task read its keys and values from L3 or memory).
  at::parallel_for(0, n * Hkv, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t kvh = t / n, s = t % n;
      const int64_t head = (s * H + kvh * groups) * D;
      attend(qp + head, kp + kvh * capacity * D, vp + kvh * capacity * D, seen[s], groups, D, sc, scores, op + head);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(verispec_attention, m) {
  m.def("rowwise_attention(Tensor query, Tensor keys, Tensor values, int start, int window, Tensor? tree, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(verispec_attention, CPU, m) { m.impl("rowwise_attention", rowwise_attention); }
