// The packed-weight matmul extension: cpu_linear.h's functions, and cpu_gemv_bf16.h's
// decode matmul over bfloat16 weights, bound for Python.
#include "cpu_linear.h"
#include "cpu_gemv_bf16.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_weight", torch::wrap_pybind_function(pack_weight), "pack_weight");
  m.def("pack_bias", torch::wrap_pybind_function(pack_bias), "pack_bias");
  m.def("linear", torch::wrap_pybind_function(linear), "linear");
  m.def("pack_gated_weight", torch::wrap_pybind_function(pack_gated_weight), "pack_gated_weight");
  m.def("linear_gated", torch::wrap_pybind_function(linear_gated), "linear_gated");
  m.def("gemv_bf16", torch::wrap_pybind_function(gemv_bf16), "gemv_bf16");
  m.def("gemv_bf16_available", &gemv_bf16_available, "gemv_bf16_available");
}
