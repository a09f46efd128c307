// The fused element-wise extension: cpu_fused.h's functions, bound for Python.
#include "cpu_fused.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", torch::wrap_pybind_function(rms_norm), "rms_norm");
  m.def("add_rms_norm", torch::wrap_pybind_function(add_rms_norm), "add_rms_norm");
  m.def("qk_norm_rope_", torch::wrap_pybind_function(qk_norm_rope_), "qk_norm_rope_");
  m.def("argmax_rows", torch::wrap_pybind_function(argmax_rows), "argmax_rows");
}
