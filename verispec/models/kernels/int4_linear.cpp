// 4-bit weight x 8-bit activation Linear for AVX-512 VNNI CPUs (verispec's int4 fast path).
//
// Why a kernel of our own: decoding is bound by the bytes of weights read per token, and the
// int4 kernels shipped in torch 2.13 for CPU dequantize to bfloat16 and are compute-bound here
// (42 ms for the 1.5B's Linears at 1 row, 148 ms at 8 rows, against 46 / 74 ms for the int8
// fbgemm path), so they read fewer bytes but gain nothing. This kernel keeps the products in
// integers (VNNI's u8 x s8 dot products into int32, as llama.cpp's q4 x q8 dot products do) and
// streams each weight block from memory once per call, reusing it from L1 for up to 8 activation
// rows. The per-row integer work, not the memory, is what grows with the rows: the whole 1.5B
// forward costs ~44 / 64 / 104 / 190 ms at 1 / 4 / 8 / 16 rows (NOTES.md has the layouts tried).
//
// Exact batch invariance: each output element (row m, channel n) is computed by one thread with
// the same sequence of operations whatever the number of rows in the call and wherever row m sits,
// so a token scores the same decoded alone, verified beside drafts or batched with other
// sequences. The build uses -ffp-contract=off so the compiler cannot fuse some multiply-adds in
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
#include <vector>

namespace {

constexpr int64_t kGroup = 64;
constexpr int64_t kRowBlock = 8;  // activation rows per pass over a weight block (register budget)
constexpr int64_t kPrefetch = 2048;  // bytes ahead in a thread's weight stream
constexpr int64_t kColBlock = 4;  // output channels per weight block: one per 128-bit lane
constexpr int64_t kGroupBytes = kColBlock * kGroup / 2;  // one block's group: 4 channels x kGroup nibbles
constexpr int64_t kVectors = kGroup / 32;  // 64-byte weight vectors per block and group

// Per-row symmetric int8 quantization of x [M, K] into q [M, Kp] (zero padded), with each row's
// scale and each group's sum of quantized activations (the offset term's factor, as a float: exact
// for these small integers, and the kernel then needs no conversion per group and row).
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t Kp, int8_t* q, float* scale,
                   float* gsum) {
  const int64_t groups = Kp / kGroup;
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::fmax(amax, std::fabs(row[k]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    scale[m] = amax / 127.f;
    int8_t* out = q + m * Kp;
    for (int64_t k = 0; k < K; ++k) {
      float v = std::nearbyint(row[k] * inv);
      v = std::fmin(127.f, std::fmax(-127.f, v));
      out[k] = static_cast<int8_t>(v);
    }
    for (int64_t k = K; k < Kp; ++k) out[k] = 0;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t sum = 0;
      for (int64_t b = 0; b < kGroup; ++b) sum += out[g * kGroup + b];
      gsum[m * groups + g] = static_cast<float>(sum);
    }
  }
}

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
  const int64_t groups = Kp / kGroup;
  const int64_t n0 = nb * kColBlock;
  const uint8_t* wb = w + nb * groups * kGroupBytes;
  const uint16_t* sb = ws + nb * groups * kColBlock;
  const uint16_t* ob = wo + nb * groups * kColBlock;
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
  for (int64_t r = 0; r < ROWS; ++r) {
    alignas(64) float lanes[16];
    alignas(64) float offs[16];
    _mm512_store_ps(lanes, acc[r]);
    _mm512_store_ps(offs, off[r]);
    for (int64_t j = 0; j < kColBlock && n0 + j < N; ++j) {
      const float* l = lanes + 4 * j;
      const float o = (offs[j] + offs[4 + j]) + (offs[8 + j] + offs[12 + j]);
      float v = xs[m0 + r] * (((l[0] + l[1]) + (l[2] + l[3])) + o);
      if (bias != nullptr) v = v + bias[n0 + j];
      y[(m0 + r) * N + n0 + j] = v;
    }
  }
}

// The row count is a template argument so that the accumulators live in registers.
template <typename... Args>
void dispatch(int64_t rows, Args... args) {
  switch (rows) {
    case 1: block<1>(args...); break;
    case 2: block<2>(args...); break;
    case 3: block<3>(args...); break;
    case 4: block<4>(args...); break;
    case 5: block<5>(args...); break;
    case 6: block<6>(args...); break;
    case 7: block<7>(args...); break;
    default: block<8>(args...); break;
  }
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                       const at::Tensor& offsets, const std::optional<at::Tensor>& bias,
                       int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "int4_linear: x must be float32");
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2,
              "int4_linear: weight must be uint8 [N / 4, groups * 256]");
  const int64_t N = out_features;
  const int64_t blocks = weight.size(0);
  TORCH_CHECK(blocks == (N + kColBlock - 1) / kColBlock, "int4_linear: ", blocks, " blocks for ", N, " outputs");
  const int64_t groups = weight.size(1) / kGroupBytes;
  const int64_t Kp = groups * kGroup;
  const int64_t K = x.size(-1);
  TORCH_CHECK(K <= Kp && K > Kp - kGroup, "int4_linear: x has ", K, " features, the weight ", Kp);
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.numel() == blocks * groups * kColBlock,
              "int4_linear: bad scales");
  TORCH_CHECK(offsets.scalar_type() == at::kHalf && offsets.numel() == blocks * groups * kColBlock,
              "int4_linear: bad offsets");
  const at::Tensor xc = x.reshape({-1, K}).contiguous();
  const int64_t M = xc.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y.reshape(out_shape);

  std::vector<int8_t> q(M * Kp);
  std::vector<float> xs(M);
  std::vector<float> gsum(M * groups);
  quantize_rows(xc.data_ptr<float>(), M, K, Kp, q.data(), xs.data(), gsum.data());

  const at::Tensor wc = weight.contiguous(), sc = scales.contiguous(), oc = offsets.contiguous();
  at::Tensor bc;
  const float* bptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    bc = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bc.numel() == N, "int4_linear: bias must have ", N, " elements");
    bptr = bc.data_ptr<float>();
  }
  const uint8_t* w = wc.data_ptr<uint8_t>();
  const auto* ws = reinterpret_cast<const uint16_t*>(sc.data_ptr<at::Half>());
  const auto* wo = reinterpret_cast<const uint16_t*>(oc.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  // Threads split the channel blocks only: which thread computes (m, n) never depends on M.
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t m0 = 0; m0 < M; m0 += kRowBlock)
        dispatch(std::min(kRowBlock, M - m0), w, ws, wo, q.data(), xs.data(), gsum.data(), bptr, yp,
                 nb, m0, N, Kp);
  });
  return y.reshape(out_shape);
}

}  // namespace

TORCH_LIBRARY(verispec, m) {
  m.def("int4_linear(Tensor x, Tensor weight, Tensor scales, Tensor offsets, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(verispec, CPU, m) { m.impl("int4_linear", int4_linear); }
