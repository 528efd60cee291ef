// The small per-layer operations of a Llama-family decoder layer in one call each (verispec's lean
// forward, verispec/models/lean.py): RMSNorm (with the residual add before it), the rotary
// embedding of q and k, and the SiLU-gated product of the MLP.
//
// Why: on the CPU fast path a 1.5B decode step's Linears take ~38 ms, and the ~25 torch operations
// per layer around them (RMSNorm alone is 8: a conversion, pow, mean, add, rsqrt, two multiplies,
// another conversion) cost ~5 us each in dispatch: ~6 ms of a ~45 ms step on a 2-core machine,
// for arithmetic that takes microseconds. Here each is one call.
//
// Batch invariance: every operation works row by row (a row is one token's vector), and a row's
// arithmetic (the order of its sums, the lanes they use) depends only on the row's length, never on
// how many rows the call has or which thread runs it. So a token gets the same bits decoded alone,
// verified beside drafts or batched, as lossless greedy speculation needs. The bits differ from
// torch's (its reductions and exp order differently), so a model uses one or the other for all
// its forwards (HFCausalLM.native_layers, handed to lean.forward). The build uses -ffp-contract=off,
// like the other kernels.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VERISPEC_VECTOR 1
#else
#define VERISPEC_VECTOR 0
#endif

namespace {

// Rows of at most this many elements per task of the thread pool: a decode row alone is not worth
// waking a second thread for.
constexpr int64_t kGrain = 1 << 15;

int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, kGrain / std::max<int64_t>(1, width)); }

// sum_i x_i^2 over one row: 8 lanes in index order, then a fixed pairwise sum of the lanes, then
// the tail in index order.
float sum_squares(const float* x, int64_t n) {
  int64_t i = 0;
  float total = 0.f;
#if VERISPEC_VECTOR
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
  }
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  const __m128 p = _mm_add_ps(h, _mm_movehl_ps(h, h));
  total = _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps(p, p, 1)));
#endif
  for (; i < n; ++i) total += x[i] * x[i];
  return total;
}

// out = weight * (x * rsqrt(mean(x^2) + eps)), the two products in transformers' order.
void norm_row(const float* x, const float* weight, float eps, int64_t n, float* out) {
  const float r = 1.f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * r);
}

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu(), what, ": float32 CPU tensors only");
  TORCH_CHECK(t.dim() >= 1 && t.is_contiguous(), what, ": a contiguous tensor of rows");
}

// RMSNorm of each row of x [..., H]: transformers' Llama/Qwen2/Mistral RMSNorm in float32.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  const int64_t H = x.size(-1), M = x.numel() / std::max<int64_t>(1, H);
  const at::Tensor w = weight.to(at::kFloat).contiguous();
  TORCH_CHECK(w.numel() == H, "rms_norm: weight has ", w.numel(), " elements for rows of ", H);
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, M, grain_rows(H), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) norm_row(xp + m * H, wp, e, H, op + m * H);
  });
  return out;
}

// (residual + delta, RMSNorm of it): a layer's residual add and the next norm in one pass.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& residual, const at::Tensor& delta,
                                                const at::Tensor& weight, double eps) {
  check_rows(residual, "add_rms_norm");
  check_rows(delta, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == delta.sizes(), "add_rms_norm: residual and delta differ in shape");
  const int64_t H = residual.size(-1), M = residual.numel() / std::max<int64_t>(1, H);
  const at::Tensor w = weight.to(at::kFloat).contiguous();
  TORCH_CHECK(w.numel() == H, "add_rms_norm: weight has ", w.numel(), " elements for rows of ", H);
  at::Tensor sum = at::empty_like(residual), out = at::empty_like(residual);
  const float* rp = residual.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, M, grain_rows(H), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t i = 0; i < H; ++i) sp[m * H + i] = rp[m * H + i] + dp[m * H + i];
      norm_row(sp + m * H, wp, e, H, op + m * H);
    }
  });
  return {sum, out};
}

// In place on x [M, C] (rows contiguous, row stride C): the first `heads` blocks of D values of each
// row become x * cos + rotate_half(x) * sin, with cos / sin [M, D] per row, as transformers'
// apply_rotary_pos_emb computes it (two products, then their sum: the same bits).
void rotary_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads) {
  check_rows(x, "rotary_");
  TORCH_CHECK(x.dim() == 2 && cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0),
              "rotary_: x must be [M, C] and cos, sin [M, D]");
  const int64_t M = x.size(0), C = x.size(1), D = cos.size(1), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && heads >= 0 && heads * D <= C, "rotary_: ", heads, " heads of ", D, " do not fit rows of ", C);
  const at::Tensor c = cos.to(at::kFloat).contiguous(), s = sin.to(at::kFloat).contiguous();
  float* xp = x.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  at::parallel_for(0, M, grain_rows(heads * D), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* cm = cp + m * D;
      const float* sm = sp + m * D;
      for (int64_t h = 0; h < heads; ++h) {
        float* v = xp + m * C + h * D;
        for (int64_t i = 0; i < half; ++i) {
          const float a = v[i], b = v[i + half];
          v[i] = a * cm[i] + (-b) * sm[i];
          v[i + half] = b * cm[i + half] + a * sm[i + half];
        }
      }
    }
  });
}

#if VERISPEC_VECTOR
// exp(x) for 8 floats: x = k ln2 + r with |r| <= ln2 / 2 (ln2 split in two parts for exactness),
// a degree-6 polynomial for exp(r) (Cephes' coefficients, ~1 ulp), then 2^k from the exponent bits.
// Inputs are clamped to [-87.3, 88.7], where the float result stays normal.
__m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(k, _mm256_set1_ps(0.693359375f)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(k, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

#if defined(__AVX512F__)
// exp8's operations in 16 lanes, one for one (multiplies and adds apart, rounding to nearest), so
// every element gets exp8's bits: the AVX-512 and AVX2 builds agree, and so do a row's 16-wide body
// and its 8-wide tail.
__m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(k, _mm512_set1_ps(0.693359375f)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(k, _mm512_set1_ps(-2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
#endif

// silu(gate) * up for rows of gate / up [M, I] that may be views with a row stride (the two halves
// of one fused gate/up product): silu(g) = g / (1 + exp(-g)). With AVX-512, 16 elements at a time
// by the same operations as the 8-wide loop (every element the same bits either way): on a Zen 5
// (2 threads) rows of 8960, as the 1.5B's 28 layers have, 1 row 5.8 -> 3.6 us, 8 rows 20-23 -> 12,
// 137 rows 317-359 -> 170.
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.scalar_type() == at::kFloat && up.scalar_type() == at::kFloat && gate.device().is_cpu(),
              "silu_mul: float32 CPU tensors only");
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes() && gate.stride(1) == 1 && up.stride(1) == 1,
              "silu_mul: gate and up must be [M, I] with contiguous rows");
  const int64_t M = gate.size(0), I = gate.size(1);
  const int64_t gs = gate.stride(0), us = up.stride(0);
  at::Tensor out = at::empty({M, I}, gate.options());
  const float* gp = gate.data_ptr<float>();
  const float* upp = up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, grain_rows(I), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* g = gp + m * gs;
      const float* u = upp + m * us;
      float* o = op + m * I;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= I; i += 16) {
        const __m512 x = _mm512_loadu_ps(g + i);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
        const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e));
        _mm512_storeu_ps(o + i, _mm512_mul_ps(silu, _mm512_loadu_ps(u + i)));
      }
#endif
#if VERISPEC_VECTOR
      const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
      for (; i + 8 <= I; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, x))));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
      }
#endif
      for (; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(verispec_layer, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor residual, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin, int heads) -> ()");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
}

TORCH_LIBRARY_IMPL(verispec_layer, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("rotary_", rotary_);
  m.impl("silu_mul", silu_mul);
}
