// The argument block of the decode kernels. Passed by value as a __grid_constant__ parameter;
// its Python twin is lowlevel_fd/decode/params.py (same field order, same types).
#pragma once
#include "kv_types.cuh"

namespace llfd {

struct DecodeParams {
  const void* q;            // [B, Hq, D] fp16/bf16
  const int8_t* k_cache;    // element (b, h, t, d) at b*kv_batch_stride + h*kv_head_stride
  const int8_t* v_cache;    //   + t*kv_token_stride + d (bytes): covers BNSH and BSNH
  const void* k_scale;      // fp32 [1] | fp32 [Hkv] | fp32/fp16 [B, Hkv, S_max] (by scale mode)
  const void* v_scale;
  const int32_t* seq_lens;  // [B]
  void* out;                // [B, Hq, D] like q
  float* lse;               // [B, Hq] natural log, or null
  float* partial_out;       // workspace [B, Hkv, num_splits, GROUP, D] fp32, normalised per split
  float* partial_lse;       // workspace [B, Hkv, num_splits, GROUP], base-2 log-sum-exp
  uint32_t* counters;       // workspace [B, Hkv]: arrivals of the splits (the last one merges)
  uint32_t* error_flags;    // workspace [1]: bit 0 = a length exceeded the capacity (clamped)
  int64_t q_batch_stride, q_head_stride;      // elements
  int64_t out_batch_stride, out_head_stride;  // elements
  int64_t kv_batch_stride, kv_head_stride, kv_token_stride;  // bytes (int8)
  int64_t scale_batch_stride, scale_head_stride;             // elements, per-token mode
  float score_scale_log2;   // sm_scale * log2(e)
  int32_t num_kv_heads;
  int32_t num_splits;       // grid.y: the most splits a sequence may use
  int32_t min_split_tokens; // a split never gets fewer tokens than this (multiple of 16)
  int32_t capacity;         // tokens per sequence the cache holds (lengths are clamped to it)
  int32_t fused_merge;      // 1: the last split CTA merges; 0: a combine kernel follows
  int32_t append;           // 1: fused append (decode_append.cuh): seq_lens are the positions
  int32_t rope;             //   of the new tokens; RopeStyle of their rotation
  float rope_theta;         //   inv_freq[i] = theta^(-2i/D) when cos_sin is null
  int32_t cluster_slots_offset;  // cluster merge: bytes into dynamic shared memory of the slots
  int32_t early_reads;      //   1: read the lengths, cache, scales and RoPE table before the
                            //   programmatic wait (the previous kernel writes none of them)
  int32_t key_transform;    //   1: keys are stored Hadamard-transformed (rows.cuh hadamard_row)
  const void* k_new;        //   the new tokens' K and V: [B, Hkv, D] like q
  const void* v_new;
  const float* cos_sin;     //   [max_pos >= capacity, D/2, 2] fp32, or null
  int64_t k_new_batch_stride, k_new_head_stride;  // elements
  int64_t v_new_batch_stride, v_new_head_stride;  // elements
  // The query heads: group_size per KV head, served by head_chunks CTAs of chunk_heads heads
  // (at most the kernel's GROUP) each; grid.x = num_kv_heads * head_chunks.
  int32_t group_size;
  int32_t head_chunks;
  int32_t chunk_heads;
  int32_t table_window;  // paged, fused append: 1 copies table ids with the position (IdWindow)
  // Paged storage (cache_pages.cuh; null block_table: contiguous). kv_batch_stride and
  // scale_batch_stride are then the pools' page strides.
  const int32_t* block_table;  // [>= B, table_stride]: page ids, read at run time
  int64_t table_stride;        // elements between two sequences' rows of the table
  int64_t scale_token_stride;  // elements between two tokens' scales (per-token mode)
  int32_t num_pages;           // page ids outside [0, num_pages) are never dereferenced
  int32_t page_shift;          // log2(page_size)
};

static_assert(sizeof(DecodeParams) == 320, "keep in sync with lowlevel_fd/decode/params.py");

// The query heads one CTA serves: `heads` (<= GROUP) consecutive heads from `first`, of KV head
// `kvh`; `slot` numbers the (kv head, chunk) pairs of a sequence (blockIdx.x), `slots` counts
// them (the split workspace and the merge counters are indexed by slot). MASKED kernels serve a
// group that is not GROUP (fewer heads: the rest masked; more: in chunks of CTAs) from the
// run-time fields; the others serve exactly GROUP heads per KV head, everything known at
// compile time (the run-time form cost ~2% at B=1 in the common case: PERF_NOTES v15).
template <int GROUP, bool MASKED>
struct HeadChunk {  // MASKED: the group's shape comes from the run-time fields
  int kvh, chunk, first, heads, slot;
  __device__ __forceinline__ HeadChunk(const DecodeParams& p, int x) : kvh(x), chunk(0), slot(x) {
    if (p.head_chunks > 1) {  // one chunk per KV head skips the division
      kvh = x / p.head_chunks;
      chunk = x - kvh * p.head_chunks;
    }
    first = kvh * p.group_size + chunk * p.chunk_heads;
    heads = min(p.chunk_heads, p.group_size - chunk * p.chunk_heads);
  }
  // Slots per sequence: read where used, so no register holds it through the kernel.
  __device__ __forceinline__ int slots(const DecodeParams& p) const {
    return p.num_kv_heads * p.head_chunks;
  }
  // Whether the chunk has its head h (h < GROUP).
  __device__ __forceinline__ bool has(int h) const { return h < heads; }
  // lse row of the chunk's head h of sequence b: heads are numbered b * Hq + head (< 2^31).
  __device__ __forceinline__ int row(const DecodeParams& p, int b, int h) const {
    return b * p.num_kv_heads * p.group_size + first + h;
  }
};

template <int GROUP>
struct HeadChunk<GROUP, false> {  // exactly GROUP heads per KV head, one CTA each
  static constexpr int chunk = 0, heads = GROUP;
  int kvh, first, slot;
  __device__ __forceinline__ HeadChunk(const DecodeParams&, int x)
      : kvh(x), first(x * GROUP), slot(x) {}
  __device__ __forceinline__ int slots(const DecodeParams& p) const { return p.num_kv_heads; }
  __device__ __forceinline__ bool has(int) const { return true; }
  __device__ __forceinline__ int row(const DecodeParams& p, int b, int h) const {
    return b * p.num_kv_heads * GROUP + first + h;
  }
};

// How many splits sequence `len` uses and how many tokens each gets (a multiple of 16).
// Computed on the device from the live length, so a captured graph stays right as lengths grow.
__device__ __forceinline__ void split_range(int len, const DecodeParams& p, int& chunk,
                                            int& active) {
  int per_split = (len + p.num_splits - 1) / p.num_splits;
  per_split = (per_split + 15) & ~15;
  chunk = per_split > p.min_split_tokens ? per_split : p.min_split_tokens;
  active = (len + chunk - 1) / chunk;
}

// With the fused append (p.append): a sequence whose new token goes to position `pos` streams
// its pos cached tokens, split as usual, and the new token joins the last split (split 0 when
// nothing is cached, so there is always one). A position outside the cache appends nothing
// (`appended` false) and streams the min(max(pos, 0), capacity) tokens there are. Returns the
// tokens streamed.
__device__ __forceinline__ int sequence_splits(const DecodeParams& p, int pos, bool& appended,
                                               int& chunk, int& active) {
  appended = pos >= 0 && pos < p.capacity;
  const int cached = appended ? pos : (pos < 0 ? 0 : p.capacity);
  split_range(cached, p, chunk, active);
  if (appended && active == 0) active = 1;
  return cached;
}

__device__ __forceinline__ int clamped_length(const DecodeParams& p, int b) {
  int len = p.seq_lens[b];
  if (len > p.capacity || len < 0) {
    // Never read or write outside the cache: clamp, and leave a flag the host can read.
    atomicOr(p.error_flags, kErrorOutsideCache);
    len = len < 0 ? 0 : p.capacity;
  }
  return len;
}

}  // namespace llfd
