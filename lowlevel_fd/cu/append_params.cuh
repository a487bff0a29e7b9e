// The argument block of the append and prompt-quantization kernels. Passed by value as a
// __grid_constant__ parameter; its Python twin is lowlevel_fd/append/params.py (same field
// order, same types, same size).
#pragma once
#include "kv_types.cuh"

namespace llfd {

struct AppendParams {
  const void* k_new;        // append: [B, Hkv, D]; prompt: [B, S, Hkv, D] or [B, Hkv, S, D]
  const void* v_new;        //   fp16/bf16, last dimension contiguous, any other strides
  const void* q;            // append with RoPE: [B, Hq, D] or null (no query rotation)
  void* q_out;              // where the rotated q goes; equal to q for in-place rotation
  int8_t* k_cache;          // element (b, h, t, d) at b*kv_batch_stride + h*kv_head_stride
  int8_t* v_cache;          //   + t*kv_token_stride + d (bytes): covers BNSH and BSNH
  void* k_scale;            // fp32 [1] | fp32 [Hkv] (read) | fp32/fp16 [B, Hkv, S_max] (written)
  void* v_scale;
  int32_t* seq_lens;        // append: the position of the new token, bumped when advance != 0;
                            // prompt: the prompt lengths
  int32_t* seq_lens_out;    // prompt: receives the length written, or null
  const float* cos_sin;     // [max_pos >= capacity, D/2, 2] fp32, or null: from rope_theta
  uint32_t* error_flags;    // [1], see kError*
  int64_t k_batch_stride, k_head_stride, k_token_stride;  // elements of k_new
  int64_t v_batch_stride, v_head_stride, v_token_stride;  // elements of v_new
  int64_t q_batch_stride, q_head_stride;                  // elements
  int64_t q_out_batch_stride, q_out_head_stride;          // elements
  int64_t kv_batch_stride, kv_head_stride, kv_token_stride;  // bytes (int8)
  int64_t scale_batch_stride, scale_head_stride;             // elements, per-token mode
  float rope_theta;         // inv_freq[i] = theta^(-2i/D) when cos_sin is null
  int32_t num_kv_heads;
  int32_t num_q_heads;      // rows of q rotated (0 when q is null)
  int32_t capacity;         // S_max: tokens per sequence the cache holds
  int32_t prompt_tokens;    // prompt: S, the token extent of k_new/v_new
  int32_t advance;          // append: 1 = seq_lens[b] += 1 after the token is written
  // Paged storage (cache_pages.cuh; null block_table: contiguous). kv_batch_stride and
  // scale_batch_stride are then the pools' page strides.
  const int32_t* block_table;  // [>= B, table_stride]: page ids
  int64_t table_stride;        // elements
  int64_t scale_token_stride;  // elements (per-token mode)
  int32_t num_pages;
  int32_t page_shift;          // log2(page_size)
  // prompt: the position of each prompt's first token (a chunk after cached tokens), or null
  // (position 0)
  const int32_t* starts;
  int32_t key_transform;       // 1: K rows (and rotated q) are Hadamard-transformed after RoPE
};

static_assert(sizeof(AppendParams) == 288, "keep in sync with lowlevel_fd/append/params.py");

}  // namespace llfd
