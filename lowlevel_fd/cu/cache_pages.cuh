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

// Pull the start of sequence b's table row into L1 (one 128-byte line per thread, up to
// `threads` lines) while the kernel reads its length, so that the first page lookups, which
// must wait for the length, hit L1 instead of adding an L2 round trip to the chain.
template <typename P>
__device__ __forceinline__ void prefetch_table_row(const P& p, int b, int threads) {
  const int lines = ((p.capacity >> p.page_shift) + 31) / 32;
  for (int line = threadIdx.x; line < lines && line < threads; line += blockDim.x)
    asm volatile("prefetch.global.L1 [%0];" ::"l"(p.block_table + b * p.table_stride +
                                                    32 * line));
}

}  // namespace llfd
