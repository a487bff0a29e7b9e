// The multi-token kernel's KV tiles: shared-memory stages filled by cp.async from a contiguous
// or paged cache (cache_pages.cuh), and their int8 rows read as fp16 mma B fragments.
//
// Stage layout (bytes): K [kRows][D] | V [kRows][D] | K scales [kRows] fp32 | V scales [kRows].
// A row's 16-byte chunks are XOR-swizzled by the row (chunk ^ (row & 7); D = 64: the row pair),
// so the eight row addresses of every ldmatrix phase fall in distinct bank groups.
//
// Fragments come from ldmatrix on int8 rows viewed as b16, converted in registers (no fp16
// copy of the tile in shared memory: that would double the shared-memory traffic of the
// mma operands):
//  * K (B of S = Q K^T, k = dims, n = tokens): lane (g, c) gets bytes 4c..4c+3 of token g's
//    16-dim chunk; they serve as mma k = 2c, 2c+1 (bytes 0, 1) and 2c+8, 2c+9 (bytes 2, 3), and
//    Q is loaded with the same permutation of the dims (S does not depend on their order).
//  * V (B of O += P V, k = tokens, n = dims): ldmatrix .trans hands lane (g, c) tokens 2c, 2c+1
//    at dims 2g, 2g+1 of a chunk; bytes 0, 2 are the B fragment of the "even" n-block (dims
//    d0 + 2n) and bytes 1, 3 that of the "odd" one (d0 + 2n + 1). A lane's accumulators then
//    hold dims d0 + 4c .. d0 + 4c + 3 of its rows: one 8-byte store per chunk.
#pragma once
#include "multi_params.cuh"

namespace llfd {

template <int HEAD_DIM, int ROWS, int THREADS = 128>
struct MultiTile {
  static_assert(HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256, "head_dim 64/128/256");
  static_assert(ROWS == 32 || ROWS == 64, "32 or 64 KV tokens per tile");
  static constexpr int kRows = ROWS;  // KV tokens per tile
  static constexpr int kRowChunks = HEAD_DIM / 16;
  static constexpr int kK = 0, kV = kRows * HEAD_DIM, kKScale = 2 * kRows * HEAD_DIM;
  static constexpr int kVScale = kKScale + 4 * kRows;
  static constexpr int kBytes = kVScale + 4 * kRows;
  static constexpr int kThreads = THREADS;  // the CTA's threads, each issuing its share
  static constexpr int kLoads = kRows * kRowChunks / kThreads;  // chunks per thread and tensor
  static constexpr int kRowStep = kThreads / kRowChunks;        // rows between them

  __device__ static __forceinline__ int offset(int row, int chunk) {
    const int swizzled = HEAD_DIM == 64 ? chunk ^ ((row >> 1) & 3) : chunk ^ (row & 7);
    return row * HEAD_DIM + 16 * swizzled;
  }
};

// Issues the copies of one tile per call, every thread of the CTA its share: kLoads chunks of K
// and of V, and (per-token scales) threads 0..2 kRows-1 one K or V scale each. Rows past the
// range's end and rows in bad pages are zero-filled without a read. Paged: the page ids of the
// next tile are loaded right after a tile is issued, so their latency hides behind a tile of
// math. fp16 scales are copied as their aligned 4-byte word (cp.async has no 2-byte form) with
// the half selected per stage by a bit (`selectors`), and widened to fp32 in place by the same
// thread once its copies land (widen): the math reads fp32 scales.
// The loader keeps only the sequence, the head and its page ids in registers: every base and
// stride is read from the parameter block (constant memory) where it is used, so that the
// loop's registers go to the accumulators (cached strides made eight variants spill).
// CURSOR (contiguous storage, kernels with registers to spare): the byte offsets of this
// thread's first row and scale in the next tile are kept and advanced a tile per issue
// instead of recomputed from the token (tiles are issued in order from `start`).
template <int HEAD_DIM, int ROWS, bool TOKEN_SCALES, typename ScaleT, bool PAGED,
          int THREADS = 128, bool CURSOR = false>
struct TileLoader {
  static_assert(!(CURSOR && PAGED), "the cursor walks contiguous storage");
  using T = MultiTile<HEAD_DIM, ROWS, THREADS>;
  static constexpr int64_t kScaleBytes = sizeof(ScaleT);
  int b, kvh;
  int pages[T::kLoads];    // paged: the next tile's page of each of this thread's rows
  int scale_page;          //   ... and of its scale token
  uint32_t selectors = 0;  // fp16 scales: bit `stage` set = the high half
  bool bad = false;        // a page id out of range was met
  int64_t row_cursor = 0, scale_cursor = 0;  // CURSOR: bytes, the next tile's

  __device__ __forceinline__ TileLoader(int b_, int kvh_) : b(b_), kvh(kvh_) {}

  __device__ static __forceinline__ int row0() { return threadIdx.x / T::kRowChunks; }
  __device__ static __forceinline__ int chunk() { return threadIdx.x % T::kRowChunks; }
  __device__ static __forceinline__ bool scale_thread() { return threadIdx.x < 2 * T::kRows; }

  // Paged: the page ids of the tile at t0 (rows before `end` only: the table need not reach
  // further).
  __device__ __forceinline__ void fetch(const MultiParams& p, int t0, int end) {
    if constexpr (PAGED) {
      const int32_t* table = p.block_table + b * p.table_stride;
#pragma unroll
      for (int i = 0; i < T::kLoads; ++i) {
        const int t = t0 + row0() + i * T::kRowStep;
        pages[i] = t < end ? __ldg(table + (t >> p.page_shift)) : 0;
      }
      const int t = t0 + static_cast<int>(threadIdx.x) % T::kRows;
      scale_page = TOKEN_SCALES && scale_thread() && t < end
                       ? __ldg(table + (t >> p.page_shift)) : 0;
    }
  }

  // Byte offset of token t's row from the cache's base, or -1 when it is not to be read.
  __device__ __forceinline__ int64_t row_offset(const MultiParams& p, int page, int t, int end) {
    if (t >= end) return -1;
    const int64_t head = kvh * p.kv_head_stride;
    if constexpr (PAGED) {
      if (static_cast<unsigned>(page) >= static_cast<unsigned>(p.num_pages)) {
        bad = true;
        return -1;
      }
      return page * p.kv_batch_stride + head + (t & ((1 << p.page_shift) - 1)) * p.kv_token_stride;
    } else {
      return b * p.kv_batch_stride + head + t * p.kv_token_stride;
    }
  }

  // CURSOR: the offsets of the tile at t0 (before its issue).
  __device__ __forceinline__ void start_cursor(const MultiParams& p, int t0) {
    if constexpr (CURSOR) {
      row_cursor = b * p.kv_batch_stride + kvh * p.kv_head_stride +
                   static_cast<int64_t>(t0 + row0()) * p.kv_token_stride + 16 * chunk();
      scale_cursor = (b * p.scale_batch_stride + kvh * p.scale_head_stride +
                      static_cast<int64_t>(t0 + static_cast<int>(threadIdx.x) % T::kRows) *
                          p.scale_token_stride) * kScaleBytes;
    }
  }

  __device__ __forceinline__ void issue(const MultiParams& p, uint32_t stage_addr, int stage,
                                        int t0, int end) {
    if constexpr (CURSOR) {
      issue_at_cursor(p, stage_addr, stage, t0, end);
      return;
    }
#pragma unroll
    for (int i = 0; i < T::kLoads; ++i) {
      const int row = row0() + i * T::kRowStep;
      const int64_t at = row_offset(p, PAGED ? pages[i] : 0, t0 + row, end);
      const int64_t src = at < 0 ? 0 : at + 16 * chunk();
      const int bytes = at < 0 ? 0 : 16;
      cp_async_16(stage_addr + T::kK + T::offset(row, chunk()), p.k_cache + src, bytes);
      cp_async_16(stage_addr + T::kV + T::offset(row, chunk()), p.v_cache + src, bytes);
    }
    if constexpr (TOKEN_SCALES) {
      if (scale_thread()) {
        const bool is_v = threadIdx.x >= T::kRows;
        const int r = threadIdx.x % T::kRows, t = t0 + r;
        const char* base = static_cast<const char*>(is_v ? p.v_scale : p.k_scale);
        int64_t at = -1;  // bytes
        if (t < end) {
          const int64_t head = kvh * p.scale_head_stride;
          if constexpr (PAGED) {
            if (static_cast<unsigned>(scale_page) < static_cast<unsigned>(p.num_pages))
              at = (scale_page * p.scale_batch_stride + head +
                    (t & ((1 << p.page_shift) - 1)) * p.scale_token_stride) * kScaleBytes;
          } else {
            at = (b * p.scale_batch_stride + head + t * p.scale_token_stride) * kScaleBytes;
          }
        }
        const uint32_t dst = stage_addr + (is_v ? T::kVScale : T::kKScale) + 4 * r;
        if constexpr (sizeof(ScaleT) == 2) {
          // The aligned word holding the scale: 2 bytes when it is the low half (never past
          // the array's end), all 4 when it is the high half (the low half lies in the same
          // allocation: an allocation starts 4-byte aligned).
          const uint64_t address = reinterpret_cast<uint64_t>(base + (at < 0 ? 0 : at));
          const uint32_t high = (address >> 1) & 1;
          selectors = (selectors & ~(1u << stage)) | (high << stage);
          cp_async_4(dst, reinterpret_cast<const void*>(address & ~uint64_t(3)),
                     at < 0 ? 0 : (high ? 4 : 2));
        } else {
          cp_async_4(dst, base + (at < 0 ? 0 : at), at < 0 ? 0 : 4);
        }
      }
    }
  }

  __device__ __forceinline__ void issue_at_cursor(const MultiParams& p, uint32_t stage_addr,
                                                  int stage, int t0, int end) {
    const int64_t step = static_cast<int64_t>(T::kRowStep) * p.kv_token_stride;
#pragma unroll
    for (int i = 0; i < T::kLoads; ++i) {
      const int row = row0() + i * T::kRowStep;
      const bool in = t0 + row < end;
      const int64_t src = in ? row_cursor + i * step : 0;
      cp_async_16(stage_addr + T::kK + T::offset(row, chunk()), p.k_cache + src, in ? 16 : 0);
      cp_async_16(stage_addr + T::kV + T::offset(row, chunk()), p.v_cache + src, in ? 16 : 0);
    }
    row_cursor += T::kRows * p.kv_token_stride;
    if constexpr (TOKEN_SCALES) {
      if (scale_thread()) {
        const bool is_v = threadIdx.x >= T::kRows;
        const int r = threadIdx.x % T::kRows;
        const char* base = static_cast<const char*>(is_v ? p.v_scale : p.k_scale);
        const bool in = t0 + r < end;
        const uint32_t dst = stage_addr + (is_v ? T::kVScale : T::kKScale) + 4 * r;
        if constexpr (sizeof(ScaleT) == 2) {  // the aligned word, as issue() explains
          const uint64_t address = reinterpret_cast<uint64_t>(base + (in ? scale_cursor : 0));
          const uint32_t high = (address >> 1) & 1;
          selectors = (selectors & ~(1u << stage)) | (high << stage);
          cp_async_4(dst, reinterpret_cast<const void*>(address & ~uint64_t(3)),
                     in ? (high ? 4 : 2) : 0);
        } else {
          cp_async_4(dst, base + (in ? scale_cursor : 0), in ? 4 : 0);
        }
      }
      scale_cursor += T::kRows * p.scale_token_stride * kScaleBytes;
    }
  }

  // Before the loop: the page ids of the tile at start, then the first STAGES - 1 tiles issued
  // into stages 0.. (one commit group each, empty past the range).
  template <int STAGES>
  __device__ __forceinline__ void prime(const MultiParams& p, uint32_t base, int stage_bytes,
                                        int start, int end) {
    start_cursor(p, start);
    fetch(p, start, end);
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
      const int t = start + st * T::kRows;
      if (t < end) {
        issue(p, base + st * stage_bytes, st, t, end);
        fetch(p, t + T::kRows, end);
      }
      cp_async_commit();
    }
  }

  // fp16 scales: this thread's copied word -> its scale as fp32, in place (after its copies
  // of `stage` landed, before the barrier that publishes the stage).
  __device__ __forceinline__ void widen(char* stage_base, int stage) {
    if constexpr (TOKEN_SCALES && sizeof(ScaleT) == 2) {
      if (scale_thread()) {
        const bool is_v = threadIdx.x >= T::kRows;
        uint32_t* slot = reinterpret_cast<uint32_t*>(
            stage_base + (is_v ? T::kVScale : T::kKScale) + 4 * (threadIdx.x % T::kRows));
        const uint32_t word = *slot;
        const uint16_t bits = ((selectors >> stage) & 1) ? word >> 16 : word & 0xffffu;
        *reinterpret_cast<float*>(slot) = half_to_float(bits);
      }
    }
  }
};

// ---- fragments ---------------------------------------------------------------------------------
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address)
               : "memory");
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address)
               : "memory");
}

// Bytes (SELECTOR's picks) of a word of int8 as an exact fp16 pair (common.cuh's magic-number
// conversion: the word is biased by XOR 0x80 first).
template <uint32_t SELECTOR>
__device__ __forceinline__ uint32_t int8_pair(uint32_t biased) {
  return hsub2(prmt(biased, kExp1024x4, SELECTOR), kMagic1152x2);
}

}  // namespace llfd
