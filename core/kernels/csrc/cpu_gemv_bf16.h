// A decode step's matmul over bfloat16 weights as the model holds them (row-major
// [N, K], no packed copy), for CPUs with AVX512-BF16 (`vdpbf16ps`): x is rounded to
// bf16, as oneDNN's bf16 matmul rounds it, and each instruction multiplies 32
// weights by 32 x values in pairs into 16 float32 sums.
//
// Why: at one row a decode step is a stream of the weights, and the bytes it reads
// set its time. oneDNN's bf16 kernel streams them at ~60-70% of the rate servelab's
// float32 kernel streams float32 weights here (benchmarks/cpu_decode_matmuls.py),
// which leaves bf16's halved bytes mostly unused. One x row takes each weight row
// in turn, so a thread's rows are one sequential stream, left to the hardware
// prefetchers: on the 2 MiB pages the model's weights live on
// (`servelab.kernels.huge_pages`) they run across page boundaries, and software
// prefetches ahead of them only cost issue slots (no prefetch: 1.07x the rate of
// prefetching 12 KiB ahead there, level on 4 KiB pages; AMD Zen 4). Four sums over
// alternating k blocks keep the adds from waiting on one another. Made for one row
// (a batch-1 decode): several rows are computed one after another, each streaming
// the weights again (oneDNN's prepacked kernel is faster from two rows on).
// Deterministic: an output element is computed whole by one thread in one order.
#pragma once

#include "simd.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512BF16__)
constexpr bool kGemvBf16 = true;
constexpr int64_t kBf16Lanes = 32;  // bf16 values a register

inline __m512bh load_bh(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh load_bh_part(const uint16_t* p, __mmask32 lanes) {
  return (__m512bh)_mm512_maskz_loadu_epi16(lanes, p);
}

// One x row: out[n] = sum_k x[k] * w[n, k] for n in [n0, n1).
inline void gemv_bf16_row(const uint16_t* x, int64_t K, const uint16_t* w, float* out,
                          int64_t n0, int64_t n1) {
  constexpr int64_t L = kBf16Lanes;
  const int64_t whole4 = K - K % (4 * L), whole = K - K % L;
  const __mmask32 tail = static_cast<__mmask32>((1ull << (K % L)) - 1);
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* row = w + n * K;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
    for (; k < whole4; k += 4 * L) {
      a0 = _mm512_dpbf16_ps(a0, load_bh(row + k), load_bh(x + k));
      a1 = _mm512_dpbf16_ps(a1, load_bh(row + k + L), load_bh(x + k + L));
      a2 = _mm512_dpbf16_ps(a2, load_bh(row + k + 2 * L), load_bh(x + k + 2 * L));
      a3 = _mm512_dpbf16_ps(a3, load_bh(row + k + 3 * L), load_bh(x + k + 3 * L));
    }
    for (; k < whole; k += L) a0 = _mm512_dpbf16_ps(a0, load_bh(row + k), load_bh(x + k));
    if (whole < K)
      a1 = _mm512_dpbf16_ps(a1, load_bh_part(row + whole, tail), load_bh_part(x + whole, tail));
    out[n] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  }
}

#else
constexpr bool kGemvBf16 = false;
#endif

// Whether this build has `gemv_bf16` (the CPU it was built for has AVX512-BF16).
bool gemv_bf16_available() { return kGemvBf16; }

// float32 rounded to bfloat16's precision, to nearest even as torch rounds, and kept
// in float32 (exactly what `.to(torch.bfloat16).float()` gives).
inline float round_to_bf16(float v) {
  const uint32_t bits = static_cast<uint32_t>(c10::detail::round_to_nearest_even(v)) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// x float32 or bfloat16 [M, K] (one row a pass over the weights), w bfloat16 [N, K],
// bias bfloat16 [N] or none; returns float32 [M, N]: x @ w.T + bias, each element
// rounded to bf16 with `round` (a bf16 matmul's output, widened back: the one-call
// decoder and the Python loop both take it so, without two conversions).
torch::Tensor gemv_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias,
                        bool round) {
  TORCH_CHECK(kGemvBf16, "gemv_bf16: this build's CPU has no AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "gemv_bf16: x [M, K] and w [N, K]");
  TORCH_CHECK((x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16) &&
                  w.scalar_type() == torch::kBFloat16,
              "gemv_bf16: float32 or bfloat16 x and bfloat16 w");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(!bias || (bias->scalar_type() == torch::kBFloat16 && bias->numel() == N),
              "gemv_bf16: the bias must be bfloat16 [N]");
  auto out = torch::empty({M, N}, x.options().dtype(torch::kFloat32));
#if defined(__AVX512BF16__)
  w = w.contiguous();
  const auto xb = x.to(torch::kBFloat16).contiguous();
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  const auto* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
  const torch::Tensor b = bias ? bias->contiguous() : torch::Tensor();
  const at::BFloat16* bp = bias ? b.data_ptr<at::BFloat16>() : nullptr;
  float* op = out.data_ptr<float>();
  // enough rows a task that it streams a while (about 64 KiB of weights)
  const int64_t grain = std::max<int64_t>(1, (32 * 1024) / std::max<int64_t>(K, 1));
  for (int64_t m = 0; m < M; ++m) {
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
      float* row = op + m * N;
      gemv_bf16_row(xp + m * K, K, wp, row, n0, n1);
      if (bp != nullptr)  // in float32, as torch adds a bf16 bias to a float32 sum
        for (int64_t n = n0; n < n1; ++n) row[n] += static_cast<float>(bp[n]);
      if (round)
        for (int64_t n = n0; n < n1; ++n) row[n] = round_to_bf16(row[n]);
    });
  }
#endif
  return out;
}

}  // namespace
