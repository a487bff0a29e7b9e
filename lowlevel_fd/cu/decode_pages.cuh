// The decode kernel's tile loads over pages (the PAGED instantiation of decode_split): the same
// stages as issue_tile (decode_pipeline.cuh), each row from its page of the block table
// (cache_pages.cuh).
//  * Page ids load ahead of the tiles (start, advance). Whole pages, and every page size at
//    head_dim 256: a tile ahead. Smaller pages: a ring in registers holds the ids of a batch
//    of the warp's next tiles, and the batch after it, loaded when the first comes into use.
//    Their table reads (16 ids per tile, an L2 round trip queued behind the stream) then hide
//    behind a batch of tiles: with ids a tile ahead, pages of 1 in physical order cost 1.21x
//    contiguous on the H200, with ids computed 1.06x, with the ring 1.09-1.10x (PERF_NOTES
//    v34).
//  * Pages of >= 16 tokens ("whole": the usual case) hold whole 16-token sub-tiles: one id and
//    one 64-bit page address per sub-tile, and per row only a lane-constant offset. Smaller
//    pages: one id per token, handed to every row by a shuffle from the ring (head_dim 256:
//    one id per row). The two paths are picked per launch; the kernel's loop and prologue are
//    instantiated for each.
//  * Rows past the sequence's end and rows of bad page ids are zero-filled without a read.
//  * Per-token scales are copied as the aligned 4-byte word holding them (fp16: either half;
//    which one is a bit per stage and sub-tile in `selectors`, read by the consumer through a
//    shuffle): cp.async cannot copy 2 bytes, and a scale's neighbours in a pool need not be
//    its own sequence's.
#pragma once
#include "cache_pages.cuh"
#include "decode_pipeline.cuh"

namespace llfd {

// A compile-time bool as a value: the decode loop is instantiated once per page path.
template <bool B>
struct BoolTag { static constexpr bool value = B; };

// STEP: tokens between a warp's consecutive tiles.
template <int HEAD_DIM, bool TOKEN_SCALES, typename ScaleT, int TILES, int STEP>
struct PagedTiles {
  using S = Stage<HEAD_DIM, ScaleT, TILES, true>;
  static constexpr int kLoads = TILES * HEAD_DIM / 32;  // 16-byte chunks per lane and tile
  static constexpr int kLoadsPerSub = kLoads / TILES;   // ... per 16-token sub-tile
  static constexpr int kRowStep = 32 / (HEAD_DIM / 16);  // rows between a lane's chunks
  static constexpr bool kHalfScales = sizeof(ScaleT) == 2;
  // Small pages' ring: lanes [kIds * k, + kIds) of one register hold the ids of the tokens
  // of kPerReg tiles; a batch is kRegs registers' tiles. One register (2 tiles) was still
  // short of the table's latency behind the stream, four no better than two (PERF_NOTES
  // v34). head_dim 256 keeps one id per row, loaded a tile ahead: its widest variants are at
  // 255 registers, and ring or shuffles spill them.
  static constexpr bool kRing = HEAD_DIM != 256;
  static constexpr int kIds = 16 * TILES;
  static constexpr int kPerReg = 32 / kIds;
  static constexpr int kRegs = 2;
  static constexpr int kBatch = kPerReg * kRegs;
  const int32_t* table;  // this sequence's row of the block table
  uint32_t window = 0;  // shared address of the ids of pages [window_first, + window_count)
  int window_first = 0, window_count = 0;  // (IdWindow); count 0: none
  const int8_t *k_head, *v_head;  // the pools at this KV head
  int64_t v_delta;                // v_head - k_head
  const char* scale_head;         // this lane's scale pool (K: lanes 0-15, V: 16-31) at the head
  // Bytes. Page ids are in range (unsigned) where they are used: 32 x 64-bit products. Slot
  // offsets inside a page fit 32 bits.
  uint64_t page_stride, scale_page_stride;
  int token_stride, scale_token_stride;
  int shift, mask, num_pages;
  bool whole;              // pages of >= 16 tokens: a sub-tile lies in one page
  int row0, chunk_bytes;   // this lane's first row of a sub-tile, and its chunk's byte offset
  int scale_offset;        // bytes of this lane's scale token past its sub-tile's first slot
  // Small pages: the ids of the warp's batch of tiles being issued, and of the batch after
  // it (in flight while this one is used); slot: the next tile's place in the batch.
  int ids_now[kRing ? kRegs : 1] = {}, ids_ahead[kRing ? kRegs : 1] = {}, slot = 0;
  int sub_page[TILES];  // whole pages: the page of each sub-tile of the next tile; small
                        // pages without the ring: of this lane's scale token
  int pages[kRing ? 1 : kLoads];  // small pages without the ring: each of this lane's rows
  uint32_t selectors = 0;  // fp16 scales: bit stage * TILES + sub set = the high half
  bool bad = false;        // a page id out of range was met

  template <typename P>
  __device__ __forceinline__ PagedTiles(const P& p, int b, int kvh, int lane)
      : table(p.block_table + b * p.table_stride),
        k_head(p.k_cache + kvh * p.kv_head_stride),
        v_head(p.v_cache + kvh * p.kv_head_stride),
        v_delta(p.v_cache - p.k_cache),
        scale_head(static_cast<const char*>(lane >= 16 ? p.v_scale : p.k_scale) +
                   kvh * p.scale_head_stride * static_cast<int64_t>(sizeof(ScaleT))),
        page_stride(p.kv_batch_stride),
        scale_page_stride(p.scale_batch_stride * sizeof(ScaleT)),
        token_stride(static_cast<int>(p.kv_token_stride)),
        scale_token_stride(static_cast<int>(p.scale_token_stride * sizeof(ScaleT))),
        shift(p.page_shift),
        mask((1 << p.page_shift) - 1),
        num_pages(p.num_pages),
        whole(p.page_shift >= 4) {
    // Tiles start at multiples of 16 tokens, so a row's slot is its sub-tile's first slot
    // (0 when pages are smaller than 16) plus (row % 16) & mask (row_offset).
    row0 = lane / S::kRowChunks;
    chunk_bytes = 16 * (lane % S::kRowChunks);
    scale_offset = ((lane % 16) & mask) * scale_token_stride;
  }

  __device__ __forceinline__ void use_window(const int* ids, int first, int count) {
    window = shared_address(ids), window_first = first, window_count = count;
  }

  // The id of the row's page `index`: from the shared window when it holds it.
  __device__ __forceinline__ int id(int index) const {
    const unsigned at = static_cast<unsigned>(index - window_first);
    if (at < static_cast<unsigned>(window_count)) {
      int page;
      asm volatile("ld.shared.b32 %0, [%1];" : "=r"(page) : "r"(window + 4 * at));
      return page;
    }
    return __ldg(table + index);
  }

  // Whole pages: the ids of the sub-tiles of the tile at t0.
  __device__ __forceinline__ void load_sub_pages(int t0, int end) {
#pragma unroll
    for (int sub = 0; sub < TILES; ++sub)
      sub_page[sub] = id(min(t0 + 16 * sub, end - 1) >> shift);
  }

  // Small pages without the ring: the ids of this lane's rows and scale tokens of the tile
  // at t0. Tokens past `end` are never copied: any id of the row does for them, so every
  // index is clamped into it.
  __device__ __forceinline__ void load_rows(int t0, int end, int lane) {
#pragma unroll
    for (int i = 0; i < kLoads; ++i)
      pages[i] = id(min(t0 + (lane + 32 * i) / S::kRowChunks, end - 1) >> shift);
    if constexpr (TOKEN_SCALES) {
#pragma unroll
      for (int sub = 0; sub < TILES; ++sub)
        sub_page[sub] = id(min(t0 + 16 * sub + lane % 16, end - 1) >> shift);
    }
  }

  // Small pages: this lane's id in register r of the batch of tiles from t0 on, of token
  // lane % kIds of tile t0 + STEP * (kPerReg * r + lane / kIds).
  __device__ __forceinline__ int batch_id(int t0, int end, int lane, int r) const {
    return id(min(t0 + STEP * (kPerReg * r + lane / kIds) + lane % kIds, end - 1) >> shift);
  }

  __device__ __forceinline__ void load_batch(int (&ids)[kRing ? kRegs : 1], int t0, int end,
                                             int lane) {
#pragma unroll
    for (int r = 0; r < kRegs; ++r) ids[r] = batch_id(t0, end, lane, r);
  }

  // Before the warp's first tile, at t0 (< end; the warp's tiles follow every STEP tokens).
  // WHOLE: the path `whole` selects, known at compile time (the kernel's loop is instantiated
  // for each).
  template <bool WHOLE>
  __device__ __forceinline__ void start(int t0, int end, int lane) {
    if constexpr (WHOLE) {
      load_sub_pages(t0, end);
    } else if constexpr (!kRing) {
      load_rows(t0, end, lane);
    } else {
      slot = 0;
      load_batch(ids_now, t0, end, lane);
      if (t0 + kBatch * STEP < end) load_batch(ids_ahead, t0 + kBatch * STEP, end, lane);
    }
  }

  // After the warp's tile before t_next (< end) is issued. Whole pages: t_next's ids load, a
  // tile ahead (a page of >= 16 tokens holds a warp's next tiles, so mostly from L1). Small
  // pages: the ring moves to t_next's slot; a used-up batch gives way to the one loaded with
  // it, and the next one loads.
  template <bool WHOLE>
  __device__ __forceinline__ void advance(int t_next, int end, int lane) {
    if constexpr (WHOLE) {
      load_sub_pages(t_next, end);
    } else if constexpr (!kRing) {
      load_rows(t_next, end, lane);
    } else if (++slot == kBatch) {
      slot = 0;
#pragma unroll
      for (int r = 0; r < kRegs; ++r) ids_now[r] = ids_ahead[r];
      if (t_next + kBatch * STEP < end) load_batch(ids_ahead, t_next + kBatch * STEP, end, lane);
    }
  }

  // Small pages: the id of token `index` of the tile in the ring's current slot (every lane
  // runs every shuffle: the caller's branches are uniform per warp).
  __device__ __forceinline__ int ring_id(int index) const {
    int ids = ids_now[0];
#pragma unroll
    for (int r = 1; r < kRegs; ++r)
      if (slot >= r * kPerReg) ids = ids_now[r];
    return __shfl_sync(0xffffffffu, ids, (slot & (kPerReg - 1)) * kIds + index);
  }

  // Bytes of this lane's chunk i of a tile past its sub-tile's first slot.
  __device__ __forceinline__ int row_offset(int i) const {
    return (((row0 + kRowStep * i) % 16) & mask) * token_stride + chunk_bytes;
  }

  __device__ __forceinline__ bool good(int page) const {
    return static_cast<unsigned>(page) < static_cast<unsigned>(num_pages);
  }

  // Issue the copies of the warp's next tile (at t0) into stage number `index` at shared
  // address `stage`.
  template <bool WHOLE>
  __device__ __forceinline__ void issue_as(uint32_t stage, int index, int t0, int end,
                                           int lane) {
    if constexpr (WHOLE)
      issue_whole(stage, index, t0, end, lane);
    else
      issue_rows(stage, index, t0, end, lane);
  }

  // Pages of >= 16 tokens: one page address per sub-tile, a constant offset per row. A row
  // that is not copied keeps a pointer inside the pool (page 0 when the id is bad) and reads
  // nothing.
  __device__ __forceinline__ void issue_whole(uint32_t stage, int index, int t0, int end,
                                              int lane) {
#pragma unroll
    for (int sub = 0; sub < TILES; ++sub) {
      const int first = t0 + 16 * sub, page = sub_page[sub];
      const bool ok = good(page);
      bad |= first < end && !ok;
      const unsigned safe = ok ? page : 0;
      // This lane's first row of the sub-tile; its next rows follow every kRowStep tokens
      // (the same step for every lane: one 64-bit add per row), V at a fixed distance.
      const int8_t* k = k_head + safe * page_stride +
                        static_cast<unsigned>((first & mask) * token_stride + row_offset(0));
      const int row_step = kRowStep * token_stride;
#pragma unroll
      for (int j = 0; j < kLoadsPerSub; ++j) {
        const int i = sub * kLoadsPerSub + j, index_in_tile = lane + 32 * i;
        const int row = index_in_tile / S::kRowChunks, chunk = index_in_tile % S::kRowChunks;
        const int bytes = ok && t0 + row < end ? 16 : 0;
        const int8_t* src = k + j * row_step;
        cp_async_16(stage + S::kK + row * HEAD_DIM + 16 * S::k_chunk(row, chunk), src, bytes);
        cp_async_16(stage + S::kV + row * HEAD_DIM + 16 * S::v_chunk(row, chunk),
                    src + v_delta, bytes);
      }
      issue_scales(stage, index, sub, first, end, lane, safe, ok);
    }
  }

  // Pages of fewer than 16 tokens: every row (and scale token) from its own page, which the
  // lane holding that token's id hands over.
  __device__ __forceinline__ void issue_rows(uint32_t stage, int index, int t0, int end,
                                             int lane) {
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int index_in_tile = lane + 32 * i;
      const int row = index_in_tile / S::kRowChunks, chunk = index_in_tile % S::kRowChunks;
      int page;
      if constexpr (kRing) page = ring_id(row);
      else page = pages[i];
      const bool ok = good(page), live = t0 + row < end;
      bad |= live && !ok;
      const uint64_t offset = static_cast<unsigned>(ok ? page : 0) * page_stride +
                              static_cast<unsigned>(row_offset(i));
      const int bytes = ok && live ? 16 : 0;
      cp_async_16(stage + S::kK + row * HEAD_DIM + 16 * S::k_chunk(row, chunk),
                  k_head + offset, bytes);
      cp_async_16(stage + S::kV + row * HEAD_DIM + 16 * S::v_chunk(row, chunk),
                  v_head + offset, bytes);
    }
#pragma unroll
    for (int sub = 0; sub < TILES; ++sub) {
      int page;
      if constexpr (kRing) page = ring_id(16 * sub + lane % 16);
      else page = sub_page[sub];
      const bool ok = good(page);
      issue_scales(stage, index, sub, t0 + 16 * sub, end, lane, ok ? page : 0u, ok);
    }
  }

  // Lanes 0-15 copy the K scales of tokens 0-15 of the sub-tile at `first`, lanes 16-31 the V
  // scales; `page` is this lane's token's page (0 when its id is bad: nothing is read).
  __device__ __forceinline__ void issue_scales(uint32_t stage, int index, int sub, int first,
                                               int end, int lane, unsigned page, bool ok) {
    if constexpr (TOKEN_SCALES) {
      const char* src = scale_head + page * scale_page_stride +
                        static_cast<unsigned>((first & mask) * scale_token_stride + scale_offset);
      if constexpr (kHalfScales) {
        const uint32_t bit = 1u << (index * TILES + sub);
        selectors = (reinterpret_cast<uint64_t>(src) & 2) ? selectors | bit : selectors & ~bit;
      }
      cp_async_4(stage + (lane >= 16 ? S::kVScale : S::kKScale) + 4 * (16 * sub + lane % 16),
                 reinterpret_cast<const void*>(reinterpret_cast<uint64_t>(src) & ~uint64_t{3}),
                 ok && first + lane % 16 < end ? 4 : 0);
    }
  }

  // The scale of token `row` (0-15) of sub-tile `sub` of the stage numbered `index`, from the
  // word copied for it (fp16: the half its address selected).
  __device__ __forceinline__ float scale(const char* stage, int index, int sub, int row,
                                         bool is_v) const {
    const uint32_t word = *reinterpret_cast<const uint32_t*>(
        stage + (is_v ? S::kVScale : S::kKScale) + 4 * (16 * sub + row));
    if constexpr (!kHalfScales) {
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
template <bool PAGED, int HEAD_DIM, bool TOKEN_SCALES, typename ScaleT, int TILES, int STEP>
struct Pager { using type = PagedTiles<HEAD_DIM, TOKEN_SCALES, ScaleT, TILES, STEP>; };
template <int HEAD_DIM, bool TOKEN_SCALES, typename ScaleT, int TILES, int STEP>
struct Pager<false, HEAD_DIM, TOKEN_SCALES, ScaleT, TILES, STEP> { using type = NoPager; };

}  // namespace llfd
