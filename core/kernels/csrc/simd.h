// The SIMD helpers the CPU kernels share: the includes, `Simd<T>` (64-byte
// GCC/Clang vector types, no intrinsics), `bits_as`, whole and partial vector
// loads and stores, a tree `reduce_add`, and lane-wise `exp` for float32 (a
// Cephes polynomial) and float64 (the C library's). Everything is in the
// anonymous namespace: each translation unit that includes it has its own copy.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// 64-byte vectors: one AVX-512 register, two AVX2 ones (GCC's and Clang's vector
// extensions split them where the target is narrower: no intrinsics needed).
template <typename T>
struct Simd {
  static constexpr int kLanes = 64 / sizeof(T);
  typedef T vec __attribute__((vector_size(64)));
  typedef T half __attribute__((vector_size(32)));
  typedef T quarter __attribute__((vector_size(16)));
  using mask = decltype(vec{} < vec{});  // integer lanes of T's size
};

template <typename To, typename From>
inline To bits_as(const From& from) {
  static_assert(sizeof(To) == sizeof(From));
  To to;
  std::memcpy(&to, &from, sizeof(To));
  return to;
}
template <typename V, typename T>
inline V load(const T* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <typename V, typename T>
inline void store(T* p, V v) { std::memcpy(p, &v, sizeof(v)); }
// The first n (< one vector's) elements; the other lanes of a load are zero.
template <typename V, typename T>
inline V load_part(const T* p, int64_t n) {
  V v{};
  std::memcpy(&v, p, n * sizeof(T));
  return v;
}
template <typename V, typename T>
inline void store_part(T* p, V v, int64_t n) { std::memcpy(p, &v, n * sizeof(T)); }

// Tree reduction, halves folded onto each other: a lane-by-lane loop would be
// a dependency chain as long as the vector (float addition may not be reordered).
template <typename T>
inline T reduce_add(typename Simd<T>::vec v) {
  using S = Simd<T>;
  const auto halves = bits_as<std::array<typename S::half, 2>>(v);
  const auto quarters = bits_as<std::array<typename S::quarter, 2>>(halves[0] + halves[1]);
  const typename S::quarter q = quarters[0] + quarters[1];
  if constexpr (S::kLanes == 16) return (q[0] + q[2]) + (q[1] + q[3]);
  else return q[0] + q[1];
}

// float32 exp, lane-wise: 2^n * P(r) with r = x - n ln 2 (ln 2 in two parts),
// Cephes' expf polynomial (a couple of ulps); `pow2` holds 2^n's bits. x is
// already clamped to the range.
inline Simd<float>::vec exp_poly(Simd<float>::vec x, Simd<float>::vec nf, Simd<float>::mask pow2) {
  using vec = Simd<float>::vec;
  vec r = x - nf * 0.693359375f;
  r = r + nf * 2.12194440e-4f;
  vec p = vec{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * bits_as<vec>(pow2);
}

// exp(x) for x <= 0 (softmax arguments), lane-wise; below -87, exp(-87). float32:
// n = round(x / ln 2) by truncating a non-negative value, so no rounding
// instruction is needed. float64: the C library's exp, lane by lane (float64 is
// the oracle's dtype: exactness, not speed).
inline Simd<float>::vec exp_nonpositive(Simd<float>::vec x) {
  using vec = Simd<float>::vec;
  using ivec = Simd<float>::mask;
  x = x < -87.0f ? vec{} - 87.0f : x;
  const ivec n = -__builtin_convertvector(0.5f - x * 1.44269504088896341f, ivec);
  return exp_poly(x, __builtin_convertvector(n, vec), (n + 127) << 23);
}
inline Simd<double>::vec exp_nonpositive(Simd<double>::vec x) {
  for (int i = 0; i < Simd<double>::kLanes; ++i) x[i] = std::exp(x[i]);
  return x;
}

// exp(x) for any x, lane-wise. float32: below -87, exp(-87) (about 1.6e-38, the
// smallest normal's order: never 0 or a subnormal); above about 88.4, +inf (2^128);
// NaN stays NaN. n = round(x / ln 2) by adding 1.5 * 2^23, which leaves n in
// the low mantissa bits: (those bits + 127) << 23 are 2^n's, the magic
// constant's own bits shifted out. float64: the C library's exp, lane by lane.
inline Simd<float>::vec exp_lanes(Simd<float>::vec x) {
  using vec = Simd<float>::vec;
  using ivec = Simd<float>::mask;
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23
  x = x < -87.0f ? vec{} - 87.0f : x;
  x = x > 89.0f ? vec{} + 89.0f : x;
  const vec shifted = x * 1.44269504088896341f + kMagic;
  return exp_poly(x, shifted - kMagic, (bits_as<ivec>(shifted) + 127) << 23);
}
inline Simd<double>::vec exp_lanes(Simd<double>::vec x) {
  for (int i = 0; i < Simd<double>::kLanes; ++i) x[i] = std::exp(x[i]);
  return x;
}

}  // namespace
