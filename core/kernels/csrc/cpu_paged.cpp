// The paged-attention extension: cpu_paged.h's functions, bound for Python.
#include "cpu_paged.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", torch::wrap_pybind_function(paged_decode), "paged_decode");
  m.def("store_kv", torch::wrap_pybind_function(store_kv), "store_kv");
}
