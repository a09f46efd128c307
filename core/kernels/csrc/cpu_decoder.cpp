// Every decoder layer of one CPU step in a single call: the embedding lookup, then
// per layer the same kernel functions the Python loop calls, in the same order,
// on the same tensors (so the result is bit for bit the Python loop's), then the
// final norm. The kernels come from their headers, compiled into this one unit.
#include "cpu_linear.h"
#include "cpu_fused.h"
#include "cpu_paged.h"

namespace {

c10::optional<torch::Tensor> present(const torch::Tensor& t) {
  if (t.numel() == 0) return c10::nullopt;
  return t;
}

}  // namespace

// input_ids int64 [T]; embed [vocab, hidden], contiguous; per layer
// LAYER_TENSORS, LAYER_INTS and LAYER_EPS flattened in that order; caches: per
// layer k_cache, v_cache. Returns the final norm's output.
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
  torch::Tensor residual = torch::empty({tokens, embed.size(1)}, embed.options());
  const int64_t row_bytes = embed.size(1) * embed.element_size();
  const int64_t* ids = input_ids.data_ptr<int64_t>();
  const char* table = static_cast<const char*>(embed.data_ptr());
  char* rows = static_cast<char*>(residual.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(ids[t] >= 0 && ids[t] < vocab, "decoder_forward: token id ", ids[t],
                " is outside the vocabulary [0, ", vocab, ")");
    std::memcpy(rows + t * row_bytes, table + ids[t] * row_bytes, row_bytes);
  }
  torch::Tensor delta;
  for (int64_t l = 0; l < layers; ++l) {
    const torch::Tensor* w = tensors.data() + l * kTensors;
    const int64_t* n = ints.data() + l * kInts;
    const double* e = eps.data() + l * kEps;
    const torch::Tensor& k_cache = caches[2 * l];
    const torch::Tensor& v_cache = caches[2 * l + 1];
    torch::Tensor h = l == 0 ? rms_norm(residual, w[0], e[0])
                             : add_rms_norm(residual, delta, w[0], e[0]);
    torch::Tensor qkv = linear(h, w[1], present(w[2]), n[0]);
    qk_norm_rope_(qkv, present(w[3]), present(w[4]), e[1], cos, sin, positions, num_heads,
                  num_kv_heads);
    const auto qkv_heads = qkv.view({tokens, num_heads + 2 * num_kv_heads, head_dim})
                               .split_with_sizes({num_heads, num_kv_heads, num_kv_heads}, 1);
    store_kv(qkv_heads[1], qkv_heads[2], k_cache, v_cache, slots);
    torch::Tensor out = paged_decode(qkv_heads[0], k_cache, v_cache, tables, lens, scale);
    delta = linear(out.reshape({tokens, num_heads * head_dim}), w[5], present(w[6]), n[1]);
    h = add_rms_norm(residual, delta, w[7], e[2]);
    delta = linear(linear_gated(h, w[8], n[2]), w[9], present(w[10]), n[3]);
  }
  if (layers == 0) return rms_norm(residual, final_norm, final_eps);
  return add_rms_norm(residual, delta, final_norm, final_eps);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decoder_forward", torch::wrap_pybind_function(decoder_forward), "decoder_forward");
}
