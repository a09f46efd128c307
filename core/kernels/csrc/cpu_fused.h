// Fused kernels for a decoder layer's element-wise ops: each is one call and one
// pass over the rows, computing the formulas of `servelab.model.transformer`.
//
// - `rms_norm`: `x * rsqrt(mean(x * x) + eps) * weight`, rows of x;
// - `add_rms_norm`: `residual += delta` in place, then `rms_norm(residual)`;
// - `qk_norm_rope_`: in place on a fused QKV projection: each q and k head's
//   optional RMSNorm, then rotate-half RoPE at the token's position;
// - `argmax_rows`: `argmax(dim=-1)` with torch's rules, for greedy sampling.
//
// Arithmetic in the tensors' dtype (float32 or float64). The sum of squares runs
// in vector lanes, then a tree sum: it matches torch's to rounding, not bit for
// bit. Deterministic: each row is computed whole by one thread.
#pragma once

#include "simd.h"

#include <optional>
#include <type_traits>

namespace {

// The least work a call needs before its rows are split over threads, in units
// of about one element's worth: rms_norm counts 1 per element, add_rms_norm 2,
// qk_norm_rope_ 2 per element of a q or k head. Measured on the reference shapes
// (2 threads, Zen 4): one thread is as fast or faster below it, two are faster
// above it. (`cpu_fused.PARALLEL_MIN_WORK` is read from this line.)
constexpr int64_t kParallelMinWork = 24576;

// Rows go to torch's intra-op threads (each row whole on one thread) only when
// the call has at least kParallelMinWork units of work (about one element's
// load, arithmetic and store; a call passes its rows' cost): a parallel region
// costs about a microsecond, more than a small call's whole work.
inline int64_t grain_rows(int64_t rows, int64_t row_work) {
  if (rows * row_work < kParallelMinWork) return rows + 1;  // one thread
  return std::max<int64_t>(1, kParallelMinWork / 2 / std::max<int64_t>(row_work, 1));
}

// The sum of x[0..n) squared, in four vector accumulators and a tree sum. With
// kAdd, x[i] += add[i] first (stored back): one pass for the residual add.
template <typename T, bool kAdd>
inline T sum_squares(T* x, const T* add, int64_t n) {
  using S = Simd<T>;
  using vec = typename S::vec;
  constexpr int L = S::kLanes;
  auto next = [&](int64_t i) {
    vec v = load<vec>(x + i);
    if constexpr (kAdd) {
      v += load<vec>(add + i);
      store(x + i, v);
    }
    return v;
  };
  vec a0{}, a1{}, a2{}, a3{};
  int64_t i = 0;
  for (; i + 4 * L <= n; i += 4 * L) {
    const vec v0 = next(i), v1 = next(i + L), v2 = next(i + 2 * L), v3 = next(i + 3 * L);
    a0 += v0 * v0;
    a1 += v1 * v1;
    a2 += v2 * v2;
    a3 += v3 * v3;
  }
  for (; i + L <= n; i += L) {
    const vec v = next(i);
    a0 += v * v;
  }
  if (i < n) {  // the tail, zero-padded to a vector
    vec v = load_part<vec>(x + i, n - i);
    if constexpr (kAdd) {
      v += load_part<vec>(add + i, n - i);
      store_part(x + i, v, n - i);
    }
    a1 += v * v;
  }
  return reduce_add<T>((a0 + a1) + (a2 + a3));
}

// 1 / sqrt(mean + eps): torch's rsqrt is the same division.
template <typename T>
inline T inv_rms(T sum_sq, int64_t n, T eps) {
  return T(1) / std::sqrt(sum_sq / static_cast<T>(n) + eps);
}

// out[i] = (x[i] * inv) * w[i], HF's order (normalise, then scale by the weight).
template <typename T>
inline void scale_row(const T* x, T inv, const T* w, T* out, int64_t n) {
  using vec = typename Simd<T>::vec;
  constexpr int L = Simd<T>::kLanes;
  int64_t i = 0;
  for (; i + L <= n; i += L) store(out + i, load<vec>(x + i) * inv * load<vec>(w + i));
  if (i < n) {
    const vec v = load_part<vec>(x + i, n - i) * inv * load_part<vec>(w + i, n - i);
    store_part(out + i, v, n - i);
  }
}

// Lanes [i, i + n) of each half of one head of D = 2 * half elements, in place:
// with kNorm, RMSNorm first (in registers), then x1 * c - x2 * s, x2 * c + x1 * s.
template <typename T, bool kNorm, bool kWhole>
inline void norm_rope_chunk(T* x, int64_t half, int64_t i, int64_t n, const T* w, T inv,
                            const T* c, const T* s) {
  using vec = typename Simd<T>::vec;
  auto get = [&](const T* p) { return kWhole ? load<vec>(p) : load_part<vec>(p, n); };
  vec x1 = get(x + i), x2 = get(x + half + i);
  if constexpr (kNorm) {
    x1 = x1 * inv * get(w + i);
    x2 = x2 * inv * get(w + half + i);
  }
  const vec ci = get(c + i), si = get(s + i);
  const vec o1 = x1 * ci - x2 * si, o2 = x2 * ci + x1 * si;
  if constexpr (kWhole) {
    store(x + i, o1);
    store(x + half + i, o2);
  } else {
    store_part(x + i, o1, n);
    store_part(x + half + i, o2, n);
  }
}

template <typename T, bool kNorm>
inline void norm_rope_head(T* x, int64_t half, const T* w, T inv, const T* c, const T* s) {
  constexpr int L = Simd<T>::kLanes;
  int64_t i = 0;
  for (; i + L <= half; i += L) norm_rope_chunk<T, kNorm, true>(x, half, i, L, w, inv, c, s);
  if (i < half) norm_rope_chunk<T, kNorm, false>(x, half, i, half - i, w, inv, c, s);
}

inline void check_dtype(const torch::Tensor& t, const torch::Tensor& like, const char* op,
                        const char* name, const char* like_name) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor (got ", t.device(), ")");
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), op, ": ", name, " must have ", like_name,
              "'s dtype ", like.scalar_type(), " (got ", t.scalar_type(), ")");
}

// x: a float32/float64 CPU tensor of `dims` dims, its last dim contiguous.
inline void check_input(const torch::Tensor& x, const char* op, const char* name, int64_t dims) {
  TORCH_CHECK(x.device().is_cpu(), op, ": ", name, " must be a CPU tensor (got ", x.device(), ")");
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kDouble, op, ": ",
              name, " must be float32 or float64 (got ", x.scalar_type(), ")");
  TORCH_CHECK(x.dim() == dims, op, ": ", name, " must have ", dims, " dims (got shape ",
              x.sizes(), ")");
  TORCH_CHECK(x.size(dims - 1) <= 1 || x.stride(dims - 1) == 1, op, ": ", name,
              "'s last dim must be contiguous (got strides ", x.strides(), ")");
}

inline void check_weight(const torch::Tensor& w, const torch::Tensor& x, int64_t size,
                         const char* op, const char* name, const char* x_name) {
  TORCH_CHECK(w.device().is_cpu(), op, ": ", name, " must be a CPU tensor (got ", w.device(), ")");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), op, ": ", name, " must have ", x_name,
              "'s dtype ", x.scalar_type(), " (got ", w.scalar_type(), ")");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == size, op, ": ", name, " must have shape [", size,
              "] (got ", w.sizes(), ")");
  TORCH_CHECK(w.is_contiguous(), op, ": ", name, " must be contiguous");
}

// Rows (heads) are normalised in blocks: first every row's inverse RMS, then
// every row's scaling. A row's scaling waits on its sum's reduction, division
// and square root (about 80 cycles): one row after another, that latency is
// paid per row; a block's independent sums overlap in the core instead.
constexpr int kBlockRows = 8;
inline int64_t block_rows(int64_t row_bytes) {  // a block stays in L1 between its passes
  return std::clamp<int64_t>(16384 / std::max<int64_t>(row_bytes, 1), 1, kBlockRows);
}

template <typename T, bool kAdd>
void rms_norm_rows(T* x, int64_t x_stride, const T* add, int64_t add_stride, const T* w, T eps,
                   T* out, int64_t rows, int64_t h) {
  const int64_t block = block_rows(h * sizeof(T));
  const int64_t grain = grain_rows(rows, (kAdd ? 2 : 1) * h);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    T inv[kBlockRows];
    for (int64_t first = begin; first < end; first += block) {
      const int64_t n = std::min(block, end - first);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t r = first + j;
        inv[j] = inv_rms(sum_squares<T, kAdd>(x + r * x_stride, add + r * add_stride, h), h, eps);
      }
      for (int64_t j = 0; j < n; ++j) {
        const int64_t r = first + j;
        scale_row(x + r * x_stride, inv[j], w, out + r * h, h);
      }
    }
  });
}

// kHalf: head_dim / 2 when known at compile time (the common head sizes: the
// loops unroll; 64 tokens of 6 heads of 64 take 3.5 instead of 6 us), else 0.
template <typename T, int kHalf>
void qk_norm_rope_rows(T* qkv, int64_t rows, int64_t num_heads, int64_t num_kv_heads,
                       int64_t runtime_head_dim, const T* q_w, const T* k_w, T eps, const T* cos,
                       const T* sin, const int64_t* positions) {
  const int64_t head_dim = kHalf > 0 ? 2 * kHalf : runtime_head_dim, half = head_dim / 2;
  const int64_t row = (num_heads + 2 * num_kv_heads) * head_dim;
  const int64_t rotated = num_heads + num_kv_heads;  // heads
  const int64_t block = block_rows(head_dim * sizeof(T));
  const int64_t grain = grain_rows(rows, 2 * rotated * head_dim);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    T inv[kBlockRows];
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + positions[t] * half;
      const T* s = sin + positions[t] * half;
      T* token = qkv + t * row;
      for (int64_t first = 0; first < rotated; first += block) {
        const int64_t n = std::min(block, rotated - first);
        for (int64_t j = 0; j < n; ++j) {
          const int64_t h = first + j;
          if ((h < num_heads ? q_w : k_w) != nullptr) {
            T* x = token + h * head_dim;
            inv[j] = inv_rms(sum_squares<T, false>(x, nullptr, head_dim), head_dim, eps);
          }
        }
        for (int64_t j = 0; j < n; ++j) {
          const int64_t h = first + j;
          const T* w = h < num_heads ? q_w : k_w;
          if (w != nullptr) norm_rope_head<T, true>(token + h * head_dim, half, w, inv[j], c, s);
          else norm_rope_head<T, false>(token + h * head_dim, half, nullptr, T(1), c, s);
        }
      }
    }
  });
}

}  // namespace

// The extension's functions (also called by the decoder loop), in the anonymous
// namespace like the rest: each translation unit that includes this header gets
// its own copy, so any number of them can.
namespace {

// x [T, H] (last dim contiguous, any row stride), weight [H] -> a new contiguous
// [T, H]: x * rsqrt(mean(x^2) + eps) * weight in x's dtype.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_input(x, "rms_norm", "x", 2);
  check_weight(weight, x, x.size(1), "rms_norm", "weight", "x");
  auto out = torch::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t, false>(x.data_ptr<scalar_t>(), x.stride(0), nullptr, 0,
                                   weight.data_ptr<scalar_t>(), static_cast<scalar_t>(eps),
                                   out.data_ptr<scalar_t>(), x.size(0), x.size(1));
  });
  return out;
}

// residual [T, H] contiguous += delta [T, H] (last dim contiguous, any row
// stride), in place; returns rms_norm(residual, weight, eps), a new tensor.
torch::Tensor add_rms_norm(torch::Tensor residual, torch::Tensor delta, torch::Tensor weight,
                           double eps) {
  check_input(residual, "add_rms_norm", "residual", 2);
  TORCH_CHECK(residual.is_contiguous(), "add_rms_norm: residual must be contiguous (got strides ",
              residual.strides(), ")");
  check_input(delta, "add_rms_norm", "delta", 2);
  TORCH_CHECK(delta.scalar_type() == residual.scalar_type(),
              "add_rms_norm: delta must have residual's dtype ", residual.scalar_type(), " (got ",
              delta.scalar_type(), ")");
  TORCH_CHECK(delta.sizes() == residual.sizes(), "add_rms_norm: delta must have residual's shape ",
              residual.sizes(), " (got ", delta.sizes(), ")");
  check_weight(weight, residual, residual.size(1), "add_rms_norm", "weight", "residual");
  auto out = torch::empty(residual.sizes(), residual.options());
  AT_DISPATCH_FLOATING_TYPES(residual.scalar_type(), "add_rms_norm", [&] {
    rms_norm_rows<scalar_t, true>(residual.data_ptr<scalar_t>(), residual.size(1),
                                  delta.data_ptr<scalar_t>(), delta.stride(0),
                                  weight.data_ptr<scalar_t>(), static_cast<scalar_t>(eps),
                                  out.data_ptr<scalar_t>(), residual.size(0), residual.size(1));
  });
  return out;
}

// In place on qkv [T, (num_heads + 2 * num_kv_heads) * head_dim], contiguous:
// every q head (then k head) RMSNormed with q_weight (k_weight) when given,
// then rotated by cos/sin [max_positions, head_dim / 2] at positions[t] (int64).
void qk_norm_rope_(torch::Tensor qkv, std::optional<torch::Tensor> q_weight,
                   std::optional<torch::Tensor> k_weight, double eps, torch::Tensor cos,
                   torch::Tensor sin, torch::Tensor positions, int64_t num_heads,
                   int64_t num_kv_heads) {
  const char* op = "qk_norm_rope_";
  check_input(qkv, op, "qkv", 2);
  TORCH_CHECK(qkv.is_contiguous(), op, ": qkv must be contiguous (got strides ", qkv.strides(),
              ")");
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0, op,
              ": num_heads and num_kv_heads must be positive (got ", num_heads, " and ",
              num_kv_heads, ")");
  const int64_t heads = num_heads + 2 * num_kv_heads;
  TORCH_CHECK(qkv.size(1) % heads == 0 && qkv.size(1) / heads % 2 == 0, op, ": qkv's width ",
              qkv.size(1), " must be (num_heads + 2 * num_kv_heads) = ", heads,
              " heads of an even head_dim");
  const int64_t head_dim = qkv.size(1) / heads, rows = qkv.size(0);
  for (const auto& [table, name] : {std::pair{&cos, "cos"}, std::pair{&sin, "sin"}}) {
    check_dtype(*table, qkv, op, name, "qkv");
    TORCH_CHECK(table->dim() == 2 && table->size(1) == head_dim / 2, op, ": ", name,
                " must be [max_positions, head_dim / 2 = ", head_dim / 2, "] (got ",
                table->sizes(), ")");
    TORCH_CHECK(table->is_contiguous(), op, ": ", name, " must be contiguous");
  }
  TORCH_CHECK(sin.size(0) == cos.size(0), op, ": cos and sin must have the same shape (got ",
              cos.sizes(), " and ", sin.sizes(), ")");
  TORCH_CHECK(positions.device().is_cpu(), op, ": positions must be a CPU tensor (got ",
              positions.device(), ")");
  TORCH_CHECK(positions.scalar_type() == torch::kLong, op, ": positions must be int64 (got ",
              positions.scalar_type(), ")");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == rows, op,
              ": positions must be [T] = [", rows, "] (got ", positions.sizes(), ")");
  TORCH_CHECK(positions.is_contiguous(), op, ": positions must be contiguous");
  if (q_weight) check_weight(*q_weight, qkv, head_dim, op, "q_weight", "qkv");
  if (k_weight) check_weight(*k_weight, qkv, head_dim, op, "k_weight", "qkv");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_positions = cos.size(0);
  for (int64_t t = 0; t < rows; ++t) {  // before anything is written
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_positions, op, ": position ", pos[t], " of token ", t,
                " is outside the cos/sin tables (positions 0 to ", max_positions - 1, ")");
  }
  AT_DISPATCH_FLOATING_TYPES(qkv.scalar_type(), "qk_norm_rope_", [&] {
    auto run = [&](auto half) {
      qk_norm_rope_rows<scalar_t, decltype(half)::value>(
          qkv.data_ptr<scalar_t>(), rows, num_heads, num_kv_heads, head_dim,
          q_weight ? q_weight->data_ptr<scalar_t>() : nullptr,
          k_weight ? k_weight->data_ptr<scalar_t>() : nullptr, static_cast<scalar_t>(eps),
          cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), pos);
    };
    if (head_dim == 64) run(std::integral_constant<int, 32>{});
    else if (head_dim == 128) run(std::integral_constant<int, 64>{});
    else run(std::integral_constant<int, 0>{});
  });
}

// Row-wise argmax with torch.argmax's rules: the first index of the largest
// value, a NaN counting as larger than any number (the first NaN wins). One
// vector pass for the maximum, one scalar pass for where it first stands.
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  using S = Simd<T>;
  using vec = typename S::vec;
  constexpr int L = S::kLanes;
  T best = -INFINITY;
  bool nan = false;
  int64_t i = 0;
  if (n >= L) {
    vec m = load<vec>(x);
    typename S::mask nans = m != m;
    for (i = L; i + L <= n; i += L) {
      const vec v = load<vec>(x + i);
      nans |= v != v;
      m = v > m ? v : m;
    }
    for (int c = 0; c < L; ++c) {
      nan |= nans[c] != 0;
      best = std::max(best, m[c]);
    }
  }
  for (; i < n; ++i) {
    nan |= x[i] != x[i];
    best = std::max(best, x[i]);
  }
  int64_t j = 0;
  if (!nan) {  // skip whole vectors that do not hold the maximum
    const vec target = vec{} + best;
    for (; j + L <= n; j += L) {
      const auto words = bits_as<std::array<uint64_t, 8>>(load<vec>(x + j) == target);
      uint64_t any = 0;
      for (const uint64_t w : words) any |= w;
      if (any != 0) break;
    }
  }
  for (; j < n; ++j) {
    if (nan ? x[j] != x[j] : x[j] == best) return j;
  }
  return 0;  // unreachable: some value equals the maximum
}

// logits [rows, n] (last dim contiguous, any row stride) -> int64 [rows].
torch::Tensor argmax_rows(torch::Tensor logits) {
  check_input(logits, "argmax_rows", "logits", 2);
  TORCH_CHECK(logits.size(1) > 0, "argmax_rows: rows must not be empty (got shape ",
              logits.sizes(), ")");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  auto out = torch::empty({rows}, logits.options().dtype(torch::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "argmax_rows", [&] {
    const scalar_t* x = logits.data_ptr<scalar_t>();
    for (int64_t r = 0; r < rows; ++r) o[r] = argmax_row<scalar_t>(x + r * stride, n);
  });
  return out;
}

}  // namespace
