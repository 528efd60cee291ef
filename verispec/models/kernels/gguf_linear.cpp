// A Linear over a GGUF file's own quantized blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q3_K, Q4_K, Q5_K, Q6_K),
// for x86 CPUs with AVX-512 VNNI or AVX2 (+ FMA, F16C); a portable scalar build elsewhere (correct,
// slow: the native path is chosen by default only where a vector build is there).
//
// Why: the file's 4-6-bit blocks are what llama.cpp multiplies by. Running them as they are keeps
// llama.cpp's weights to the bit (no float32 copy, no second rounding) and reads ~4.5-6.6 bits per
// weight per token.
//
// Weight format (gguf_linear.py packs it from the blocks, exactly): output channels in tiles of 16;
// inputs in groups of G (32, or 16 for Q6_K). Every weight is w = S_g * c + O_g with an unsigned code c
// and, per channel and group, a scale S_g and offset O_g:
//   - "k" formats (Q3_K, Q4_K, Q5_K, Q6_K): S_g = D * sc_g and O_g = -(M * mn_g), with D, M float16 per
//     channel and super-block of 256 inputs (the file's own values; Q6_K's M = 32 D, Q3_K's 4 D) and sc_g, mn_g
//     int8 per channel and group (the products are exact in float32: sc and mn have at most 8 bits;
//     float16 rather than float32 D and M cut the 1.5B's bytes a token from 1024 to 1000 MB);
//   - "legacy" formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): S_g and O_g float16 per channel and group.
// Codes: 4 low bits as nibbles, per tile and group G/8 vectors of 64 bytes whose byte 4c + j holds
// channel c's input 8t + j (low nibble) and 8t + 4 + j (high); then, for 5- and 6-bit codes, one
// more 64-byte vector per group whose byte 4c + j holds the P high bits (P = 1 or 2) of the codes of
// unpacked vector v = 0 .. G/4 - 1 (input 4v + j) at bits P v .. P v + P - 1: one shift, mask and or
// per unpacked vector puts them in place (llama.cpp's Q6_K keeps its 2 high bits the same way).
// That vector follows its group's nibbles, so a tile's codes are one stream: held in an array of
// their own, the high bits were a second stream that the products waited on from memory (a Zen 5
// core's 8-row Q6_K products ~150 G multiply-adds/s from memory against ~260 with the weights in
// cache; ~230 with the high bits in line).
// Q8_0's codes (q + 128) are whole bytes instead: G/4 vectors whose byte 4c + j is input 4v + j.
// Q6_K's and Q3_K's offsets need no int8 of their own (mn = sc): their group scales hold sc only, and
// an int32 per channel and super-block, kcorr = -128 sum_g sc_g sum_{i in g} (c_i - bias) (bias 32 and 4),
// lets the AVX-512 tiles multiply signed codes with no offset term (tile_avx512_k).
// Q3_K's codes (q + 4, 0..7) are nibbles with no bit planes, in groups of 16 as Q6_K's.
//
// Activations are quantized per row and unit U of inputs (256 for "k" formats, G for legacy ones), as
// llama.cpp's Q8_K and Q8_0: a = round(x * 127 / max|x|) with scale xs (vectorized: one call's rows
// are quantized once, and q/k/v or gate/up fused into one call share them). Then, per row m and channel n,
//   y[m, n] = sum_u sum_{g in u} (xs_u * S_g) * (sum_i c_i * a_i) + (xs_u * O_g) * (sum_i a_i) + bias[n].
// Each 32-bit lane of a product vector holds one channel (16 channels x 4 inputs per VNNI product,
// against the row's 4 activation bytes broadcast); unpacking the codes is done once per tile for every
// row. Legacy formats apply S_g and O_g in float per group. "k" formats keep whole super-blocks in
// integers, as llama.cpp's q*_K x q8_K dot products do: per row and group the products, the int8
// group scale sc_g multiplied in (AVX-512: one multiply and one add; AVX2: in the madd that sums
// the pairs), the offsets' sum_g mn_g * sum_g(a) as int16 pair products, and one conversion to float
// per super-block. On a Zen 4 that took a 32-row Q4_K product from 1.69 to 1.41 ms and a 32-row Q6_K
// LM head from 34.9 to 31.9 ms, and top-1 agreement with llama.cpp from 98.6% to 98.9%.
//
// AVX2 without VNNI multiplies u8 x s8 pairs into int16 (maddubs) and widens them with a second multiply
// (madd), both on the same two pipes of a Zen 3. Its tiles therefore add runs of pair sums in int16
// before one madd (a Q4 group of 32 inputs: 9 multiplies a row instead of 16; see int16_run), and keep
// one group's unpacked codes in registers while the rows take turns, so that a row's sums are all
// that it keeps live (with every row's sums live, GCC spilled them around each product); the "k"
// tiles take both half tiles at once, so one broadcast of a row's activations feeds two products.
// On a real Zen 3 (EPYC, 2 cores): one core's 8-row Q4_K products 37-61 -> 74-78 G multiply-adds/s
// with the runs, and on to ~97 with both halves at once; the outputs stayed bit-identical each time
// (same integer sums, same float operations). Where the CPU has AVX-VNNI (256-bit vpdpbusd, built
// with -mavxvnni) the same tiles multiply with it, a run being a whole group (int16_run), with the
// same bits: on a Zen 5 built that way, the 1.5B's 8-token step 75-77 -> 69-71 ms, 16 tokens 138-141
// -> 124-127.
//
// Exact batch invariance: each output element is computed by one thread with the same sequence of
// operations whatever the number of rows in the call and wherever its row sits (threads split the
// tiles; rows only repeat the same per-row sequence), so a token scores the same decoded alone or
// verified beside drafts. Built with -ffp-contract=off (native.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define VERISPEC_GGUF_AVX512 1
#define VERISPEC_GGUF_AVX2 0
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define VERISPEC_GGUF_AVX512 0
#define VERISPEC_GGUF_AVX2 1
#else
#define VERISPEC_GGUF_AVX512 0
#define VERISPEC_GGUF_AVX2 0
#endif

namespace {

constexpr int64_t kTile = 16;      // output channels per tile: one per 32-bit lane
// Activation rows per pass over a tile: what the accumulators leave of the vector registers with
// AVX-512 (32); the AVX2 tiles keep a group's codes in registers and take the rows one by one.
constexpr int64_t kRowBlock = 8;
// How far ahead in a thread's stream of codes the AVX-512 tiles ask for the weights (bytes). An 8-row
// pass spends ~30 cycles on a Q4_K group's 256 bytes, so 1 KB ahead asked for lines ~130 cycles
// before use, well short of a trip to memory, and the products waited on it: on a Zen 5 (2 cores),
// one core's 8-row Q4_K products from memory went 208 -> 338 G multiply-adds/s at 8 KB (335 at 16 KB;
// 356 with the weights in cache) and 1-row ones 68 -> 84 G/s; all decoder products of the 1.5B on
// 2 threads, 8 rows, 26.6-29.5 -> 21.3-23.2 ms (alternated runs). On a Zen 4, 1-4 KB made no
// difference beyond noise.
constexpr int64_t kPrefetch = 8192;

// Formats, as gguf_linear.py numbers them.
enum Format : int64_t { LEG4 = 0, LEG5 = 1, LEG8 = 2, K4 = 3, K5 = 4, K6 = 5, K3 = 6 };

struct Spec {
  int64_t group, unit, planes;
  bool bytes, kq;
  int64_t iscales;  // int8 group scales per channel and group ("k": sc and mn, or sc alone)
  // Symmetric "k" formats (Q6_K, Q3_K: mn = sc): w = D sc (c - bias). Their AVX-512 tiles multiply the
  // signed c - bias by q + 128 and need no offset term (see tile_avx512_k).
  int64_t bias = 0;
  bool symmetric() const { return kq && iscales == 1; }
};

Spec spec_of(int64_t fmt) {
  switch (fmt) {
    case LEG4: return {32, 32, 0, false, false, 0};
    case LEG5: return {32, 32, 1, false, false, 0};
    case LEG8: return {32, 32, 0, true, false, 0};
    case K4: return {32, 256, 0, false, true, 2};
    case K5: return {32, 256, 1, false, true, 2};
    case K6: return {16, 256, 2, false, true, 1, 32};
    case K3: return {16, 256, 0, false, true, 1, 4};
  }
  TORCH_CHECK(false, "gguf_linear: unknown format ", fmt);
}

// Bytes per tile and group: of the low bits (or whole bytes), of the high bits, and both (the stride).
inline int64_t code_bytes(const Spec& s) { return s.bytes ? kTile * s.group : kTile * s.group / 2; }
inline int64_t plane_bytes(const Spec& s) { return s.planes ? 64 : 0; }
inline int64_t group_bytes(const Spec& s) { return code_bytes(s) + plane_bytes(s); }

// Quantized activations: q [M, K] int8, per row and unit the scale xs, per row and group the sum of
// the codes (|sum| <= 32 x 127; the "k" tiles take it as it is, the float tiles times xs).
struct Acts {
  std::vector<int8_t> q;
  std::vector<uint8_t> qu;  // q + 128: the unsigned operand where the codes are signed (symmetric "k" tiles)
  std::vector<float> xs;
  std::vector<int16_t> sums;
  // The offset term's factor of row m's group g in unit u: the group's code sum times xs.
  float scaled_sum(int64_t m, int64_t groups, int64_t g, int64_t units, int64_t u) const {
    return static_cast<float>(sums[m * groups + g]) * xs[m * units + u];
  }
};

// One unit's codes: a = round(x * inv) (ties to even) within [-127, 127], and per group their sum.
// The vector builds compute the same IEEE products and roundings as the scalar loop, 16 or 8 at a time.
// `qu`, where given (AVX-512, symmetric formats), gets q + 128 as well.
void quantize_unit(const float* xu, const Spec& s, float inv, int8_t* q, uint8_t* qu, int16_t* sums) {
  const int64_t per_unit = s.unit / s.group;
#if VERISPEC_GGUF_AVX512
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (int64_t g = 0; g < per_unit; ++g) {
    __m512i sum = _mm512_setzero_si512();
    for (int64_t i = g * s.group; i < (g + 1) * s.group; i += 16) {
      __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xu + i), vinv));
      c = _mm512_min_epi32(_mm512_max_epi32(c, lo), hi);
      const __m128i bytes = _mm512_cvtepi32_epi8(c);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), bytes);
      if (qu != nullptr) _mm_storeu_si128(reinterpret_cast<__m128i*>(qu + i), _mm_xor_si128(bytes, _mm_set1_epi8(-128)));
      sum = _mm512_add_epi32(sum, c);
    }
    sums[g] = static_cast<int16_t>(_mm512_reduce_add_epi32(sum));
  }
#elif VERISPEC_GGUF_AVX2
  const __m256 vinv = _mm256_set1_ps(inv);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  for (int64_t g = 0; g < per_unit; ++g) {
    __m256i sum = _mm256_setzero_si256();
    for (int64_t i = g * s.group; i < (g + 1) * s.group; i += 8) {
      __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xu + i), vinv));
      c = _mm256_min_epi32(_mm256_max_epi32(c, lo), hi);
      alignas(32) int32_t lanes[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), c);
      for (int64_t j = 0; j < 8; ++j) q[i + j] = static_cast<int8_t>(lanes[j]);
      sum = _mm256_add_epi32(sum, c);
    }
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), sum);
    sums[g] = static_cast<int16_t>(lanes[0] + lanes[1] + lanes[2] + lanes[3] + lanes[4] + lanes[5] + lanes[6] + lanes[7]);
  }
#else
  for (int64_t g = 0; g < per_unit; ++g) {
    int32_t sum = 0;
    for (int64_t i = g * s.group; i < (g + 1) * s.group; ++i) {
      float v = std::nearbyint(xu[i] * inv);
      v = std::fmin(127.f, std::fmax(-127.f, v));
      q[i] = static_cast<int8_t>(v);
      sum += q[i];
    }
    sums[g] = static_cast<int16_t>(sum);
  }
#endif
}

float max_abs(const float* x, int64_t n) {
#if VERISPEC_GGUF_AVX512
  __m512 m = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
  return _mm512_reduce_max_ps(m);
#elif VERISPEC_GGUF_AVX2
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float amax = 0.f;
  for (float v : lanes) amax = std::fmax(amax, v);
  return amax;
#else
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  return amax;
#endif
}

void quantize_row(const float* x, int64_t K, const Spec& s, int8_t* q, uint8_t* qu, float* xs, int16_t* gsums) {
  const int64_t units = K / s.unit, per_unit = s.unit / s.group;
  for (int64_t u = 0; u < units; ++u) {
    const float* xu = x + u * s.unit;
    const float amax = max_abs(xu, s.unit);
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    const float scale = amax / 127.f;
    xs[u] = scale;
    quantize_unit(xu, s, inv, q + u * s.unit, qu != nullptr ? qu + u * s.unit : nullptr, gsums + u * per_unit);
  }
}

Acts quantize_rows(const float* x, int64_t M, int64_t K, const Spec& s) {
  Acts a;
  const int64_t units = K / s.unit, groups = K / s.group;
  a.q.resize(M * K);
  a.xs.resize(M * units);
  a.sums.resize(M * groups);
  if (VERISPEC_GGUF_AVX512 && s.symmetric()) a.qu.resize(M * K);
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      quantize_row(x + m * K, K, s, a.q.data() + m * K, a.qu.empty() ? nullptr : a.qu.data() + m * K,
                   a.xs.data() + m * units, a.sums.data() + m * groups);
  });
  return a;
}

// A packed weight's arrays and sizes.
struct Weights {
  const uint8_t* codes;    // [tiles, groups, code bytes + high-bit bytes]
  const uint16_t* kscale;  // "k": [tiles, units, 2, 16] (D, M) float16
  const int8_t* kint;      // "k": [tiles, groups, 2 or 1, 16] (sc, mn or sc alone)
  const int32_t* kcorr;    // symmetric "k": [tiles, units, 16] -128 sum_g sc_g sum_{i in g} (c_i - bias)
  const uint16_t* lscale;  // legacy: [tiles, groups, 2, 16] (S, O) float16
  int64_t K, N, groups, units;
};

// A "k" format's layout constants and one tile's arrays (both vector builds' integer tiles).
template <int64_t G, int64_t P>
struct KLayout {
  static constexpr int64_t kVecs = G / 4;  // 4-input code vectors per group
  static constexpr int64_t kPerUnit = 256 / G;
  static constexpr int64_t kCodeBytes = kTile * G / 2;
  static constexpr int64_t kHighBytes = P ? 64 : 0;
  static constexpr int64_t kGroupBytes = kCodeBytes + kHighBytes;  // a group's high bits follow its nibbles
  static constexpr int64_t kIScales = G == 16 ? 1 : 2;  // Q6_K, Q3_K: mn = sc
  const uint8_t* codes;
  const int8_t* iscales;
  KLayout(const Weights& w, int64_t tile)
      : codes(w.codes + tile * w.groups * kGroupBytes), iscales(w.kint + tile * w.groups * kIScales * kTile) {}
};

inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

// Scalar reference of the per-tile products (any CPU): the same sums in the same order per row as
// the vector build would be too much to promise, so the scalar build is its own, consistent path.
void tile_scalar(const Weights& w, const Spec& s, const Acts& a, const float* bias, float* y, int64_t tile,
                 int64_t m0, int64_t rows) {
  const int64_t per_unit = s.unit / s.group;
  const uint8_t* codes = w.codes + tile * w.groups * group_bytes(s);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t m = m0 + r;
    for (int64_t c = 0; c < kTile; ++c) {
      const int64_t n = tile * kTile + c;
      if (n >= w.N) break;
      float acc = 0.f;
      for (int64_t g = 0; g < w.groups; ++g) {
        const int64_t u = g / per_unit;
        float S, O;
        if (s.kq) {
          const uint16_t* dm = w.kscale + ((tile * w.units + u) * 2) * kTile;
          const int8_t* sm = w.kint + ((tile * w.groups + g) * s.iscales) * kTile;
          S = half_to_float(dm[c]) * static_cast<float>(sm[c]);
          O = -(half_to_float(dm[kTile + c]) * static_cast<float>(sm[(s.iscales - 1) * kTile + c]));
        } else {
          const uint16_t* so = w.lscale + ((tile * w.groups + g) * 2) * kTile;
          S = half_to_float(so[c]);
          O = half_to_float(so[kTile + c]);
        }
        const uint8_t* cg = codes + g * group_bytes(s);
        const uint8_t* pg = cg + code_bytes(s);
        const int8_t* ag = a.q.data() + m * w.K + g * s.group;
        int32_t dot = 0;
        for (int64_t i = 0; i < s.group; ++i) {
          int32_t code;
          if (s.bytes) {
            code = cg[(i / 4) * 64 + 4 * c + i % 4];
          } else {
            const uint8_t byte = cg[(i / 8) * 64 + 4 * c + i % 4];
            code = (i % 8) < 4 ? (byte & 15) : (byte >> 4);
            if (s.planes) code |= ((pg[4 * c + i % 4] >> (s.planes * (i / 4))) & ((1 << s.planes) - 1)) << 4;
          }
          dot += code * ag[i];
        }
        const float xs = a.xs[m * w.units + u];
        acc += static_cast<float>(dot) * (xs * S) + O * a.scaled_sum(m, w.groups, g, w.units, u);
      }
      y[m * w.N + n] = acc + (bias != nullptr ? bias[n] : 0.f);
    }
  }
}

#if VERISPEC_GGUF_AVX512
// Bits P v .. P v + P - 1 of each byte of `high`, moved to bits 4 .. 4 + P - 1 (16-bit shifts: what
// crosses into a neighbouring byte lands outside the mask).
template <int64_t P, int64_t V>
inline __m512i high_bits(__m512i high) {
  const __m512i mask = _mm512_set1_epi8(static_cast<char>(((1 << P) - 1) << 4));
  constexpr int64_t at = P * V;
  if constexpr (at < 4) return _mm512_and_si512(_mm512_slli_epi16(high, 4 - at), mask);
  if constexpr (at == 4) return _mm512_and_si512(high, mask);
  return _mm512_and_si512(_mm512_srli_epi16(high, at - 4), mask);
}

template <int64_t P, int64_t V, int64_t N>
inline void add_high_bits(__m512i (&wv)[N], __m512i high) {
  if constexpr (V < N) {
    wv[V] = _mm512_or_si512(wv[V], high_bits<P, V>(high));
    add_high_bits<P, V + 1>(wv, high);
  }
}

// A group's G/4 code vectors of 4 low bits plus P high bits from the planes.
template <int64_t G, int64_t P>
inline void unpack_group(const uint8_t* cg, const uint8_t* high, __m512i (&wv)[G / 4]) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t t = 0; t < G / 8; ++t) {
    const __m512i bytes = _mm512_loadu_si512(cg + 64 * t);
    wv[2 * t] = _mm512_and_si512(bytes, low4);
    wv[2 * t + 1] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
  }
  if constexpr (P > 0) add_high_bits<P, 0>(wv, _mm512_loadu_si512(high));
}

// A symmetric "k" group's G/4 code vectors minus the format's bias (Q6_K 32, Q3_K 4), as signed bytes.
// With GFNI one affine bit-matrix product per vector moves a field into place and writes its sign bits
// (a 6-bit code c: bits 0-4 of c - 32 are c's, bits 5-7 are all the complement of c's bit 5); without
// it, the codes as unpack_group gives them, minus the bias.
#if defined(__GFNI__)
// The matrix whose affine product sets bit `to` of each byte to bit `from` (OR several for several bits).
constexpr uint64_t gf_bit(int to, int from) { return (uint64_t{1} << from) << (8 * (7 - to)); }
constexpr uint64_t gf_sign(int from, int lowest) {  // bits lowest .. 7 <- bit `from`
  return lowest > 7 ? 0 : gf_bit(lowest, from) | gf_sign(from, lowest + 1);
}
template <int64_t V>  // Q6_K: vector V's 2 high bits (bits 2V, 2V + 1 of the high-bit byte) to bits 4 .. 7
inline __m512i q6_high(__m512i high) {
  return _mm512_gf2p8affine_epi64_epi8(high, _mm512_set1_epi64(gf_bit(4, 2 * V) | gf_sign(2 * V + 1, 5)), 0xE0);
}
#endif

template <int64_t G, int64_t P>
inline void unpack_signed(const uint8_t* cg, __m512i (&wv)[G / 4]) {
  static_assert(G == 16 && (P == 2 || P == 0), "symmetric k formats: Q6_K and Q3_K");
#if defined(__GFNI__)
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  if constexpr (P == 2) {
    const __m512i high = _mm512_loadu_si512(cg + kTile * G / 2);
    const __m512i nib_high = _mm512_set1_epi64(gf_bit(0, 4) | gf_bit(1, 5) | gf_bit(2, 6) | gf_bit(3, 7));
    for (int64_t t = 0; t < 2; ++t) {
      const __m512i bytes = _mm512_loadu_si512(cg + 64 * t);
      const __m512i h0 = t == 0 ? q6_high<0>(high) : q6_high<2>(high);
      const __m512i h1 = t == 0 ? q6_high<1>(high) : q6_high<3>(high);
      wv[2 * t] = _mm512_ternarylogic_epi32(bytes, h0, low4, 0xEC);  // (bytes & low4) | h0
      wv[2 * t + 1] = _mm512_or_si512(_mm512_gf2p8affine_epi64_epi8(bytes, nib_high, 0), h1);
    }
  } else {  // Q3_K: codes q + 4 (0 .. 7) in nibbles; q = bits 0-1, then the complement of bit 2
    const __m512i lo = _mm512_set1_epi64(gf_bit(0, 0) | gf_bit(1, 1) | gf_sign(2, 2));
    const __m512i hi = _mm512_set1_epi64(gf_bit(0, 4) | gf_bit(1, 5) | gf_sign(6, 2));
    for (int64_t t = 0; t < 2; ++t) {
      const __m512i bytes = _mm512_loadu_si512(cg + 64 * t);
      wv[2 * t] = _mm512_gf2p8affine_epi64_epi8(bytes, lo, 0xFC);
      wv[2 * t + 1] = _mm512_gf2p8affine_epi64_epi8(bytes, hi, 0xFC);
    }
    (void)low4;
  }
#else
  unpack_group<G, P>(cg, cg + kTile * G / 2, wv);
  const __m512i bias = _mm512_set1_epi8(P == 2 ? 32 : 4);
  for (int64_t v = 0; v < G / 4; ++v) wv[v] = _mm512_sub_epi8(wv[v], bias);
#endif
}

// One tile (16 channels) of a legacy format for rows [m0, m0 + ROWS): G/4 weight vectors per group,
// unpacked once and multiplied with every row's activations. The rows' integer sums are separate
// chains, interleaved, so the products' latency overlaps.
template <int64_t G, int64_t P, bool BYTES, int64_t ROWS>
void tile_avx512(const Weights& w, const Acts& a, const float* bias, float* y, int64_t tile, int64_t m0) {
  constexpr int64_t kVecs = G / 4;  // unpacked 64-byte weight vectors per group
  constexpr int64_t kCodeBytes = BYTES ? kTile * G : kTile * G / 2;
  constexpr int64_t kGroupBytes = kCodeBytes + (P ? 64 : 0);
  const int64_t groups = w.groups, K = w.K;
  const uint8_t* codes = w.codes + tile * groups * kGroupBytes;
  __m512 acc[ROWS];
  for (int64_t r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  const int8_t* arow[ROWS];
  for (int64_t r = 0; r < ROWS; ++r) arow[r] = a.q.data() + (m0 + r) * K;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* cg = codes + g * kGroupBytes;
    for (int64_t line = 0; line < kGroupBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(cg + kPrefetch + line), _MM_HINT_T0);
    const uint16_t* so = w.lscale + ((tile * groups + g) * 2) * kTile;
    const __m512 S = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(so)));
    const __m512 O = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(so + kTile)));
    __m512i wv[kVecs];
    if constexpr (BYTES) {
      for (int64_t v = 0; v < kVecs; ++v) wv[v] = _mm512_loadu_si512(cg + 64 * v);
    } else {
      unpack_group<G, P>(cg, cg + kCodeBytes, wv);
    }
    __m512i d[ROWS];
    for (int64_t r = 0; r < ROWS; ++r) d[r] = _mm512_setzero_si512();
    for (int64_t v = 0; v < kVecs; ++v)
      for (int64_t r = 0; r < ROWS; ++r) {
        int32_t four;
        std::memcpy(&four, arow[r] + g * G + 4 * v, 4);
        d[r] = _mm512_dpbusd_epi32(d[r], wv[v], _mm512_set1_epi32(four));
      }
    for (int64_t r = 0; r < ROWS; ++r) {
      const int64_t m = m0 + r;
      const __m512 sx = _mm512_mul_ps(S, _mm512_set1_ps(a.xs[m * w.units + g]));  // legacy: unit = group
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[r]), sx, acc[r]);
      acc[r] = _mm512_fmadd_ps(O, _mm512_set1_ps(a.scaled_sum(m, groups, g, w.units, g)), acc[r]);
    }
  }
  const int64_t n0 = tile * kTile;
  const int64_t valid = std::min<int64_t>(kTile, w.N - n0);
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
  const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  for (int64_t r = 0; r < ROWS; ++r) _mm512_mask_storeu_ps(y + (m0 + r) * w.N + n0, mask, _mm512_add_ps(acc[r], b));
}


// "k" formats (Q4_K, Q5_K, Q6_K) as llama.cpp's q*_K x q8_K dot products do: integer sums over a
// whole super-block, one conversion to float per super-block and row. Per row and group only the
// G/4 VNNI products, one multiply by the group's int8 scale and one add remain; per super-block the
// offset term sum_g mn_g * sum_g(a) takes one int16 pair product per two groups (vpdpwssd), then
//   y += (D * xs_u) * float(sum_g sc_g * dot_g) - (M * xs_u) * float(sum_g mn_g * sum_g(a)).
// All integer sums are exact (|sum_g sc_g dot_g| < 2^31 for every "k" type's code and scale range).
// Symmetric formats (Q6_K, Q3_K: mn = sc, w = D sc (c - bias)) drop the offset term: their codes are
// unpacked as signed c - bias and multiplied by the unsigned q + 128, and each super-block's sums
// start at the packer's -128 sum_g sc_g sum(c - bias), so that they end at sum_g sc_g sum(q (c - bias))
// (every partial sum under 4.1e8 in magnitude for Q6_K), llama.cpp's own integer sum, and
//   y += (D * xs_u) * float(sum_g sc_g sum(q (c - bias))).
// The offset term's 1 product per 8 of the codes' went with it: 8-row Q6_K products with the weights
// in cache 10-12% sooner on a Zen 5 (from memory, ~2% more bytes: the corrections).
template <int64_t G, int64_t P, int64_t ROWS>
void tile_avx512_k(const Weights& w, const Acts& a, const float* bias, float* y, int64_t tile, int64_t m0) {
  using L = KLayout<G, P>;
  constexpr bool kSym = L::kIScales == 1;  // Q6_K, Q3_K: signed codes, no offset term
  const L at(w, tile);
  __m512 acc[ROWS];
  for (int64_t r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  const uint8_t* arow[ROWS];  // the rows' activation bytes: q (signed), or q + 128 against signed codes
  for (int64_t r = 0; r < ROWS; ++r)
    arow[r] = kSym ? a.qu.data() + (m0 + r) * w.K : reinterpret_cast<const uint8_t*>(a.q.data()) + (m0 + r) * w.K;
  for (int64_t u = 0; u < w.units; ++u) {
    __m512i isum[ROWS];
    const __m512i start = kSym ? _mm512_loadu_si512(w.kcorr + (tile * w.units + u) * kTile) : _mm512_setzero_si512();
    for (int64_t r = 0; r < ROWS; ++r) isum[r] = start;
    for (int64_t j = 0; j < L::kPerUnit; ++j) {
      const int64_t g = u * L::kPerUnit + j;
      const uint8_t* cg = at.codes + g * L::kGroupBytes;
      for (int64_t line = 0; line < L::kGroupBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(cg + kPrefetch + line), _MM_HINT_T0);
      const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at.iscales + g * L::kIScales * kTile)));
      __m512i wv[L::kVecs];
      if constexpr (kSym)
        unpack_signed<G, P>(cg, wv);
      else
        unpack_group<G, P>(cg, cg + L::kCodeBytes, wv);
      __m512i d[ROWS];
      for (int64_t r = 0; r < ROWS; ++r) d[r] = _mm512_setzero_si512();
      for (int64_t v = 0; v < L::kVecs; ++v)
        for (int64_t r = 0; r < ROWS; ++r) {
          int32_t four;
          std::memcpy(&four, arow[r] + g * G + 4 * v, 4);
          if constexpr (kSym)  // unsigned q + 128 times signed c - bias
            d[r] = _mm512_dpbusd_epi32(d[r], _mm512_set1_epi32(four), wv[v]);
          else  // unsigned c times signed q
            d[r] = _mm512_dpbusd_epi32(d[r], wv[v], _mm512_set1_epi32(four));
        }
      for (int64_t r = 0; r < ROWS; ++r) isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(d[r], sc));
    }
    const uint16_t* dm = w.kscale + ((tile * w.units + u) * 2) * kTile;
    const __m512 D = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm)));
    for (int64_t r = 0; r < ROWS; ++r) {
      const __m512 xs = _mm512_set1_ps(a.xs[(m0 + r) * w.units + u]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(D, xs), acc[r]);
    }
    if constexpr (!kSym) {
      // The offset term, after the unit's products: with its sums live beside theirs (products, group
      // sums, code vectors: 24 registers for 8 rows) GCC spilled in the product loop. Same integer sums,
      // so the same bits; one core's 8-row Q4_K products on a Zen 5 ~300 -> ~330 G multiply-adds/s
      // from memory (314 -> 348 in L2), 64 rows on 2 threads 600-607 -> 652-672.
      // vpermw index: int16 lane 2c <- element c (group 2p's mn), 2c + 1 <- element 16 + c (group 2p + 1's).
      alignas(64) static constexpr int16_t kPairIndex[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                             8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
      const __m512i pairs = _mm512_load_si512(kPairIndex);
      __m512i osum[ROWS];
      for (int64_t r = 0; r < ROWS; ++r) osum[r] = _mm512_setzero_si512();
      for (int64_t j = 1; j < L::kPerUnit; j += 2) {  // groups g - 1 and g
        const int64_t g = u * L::kPerUnit + j;
        const int8_t* mn = at.iscales + (g - 1) * L::kIScales * kTile + (L::kIScales - 1) * kTile;
        const __m256i both = _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mn + L::kIScales * kTile)),
                                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(mn)));
        const __m512i mnp = _mm512_permutexvar_epi16(pairs, _mm512_cvtepi8_epi16(both));
        for (int64_t r = 0; r < ROWS; ++r) {
          int32_t two;
          std::memcpy(&two, a.sums.data() + (m0 + r) * w.groups + g - 1, 4);
          osum[r] = _mm512_dpwssd_epi32(osum[r], mnp, _mm512_set1_epi32(two));
        }
      }
      const __m512 Mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + kTile)));
      for (int64_t r = 0; r < ROWS; ++r) {
        const __m512 xs = _mm512_set1_ps(a.xs[(m0 + r) * w.units + u]);
        acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(osum[r]), _mm512_mul_ps(Mv, xs), acc[r]);
      }
    }
  }
  const int64_t n0 = tile * kTile;
  const int64_t valid = std::min<int64_t>(kTile, w.N - n0);
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
  const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  for (int64_t r = 0; r < ROWS; ++r) _mm512_mask_storeu_ps(y + (m0 + r) * w.N + n0, mask, _mm512_add_ps(acc[r], b));
}

#elif VERISPEC_GGUF_AVX2
// Code vectors whose maddubs pair sums (u8 code x s8 activation, |a| <= 127) add up in int16 before
// one madd_epi16 widens them: sum <= run x 2 x max code x 127 < 2^15 keeps the sum exact, so the
// int32 totals are those of a madd per vector. Q4 codes allow 8 vectors (a 32-input group), 5-bit 4,
// 6-bit 2; Q8_0's signed bytes 1. Zen 3 issues maddubs and madd on the same two pipes, so 4-bit
// groups take 9 multiplies per row instead of 16.
//
// With AVX-VNNI (256-bit vpdpbusd: Intel's 12th-14th generation Core, which have no AVX-512; Zen 5)
// one instruction multiplies and sums 4 pairs into int32, so a run is a whole group and a product
// is one operation instead of two; the integer sums are the same, so the outputs are the same bits.
#if defined(__AVXVNNI__)
constexpr bool kAvxVnni = true;
#else
constexpr bool kAvxVnni = false;
#endif

template <int64_t P, bool BYTES, int64_t VECS>
constexpr int64_t int16_run() {
  if (kAvxVnni) return VECS;
  const int64_t per_vec = BYTES ? 2 * 128 * 127 : 2 * ((16 << P) - 1) * 127;
  const int64_t run = 32767 / per_vec;
  return run >= VECS ? VECS : run;
}

// Code vectors FIRST .. FIRST + N - 1 of one half tile's (8 channels') group: 4 low bits from the
// nibbles at `cg`, plus P high bits from the plane at `high` (P > 0; unread, may be null, for P = 0).
template <int64_t G, int64_t P, int64_t FIRST, int64_t N>
inline void unpack_vecs_avx2(const uint8_t* cg, const uint8_t* high, __m256i (&wv)[N]) {
  static_assert(FIRST + N <= G / 4, "a group has G / 4 code vectors");
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i high_mask = _mm256_set1_epi8(static_cast<char>(((1 << P) - 1) << 4));
  __m256i planes = _mm256_setzero_si256();
  if constexpr (P > 0) planes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(high));
  for (int64_t i = 0; i < N; ++i) {
    const int64_t v = FIRST + i;
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cg + 64 * (v / 2)));
    wv[i] = _mm256_and_si256(v % 2 ? _mm256_srli_epi16(bytes, 4) : bytes, low4);
    if constexpr (P > 0) {
      const int64_t at = P * v;
      const __m256i moved = at <= 4 ? _mm256_sll_epi16(planes, _mm_cvtsi64_si128(4 - at))
                                    : _mm256_srl_epi16(planes, _mm_cvtsi64_si128(at - 4));
      wv[i] = _mm256_or_si256(wv[i], _mm256_and_si256(moved, high_mask));
    }
  }
}

// Each 32-bit lane's value (a sign-extended int8) in both of its int16 halves: the madd_epi16
// factor that multiplies both pair sums of a channel by it (with AVX-VNNI: the int32 lanes as they are).
inline __m256i int16_pairs(__m256i v32) {
  if constexpr (kAvxVnni) return v32;
  return _mm256_or_si256(_mm256_and_si256(v32, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(v32, 16));
}

// A run's sums plus one code vector's products with 4 broadcast activations: int16 pair sums
// (maddubs), or with AVX-VNNI int32 sums of four.
inline __m256i add_products(__m256i run, __m256i codes, __m256i acts) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(run, codes, acts);
#else
  return _mm256_add_epi16(run, _mm256_maddubs_epi16(codes, acts));
#endif
}

// A finished run's sums in int32, each channel's times `factor` (int16_pairs of it): one madd, or
// with AVX-VNNI (int32 sums already) one multiply, none where the factor is 1.
inline __m256i widen_run(__m256i run, __m256i factor, bool ones) {
  if constexpr (kAvxVnni) return ones ? run : _mm256_mullo_epi32(run, factor);
  return _mm256_madd_epi16(run, factor);
}

// A legacy format's tile with AVX2 (no VNNI): each half of 8 channels at a time, a group's code vectors
// unpacked once into registers and each row walking them (as the "k" tile below): u8 x s8 products
// summed in pairs into int16 (maddubs), runs of them in int16 and then into int32 (madd), as llama.cpp's
// AVX2 dot products do. Q8_0's byte codes run signed: q = c - 128 against the activations with q's
// signs (|q| x sign(a, q), llama.cpp's trick), which is exact and leaves no offset term (O = -128 S).
template <int64_t G, int64_t P, bool BYTES, int64_t ROWS>
void tile_avx2(const Weights& w, const Acts& a, const float* bias, float* y, int64_t tile, int64_t m0) {
  constexpr int64_t kVecs = G / 4;
  constexpr int64_t kRun = int16_run<P, BYTES, kVecs>();
  static_assert(kVecs % kRun == 0, "runs split a group evenly");
  constexpr int64_t kCodeBytes = BYTES ? kTile * G : kTile * G / 2;
  constexpr int64_t kGroupBytes = kCodeBytes + (P ? 64 : 0);
  const int64_t groups = w.groups, K = w.K;
  const uint8_t* codes = w.codes + tile * groups * kGroupBytes;
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* arow[ROWS];
  for (int64_t r = 0; r < ROWS; ++r) arow[r] = a.q.data() + (m0 + r) * K;
  for (int64_t h = 0; h < 2; ++h) {
    const int64_t n0 = tile * kTile + 8 * h;
    if (n0 >= w.N) break;
    __m256 acc[ROWS];
    for (int64_t r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* group = codes + g * kGroupBytes;
      const uint8_t* cg = group + 32 * h;
      const uint16_t* so = w.lscale + ((tile * groups + g) * 2) * kTile + 8 * h;
      const __m256 S = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(so)));
      const __m256 O = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(so + kTile)));
      __m256i wv[kVecs];  // the unsigned factor of maddubs: codes, or |q| for Q8_0
      __m256i qv[BYTES ? kVecs : 1];  // Q8_0: q, whose signs go onto the activations
      if constexpr (BYTES) {
        for (int64_t v = 0; v < kVecs; ++v) {
          qv[v] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(cg + 64 * v)),
                                   _mm256_set1_epi8(static_cast<char>(0x80)));
          wv[v] = _mm256_abs_epi8(qv[v]);
        }
      } else {
        unpack_vecs_avx2<G, P, 0, kVecs>(cg, P ? group + kCodeBytes + 32 * h : nullptr, wv);
      }
#pragma GCC unroll 1
      for (int64_t r = 0; r < ROWS; ++r) {
        const int8_t* ag = arow[r] + g * G;
        __m256i d = _mm256_setzero_si256();
        for (int64_t v0 = 0; v0 < kVecs; v0 += kRun) {
          __m256i pairs = _mm256_setzero_si256();
          for (int64_t v = v0; v < v0 + kRun; ++v) {
            int32_t four;
            std::memcpy(&four, ag + 4 * v, 4);
            __m256i av = _mm256_set1_epi32(four);
            if constexpr (BYTES) av = _mm256_sign_epi8(av, qv[v]);
            pairs = add_products(pairs, wv[v], av);
          }
          d = _mm256_add_epi32(d, widen_run(pairs, ones, true));
        }
        const int64_t m = m0 + r;
        const __m256 sx = _mm256_mul_ps(S, _mm256_set1_ps(a.xs[m * w.units + g]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), sx, acc[r]);
        if constexpr (!BYTES) acc[r] = _mm256_fmadd_ps(O, _mm256_set1_ps(a.scaled_sum(m, groups, g, w.units, g)), acc[r]);
      }
    }
    const int64_t valid = std::min<int64_t>(8, w.N - n0);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(valid)), lanes);
    const __m256 b = bias != nullptr ? _mm256_maskload_ps(bias + n0, keep) : _mm256_setzero_ps();
    for (int64_t r = 0; r < ROWS; ++r) _mm256_maskstore_ps(y + (m0 + r) * w.N + n0, keep, _mm256_add_ps(acc[r], b));
  }
}

// "k" formats with AVX2, in integers per super-block as the AVX-512 build. A group is taken in passes
// of up to 4 code vectors of both half tiles, unpacked into registers (8 of them); each row then walks
// them: one broadcast of 4 activations feeds a product for each half (maddubs sums the code x
// activation pairs into int16), runs of products add up in int16 (int16_run; a Q4 group's run of 8
// spans both passes, carried between them), and madd_epi16 against the group's scale (in both
// halves of each channel's lane) multiplies and sums them into int32 in one step. Rows one after
// another keep few registers live: with every row's sums in registers the compiler spilled them
// around each product. The offsets' sum_g mn_g * sum_g(a) takes one madd_epi16 per two groups and
// half; one conversion to float per super-block, row and half.
//
// Why both halves at once: Zen 3's two virtual cores run this loop at ~1.25x one core's rate, as
// if they shared its four vector pipes, and each product's broadcast is a vector operation too.
// Sharing a broadcast between the halves' products takes a row's group from 50 vector operations
// to 42. Outputs are bit-identical to the tile that did one half after the other (the same integer
// sums, the same float operations); a Q4_K 17920 x 1536 product at 8 rows went from 81-83 to 97
// G multiply-adds/s on one core of a Zen 3 (hot, best of 60), at 4 and 2 rows 22% faster.
template <int64_t G, int64_t P, int64_t ROWS>
void tile_avx2_k(const Weights& w, const Acts& a, const float* bias, float* y, int64_t tile, int64_t m0) {
  using L = KLayout<G, P>;
  constexpr int64_t kRun = int16_run<P, false, L::kVecs>();
  constexpr int64_t kPass = L::kVecs < 4 ? L::kVecs : 4;  // code vectors per half in registers at once
  static_assert(L::kVecs % kPass == 0 && (kRun % kPass == 0 || kPass % kRun == 0), "passes and runs align");
  const L at(w, tile);
  const int8_t* arow[ROWS];
  for (int64_t r = 0; r < ROWS; ++r) arow[r] = a.q.data() + (m0 + r) * w.K;
  __m256 acc[2][ROWS];
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t r = 0; r < ROWS; ++r) acc[h][r] = _mm256_setzero_ps();
  for (int64_t u = 0; u < w.units; ++u) {
    __m256i isum[2][ROWS], osum[2][ROWS];
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t r = 0; r < ROWS; ++r) isum[h][r] = osum[h][r] = _mm256_setzero_si256();
    for (int64_t j = 0; j < L::kPerUnit; ++j) {
      const int64_t g = u * L::kPerUnit + j;
      const uint8_t* cg = at.codes + g * L::kGroupBytes;
      const uint8_t* high = P ? cg + L::kCodeBytes : nullptr;
      const int8_t* sc = at.iscales + g * L::kIScales * kTile;
      const __m256i sc0 = int16_pairs(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc))));
      const __m256i sc1 =
          int16_pairs(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 8))));
      __m256i carry[2][ROWS];  // a run's int16 sums from one pass to the next (Q4: 8 vectors, 2 passes)
      auto pass = [&]<int64_t P0>() {
        __m256i w0[kPass], w1[kPass];
        unpack_vecs_avx2<G, P, P0, kPass>(cg, high, w0);
        unpack_vecs_avx2<G, P, P0, kPass>(cg + 32, P ? high + 32 : nullptr, w1);
#pragma GCC unroll 1
        for (int64_t r = 0; r < ROWS; ++r) {
          const int8_t* ag = arow[r] + g * G;
          __m256i pr0 = _mm256_setzero_si256(), pr1 = _mm256_setzero_si256();
          if constexpr (kRun > kPass && P0 % kRun != 0) pr0 = carry[0][r], pr1 = carry[1][r];
          __m256i s0 = isum[0][r], s1 = isum[1][r];
          for (int64_t i = 0; i < kPass; ++i) {
            int32_t four;
            std::memcpy(&four, ag + 4 * (P0 + i), 4);
            const __m256i av = _mm256_set1_epi32(four);
            pr0 = add_products(pr0, w0[i], av);
            pr1 = add_products(pr1, w1[i], av);
            if ((P0 + i + 1) % kRun == 0) {
              s0 = _mm256_add_epi32(s0, widen_run(pr0, sc0, false));
              s1 = _mm256_add_epi32(s1, widen_run(pr1, sc1, false));
              pr0 = pr1 = _mm256_setzero_si256();
            }
          }
          isum[0][r] = s0, isum[1][r] = s1;
          if constexpr (kRun > kPass) carry[0][r] = pr0, carry[1][r] = pr1;
        }
      };
      pass.template operator()<0>();
      if constexpr (L::kVecs > kPass) pass.template operator()<kPass>();
      if (j % 2 == 1) {  // the offset term of groups g - 1 and g: lanes (mn_{g-1}, mn_g) per channel
        for (int64_t h = 0; h < 2; ++h) {
          const int8_t* mn = at.iscales + (g - 1) * L::kIScales * kTile + (L::kIScales - 1) * kTile + 8 * h;
          const __m128i m0v = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn)));
          const __m128i m1v =
              _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn + L::kIScales * kTile)));
          const __m256i mnp = _mm256_set_m128i(_mm_unpackhi_epi16(m0v, m1v), _mm_unpacklo_epi16(m0v, m1v));
          for (int64_t r = 0; r < ROWS; ++r) {
            int32_t two;
            std::memcpy(&two, a.sums.data() + (m0 + r) * w.groups + g - 1, 4);
            osum[h][r] = _mm256_add_epi32(osum[h][r], _mm256_madd_epi16(mnp, _mm256_set1_epi32(two)));
          }
        }
      }
    }
    for (int64_t h = 0; h < 2; ++h) {
      const uint16_t* dm = w.kscale + ((tile * w.units + u) * 2) * kTile + 8 * h;
      const __m256 D = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dm)));
      const __m256 Mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dm + kTile)));
      for (int64_t r = 0; r < ROWS; ++r) {
        const __m256 xs = _mm256_set1_ps(a.xs[(m0 + r) * w.units + u]);
        acc[h][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[h][r]), _mm256_mul_ps(D, xs), acc[h][r]);
        acc[h][r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(osum[h][r]), _mm256_mul_ps(Mv, xs), acc[h][r]);
      }
    }
  }
  for (int64_t h = 0; h < 2; ++h) {
    const int64_t n0 = tile * kTile + 8 * h;
    if (n0 >= w.N) break;
    const int64_t valid = std::min<int64_t>(8, w.N - n0);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(valid)), lanes);
    const __m256 b = bias != nullptr ? _mm256_maskload_ps(bias + n0, keep) : _mm256_setzero_ps();
    for (int64_t r = 0; r < ROWS; ++r) _mm256_maskstore_ps(y + (m0 + r) * w.N + n0, keep, _mm256_add_ps(acc[h][r], b));
  }
}
#endif

#if VERISPEC_GGUF_AVX512 || VERISPEC_GGUF_AVX2
template <int64_t G, int64_t P, bool BYTES, bool KQ, int64_t ROWS = kRowBlock>
void dispatch_rows(int64_t rows, const Weights& w, const Acts& a, const float* bias, float* y, int64_t tile,
                   int64_t m0) {
  if constexpr (ROWS > 1) {
    if (rows < ROWS) return dispatch_rows<G, P, BYTES, KQ, ROWS - 1>(rows, w, a, bias, y, tile, m0);
  }
#if VERISPEC_GGUF_AVX512
  if constexpr (KQ)
    tile_avx512_k<G, P, ROWS>(w, a, bias, y, tile, m0);
  else
    tile_avx512<G, P, BYTES, ROWS>(w, a, bias, y, tile, m0);
#else
  if constexpr (KQ)
    tile_avx2_k<G, P, ROWS>(w, a, bias, y, tile, m0);
  else
    tile_avx2<G, P, BYTES, ROWS>(w, a, bias, y, tile, m0);
#endif
}

void tile_rows(int64_t fmt, int64_t rows, const Weights& w, const Acts& a, const float* bias, float* y,
               int64_t tile, int64_t m0) {
  switch (fmt) {
    case LEG4: return dispatch_rows<32, 0, false, false>(rows, w, a, bias, y, tile, m0);
    case LEG5: return dispatch_rows<32, 1, false, false>(rows, w, a, bias, y, tile, m0);
    case LEG8: return dispatch_rows<32, 0, true, false>(rows, w, a, bias, y, tile, m0);
    case K4: return dispatch_rows<32, 0, false, true>(rows, w, a, bias, y, tile, m0);
    case K5: return dispatch_rows<32, 1, false, true>(rows, w, a, bias, y, tile, m0);
    case K6: return dispatch_rows<16, 2, false, true>(rows, w, a, bias, y, tile, m0);
    case K3: return dispatch_rows<16, 0, false, true>(rows, w, a, bias, y, tile, m0);
  }
}
#endif

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& fscales,
                       const at::Tensor& iscales, const at::Tensor& kcorr, const std::optional<at::Tensor>& bias,
                       int64_t fmt, int64_t out_features) {
  const Spec s = spec_of(fmt);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "gguf_linear: x must be float32");
  const int64_t K = x.size(-1), N = out_features;
  TORCH_CHECK(K % s.unit == 0, "gguf_linear: ", K, " inputs is not a multiple of ", s.unit);
  const int64_t tiles = (N + kTile - 1) / kTile, groups = K / s.group, units = K / s.unit;
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.numel() == tiles * groups * group_bytes(s),
              "gguf_linear: codes do not match ", N, " x ", K);
  if (s.kq) {
    TORCH_CHECK(fscales.scalar_type() == at::kHalf && fscales.numel() == tiles * units * 2 * kTile,
                "gguf_linear: bad super-block scales");
    TORCH_CHECK(iscales.scalar_type() == at::kChar && iscales.numel() == tiles * groups * s.iscales * kTile,
                "gguf_linear: bad group scales");
    if (s.symmetric())
      TORCH_CHECK(kcorr.scalar_type() == at::kInt && kcorr.numel() == tiles * units * kTile,
                  "gguf_linear: bad code-sum corrections");
  } else {
    TORCH_CHECK(fscales.scalar_type() == at::kHalf && fscales.numel() == tiles * groups * 2 * kTile,
                "gguf_linear: bad group scales");
  }
  const at::Tensor cc = codes.contiguous(), fc = fscales.contiguous(), ic = iscales.contiguous(),
                   kc = kcorr.contiguous();
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  const at::Tensor xc = x.reshape({-1, K}).contiguous();
  const int64_t M = xc.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y.reshape(out_shape);
  at::Tensor bc;
  const float* bptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    bc = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bc.numel() == N, "gguf_linear: bias must have ", N, " elements");
    bptr = bc.data_ptr<float>();
  }
  const Acts a = quantize_rows(xc.data_ptr<float>(), M, K, s);
  Weights w{cc.data_ptr<uint8_t>(),
            s.kq ? reinterpret_cast<const uint16_t*>(fc.data_ptr<at::Half>()) : nullptr,
            s.kq ? ic.data_ptr<int8_t>() : nullptr,
            s.symmetric() ? kc.data_ptr<int32_t>() : nullptr,
            s.kq ? nullptr : reinterpret_cast<const uint16_t*>(fc.data_ptr<at::Half>()),
            K, N, groups, units};
  float* yp = y.data_ptr<float>();
  // Threads split the tiles only: which thread computes (m, n), and how, never depends on M.
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
        const int64_t rows = std::min(kRowBlock, M - m0);
#if VERISPEC_GGUF_AVX512 || VERISPEC_GGUF_AVX2
        tile_rows(fmt, rows, w, a, bptr, yp, t, m0);
#else
        tile_scalar(w, s, a, bptr, yp, t, m0, rows);
#endif
      }
  });
  return y.reshape(out_shape);
}

// ---- Packing: a tensor's blocks, as the file holds them, into the layout above -----------------------
// gguf_linear.py's pack (numpy) stays the reference the tests compare with, byte for byte; this is
// the same layout ~20x sooner (the 1.5B's Q6_K LM head: 0.25 s against 4.8 s there).

// ggml's type numbers.
enum Type : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

struct BlockType {
  int64_t inputs, bytes, fmt;
};

BlockType block_type(int64_t type) {
  switch (type) {
    case Q4_0: return {32, 18, LEG4};
    case Q4_1: return {32, 20, LEG4};
    case Q5_0: return {32, 22, LEG5};
    case Q5_1: return {32, 24, LEG5};
    case Q8_0: return {32, 34, LEG8};
    case Q3_K: return {256, 110, K3};
    case Q4_K: return {256, 144, K4};
    case Q5_K: return {256, 176, K5};
    case Q6_K: return {256, 210, K6};
  }
  TORCH_CHECK(false, "gguf_pack: no kernel runs ggml type ", type);
}

inline uint16_t load16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }

// One channel decoded from its blocks: codes [K] and, per group (legacy: S, O) or per super-block
// (k: D, M) and per group (k: sc, mn), the factors of w = S c + O = (D sc) c - M mn.
struct Channel {
  std::vector<uint8_t> codes;
  std::vector<float> f0, f1;
  std::vector<int8_t> sc, mn;
};

// The low nibbles of `chunk` bytes, then their high nibbles: every GGUF 4-bit type's order.
inline void nibbles(const uint8_t* qs, int64_t chunk, uint8_t* out) {
  for (int64_t j = 0; j < chunk; ++j) {
    out[j] = qs[j] & 0x0F;
    out[chunk + j] = qs[j] >> 4;
  }
}

void decode_channel(int64_t type, const uint8_t* row, int64_t K, Channel& c) {
  const BlockType bt = block_type(type);
  for (int64_t b = 0; b < K / bt.inputs; ++b) {
    const uint8_t* p = row + b * bt.bytes;
    uint8_t* q = c.codes.data() + b * bt.inputs;
    if (type == Q3_K) {  // codes q + 4 = low 2 bits | hmask bit << 2; w = d (s - 32) (c - 4)
      const uint8_t *hm = p, *qs = p + 32, *sm = p + 96;
      for (int64_t i = 0; i < 256; ++i)
        q[i] = ((qs[32 * (i / 128) + i % 32] >> (2 * ((i / 32) % 4))) & 3) | (((hm[i % 32] >> (i / 32)) & 1) << 2);
      const float d = half_to_float(load16(p + 108));
      c.f0[b] = d;
      c.f1[b] = 4.0f * d;
      for (int64_t g = 0; g < 16; ++g) {
        const int low = g < 8 ? sm[g] & 0x0F : sm[g - 8] >> 4, high = (sm[8 + g % 4] >> (2 * (g / 4))) & 3;
        c.sc[16 * b + g] = c.mn[16 * b + g] = static_cast<int8_t>((low | (high << 4)) - 32);
      }
      continue;
    }
    if (type == Q4_K || type == Q5_K || type == Q6_K) {
      if (type == Q6_K) {
        const uint8_t *ql = p, *qh = p + 128;
        for (int64_t h = 0; h < 2; ++h) {
          nibbles(ql + 64 * h, 64, q + 128 * h);
          for (int64_t s = 0; s < 4; ++s)
            for (int64_t j = 0; j < 32; ++j) q[128 * h + 32 * s + j] |= ((qh[32 * h + j] >> (2 * s)) & 3) << 4;
        }
        const float d = half_to_float(load16(p + 208));
        c.f0[b] = d;
        c.f1[b] = 32.0f * d;  // w = d sc (c - 32) = (D sc) c - M mn with M = 32 d, mn = sc
        for (int64_t g = 0; g < 16; ++g) c.sc[16 * b + g] = c.mn[16 * b + g] = static_cast<int8_t>(p[192 + g]);
        continue;
      }
      c.f0[b] = half_to_float(load16(p));
      c.f1[b] = half_to_float(load16(p + 2));
      const uint8_t* sm = p + 4;  // gguf's get_scale_min: 6-bit scales and mins, 8 of each
      for (int64_t j = 0; j < 4; ++j) {
        c.sc[8 * b + j] = static_cast<int8_t>(sm[j] & 0x3F);
        c.mn[8 * b + j] = static_cast<int8_t>(sm[4 + j] & 0x3F);
        c.sc[8 * b + 4 + j] = static_cast<int8_t>((sm[8 + j] & 0x0F) | ((sm[j] >> 2) & 0x30));
        c.mn[8 * b + 4 + j] = static_cast<int8_t>((sm[8 + j] >> 4) | ((sm[4 + j] >> 2) & 0x30));
      }
      const uint8_t* qs = p + (type == Q4_K ? 16 : 48);
      for (int64_t ch = 0; ch < 4; ++ch) nibbles(qs + 32 * ch, 32, q + 64 * ch);
      if (type == Q5_K)
        for (int64_t i = 0; i < 256; ++i) q[i] |= ((p[16 + i % 32] >> (i / 32)) & 1) << 4;
      continue;
    }
    const float d = half_to_float(load16(p));
    if (type == Q8_0) {
      for (int64_t i = 0; i < 32; ++i) q[i] = static_cast<uint8_t>(static_cast<int8_t>(p[2 + i]) + 128);
      c.f0[b] = d;
      c.f1[b] = -128.0f * d;
      continue;
    }
    const bool has_min = type == Q4_1 || type == Q5_1;
    int64_t at = has_min ? 4 : 2;
    uint32_t qh = 0;
    if (type == Q5_0 || type == Q5_1) {
      std::memcpy(&qh, p + at, 4);  // little-endian, as x86 is
      at += 4;
    }
    nibbles(p + at, 16, q);
    if (type == Q5_0 || type == Q5_1)
      for (int64_t i = 0; i < 32; ++i) q[i] |= ((qh >> i) & 1) << 4;
    c.f0[b] = d;
    c.f1[b] = has_min ? half_to_float(load16(p + 2)) : (type == Q4_0 ? -8.0f : -16.0f) * d;
  }
}

// float -> float16 bits, noting a value that float16 does not hold exactly.
inline uint16_t to_half(float v, bool& exact) {
  const c10::Half h(v);
  exact = exact && static_cast<float>(h) == v;
  return h.x;
}

// Where packed weights live: 2 MB pages. A decode step streams every weight once, ~1 GB for the 1.5B,
// and with 4 KB pages that is a page walk and a stop of the hardware prefetchers every 4 KB of each
// thread's stream. Linux backs anonymous memory with transparent huge pages where asked (madvise, the
// usual setting; "always" needs no asking, "never" refuses, and then this is plain memory). The packer
// takes its arrays from chunks of such memory, one after another (64-byte aligned), so small layers
// (q, k, v, o) share huge pages too. On a Zen 5 (2 cores) the 1.5B's 1-token step went 20.3-21.7 ->
// 18.6-19.5 ms and its 8-token step 28.2-29.6 -> 27.1-28.0, an 8B's 1-token step 79-82 -> 69-70 ms
// (alternated in one process; no change when the machine's memory was slow). Fresh
// anonymous memory is zero, which the packer relies on (padding, kcorr's sums). A chunk is unmapped
// when the last array in it is freed; nothing is ever reused, so a model's arrays stay together.
class WeightArena {
 public:
  static WeightArena& instance() {
    static WeightArena arena;
    return arena;
  }

  // Zero-filled tensors of these sizes and types, in huge-page memory where the system gives it.
  std::vector<at::Tensor> take(const std::vector<std::pair<std::vector<int64_t>, at::ScalarType>>& specs) {
    std::vector<at::Tensor> out;
#if defined(__linux__)
    std::lock_guard<std::mutex> hold(mutex_);
    for (const auto& [shape, type] : specs) {
      int64_t count = 1;
      for (int64_t d : shape) count *= d;
      const size_t bytes = static_cast<size_t>(count) * at::elementSize(type);
      const bool own = bytes > kChunk / 2;  // a big array gets a chunk of its own
      std::shared_ptr<Chunk> chunk = bytes == 0 ? nullptr : own ? Chunk::map(bytes) : bump(bytes);
      if (!chunk) {  // nothing to place, or no mapping to be had: ordinary memory
        out.push_back(at::zeros(shape, at::TensorOptions().dtype(type)));
        continue;
      }
      uint8_t* place = chunk->base + (own ? 0 : used_);
      if (!own) used_ += (bytes + 63) / 64 * 64;
      out.push_back(at::from_blob(place, shape, [chunk](void*) {}, at::TensorOptions().dtype(type)));
    }
#else
    for (const auto& [shape, type] : specs) out.push_back(at::zeros(shape, at::TensorOptions().dtype(type)));
#endif
    return out;
  }

 private:
  static constexpr size_t kHuge = size_t{1} << 21;
  static constexpr size_t kChunk = size_t{64} << 20;  // small arrays share chunks of this size

#if defined(__linux__)
  struct Chunk {
    uint8_t* base;
    size_t length;
    ~Chunk() { munmap(base, length); }

    // `bytes` (rounded up to 4 KB) of anonymous memory starting on a 2 MB boundary, huge pages asked for.
    static std::shared_ptr<Chunk> map(size_t bytes) {
      const size_t length = (bytes + 4095) / 4096 * 4096;
      void* raw = mmap(nullptr, length + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (raw == MAP_FAILED) return nullptr;
      uint8_t* start = static_cast<uint8_t*>(raw);
      uint8_t* base = start + (kHuge - reinterpret_cast<uintptr_t>(start) % kHuge) % kHuge;
      if (base > start) munmap(start, base - start);  // keep only [base, base + length): base - start < kHuge
      munmap(base + length, start + kHuge - base);
      madvise(base, length, MADV_HUGEPAGE);  // a refusal leaves ordinary pages
      return std::shared_ptr<Chunk>(new Chunk{base, length});
    }
  };

  // A place for `bytes` in the current shared chunk, or in a new one (the old one lives on in its arrays).
  std::shared_ptr<Chunk> bump(size_t bytes) {
    std::shared_ptr<Chunk> chunk = current_.lock();
    if (!chunk || used_ + bytes > chunk->length) {
      chunk = Chunk::map(kChunk);
      current_ = chunk;
      used_ = 0;
    }
    return chunk;
  }

  std::mutex mutex_;
  std::weak_ptr<Chunk> current_;  // weak: a chunk whose arrays are all freed is unmapped, not kept here
  size_t used_ = 0;
#endif
};

// Blocks of ggml type `type` -> codes (the high bits in line), fscales, iscales as pack() lays them out. `members`
// ([rows_i, row_bytes] each) are the rows of one layer one after another (q, k and v of a fused
// product: packed into one layout at once, with no copy to concatenate); `order`, where given, says
// which of those rows is each output channel (llama.cpp's q/k row permutation undone as transformers
// does it), again without a copy.
std::vector<at::Tensor> gguf_pack(const std::vector<at::Tensor>& members, int64_t type, int64_t K,
                                  const std::optional<at::Tensor>& order) {
  const BlockType bt = block_type(type);
  const Spec s = spec_of(bt.fmt);
  TORCH_CHECK(K % bt.inputs == 0, "gguf_pack: ", K, " inputs are not whole blocks");
  const int64_t row_bytes = K / bt.inputs * bt.bytes;
  std::vector<at::Tensor> kept;  // contiguous views (or copies) alive while the pointers are used
  std::vector<const uint8_t*> rows;
  for (const at::Tensor& m : members) {
    TORCH_CHECK(m.scalar_type() == at::kByte && m.dim() == 2 && m.size(1) == row_bytes,
                "gguf_pack: blocks must be uint8 [rows, ", row_bytes, "] for ", K, " inputs");
    kept.push_back(m.contiguous());
    const uint8_t* base = kept.back().data_ptr<uint8_t>();
    for (int64_t r = 0; r < m.size(0); ++r) rows.push_back(base + r * row_bytes);
  }
  if (order.has_value() && order->defined()) {
    const at::Tensor oc = order->to(at::kLong).contiguous();
    const int64_t* o = oc.data_ptr<int64_t>();
    std::vector<const uint8_t*> picked(oc.numel());
    for (int64_t i = 0; i < oc.numel(); ++i) {
      TORCH_CHECK(o[i] >= 0 && o[i] < static_cast<int64_t>(rows.size()), "gguf_pack: row ", o[i], " out of range");
      picked[i] = rows[o[i]];
    }
    rows.swap(picked);
  }
  const int64_t N = static_cast<int64_t>(rows.size()), tiles = (N + kTile - 1) / kTile, groups = K / s.group,
                units = K / s.unit;
  const int64_t nf = s.kq ? units : groups;  // float factors per channel
  // Zero-filled, on huge pages (WeightArena); every byte of a whole tile is written below.
  const std::vector<at::Tensor> arrays = WeightArena::instance().take({
      {{tiles, groups * group_bytes(s)}, at::kByte},
      {{tiles, nf * 2 * kTile}, at::kHalf},
      {s.kq ? std::vector<int64_t>{tiles, groups * s.iscales * kTile} : std::vector<int64_t>{0}, at::kChar},
      {s.symmetric() ? std::vector<int64_t>{tiles, units * kTile} : std::vector<int64_t>{0}, at::kInt},
  });
  const at::Tensor &codes = arrays[0], &fscales = arrays[1], &iscales = arrays[2], &kcorr = arrays[3];
  uint8_t* cp = codes.data_ptr<uint8_t>();
  uint16_t* fp = reinterpret_cast<uint16_t*>(fscales.data_ptr<at::Half>());
  int8_t* ip = s.kq ? iscales.data_ptr<int8_t>() : nullptr;
  int32_t* kp = s.symmetric() ? kcorr.data_ptr<int32_t>() : nullptr;
  std::atomic<bool> all_exact{true};
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    Channel c{std::vector<uint8_t>(K), std::vector<float>(nf), std::vector<float>(nf), std::vector<int8_t>(groups),
              std::vector<int8_t>(groups)};
    bool exact = true;
    for (int64_t t = t0; t < t1; ++t) {
      uint8_t* tc = cp + t * groups * group_bytes(s);
      uint16_t* tf = fp + t * nf * 2 * kTile;
      int8_t* ti = s.kq ? ip + t * groups * s.iscales * kTile : nullptr;
      for (int64_t ch = 0; ch < kTile && t * kTile + ch < N; ++ch) {
        decode_channel(type, rows[t * kTile + ch], K, c);
        for (int64_t g = 0; g < groups; ++g) {
          const uint8_t* q = c.codes.data() + g * s.group;
          uint8_t* gc = tc + g * group_bytes(s);
          if (s.bytes) {  // byte 4ch + j of vector v: input 4v + j
            for (int64_t v = 0; v < s.group / 4; ++v) std::memcpy(gc + v * 64 + 4 * ch, q + 4 * v, 4);
          } else {  // byte 4ch + j of vector v: input 8v + j (low nibble), 8v + 4 + j (high)
            for (int64_t v = 0; v < s.group / 8; ++v)
              for (int64_t j = 0; j < 4; ++j)
                gc[v * 64 + 4 * ch + j] = (q[8 * v + j] & 0x0F) | ((q[8 * v + 4 + j] & 0x0F) << 4);
          }
          if (s.planes)  // after the nibbles, byte 4ch + j: the high bits of input 4v + j at bits planes * v
            for (int64_t j = 0; j < 4; ++j) {
              uint32_t bits = 0;
              for (int64_t v = 0; v < s.group / 4; ++v) bits += static_cast<uint32_t>(q[4 * v + j] >> 4) << (s.planes * v);
              gc[code_bytes(s) + 4 * ch + j] = static_cast<uint8_t>(bits);
            }
          if (s.kq) {
            ti[(g * s.iscales) * kTile + ch] = c.sc[g];
            if (s.iscales == 2) ti[(g * 2 + 1) * kTile + ch] = c.mn[g];
          }
        }
        if (kp)  // -128 sum_g sc_g sum_{i in g} (c_i - bias) per super-block: what q + 128 adds to the sums
          for (int64_t u = 0; u < units; ++u) {
            int32_t total = 0;
            for (int64_t g = u * (s.unit / s.group); g < (u + 1) * (s.unit / s.group); ++g) {
              int32_t codes_sum = 0;
              for (int64_t i = 0; i < s.group; ++i) codes_sum += c.codes[g * s.group + i] - static_cast<int32_t>(s.bias);
              total += c.sc[g] * codes_sum;
            }
            kp[(t * units + u) * kTile + ch] = -128 * total;
          }
        for (int64_t f = 0; f < nf; ++f) {
          tf[(2 * f) * kTile + ch] = to_half(c.f0[f], exact);
          tf[(2 * f + 1) * kTile + ch] = to_half(c.f1[f], exact);
        }
      }
    }
    if (!exact) all_exact = false;
  });
  TORCH_CHECK(all_exact.load(), "gguf_pack: scales that float16 does not hold exactly");
  return {codes, fscales, iscales, kcorr};
}

bool gguf_linear_vectorized() { return VERISPEC_GGUF_AVX512 || VERISPEC_GGUF_AVX2; }

}  // namespace

TORCH_LIBRARY(verispec_gguf, m) {
  m.def("gguf_linear(Tensor x, Tensor codes, Tensor fscales, Tensor iscales, Tensor kcorr, Tensor? bias, "
        "int fmt, int out_features) -> Tensor");
  m.def("gguf_linear_vectorized() -> bool", &gguf_linear_vectorized);
  m.def("gguf_pack(Tensor[] members, int type, int in_features, Tensor? order) -> Tensor[]", &gguf_pack);
}

TORCH_LIBRARY_IMPL(verispec_gguf, CPU, m) { m.impl("gguf_linear", gguf_linear); }
