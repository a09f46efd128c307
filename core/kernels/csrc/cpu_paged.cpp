// The paged-attention extension: cpu_paged.h's functions, bound for Python.
#include "cpu_paged.h"
#include "cpu_prefill_bf16.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", torch::wrap_pybind_function(paged_decode), "paged_decode");
  m.def("paged_prefill_bf16", torch::wrap_pybind_function(paged_prefill_bf16),
        "paged_prefill_bf16");
  m.def("paged_prefill_bf16_available", &paged_prefill_bf16_available,
        "paged_prefill_bf16_available");
  m.def("store_kv", torch::wrap_pybind_function(store_kv), "store_kv");
}
