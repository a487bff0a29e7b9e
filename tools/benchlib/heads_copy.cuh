// The heads-together probe kernel's copies (heads.cu): the pools' tensor maps, the stage
// ring's mbarriers, the bulk tensor copies, and the ring's shared-memory layout.
#pragma once
#include "decode_merge.cuh"

namespace llfd {

struct alignas(64) TensorMap { uint64_t opaque[16]; };

// The pools' tensor maps (benchlib/heads.py): rows as (D, slot, head, page), scales
// as (slot, head, page) or, when a page's heads are innermost, (head, slot, page).
struct HeadsMaps {
  TensorMap k, v, k_scale, v_scale;
  int32_t scale_heads_inner;
};

// Row r (0-7) of each 8-row half of a tile's mma holds token sigma8(r) of that half
// (heads.py SIGMA).
__device__ __forceinline__ int sigma8(int r) { return (0x36157240u >> (4 * r)) & 7; }

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
        "selp.u32 %0, 1, 0, p; }"
        : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_expect(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void tma_4d(uint32_t dst, const TensorMap* map, int c0, int c1, int c2,
                                       int c3, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];"
      ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar) : "memory");
}
__device__ __forceinline__ void tma_3d(uint32_t dst, const TensorMap* map, int c0, int c1, int c2,
                                       uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];"
      ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}

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
