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

// The decode kernel's tile loads over pages (the PAGED instantiation of decode_split): the same
// stages as issue_tile (decode_pipeline.cuh), each row from its own page. The page ids of the
// next tile a lane issues are loaded one tile ahead (fetch), so the table's latency hides behind
// a tile of math instead of sitting in front of every copy. Per-token scales are copied as the
// aligned 4-byte word holding them (fp16: either half; which one is a bit per stage and sub-tile
// in `selectors`, read by the consumer through a shuffle), since cp.async cannot copy 2 bytes
// and a paged scale's neighbours need not be its own sequence's.
template <int HEAD_DIM, bool TOKEN_SCALES, typename ScaleT, int TILES>
struct PagedTiles {
  using S = Stage<HEAD_DIM, ScaleT, TILES, true>;
  static constexpr int kLoads = TILES * HEAD_DIM / 32;  // 16-byte chunks per lane and tile
  static constexpr int kLoadsPerSub = kLoads / TILES;   // ... per 16-token sub-tile
  const int32_t* table;  // this sequence's row of the block table
  const int8_t *k_head, *v_head;  // the pools at this KV head
  const char *ks_head, *vs_head;  // the scale pools at this KV head (bytes)
  int64_t page_stride, token_stride, scale_page_stride, scale_token_stride;  // bytes
  int shift, num_pages;
  bool whole;              // pages of >= 16 tokens: a sub-tile lies in one page
  int row_offset[kLoads];  // bytes of this lane's chunks past their sub-tile's first slot
  int pages[kLoads];       // page ids of this lane's rows of the next tile to issue
  int scale_page[TILES];   // ... and of its scale token (lane % 16 of each sub-tile)
  uint32_t selectors = 0;  // fp16 scales: bit stage * TILES + sub set = the high half
  bool bad = false;        // a page id out of range was met

  template <typename P>
  __device__ __forceinline__ PagedTiles(const P& p, int b, int kvh, int lane)
      : table(p.block_table + b * p.table_stride),
        k_head(p.k_cache + kvh * p.kv_head_stride),
        v_head(p.v_cache + kvh * p.kv_head_stride),
        ks_head(static_cast<const char*>(p.k_scale) +
                kvh * p.scale_head_stride * static_cast<int64_t>(sizeof(ScaleT))),
        vs_head(static_cast<const char*>(p.v_scale) +
                kvh * p.scale_head_stride * static_cast<int64_t>(sizeof(ScaleT))),
        page_stride(p.kv_batch_stride),
        token_stride(p.kv_token_stride),
        scale_page_stride(p.scale_batch_stride * static_cast<int64_t>(sizeof(ScaleT))),
        scale_token_stride(p.scale_token_stride * static_cast<int64_t>(sizeof(ScaleT))),
        shift(p.page_shift),
        num_pages(p.num_pages),
        whole(p.page_shift >= 4) {
    // Tiles start at multiples of 16 tokens, so a row's slot is its sub-tile's first slot
    // (0 when pages are smaller than 16) plus (row % 16) & mask: a per-lane constant.
    const int mask = (1 << shift) - 1;
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int index = lane + 32 * i, row = index / S::kRowChunks;
      row_offset[i] = ((row % 16) & mask) * static_cast<int>(token_stride) +
                      16 * (index % S::kRowChunks);
    }
  }

  // Load the page ids of the tile at t0 (t0 < end): one per sub-tile when pages hold whole
  // sub-tiles, else one per row (rows past `end` are never copied: any id does).
  __device__ __forceinline__ void fetch(int t0, int end, int lane) {
    if (whole) {
      int sub_page[TILES];
#pragma unroll
      for (int sub = 0; sub < TILES; ++sub)
        sub_page[sub] = __ldg(table + (min(t0 + 16 * sub, end - 1) >> shift));
#pragma unroll
      for (int i = 0; i < kLoads; ++i) pages[i] = sub_page[i / kLoadsPerSub];
#pragma unroll
      for (int sub = 0; sub < TILES; ++sub) scale_page[sub] = sub_page[sub];
      return;
    }
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int row = (lane + 32 * i) / S::kRowChunks;
      pages[i] = __ldg(table + (min(t0 + row, end - 1) >> shift));
    }
    if constexpr (TOKEN_SCALES)
#pragma unroll
      for (int sub = 0; sub < TILES; ++sub)
        scale_page[sub] = __ldg(table + (min(t0 + 16 * sub + lane % 16, end - 1) >> shift));
  }

  // Issue the copies of the tile at t0 into stage number `index` at shared address `stage`,
  // from the page ids fetched for it. Rows past `end` (and rows of bad pages) are zero-filled
  // without a read; the math masks them.
  __device__ __forceinline__ void issue(uint32_t stage, int index, int t0, int end, int lane) {
    const int mask = (1 << shift) - 1;
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int index_in_tile = lane + 32 * i;
      const int row = index_in_tile / S::kRowChunks, chunk = index_in_tile % S::kRowChunks;
      const int page = pages[i];
      const bool good = static_cast<unsigned>(page) < static_cast<unsigned>(num_pages);
      const bool live = t0 + row < end;
      bad |= live && !good;
      const int64_t offset =
          live && good ? page * page_stride + ((t0 + 16 * (row / 16)) & mask) * token_stride +
                             row_offset[i]
                       : 0;
      const int bytes = live && good ? 16 : 0;
      cp_async_16(stage + S::kK + row * HEAD_DIM + 16 * S::k_chunk(row, chunk), k_head + offset,
                  bytes);
      cp_async_16(stage + S::kV + row * HEAD_DIM + 16 * S::v_chunk(row, chunk), v_head + offset,
                  bytes);
    }
    if constexpr (TOKEN_SCALES) {
      // Lanes 0-15 copy the K scales of tokens 0-15 of each sub-tile, lanes 16-31 the V scales.
      const bool is_v = lane >= 16;
      const char* base = is_v ? vs_head : ks_head;
#pragma unroll
      for (int sub = 0; sub < TILES; ++sub) {
        const int t = t0 + 16 * sub + lane % 16, page = scale_page[sub];
        const bool ok = t < end && static_cast<unsigned>(page) < static_cast<unsigned>(num_pages);
        const char* src = base + (ok ? page * scale_page_stride + (t & mask) * scale_token_stride
                                     : 0);
        const uint64_t word = reinterpret_cast<uint64_t>(src) & ~uint64_t{3};
        const uint32_t bit = 1u << (index * TILES + sub);
        selectors = (reinterpret_cast<uint64_t>(src) & 2) ? selectors | bit : selectors & ~bit;
        cp_async_4(stage + (is_v ? S::kVScale : S::kKScale) + 4 * (16 * sub + lane % 16),
                   reinterpret_cast<const void*>(word), ok ? 4 : 0);
      }
    }
  }

  // The scale of token `row` (0-15) of sub-tile `sub` of the stage numbered `index`, from the
  // word copied for it (fp16: the half its address selected).
  __device__ __forceinline__ float scale(const char* stage, int index, int sub, int row,
                                         bool is_v) const {
    const uint32_t word = *reinterpret_cast<const uint32_t*>(
        stage + (is_v ? S::kVScale : S::kKScale) + 4 * (16 * sub + row));
    if constexpr (sizeof(ScaleT) == 4) {
      return __uint_as_float(word);
    } else {
      const uint32_t owner = __shfl_sync(0xffffffffu, selectors, row + (is_v ? 16 : 0));
      const bool high = (owner >> (index * TILES + sub)) & 1u;
      return half_to_float(static_cast<uint16_t>(high ? word >> 16 : word & 0xffffu));
    }
  }
};

// The pager a decode kernel holds: PagedTiles over pages, nothing over a contiguous cache.
struct NoPager {
  template <typename P>
  __device__ __forceinline__ NoPager(const P&, int, int, int) {}
};
template <bool PAGED, int HEAD_DIM, bool TOKEN_SCALES, typename ScaleT, int TILES>
struct Pager { using type = PagedTiles<HEAD_DIM, TOKEN_SCALES, ScaleT, TILES>; };
template <int HEAD_DIM, bool TOKEN_SCALES, typename ScaleT, int TILES>
struct Pager<false, HEAD_DIM, TOKEN_SCALES, ScaleT, TILES> { using type = NoPager; };

}  // namespace llfd
