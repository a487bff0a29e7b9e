// The per-warp shared-memory pipeline of the decode kernel: STAGES 16-token tiles of K, V and
// (per-token mode) their scales are in flight per warp through cp.async, so the bytes in
// flight per SM no longer depend on registers.
//
// Stage layout (bytes): K [16 rows][D] | V [16 rows][D] | K scales [16] | V scales [16].
// Rows are stored with their 16-byte chunks XOR-swizzled so the fragment reads of the math
// are bank-conflict free (checked by enumerating the lanes of each LDS phase):
//  * K: lane (g, c) reads chunks 4u + c of rows g and g + 1 per phase; flipping chunk bit 2 on
//    odd rows puts the two rows in different halves of the 128-byte bank space (D >= 128).
//  * V: lane (g, c) reads bytes [VB*g, VB*g + VB) of rows 2c (+1, +8, +9); rows 0, 2, 4, 6 of a
//    phase are spread by XOR with (r & 6) for D = 128, and bits 1, 2 of r for D = 256.
//    D = 64 keeps a 2-way conflict: four 64-byte rows share one 128-byte bank line.
#pragma once
#include "common.cuh"

namespace llfd {

// PAGED: scales are copied as 4-byte words whatever their type (PagedTiles).
template <int HEAD_DIM, typename ScaleT, int TILES = 1, bool PAGED = false>
struct Stage {
  static constexpr int kRows = 16 * TILES;  // tokens per stage: TILES 16-token tiles
  static constexpr int kRowChunks = HEAD_DIM / 16;
  static constexpr int kScaleBytes = PAGED ? 4 : static_cast<int>(sizeof(ScaleT));
  static constexpr int kK = 0, kV = kRows * HEAD_DIM, kKScale = 2 * kRows * HEAD_DIM;
  static constexpr int kVScale = kKScale + kRows * kScaleBytes;
  static constexpr int kBytes = kVScale + kRows * kScaleBytes;

  __device__ static __forceinline__ int k_chunk(int row, int chunk) {
    return HEAD_DIM >= 128 ? chunk ^ (4 * (row & 1)) : chunk;
  }
  __device__ static __forceinline__ int v_chunk(int row, int chunk) {
    if (HEAD_DIM == 128) return chunk ^ (row & 6);
    if (HEAD_DIM == 256) return chunk ^ (((row >> 1) & 1) | (((row >> 2) & 1) << 2));
    return chunk ^ ((row >> 1) & 3);
  }
};

// Issue the copies of tokens [t0, t0 + 16 * TILES) into the stage at `stage` (a shared
// address). Rows past `end` re-read row end - 1 (in bounds, initialised) and are masked by the
// math; scales past `end` are zero-filled without reading memory.
template <int HEAD_DIM, bool TOKEN_SCALES, typename ScaleT, int TILES>
__device__ __forceinline__ void issue_tile(uint32_t stage, const int8_t* k_base,
                                           const int8_t* v_base, const ScaleT* ks_base,
                                           const ScaleT* vs_base, int64_t token_stride, int t0,
                                           int end, int lane) {
  using S = Stage<HEAD_DIM, ScaleT, TILES>;
#pragma unroll
  for (int i = 0; i < TILES * HEAD_DIM / 32; ++i) {
    const int index = lane + 32 * i, row = index / S::kRowChunks, chunk = index % S::kRowChunks;
    const int64_t offset = min(t0 + row, end - 1) * token_stride + 16 * chunk;
    cp_async_16(stage + S::kK + row * HEAD_DIM + 16 * S::k_chunk(row, chunk), k_base + offset);
    cp_async_16(stage + S::kV + row * HEAD_DIM + 16 * S::v_chunk(row, chunk), v_base + offset);
  }
  if constexpr (TOKEN_SCALES) {
    // fp32: one lane per token (lanes 0-15 K, 16-31 V). fp16: one lane per token pair.
    constexpr int kPerLane = 4 / sizeof(ScaleT), kLanes = 16 / kPerLane;
    if (lane < 2 * kLanes) {
      const bool is_v = lane >= kLanes;
#pragma unroll
      for (int tile = 0; tile < TILES; ++tile) {
        const int t = t0 + 16 * tile + kPerLane * (lane % kLanes);
        const int valid = max(0, min(kPerLane, end - t));
        const ScaleT* src = (is_v ? vs_base : ks_base) + (valid ? t : 0);
        cp_async_4(stage + (is_v ? S::kVScale : S::kKScale) +
                       16 * tile * static_cast<int>(sizeof(ScaleT)) + 4 * (lane % kLanes),
                   src, valid * static_cast<int>(sizeof(ScaleT)));
      }
    }
  }
}

}  // namespace llfd
