// The multi-token kernel's query rows (multi.cu): loading a lane's Q fragments (RoPE and the
// fp16 range), storing output rows, and merging a row tile's KV splits.
#pragma once
#include "multi_params.cuh"
#include "rows.cuh"

#ifndef kNegInf
#define kNegInf (__int_as_float(0xff800000))
#endif

namespace llfd {

constexpr int kMultiMaxSplits = 32;  // multi/planner.py MAX_SPLITS
constexpr float kMultiLn2 = 0.6931471805599453f;

// x <- H x (rows.cuh hadamard_row) for a row held by a quad: element 16 s + 4 c + e at x[s][e]
// of lane c. The same butterflies in the same order (index bits of e, of c by xor-shuffle within
// the quad, of s), so the same fp32 results as the writers' layout.
template <int HEAD_DIM>
__device__ __forceinline__ void hadamard_quad(float (&x)[HEAD_DIM / 16][4], int c) {
  constexpr int kChunks = HEAD_DIM / 16;
#pragma unroll
  for (int bit = 1; bit < 4; bit <<= 1)
#pragma unroll
    for (int s = 0; s < kChunks; ++s)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (!(e & bit)) {
          const float a = x[s][e], b = x[s][e | bit];
          x[s][e] = a + b;
          x[s][e | bit] = a - b;
        }
#pragma unroll
  for (int bit = 1; bit < 4; bit <<= 1)
#pragma unroll
    for (int s = 0; s < kChunks; ++s)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float partner = __shfl_xor_sync(kFullMask, x[s][e], bit);
        x[s][e] = (c & bit) ? partner - x[s][e] : x[s][e] + partner;
      }
#pragma unroll
  for (int bit = 1; bit < kChunks; bit <<= 1)
#pragma unroll
    for (int s = 0; s < kChunks; ++s)
      if (!(s & bit))
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float a = x[s][e], b = x[s | bit][e];
          x[s][e] = a + b;
          x[s | bit][e] = a - b;
        }
#pragma unroll
  for (int s = 0; s < kChunks; ++s)
#pragma unroll
    for (int e = 0; e < 4; ++e) x[s][e] = __fmul_rn(x[s][e], kHadamardNorm<HEAD_DIM>);
}

// RoPE of one query row held by a quad (this lane: elements 16 s + 4 c .. + 3 of every chunk s)
// at position `pos`; TABLE: the coefficients from p.cos_sin, else from p.rope_theta.
template <int HEAD_DIM, int ROPE, bool TABLE>
__device__ __forceinline__ void rotate_quad(float (&x)[HEAD_DIM / 16][4], const MultiParams& p,
                                            int pos, int c) {
  constexpr int kChunks = HEAD_DIM / 16;
  auto coefficients = [&](int i) __attribute__((always_inline)) {
    if constexpr (TABLE) return rope_table_entry<HEAD_DIM>(p.cos_sin, pos, i);
    else return cos_sin_of(__fmul_rn(static_cast<float>(pos),
                                     rope_inv_freq<HEAD_DIM>(p.rope_theta, i)));
  };
  if constexpr (ROPE == kRopeNeox) {  // pairs (d, d + D/2): chunks s and s + kChunks/2
#pragma unroll
    for (int s = 0; s < kChunks / 2; ++s)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 cs = coefficients(16 * s + 4 * c + e);
        const float a = x[s][e], b = x[s + kChunks / 2][e];
        x[s][e] = a * cs.x - b * cs.y;
        x[s + kChunks / 2][e] = b * cs.x + a * cs.y;
      }
  } else {  // gptj, pairs (2i, 2i + 1): elements e, e + 1
#pragma unroll
    for (int s = 0; s < kChunks; ++s)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const float2 cs = coefficients(8 * s + 2 * c + e / 2);
        const float a = x[s][e], b = x[s][e + 1];
        x[s][e] = a * cs.x - b * cs.y;
        x[s][e + 1] = a * cs.y + b * cs.x;
      }
  }
}

// This lane's Q fragments for its rows r_lo and r_lo + 8 (dims permuted as the K fragments:
// multi_tiles.cuh), and each row's scale into fp16 range. Rows past the sequence's are zero.
template <int HEAD_DIM, typename QT>
__device__ __forceinline__ void load_rows(uint32_t (&qf)[HEAD_DIM / 16][4], float (&row_scale)[2],
                                          const MultiParams& p, const SequenceRows& sr, int kvh,
                                          int r_lo, int c) {
  constexpr int kChunks = HEAD_DIM / 16;
  constexpr bool kWiden = is_same<QT, bf16>::value;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = r_lo + 8 * hr;
    uint2 words[kChunks];
    const bool valid = r < sr.rows;
    const int token = valid ? r / p.group_size : 0;
    const uint16_t* row = static_cast<const uint16_t*>(p.q) +
                          (sr.q0 + token) * p.q_token_stride +
                          (kvh * p.group_size + r - token * p.group_size) * p.q_head_stride;
#pragma unroll
    for (int s = 0; s < kChunks; ++s)
      words[s] = valid ? __ldg(reinterpret_cast<const uint2*>(row + 16 * s + 4 * c))
                       : make_uint2(0, 0);
    row_scale[hr] = 1.f;
    if (kWiden || p.rope != kRopeNone) {  // key_transform is set only with rope
      float x[kChunks][4];
#pragma unroll
      for (int s = 0; s < kChunks; ++s) {
        x[s][0] = to_float<QT>(words[s].x & 0xffff); x[s][1] = to_float<QT>(words[s].x >> 16);
        x[s][2] = to_float<QT>(words[s].y & 0xffff); x[s][3] = to_float<QT>(words[s].y >> 16);
      }
      // A decode row whose token was not appended has prefix -1 (SequenceRows): position 0,
      // the identity rotation, so q is used as given.
      const int pos = max(sr.prefix + token, 0);
      // One uniform branch per row on where the coefficients come from: a table read per
      // element must not sit beside the rope_theta path's double-precision evaluation
      // (inlined per element, it cost the table path ~16 us per launch at B=32, group 64).
      if (valid && p.rope != kRopeNone) {
        if (p.cos_sin != nullptr) {
          if (p.rope == kRopeNeox) rotate_quad<HEAD_DIM, kRopeNeox, true>(x, p, pos, c);
          else rotate_quad<HEAD_DIM, kRopeGptj, true>(x, p, pos, c);
        } else {
          if (p.rope == kRopeNeox) rotate_quad<HEAD_DIM, kRopeNeox, false>(x, p, pos, c);
          else rotate_quad<HEAD_DIM, kRopeGptj, false>(x, p, pos, c);
        }
      }
      if (p.key_transform && sr.prefix >= 0) hadamard_quad<HEAD_DIM>(x, c);
      float absmax = 0.f;
#pragma unroll
      for (int s = 0; s < kChunks; ++s)
#pragma unroll
        for (int e = 0; e < 4; ++e) absmax = fmaxf(absmax, fabsf(x[s][e]));
      absmax = warp_max_xor(absmax, 2);  // the row's four lanes
      // Largest power of two with absmax * up < 2^15: fp16 range, bf16 precision kept.
      const int exponent = absmax > 0.f ? ((__float_as_int(absmax) >> 23) & 0xff) - 127 : 0;
      const float up = exp2f(static_cast<float>(14 - exponent));
      row_scale[hr] = 1.f / up;
#pragma unroll
      for (int s = 0; s < kChunks; ++s)
        words[s] = make_uint2(pack2<f16>(x[s][0] * up, x[s][1] * up),
                              pack2<f16>(x[s][2] * up, x[s][3] * up));
    }
#pragma unroll
    for (int s = 0; s < kChunks; ++s) {
      qf[s][hr] = words[s].x;      // k = 2c, 2c+1 of row g (hr 0) or g + 8 (hr 1)
      qf[s][2 + hr] = words[s].y;  // k = 2c+8, 2c+9
    }
  }
}

// Speculative trees (p.tree_mask): a score column of the chunk (draft token d = col - prefix)
// stays only where bit d of its query row's mask is set; columns before the chunk always stay.
// s holds rows r_lo (e < 2) and r_lo + 8 at columns col0 + 8 j + (e & 1). Bits are read only
// inside the row's chunk and its tree_words words (device values may be anything).
template <int kNBw>
__device__ __forceinline__ void tree_mask_scores(float (&s)[kNBw][4], const MultiParams& p,
                                                 const SequenceRows& sr, int r_lo, int col0) {
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = r_lo + 8 * hr;
    if (r >= sr.rows) continue;
    const uint32_t* bits = p.tree_mask +
                           static_cast<int64_t>(sr.q0 + r / p.group_size) * p.tree_words;
#pragma unroll
    for (int j = 0; j < kNBw; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int d = col0 + 8 * j + e - sr.prefix;
        if (d < 0 || d >= sr.qo_len) continue;
        const bool seen = (d >> 5) < p.tree_words && ((__ldg(bits + (d >> 5)) >> (d & 31)) & 1u);
        if (!seen) s[j][2 * hr + e] = kNegInf;
      }
  }
}

// Four consecutive output elements of a row.
template <typename QT>
__device__ __forceinline__ void store4(void* out, int64_t offset, float a, float b, float c,
                                      float d) {
  *reinterpret_cast<uint2*>(static_cast<uint16_t*>(out) + offset) =
      make_uint2(pack2<QT>(a, b), pack2<QT>(c, d));
}

// Quad `quad` of row `local` of a row tile, merged: acc / sum into out, and from quad 0 the
// row's LSE (natural log; best: the largest split LSE, base 2). Every split merge ends here.
template <typename QT>
__device__ __forceinline__ void store_merged_quad(const MultiParams& p, const SequenceRows& sr,
                                                  int kvh, int row0, int local, int quad,
                                                  const float4& acc, float sum, float best) {
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  const int r = row0 + local, token = r / p.group_size;
  const int head = kvh * p.group_size + r - token * p.group_size;
  const int64_t q_row = sr.q0 + token;
  store4<QT>(p.out, q_row * p.out_token_stride + head * p.out_head_stride + 4 * quad,
             acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
  if (quad == 0 && p.lse != nullptr)
    p.lse[q_row * p.num_kv_heads * p.group_size + head] =
        sum > 0.f ? (best + __log2f(sum)) * kMultiLn2 : kNegInf;
}

// The threads that merge a row tile's splits: the whole CTA (THREADS = 0, __syncthreads), or
// its last THREADS threads (a warp-specialized CTA whose loading warps have left: named
// barrier 1).
template <int THREADS>
struct MergeTeam {
  __device__ static __forceinline__ int tid() {
    return THREADS ? static_cast<int>(threadIdx.x + THREADS - blockDim.x) : threadIdx.x;
  }
  __device__ static __forceinline__ int size() { return THREADS ? THREADS : blockDim.x; }
  __device__ static __forceinline__ void sync() {
    if constexpr (THREADS != 0)
      asm volatile("bar.sync 1, %0;" ::"n"(THREADS) : "memory");
    else
      __syncthreads();
  }
};

// Weighted sum of the tile's split partials (fixed order: reproducible). `scratch`: shared
// memory for (kMultiMaxSplits + 2) x ROWS floats (the pipeline's, no longer in use).
template <int HEAD_DIM, int ROWS, typename QT, int THREADS = 0>
__device__ void merge_tile_splits(const MultiParams& p, const SequenceRows& sr, int kvh,
                                  int row0, int tile_rows, int64_t slot, int active,
                                  float* scratch) {
  float* weight = scratch;                                  // [active][64]
  float* row_total = scratch + kMultiMaxSplits * ROWS;  // [ROWS]
  float* row_best = row_total + ROWS;                 // [ROWS]
  using Team = MergeTeam<THREADS>;
  const int tid = Team::tid(), team = Team::size();
  const int64_t base = slot * p.num_splits;
  for (int i = tid; i < active * ROWS; i += team)  // rows past the tile's: unwritten
    weight[i] = i % ROWS < tile_rows ? __ldcg(p.partial_lse + base * ROWS + i) : kNegInf;
  Team::sync();
  if (tid < ROWS) {
    const int row = tid;
    float best = kNegInf, sum = 0.f;
    for (int s = 0; s < active; ++s) best = fmaxf(best, weight[s * ROWS + row]);
    for (int s = 0; s < active; ++s) {
      const float w = best == kNegInf ? 0.f : fast_exp2(weight[s * ROWS + row] - best);
      weight[s * ROWS + row] = w;
      sum += w;
    }
    row_total[row] = sum;
    row_best[row] = best;
  }
  Team::sync();
  constexpr int kQuads = HEAD_DIM / 4;
  // Each thread sums kU row quads at a time over kS splits per round: kU x kS loads in flight
  // (the partials come from L2; one quad at a time, ptxas kept 4 loads in flight and the merge
  // of 8 splits took 32 round trips per thread). kU: at most a 128-thread CTA's share, so that
  // small tiles' kernels keep their registers. The sum's order is the splits' (reproducible).
  constexpr int kU = ROWS * kQuads >= 4 * 128 ? 4 : ROWS * kQuads >= 2 * 128 ? 2 : 1;
  constexpr int kS = 4;
  const float4* parts = reinterpret_cast<const float4*>(p.partial_out) + base * ROWS * kQuads;
  const int n = tile_rows * kQuads;
  for (int first = tid; first < n; first += kU * team) {
    float4 acc[kU];
    int local[kU], quad[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      acc[u] = make_float4(0.f, 0.f, 0.f, 0.f);
      const int idx = min(first + u * team, n - 1);  // past n: unused
      local[u] = idx / kQuads;
      quad[u] = idx % kQuads;
    }
    for (int s0 = 0; s0 < active; s0 += kS) {
      float4 v[kS][kU];
#pragma unroll
      for (int a = 0; a < kS; ++a)
#pragma unroll
        for (int u = 0; u < kU; ++u)
          v[a][u] = s0 + a < active
                        ? __ldcg(parts + ((s0 + a) * ROWS + local[u]) * kQuads + quad[u])
                        : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int a = 0; a < kS; ++a)
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          if (s0 + a >= active) continue;
          const float w = weight[(s0 + a) * ROWS + local[u]];
          acc[u].x += w * v[a][u].x; acc[u].y += w * v[a][u].y;
          acc[u].z += w * v[a][u].z; acc[u].w += w * v[a][u].w;
        }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u)
      if (first + u * team < n)
        store_merged_quad<QT>(p, sr, kvh, row0, local[u], quad[u], acc[u], row_total[local[u]],
                              row_best[local[u]]);
  }
}

// After a split wrote its partial rows: the last split of the row tile to arrive merges them
// all (the others return) and resets the tile's counter for the next launch. `is_last`: a
// __shared__ int of the kernel; `scratch`: merge_tile_splits's shared memory.
template <int HEAD_DIM, int ROWS, typename QT, int THREADS = 0>
__device__ __forceinline__ void merge_if_last(const MultiParams& p, const SequenceRows& sr,
                                              int kvh, int row0, int tile_rows, int64_t slot,
                                              int active, float* scratch, int& is_last) {
  using Team = MergeTeam<THREADS>;
  __threadfence();
  Team::sync();
  if (Team::tid() == 0) is_last = atomicAdd(p.counters + slot, 1u) + 1 == static_cast<uint32_t>(active);
  Team::sync();
  if (!is_last) return;
  __threadfence();
  merge_tile_splits<HEAD_DIM, ROWS, QT, THREADS>(p, sr, kvh, row0, tile_rows, slot, active, scratch);
  if (Team::tid() == 0) p.counters[slot] = 0;  // ready for the next launch
}

}  // namespace llfd
