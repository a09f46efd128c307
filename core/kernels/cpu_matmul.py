"""The CPU projections' matmul, chosen once per weight dtype from what the CPU offers.

Three paths, each over weights prepacked once (`servelab.executor.kernel_forward.PackedMatmul`):
- `onednn`: torch's oneDNN linear (`mkldnn._linear_pointwise`) over a weight
  reordered into oneDNN's blocked layout for this CPU. bfloat16 / float16 weights
  take it where oneDNN runs them on matrix units (AMX) or AVX512-BF16/FP16; a
  bfloat16 step of one row goes through `cpu_linear`'s row kernel over the model's
  own weight instead where the build has AVX512-BF16 (`PackedMatmul`).
- `onednn-upcast`: a bfloat16 / float16 weight on a CPU without those units is
  widened once to float32 (exact) and multiplied in float32: torch's bfloat16
  matmul there converts element by element and runs several times slower.
- `servelab`: `cpu_linear`'s packed micro-kernel (64-byte vectors), kept for
  float64 (the oracle's dtype: oneDNN has none) and for float32 on AVX-512 CPUs
  (what it was tuned on); without AVX-512 it runs an order of magnitude below MKL.
Inputs may be any floating dtype (cast to the path's); outputs are float32 for
reduced-precision weights, else the weight's dtype. `path_for` logs one line per
dtype naming the path and why.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import NamedTuple

import torch

log = logging.getLogger(__name__)

REDUCED = (torch.bfloat16, torch.float16)


@functools.cache
def _cpuinfo(field: str) -> str:
    """A field of the first CPU in Linux's /proc/cpuinfo (empty elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere)."""
    return frozenset(_cpuinfo("flags").split())


# Up to this many rows F.linear (MKL) beats oneDNN's blocked kernel over float32
# weights. On Intel CPUs MKL's gemv wins at one or two rows; elsewhere MKL takes its
# generic paths: its gemv (one row) is level with oneDNN, its two-row gemm 2-7x slower
# on the large projections (AMD Zen 3, measured), so a second row goes to oneDNN.
GEMV_ROWS = 2 if _cpuinfo("vendor_id") == "GenuineIntel" else 1


@functools.cache
def bf16_row_kernel():
    """`cpu_linear`'s bf16 row kernel (`gemv_bf16`) where this build has it (a CPU
    with AVX512-BF16), else None."""
    from servelab.kernels import cpu_linear

    module = cpu_linear.kernel()
    if module is None or not module.gemv_bf16_available():
        return None
    return module.gemv_bf16


class MatmulPath(NamedTuple):
    name: str  # "onednn", "onednn-upcast" or "servelab"
    compute_dtype: torch.dtype
    why: str


def _onednn_reduced(dtype: torch.dtype) -> str | None:
    """Why oneDNN runs `dtype` natively here, or None when it does not."""
    flags = cpu_flags()
    if dtype == torch.bfloat16:
        units = [f for f in ("amx_bf16", "avx512_bf16") if f in flags]
        supported = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    else:
        units = [f for f in ("amx_fp16", "avx512_fp16") if f in flags]
        supported = torch.ops.mkldnn._is_mkldnn_fp16_supported()
    if supported and units:
        return f"the CPU has {' and '.join(units)}"
    return None


@functools.cache
def path_for(dtype: torch.dtype) -> MatmulPath:
    """The path weights of `dtype` take on this CPU (logged once per dtype)."""
    avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    if dtype == torch.float64:
        path = MatmulPath("servelab", dtype, "oneDNN has no float64")
    elif dtype in REDUCED:
        native = _onednn_reduced(dtype)
        if native is not None:
            path = MatmulPath("onednn", dtype, f"{native}: weights prepacked for oneDNN")
        else:
            path = MatmulPath(
                "onednn-upcast", torch.float32,
                f"no {str(dtype).removeprefix('torch.')} matrix instructions "
                "(amx/avx512 bf16/fp16) on this CPU: weights widened to float32 once",
            )  # fmt: skip
    elif avx512:
        path = MatmulPath("servelab", dtype, "AVX-512: servelab's packed kernel")
    else:
        path = MatmulPath(
            "onednn", dtype, "no AVX-512 for servelab's kernel: weights prepacked for oneDNN"
        )
    log.info("servelab: CPU matmul for %s weights: %s (%s)", dtype, path.name, path.why)
    return path
