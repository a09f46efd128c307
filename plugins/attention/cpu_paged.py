"""A C++ paged decode-attention kernel for the CPU, built on first use.

Decode attention on a CPU is bound by memory traffic: each step reads every
running sequence's whole context once per layer. Gathering the pages into a
padded tensor and running SDPA over it reads and writes that data three times
(gather in, gather out, SDPA in) plus the padding; this kernel reads each key
and value exactly once, straight through the block table, with an online
softmax (FlashAttention's decode loop), one task per sequence on torch's
intra-op threads (a key slot holds every KV head: read once, whole).

Rules:
- float32 only (float64 keeps PyTorch's SDPA: the oracle's exactness never
  depends on this kernel); head_dim in `HEAD_DIMS`; any block size, any
  grouped-query ratio;
- built with `torch.utils.cpp_extension.load_inline` when an engine that
  uses it is built (about half a minute the first time; torch caches the
  build across processes); a machine without a C++ compiler, or
  `SERVELAB_CPU_KERNEL=0` in the environment, gets `None` from `kernel()`
  and a logged reason, and callers fall back to the SDPA path;
- `exp` is a Cephes-style polynomial (a couple of float32 ulps): results match
  SDPA to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import functools
import logging
import os
from types import ModuleType

import torch

log = logging.getLogger(__name__)

HEAD_DIMS = (16, 32, 64, 128, 256)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int kTile = 16;  // keys scored before one online-softmax update

// exp(x) for x <= 0 (softmax arguments): 2^n * P(r), Cephes' expf polynomial.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(float));
  return p * scale;
}

// One sequence, every head. A key slot holds all KV heads contiguously, so
// each slot is read once, whole; the next tile's slots are prefetched while
// this one is computed (blocks are scattered: the hardware cannot guess them).
template <int D>
void attend_seq(const float* q, const float* k_cache, const float* v_cache, const int32_t* table,
                int64_t len, int64_t block_size, int num_heads, int kv_heads, float scale,
                float* out, float* work) {
  const int group = num_heads / kv_heads;
  float* qs = work;                     // [num_heads][D], pre-scaled queries
  float* acc = qs + num_heads * D;      // [num_heads][D], unnormalised outputs
  float* scores = acc + num_heads * D;  // [num_heads][kTile]
  float* run_max = scores + num_heads * kTile;
  float* run_sum = run_max + num_heads;
  for (int h = 0; h < num_heads; ++h) {
    run_max[h] = -INFINITY;
    run_sum[h] = 0.f;
    for (int d = 0; d < D; ++d) {
      qs[h * D + d] = q[h * D + d] * scale;
      acc[h * D + d] = 0.f;
    }
  }
  const int64_t slot_stride = static_cast<int64_t>(kv_heads) * D;
  int64_t rows[kTile];       // element offset of each key slot of this tile
  int64_t next_rows[kTile];  // and of the next tile
  auto locate = [&](int64_t* r, int64_t start) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, len - start));
    for (int t = 0; t < n; ++t) {
      const int64_t pos = start + t;
      const int64_t slot = static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size;
      r[t] = slot * slot_stride;
    }
    return n;
  };
  int next_n = locate(next_rows, 0);
  for (int64_t start = 0; start < len; start += kTile) {
    const int n = next_n;
    std::copy(next_rows, next_rows + n, rows);
    if (start + kTile < len) {
      next_n = locate(next_rows, start + kTile);
      for (int t = 0; t < next_n; ++t) {
        for (int64_t c = 0; c < slot_stride; c += 16) {  // one 64-byte line at a time
          __builtin_prefetch(k_cache + next_rows[t] + c, 0, 3);
          __builtin_prefetch(v_cache + next_rows[t] + c, 0, 3);
        }
      }
    }
    for (int t = 0; t < n; ++t) {
      const float* k = k_cache + rows[t];
      for (int h = 0; h < num_heads; ++h) {
        const float* __restrict__ kh = k + (h / group) * D;
        const float* __restrict__ qh = qs + h * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int d = 0; d < D; ++d) dot += qh[d] * kh[d];
        scores[h * kTile + t] = dot;
      }
    }
    for (int h = 0; h < num_heads; ++h) {
      float* s = scores + h * kTile;
      float tile_max = run_max[h];
      for (int t = 0; t < n; ++t) tile_max = std::max(tile_max, s[t]);
      const float correction = exp_nonpositive(run_max[h] - tile_max);
      run_max[h] = tile_max;
      float tile_sum = 0.f;
#pragma omp simd reduction(+ : tile_sum)
      for (int t = 0; t < n; ++t) {
        const float e = exp_nonpositive(s[t] - tile_max);
        s[t] = e;
        tile_sum += e;
      }
      run_sum[h] = run_sum[h] * correction + tile_sum;
      float* a = acc + h * D;
#pragma omp simd
      for (int d = 0; d < D; ++d) a[d] *= correction;
    }
    for (int t = 0; t < n; ++t) {
      const float* v = v_cache + rows[t];
      for (int h = 0; h < num_heads; ++h) {
        const float* __restrict__ vh = v + (h / group) * D;
        const float p = scores[h * kTile + t];
        float* __restrict__ a = acc + h * D;
#pragma omp simd
        for (int d = 0; d < D; ++d) a[d] += p * vh[d];
      }
    }
  }
  for (int h = 0; h < num_heads; ++h) {
    const float inv = 1.f / run_sum[h];
    for (int d = 0; d < D; ++d) out[h * D + d] = acc[h * D + d] * inv;
  }
}

template <int D>
void attend_all(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                const torch::Tensor& block_tables, const torch::Tensor& seq_lens, float scale,
                torch::Tensor& out) {
  const int64_t num_seqs = q.size(0);
  const int num_heads = static_cast<int>(q.size(1));
  const int kv_heads = static_cast<int>(k_cache.size(2));
  const int64_t block_size = k_cache.size(1), width = block_tables.size(1);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const int64_t work_size = static_cast<int64_t>(num_heads) * (2 * D + kTile + 2);
  // thread w takes sequences w, w + T, w + 2T...: contexts of every length on each
  // thread (a contiguous split would give one thread the batch's long tail)
  const int64_t num_workers = std::min<int64_t>(at::get_num_threads(), num_seqs);
  at::parallel_for(0, num_workers, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> work(work_size);
    for (int64_t worker = begin; worker < end; ++worker) {
      for (int64_t seq = worker; seq < num_seqs; seq += num_workers) {
        attend_seq<D>(qp + seq * num_heads * D, kp, vp, tables + seq * width, lens[seq],
                      block_size, num_heads, kv_heads, scale, op + seq * num_heads * D,
                      work.data());
      }
    }
  });
}

}  // namespace

// q [num_seqs, num_heads, D]; caches [num_blocks, block_size, kv_heads, D];
// block_tables int32 [num_seqs, width]; seq_lens int32 [num_seqs] (>= 1).
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous());
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k_cache.scalar_type() == torch::kFloat);
  TORCH_CHECK(v_cache.scalar_type() == torch::kFloat && v_cache.sizes() == k_cache.sizes());
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt && seq_lens.scalar_type() == torch::kInt);
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(2) == k_cache.size(3));
  auto out = torch::empty_like(q);
  switch (q.size(2)) {
    case 16: attend_all<16>(q, k_cache, v_cache, block_tables, seq_lens, scale, out); break;
    case 32: attend_all<32>(q, k_cache, v_cache, block_tables, seq_lens, scale, out); break;
    case 64: attend_all<64>(q, k_cache, v_cache, block_tables, seq_lens, scale, out); break;
    case 128: attend_all<128>(q, k_cache, v_cache, block_tables, seq_lens, scale, out); break;
    case 256: attend_all<256>(q, k_cache, v_cache, block_tables, seq_lens, scale, out); break;
    default: TORCH_CHECK(false, "unsupported head_dim ", q.size(2));
  }
  return out;
}
"""


@functools.cache
def kernel() -> ModuleType | None:
    """The compiled extension, or None (logged once) when it cannot be built."""
    if os.environ.get("SERVELAB_CPU_KERNEL", "1") == "0":
        log.info("servelab: SERVELAB_CPU_KERNEL=0, the CPU paged-decode kernel is off")
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        return load_inline(
            name="servelab_cpu_paged_decode",
            cpp_sources=_SOURCE,
            functions=["paged_decode"],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no headers, a sandbox: fall back
        log.warning(
            "servelab: the CPU paged-decode kernel could not be built (%s); "
            "decode attention uses gathered pages and SDPA instead",
            exc,
        )
        return None


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel serves this layer's shapes and dtypes (it may still
    fail to build: see `kernel`)."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and k_cache.dtype == torch.float32
        and q.shape[-1] in HEAD_DIMS
        and q.shape[1] % k_cache.shape[2] == 0
        and k_cache.is_contiguous()
    )


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per sequence over its whole paged context:
    `q` `[num_seqs, num_heads, head_dim]` -> same shape. Call `supports` and
    `kernel` first."""
    return kernel().paged_decode(
        q.contiguous(), k_cache, v_cache, block_tables, seq_lens, float(scale)
    )
