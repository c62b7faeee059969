// The fused kernels of attn's C++ step (issue 53, stage B): plain loops over float32 rows that
// the compiler vectorises for the CPU the extension is built for (native.py passes the
// instruction set torch itself runs: AVX2 or AVX-512), each doing in one pass what the eager
// step does in several ops with a new tensor each. They compute the same formulas as the ops
// they replace; only the order of float additions differs (a dot product summed in vector
// lanes, not by MKL's or oneDNN's kernel), so their results equal the ATen step's to float
// rounding, not bit for bit (tests/decode/test_native.py holds them within 1e-5).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace attn_kernels {

constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

// The kernels over whole rows are kept out of line: GCC vectorises an `omp simd` reduction in a
// function of its own, and inlined into a large caller (or cloned for a constant length) it may
// not (seen: sum_exp scalar there, row_max scalar in a clone for 64).
#define ATTN_ROW_KERNEL __attribute__((noinline, noclone)) inline

// Vectors of 16 and 8 floats as GCC lowers them for the ISA built for (one zmm, two ymm,
// ...), read from and written to any float address (aligned(4)): the attention's kernels keep
// their sums in these registers across a loop, where `omp simd` loops kept them in memory.
typedef float Vec16 __attribute__((vector_size(64), aligned(4)));
typedef float Vec8 __attribute__((vector_size(32), aligned(4)));
typedef float Vec4 __attribute__((vector_size(16), aligned(4)));

inline Vec16 load16(const float* p) { return *reinterpret_cast<const Vec16*>(p); }
inline Vec8 load8(const float* p) { return *reinterpret_cast<const Vec8*>(p); }
inline void store16(float* p, Vec16 x) { *reinterpret_cast<Vec16*>(p) = x; }
inline void store8(float* p, Vec8 x) { *reinterpret_cast<Vec8*>(p) = x; }

// The sum of a vector's lanes by halves (8 + 8, 4 + 4, ...): a few shuffles, where the
// reduction `omp simd` wrote summed the 16 lanes one after another through memory.
inline float lane_sum(Vec16 x) {
  const Vec8 eight = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
                     __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  const Vec4 four = __builtin_shufflevector(eight, eight, 0, 1, 2, 3) +
                    __builtin_shufflevector(eight, eight, 4, 5, 6, 7);
  return (four[0] + four[2]) + (four[1] + four[3]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  Vec16 lanes = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) lanes += load16(a + i) * load16(b + i);
  float sum = lane_sum(lanes);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// y += a x
inline void axpy(float a, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// out (d) = the sum over s < length of weights[s] × value_at(s) (a row of d): 64 columns at a
// time held in four vector registers across every s (axpy per s read and wrote `out` each
// time).
template <typename ValueAt>
inline void weighted_sum(const float* weights, int64_t length, ValueAt value_at, float* out,
                         int64_t d) {
  int64_t c = 0;
  for (; c + 64 <= d; c += 64) {
    Vec16 a0 = {}, a1 = {}, a2 = {}, a3 = {};
    for (int64_t s = 0; s < length; ++s) {
      const float* v = value_at(s) + c;
      const float w = weights[s];
      a0 += w * load16(v);
      a1 += w * load16(v + 16);
      a2 += w * load16(v + 32);
      a3 += w * load16(v + 48);
    }
    store16(out + c, a0);
    store16(out + c + 16, a1);
    store16(out + c + 32, a2);
    store16(out + c + 48, a3);
  }
  if (c == d) return;
  std::fill(out + c, out + d, 0.0f);
  for (int64_t s = 0; s < length; ++s) axpy(weights[s], value_at(s) + c, out + c, d - c);
}

// scores (length) = q (d) against keys stored transposed (d rows of `length`: keys_t[j ×
// length + s] is key s's j-th value): each block of 16 (or 8) positions summed over j in one
// register; the last block overlaps the one before it instead of reading past the row (its
// positions computed again, to the same values). Below 8 positions, axpy over the rows.
inline void scores_transposed(const float* q, const float* keys_t, int64_t length, int64_t d,
                              float* scores) {
  if (length >= 16) {
    for (int64_t start = 0; start < length; start += 16) {
      const int64_t s = std::min(start, length - 16);
      Vec16 sum = {};
      for (int64_t j = 0; j < d; ++j) sum += q[j] * load16(keys_t + j * length + s);
      store16(scores + s, sum);
    }
  } else if (length >= 8) {
    for (int64_t start = 0; start < length; start += 8) {
      const int64_t s = std::min(start, length - 8);
      Vec8 sum = {};
      for (int64_t j = 0; j < d; ++j) sum += q[j] * load8(keys_t + j * length + s);
      store8(scores + s, sum);
    }
  } else {
    std::fill_n(scores, length, 0.0f);
    for (int64_t j = 0; j < d; ++j) axpy(q[j], keys_t + j * length, scores, length);
  }
}

ATTN_ROW_KERNEL float row_max(const float* x, int64_t n) {
  // 16 running maxima (a vector's lanes), each lane's in order: vectorised as they are, where
  // an `omp simd` max reduction was left scalar
  constexpr int64_t kLanes = 16;
  float lanes[kLanes];
  std::fill_n(lanes, kLanes, kMinusInf);
  const int64_t body = n - n % kLanes;
  for (int64_t i = 0; i < body; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) lanes[j] = lanes[j] < x[i + j] ? x[i + j] : lanes[j];
  float best = kMinusInf;
  for (int64_t i = body; i < n; ++i) best = best < x[i] ? x[i] : best;
  for (int64_t j = 0; j < kLanes; ++j) best = best < lanes[j] ? lanes[j] : best;
  return best;
}

// e^x for x <= 0 (every caller subtracts the row's maximum first), within 2 ulp: Cephes'
// expf (x = n ln 2 + r, |r| <= ln 2 / 2, a degree-5 polynomial in r, then 2^n), written as
// straight-line arithmetic the compiler vectorises (libm's expf is a call per element). Below
// -87 (and at -inf, a masked score) it is 0, as e^x is in float to 1e-38.
inline float exp_nonpositive(float x) {
  const bool tiny = x < -87.0f;
  x = std::max(x, -87.0f);
  // n = round(x log2 e) by adding and taking away 1.5 × 2^23 (std::floor would keep GCC from
  // vectorising the loop; without -ffast-math the two additions are not folded away)
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return tiny ? 0.0f : p * scale;
}

// sum of e^(x_i - shift)
ATTN_ROW_KERNEL float sum_exp(const float* x, float shift, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += exp_nonpositive(x[i] - shift);
  return sum;
}

// softmax in place over n scores (at least one finite)
ATTN_ROW_KERNEL void softmax(float* x, int64_t n) {
  const float shift = row_max(x, n);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    x[i] = exp_nonpositive(x[i] - shift);
    sum += x[i];
  }
  const float inverse = 1.0f / sum;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] *= inverse;
}

// out = LayerNorm(x) (weight, bias, eps), one row of d; mean and variance in two passes as
// torch's layer_norm computes them (the variance of x - mean, not E[x^2] - mean^2)
ATTN_ROW_KERNEL void layer_norm(const float* x, const float* weight, const float* bias, float eps,
                       int64_t d, float* out) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < d; ++i) sum += x[i];
  const float mean = sum / static_cast<float>(d);
  float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < d; ++i) squares += (x[i] - mean) * (x[i] - mean);
  const float rstd = 1.0f / std::sqrt(squares / static_cast<float>(d) + eps);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) out[i] = (x[i] - mean) * rstd * weight[i] + bias[i];
}

// x = LayerNorm(x + y): a post-norm sub-layer's residual and norm in one pass over the row
ATTN_ROW_KERNEL void add_layer_norm(float* x, const float* y, const float* weight, const float* bias,
                           float eps, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) x[i] += y[i];
  layer_norm(x, weight, bias, eps, d, x);
}

// The k largest of n values that `allowed` lets through (none: all), in descending order, the
// earlier column first among equals; fewer than k allowed: the rest -inf at column 0.
// `top`/`columns` hold k each. One pass: most values fail against the k-th best so far.
constexpr int64_t kBlock = 64;  // top_k skips a block whose maximum is not above the k-th

// The maximum of each whole block of kBlock values (n / kBlock of them), and of all n: one
// pass, so that the log-softmax's shift and top_k's skipping read the row once between them.
ATTN_ROW_KERNEL float block_maxima(const float* x, int64_t n, float* maxima) {
  constexpr int64_t kLanes = 16;
  const int64_t blocks = n / kBlock;
  float best = kMinusInf;
  for (int64_t b = 0; b < blocks; ++b) {
    float lanes[kLanes];
    std::fill_n(lanes, kLanes, kMinusInf);
    const float* block = x + b * kBlock;
    for (int64_t i = 0; i < kBlock; i += kLanes)
      for (int64_t j = 0; j < kLanes; ++j)
        lanes[j] = lanes[j] < block[i + j] ? block[i + j] : lanes[j];
    float most = kMinusInf;
    for (int64_t j = 0; j < kLanes; ++j) most = most < lanes[j] ? lanes[j] : most;
    maxima[b] = most;
    best = best < most ? most : best;
  }
  for (int64_t i = blocks * kBlock; i < n; ++i) best = best < x[i] ? x[i] : best;
  return best;
}

// `maxima`: block_maxima's of x (none: each block's is computed where it is needed).
ATTN_ROW_KERNEL void top_k(const float* x, int64_t n, int64_t k, const bool* banned, float* top,
                           int64_t* columns, const float* maxima = nullptr) {
  int64_t held = 0;
  for (int64_t c = 0; c < n; ++c) {
    if (c % kBlock == 0 && held == k && c + kBlock <= n &&
        !((maxima != nullptr ? maxima[c / kBlock] : row_max(x + c, kBlock)) > top[k - 1])) {
      c += kBlock - 1;
      continue;
    }
    const float value = x[c];
    if (held == k && !(value > top[k - 1])) continue;
    if (banned != nullptr && banned[c]) continue;
    int64_t at = held < k ? held++ : k - 1;
    while (at > 0 && value > top[at - 1]) {
      top[at] = top[at - 1];
      columns[at] = columns[at - 1];
      --at;
    }
    top[at] = value;
    columns[at] = c;
  }
  for (int64_t i = held; i < k; ++i) {
    top[i] = kMinusInf;
    columns[i] = 0;
  }
}

}  // namespace attn_kernels
