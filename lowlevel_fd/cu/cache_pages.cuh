// Where a cached token lives, for every kernel family. Contiguous storage keeps sequence b at
// b * kv_batch_stride; paged storage (block_table != null) keeps token pos of sequence b in page
// block_table[b * table_stride + (pos >> page_shift)], slot pos & (page_size - 1), and the
// "batch" strides of the parameter block are then the pools' page strides. Byte offsets of a row
// are page * kv_batch_stride + head * kv_head_stride + slot * kv_token_stride (K and V pools share
// strides); scale indices (elements) are page * scale_batch_stride + head * scale_head_stride +
// slot * scale_token_stride. Any strides work, so a scale stored inline after each row (a float
// view of the same allocation) is one more layout.
//
// A page id outside [0, num_pages) is never dereferenced: the caller skips the write (or
// zero-fills the load: PagedTiles in decode_pages.cuh) and sets kErrorBadPage.
#pragma once
#include "kv_types.cuh"

namespace llfd {

// The page of token `pos` of sequence b (contiguous storage: b itself). `pos` must lie in
// [0, capacity).
template <typename P>
__device__ __forceinline__ int page_of(const P& p, int b, int pos) {
  return p.block_table != nullptr ? p.block_table[b * p.table_stride + (pos >> p.page_shift)] : b;
}

// Row byte offset and scale index of token `pos`, KV head `head`, in `page` (page_of); false
// when the page id is out of range (nothing to read or write).
template <typename P>
__device__ __forceinline__ bool token_offsets(const P& p, int page, int head, int pos,
                                              int64_t& row, int64_t& scale) {
  int slot = pos;
  if (p.block_table != nullptr) {
    if (static_cast<unsigned>(page) >= static_cast<unsigned>(p.num_pages)) return false;
    slot = pos & ((1 << p.page_shift) - 1);
  }
  row = page * p.kv_batch_stride + head * p.kv_head_stride + slot * p.kv_token_stride;
  scale = page * p.scale_batch_stride + head * p.scale_head_stride + slot * p.scale_token_stride;
  return true;
}

template <typename P>
__device__ __forceinline__ bool locate_token(const P& p, int b, int head, int pos, int64_t& row,
                                             int64_t& scale) {
  return token_offsets(p, page_of(p, b, pos), head, pos, row, scale);
}

// The fused append's window of sequence b's table row in shared memory. The page ids of a
// CTA's first tiles wait for the sequence's position, and without early reads a round trip to
// the table after it sat on the chain of the decode step (B=1, 1024 tokens: 6.54 us per layer
// paged against 5.71 contiguous; with the window 6.05, PERF_NOTES v17). The window's ids are
// copied alongside the position read instead: kEntries ids from the earliest page the CTA's
// split can start at (split x min_split_tokens), when the plan asks (p.table_window: plans of
// few CTAs, where the chain is the time). Ids outside it are read from the table as before.
// (The plain decode kernel has no window: the window's CTA barrier made it slower. Nor an
// L1 prefetch of the row: it cost 1-3 points at B=1, PERF_NOTES v22.)
template <int THREADS>
struct IdWindow {
  static constexpr int kEntries = 1024;
  int first = 0, count = 0;  // the window: pages [first, first + count) of the row

  // Copies the window into `ids` (shared) in a cp.async group of its own: issued before the
  // length is read, with no register waiting on it. wait() completes it.
  template <typename P>
  __device__ __forceinline__ void load(const P& p, int b, int split, int* ids) {
    if (p.table_window == 0) return;
    const int row_pages = (p.capacity + (1 << p.page_shift) - 1) >> p.page_shift;
    first = min(static_cast<int>((static_cast<int64_t>(split) * p.min_split_tokens) >>
                                 p.page_shift), row_pages);
    count = min(kEntries, row_pages - first);
    const int32_t* row = p.block_table + b * p.table_stride + first;
    const uint32_t base = shared_address(ids);
    for (int i = threadIdx.x; i < count; i += THREADS) cp_async_4(base + 4 * i, row + i, 4);
    cp_async_commit();
  }
  // Before the first id is read (every thread of the CTA; no other cp.async in flight).
  template <typename P>
  __device__ __forceinline__ void wait(const P& p) const {
    if (p.table_window == 0) return;
    cp_async_wait<0>();
    __syncthreads();
  }
  // Before a CTA returns without reading the window: no copy outlives it.
  template <typename P>
  __device__ __forceinline__ void drain(const P& p) const {
    if (p.table_window != 0) cp_async_wait<0>();
  }
};

}  // namespace llfd
