// The decode kernel's fused append (the APPEND instantiation of decode_split, launched by
// DecodePlan.append_and_run with DecodeParams::append = 1): the step's new token is rotated,
// quantized, written into the cache and attended in the same launch as the attention.
//
// seq_lens[b] is then the write position pos (the tokens already cached); the kernel attends
// pos + 1 tokens. Every CTA stages its query group in shared memory, rotated at pos (RoPE, as
// append_token rotates it: fp32, rounded once to the query dtype), and quantizes the new K and V
// rows with the helpers of rows.cuh, so the bytes are those append_token would write. The splits
// cover the pos cached tokens (sequence_splits); the last one also takes the new token: its CTA
// writes the quantized rows into the cache and adds the token to its merge as one more partial
// (score from the fp32 rotated q and the quantized K, value the dequantized V), so the token is
// never read back from memory inside the launch.
//
// A position outside [0, capacity) writes nothing, leaves q unrotated (as append_token does),
// attends the min(max(pos, 0), capacity) cached tokens and sets bit 0 of error_flags. In paged
// storage a page id out of range for the new token writes nothing and sets kErrorBadPage (the
// token is still attended from shared memory).
#pragma once
#include "cache_pages.cuh"
#include "decode_params.cuh"
#include "rows.cuh"

namespace llfd {

template <int HEAD_DIM, int GROUP>
struct alignas(16) NewTokenShared {  // 16: the staged query rows are stored as uint4
  uint16_t q[GROUP][HEAD_DIM];  // the query group, rotated, in the query dtype
  int8_t k[HEAD_DIM];           // the new token, quantized
  float value[HEAD_DIM];        // its V, dequantized (times its per-token scale)
  float2 cs[HEAD_DIM / 2];      // RoPE (cos, sin) at pos
  float k_dequant;              // the scale a reader of its K applies
  float score[GROUP];           // its base-2 scores, per head of the group
};

// What a kernel without the fused append keeps instead: nothing.
struct NoNewToken {};
template <bool APPEND, int HEAD_DIM, int GROUP>
struct NewTokenState { using type = NewTokenShared<HEAD_DIM, GROUP>; };
template <int HEAD_DIM, int GROUP>
struct NewTokenState<false, HEAD_DIM, GROUP> { using type = NoNewToken; };

// Row `row` of the staging pass: the chunk's query heads 0..GROUP-1 (zero past its `heads`),
// then the new K and V rows of its KV head.
template <int HEAD_DIM, int GROUP, typename Chunk>
__device__ __forceinline__ uint4 load_new_row(const DecodeParams& p, int b, const Chunk& hc,
                                              int row, int lane) {
  const uint16_t* src;
  if (row < GROUP) {
    if (!hc.has(row)) return make_uint4(0, 0, 0, 0);
    src = static_cast<const uint16_t*>(p.q) + b * p.q_batch_stride +
          (hc.first + row) * p.q_head_stride;
  } else if (row == GROUP)
    src = static_cast<const uint16_t*>(p.k_new) + b * p.k_new_batch_stride +
          hc.kvh * p.k_new_head_stride;
  else if (row == GROUP + 1)
    src = static_cast<const uint16_t*>(p.v_new) + b * p.v_new_batch_stride +
          hc.kvh * p.v_new_head_stride;
  else
    return make_uint4(0, 0, 0, 0);
  return *reinterpret_cast<const uint4*>(src + 8 * lane);
}

// This thread's RoPE coefficients (frequencies threadIdx.x + THREADS * j), in three parts so
// their latency hides behind other work: the inverse frequencies before the position is known,
// the table load as soon as it is, the theta path's sin/cos after the first tiles are issued.
template <int HEAD_DIM, int THREADS>
struct RopeCoefficients {
  static constexpr int kPerThread = (HEAD_DIM / 2 + THREADS - 1) / THREADS;
  float inv_freq[kPerThread];
  float2 cs[kPerThread];

  __device__ __forceinline__ void start(const DecodeParams& p) {
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int i = threadIdx.x + THREADS * j;
      inv_freq[j] = p.cos_sin == nullptr && i < HEAD_DIM / 2 ? rope_inv_freq<HEAD_DIM>(
                                                                   p.rope_theta, i)
                                                             : 0.f;
    }
  }
  __device__ __forceinline__ void load(const DecodeParams& p, int pos, bool rotate) {
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int i = threadIdx.x + THREADS * j;
      if (rotate && p.cos_sin != nullptr && i < HEAD_DIM / 2)
        cs[j] = rope_table_entry<HEAD_DIM>(p.cos_sin, pos, i);
    }
  }
  __device__ __forceinline__ void store(const DecodeParams& p, int pos, float2* shared) {
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int i = threadIdx.x + THREADS * j;
      if (i < HEAD_DIM / 2)
        shared[i] = p.cos_sin != nullptr
                        ? cs[j]
                        : cos_sin_of(__fmul_rn(static_cast<float>(pos), inv_freq[j]));
    }
  }
};

// The whole CTA: rotate and stage the query group, quantize the new K and V rows (writing them
// into the cache when `writer`), fill sh.k, sh.value and sh.k_dequant. `first_raw` is this
// thread's row of the first pass; the caller has stored the RoPE coefficients into sh.cs
// (RopeCoefficients::store) when `rotate_now`.
template <int HEAD_DIM, int GROUP, int SCALE_MODE, typename QT, typename ScaleT, int THREADS,
          typename Chunk>
__device__ __forceinline__ void stage_new_token(const DecodeParams& p,
                                                NewTokenShared<HEAD_DIM, GROUP>& sh,
                                                uint4 first_raw, int b, const Chunk& hc,
                                                int pos, int page, bool rotate_now,
                                                bool writer) {
  // writer: only with pos inside the cache (the caller's `appended`); page: page_of(p, b, pos),
  // loaded by the caller as soon as pos was known.
  const int kvh = hc.kvh;
  constexpr int kLanes = RowLanes<HEAD_DIM>::kLanes, kRowsPerPass = THREADS / kLanes;
  constexpr int kRows = GROUP + 2;
  const int lane = threadIdx.x % kLanes, slot = threadIdx.x / kLanes;
  const int rope = rotate_now ? p.rope : kRopeNone;
  if (rope != kRopeNone) __syncthreads();  // sh.cs is complete
  int64_t cache_row = 0, scale_index = 0;
  if (writer && !token_offsets(p, page, kvh, pos, cache_row, scale_index)) {
    writer = false;
    if (threadIdx.x == 0) atomicOr(p.error_flags, kErrorBadPage);
  }
  cache_row += 8 * lane;
#pragma unroll 1
  for (int base = 0; base < kRows; base += kRowsPerPass) {  // uniform across the CTA
    const int row = base + slot;
    const uint4 raw = base == 0 ? first_raw
                                : load_new_row<HEAD_DIM, GROUP>(p, b, hc, row, lane);
    const bool is_q = row < GROUP, is_k = row == GROUP, is_v = row == GROUP + 1;
    float x[8];
    unpack8<QT>(raw, x);
    if (rope == kRopeNeox) rotate<kRopeNeox, HEAD_DIM>(x, sh.cs, lane, is_q || is_k);
    else if (rope == kRopeGptj) rotate<kRopeGptj, HEAD_DIM>(x, sh.cs, lane, is_q || is_k);
    // Keys are transformed whenever written, q when the kernel rotates it (else it arrives
    // transformed, like a rotated q).
    if (p.key_transform && rotate_now)
      hadamard_row<HEAD_DIM>(x, lane, is_k || (is_q && rope != kRopeNone));
    if (is_q)
      *reinterpret_cast<uint4*>(&sh.q[row][8 * lane]) =
          make_uint4(pack2<QT>(x[0], x[1]), pack2<QT>(x[2], x[3]), pack2<QT>(x[4], x[5]),
                     pack2<QT>(x[6], x[7]));
    // Quantize: every lane of the warp runs the row's reduction; only K/V rows keep the result.
    const bool kv = is_k || is_v;
    const void* scales = is_k ? p.k_scale : p.v_scale;
    const float given = kv ? given_scale<SCALE_MODE>(scales, kvh) : 0.f;
    int8_t* cache = const_cast<int8_t*>(is_k ? p.k_cache : p.v_cache) + cache_row;
    ScaleT* scale_dst = static_cast<ScaleT*>(const_cast<void*>(scales)) + scale_index;
    float dequant;
    const uint2 bytes = quantize_row<HEAD_DIM, SCALE_MODE, ScaleT>(x, kv && writer, given, cache,
                                                                   scale_dst, lane, dequant);
    if (is_k) {
      *reinterpret_cast<uint2*>(&sh.k[8 * lane]) = bytes;
      if (lane == 0) sh.k_dequant = dequant;
    } else if (is_v) {
      // Per-tensor and per-head V scales multiply the merged output once (v_const).
      const float scale = SCALE_MODE == kScalePerToken ? dequant : 1.f;
      const uint32_t words[2] = {bytes.x, bytes.y};
#pragma unroll
      for (int e = 0; e < 8; ++e)
        sh.value[8 * lane + e] =
            static_cast<float>(static_cast<int8_t>(words[e / 4] >> (8 * (e % 4)))) * scale;
    }
  }
  __syncthreads();
}

// Warp `warp` of NUM_WARPS: the new token's base-2 score for heads warp, warp + NUM_WARPS, ...
// (exact fp32 dot products of the staged query and the quantized K).
template <int HEAD_DIM, int GROUP, typename QT, int NUM_WARPS>
__device__ __forceinline__ void new_token_scores(const DecodeParams& p,
                                                 NewTokenShared<HEAD_DIM, GROUP>& sh, int warp,
                                                 int lane) {
  for (int head = warp; head < GROUP; head += NUM_WARPS) {
    float dot = 0.f;
#pragma unroll
    for (int d = lane; d < HEAD_DIM; d += 32)
      dot += to_float<QT>(sh.q[head][d]) * static_cast<float>(sh.k[d]);
    dot = warp_sum_xor(dot, 16);
    if (lane == 0) sh.score[head] = dot * sh.k_dequant * p.score_scale_log2;
  }
}

}  // namespace llfd
