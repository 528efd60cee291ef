// 4-bit weight x 8-bit activation Linear for x86 CPUs (verispec's int4 fast path), built for AVX-512
// VNNI where the CPU has it and for AVX2 + FMA + F16C otherwise (int4.py picks the flags; the
// sections below split on VERISPEC_AVX512). What follows describes the AVX-512 build; the AVX2 one
// keeps the weight format, the per-row activation quantization and the batch invariance, does the
// products with maddubs/madd as llama.cpp's AVX2 path does, and sends prompt rows through the
// decode kernel (on a Zen 3 EPYC: the 1.5B at 56 ms per token against 110 ms on int8, 160 ms at 8
// rows).
//
// Why a kernel of our own: decoding is bound by the bytes of weights read per token, and the
// int4 kernels shipped in torch 2.13 for CPU dequantize to bfloat16 and are compute-bound here
// (42 ms for the 1.5B's Linears at 1 row, 148 ms at 8 rows, against 46 / 74 ms for the int8
// fbgemm path), so they read fewer bytes but gain nothing. This kernel keeps the products in
// integers (VNNI's u8 x s8 dot products into int32, as llama.cpp's q4 x q8 dot products do) and
// streams each weight block from memory once per call, reusing it from L1 for up to 8 activation
// rows. The per-row integer work, not the memory, is what grows with the rows: the whole 1.5B
// forward costs ~44 / 64 / 104 / 190 ms at 1 / 4 / 8 / 16 rows (docs/design.md has the layouts tried).
// Prompts (tens to hundreds of rows) take a second entry point, int4_linear_many, that unpacks the
// weights once per call and runs them fbgemm-style: ~1.3-1.5x the decode kernel's rows per second.
// On Intel CPUs with AMX-INT8 a third entry point, int4_linear_amx, takes every row instead (its own
// weight layout, tile products; see its section): there 8 rows cost ~1.2x one row, not ~1.5x.
//
// Exact batch invariance: each output element (row m, channel n) is computed by one thread with
// the same sequence of operations whatever the number of rows in the call and wherever row m sits,
// so a token scores the same decoded alone, verified beside drafts or batched with other
// sequences (int4_linear_many keeps rows independent too, in its own order; see there). The build uses -ffp-contract=off so the compiler cannot fuse some multiply-adds in
// one code path and not in another.
//
// Weight format: output channels in blocks of 4 (N padded with zero channels); for each block and
// group g of kGroup inputs, kGroup / 32 vectors t of 64 bytes whose 16-byte lane j holds channel
// j's inputs 32t..32t+15 in its low nibbles and 32t+16..32t+31 in its high ones, q in 0..15; a
// float16 scale s and offset o per channel and group (w = s * q + o), stored [block, group, 4]. A thread
// reads one block as one contiguous stream. Activations are quantized per row:
// a = round(x * 127 / max|x|). Then
// y[m, n] = (max|x_m| / 127) * (sum_g s * sum_b q*a + sum_g o * sum_b a) + bias[n].

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define VERISPEC_AVX512 1
#else
#define VERISPEC_AVX512 0
#endif

#if VERISPEC_AVX512 && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define VERISPEC_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define VERISPEC_AMX 0
#endif

namespace {

#if VERISPEC_AMX
// f(std::integral_constant<int64_t, n>{}) for a run-time n in 1..MAX: the AMX kernels are templates
// over their row counts (unrolled loops, accumulators in registers).
template <int64_t MAX, typename F>
void with_count(int64_t n, F&& f) {
  if constexpr (MAX > 1) {
    if (n < MAX) return with_count<MAX - 1>(n, f);
  }
  f(std::integral_constant<int64_t, MAX>{});
}
#endif

constexpr int64_t kGroup = 64;
// Activation rows per pass over a weight block: what the accumulators leave of the vector
// registers (32 with AVX-512; with AVX2's 16, past 4 rows the block runs a half at a time).
constexpr int64_t kRowBlock = 8;
constexpr int64_t kPrefetch = 2048;  // bytes ahead in a thread's weight stream
constexpr int64_t kColBlock = 4;  // output channels per weight block: one per 128-bit lane
constexpr int64_t kGroupBytes = kColBlock * kGroup / 2;  // one block's group: 4 channels x kGroup nibbles
constexpr int64_t kVectors = kGroup / 32;  // 64-byte weight vectors per block and group
static_assert(kGroup == 64, "quantize_row sums a group as one 64-byte vector");

// Values k..K-1 one by one (what the vector loops leave), as those round them, then zeros up to Kp.
void quantize_tail(const float* row, int64_t k, int64_t K, int64_t Kp, float inv, int8_t* out) {
  for (; k < K; ++k) {
    float v = std::nearbyint(row[k] * inv);
    v = std::fmin(127.f, std::fmax(-127.f, v));
    out[k] = static_cast<int8_t>(v);
  }
  for (k = K; k < Kp; ++k) out[k] = 0;
}

// Per-row symmetric int8 quantization of x [M, K] into q [M, Kp] (zero padded), with each row's
// scale and each group's sum of quantized activations (the offset term's factor, as a float: exact
// for these small integers, and the kernel then needs no conversion per group and row). Vectorized
// and split over rows (a prompt's rows are many): each value is rounded by itself (x * inv rounded
// to nearest-even, clamped), so the bits are those of the scalar loop in any split.
#if VERISPEC_AVX512
void quantize_row(const float* row, int64_t K, int64_t Kp, int8_t* out, float* scale, float* gsum) {
  const int64_t groups = Kp / kGroup;
  __m512 vmax = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(row + k)));
  float amax = _mm512_reduce_max_ps(vmax);
  for (; k < K; ++k) amax = std::fmax(amax, std::fabs(row[k]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  *scale = amax / 127.f;
  const __m512 vinv = _mm512_set1_ps(inv), hi = _mm512_set1_ps(127.f), lo = _mm512_set1_ps(-127.f);
  for (k = 0; k + 16 <= K; k += 16) {
    __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(row + k), vinv),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_min_ps(hi, _mm512_max_ps(lo, v));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
  }
  quantize_tail(row, k, K, Kp, inv, out);
  for (int64_t g = 0; g < groups; ++g) {
    const __m512i bytes = _mm512_loadu_si512(out + g * kGroup);  // kGroup = 64 int8
    const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), bytes);
    gsum[g] = static_cast<float>(_mm512_reduce_add_epi32(sums));
  }
}

#else  // AVX2 + FMA + F16C (no AVX-512): the same weight format, 256-bit vectors, no VNNI.

// As the AVX-512 quantize_row above, eight values per vector: the same rounding of each value.
void quantize_row(const float* row, int64_t K, int64_t Kp, int8_t* out, float* scale, float* gsum) {
  const int64_t groups = Kp / kGroup;
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 vmax = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(absmask, _mm256_loadu_ps(row + k)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  float amax = 0.f;
  for (const float v : lanes) amax = std::fmax(amax, v);
  for (; k < K; ++k) amax = std::fmax(amax, std::fabs(row[k]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  *scale = amax / 127.f;
  const __m256 vinv = _mm256_set1_ps(inv), hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
  const auto codes = [&](const float* p) {
    const __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(p), vinv),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, v)));
  };
  // The two packs work within 128-bit lanes; dword i of `packed` holds values 4 * order[i]...
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (k = 0; k + 32 <= K; k += 32) {
    const __m256i a = _mm256_packs_epi32(codes(row + k), codes(row + k + 8));
    const __m256i b = _mm256_packs_epi32(codes(row + k + 16), codes(row + k + 24));
    const __m256i packed = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(a, b), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), packed);
  }
  quantize_tail(row, k, K, Kp, inv, out);
  const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < groups; ++g) {
    const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(out + g * kGroup));
    const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(out + g * kGroup + 32));
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(ones8, b0), _mm256_maddubs_epi16(ones8, b1));
    alignas(32) int32_t sums[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(sums), _mm256_madd_epi16(pairs, ones16));
    int32_t total = 0;
    for (const int32_t s : sums) total += s;
    gsum[g] = static_cast<float>(total);
  }
}

#endif

void quantize_rows(const float* x, int64_t M, int64_t K, int64_t Kp, int8_t* q, float* scale,
                   float* gsum) {
  const int64_t groups = Kp / kGroup;
  at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      quantize_row(x + m * K, K, Kp, q + m * Kp, scale + m, gsum + m * groups);
  });
}

// Channel block nb's share of the weight arrays: its groups, first channel, codes, scales, offsets.
struct Block {
  int64_t groups, n0;
  const uint8_t* codes;
  const uint16_t *scales, *offsets;
};

inline Block block_of(const uint8_t* w, const uint16_t* ws, const uint16_t* wo, int64_t nb, int64_t Kp) {
  const int64_t groups = Kp / kGroup;
  return {groups, nb * kColBlock, w + nb * groups * kGroupBytes, ws + nb * groups * kColBlock,
          wo + nb * groups * kColBlock};
}

#if VERISPEC_AVX512
// Output channels [4 nb, 4 nb + 4) for activation rows [m0, m0 + ROWS). Each 128-bit lane holds
// one channel, so one VNNI product covers 16 inputs of 4 channels against 16 activation bytes
// broadcast to every lane, and a group needs one conversion and one multiply-add per row. (Tried
// and slower here: a channel per 64-byte vector with 4 converts per group, 21-23 ms for the 1.5B's
// layers at 1 row but 75 ms at 8; fbgemm's channel-per-32-bit-lane layout, 27 ms and 100 ms.)
// The per-row work is what grows with the rows, so the inner loop holds only the integer products
// (one chain: int32 sums are exact in any order), the conversion and the scale's multiply-add;
// the offset term sum_g o * sum(a) runs after it, four groups per vector.
template <int64_t ROWS>
void block(const uint8_t* w, const uint16_t* ws, const uint16_t* wo, const int8_t* q, const float* xs,
           const float* gsum, const float* bias, float* y, int64_t nb, int64_t m0, int64_t N,
           int64_t Kp) {
  const auto [groups, n0, wb, sb, ob] = block_of(w, ws, wo, nb, Kp);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  // Lane 4i+j takes element i: channel j's scale in its 128-bit lane below, group i's activation
  // sum in the offset term.
  const __m512i lane_of = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  __m512 acc[ROWS];
  for (int64_t r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = wb + g * kGroupBytes;
    // One stream per thread, read once: ask for it kPrefetch bytes ahead.
    for (int64_t t = 0; t < kVectors; ++t)
      _mm_prefetch(reinterpret_cast<const char*>(wg + kPrefetch + t * 64), _MM_HINT_T0);
    __m512i lo[kVectors], hi[kVectors];
    for (int64_t t = 0; t < kVectors; ++t) {
      const __m512i bytes = _mm512_loadu_si512(wg + t * 64);
      lo[t] = _mm512_and_si512(bytes, low4);
      hi[t] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
    }
    const __m128 scale4 = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb + g * kColBlock)));
    const __m512 scale = _mm512_permutexvar_ps(lane_of, _mm512_castps128_ps512(scale4));
    for (int64_t r = 0; r < ROWS; ++r) {
      const int8_t* a = q + (m0 + r) * Kp + g * kGroup;
      __m512i d = _mm512_setzero_si512();
      for (int64_t t = 0; t < kVectors; ++t) {
        const __m128i* a_lo = reinterpret_cast<const __m128i*>(a + 32 * t);
        const __m128i* a_hi = reinterpret_cast<const __m128i*>(a + 32 * t + 16);
        d = _mm512_dpbusd_epi32(d, lo[t], _mm512_broadcast_i32x4(_mm_loadu_si128(a_lo)));
        d = _mm512_dpbusd_epi32(d, hi[t], _mm512_broadcast_i32x4(_mm_loadu_si128(a_hi)));
      }
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), scale, acc[r]);
    }
  }
  // Offset term: lane 4i+j accumulates o[g0 + i][j] * gsum[g0 + i] over g0 = 0, 4, 8, ...
  __m512 off[ROWS];
  for (int64_t r = 0; r < ROWS; ++r) off[r] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < groups; g0 += 4) {
    const int64_t n = std::min<int64_t>(4, groups - g0);
    const __m512 o = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(
        static_cast<__mmask16>((1u << (4 * n)) - 1), ob + g0 * kColBlock));
    for (int64_t r = 0; r < ROWS; ++r) {
      const __m128 sums = _mm_maskz_loadu_ps(static_cast<__mmask8>((1u << n) - 1),
                                             gsum + (m0 + r) * groups + g0);
      off[r] = _mm512_fmadd_ps(o, _mm512_permutexvar_ps(lane_of, _mm512_castps128_ps512(sums)), off[r]);
    }
  }
  // Per channel j: ((l0 + l1) + (l2 + l3)) of its 128-bit lane, plus (o_j + o_4+j) + (o_8+j + o_12+j)
  // of the offset lanes: the same additions in the same order for every row, done in vectors.
  const __m512i pick = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
  const __mmask8 tail = static_cast<__mmask8>((1u << std::min<int64_t>(kColBlock, N - n0)) - 1);
  const __m128 b4 = bias != nullptr ? _mm_maskz_loadu_ps(tail, bias + n0) : _mm_setzero_ps();
  for (int64_t r = 0; r < ROWS; ++r) {
    __m512 l = acc[r];
    l = _mm512_add_ps(l, _mm512_permute_ps(l, 0xB1));  // (l0+l1), (l1+l0), (l2+l3), (l3+l2)
    l = _mm512_add_ps(l, _mm512_permute_ps(l, 0x4E));  // (l0+l1)+(l2+l3) in every element
    __m512 o = off[r];
    o = _mm512_add_ps(o, _mm512_shuffle_f32x4(o, o, 0xB1));  // lanes (0+1), (1+0), (2+3), (3+2)
    o = _mm512_add_ps(o, _mm512_shuffle_f32x4(o, o, 0x4E));  // (0+1)+(2+3)
    const __m128 sums = _mm512_castps512_ps128(_mm512_permutexvar_ps(pick, l));
    __m128 v = _mm_mul_ps(_mm_set1_ps(xs[m0 + r]), _mm_add_ps(sums, _mm512_castps512_ps128(o)));
    if (bias != nullptr) v = _mm_add_ps(v, b4);
    _mm_mask_storeu_ps(y + (m0 + r) * N + n0, tail, v);
  }
}

#else  // AVX2

// The decode kernel without VNNI, as llama.cpp's AVX2 q4 x q8 dot products: u8 x s8 products
// summed in pairs into int16 (maddubs), then into int32 (madd). Each 256-bit half of a 64-byte
// weight vector holds two channels, one per 128-bit lane. A group's four pair-sums per int16 lane
// stay below 2^15 (4 x 2 x 15 x 127 = 15240), so they are added as int16 before one widening madd:
// exact integers, then one conversion and one multiply-add per half and row, as in the AVX-512 kernel.
template <int64_t ROWS>
void block(const uint8_t* w, const uint16_t* ws, const uint16_t* wo, const int8_t* q, const float* xs,
           const float* gsum, const float* bias, float* y, int64_t nb, int64_t m0, int64_t N,
           int64_t Kp) {
  const auto [groups, n0, wb, sb, ob] = block_of(w, ws, wo, nb, Kp);
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones16 = _mm256_set1_epi16(1);
  // Half h's 128-bit lanes are channels 2h and 2h + 1: their scales, each over its lane.
  const __m256i lanes_of[2] = {_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3)};
  const auto bcast = [](const int8_t* a) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a)));
  };
  // One half of a group (channels 2h, 2h + 1) against the rows: 4 products per row, summed as int16.
  const auto half = [&](const uint8_t* wg, int64_t g, int64_t h, __m256 scale4, __m256* acc, int64_t stride) {
    __m256i lo[kVectors], hi[kVectors];
    for (int64_t t = 0; t < kVectors; ++t) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + t * 64 + 32 * h));
      lo[t] = _mm256_and_si256(bytes, low4);
      hi[t] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
    }
    const __m256 scale = _mm256_permutevar8x32_ps(scale4, lanes_of[h]);
    for (int64_t r = 0; r < ROWS; ++r) {
      const int8_t* a = q + (m0 + r) * Kp + g * kGroup;
      __m256i d = _mm256_maddubs_epi16(lo[0], bcast(a));
      d = _mm256_add_epi16(d, _mm256_maddubs_epi16(hi[0], bcast(a + 16)));
      d = _mm256_add_epi16(d, _mm256_maddubs_epi16(lo[1], bcast(a + 32)));
      d = _mm256_add_epi16(d, _mm256_maddubs_epi16(hi[1], bcast(a + 48)));
      acc[r * stride] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(d, ones16)), scale, acc[r * stride]);
    }
  };
  const auto scales_of = [&](int64_t g) {
    return _mm256_castps128_ps256(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb + g * kColBlock))));
  };
  const auto prefetch = [&](const uint8_t* wg) {
    for (int64_t t = 0; t < kVectors; ++t)
      _mm_prefetch(reinterpret_cast<const char*>(wg + kPrefetch + t * 64), _MM_HINT_T0);
  };
  // acc[r][h]: row r's sums for half h. Up to 4 rows, both halves of a group run before the next
  // group (the block streams from memory once); more rows would not fit 16 registers with both
  // halves' accumulators, so each half runs over all groups in turn (the block is read twice, the
  // second time from cache). Either way each accumulator sees the same operations in the same
  // order, so a row's result does not depend on how many rows the call has.
  __m256 acc[ROWS][2];
  if constexpr (ROWS <= 4) {
    for (int64_t r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* wg = wb + g * kGroupBytes;
      prefetch(wg);
      const __m256 scale4 = scales_of(g);
      half(wg, g, 0, scale4, &acc[0][0], 2);
      half(wg, g, 1, scale4, &acc[0][1], 2);
    }
  } else {
    for (int64_t h = 0; h < 2; ++h) {
      __m256 hacc[ROWS];
      for (int64_t r = 0; r < ROWS; ++r) hacc[r] = _mm256_setzero_ps();
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* wg = wb + g * kGroupBytes;
        if (h == 0) prefetch(wg);
        half(wg, g, h, scales_of(g), hacc, 1);
      }
      for (int64_t r = 0; r < ROWS; ++r) acc[r][h] = hacc[r];
    }
  }
  // Offset term: lane 4i+j accumulates o[g0 + i][j] * gsum[g0 + i] over g0 = 0, 2, 4, ...
  const __m256i pair = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  __m256 off[ROWS];
  for (int64_t r = 0; r < ROWS; ++r) off[r] = _mm256_setzero_ps();
  for (int64_t g0 = 0; g0 < groups; g0 += 2) {
    const bool two = g0 + 1 < groups;
    const __m128i raw = two ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(ob + g0 * kColBlock))
                            : _mm_loadl_epi64(reinterpret_cast<const __m128i*>(ob + g0 * kColBlock));
    const __m256 o = _mm256_cvtph_ps(raw);
    for (int64_t r = 0; r < ROWS; ++r) {
      const float* gs = gsum + (m0 + r) * groups + g0;
      const __m128 sums = _mm_setr_ps(gs[0], two ? gs[1] : 0.f, 0.f, 0.f);
      off[r] = _mm256_fmadd_ps(o, _mm256_permutevar8x32_ps(_mm256_castps128_ps256(sums), pair), off[r]);
    }
  }
  // Per channel: ((l0 + l1) + (l2 + l3)) of its lane, plus its even-group and odd-group offset
  // sums: the same additions in the same order for every row.
  const int64_t valid = std::min<int64_t>(kColBlock, N - n0);
  const __m128i tail = _mm_setr_epi32(valid > 0 ? -1 : 0, valid > 1 ? -1 : 0, valid > 2 ? -1 : 0, valid > 3 ? -1 : 0);
  const __m128 b4 = bias != nullptr ? _mm_maskload_ps(bias + n0, tail) : _mm_setzero_ps();
  for (int64_t r = 0; r < ROWS; ++r) {
    __m256 l = _mm256_hadd_ps(acc[r][0], acc[r][1]);  // lane 0: ch 0, 0, 2, 2; lane 1: ch 1, 1, 3, 3
    l = _mm256_hadd_ps(l, l);  // lane 0: ch 0, 2, 0, 2; lane 1: ch 1, 3, 1, 3
    const __m128 sums = _mm_unpacklo_ps(_mm256_castps256_ps128(l), _mm256_extractf128_ps(l, 1));
    const __m128 o = _mm_add_ps(_mm256_castps256_ps128(off[r]), _mm256_extractf128_ps(off[r], 1));
    __m128 v = _mm_mul_ps(_mm_set1_ps(xs[m0 + r]), _mm_add_ps(sums, o));
    if (bias != nullptr) v = _mm_add_ps(v, b4);
    _mm_maskstore_ps(y + (m0 + r) * N + n0, tail, v);
  }
}

#endif

// rows <= ROWS activation rows through block<rows>: the row count is a template argument so that
// the accumulators live in registers.
template <int64_t ROWS, typename... Args>
void dispatch(int64_t rows, Args... args) {
  if constexpr (ROWS > 1) {
    if (rows < ROWS) return dispatch<ROWS - 1>(rows, args...);
  }
  block<ROWS>(args...);
}

#if VERISPEC_AVX512
// ---------------------------------------------------------------------------------------------
// The many-row kernel (prefill). Each call unpacks a tile of 32 channels once into L2 as bytes laid
// out fbgemm-style, [input quad][channel][4 inputs], so one VNNI product covers 16 channels x 4
// inputs against a 4-byte activation broadcast, and a group's integer sums of 6 rows x 32 channels
// stay in registers over its 64 inputs: one conversion and two multiply-adds per 16 products,
// against one per 4 in the decode kernel. Rows are still independent of each other (each row's
// operations do not depend on M or on its neighbours), but the float order differs from the decode
// kernel's, so a token fed here scores within rounding of, not bit-identically to, the same token
// fed through int4_linear: only prompt tokens, fed the same way whether the engine speculates or
// not, come here (see Int4Linear).
constexpr int64_t kTile = 32;
constexpr int64_t kTileBlocks = kTile / kColBlock;
constexpr int64_t kWideRows = 6;

void unpack_tile(const uint8_t* w, const uint16_t* ws, const uint16_t* wo, int64_t b0, int64_t nblk,
                 int64_t groups, uint8_t* W, float* S, float* O) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  // (128-bit lane j = channel j, dword q = input quad q) -> (lane q, dword j)
  const __m512i transpose = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  if (nblk < kTileBlocks) {
    std::memset(W, 0, groups * kGroup / 4 * kTile * 4);
    std::memset(S, 0, groups * kTile * sizeof(float));
    std::memset(O, 0, groups * kTile * sizeof(float));
  }
  for (int64_t bi = 0; bi < nblk; ++bi) {
    const uint8_t* wb = w + (b0 + bi) * groups * kGroupBytes;
    const uint16_t* sb = ws + (b0 + bi) * groups * kColBlock;
    const uint16_t* ob = wo + (b0 + bi) * groups * kColBlock;
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t t = 0; t < kVectors; ++t) {
        const __m512i bytes = _mm512_loadu_si512(wb + g * kGroupBytes + t * 64);
        const __m512i lo = _mm512_permutexvar_epi32(transpose, _mm512_and_si512(bytes, low4));
        const __m512i hi = _mm512_permutexvar_epi32(
            transpose, _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4));
        // Lane q of lo holds quad 8t + q of this block's 4 channels, lane q of hi quad 8t + 4 + q.
        alignas(64) uint8_t lanes[128];
        _mm512_store_si512(lanes, lo);
        _mm512_store_si512(lanes + 64, hi);
        uint8_t* dst = W + ((g * 16 + 8 * t) * kTile + kColBlock * bi) * 4;
        for (int64_t q = 0; q < 8; ++q) std::memcpy(dst + q * kTile * 4, lanes + 16 * q, 16);
      }
      for (int64_t j = 0; j < kColBlock; ++j) {
        S[g * kTile + kColBlock * bi + j] = _cvtsh_ss(sb[g * kColBlock + j]);
        O[g * kTile + kColBlock * bi + j] = _cvtsh_ss(ob[g * kColBlock + j]);
      }
    }
  }
}

template <int64_t ROWS>
void wide_rows(const uint8_t* W, const float* S, const float* O, const int8_t* q, const float* xs,
               const float* gsum, const float* bias, float* y, int64_t n0, int64_t nvalid, int64_t m0,
               int64_t N, int64_t Kp) {
  const int64_t groups = Kp / kGroup;
  __m512 acc[ROWS][2];
  for (int64_t r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i d[ROWS][2];
    for (int64_t r = 0; r < ROWS; ++r) d[r][0] = d[r][1] = _mm512_setzero_si512();
    const uint8_t* wg = W + g * 16 * kTile * 4;
    for (int64_t s = 0; s < kGroup / 4; ++s) {
      const __m512i w0 = _mm512_loadu_si512(wg + s * kTile * 4);
      const __m512i w1 = _mm512_loadu_si512(wg + s * kTile * 4 + 64);
      for (int64_t r = 0; r < ROWS; ++r) {
        int32_t a4;
        std::memcpy(&a4, q + (m0 + r) * Kp + g * kGroup + 4 * s, 4);
        const __m512i a = _mm512_set1_epi32(a4);
        d[r][0] = _mm512_dpbusd_epi32(d[r][0], w0, a);
        d[r][1] = _mm512_dpbusd_epi32(d[r][1], w1, a);
      }
    }
    const __m512 s0 = _mm512_loadu_ps(S + g * kTile), s1 = _mm512_loadu_ps(S + g * kTile + 16);
    const __m512 o0 = _mm512_loadu_ps(O + g * kTile), o1 = _mm512_loadu_ps(O + g * kTile + 16);
    for (int64_t r = 0; r < ROWS; ++r) {
      const __m512 gs = _mm512_set1_ps(gsum[(m0 + r) * groups + g]);
      acc[r][0] = _mm512_fmadd_ps(o0, gs, _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[r][0]), s0, acc[r][0]));
      acc[r][1] = _mm512_fmadd_ps(o1, gs, _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[r][1]), s1, acc[r][1]));
    }
  }
  const __mmask16 m_lo = static_cast<__mmask16>(nvalid >= 16 ? 0xFFFF : (1u << nvalid) - 1);
  const __mmask16 m_hi = static_cast<__mmask16>(nvalid >= 32 ? 0xFFFF : nvalid <= 16 ? 0 : (1u << (nvalid - 16)) - 1);
  const __m512 b0 = bias != nullptr ? _mm512_maskz_loadu_ps(m_lo, bias + n0) : _mm512_setzero_ps();
  const __m512 b1 = bias != nullptr ? _mm512_maskz_loadu_ps(m_hi, bias + n0 + 16) : _mm512_setzero_ps();
  for (int64_t r = 0; r < ROWS; ++r) {
    const __m512 x = _mm512_set1_ps(xs[m0 + r]);
    _mm512_mask_storeu_ps(y + (m0 + r) * N + n0, m_lo, _mm512_add_ps(_mm512_mul_ps(x, acc[r][0]), b0));
    _mm512_mask_storeu_ps(y + (m0 + r) * N + n0 + 16, m_hi, _mm512_add_ps(_mm512_mul_ps(x, acc[r][1]), b1));
  }
}

template <typename... Args>
void dispatch_wide(int64_t rows, Args... args) {
  switch (rows) {
    case 1: wide_rows<1>(args...); break;
    case 2: wide_rows<2>(args...); break;
    case 3: wide_rows<3>(args...); break;
    case 4: wide_rows<4>(args...); break;
    case 5: wide_rows<5>(args...); break;
    default: wide_rows<6>(args...); break;
  }
}

#endif

// What every entry point does before its products: check x against the weight's Kp inputs, quantize
// the activations per row (quantize_rows), allocate the output and take the bias as float32.
struct Rows {
  int64_t M = 0;
  std::vector<int64_t> out_shape;
  at::Tensor y, bias;
  const float* bptr = nullptr;
  std::vector<int8_t> q;
  std::vector<float> xs, gsum;
};

// `pad_rows`: q gets zero rows up to a multiple of it, so that tile loads of whole 16-row tiles
// stay inside it (the sums of the padding rows are computed and never stored).
Rows prepare_rows(const char* op, const at::Tensor& x, int64_t Kp, int64_t N, const std::optional<at::Tensor>& bias,
                  int64_t pad_rows = 1) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": x must be float32");
  const int64_t K = x.size(-1);
  TORCH_CHECK(K <= Kp && K > Kp - kGroup, op, ": x has ", K, " features, the weight ", Kp);
  Rows r;
  const at::Tensor xc = x.reshape({-1, K}).contiguous();
  r.M = xc.size(0);
  r.out_shape.assign(x.sizes().begin(), x.sizes().end());
  r.out_shape.back() = N;
  r.y = at::empty({r.M, N}, x.options());
  if (bias.has_value() && bias->defined()) {
    r.bias = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(r.bias.numel() == N, op, ": bias must have ", N, " elements");
    r.bptr = r.bias.data_ptr<float>();
  }
  if (r.M == 0) return r;
  r.q.assign((r.M + pad_rows - 1) / pad_rows * pad_rows * Kp, 0);
  r.xs.resize(r.M);
  r.gsum.resize(r.M * (Kp / kGroup));
  quantize_rows(xc.data_ptr<float>(), r.M, K, Kp, r.q.data(), r.xs.data(), r.gsum.data());
  return r;
}

// An int4 weight in either layout, checked: `cols` channels per row of `weight` (a VNNI block of 4,
// an AMX tile of 16), cols * kGroup / 2 packed bytes per row and group, float16 scales and offsets.
struct Int4Weights {
  at::Tensor wc, sc, oc;
  const uint8_t* w = nullptr;
  const uint16_t *ws = nullptr, *wo = nullptr;
  int64_t units = 0, groups = 0, Kp = 0;
};

Int4Weights int4_weights(const char* op, const at::Tensor& weight, const at::Tensor& scales,
                         const at::Tensor& offsets, int64_t N, int64_t cols) {
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2, op, ": weight must be uint8 [N / ", cols,
              ", groups * ", cols * kGroup / 2, "]");
  Int4Weights p;
  p.units = weight.size(0);
  TORCH_CHECK(p.units == (N + cols - 1) / cols, op, ": ", p.units, " weight rows for ", N, " outputs");
  p.groups = weight.size(1) / (cols * kGroup / 2);
  p.Kp = p.groups * kGroup;
  const int64_t count = p.units * p.groups * cols;
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.numel() == count, op, ": bad scales");
  TORCH_CHECK(offsets.scalar_type() == at::kHalf && offsets.numel() == count, op, ": bad offsets");
  p.wc = weight.contiguous();
  p.sc = scales.contiguous();
  p.oc = offsets.contiguous();
  p.w = p.wc.data_ptr<uint8_t>();
  p.ws = reinterpret_cast<const uint16_t*>(p.sc.data_ptr<at::Half>());
  p.wo = reinterpret_cast<const uint16_t*>(p.oc.data_ptr<at::Half>());
  return p;
}

#if VERISPEC_AMX
// ---------------------------------------------------------------------------------------------
// The AMX kernel (Intel CPUs with AMX-INT8: Sapphire Rapids and later). Where the VNNI decode
// kernel's cost grows by ~40 vector instructions per activation row and 16 channels x 64 inputs
// (one product per 4 channels x 16 inputs, then a conversion and a multiply-add per 4 channels), one
// tile product (TDPBSUD) takes up to 16 activation rows x 64 inputs against 16 channels at once, so
// a row adds only the conversion and two multiply-adds of its 16 integer sums per group: verifying 8
// or 16 drafted tokens costs little more than decoding one. The weights stay 4-bit in memory; each
// 16-channel x 64-input group is unpacked to bytes in L1 (two masks per 64 bytes) for the tile load.
// Weight layout (int4.to_amx_layout): per tile of 16 channels and group, 8 vectors v of 64 bytes;
// byte 4c + b of vector v holds channel c's input 4v + b in its low nibble and 4(v + 8) + b in its
// high one, so the low nibbles are tile rows 0-7 (input quads 0-7, VNNI order) and the high ones
// rows 8-15. Scales and offsets: float16 [tile, group, 16].
//
// Batch invariance as in the decode kernel: output (m, n) is computed by one thread with the same
// operations in the same order for any M and any position of row m (exact int32 sums per group, then
// per group acc = fma(sum, s, acc), acc = fma(o, sum(a), acc); then y = scale_m * acc + bias). The
// order differs from the VNNI kernels', so a process runs every int4 row through this kernel
// (decode, verify and prompt rows alike) or none.
constexpr int64_t kAmxCols = 16;  // output channels per tile
constexpr int64_t kAmxRows = 16;  // activation rows per tile product
constexpr int64_t kAmxGroupBytes = kAmxCols * kGroup / 2;  // 512: one tile's group, 4-bit
constexpr int64_t kAmxB = kAmxCols * kGroup;  // 1024: the same group unpacked to a B tile
constexpr int64_t kAmxPrefetch = 2048;  // bytes ahead in a tile's weight stream (1024-8192 tried: none better)

// Linux hands out AMX's 8 KB of tile state only to processes that ask for it (once per process).
bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-2 and 3-5: C (rows x 16 int32), A (rows x 64 int8), B (16 x 64 uint8), two sets so that
// one group's product overlaps the other's store.
void amx_configure(int64_t rows) {
  TileConfig c;
  for (int t = 0; t < 6; t += 3) {
    c.rows[t] = c.rows[t + 1] = static_cast<uint8_t>(rows);
    c.colsb[t] = c.colsb[t + 1] = 64;
    c.rows[t + 2] = 16;
    c.colsb[t + 2] = 64;
  }
  // GCC does not treat ldtilecfg as reading its operand: compiled out of line, the stores above
  // were dropped as dead and every tile was configured empty (SIGILL at the first tile load).
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

inline void amx_unpack(const uint8_t* src, uint8_t* dst) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t v = 0; v < 8; ++v) {
    const __m512i bytes = _mm512_loadu_si512(src + 64 * v);
    _mm512_store_si512(dst + 64 * v, _mm512_and_si512(bytes, low4));
    _mm512_store_si512(dst + 64 * (v + 8), _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4));
  }
}

// The float part both AMX-layout paths share, so that their results are the same to the bit: fold
// group g's exact int32 sums (sum_of(r): row m0 + r's 16 channels) into the accumulators, then write
// y = scale_m * acc + bias for the tile's valid channels.
template <int64_t ROWS, typename SumOf>
inline void fold_group(__m512* acc, SumOf sum_of, const uint16_t* st, const uint16_t* ot, const float* gsum,
                       int64_t groups, int64_t m0, int64_t g) {
  const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(st + g * kAmxCols)));
  const __m512 o = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ot + g * kAmxCols)));
  for (int64_t r = 0; r < ROWS; ++r) {
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum_of(r)), s, acc[r]);
    acc[r] = _mm512_fmadd_ps(o, _mm512_set1_ps(gsum[(m0 + r) * groups + g]), acc[r]);
  }
}

template <int64_t ROWS>
inline void store_rows(const __m512* acc, const float* xs, const float* bias, float* y, int64_t n0, int64_t m0,
                       int64_t N) {
  const int64_t valid = std::min<int64_t>(kAmxCols, N - n0);
  const __mmask16 tail = static_cast<__mmask16>(valid >= 16 ? 0xFFFF : (1u << valid) - 1);
  const __m512 b16 = bias != nullptr ? _mm512_maskz_loadu_ps(tail, bias + n0) : _mm512_setzero_ps();
  for (int64_t r = 0; r < ROWS; ++r) {
    const __m512 v = _mm512_mul_ps(_mm512_set1_ps(xs[m0 + r]), acc[r]);
    _mm512_mask_storeu_ps(y + (m0 + r) * N + n0, tail, bias != nullptr ? _mm512_add_ps(v, b16) : v);
  }
}
// One group's 8 lines of 4-bit weights, kAmxPrefetch bytes ahead of group g.
inline void prefetch_group(const uint8_t* wt, int64_t g) {
  for (int64_t line = 0; line < kAmxGroupBytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(wt + g * kAmxGroupBytes + kAmxPrefetch + line), _MM_HINT_T0);
}

// Group g of a channel tile's weights unpacked into slot g % 4 of the L1 ring (past the last group:
// nothing).
inline void amx_ring_unpack(const uint8_t* wt, uint8_t* ring, int64_t groups, int64_t g) {
  if (g >= groups) return;
  prefetch_group(wt, g);
  amx_unpack(wt + g * kAmxGroupBytes, ring + (g & 3) * kAmxB);
}

// Rows [m0, m0 + ROWS) against channel tile nt (tiles must be configured for ROWS rows), each
// group unpacked into `ring` as it comes (the bytes stay in L1).
template <int64_t ROWS>
void amx_rows(const uint8_t* wt, uint8_t* ring, const uint16_t* st, const uint16_t* ot,
              const int8_t* q, const float* xs, const float* gsum, const float* bias, float* y, int64_t n0,
              int64_t m0, int64_t N, int64_t Kp) {
  const int64_t groups = Kp / kGroup;
  alignas(64) int32_t c[2][2 * ROWS * kAmxCols];  // [pair parity][group of the pair][row][channel]
  __m512 acc[ROWS];
  for (int64_t r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  const auto epilogue = [&](const int32_t* sums, int64_t g) {
    fold_group<ROWS>(acc, [&](int64_t r) { return _mm512_load_si512(sums + r * kAmxCols); }, st, ot, gsum, groups,
                     m0, g);
  };
  // Software-pipelined over pairs of groups: the next pair is unpacked (into the other half of a
  // 4-slot ring) while this pair's products run, and a pair's sums are folded in after the next
  // pair's products are issued, so the tile loads never wait on just-stored bytes and the stores
  // of C overlap other work. Each row still takes its groups in order.
  const auto b_of = [&](int64_t g) -> const uint8_t* { return ring + (g & 3) * kAmxB; };
  const auto unpack = [&](int64_t g) { amx_ring_unpack(wt, ring, groups, g); };
  const int8_t* a = q + m0 * Kp;
  unpack(0);
  unpack(1);
  for (int64_t g = 0; g < groups + 2; g += 2) {
    int32_t* now = c[(g >> 1) & 1];
    int32_t* before = c[((g >> 1) + 1) & 1];
    if (g < groups) {
      _tile_loadd(2, b_of(g), 64);
      _tile_loadd(1, a + g * kGroup, Kp);
      _tile_zero(0);
      _tile_dpbsud(0, 1, 2);
      if (g + 1 < groups) {
        _tile_loadd(5, b_of(g + 1), 64);
        _tile_loadd(4, a + (g + 1) * kGroup, Kp);
        _tile_zero(3);
        _tile_dpbsud(3, 4, 5);
      }
      unpack(g + 2);
      unpack(g + 3);
    }
    if (g >= 2) {
      epilogue(before, g - 2);
      if (g - 1 < groups) epilogue(before + ROWS * kAmxCols, g - 1);
    }
    if (g < groups) {
      _tile_stored(0, now, 64);
      if (g + 1 < groups) _tile_stored(3, now + ROWS * kAmxCols, 64);
    }
  }
  store_rows<ROWS>(acc, xs, bias, y, n0, m0, N);
}

// Two tiles of rows, [m0, m0 + R0) and [m0 + 16, m0 + 16 + R1) (R1 = 0: the first only), against
// channel tile nt in one pass over the groups: each group's B tile is unpacked and loaded once for
// both, where one pass per tile of rows paid the unpacking, the B load and the loop again (17 rows
// cost 1.5x 16 rows; a token tree of 16 drafts plus its root is 17). Tiles are configured for 16
// rows throughout (amx_configure(16)) and read whole 16-row tiles of activations: q is padded with
// zero rows (prepare_rows' pad_rows), whose sums are never stored. Steps of one group: this group's
// products are issued, then the previous group's sums are folded in, then this group's stored. The
// float work per row is fold_group and store_rows, as in amx_rows: bit-identical results. B: the
// channel tile's groups unpacked once per call (more than 64 rows), or nullptr to unpack each group
// into `ring` as it comes.
template <int64_t R0, int64_t R1>
void amx_row_pair(const uint8_t* wt, const uint8_t* B, uint8_t* ring, const uint16_t* st, const uint16_t* ot,
                  const int8_t* q, const float* xs, const float* gsum, const float* bias, float* y, int64_t n0,
                  int64_t m0, int64_t N, int64_t Kp) {
  static_assert(R0 >= 1 && R0 <= kAmxRows && R1 >= 0 && R1 <= kAmxRows && (R1 == 0 || R0 == kAmxRows));
  const int64_t groups = Kp / kGroup;
  alignas(64) int32_t c[2][2 * kAmxRows * kAmxCols];  // [group parity][tile of rows][row][channel]
  __m512 acc0[R0], acc1[R1 > 0 ? R1 : 1];
  for (int64_t r = 0; r < R0; ++r) acc0[r] = _mm512_setzero_ps();
  for (int64_t r = 0; r < R1; ++r) acc1[r] = _mm512_setzero_ps();
  const auto b_of = [&](int64_t g) -> const uint8_t* { return B != nullptr ? B + g * kAmxB : ring + (g & 3) * kAmxB; };
  const auto unpack = [&](int64_t g) {
    if (B == nullptr) amx_ring_unpack(wt, ring, groups, g);
  };
  const int8_t* a0 = q + m0 * Kp;
  const int8_t* a1 = a0 + kAmxRows * Kp;
  unpack(0);
  unpack(1);
  for (int64_t g = 0; g <= groups; ++g) {
    int32_t* now = c[g & 1];
    const int32_t* before = c[(g + 1) & 1];
    if (g < groups) {
      _tile_loadd(2, b_of(g), 64);
      _tile_loadd(1, a0 + g * kGroup, Kp);
      _tile_zero(0);
      _tile_dpbsud(0, 1, 2);
      if constexpr (R1 > 0) {
        _tile_loadd(4, a1 + g * kGroup, Kp);
        _tile_zero(3);
        _tile_dpbsud(3, 4, 2);
      }
      unpack(g + 2);
    }
    if (g >= 1) {
      fold_group<R0>(acc0, [&](int64_t r) { return _mm512_load_si512(before + r * kAmxCols); }, st, ot, gsum, groups,
                     m0, g - 1);
      if constexpr (R1 > 0)
        fold_group<R1>(acc1, [&](int64_t r) { return _mm512_load_si512(before + (kAmxRows + r) * kAmxCols); }, st, ot,
                       gsum, groups, m0 + kAmxRows, g - 1);
    }
    if (g < groups) {
      _tile_stored(0, now, 64);
      if constexpr (R1 > 0) _tile_stored(3, now + kAmxRows * kAmxCols, 64);
    }
  }
  store_rows<R0>(acc0, xs, bias, y, n0, m0, N);
  if constexpr (R1 > 0) store_rows<R1>(acc1, xs, bias, y, n0, m0 + kAmxRows, N);
}

// Rows [0, M) of one channel tile in passes of up to 32: pass(m0, R0, R1) for 16 + R1 rows from m0
// (R0 = 16), or for the last R0 <= 16 rows alone (R1 = 0); R0 and R1 as std::integral_constant.
template <typename Pass>
void amx_passes(int64_t M, Pass&& pass) {
  for (int64_t m0 = 0; m0 < M; m0 += 2 * kAmxRows) {
    const int64_t rest = M - m0;
    if (rest > kAmxRows)
      with_count<kAmxRows>(std::min(rest - kAmxRows, kAmxRows),
                           [&](auto R1) { pass(m0, std::integral_constant<int64_t, kAmxRows>{}, R1); });
    else
      with_count<kAmxRows>(rest, [&](auto R0) { pass(m0, R0, std::integral_constant<int64_t, 0>{}); });
  }
}

// A few rows (decoding one token, verifying one or two drafts) through the AMX layout with VNNI
// products instead of tiles: no unpacked bytes stored and loaded again, and no tile latencies,
// which is faster at 1-2 rows. Row m's dword c sums channel c's products over the group's 16 input
// quads exactly (two int32 chains added), then goes through the same fold_group and store_rows as
// amx_rows: the results are bit-identical to the tile path's, so the two mix freely.
template <int64_t ROWS>
void amx_layout_vnni_rows(const uint8_t* wt, const uint16_t* st, const uint16_t* ot, const int8_t* q,
                          const float* xs, const float* gsum, const float* bias, float* y, int64_t n0,
                          int64_t m0, int64_t N, int64_t Kp) {
  const int64_t groups = Kp / kGroup;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[ROWS];
  for (int64_t r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = wt + g * kAmxGroupBytes;
    prefetch_group(wt, g);
    __m512i d0[ROWS], d1[ROWS];
    for (int64_t r = 0; r < ROWS; ++r) d0[r] = d1[r] = _mm512_setzero_si512();
    for (int64_t v = 0; v < 8; ++v) {
      const __m512i bytes = _mm512_loadu_si512(wg + 64 * v);
      const __m512i lo = _mm512_and_si512(bytes, low4);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
      for (int64_t r = 0; r < ROWS; ++r) {
        const int8_t* a = q + (m0 + r) * Kp + g * kGroup;
        int32_t lo4, hi4;
        std::memcpy(&lo4, a + 4 * v, 4);
        std::memcpy(&hi4, a + 4 * (v + 8), 4);
        d0[r] = _mm512_dpbusd_epi32(d0[r], lo, _mm512_set1_epi32(lo4));
        d1[r] = _mm512_dpbusd_epi32(d1[r], hi, _mm512_set1_epi32(hi4));
      }
    }
    fold_group<ROWS>(acc, [&](int64_t r) { return _mm512_add_epi32(d0[r], d1[r]); }, st, ot, gsum, groups, m0, g);
  }
  store_rows<ROWS>(acc, xs, bias, y, n0, m0, N);
}

// Up to 5 rows the VNNI products beat the tiles' fixed cost per group (unpacking, tile loads and
// stores): for the 1.5B's gate/up projection 0.31 / 0.31 / 0.33 ms at 1 / 4 / 5 rows against the
// tiles' 0.38 / 0.42 / 0.45; at 6 rows 0.43 each, at 8 0.54 against 0.41.
constexpr int64_t kVnniRowsMax = 5;

at::Tensor int4_linear_amx(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                           const at::Tensor& offsets, const std::optional<at::Tensor>& bias,
                           int64_t out_features) {
  TORCH_CHECK(amx_permitted(), "int4_linear_amx: the kernel may not use AMX tiles in this process");
  const int64_t N = out_features;
  const Int4Weights p = int4_weights("int4_linear_amx", weight, scales, offsets, N, kAmxCols);
  const int64_t tiles = p.units, groups = p.groups, Kp = p.Kp;
  Rows r = prepare_rows("int4_linear_amx", x, Kp, N, bias, kAmxRows);
  const int64_t M = r.M;
  if (M == 0) return r.y.reshape(r.out_shape);
  const int8_t* q = r.q.data();
  const float *xs = r.xs.data(), *gsum = r.gsum.data();
  float* yp = r.y.data_ptr<float>();
  if (M <= kVnniRowsMax) {  // a few rows: VNNI products on the same layout, bit-identical (see there)
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t nt = t0; nt < t1; ++nt) {
        with_count<kVnniRowsMax>(M, [&](auto R) {
          amx_layout_vnni_rows<R()>(p.w + nt * groups * kAmxGroupBytes, p.ws + nt * groups * kAmxCols,
                                    p.wo + nt * groups * kAmxCols, q, xs, gsum, r.bptr, yp, nt * kAmxCols, 0, N, Kp);
        });
      }
    });
    return r.y.reshape(r.out_shape);
  }
  // Threads split the channel tiles only: which thread computes (m, n) never depends on M.
  // Passes of up to 32 rows unpack their groups into the L1 ring as they go; from 65 rows on, each
  // channel tile is unpacked once per call into an L2 buffer that all passes read. Measured in one
  // process (gate/up 17920 x 1536, ms, ring / buffer): 33 rows 1.43 / 1.54, 64 rows 2.04 / 2.24,
  // 128 rows 4.38 / 4.20, 256 rows 13.1 / 10.6.
  const bool many = M > 4 * kAmxRows;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    alignas(64) uint8_t ring[4 * kAmxB];
    std::vector<uint8_t> unpacked(many ? groups * kAmxB + 64 : 0);
    uint8_t* B = many ? reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(unpacked.data()) + 63) & ~uintptr_t{63})
                      : nullptr;
    amx_configure(std::min(M, kAmxRows));
    for (int64_t nt = t0; nt < t1; ++nt) {
      const uint8_t* wt = p.w + nt * groups * kAmxGroupBytes;
      const uint16_t *st = p.ws + nt * groups * kAmxCols, *ot = p.wo + nt * groups * kAmxCols;
      if (M <= kAmxRows) {  // one tile of rows, configured for exactly M: amx_rows' pipeline
        with_count<kAmxRows>(M, [&](auto R) { amx_rows<R()>(wt, ring, st, ot, q, xs, gsum, r.bptr, yp, nt * kAmxCols, 0, N, Kp); });
        continue;
      }
      if (many)
        for (int64_t g = 0; g < groups; ++g) amx_unpack(wt + g * kAmxGroupBytes, B + g * kAmxB);
      amx_passes(M, [&](int64_t m0, auto R0, auto R1) {
        amx_row_pair<R0(), R1()>(wt, B, ring, st, ot, q, xs, gsum, r.bptr, yp, nt * kAmxCols, m0, N, Kp);
      });
    }
    _tile_release();
  });
  return r.y.reshape(r.out_shape);
}

// int8 weights x int8 activations on AMX, for RowwiseInt8Linear (the LM head on the int4 path, every
// Linear on the int8 path). fbgemm's int8 product costs ~0.7 ms more per verified row for the 1.5B's
// LM head (152k channels); a tile product takes 16 rows at once. Weights: symmetric per channel,
// laid out per tile of 16 channels as [input chunk of 64][quad][channel][4] (int8 [N/16, Kp*16]),
// loaded into tiles as they are (no unpacking); activations: symmetric per row (quantize_rows).
// Output (m, n) = (float(sum_k a*w) * scale_m) * scale_n + bias_n, with the int32 sum exact: the
// same for any M and any position of the row.
// y = (float(sum) * scale_m) * scale_n + bias_n for ROWS rows of one channel tile (sum_of(r): row
// m0 + r's 16 exact int32 sums).
template <int64_t ROWS, typename SumOf>
inline void int8_store_rows(SumOf sum_of, const float* wscale, const float* xs, const float* bias, float* y,
                            int64_t n0, int64_t m0, int64_t N) {
  const int64_t valid = std::min<int64_t>(kAmxCols, N - n0);
  const __mmask16 tail = static_cast<__mmask16>(valid >= 16 ? 0xFFFF : (1u << valid) - 1);
  const __m512 ws = _mm512_loadu_ps(wscale);
  const __m512 b16 = bias != nullptr ? _mm512_maskz_loadu_ps(tail, bias + n0) : _mm512_setzero_ps();
  for (int64_t r = 0; r < ROWS; ++r) {
    const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum_of(r)), _mm512_set1_ps(xs[m0 + r])), ws);
    _mm512_mask_storeu_ps(y + (m0 + r) * N + n0, tail, bias != nullptr ? _mm512_add_ps(v, b16) : v);
  }
}

template <int64_t ROWS>
void amx_int8_rows(const int8_t* wt, const float* wscale, const int8_t* q, const float* xs, const float* bias,
                   float* y, int64_t n0, int64_t m0, int64_t N, int64_t Kp) {
  const int64_t chunks = Kp / kGroup;
  const int8_t* a = q + m0 * Kp;
  _tile_zero(0);
  _tile_zero(3);
  int64_t kc = 0;
  for (; kc + 2 <= chunks; kc += 2) {
    _tile_loadd(2, wt + kc * kAmxB, 64);
    _tile_loadd(5, wt + (kc + 1) * kAmxB, 64);
    _tile_loadd(1, a + kc * kGroup, Kp);
    _tile_loadd(4, a + (kc + 1) * kGroup, Kp);
    _tile_dpbssd(0, 1, 2);
    _tile_dpbssd(3, 4, 5);
  }
  if (kc < chunks) {
    _tile_loadd(2, wt + kc * kAmxB, 64);
    _tile_loadd(1, a + kc * kGroup, Kp);
    _tile_dpbssd(0, 1, 2);
  }
  alignas(64) int32_t c[2][ROWS * kAmxCols];
  _tile_stored(0, c[0], 64);
  _tile_stored(3, c[1], 64);
  int8_store_rows<ROWS>(
      [&](int64_t r) { return _mm512_add_epi32(_mm512_load_si512(c[0] + r * kAmxCols), _mm512_load_si512(c[1] + r * kAmxCols)); },
      wscale, xs, bias, y, n0, m0, N);
}

// Two tiles of rows (R1 = 0: the first only) against one channel tile in one pass over the inputs:
// each weight tile is loaded once for both (17-32 rows; more in passes of 32), as amx_row_pair does
// for int4. Configured for 16 rows throughout, q padded with zero rows. The int32 sums are exact in
// any order, so the results equal amx_int8_rows' to the bit.
template <int64_t R0, int64_t R1>
void amx_int8_pair(const int8_t* wt, const float* wscale, const int8_t* q, const float* xs, const float* bias,
                   float* y, int64_t n0, int64_t m0, int64_t N, int64_t Kp) {
  static_assert(R0 >= 1 && R0 <= kAmxRows && R1 >= 0 && R1 <= kAmxRows && (R1 == 0 || R0 == kAmxRows));
  const int64_t chunks = Kp / kGroup;
  const int8_t* a0 = q + m0 * Kp;
  const int8_t* a1 = a0 + kAmxRows * Kp;
  _tile_zero(0);
  if constexpr (R1 > 0) _tile_zero(3);
  for (int64_t kc = 0; kc < chunks; ++kc) {
    _tile_loadd(2, wt + kc * kAmxB, 64);
    _tile_loadd(1, a0 + kc * kGroup, Kp);
    _tile_dpbssd(0, 1, 2);
    if constexpr (R1 > 0) {
      _tile_loadd(4, a1 + kc * kGroup, Kp);
      _tile_dpbssd(3, 4, 2);
    }
  }
  alignas(64) int32_t c[2][kAmxRows * kAmxCols];
  _tile_stored(0, c[0], 64);
  int8_store_rows<R0>([&](int64_t r) { return _mm512_load_si512(c[0] + r * kAmxCols); }, wscale, xs, bias, y, n0,
                      m0, N);
  if constexpr (R1 > 0) {
    _tile_stored(3, c[1], 64);
    int8_store_rows<R1>([&](int64_t r) { return _mm512_load_si512(c[1] + r * kAmxCols); }, wscale, xs, bias, y,
                        n0, m0 + kAmxRows, N);
  }
}

at::Tensor int8_linear_amx(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                           const std::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(amx_permitted(), "int8_linear_amx: the kernel may not use AMX tiles in this process");
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2,
              "int8_linear_amx: weight must be int8 [N / 16, Kp * 16]");
  const int64_t N = out_features;
  const int64_t tiles = weight.size(0);
  TORCH_CHECK(tiles == (N + kAmxCols - 1) / kAmxCols, "int8_linear_amx: ", tiles, " tiles for ", N, " outputs");
  const int64_t Kp = weight.size(1) / kAmxCols;
  TORCH_CHECK(Kp % kGroup == 0, "int8_linear_amx: the weight's inputs must be padded to ", kGroup);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == tiles * kAmxCols,
              "int8_linear_amx: bad scales");
  Rows r = prepare_rows("int8_linear_amx", x, Kp, N, bias, kAmxRows);  // (its group sums go unused)
  const int64_t M = r.M;
  if (M == 0) return r.y.reshape(r.out_shape);
  const at::Tensor wc = weight.contiguous(), sc = scales.contiguous();
  const int8_t* w = wc.data_ptr<int8_t>();
  const float* wsp = sc.data_ptr<float>();
  float* yp = r.y.data_ptr<float>();
  const int8_t* q = r.q.data();
  const float* xs = r.xs.data();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    amx_configure(std::min(M, kAmxRows));
    for (int64_t nt = t0; nt < t1; ++nt) {
      const int8_t* wt = w + nt * Kp * kAmxCols;
      if (M <= kAmxRows) {  // one tile of rows, configured for exactly M
        with_count<kAmxRows>(M, [&](auto R) {
          amx_int8_rows<R()>(wt, wsp + nt * kAmxCols, q, xs, r.bptr, yp, nt * kAmxCols, 0, N, Kp);
        });
        continue;
      }
      amx_passes(M, [&](int64_t m0, auto R0, auto R1) {
        amx_int8_pair<R0(), R1()>(wt, wsp + nt * kAmxCols, q, xs, r.bptr, yp, nt * kAmxCols, m0, N, Kp);
      });
    }
    _tile_release();
  });
  return r.y.reshape(r.out_shape);
}

#endif  // VERISPEC_AMX

// Whether this build and process run the AMX kernel (int4.py asks once).
bool int4_amx_ready() {
#if VERISPEC_AMX
  return amx_permitted();
#else
  return false;
#endif
}

at::Tensor int4_linear_impl(bool many, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                       const at::Tensor& offsets, const std::optional<at::Tensor>& bias,
                       int64_t out_features) {
  const int64_t N = out_features;
  const Int4Weights p = int4_weights("int4_linear", weight, scales, offsets, N, kColBlock);
  const int64_t blocks = p.units, groups = p.groups, Kp = p.Kp;
  Rows r = prepare_rows("int4_linear", x, Kp, N, bias);
  const int64_t M = r.M;
  if (M == 0) return r.y.reshape(r.out_shape);
  const uint8_t* w = p.w;
  const uint16_t *ws = p.ws, *wo = p.wo;
  const int8_t* q = r.q.data();
  const float *xs = r.xs.data(), *gsum = r.gsum.data(), *bptr = r.bptr;
  float* yp = r.y.data_ptr<float>();
#if VERISPEC_AVX512
  if (many) {
    // Threads split the channel tiles; a row's outputs never depend on M or on the other rows.
    const int64_t tiles = (blocks + kTileBlocks - 1) / kTileBlocks;
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      std::vector<uint8_t> W(Kp * kTile);
      std::vector<float> S(groups * kTile), O(groups * kTile);
      for (int64_t tile = t0; tile < t1; ++tile) {
        const int64_t b0 = tile * kTileBlocks, nblk = std::min(kTileBlocks, blocks - b0);
        unpack_tile(w, ws, wo, b0, nblk, groups, W.data(), S.data(), O.data());
        const int64_t n0 = b0 * kColBlock, nvalid = std::min<int64_t>(kTile, N - n0);
        for (int64_t m0 = 0; m0 < M; m0 += kWideRows)
          dispatch_wide(std::min(kWideRows, M - m0), W.data(), S.data(), O.data(), q, xs, gsum, bptr, yp, n0,
                        nvalid, m0, N, Kp);
      }
    });
    return r.y.reshape(r.out_shape);
  }
#endif  // with AVX2 only, prompt rows take the decode kernel below (bit-identical to decode rows)
  // Threads split the channel blocks only: which thread computes (m, n) never depends on M.
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t m0 = 0; m0 < M; m0 += kRowBlock)
        dispatch<kRowBlock>(std::min(kRowBlock, M - m0), w, ws, wo, q, xs, gsum, bptr, yp, nb, m0, N, Kp);
  });
  return r.y.reshape(r.out_shape);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                       const at::Tensor& offsets, const std::optional<at::Tensor>& bias,
                       int64_t out_features) {
  return int4_linear_impl(false, x, weight, scales, offsets, bias, out_features);
}

at::Tensor int4_linear_many(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                            const at::Tensor& offsets, const std::optional<at::Tensor>& bias,
                            int64_t out_features) {
  return int4_linear_impl(true, x, weight, scales, offsets, bias, out_features);
}

}  // namespace

TORCH_LIBRARY(verispec, m) {
  m.def("int4_linear(Tensor x, Tensor weight, Tensor scales, Tensor offsets, Tensor? bias, int out_features) -> Tensor");
  m.def("int4_linear_many(Tensor x, Tensor weight, Tensor scales, Tensor offsets, Tensor? bias, int out_features) -> Tensor");
  m.def("int4_amx_ready() -> bool", &int4_amx_ready);
#if VERISPEC_AMX
  m.def("int4_linear_amx(Tensor x, Tensor weight, Tensor scales, Tensor offsets, Tensor? bias, int out_features) -> Tensor");
  m.def("int8_linear_amx(Tensor x, Tensor weight, Tensor scales, Tensor? bias, int out_features) -> Tensor");
#endif
}

TORCH_LIBRARY_IMPL(verispec, CPU, m) {
  m.impl("int4_linear", int4_linear);
  m.impl("int4_linear_many", int4_linear_many);
#if VERISPEC_AMX
  m.impl("int4_linear_amx", int4_linear_amx);
  m.impl("int8_linear_amx", int8_linear_amx);
#endif
}
