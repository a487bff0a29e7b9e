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
// zero-fills the load: PagedTiles in decode_pipeline.cuh) and sets kErrorBadPage.
#pragma once
#include "kv_types.cuh"

namespace llfd {

// Row byte offset and scale index of token `pos` of sequence b, KV head `head`; false when its
// page id is out of range (nothing to read or write). `pos` must lie in [0, capacity).
template <typename P>
__device__ __forceinline__ bool locate_token(const P& p, int b, int head, int pos, int64_t& row,
                                             int64_t& scale) {
  int64_t base = b;
  int slot = pos;
  if (p.block_table != nullptr) {
    const int page = p.block_table[b * p.table_stride + (pos >> p.page_shift)];
    if (static_cast<unsigned>(page) >= static_cast<unsigned>(p.num_pages)) return false;
    base = page;
    slot = pos & ((1 << p.page_shift) - 1);
  }
  row = base * p.kv_batch_stride + head * p.kv_head_stride + slot * p.kv_token_stride;
  scale = base * p.scale_batch_stride + head * p.scale_head_stride + slot * p.scale_token_stride;
  return true;
}

}  // namespace llfd
