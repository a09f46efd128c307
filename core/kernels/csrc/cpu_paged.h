// Paged decode attention for the CPU, and the K/V store that feeds it.
//
// Decode attention on a CPU is bound by memory traffic. `paged_decode` reads
// each key and value exactly once, straight through the block table, with an
// online softmax (FlashAttention's decode loop). A work item is one KV head of
// one sequence with the query heads of its group, so each K/V row is read once
// for all of them; items go to torch's intra-op threads through an atomic
// counter, and the next keys' scattered pages are prefetched into L2. A thread
// claims its next item before it runs the current one, so the prefetch runs on
// from the current item's last keys into the next one's first. In float32 a
// tile's 16 dot products per query head are summed by one transposing reduction
// (`reduce_add_16`: the same pairwise sums, in the same order, as 16 separate
// `reduce_add`s, so results are bit for bit the same) in a quarter of the
// instructions. Deterministic: a work item runs whole on one thread, in key order.
//
// bfloat16 q and caches (`C` = `uint16_t`, bf16's bits) are computed in float32:
// each q, K and V row is widened as it is loaded (bf16 is float32's top half, so
// widening is exact), the softmax and the sums run in float32, and the output is
// rounded to bf16 once, to nearest even as torch rounds. The cache is read at
// half float32's bytes, which is what decode attention's time is made of. With
// AVX512-BF16 (and heads of whole 32-element registers) the scores come from
// `vdpbf16ps` on q and K as stored, and V is widened as even and odd halves by
// integer ops: widening in order took two shuffles a register, and on AMD Zen 4
// those made the kernel shuffle-bound (62 against 100 cycles a key and KV head
// with the cache in L2; 16.3 -> 18.3 GB/s streaming a 20-sequence decode batch).
#pragma once

#include "simd.h"

#include <atomic>
#include <type_traits>
// AVX2 (with FMA) but not AVX-512: a few loops the compiler lowers badly from
// 64-byte vectors there are written for ymm registers, with the same arithmetic.
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define SERVELAB_PAGED_AVX2 1
#include <immintrin.h>
#else
#define SERVELAB_PAGED_AVX2 0
#endif
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

// How far ahead of the key being computed its slots are prefetched, in keys,
// into L2 (`prefetcht1`): pages are scattered, so the hardware cannot guess the
// next one, and prefetching into L1 evicts what is being computed (measured on
// the reference decode shape: L2 at 32 keys streams from DRAM about twice as
// fast as L1 at 16).
constexpr int kPrefetchKeys = 32;
constexpr int kPrefetchLocality = 2;

// Storage -> compute: a row of C (the caches' and q's element type: float,
// double, or bf16's bits as uint16_t) as the compute type's vectors.
template <typename C>
struct Compute { using type = C; };
template <>
struct Compute<uint16_t> { using type = float; };

typedef uint16_t bf16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

// One vector of the compute type from `Simd<T>::kLanes` elements at p.
template <typename C>
inline typename Simd<typename Compute<C>::type>::vec load_wide(const C* p) {
  using vec = typename Simd<typename Compute<C>::type>::vec;
  if constexpr (std::is_same_v<C, uint16_t>) {  // exact: bf16 is float32's top 16 bits
    return bits_as<vec>(__builtin_convertvector(load<bf16x16>(p), u32x16) << 16);
  } else {
    return load<vec>(p);
  }
}

// One vector stored as C: bf16 rounded to nearest even, as torch rounds; a NaN
// stays a NaN (0x7FC0, c10::BFloat16's quiet NaN).
template <typename C>
inline void store_narrow(C* p, typename Simd<typename Compute<C>::type>::vec v) {
  if constexpr (std::is_same_v<C, uint16_t>) {
    const u32x16 bits = bits_as<u32x16>(v);
    u32x16 rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    rounded = (bits & 0x7FFFFFFFu) > 0x7F800000u ? u32x16{} + 0x7FC0u : rounded;
    store(p, __builtin_convertvector(rounded, bf16x16));
  } else {
    store(p, v);
  }
}

// The largest lane, halves folded onto each other (see `reduce_add`).
template <typename T>
inline T reduce_max(typename Simd<T>::vec v) {
  using S = Simd<T>;
#if SERVELAB_PAGED_AVX2
  if constexpr (S::kLanes == 16) {  // the same comparisons on two ymm halves (see reduce_add_16)
    float x[16];
    std::memcpy(x, &v, sizeof(x));
    const __m256 h = _mm256_max_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8));  // a > b ? a : b
    const __m128 q = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    float r[4];
    _mm_storeu_ps(r, q);
    return std::max(std::max(r[0], r[2]), std::max(r[1], r[3]));
  }
#endif
  const auto halves = bits_as<std::array<typename S::half, 2>>(v);
  const typename S::half h = halves[0] > halves[1] ? halves[0] : halves[1];
  const auto quarters = bits_as<std::array<typename S::quarter, 2>>(h);
  const typename S::quarter q = quarters[0] > quarters[1] ? quarters[0] : quarters[1];
  if constexpr (S::kLanes == 16) return std::max(std::max(q[0], q[2]), std::max(q[1], q[3]));
  else return std::max(q[0], q[1]);
}

// reduce_add of 16 float32 vectors at once: lane t of the result is exactly
// reduce_add(d[t]) (the same pairwise sums in the same order), but the four
// folding steps run on whole vectors holding 2, 4, 8, then 16 keys' partial
// sums: 15 shuffle-add pairs for a tile instead of 16 separate reductions.
inline Simd<float>::vec reduce_add_16(const Simd<float>::vec (&d)[16]) {
  using vec = Simd<float>::vec;
  vec halves[8], quarters[4], pairs[2];
  for (int m = 0; m < 8; ++m)  // keys 2m, 2m+1: v[i] + v[i + 8], 8 lanes each
    halves[m] = __builtin_shufflevector(d[2 * m], d[2 * m + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17,
                                        18, 19, 20, 21, 22, 23) +
                __builtin_shufflevector(d[2 * m], d[2 * m + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                        25, 26, 27, 28, 29, 30, 31);
  for (int m = 0; m < 4; ++m)  // keys 4m..4m+3: h[i] + h[i + 4], 4 lanes each
    quarters[m] = __builtin_shufflevector(halves[2 * m], halves[2 * m + 1], 0, 1, 2, 3, 8, 9, 10,
                                          11, 16, 17, 18, 19, 24, 25, 26, 27) +
                  __builtin_shufflevector(halves[2 * m], halves[2 * m + 1], 4, 5, 6, 7, 12, 13, 14,
                                          15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int m = 0; m < 2; ++m)  // keys 8m..8m+7: (q[0] + q[2]), (q[1] + q[3])
    pairs[m] = __builtin_shufflevector(quarters[2 * m], quarters[2 * m + 1], 0, 1, 4, 5, 8, 9, 12,
                                       13, 16, 17, 20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(quarters[2 * m], quarters[2 * m + 1], 2, 3, 6, 7, 10, 11,
                                       14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(pairs[0], pairs[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22,
                                 24, 26, 28, 30) +
         __builtin_shufflevector(pairs[0], pairs[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23,
                                 25, 27, 29, 31);
}

// Where a sequence's keys live, in order, without a division per key.
struct KeyWalk {
  const int32_t* table;
  int64_t block_size, slot_stride;  // slot_stride: elements from one slot to the next
  int64_t block = 0, offset = 0;
  void next(int64_t* rows, int n) {  // element offsets of the next n keys' slots
    for (int t = 0; t < n; ++t) {
      rows[t] = (static_cast<int64_t>(table[block]) * block_size + offset) * slot_stride;
      if (++offset == block_size) {
        offset = 0;
        ++block;
      }
    }
  }
};

// G query heads sharing one KV head, D elements a head: pre-scaled queries,
// unnormalised outputs, the online softmax's running max and sum. Keys come in
// tiles of one vector of scores; each K and V row is read once for all G heads.
template <typename C, int D, int G>
struct GroupState {
  using T = typename Compute<C>::type;
  using S = Simd<T>;
  using vec = typename S::vec;
  static constexpr int kTile = S::kLanes;
  static constexpr int V = D / S::kLanes;  // vectors per head row
#if defined(__AVX512BF16__)
  // bf16 with `vdpbf16ps`, for rows of whole registers (32 elements): scores are
  // summed from exact products of q and K as stored (no widening), then scaled;
  // V is widened in two halves per register (even elements shifted up, odd ones
  // masked: two integer ops, where widening in order takes two shuffles), so
  // acc[g][2c] holds the even and acc[g][2c + 1] the odd elements of row part c
  static constexpr bool kDot = std::is_same_v<C, uint16_t> && D % 32 == 0;
#else
  static constexpr bool kDot = false;
#endif
  vec qs[G][V], acc[G][V];
  T run_max[G], run_sum[G];
  T scale_;  // kDot: applied to the scores

  void start(const C* q, T scale) {  // q: [G][D]
    scale_ = scale;
    for (int g = 0; g < G; ++g) {
      run_max[g] = -INFINITY;
      run_sum[g] = 0;
      for (int j = 0; j < V; ++j) {
        if constexpr (kDot)  // q as stored, in the first half of qs[g]
          std::memcpy(reinterpret_cast<C*>(qs[g]) + j * S::kLanes, q + g * D + j * S::kLanes,
                      S::kLanes * sizeof(C));
        else
          qs[g][j] = load_wide(q + g * D + j * S::kLanes) * scale;
        acc[g][j] = vec{};
      }
    }
  }

  // n <= kTile keys, their K rows at k_head + rows[t], V rows at v_head + rows[t].
  void update(const C* k_head, const C* v_head, const int64_t* rows, int n) {
    vec tile_scores[G];  // lane t: key t's score (lanes past n: anything)
#if defined(__AVX512BF16__)
    if constexpr (kDot) {
      vec dots[G][kTile];
      for (int t = 0; t < kTile; ++t) {
        if (t >= n) {
          for (int g = 0; g < G; ++g) dots[g][t] = vec{};
          continue;
        }
        __m512bh k[D / 32];
        for (int c = 0; c < D / 32; ++c)
          k[c] = (__m512bh)_mm512_loadu_si512(k_head + rows[t] + 32 * c);
        for (int g = 0; g < G; ++g) {
          const C* qg = reinterpret_cast<const C*>(qs[g]);
          __m512 dot = _mm512_setzero_ps();
          for (int c = 0; c < D / 32; ++c)
            dot = _mm512_dpbf16_ps(dot, (__m512bh)_mm512_loadu_si512(qg + 32 * c), k[c]);
          dots[g][t] = bits_as<vec>(dot);
        }
      }
      for (int g = 0; g < G; ++g) tile_scores[g] = reduce_add_16(dots[g]) * scale_;
    } else
#endif
    if constexpr (S::kLanes == 16) {
      // a tile's 16 dot products per head are summed together (`reduce_add_16`)
      vec dots[G][kTile];
      for (int t = 0; t < kTile; ++t) {
        if (t >= n) {
          for (int g = 0; g < G; ++g) dots[g][t] = vec{};
          continue;
        }
        vec k[V];
        for (int j = 0; j < V; ++j) k[j] = load_wide(k_head + rows[t] + j * S::kLanes);
        for (int g = 0; g < G; ++g) {
          vec dot = qs[g][0] * k[0];
          for (int j = 1; j < V; ++j) dot += qs[g][j] * k[j];
          dots[g][t] = dot;
        }
      }
      for (int g = 0; g < G; ++g) tile_scores[g] = reduce_add_16(dots[g]);
    } else {  // float64 (the oracle's dtype): one reduction per score
      T scores[G][kTile];
      for (int t = 0; t < n; ++t) {
        vec k[V];
        for (int j = 0; j < V; ++j) k[j] = load_wide(k_head + rows[t] + j * S::kLanes);
        for (int g = 0; g < G; ++g) {
          vec dot = qs[g][0] * k[0];
          for (int j = 1; j < V; ++j) dot += qs[g][j] * k[j];
          scores[g][t] = reduce_add<T>(dot);
        }
      }
      for (int g = 0; g < G; ++g) tile_scores[g] = load<vec>(scores[g]);
    }
    typename S::mask lane;
    for (int i = 0; i < S::kLanes; ++i) lane[i] = i;
    const auto valid = lane < n;  // a sequence's last tile may be short
    vec probs[G];
    for (int g = 0; g < G; ++g) {
      const vec s = valid ? tile_scores[g] : vec{} - INFINITY;
      const T tile_max = std::max(run_max[g], reduce_max<T>(s));
      const T correction = exp_nonpositive(vec{} + (run_max[g] - tile_max))[0];
      run_max[g] = tile_max;
      probs[g] = valid ? exp_nonpositive(s - tile_max) : vec{};
      run_sum[g] = run_sum[g] * correction + reduce_add<T>(probs[g]);
      for (int j = 0; j < V; ++j) acc[g][j] *= correction;
    }
#if SERVELAB_PAGED_AVX2
    accumulate_avx2(v_head, rows, n, probs);
#else
#if defined(__AVX512BF16__)
    if constexpr (kDot) {
      const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
      for (int t = 0; t < n; ++t) {
        vec even[D / 32], odd[D / 32];
        for (int c = 0; c < D / 32; ++c) {
          const __m512i x = _mm512_loadu_si512(v_head + rows[t] + 32 * c);
          even[c] = bits_as<vec>(_mm512_slli_epi32(x, 16));  // exact, as load_wide
          odd[c] = bits_as<vec>(_mm512_and_si512(x, high));
        }
        for (int g = 0; g < G; ++g) {
          const T p = probs[g][t];
          for (int c = 0; c < D / 32; ++c) {
            acc[g][2 * c] += p * even[c];
            acc[g][2 * c + 1] += p * odd[c];
          }
        }
      }
      return;
    }
#endif
    for (int t = 0; t < n; ++t) {
      vec v[V];
      for (int j = 0; j < V; ++j) v[j] = load_wide(v_head + rows[t] + j * S::kLanes);
      for (int g = 0; g < G; ++g) {
        const T p = probs[g][t];
        for (int j = 0; j < V; ++j) acc[g][j] += p * v[j];
      }
    }
#endif
  }

#if SERVELAB_PAGED_AVX2
  // acc[g] += probs[g][t] * V row t, as one fused multiply-add per lane, as the
  // generic loop above compiles to. On AVX2 that loop broadcasts p through 16
  // stack stores and keeps acc in memory (measured: most of the kernel's time);
  // here acc lives in ymm registers for the whole tile.
  void accumulate_avx2(const C* v_head, const int64_t* rows, int n, const vec (&probs)[G]) {
    using Ymm = std::conditional_t<std::is_same_v<T, float>, __m256, __m256d>;
    constexpr int kYmmLanes = 32 / sizeof(T), W = D / kYmmLanes;  // ymm registers a row
    Ymm a[G][W];
    for (int g = 0; g < G; ++g) std::memcpy(a[g], acc[g], sizeof(a[g]));
    for (int t = 0; t < n; ++t) {
      const C* row = v_head + rows[t];
      for (int g = 0; g < G; ++g) {
        if constexpr (std::is_same_v<C, uint16_t>) {  // bf16 widened: 8 lanes, shifted up
          const __m256 p = _mm256_set1_ps(probs[g][t]);
          for (int j = 0; j < W; ++j) {
            const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + j * 8));
            const __m256 x = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
            a[g][j] = _mm256_fmadd_ps(p, x, a[g][j]);
          }
        } else if constexpr (std::is_same_v<T, float>) {
          const __m256 p = _mm256_set1_ps(probs[g][t]);
          for (int j = 0; j < W; ++j) a[g][j] = _mm256_fmadd_ps(p, _mm256_loadu_ps(row + j * 8), a[g][j]);
        } else {
          const __m256d p = _mm256_set1_pd(probs[g][t]);
          for (int j = 0; j < W; ++j) a[g][j] = _mm256_fmadd_pd(p, _mm256_loadu_pd(row + j * 4), a[g][j]);
        }
      }
    }
    for (int g = 0; g < G; ++g) std::memcpy(acc[g], a[g], sizeof(a[g]));
  }
#endif

  void finish(C* out) const {  // out: [G][D]; no key at all -> zeros
#if defined(__AVX512BF16__)
    if constexpr (kDot) {  // even and odd elements back in order
      const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
      const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
      for (int g = 0; g < G; ++g) {
        const T inv = run_sum[g] > 0 ? 1 / run_sum[g] : 0;
        for (int c = 0; c < D / 32; ++c) {
          const __m512 even = bits_as<__m512>(acc[g][2 * c]), odd = bits_as<__m512>(acc[g][2 * c + 1]);
          store_narrow(out + g * D + 32 * c,
                       bits_as<vec>(_mm512_permutex2var_ps(even, first, odd)) * inv);
          store_narrow(out + g * D + 32 * c + 16,
                       bits_as<vec>(_mm512_permutex2var_ps(even, second, odd)) * inv);
        }
      }
      return;
    }
#endif
    for (int g = 0; g < G; ++g) {
      const T inv = run_sum[g] > 0 ? 1 / run_sum[g] : 0;
      for (int j = 0; j < V; ++j) store_narrow(out + g * D + j * S::kLanes, acc[g][j] * inv);
    }
  }
};

// Where a work item's keys live: its KV head's rows through its sequence's table.
template <typename C, int D>
struct ItemKeys {
  const C* k_head = nullptr;  // the KV head's row in slot 0
  const C* v_head = nullptr;
  KeyWalk walk{nullptr, 0, 0};
  int64_t len = 0;  // 0: no item

  // Prefetches keys [*done, until) into L2, one 64-byte line at a time.
  void prefetch(int64_t* done, int64_t until) {
    constexpr int kLineElems = 64 / sizeof(C);
    for (; *done < until; ++*done) {
      int64_t row;
      walk.next(&row, 1);
      for (int c = 0; c < D; c += kLineElems) {
        __builtin_prefetch(k_head + row + c, 0, kPrefetchLocality);
        __builtin_prefetch(v_head + row + c, 0, kPrefetchLocality);
      }
    }
  }
};

// One work item: G query heads of one sequence over its `len` keys of one KV
// head. The keys are prefetched kPrefetchKeys ahead; in the item's last tiles,
// where its own keys run out, the prefetch runs on into `next`'s first keys
// (the item this thread takes next), so a new item does not start cold.
template <typename C, int D, int G>
void attend_group(const C* q, ItemKeys<C, D> keys, ItemKeys<C, D> next,
                  typename Compute<C>::type scale, C* out) {
  using State = GroupState<C, D, G>;
  State state;
  state.start(q, scale);
  KeyWalk walk = keys.walk;
  int64_t prefetched = 0, next_prefetched = 0;
  int64_t rows[State::kTile];
  for (int64_t start = 0; start < keys.len; start += State::kTile) {
    const int64_t want = start + State::kTile + kPrefetchKeys;
    keys.prefetch(&prefetched, std::min<int64_t>(want, keys.len));
    if (want > keys.len) next.prefetch(&next_prefetched, std::min(want - keys.len, next.len));
    const int n = static_cast<int>(std::min<int64_t>(State::kTile, keys.len - start));
    walk.next(rows, n);
    state.update(keys.k_head, keys.v_head, rows, n);
  }
  state.finish(out);
}

// Every (sequence, KV head, query sub-group) is one work item, handed out by an
// atomic counter: a thread slowed by a busy neighbour core takes fewer items
// instead of making the others wait. A group of `group` query heads runs as
// group / G passes of G heads (G the largest of 8, 4, 2, 1 dividing it). Items
// go out head-major, every sequence's first KV head before any second one, so the
// threads stream different sequences' pages rather than the next rows of the same
// slots (measured, a 20-sequence bf16 batch on AMD Zen 4 with 2 threads: 1.19x the
// rate of sequence-major order; float32 1.13x; level at one sequence). Item order
// does not change a result: each item's output is computed whole by one thread.
template <typename C, int D, int G>
void attend_all(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                typename Compute<C>::type scale, torch::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), kv_heads = k_cache.size(2);
  const int64_t passes = num_heads / kv_heads / G;
  const int64_t block_size = k_cache.size(1), width = block_tables.size(1);
  const C* qp = static_cast<const C*>(q.data_ptr());
  const int64_t q_stride = q.stride(0);  // a view of a fused QKV projection: heads, then K/V
  const C* kp = static_cast<const C*>(k_cache.data_ptr());
  const C* vp = static_cast<const C*>(v_cache.data_ptr());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  C* op = static_cast<C*>(out.data_ptr());
  const int64_t items = num_seqs * kv_heads * passes;
  std::atomic<int64_t> next_item{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), items);
  auto keys_of = [&](int64_t item) {
    ItemKeys<C, D> keys;
    if (item >= items) return keys;
    const int64_t seq = item % num_seqs;
    const int64_t head = item / num_seqs / passes;  // the KV head
    keys.k_head = kp + head * D;
    keys.v_head = vp + head * D;
    keys.walk = KeyWalk{tables + seq * width, block_size, kv_heads * D};
    keys.len = lens[seq];
    return keys;
  };
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    // the next item is claimed before this one runs, so its keys can be prefetched
    int64_t item = next_item.fetch_add(1, std::memory_order_relaxed);
    while (item < items) {
      const int64_t upcoming = next_item.fetch_add(1, std::memory_order_relaxed);
      const int64_t seq = item % num_seqs;
      const int64_t first_head = item / num_seqs * G;
      attend_group<C, D, G>(qp + seq * q_stride + first_head * D, keys_of(item),
                            keys_of(upcoming), scale, op + (seq * num_heads + first_head) * D);
      item = upcoming;
    }
  });
}

template <typename C, int D>
void attend_all_groups(const torch::Tensor& q, const torch::Tensor& k_cache,
                       const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                       const torch::Tensor& seq_lens, typename Compute<C>::type scale,
                       torch::Tensor& out) {
  const int64_t group = q.size(1) / k_cache.size(2);
  if (group % 8 == 0) attend_all<C, D, 8>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
  else if (group % 4 == 0) attend_all<C, D, 4>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
  else if (group % 2 == 0) attend_all<C, D, 2>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
  else attend_all<C, D, 1>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
}

template <typename C>
void attend_all_dims(const torch::Tensor& q, const torch::Tensor& k_cache,
                     const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                     const torch::Tensor& seq_lens, double scale, torch::Tensor& out) {
  const auto s = static_cast<typename Compute<C>::type>(scale);
  switch (q.size(2)) {
    case 16: return attend_all_groups<C, 16>(q, k_cache, v_cache, block_tables, seq_lens, s, out);
    case 32: return attend_all_groups<C, 32>(q, k_cache, v_cache, block_tables, seq_lens, s, out);
    case 64: return attend_all_groups<C, 64>(q, k_cache, v_cache, block_tables, seq_lens, s, out);
    case 128: return attend_all_groups<C, 128>(q, k_cache, v_cache, block_tables, seq_lens, s, out);
    case 256: return attend_all_groups<C, 256>(q, k_cache, v_cache, block_tables, seq_lens, s, out);
    default: TORCH_CHECK(false, "paged_decode: unsupported head_dim ", q.size(2));
  }
}

}  // namespace

// The extension's functions (also called by the decoder loop), in the anonymous
// namespace like the rest: each translation unit that includes this header gets
// its own copy, so any number of them can.
namespace {

// Writes this step's k, v ([num_tokens, kv_heads, D], any stride between tokens)
// into the caches at slot_mapping (int64), one row copy per token and cache: what
// two index_copy_ calls do, without their per-call cost (a 64-sequence decode
// layer's strided K/V: about 15 us for the two calls, under 2 us here).
void store_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slot_mapping) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && slot_mapping.is_contiguous());
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes());
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kLong, "store_kv: slot_mapping must be int64");
  const int64_t num_tokens = slot_mapping.size(0);
  const int64_t kv_heads = k_cache.size(2), head_dim = k_cache.size(3);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (const auto& x : {k, v}) {
    TORCH_CHECK(x.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
                "store_kv: k, v and the caches must share a dtype");
    TORCH_CHECK(x.dim() == 3 && x.size(0) == num_tokens && x.size(1) == kv_heads &&
                x.size(2) == head_dim, "store_kv: k and v must be [num_tokens, kv_heads, head_dim]");
    TORCH_CHECK(x.stride(2) == 1 && (kv_heads == 1 || x.stride(1) == head_dim),
                "store_kv: each token's K/V heads must be contiguous");
  }
  const int64_t row_bytes = kv_heads * head_dim * k_cache.element_size();
  const int64_t k_step = k.stride(0) * k.element_size(), v_step = v.stride(0) * v.element_size();
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slots[t];
    TORCH_CHECK(slot >= 0 && slot < num_slots, "store_kv: slot ", slot, " out of range");
    std::memcpy(kc + slot * row_bytes, kp + t * k_step, row_bytes);
    std::memcpy(vc + slot * row_bytes, vp + t * v_step, row_bytes);
  }
}

// q [num_seqs, num_heads, D], any stride between tokens (each token's heads
// contiguous); caches [num_blocks, block_size, kv_heads, D], contiguous; all
// float32, all float64 or all bfloat16; block_tables int32 [>= num_seqs, width]; seq_lens
// int32 [>= num_seqs]. Returns a new contiguous [num_seqs, num_heads, D].
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode: the caches must be contiguous");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && (q.size(1) == 1 || q.stride(1) == q.size(2)),
              "paged_decode: each token's query heads must be contiguous");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous(),
              "paged_decode: block_tables and seq_lens must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "paged_decode: q and the caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt && seq_lens.scalar_type() == torch::kInt,
              "paged_decode: block_tables and seq_lens must be int32");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && k_cache.dim() == 4 && q.dim() == 3);
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(2) == k_cache.size(3));
  TORCH_CHECK(block_tables.size(0) >= q.size(0) && seq_lens.size(0) >= q.size(0));
  auto out = torch::empty(q.sizes(), q.options());
  if (q.scalar_type() == torch::kFloat) {
    attend_all_dims<float>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
  } else if (q.scalar_type() == torch::kBFloat16) {
    attend_all_dims<uint16_t>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
  } else {
    TORCH_CHECK(q.scalar_type() == torch::kDouble,
                "paged_decode: float32, float64 or bfloat16 only");
    attend_all_dims<double>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
  }
  return out;
}

}  // namespace
