// A matmul for the CPU decode step's small batches, over pre-packed weights.
//
// A decode step multiplies a few rows (one per running sequence) by every
// weight matrix. At that size MKL's `sgemm` spends much of its time packing the
// weight into panels on every call and splitting tiny work over threads. Here
// the weight is packed once, when the model is built, into panels of
// `2 * lanes` columns (`[N / NR][K][NR]`, zero-padded), and a register-blocked
// micro-kernel (`MR` rows x `NR` columns of accumulators) streams each panel
// once per block of rows, panels split over torch's intra-op threads.
//
// Each output is `sum_k x[m, k] * w[n, k]` accumulated in k order with fused
// multiply-adds, then `+ bias`: a different rounding order from MKL's, so results
// match F.linear to rounding, not bit for bit. Deterministic: an output element
// is computed whole by one thread in a fixed order, so the thread count never
// changes a result.
#pragma once

#include "simd.h"

namespace {

// Columns per panel: two vectors of accumulators per row.
template <typename T>
constexpr int64_t panel_cols() { return 2 * Simd<T>::kLanes; }

// Rows per micro-kernel call: MR x 2 accumulators stay in registers (AVX-512
// has 32; 8 rows use 16 and leave room for the two weight vectors).
constexpr int kMaxRows = 8;

// `ahead`: the panel this thread multiplies next (or null): its two cache lines
// per k are prefetched into L2 while this one computes. A decode step's weights
// come back from DRAM every step (the K/V read in between evicts them), and at
// a few rows the hardware prefetcher alone does not hide that.
//
// Gated (SwiGLU): the panel's first vector of columns is the gate projection's,
// the second the up projection's for the same outputs (`pack_gated_weight`);
// the kernel writes silu(gate) * up, one vector of columns a panel, so the
// [rows, 2 * inner] projection is never stored and read back.
template <typename T, int MR, bool Gated>
inline void micro_kernel(const T* x, int64_t x_stride, const T* panel, int64_t K,
                         const T* bias, T* out, int64_t out_stride, int64_t cols,
                         const T* ahead) {
  using V = typename Simd<T>::vec;
  constexpr int L = Simd<T>::kLanes;
  V acc0[MR], acc1[MR];
  for (int r = 0; r < MR; ++r) { acc0[r] = V{}; acc1[r] = V{}; }
  for (int64_t k = 0; k < K; ++k) {
    if (ahead != nullptr) {
      __builtin_prefetch(ahead + k * 2 * L, 0, 2);
      __builtin_prefetch(ahead + k * 2 * L + L, 0, 2);
    }
    V w0, w1;
    std::memcpy(&w0, panel + k * 2 * L, sizeof(V));
    std::memcpy(&w1, panel + k * 2 * L + L, sizeof(V));
    for (int r = 0; r < MR; ++r) {
      const T xv = x[r * x_stride + k];
      acc0[r] += xv * w0;
      acc1[r] += xv * w1;
    }
  }
  if (bias != nullptr) {
    V b0, b1;
    std::memcpy(&b0, bias, sizeof(V));
    std::memcpy(&b1, bias + L, sizeof(V));
    for (int r = 0; r < MR; ++r) { acc0[r] += b0; acc1[r] += b1; }
  }
  if constexpr (Gated) {  // silu(g) * u = g / (1 + exp(-g)) * u, as F.silu(g) * u
    for (int r = 0; r < MR; ++r) {
      const V gated = acc0[r] / (T(1) + exp_lanes(-acc0[r])) * acc1[r];
      if (cols == L) {
        std::memcpy(out + r * out_stride, &gated, sizeof(V));
      } else {
        T row[L];
        std::memcpy(row, &gated, sizeof(V));
        std::memcpy(out + r * out_stride, row, cols * sizeof(T));
      }
    }
  } else if (cols == 2 * L) {
    for (int r = 0; r < MR; ++r) {
      std::memcpy(out + r * out_stride, &acc0[r], sizeof(V));
      std::memcpy(out + r * out_stride + L, &acc1[r], sizeof(V));
    }
  } else {  // the last, zero-padded panel: only its real columns are written
    for (int r = 0; r < MR; ++r) {
      T row[2 * L];
      std::memcpy(row, &acc0[r], sizeof(V));
      std::memcpy(row + L, &acc1[r], sizeof(V));
      std::memcpy(out + r * out_stride, row, cols * sizeof(T));
    }
  }
}

// The last rows - r < kMaxRows rows of a block: the micro-kernel of exactly that height.
template <typename T, int MR, bool Gated>
inline void tail_rows(int64_t rows, const T* x, int64_t x_stride, const T* panel, int64_t K,
                      const T* bias, T* out, int64_t out_stride, int64_t cols, const T* ahead) {
  if constexpr (MR > 0) {
    if (rows == MR)
      micro_kernel<T, MR, Gated>(x, x_stride, panel, K, bias, out, out_stride, cols, ahead);
    else
      tail_rows<T, MR - 1, Gated>(rows, x, x_stride, panel, K, bias, out, out_stride, cols, ahead);
  }
}

// The first row block prefetches `ahead` (the rest find this panel in L1/L2).
template <typename T, bool Gated>
void rows_times_panel(const T* x, int64_t x_stride, int64_t rows, const T* panel, int64_t K,
                      const T* bias, T* out, int64_t out_stride, int64_t cols, const T* ahead) {
  int64_t r = 0;
  for (; r + kMaxRows <= rows; r += kMaxRows)
    micro_kernel<T, kMaxRows, Gated>(x + r * x_stride, x_stride, panel, K, bias,
                                     out + r * out_stride, out_stride, cols,
                                     r == 0 ? ahead : nullptr);
  tail_rows<T, kMaxRows - 1, Gated>(rows - r, x + r * x_stride, x_stride, panel, K, bias,
                                    out + r * out_stride, out_stride, cols,
                                    r == 0 ? ahead : nullptr);
}

// N: output columns. A gated panel yields NR / 2 of them (see micro_kernel).
template <typename T, bool Gated>
void linear_impl(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& bias,
                 int64_t N, torch::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t NR = Gated ? panel_cols<T>() / 2 : panel_cols<T>();  // output columns a panel
  const int64_t panels = packed.size(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = packed.data_ptr<T>();
  const T* bp = bias.defined() ? bias.data_ptr<T>() : nullptr;
  T* op = out.data_ptr<T>();
  const int64_t x_stride = x.stride(0);
  // Row blocks of up to 64 rows keep x's block in L2 while a panel is reused
  // over it; every (row block, panel) pair is one unit of parallel work.
  const int64_t row_block = 64;
  const int64_t row_blocks = (M + row_block - 1) / row_block;
  at::parallel_for(0, panels * row_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t rb = i / panels, p = i % panels;
      const int64_t r0 = rb * row_block, rows = std::min(row_block, M - r0);
      const int64_t cols = std::min(NR, N - p * NR);
      const int64_t panel_elems = K * panel_cols<T>();
      // (a prompt chunk's many rows keep each panel long enough for the hardware)
      const T* ahead = M <= row_block && i + 1 < end ? wp + (i + 1) % panels * panel_elems : nullptr;
      rows_times_panel<T, Gated>(xp + r0 * x_stride, x_stride, rows, wp + p * panel_elems, K,
                                 bp != nullptr ? bp + p * NR : nullptr, op + r0 * N + p * NR, N,
                                 cols, ahead);
    }
  });
}

}  // namespace

namespace {

// Columns a panel holds for tensors of t's dtype; float32 and float64 only.
int64_t panel_cols_of(const torch::Tensor& t, const char* op) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kDouble, op,
              ": float32 or float64 only (got ", t.scalar_type(), ")");
  return t.scalar_type() == torch::kFloat ? panel_cols<float>() : panel_cols<double>();
}

// What linear and linear_gated both require: x [rows, K] with contiguous rows,
// and `packer`'s output for K, of x's dtype, on the CPU.
void check_operands(const torch::Tensor& x, const torch::Tensor& packed, const char* op,
                    const char* packer) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op,
              ": x must be [rows, in_features] with contiguous rows");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(1) == x.size(1), op,
              ": the packed weight must be ", packer, "'s output for in_features = ", x.size(1));
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), op,
              ": x and the weight must share a dtype (got ", x.scalar_type(), " and ",
              packed.scalar_type(), ")");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(packed.size(2) == panel_cols_of(x, op), op, ": packed for another dtype");
}

}  // namespace

// The extension's functions (also called by the decoder loop), in the anonymous
// namespace like the rest: each translation unit that includes this header gets
// its own copy, so any number of them can.
namespace {

// w [N, K] -> [ceil(N / NR), K, NR], columns past N zero; NR = 2 vectors of w's dtype.
torch::Tensor pack_weight(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2, "pack_weight: the weight must be [out_features, in_features]");
  const int64_t NR = panel_cols_of(w, "pack_weight");
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t panels = (N + NR - 1) / NR;
  auto padded = torch::zeros({panels * NR, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({panels, NR, K}).transpose(1, 2).contiguous();
}

// bias: a padded copy ([panels * NR], zeros past N) so the kernel reads whole vectors.
torch::Tensor pack_bias(torch::Tensor bias, int64_t panels) {
  const int64_t NR = panel_cols_of(bias, "pack_bias");
  auto padded = torch::zeros({panels * NR}, bias.options());
  padded.narrow(0, 0, bias.size(0)).copy_(bias);
  return padded;
}

torch::Tensor linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                     int64_t out_features) {
  check_operands(x, packed, "linear", "pack_weight");
  TORCH_CHECK(out_features <= packed.size(0) * packed.size(2), "linear: out_features too large");
  auto out = torch::empty({x.size(0), out_features}, x.options());
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = *bias;
    TORCH_CHECK(b.is_contiguous() && b.scalar_type() == x.scalar_type() &&
                    b.numel() == packed.size(0) * packed.size(2),
                "linear: the bias must be pack_bias's output");
  }
  if (x.size(0) == 0) return out;
  if (x.scalar_type() == torch::kFloat) linear_impl<float, false>(x, packed, b, out_features, out);
  else linear_impl<double, false>(x, packed, b, out_features, out);
  return out;
}

// w [2 * I, K] (gate rows, then up rows, as the fused gate/up projection) ->
// panels whose first NR / 2 columns are gate rows and last NR / 2 the same up
// rows: [ceil(I / (NR / 2)), K, NR], rows past I zero.
torch::Tensor pack_gated_weight(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.size(0) % 2 == 0,
              "pack_gated_weight: the weight must be [2 * inner, in_features] (gate, then up)");
  const int64_t half = panel_cols_of(w, "pack_gated_weight") / 2;
  const int64_t inner = w.size(0) / 2, K = w.size(1);
  const int64_t panels = (inner + half - 1) / half;
  auto gate = torch::zeros({panels * half, K}, w.options());
  auto up = torch::zeros({panels * half, K}, w.options());
  gate.narrow(0, 0, inner).copy_(w.narrow(0, 0, inner));
  up.narrow(0, 0, inner).copy_(w.narrow(0, inner, inner));
  auto interleaved = torch::cat({gate.view({panels, half, K}), up.view({panels, half, K})}, 1);
  return interleaved.transpose(1, 2).contiguous();
}

// silu(x @ gate.T) * (x @ up.T): [rows, inner] from pack_gated_weight's output.
torch::Tensor linear_gated(torch::Tensor x, torch::Tensor packed, int64_t inner) {
  check_operands(x, packed, "linear_gated", "pack_gated_weight");
  TORCH_CHECK(inner <= packed.size(0) * packed.size(2) / 2, "linear_gated: inner too large");
  auto out = torch::empty({x.size(0), inner}, x.options());
  if (x.size(0) == 0) return out;
  const torch::Tensor no_bias;
  if (x.scalar_type() == torch::kFloat) linear_impl<float, true>(x, packed, no_bias, inner, out);
  else linear_impl<double, true>(x, packed, no_bias, inner, out);
  return out;
}

}  // namespace
