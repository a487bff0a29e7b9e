// The decode kernel's per-warp operands: tile geometry, reading a pipeline stage into mma
// fragments, and loading the query group (the dim permutation is explained in decode.cu).
#pragma once
#include "decode_params.cuh"
#include "decode_pipeline.cuh"

namespace llfd {

constexpr float kLn2 = 0.6931471805599453f;
#define kNegInf (__int_as_float(0xff800000))

template <int HEAD_DIM>
struct Geometry {
  static_assert(HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256, "head_dim 64/128/256");
  static constexpr int kKVectors = HEAD_DIM / 64;  // 16-byte K vectors per lane per token
  static constexpr int kChunks = HEAD_DIM / 16;    // k-steps of S^T = K Q^T
  static constexpr int kVBytes = HEAD_DIM / 8;     // V bytes per lane per token
  static constexpr int kVWords = kVBytes / 4;
  static constexpr int kMBlocks = HEAD_DIM / 16;   // m-blocks of O^T += V^T P^T
};

// One warp's operands for a 16-token tile, read from its pipeline stage in fragment order.
template <int HEAD_DIM>
struct Tile {
  using G = Geometry<HEAD_DIM>;
  uint32_t k[2][G::kChunks];     // tokens g and g+8
  uint32_t v[4][G::kVWords];     // tokens 2c, 2c+1, 2c+8, 2c+9
  float k_scale[2], v_scale[2];  // per-token mode: tokens g and g+8
};

template <typename ScaleT>
__device__ __forceinline__ float scale_value(const char* address) {
  if constexpr (sizeof(ScaleT) == 2)
    return half_to_float(*reinterpret_cast<const uint16_t*>(address));
  else
    return *reinterpret_cast<const float*>(address);
}

// Plain C++ loads (not asm) so the compiler may schedule them; cp_async_wait's "memory"
// clobber and __syncwarp keep them after the copies have landed.
// Sub-tile `sub` (16 tokens) of a stage that holds TILES of them.
// PAGED stages hold their scales as words that PagedTiles::scale reads (not here).
template <int HEAD_DIM, bool TOKEN_SCALES, typename ScaleT, int TILES, bool PAGED = false>
__device__ __forceinline__ void read_tile(Tile<HEAD_DIM>& tile, const char* stage, int sub, int g,
                                          int c) {
  using G = Geometry<HEAD_DIM>;
  using S = Stage<HEAD_DIM, ScaleT, TILES, PAGED>;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = 16 * sub + 8 * half + g;
#pragma unroll
    for (int u = 0; u < G::kKVectors; ++u) {
      const uint4 w = *reinterpret_cast<const uint4*>(
          stage + S::kK + row * HEAD_DIM + 16 * S::k_chunk(row, 4 * u + c));
      tile.k[half][4 * u] = w.x; tile.k[half][4 * u + 1] = w.y;
      tile.k[half][4 * u + 2] = w.z; tile.k[half][4 * u + 3] = w.w;
    }
    if constexpr (TOKEN_SCALES && !PAGED) {
      tile.k_scale[half] = scale_value<ScaleT>(stage + S::kKScale + row * sizeof(ScaleT));
      tile.v_scale[half] = scale_value<ScaleT>(stage + S::kVScale + row * sizeof(ScaleT));
    }
  }
#pragma unroll
  for (int slot = 0; slot < 4; ++slot) {
    const int row = 16 * sub + 2 * c + (slot & 1) + 8 * (slot >> 1);
    const char* base = stage + S::kV + row * HEAD_DIM;
    if constexpr (HEAD_DIM == 64) {
      const uint2 w = *reinterpret_cast<const uint2*>(base + 16 * S::v_chunk(row, g >> 1) +
                                                      8 * (g & 1));
      tile.v[slot][0] = w.x; tile.v[slot][1] = w.y;
    } else {
#pragma unroll
      for (int part = 0; part < G::kVBytes / 16; ++part) {
        const int chunk = (G::kVBytes / 16) * g + part;
        const uint4 w = *reinterpret_cast<const uint4*>(base + 16 * S::v_chunk(row, chunk));
        tile.v[slot][4 * part] = w.x; tile.v[slot][4 * part + 1] = w.y;
        tile.v[slot][4 * part + 2] = w.z; tile.v[slot][4 * part + 3] = w.w;
      }
    }
  }
}

// Query heads g (block 0) and g+8 (block 1) as fp16 B fragments of S^T = K Q^T, in the permuted
// dim order. bf16 queries are rescaled per head by a power of two into fp16 range (exact);
// head_scale undoes it.
// GLOBAL: q_group is global memory (read-only path); else the fused append's staged group in
// shared memory.
// Heads from `heads` on (<= GROUP; a partial chunk of the group) are zero.
template <int HEAD_DIM, int GROUP, typename QT, int BLOCKS, bool GLOBAL>
__device__ __forceinline__ void load_query(uint32_t (&qb)[BLOCKS][Geometry<HEAD_DIM>::kChunks][2],
                                           float (&head_scale)[BLOCKS], const uint16_t* q_group,
                                           int64_t q_head_stride, int heads, int g, int c) {
  using G = Geometry<HEAD_DIM>;
#pragma unroll
  for (int hb = 0; hb < BLOCKS; ++hb) {
    const int head = g + 8 * hb;
    uint32_t words[G::kKVectors][8];
#pragma unroll
    for (int u = 0; u < G::kKVectors; ++u) {
#pragma unroll
      for (int i = 0; i < 8; ++i) words[u][i] = 0;
      if (head < GROUP && head < heads) {
        const uint4* src = reinterpret_cast<const uint4*>(q_group + head * q_head_stride +
                                                          64 * u + 16 * c);
        uint4 lo, hi;
        if constexpr (GLOBAL) lo = __ldg(src), hi = __ldg(src + 1);
        else lo = src[0], hi = src[1];
        words[u][0] = lo.x; words[u][1] = lo.y; words[u][2] = lo.z; words[u][3] = lo.w;
        words[u][4] = hi.x; words[u][5] = hi.y; words[u][6] = hi.z; words[u][7] = hi.w;
      }
    }
    head_scale[hb] = 1.f;
    if constexpr (is_same<QT, bf16>::value) {
      float absmax = 0.f;
#pragma unroll
      for (int u = 0; u < G::kKVectors; ++u)
#pragma unroll
        for (int i = 0; i < 8; ++i)
          absmax = fmaxf(absmax, fmaxf(fabsf(bf16_to_float(words[u][i] & 0xffff)),
                                       fabsf(bf16_to_float(words[u][i] >> 16))));
      absmax = warp_max_xor(absmax, 2);
      // Largest power of two with absmax * scale < 2^15: fp16 range, full bf16 precision kept.
      const int exponent = absmax > 0.f ? ((__float_as_int(absmax) >> 23) & 0xff) - 127 : 0;
      const float up = exp2f(static_cast<float>(14 - exponent));
      head_scale[hb] = 1.f / up;
#pragma unroll
      for (int u = 0; u < G::kKVectors; ++u)
#pragma unroll
        for (int i = 0; i < 8; ++i)
          words[u][i] = pack2<f16>(bf16_to_float(words[u][i] & 0xffff) * up,
                                   bf16_to_float(words[u][i] >> 16) * up);
    }
#pragma unroll
    for (int u = 0; u < G::kKVectors; ++u)
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        qb[hb][4 * u + w][0] = words[u][2 * w];      // elements e = 0, 1: k = 2c, 2c+1
        qb[hb][4 * u + w][1] = words[u][2 * w + 1];  // elements e = 2, 3: k = 2c+8, 2c+9
      }
  }
}

}  // namespace llfd
