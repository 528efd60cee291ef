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

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// Scores of the `groups` query heads q[g * D ...] that share one key/value head against the keys
// at idx, then their softmax-weighted sums of the values into out[g * D ...] (heads of one
// position are D apart in both). The order of every sum is fixed by D and idx alone.
void attend(const float* q, const float* keys, const float* values, const std::vector<int64_t>& idx,
            int64_t groups, int64_t D, float scale, std::vector<float>& scores, float* out) {
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
  at::parallel_for(0, n * Hkv, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t s = t / Hkv, kvh = t % Hkv;
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
