// The heads-together probe kernel's copies (heads.cu): the pools' tensor maps and the ring's
// shared-memory layout (the mbarriers and copies: tma.cuh).
#pragma once
#include "decode_merge.cuh"
#include "tma.cuh"

namespace llfd {

// The pools' tensor maps (benchlib/heads.py): rows as (D, slot, head, page), scales
// as (slot, head, page) or, when a page's heads are innermost, (head, slot, page).
struct HeadsMaps {
  TensorMap k, v, k_scale, v_scale;
  int32_t scale_heads_inner;
};

// Row r (0-7) of each 8-row half of a tile's mma holds token sigma8(r) of that half
// (heads.py SIGMA).
__device__ __forceinline__ int sigma8(int r) { return (0x36157240u >> (4 * r)) & 7; }

// Shared memory: STAGES stages of rows (K then V, [HK][16][D], 1024-byte aligned for the
// swizzle), then STAGES stages of scales (K then V, 16 x HK each).
template <int HEAD_DIM, int HK, typename ScaleT, bool TOKEN_SCALES, int STAGES>
struct HeadsLayout {
  static constexpr int kRowBytes = HK * 16 * HEAD_DIM;  // K (or V) of one tile
  static constexpr int kStageRows = 2 * kRowBytes;
  // Bulk tensor copies land on 128-byte aligned shared addresses: each scale block (a box of
  // kScaleBox bytes) is padded to kScaleBytes.
  static constexpr int kScaleBox = TOKEN_SCALES ? 16 * HK * static_cast<int>(sizeof(ScaleT)) : 0;
  static constexpr int kScaleBytes = (kScaleBox + 127) / 128 * 128;
  static constexpr int kStageScales = 2 * kScaleBytes;
  static constexpr int kScales = STAGES * kStageRows;  // offset of the scale stages
  static constexpr int kBytes = kScales + STAGES * kStageScales;
  static constexpr uint32_t kTx = kStageRows + 2 * kScaleBox;  // bytes a tile's copies bring
};

}  // namespace llfd
