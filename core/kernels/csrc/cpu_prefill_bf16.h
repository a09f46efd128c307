// Paged causal attention for prompt chunks over bfloat16 caches, for CPUs with
// AVX512-BF16 (`vdpbf16ps`): FlashAttention's prefill loop, reading the keys and
// values straight through the block table.
//
// Why: torch's CPU flash attention runs a bf16 prompt's attention at about 70
// GFLOP/s here (a sixth of the bf16 matmul peak; the same rate as float32), which
// made it 20-30% of a bf16 prefill step on Qwen3-0.6B's shape.
//
// A work item is one KV head of one sequence. Its keys are packed once into
// 16-key tiles of bf16 pairs (lane l of row p holds key l's elements 2p, 2p+1) and
// its values into pairs of keys (element d of keys 2t and 2t+1 side by side), then
// its query rows (every query head of the group, at every token) are taken 16 at a
// time:
// - scores: one `vdpbf16ps` multiplies a query's pair of elements (broadcast) by
//   that pair of 16 keys, so a tile's 16 scores come out in the lanes of one
//   register, summed in float32 from exact products;
// - an online softmax in float32 over the tiles, the causal mask bottom-right
//   aligned (query j of `lq` over `lk` keys sees keys 0 .. lk - lq + j);
// - each probability is rounded to bf16, as torch's kernel rounds it, and one
//   `vdpbf16ps` weights a pair of keys' values by their pair of probabilities
//   (keeping them float32 with widened values ran at 1/1.2 to 1/1.5 the rate);
//   the softmax's sum keeps the unrounded float32 probabilities;
// - the output is rounded to bf16 once, to nearest even.
// Deterministic: an item runs whole on one thread, its tiles in key order.
#pragma once

#include "cpu_paged.h"

#include <algorithm>
#include <memory>
#include <numeric>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512BF16__)
constexpr bool kPrefillBf16 = true;
constexpr int kKeyTile = 16;    // keys a tile: one register of float32 scores
constexpr int kQueryRows = 16;  // query rows computed together against a tile

// One item's keys and values, packed for the loops below (reused across items).
template <int D>
struct PackedContext {
  static constexpr int kPairs = D / 2;
  std::vector<uint32_t> keys;  // [tiles][kPairs][kKeyTile]: a tile's pair p, key l
  // [tiles][kKeyTile / 2][D]: a tile's key pair t (keys 2t, 2t + 1), element d
  std::vector<uint32_t> values;

  // The `len` keys of one KV head (`k_head` / `v_head`: its row in slot 0) of a
  // sequence, through its table.
  void pack(const uint16_t* k_head, const uint16_t* v_head, KeyWalk walk, int64_t len) {
    const int64_t tiles = (len + kKeyTile - 1) / kKeyTile;
    keys.assign(tiles * kPairs * kKeyTile, 0);
    values.assign(tiles * kKeyTile / 2 * D, 0);
    for (int64_t t = 0; t < len; ++t) {
      int64_t row;
      walk.next(&row, 1);
      uint32_t pairs[kPairs];
      std::memcpy(pairs, k_head + row, sizeof(pairs));
      uint32_t* tile = keys.data() + t / kKeyTile * kPairs * kKeyTile + t % kKeyTile;
      for (int p = 0; p < kPairs; ++p) tile[p * kKeyTile] = pairs[p];
      uint32_t* value = values.data() + t / 2 * D;  // key 2t' in the low half
      const int shift = t % 2 * 16;
      for (int d = 0; d < D; ++d) value[d] |= static_cast<uint32_t>(v_head[row + d]) << shift;
    }
  }
};

// 16 query rows' online softmax over the tiles, and their unnormalised outputs.
template <int D>
struct RowBlock {
  static constexpr int kPairs = D / 2, V = D / 16;
  const uint32_t* q[kQueryRows];  // each row's bf16 pairs, in the query
  int64_t pos[kQueryRows];        // the last key each row sees
  float run_max[kQueryRows], run_sum[kQueryRows];
  alignas(64) uint32_t pairs[kQueryRows][kPairs];  // the rows' pairs, side by side
  alignas(64) uint32_t probs[kQueryRows][kKeyTile / 2];  // bf16 pairs
  alignas(64) float acc[kQueryRows][D];

  void start() {
    for (int r = 0; r < kQueryRows; ++r) {
      run_max[r] = -INFINITY;
      run_sum[r] = 0;
    }
    std::memset(acc, 0, sizeof(acc));
    for (int r = 0; r < kQueryRows; ++r) std::memcpy(pairs[r], q[r], sizeof(pairs[r]));
  }

  // One tile of keys, starting at key `first`.
  void update(const uint32_t* tile, const uint32_t* values, int64_t first, float scale) {
    __m512 s[kQueryRows];
    for (int r = 0; r < kQueryRows; ++r) s[r] = _mm512_setzero_ps();
    for (int p = 0; p < kPairs; ++p) {
      const __m512bh k = (__m512bh)_mm512_loadu_si512(tile + p * kKeyTile);
      for (int r = 0; r < kQueryRows; ++r)
        s[r] = _mm512_dpbf16_ps(s[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[r][p])), k);
    }
    const __m512i key = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(first)),
                                         _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                           12, 13, 14, 15));
    float correction[kQueryRows];
    for (int r = 0; r < kQueryRows; ++r) {
      const __mmask16 seen =
          _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(pos[r])));
      const __m512 scores = _mm512_mul_ps(s[r], _mm512_set1_ps(scale));
      const float tile_max = _mm512_mask_reduce_max_ps(seen, scores);  // -inf: nothing seen
      const float top = std::max(run_max[r], tile_max);
      if (top == -INFINITY) {  // no key yet (only in a row's tiles before its first)
        correction[r] = 1;
        std::memset(probs[r], 0, sizeof(probs[r]));
        continue;
      }
      correction[r] = exp_nonpositive(Simd<float>::vec{} + (run_max[r] - top))[0];
      run_max[r] = top;
      const __m512 shifted = _mm512_maskz_sub_ps(seen, scores, _mm512_set1_ps(top));
      const __m512 e = bits_as<__m512>(exp_nonpositive(bits_as<Simd<float>::vec>(shifted)));
      const __m512 p = _mm512_maskz_mov_ps(seen, e);
      run_sum[r] = run_sum[r] * correction[r] + _mm512_reduce_add_ps(p);
      _mm256_store_si256(reinterpret_cast<__m256i*>(probs[r]), (__m256i)_mm512_cvtneps_pbh(p));
    }
    // acc[r] = acc[r] * correction + sum over keys of p[r][key] * value[key], two rows
    // at a time: 2 x V accumulators and V value registers
    for (int r = 0; r < kQueryRows; r += 2) {
      __m512 a0[V], a1[V];
      const __m512 c0 = _mm512_set1_ps(correction[r]), c1 = _mm512_set1_ps(correction[r + 1]);
      for (int j = 0; j < V; ++j) {
        a0[j] = _mm512_mul_ps(_mm512_load_ps(acc[r] + 16 * j), c0);
        a1[j] = _mm512_mul_ps(_mm512_load_ps(acc[r + 1] + 16 * j), c1);
      }
      for (int t = 0; t < kKeyTile / 2; ++t) {
        const auto p0 = (__m512bh)_mm512_set1_epi32(static_cast<int>(probs[r][t]));
        const auto p1 = (__m512bh)_mm512_set1_epi32(static_cast<int>(probs[r + 1][t]));
        const uint32_t* value = values + t * D;
        for (int j = 0; j < V; ++j) {
          const auto v = (__m512bh)_mm512_loadu_si512(value + 16 * j);
          a0[j] = _mm512_dpbf16_ps(a0[j], p0, v);
          a1[j] = _mm512_dpbf16_ps(a1[j], p1, v);
        }
      }
      for (int j = 0; j < V; ++j) {
        _mm512_store_ps(acc[r] + 16 * j, a0[j]);
        _mm512_store_ps(acc[r + 1] + 16 * j, a1[j]);
      }
    }
  }

  void finish(uint16_t* const (&out)[kQueryRows], int rows) const {
    for (int r = 0; r < rows; ++r) {
      const float inv = run_sum[r] > 0 ? 1 / run_sum[r] : 0;
      for (int j = 0; j < V; ++j)
        store_narrow<uint16_t>(out[r] + 16 * j,
                               load<Simd<float>::vec>(acc[r] + 16 * j) * inv);
    }
  }
};

template <int D>
void prefill_all(const torch::Tensor& q, const torch::Tensor& k_cache,
                 const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                 const torch::Tensor& q_starts, const torch::Tensor& seq_lens, float scale,
                 torch::Tensor& out) {
  const int64_t num_seqs = seq_lens.size(0), num_heads = q.size(1), kv_heads = k_cache.size(2);
  const int64_t group = num_heads / kv_heads, block_size = k_cache.size(1);
  const int64_t width = block_tables.size(1), q_stride = q.stride(0);
  const auto* qp = static_cast<const uint16_t*>(q.data_ptr());
  const auto* kp = static_cast<const uint16_t*>(k_cache.data_ptr());
  const auto* vp = static_cast<const uint16_t*>(v_cache.data_ptr());
  auto* op = static_cast<uint16_t*>(out.data_ptr());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* starts = q_starts.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  // items, the costliest (queries x keys) first, so the last ones to finish are short
  const int64_t items = num_seqs * kv_heads;
  std::vector<int64_t> order(items);
  std::iota(order.begin(), order.end(), 0);
  auto cost = [&](int64_t item) {
    const int64_t seq = item / kv_heads;
    return static_cast<int64_t>(starts[seq + 1] - starts[seq]) * lens[seq];
  };
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return cost(a) > cost(b); });
  std::atomic<int64_t> next_item{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(items, 1));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    PackedContext<D> context;
    auto block = std::make_unique<RowBlock<D>>();
    for (int64_t i = next_item.fetch_add(1, std::memory_order_relaxed); i < items;
         i = next_item.fetch_add(1, std::memory_order_relaxed)) {
      const int64_t seq = order[i] / kv_heads, head = order[i] % kv_heads;
      const int64_t lq = starts[seq + 1] - starts[seq], lk = lens[seq];
      if (lq == 0) continue;
      context.pack(kp + head * D, vp + head * D, KeyWalk{tables + seq * width, block_size, kv_heads * D},
                   lk);
      const int64_t rows = lq * group;  // row m: token m / group, query head head * group + m % group
      for (int64_t m0 = 0; m0 < rows; m0 += kQueryRows) {
        const int n = static_cast<int>(std::min<int64_t>(kQueryRows, rows - m0));
        uint16_t* outs[kQueryRows];
        for (int r = 0; r < kQueryRows; ++r) {
          const int64_t m = m0 + std::min(r, n - 1);  // short blocks repeat their last row
          const int64_t token = starts[seq] + m / group, h = head * group + m % group;
          block->q[r] = reinterpret_cast<const uint32_t*>(qp + token * q_stride + h * D);
          block->pos[r] = lk - lq + m / group;
          outs[r] = op + (token * num_heads + h) * D;
        }
        block->start();
        const int64_t last = block->pos[kQueryRows - 1];  // the block's last row sees the most
        for (int64_t first = 0; first <= last && first < lk; first += kKeyTile)
          block->update(context.keys.data() + first / kKeyTile * (D / 2) * kKeyTile,
                        context.values.data() + first / 2 * D, first, scale);
        block->finish(outs, n);
      }
    }
  });
}
#else
constexpr bool kPrefillBf16 = false;
#endif

}  // namespace

namespace {

// Prompt chunks' attention over bf16 caches: sequence i's queries are q's rows
// q_starts[i] .. q_starts[i + 1] (int32), over its seq_lens[i] keys through row i
// of block_tables, causal and bottom-right aligned; writes those rows of `out`
// ([tokens, num_heads, D], contiguous). q: any stride between tokens, each token's
// heads contiguous. Only where `paged_prefill_bf16_available()`.
void paged_prefill_bf16(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                        torch::Tensor block_tables, torch::Tensor q_starts,
                        torch::Tensor seq_lens, double scale, torch::Tensor out) {
  TORCH_CHECK(kPrefillBf16, "paged_prefill_bf16: this build has no AVX512-BF16");
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && k_cache.scalar_type() == torch::kBFloat16 &&
                  v_cache.scalar_type() == torch::kBFloat16 &&
                  out.scalar_type() == torch::kBFloat16,
              "paged_prefill_bf16: q, the caches and out must be bfloat16");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous(),
              "paged_prefill_bf16: the caches and out must be contiguous");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && (q.size(1) == 1 || q.stride(1) == q.size(2)),
              "paged_prefill_bf16: each token's query heads must be contiguous");
  TORCH_CHECK(out.sizes() == q.sizes(), "paged_prefill_bf16: out must be shaped like q");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous() && q_starts.is_contiguous(),
              "paged_prefill_bf16: block_tables, q_starts and seq_lens must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt && seq_lens.scalar_type() == torch::kInt &&
                  q_starts.scalar_type() == torch::kInt,
              "paged_prefill_bf16: block_tables, q_starts and seq_lens must be int32");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && k_cache.dim() == 4);
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(2) == k_cache.size(3));
  TORCH_CHECK(q_starts.size(0) == seq_lens.size(0) + 1 && block_tables.size(0) >= seq_lens.size(0));
  const int32_t* starts = q_starts.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  for (int64_t i = 0; i < seq_lens.size(0); ++i) {
    TORCH_CHECK(starts[i] >= 0 && starts[i] <= starts[i + 1] && starts[i + 1] <= q.size(0),
                "paged_prefill_bf16: q_starts must rise within q's rows");
    TORCH_CHECK(lens[i] >= starts[i + 1] - starts[i] &&
                    (lens[i] + k_cache.size(1) - 1) / k_cache.size(1) <= block_tables.size(1),
                "paged_prefill_bf16: a sequence's keys must cover its queries and fit its table");
  }
#if defined(__AVX512BF16__)
  const auto s = static_cast<float>(scale);
  switch (q.size(2)) {
    case 16: return prefill_all<16>(q, k_cache, v_cache, block_tables, q_starts, seq_lens, s, out);
    case 32: return prefill_all<32>(q, k_cache, v_cache, block_tables, q_starts, seq_lens, s, out);
    case 64: return prefill_all<64>(q, k_cache, v_cache, block_tables, q_starts, seq_lens, s, out);
    case 128: return prefill_all<128>(q, k_cache, v_cache, block_tables, q_starts, seq_lens, s, out);
    case 256: return prefill_all<256>(q, k_cache, v_cache, block_tables, q_starts, seq_lens, s, out);
    default: TORCH_CHECK(false, "paged_prefill_bf16: unsupported head_dim ", q.size(2));
  }
#endif
}

bool paged_prefill_bf16_available() { return kPrefillBf16; }

}  // namespace
