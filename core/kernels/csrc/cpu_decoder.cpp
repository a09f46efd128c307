// Every decoder layer of one CPU step in a single call: the embedding lookup, then
// per layer the same kernel functions the Python loop calls, in the same order,
// on the same tensors (so the result is bit for bit the Python loop's), then the
// final norm. The kernels come from their headers, compiled into this one unit.
//
// Two kinds of layer (`layer`): servelab's packed float32 / float64 weights (any
// number of tokens), and bfloat16 weights as the model holds them for a step of one
// token, through the bf16 row kernel (`cpu_gemv_bf16.h`) with float32 activations.
#include "cpu_linear.h"
#include "cpu_gemv_bf16.h"
#include "cpu_fused.h"
#include "cpu_paged.h"

namespace {

c10::optional<torch::Tensor> present(const torch::Tensor& t) {
  if (t.numel() == 0) return c10::nullopt;
  return t;
}

// One layer after its input norm; returns its delta (the down projection's output).
// `kBf16Rows`: bfloat16 weights as the model holds them at one token, step for step
// `kernel_forward`'s Python loop over `PackedMatmul`s at one row: each projection's
// output rounded to bf16 and widened (`gemv_bf16` with `round`), q/k norms and RoPE in
// float32, q/k/v rounded to the cache's bf16 for attention, SwiGLU by torch's own bf16
// ops on the gate/up output. Otherwise servelab's packed weights, activations in their
// dtype throughout. `w`: LAYER_TENSORS (each projection's weight, then its bias).
template <bool kBf16Rows>
torch::Tensor layer(const torch::Tensor& residual, torch::Tensor h, const torch::Tensor* w,
                    const int64_t* n, const double* e, const torch::Tensor& k_cache,
                    const torch::Tensor& v_cache, const torch::Tensor& tables,
                    const torch::Tensor& lens, const torch::Tensor& slots,
                    const torch::Tensor& positions, const torch::Tensor& cos,
                    const torch::Tensor& sin, int64_t num_heads, int64_t num_kv_heads,
                    int64_t head_dim, double scale) {
  const int64_t tokens = h.size(0);
  // x @ w[i].T + w[i + 1] with out_features `out`
  const auto project = [&](const torch::Tensor& x, int i, int64_t out) {
    if constexpr (kBf16Rows) return gemv_bf16(x, w[i], present(w[i + 1]), true);
    return linear(x, w[i], present(w[i + 1]), out);
  };
  torch::Tensor qkv = project(h, 1, n[0]);
  qk_norm_rope_(qkv, present(w[3]), present(w[4]), e[1], cos, sin, positions, num_heads,
                num_kv_heads);
  if constexpr (kBf16Rows) qkv = qkv.to(k_cache.scalar_type());
  const auto qkv_heads = qkv.view({tokens, num_heads + 2 * num_kv_heads, head_dim})
                             .split_with_sizes({num_heads, num_kv_heads, num_kv_heads}, 1);
  store_kv(qkv_heads[1], qkv_heads[2], k_cache, v_cache, slots);
  torch::Tensor out = paged_decode(qkv_heads[0], k_cache, v_cache, tables, lens, scale);
  const torch::Tensor delta = project(out.reshape({tokens, num_heads * head_dim}), 5, n[1]);
  h = add_rms_norm(residual, delta, w[7], e[2]);
  torch::Tensor act;
  if constexpr (kBf16Rows) {
    const torch::Tensor gate_up = gemv_bf16(h, w[8], c10::nullopt, true).to(torch::kBFloat16);
    act = at::silu(gate_up.narrow(1, 0, n[2]));
    act.mul_(gate_up.narrow(1, n[2], n[2]));
  } else {
    act = linear_gated(h, w[8], n[2]);
  }
  return project(act, 9, n[3]);
}

}  // namespace

// input_ids int64 [T]; embed [vocab, hidden], contiguous; per layer
// LAYER_TENSORS, LAYER_INTS and LAYER_EPS flattened in that order; caches: per
// layer k_cache, v_cache. bfloat16 projection weights (one token, float32 norm
// weights and activations) take the bf16 row layer, the rest the packed one.
// Returns the final norm's output.
torch::Tensor decoder_forward(torch::Tensor input_ids, torch::Tensor embed,
                              std::vector<torch::Tensor> tensors,
                              std::vector<int64_t> ints, std::vector<double> eps,
                              std::vector<torch::Tensor> caches, torch::Tensor tables,
                              torch::Tensor lens, torch::Tensor slots, torch::Tensor positions,
                              torch::Tensor cos, torch::Tensor sin, int64_t num_heads,
                              int64_t num_kv_heads, int64_t head_dim, double scale,
                              torch::Tensor final_norm, double final_eps) {
  constexpr int64_t kTensors = 11, kInts = 4, kEps = 3;
  const int64_t layers = static_cast<int64_t>(caches.size()) / 2;
  TORCH_CHECK(static_cast<int64_t>(caches.size()) == 2 * layers &&
                  static_cast<int64_t>(tensors.size()) == kTensors * layers &&
                  static_cast<int64_t>(ints.size()) == kInts * layers &&
                  static_cast<int64_t>(eps.size()) == kEps * layers,
              "decoder_forward: per-layer arguments of different lengths");
  // the embeddings: each token's row of the table, copied as F.embedding does
  // (torch's index_select costs a parallel region for a few rows)
  TORCH_CHECK(input_ids.scalar_type() == torch::kLong && input_ids.dim() == 1 &&
                  input_ids.is_contiguous() && embed.dim() == 2 && embed.is_contiguous(),
              "decoder_forward: input_ids must be contiguous int64 [T], embed contiguous [vocab, hidden]");
  const int64_t tokens = input_ids.size(0), vocab = embed.size(0);
  const bool bf16_rows = layers > 0 && tensors[1].scalar_type() == torch::kBFloat16;
  TORCH_CHECK(!bf16_rows || tokens == 1,
              "decoder_forward: bfloat16 weights run one token a step, got ", tokens);
  const int64_t* ids = input_ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(ids[t] >= 0 && ids[t] < vocab, "decoder_forward: token id ", ids[t],
                " is outside the vocabulary [0, ", vocab, ")");
  torch::Tensor residual;
  if (embed.scalar_type() == torch::kBFloat16) {  // widened to the float32 activations
    residual = embed.index_select(0, input_ids).to(torch::kFloat32);
  } else {
    residual = torch::empty({tokens, embed.size(1)}, embed.options());
    const int64_t row_bytes = embed.size(1) * embed.element_size();
    const char* table = static_cast<const char*>(embed.data_ptr());
    char* rows = static_cast<char*>(residual.data_ptr());
    for (int64_t t = 0; t < tokens; ++t)
      std::memcpy(rows + t * row_bytes, table + ids[t] * row_bytes, row_bytes);
  }
  const auto layer_fn = bf16_rows ? layer<true> : layer<false>;
  torch::Tensor delta;
  for (int64_t l = 0; l < layers; ++l) {
    const torch::Tensor* w = tensors.data() + l * kTensors;
    const double* e = eps.data() + l * kEps;
    torch::Tensor h = l == 0 ? rms_norm(residual, w[0], e[0])
                             : add_rms_norm(residual, delta, w[0], e[0]);
    delta = layer_fn(residual, h, w, ints.data() + l * kInts, e, caches[2 * l], caches[2 * l + 1],
                     tables, lens, slots, positions, cos, sin, num_heads, num_kv_heads,
                     head_dim, scale);
  }
  if (layers == 0) return rms_norm(residual, final_norm, final_eps);
  return add_rms_norm(residual, delta, final_norm, final_eps);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decoder_forward", torch::wrap_pybind_function(decoder_forward), "decoder_forward");
}
