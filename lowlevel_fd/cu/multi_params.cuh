// The argument block of the multi-token attention kernel (multi.cu): packed ragged queries over
// the INT8 cache (prefill, chunked prefill, speculative verification). Passed by value as a
// __grid_constant__ parameter; its Python twin is lowlevel_fd/multi/params.py.
#pragma once
#include "kv_types.cuh"

namespace llfd {

struct MultiParams {
  const void* q;             // [total_q, Hq, D] fp16/bf16, rows of sequence b at qo_indptr[b]..
  const int8_t* k_cache;     // the cache fields of core/binding.py (cache_pages.cuh)
  const int8_t* v_cache;
  const void* k_scale;
  const void* v_scale;
  const int32_t* seq_lens;   // [B]: cached tokens, the chunk's included (its last qo_len)
  const int32_t* qo_indptr;  // [B + 1]
  void* out;                 // [total_q, Hq, D] like q
  float* lse;                // [total_q, Hq] natural log, or null
  float* partial_out;        // splits: [B * Hkv * max_tiles][num_splits][tile rows][D] fp32
  float* partial_lse;        //   [B * Hkv * max_tiles][num_splits][tile rows], base 2
  uint32_t* counters;        //   [B * Hkv * max_tiles]: arrivals (the last split merges)
  uint32_t* error_flags;     // [1], see kError*
  const float* cos_sin;      // RoPE of q (rope != 0): [max_pos >= capacity, D/2, 2] or null
  int64_t q_token_stride, q_head_stride;      // elements
  int64_t out_token_stride, out_head_stride;  // elements
  int64_t kv_batch_stride, kv_head_stride, kv_token_stride;  // bytes
  int64_t scale_batch_stride, scale_head_stride;             // elements, per-token mode
  float score_scale_log2;    // sm_scale * log2(e)
  int32_t num_kv_heads;
  int32_t group_size;        // query heads per KV head: row r of a KV head is token r / group,
                             // head r % group
  int32_t num_splits;        // grid.y: the most KV splits a row tile may use
  int32_t min_split_tokens;  // a split never gets fewer tokens than this (multiple of the tile)
  int32_t capacity;          // tokens per sequence the cache holds
  int32_t total_q;           // rows of q and out
  int32_t max_tiles;         // row tiles (the kernel's rows per CTA) per sequence and KV head
  int32_t causal;            // 1: query i sees tokens t <= seq_len - qo_len + i
  int32_t rope;              // RopeStyle applied to q at its positions (0: q as given)
  float rope_theta;
  int32_t key_transform;     // 1: q is Hadamard-transformed after its RoPE (rows.cuh)
  // Paged storage (cache_pages.cuh; null block_table: contiguous).
  const int32_t* block_table;
  int64_t table_stride;
  int64_t scale_token_stride;
  int32_t num_pages;
  int32_t page_shift;
  // Speculative trees: [total_q, tree_words] bits, or null. Bit j of query row i: draft token j
  // of the row's chunk (position prefix + j) is visible to it; tokens before the chunk always
  // are; bits past tree_words words count as 0.
  const uint32_t* tree_mask;
  int32_t tree_words;
  // 1 (a programmatic launch, every kernel of the family): the lengths, qo_indptr, the block
  // table and each split's first tiles when they lie before its chunk are read before the
  // previous kernel on the stream has finished; q, the rest of the cache and every write
  // wait for it (CtaWork).
  int32_t early_reads;
  // 1: one query row per sequence (row b of q is sequence b; qo_indptr is not read), and a
  // sequence with no cached tokens is not an error: its rows get out 0 and lse -inf (decode's
  // contract; DecodePlan runs such plans). 2: the same over seq_lens[b] + 1 tokens (the token
  // appended at seq_lens[b] just before: DecodePlan.append_and_run's lengths).
  int32_t decode_rows;
  // 1: a row tile's splits leave their partial rows for multi_combine (a second launch), which
  // merges them; 2: the same, and multi_combine lets the next kernel launch once its wait
  // returns (the attention kernel holds one CTA per SM); 0: the last split to arrive merges
  // them (counters), or the cluster does.
  int32_t combine;
};

static_assert(sizeof(MultiParams) == 288, "keep in sync with lowlevel_fd/multi/params.py");

// Sequence b's query rows of a KV head, packed token-major (row r is token r / group, query
// head kvh * group + r % group), cut into tiles of the kernel's rows per CTA. Device
// values are guarded: a qo_indptr interval that is not monotone or passes total_q and a chunk
// longer than its KV set a flag and the sequence writes nothing (except an empty sequence's
// decode row: `empty`); a length outside the cache is clamped (flagged); rows past the plan's
// tiles are not computed (flagged).
struct SequenceRows {
  int q0, qo_len, prefix, len;  // first query row, chunk tokens, tokens before the chunk, KV
  int rows;                     // qo_len * group (rows of this KV head)
  uint32_t flags = 0;           // the error bits these values raise

  // cta_rows: the kernel's rows per CTA (the plan's tiles cover cta_rows * max_tiles rows).
  __device__ __forceinline__ SequenceRows(const MultiParams& p, int b, int cta_rows,
                                          bool flagger) {
    int q1;
    if (p.decode_rows) {
      q0 = b, q1 = b + 1;
    } else {
      q0 = p.qo_indptr[b], q1 = p.qo_indptr[b + 1];
    }
    const int given = p.seq_lens[b];
    len = given;
    if (p.decode_rows == 2 && len >= 0 && len <= p.capacity) ++len;  // past it: clamped below
    if (len < 0 || len > p.capacity) {
      flags |= kErrorOutsideCache;
      len = len < 0 ? 0 : p.capacity;
    }
    qo_len = q1 - q0;
    if (!empty(p) && (q0 < 0 || q1 < q0 || q1 > p.total_q || qo_len > len)) {
      flags |= kErrorQueryRange;
      qo_len = 0;
      q0 = 0;
    }
    rows = qo_len * p.group_size;
    if (rows > cta_rows * p.max_tiles) flags |= kErrorQueryRange;
    prefix = len - qo_len;
    // Appended decode rows whose token was not written (outside the cache) attend what is
    // there with q as given, not rotated (decode's fused append): prefix -1 (load_rows).
    if (p.decode_rows == 2 && (given < 0 || given >= p.capacity)) prefix = -1;
    if (flagger && flags) atomicOr(p.error_flags, flags);
  }
  // A decode row of a sequence with no cached tokens: written as empty (CtaWork::retire).
  __device__ __forceinline__ bool empty(const MultiParams& p) const {
    return p.decode_rows && len == 0;
  }
  // Tokens row r (of this KV head) may see: causal, its position and all before it.
  __device__ __forceinline__ int limit(const MultiParams& p, int r) const {
    return p.causal ? prefix + r / p.group_size + 1 : len;
  }
};

// Rows row0 .. row0 + tile_rows - 1 of KV head kvh of the sequence whose first query row is q0:
// out 0, lse -inf (2-byte elements, rows 16-byte aligned). Out of line: the idle path's code
// stays out of the kernels' register allocation (the 128-row warpgroup kernel is at its limit).
__device__ __noinline__ void write_empty_rows(const MultiParams& p, int head_dim, int q0, int kvh,
                                              int row0, int tile_rows) {
  const int words = head_dim / 4;  // 8-byte stores per row
  for (int i = threadIdx.x; i < tile_rows * words; i += blockDim.x) {
    const int r = row0 + i / words, token = r / p.group_size;
    const int head = kvh * p.group_size + r - token * p.group_size;
    const int64_t q_row = q0 + token;
    uint16_t* row = static_cast<uint16_t*>(p.out) + q_row * p.out_token_stride +
                    head * p.out_head_stride;
    reinterpret_cast<uint2*>(row)[i % words] = make_uint2(0u, 0u);
    if (i % words == 0 && p.lse != nullptr)
      p.lse[q_row * p.num_kv_heads * p.group_size + head] = __int_as_float(0xff800000);
  }
}

// A row tile's KV range [0, kv_end) in splits of `chunk` tokens (a multiple of kTile), `active`
// of them; from the live lengths, so a captured graph stays right as they change.
template <int kTile>
__device__ __forceinline__ void tile_splits(const MultiParams& p, int kv_end, int& chunk,
                                            int& active) {
  int per_split = (kv_end + p.num_splits - 1) / p.num_splits;
  per_split = (per_split + kTile - 1) / kTile * kTile;
  chunk = per_split > p.min_split_tokens ? per_split : p.min_split_tokens;
  active = kv_end > 0 ? (kv_end + chunk - 1) / chunk : 1;
}

// What a CTA of CTA_ROWS query rows works on: its KV head, row tile (the longest first),
// split and sequence, and its KV range [start, end) cut in tiles of TOKENS. `idle`: nothing
// (a tile past the sequence's rows, a split past its range): the CTA calls retire() and
// returns. Programmatic launch (sm_90; a no-op otherwise): what the previous kernel on the
// stream wrote is visible past wait_for_previous_grid, which every thread that reads it or
// writes passes. Constructing the work waits first, unless p.early_reads: then the lengths,
// qo_indptr and the table are read before the wait, and the error bits (raised by one CTA
// per sequence) wait for it too, in wait_then_flag().
template <int CTA_ROWS, int TOKENS>
struct CtaWork {
  bool early;  // first: the wait, where it comes, precedes every read below
  int kvh, tile, split, b;
  SequenceRows sr;
  int row0, tile_rows = 0, chunk = 0, active = 0, start = 0, end = 0;
  bool idle;

  __device__ __forceinline__ explicit CtaWork(const MultiParams& p)
      : early(wait_unless_early(p)),
        kvh(blockIdx.x % p.num_kv_heads),
        tile(p.max_tiles - 1 - static_cast<int>(blockIdx.x) / p.num_kv_heads),
        split(blockIdx.y),
        b(blockIdx.z),
        sr(p, b, CTA_ROWS, !early && flagger()),
        row0(tile * CTA_ROWS) {
    idle = row0 >= sr.rows;
    if (idle) return;
    tile_rows = min(CTA_ROWS, sr.rows - row0);
    if (sr.empty(p)) {  // no KV: split 0's retire() writes the tile's rows
      idle = true;
      return;
    }
    const int kv_end = sr.limit(p, row0 + tile_rows - 1);
    tile_splits<TOKENS>(p, kv_end, chunk, active);
    idle = split >= active;
    start = split * chunk;
    end = min(kv_end, start + chunk);
  }
  __device__ __forceinline__ int tiles() const { return (end - start + TOKENS - 1) / TOKENS; }
  __device__ __forceinline__ bool flagger() const {
    return tile == 0 && split == 0 && kvh == 0 && threadIdx.x == 0;
  }
  // With early reads: the wait, then the deferred error bits.
  __device__ __forceinline__ void wait_then_flag(const MultiParams& p) const {
    wait_for_previous_grid();
    if (flagger() && sr.flags) atomicOr(p.error_flags, sr.flags);
  }
  // An idle CTA's exit; split 0 of an empty sequence's row tile first writes its rows.
  template <int HEAD_DIM>
  __device__ __forceinline__ void retire(const MultiParams& p) const {
    if (early) wait_then_flag(p);
    if (split == 0 && row0 < sr.rows && sr.empty(p))
      write_empty_rows(p, HEAD_DIM, sr.q0, kvh, row0, tile_rows);
  }
  // Whether the loader's first STAGES - 1 tiles may be issued before the wait (early reads,
  // and they lie before the chunk, which the previous kernel may write).
  template <int STAGES>
  __device__ __forceinline__ bool primes_early() const {
    return early && min(end, start + (STAGES - 1) * TOKENS) <= sr.prefix;
  }

 private:
  __device__ static __forceinline__ bool wait_unless_early(const MultiParams& p) {
    if (!p.early_reads) wait_for_previous_grid();
    return p.early_reads != 0;
  }
};

}  // namespace llfd
