"""Every decoder layer of one CPU step in a single C++ call.

`kernel_forward` runs a layer as eight kernel calls plus the attention
backend's `forward`, from Python. The kernels are fast enough that the Python
between them shows: a reference-workload run spends about a fifth of the main
thread's time outside the kernels while the other core waits, and that glue runs
cache-cold, after each step has streamed ~50 MB of K/V through the caches.
When the backend says a step's attention is exactly the C++ paged kernel
(`AttentionBackend.cpu_paged_kernel_inputs`: `cpu_paged.store_kv` at the
plan's slots, then `cpu_paged.paged_decode` over a table and lengths), this
module runs the whole layer loop in C++ instead, from the embedding lookup (a
row copy per token, as `F.embedding` makes) to the final norm: the same kernel
functions, in the same order, on the same tensors, so the result is bit for
bit the Python loop's. Like the rest of the kernel path it calls no module,
so forward hooks on the embedding or the layers do not run.

The extension is one translation unit of the three kernels' sources (matmul,
fused element-wise, paged attention) and the loop, built like them (see
`servelab.kernels.cpp_extension`). The paged-attention source comes from the
`flash_varlen` backend's `cpu_paged` module: the one place the model reaches
into a built-in plugin, because this loop exists only to run that kernel.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from servelab.kernels import cpu_fused, cpu_linear
from servelab.kernels.cpp_extension import SIMD_PRELUDE, build_inline

# One layer's tensors in the order the loop reads them; an absent optional
# weight (a bias, Qwen3's q/k norms on other models) is an empty tensor.
LAYER_TENSORS = (
    "attn_norm",
    "qkv_packed",
    "qkv_bias",
    "q_norm",
    "k_norm",
    "o_packed",
    "o_bias",
    "mlp_norm",
    "gate_up_packed",
    "down_packed",
    "down_bias",
)
LAYER_INTS = ("qkv_out", "o_out", "inner", "down_out")
LAYER_EPS = ("attn_eps", "qk_eps", "mlp_eps")

_LOOP = r"""
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
"""


def _body(source: str) -> str:
    """A kernel's source without the shared prelude it starts with."""
    assert source.startswith(SIMD_PRELUDE)
    return source[len(SIMD_PRELUDE) :]


@functools.cache
def kernel() -> ModuleType | None:
    """The compiled extension, or None (logged once) when it cannot be built."""
    from servelab.kernels import cpu_paged  # the attention kernel's source

    source = (
        SIMD_PRELUDE
        + _body(cpu_linear._SOURCE)
        + _body(cpu_fused._SOURCE)
        + _body(cpu_paged._SOURCE)
        + _LOOP
    )
    return build_inline(
        "servelab_cpu_decoder",
        source,
        ["decoder_forward"],
        what="CPU decoder loop",
        fallback="the model's layers run one kernel call at a time from Python",
    )


def layer_arguments(layers) -> tuple[list[torch.Tensor], list[int], list[float]]:
    """`KernelForward`'s layer programs flattened for `decoder_forward`."""
    empty = torch.empty(0)

    def given(t: torch.Tensor | None) -> torch.Tensor:  # an absent weight: empty
        return empty if t is None else t

    tensors: list[torch.Tensor] = []
    ints: list[int] = []
    eps: list[float] = []
    for layer in layers:
        tensors += [
            layer.attn_norm,
            layer.qkv.packed,
            given(layer.qkv.bias),
            given(layer.q_norm),
            given(layer.k_norm),
            layer.o.packed,
            given(layer.o.bias),
            layer.mlp_norm,
            layer.gate_up.packed,
            layer.down.packed,
            given(layer.down.bias),
        ]
        ints += [layer.qkv.out_features, layer.o.out_features, layer.gate_up.inner]
        ints += [layer.down.out_features]
        eps += [layer.attn_eps, layer.qk_eps, layer.mlp_eps]
    return tensors, ints, eps
