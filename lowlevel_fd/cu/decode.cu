// Split-K GQA decode attention over an INT8 KV cache, on the tensor cores.
//
// Grid (kv head, split, batch). One CTA owns a KV head and its whole query-head group, so every
// K/V byte is read from memory once and used by all GROUP heads. Each warp streams 16-token
// tiles of its split and keeps its own online softmax; the CTA merges its warps, and the splits
// of one (batch, kv head) are merged either by the last CTA to finish (a device counter) or by
// decode_combine.
//
// Per 16-token tile a warp issues two m16n8k16 mmas per 16 dims for S = Q K^T (rows = heads,
// padded to 16) and one per 8 dims for O += P V. No shared memory and no transposes are needed:
//  * S is invariant to a common permutation of the head dimension, so each lane reads 16
//    contiguous bytes of a K row and Q is loaded into the A fragments with the same permutation:
//    chunk j, lane quad c, element e  <->  dim 64*(j/4) + 16*c + 4*(j%4) + e.
//  * The S accumulator fragment is already the A fragment of P for the PV mma (FlashAttention-2).
//  * For PV the k dimension is tokens: lane (g, c) loads tokens 2c, 2c+1, 2c+8, 2c+9 of the tile
//    at bytes [VB*g, VB*g + VB) (VB = D/8), so one warp load covers four whole 128-byte rows.
//    Byte j of word q becomes column g of n-block 4q+j: output dim VB*col + 4q + j.
#include "decode_params.cuh"
#include "decode_pipeline.cuh"

namespace llfd {

constexpr float kLn2 = 0.6931471805599453f;
#define kNegInf (__int_as_float(0xff800000))

template <int HEAD_DIM>
struct Geometry {
  static_assert(HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256, "head_dim 64/128/256");
  static constexpr int kKVectors = HEAD_DIM / 64;  // 16-byte K vectors per lane per token
  static constexpr int kChunks = HEAD_DIM / 16;    // k-steps of S = Q K^T
  static constexpr int kVBytes = HEAD_DIM / 8;     // V bytes per lane per token
  static constexpr int kVWords = kVBytes / 4;
  static constexpr int kVBlocks = HEAD_DIM / 8;    // n-blocks of O += P V
};

// One warp's operands for a 16-token tile, read from its pipeline stage in fragment order.
template <int HEAD_DIM>
struct Tile {
  using G = Geometry<HEAD_DIM>;
  uint32_t k[2][G::kChunks];     // tokens g and 8+g
  uint32_t v[4][G::kVWords];     // tokens 2c, 2c+1, 2c+8, 2c+9
  float k_scale[4], v_scale[4];  // per-token mode: the same four tokens as v
};

template <typename ScaleT>
__device__ __forceinline__ float scale_value(const char* address) {
  if constexpr (sizeof(ScaleT) == 2)
    return half_to_float(*reinterpret_cast<const uint16_t*>(address));
  else
    return *reinterpret_cast<const float*>(address);
}

// Plain C++ loads (not asm) so the compiler may schedule them; cp_async_wait's "memory"
// clobber and __syncwarp keep them after the copies have landed.
template <int HEAD_DIM, bool TOKEN_SCALES, typename ScaleT>
__device__ __forceinline__ void read_tile(Tile<HEAD_DIM>& tile, const char* stage, int g, int c) {
  using G = Geometry<HEAD_DIM>;
  using S = Stage<HEAD_DIM, ScaleT>;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = 8 * half + g;
#pragma unroll
    for (int u = 0; u < G::kKVectors; ++u) {
      const uint4 w = *reinterpret_cast<const uint4*>(
          stage + S::kK + row * HEAD_DIM + 16 * S::k_chunk(row, 4 * u + c));
      tile.k[half][4 * u] = w.x; tile.k[half][4 * u + 1] = w.y;
      tile.k[half][4 * u + 2] = w.z; tile.k[half][4 * u + 3] = w.w;
    }
  }
#pragma unroll
  for (int slot = 0; slot < 4; ++slot) {
    const int row = 2 * c + (slot & 1) + 8 * (slot >> 1);
    const char* base = stage + S::kV + row * HEAD_DIM;
    if constexpr (HEAD_DIM == 64) {
      const uint2 w = *reinterpret_cast<const uint2*>(base + 16 * S::v_chunk(row, g >> 1) +
                                                      8 * (g & 1));
      tile.v[slot][0] = w.x; tile.v[slot][1] = w.y;
    } else {
#pragma unroll
      for (int part = 0; part < G::kVBytes / 16; ++part) {
        const int chunk = (G::kVBytes / 16) * g + part;
        const uint4 w = *reinterpret_cast<const uint4*>(base + 16 * S::v_chunk(row, chunk));
        tile.v[slot][4 * part] = w.x; tile.v[slot][4 * part + 1] = w.y;
        tile.v[slot][4 * part + 2] = w.z; tile.v[slot][4 * part + 3] = w.w;
      }
    }
    if constexpr (TOKEN_SCALES) {
      tile.k_scale[slot] = scale_value<ScaleT>(stage + S::kKScale + row * sizeof(ScaleT));
      tile.v_scale[slot] = scale_value<ScaleT>(stage + S::kVScale + row * sizeof(ScaleT));
    }
  }
}

// Query rows g and g+8 of the group as fp16 A fragments, in the permuted dim order above.
// bf16 queries are rescaled per row by a power of two into fp16 range (exact); row_scale undoes it.
template <int HEAD_DIM, int GROUP, typename QT>
__device__ __forceinline__ void load_query(uint32_t (&qa)[Geometry<HEAD_DIM>::kChunks][4],
                                           float (&row_scale)[2], const uint16_t* q_group,
                                           int64_t q_head_stride, int g, int c) {
  using G = Geometry<HEAD_DIM>;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = g + 8 * r;
    const bool valid = row < GROUP;
    uint32_t words[G::kKVectors][8];
#pragma unroll
    for (int u = 0; u < G::kKVectors; ++u) {
#pragma unroll
      for (int i = 0; i < 8; ++i) words[u][i] = 0;
      if (valid) {
        const uint4* src = reinterpret_cast<const uint4*>(q_group + row * q_head_stride +
                                                          64 * u + 16 * c);
        const uint4 lo = __ldg(src), hi = __ldg(src + 1);
        words[u][0] = lo.x; words[u][1] = lo.y; words[u][2] = lo.z; words[u][3] = lo.w;
        words[u][4] = hi.x; words[u][5] = hi.y; words[u][6] = hi.z; words[u][7] = hi.w;
      }
    }
    row_scale[r] = 1.f;
    if constexpr (is_same<QT, bf16>::value) {
      float absmax = 0.f;
#pragma unroll
      for (int u = 0; u < G::kKVectors; ++u)
#pragma unroll
        for (int i = 0; i < 8; ++i)
          absmax = fmaxf(absmax, fmaxf(fabsf(bf16_to_float(words[u][i] & 0xffff)),
                                       fabsf(bf16_to_float(words[u][i] >> 16))));
      absmax = warp_max_xor(absmax, 2);
      // Largest power of two with absmax * scale < 2^15: fp16 range, full bf16 precision kept.
      const int exponent = absmax > 0.f ? ((__float_as_int(absmax) >> 23) & 0xff) - 127 : 0;
      const float up = exp2f(static_cast<float>(14 - exponent));
      row_scale[r] = 1.f / up;
#pragma unroll
      for (int u = 0; u < G::kKVectors; ++u)
#pragma unroll
        for (int i = 0; i < 8; ++i)
          words[u][i] = pack2<f16>(bf16_to_float(words[u][i] & 0xffff) * up,
                                   bf16_to_float(words[u][i] >> 16) * up);
    }
#pragma unroll
    for (int u = 0; u < G::kKVectors; ++u)
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        qa[4 * u + w][r] = words[u][2 * w];          // elements e = 0, 1: k = 2c, 2c+1
        qa[4 * u + w][2 + r] = words[u][2 * w + 1];  // elements e = 2, 3: k = 2c+8, 2c+9
      }
  }
}

constexpr int kMaxSplits = 128;  // planner.MAX_SPLITS

// Merge the splits of one (batch, kv head): partials are normalised per split with base-2 LSE.
// `scratch` is shared memory for (kMaxSplits + 2) * GROUP floats. The split LSEs are read all at
// once, and the outputs accumulate 8 splits per step with their loads in flight together: a
// loop of dependent L2 reads would cost a round trip per split. Fixed order: reproducible.
template <int HEAD_DIM, int GROUP, typename QT>
__device__ void merge_splits(const DecodeParams& p, int b, int kvh, int active, float* scratch) {
  const int64_t base = (static_cast<int64_t>(b) * p.num_kv_heads + kvh) * p.num_splits;
  const float* lse_in = p.partial_lse + base * GROUP;
  const float4* out_in = reinterpret_cast<const float4*>(p.partial_out + base * GROUP * HEAD_DIM);
  float* weight = scratch;                            // [active][GROUP]
  float* row_total = scratch + kMaxSplits * GROUP;    // [GROUP]
  float* row_best = row_total + GROUP;                // [GROUP]
  for (int i = threadIdx.x; i < active * GROUP; i += blockDim.x) weight[i] = __ldcg(lse_in + i);
  __syncthreads();
  if (threadIdx.x < GROUP) {
    const int row = threadIdx.x;
    float best = kNegInf, total = 0.f;
    for (int s = 0; s < active; ++s) best = fmaxf(best, weight[s * GROUP + row]);
    for (int s = 0; s < active; ++s) {
      const float w = fast_exp2(weight[s * GROUP + row] - best);
      weight[s * GROUP + row] = w;
      total += w;
    }
    row_total[row] = total;
    row_best[row] = best;
  }
  __syncthreads();
  constexpr int kQuads = HEAD_DIM / 4, kSplitStride = GROUP * kQuads;
  for (int idx = threadIdx.x; idx < GROUP * kQuads; idx += blockDim.x) {
    const int row = idx / kQuads;
    const float4* src = out_in + idx;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    int s = 0;
    for (; s + 8 <= active; s += 8) {
      float4 v[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = __ldcg(src + (s + k) * kSplitStride);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float w = weight[(s + k) * GROUP + row];
        acc.x += w * v[k].x; acc.y += w * v[k].y; acc.z += w * v[k].z; acc.w += w * v[k].w;
      }
    }
    for (; s < active; ++s) {
      const float4 v = __ldcg(src + s * kSplitStride);
      const float w = weight[s * GROUP + row];
      acc.x += w * v.x; acc.y += w * v.y; acc.z += w * v.z; acc.w += w * v.w;
    }
    const float inv = 1.f / row_total[row];
    const int head = kvh * GROUP + row, d = 4 * (idx % kQuads);
    uint16_t* dst = static_cast<uint16_t*>(p.out) + b * p.out_batch_stride +
                    head * p.out_head_stride + d;
    dst[0] = from_float<QT>(acc.x * inv); dst[1] = from_float<QT>(acc.y * inv);
    dst[2] = from_float<QT>(acc.z * inv); dst[3] = from_float<QT>(acc.w * inv);
    if (p.lse != nullptr && d == 0)
      p.lse[b * p.num_kv_heads * GROUP + head] = (row_best[row] + __log2f(row_total[row])) * kLn2;
  }
}

// STAGES tiles per warp are in flight in shared memory (decode_pipeline.cuh).
template <int HEAD_DIM, int GROUP, int NUM_WARPS, int SCALE_MODE, typename QT, typename ScaleT,
          int STAGES>
__global__ void __launch_bounds__(NUM_WARPS * 32)
decode_split(const __grid_constant__ DecodeParams p) {
  using G = Geometry<HEAD_DIM>;
  static_assert(GROUP >= 1 && GROUP <= 16, "group size 1..16");
  constexpr bool kTwoRows = GROUP > 8;  // rows g+8 of the m16 tile carry heads
  static_assert(STAGES >= 2, "at least double buffering");
  // Dynamic shared memory: the warps' pipelines, reused after the loop for the warps' partial
  // outputs [NUM_WARPS][GROUP][HEAD_DIM] (fp32).
  extern __shared__ __align__(16) float smem[];
  constexpr bool kTokenScales = SCALE_MODE == kScalePerToken;
  using S = Stage<HEAD_DIM, ScaleT>;
  __shared__ float warp_max[NUM_WARPS][16], warp_sum[NUM_WARPS][16];
  __shared__ int is_last;

  const int kvh = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int head0 = kvh * GROUP;
  // ---- load: the query group first: its latency overlaps the length read below ----
  // head_dim 256 keeps the Q fragments in shared memory (one 16-byte read per lane and k-step,
  // conflict-free): in registers they would push the kernel past 255 and into spills.
  constexpr bool kQueryInShared = HEAD_DIM == 256;
  __shared__ uint4 query_shared[kQueryInShared ? G::kChunks : 1][32];
  uint32_t qa[G::kChunks][4];
  float row_scale[2];
  load_query<HEAD_DIM, GROUP, QT>(
      qa, row_scale,
      static_cast<const uint16_t*>(p.q) + b * p.q_batch_stride + head0 * p.q_head_stride,
      p.q_head_stride, g, c);
  if constexpr (kQueryInShared) {
    if (warp == 0)
#pragma unroll
      for (int j = 0; j < G::kChunks; ++j)
        query_shared[j][lane] = make_uint4(qa[j][0], qa[j][1], qa[j][2], qa[j][3]);
    __syncthreads();
  }
  const int len = clamped_length(p, b);
  int chunk, active;
  split_range(len, p, chunk, active);

  if (active == 0) {  // empty sequence: zero output, lse = -inf, never NaN
    if (split == 0)
      for (int idx = threadIdx.x; idx < GROUP * HEAD_DIM; idx += blockDim.x) {
        const int row = idx / HEAD_DIM, d = idx % HEAD_DIM;
        static_cast<uint16_t*>(p.out)[b * p.out_batch_stride + (head0 + row) * p.out_head_stride +
                                      d] = 0;
        if (p.lse != nullptr && d == 0) p.lse[b * p.num_kv_heads * GROUP + head0 + row] = kNegInf;
      }
    return;
  }
  if (split >= active) return;
  const int start = split * chunk, end = min(len, start + chunk);

  float k_const = p.score_scale_log2, v_const = 1.f;
  if constexpr (SCALE_MODE == kScalePerTensor) {
    k_const *= __ldg(static_cast<const float*>(p.k_scale));
    v_const = __ldg(static_cast<const float*>(p.v_scale));
  } else if constexpr (SCALE_MODE == kScalePerHead) {
    k_const *= __ldg(static_cast<const float*>(p.k_scale) + kvh);
    v_const = __ldg(static_cast<const float*>(p.v_scale) + kvh);
  }
  const float row_const[2] = {k_const * row_scale[0], k_const * row_scale[1]};
  const int64_t kv_offset = b * p.kv_batch_stride + kvh * p.kv_head_stride;
  const int8_t* k_base = p.k_cache + kv_offset;
  const int8_t* v_base = p.v_cache + kv_offset;
  const int64_t scale_offset = b * p.scale_batch_stride + kvh * p.scale_head_stride;
  const void* ks_base = static_cast<const ScaleT*>(p.k_scale) + scale_offset;
  const void* vs_base = static_cast<const ScaleT*>(p.v_scale) + scale_offset;

  float acc[G::kVBlocks][4];
#pragma unroll
  for (int i = 0; i < G::kVBlocks; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  float row_max[2] = {kNegInf, kNegInf}, row_sum[2] = {0.f, 0.f};

  // ---- load: STAGES - 1 tiles ahead of the math, per warp ----
  const ScaleT* ks_tokens = static_cast<const ScaleT*>(ks_base);
  const ScaleT* vs_tokens = static_cast<const ScaleT*>(vs_base);
  const uint32_t pipe = shared_address(smem) + warp * STAGES * S::kBytes;
  constexpr int kStep = 16 * NUM_WARPS;
  const int first = start + 16 * warp;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (first + s * kStep < end)
      issue_tile<HEAD_DIM, kTokenScales, ScaleT>(pipe + s * S::kBytes, k_base, v_base, ks_tokens,
                                                 vs_tokens, p.kv_token_stride, first + s * kStep,
                                                 end, lane);
    cp_async_commit();  // empty groups keep the group count uniform
  }
  int stage = 0;
#pragma unroll 1
  for (int t0 = first; t0 < end; t0 += kStep) {
    {
      const int t_issue = t0 + (STAGES - 1) * kStep;
      const int issue_stage = stage == 0 ? STAGES - 1 : stage - 1;
      if (t_issue < end)
        issue_tile<HEAD_DIM, kTokenScales, ScaleT>(pipe + issue_stage * S::kBytes, k_base, v_base,
                                                   ks_tokens, vs_tokens, p.kv_token_stride,
                                                   t_issue, end, lane);
      cp_async_commit();
    }
    cp_async_wait<STAGES - 1>();  // the tile of t0 has landed (this lane's part)
    __syncwarp();                 // ... and every other lane's part is visible
    Tile<HEAD_DIM> cur;
    read_tile<HEAD_DIM, kTokenScales, ScaleT>(
        cur, reinterpret_cast<const char*>(smem) + (warp * STAGES + stage) * S::kBytes, g, c);
    {
      // ---- score: S = Q K^T for tokens t0..t0+7 (s[0]) and t0+8..t0+15 (s[1]) ----
      // Four independent accumulation chains (two token halves x even/odd k-steps) keep the
      // tensor pipe busy while each mma's latency runs; they are summed afterwards.
      float s[2][4], s_odd[2][4];
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int i = 0; i < 4; ++i) s[half][i] = s_odd[half][i] = 0.f;
#pragma unroll
      for (int j = 0; j < G::kChunks; ++j) {
        uint32_t qj[4];
        if constexpr (kQueryInShared) {
          const uint4 q4 = query_shared[j][lane];
          qj[0] = q4.x; qj[1] = q4.y; qj[2] = q4.z; qj[3] = q4.w;
        } else {
          qj[0] = qa[j][0]; qj[1] = qa[j][1]; qj[2] = qa[j][2]; qj[3] = qa[j][3];
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          uint32_t lo, hi;
          unpack_word(cur.k[half][j] ^ 0x80808080u, lo, hi);
          mma_16x8x16(j % 2 ? s_odd[half] : s[half], qj, lo, hi);
        }
      }
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int i = 0; i < 4; ++i) s[half][i] += s_odd[half][i];
      // ---- softmax: scale, mask, online max/sum in base 2 ----
      float tile_max[2] = {kNegInf, kNegInf};
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int col = i & 1, r = i >> 1, slot = 2 * half + col;
          const bool valid = t0 + 8 * half + 2 * c + col < end;
          float scale = row_const[r];
          if constexpr (SCALE_MODE == kScalePerToken) scale *= cur.k_scale[slot];
          s[half][i] = valid ? s[half][i] * scale : kNegInf;
          tile_max[r] = fmaxf(tile_max[r], s[half][i]);
        }
      float correction[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float new_max = fmaxf(row_max[r], warp_max_xor(tile_max[r], 2));
        correction[r] = fast_exp2(row_max[r] - new_max);  // exp2(-inf) = 0 on the first tile
        row_max[r] = new_max;
        row_sum[r] *= correction[r];
      }
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          s[half][i] = fast_exp2(s[half][i] - row_max[i >> 1]);
          row_sum[i >> 1] += s[half][i];
        }
      // ---- accumulate: O = O * correction + P V ----
      // Rows g+8 are padding unless GROUP > 8: a zero A fragment lets the compiler drop them.
      const uint32_t pa[4] = {pack2<f16>(s[0][0], s[0][1]),
                              kTwoRows ? pack2<f16>(s[0][2], s[0][3]) : 0u,
                              pack2<f16>(s[1][0], s[1][1]),
                              kTwoRows ? pack2<f16>(s[1][2], s[1][3]) : 0u};
      uint32_t v_scale01 = 0, v_scale23 = 0;
      if constexpr (SCALE_MODE == kScalePerToken) {
        v_scale01 = pack2<f16>(cur.v_scale[0], cur.v_scale[1]);
        v_scale23 = pack2<f16>(cur.v_scale[2], cur.v_scale[3]);
      }
#pragma unroll
      for (int w = 0; w < G::kVWords; ++w) {
        const uint32_t a = cur.v[0][w] ^ 0x80808080u, bb = cur.v[1][w] ^ 0x80808080u;
        const uint32_t cc = cur.v[2][w] ^ 0x80808080u, dd = cur.v[3][w] ^ 0x80808080u;
        const uint32_t ab_lo = prmt(a, bb, 0x5140u), ab_hi = prmt(a, bb, 0x7362u);
        const uint32_t cd_lo = prmt(cc, dd, 0x5140u), cd_hi = prmt(cc, dd, 0x7362u);
#define LLFD_PV_BLOCK(J)                                                       \
  {                                                                            \
    uint32_t b0 = pair_from_interleaved<J>(ab_lo, ab_hi);                      \
    uint32_t b1 = pair_from_interleaved<J>(cd_lo, cd_hi);                      \
    if constexpr (SCALE_MODE == kScalePerToken) {                              \
      b0 = hmul2(b0, v_scale01);                                               \
      b1 = hmul2(b1, v_scale23);                                               \
    }                                                                          \
    float* o = acc[4 * w + J];                                                 \
    o[0] *= correction[0]; o[1] *= correction[0];                              \
    if (kTwoRows) { o[2] *= correction[1]; o[3] *= correction[1]; }            \
    mma_16x8x16(acc[4 * w + J], pa, b0, b1);                                   \
  }
        LLFD_PV_BLOCK(0) LLFD_PV_BLOCK(1) LLFD_PV_BLOCK(2) LLFD_PV_BLOCK(3)
#undef LLFD_PV_BLOCK
      }
    }
    __syncwarp();  // every lane is done with this stage before it is refilled
    stage = stage + 1 == STAGES ? 0 : stage + 1;
  }
  cp_async_wait<0>();
  __syncthreads();  // the merge below reuses the pipelines' shared memory

  // ---- merge the warps of this CTA ----
#pragma unroll
  for (int r = 0; r < 2; ++r) row_sum[r] = warp_sum_xor(row_sum[r], 2);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = g + 8 * r;
    if ((r == 1 && !kTwoRows) || row >= GROUP) continue;
    if (c == 0) { warp_max[warp][row] = row_max[r]; warp_sum[warp][row] = row_sum[r]; }
    float* dst = smem + (warp * GROUP + row) * HEAD_DIM;
#pragma unroll
    for (int blk = 0; blk < G::kVBlocks; ++blk)
#pragma unroll
      for (int col = 0; col < 2; ++col)
        dst[G::kVBytes * (2 * c + col) + blk] = acc[blk][2 * r + col];
  }
  __syncthreads();

  const bool single = active == 1;
  const int64_t part = ((static_cast<int64_t>(b) * p.num_kv_heads + kvh) * p.num_splits + split);
  for (int idx = threadIdx.x; idx < GROUP * HEAD_DIM; idx += blockDim.x) {
    const int row = idx / HEAD_DIM, d = idx % HEAD_DIM;
    float best = kNegInf;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) best = fmaxf(best, warp_max[w][row]);
    float total = 0.f, value = 0.f;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) {
      const float weight = fast_exp2(warp_max[w][row] - best);
      total += warp_sum[w][row] * weight;
      value += smem[(w * GROUP + row) * HEAD_DIM + d] * weight;
    }
    // Per-tensor and per-head V scales multiply the output once instead of every element.
    value = value * v_const / total;
    const float lse2 = best + __log2f(total);
    if (single) {
      static_cast<uint16_t*>(p.out)[b * p.out_batch_stride + (head0 + row) * p.out_head_stride +
                                    d] = from_float<QT>(value);
      if (p.lse != nullptr && d == 0)
        p.lse[b * p.num_kv_heads * GROUP + head0 + row] = lse2 * kLn2;
    } else {
      p.partial_out[(part * GROUP + row) * HEAD_DIM + d] = value;
      if (d == 0) p.partial_lse[part * GROUP + row] = lse2;
    }
  }
  if (single || !p.fused_merge) return;

  // ---- the last CTA of this (batch, kv head) to arrive merges all splits ----
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint32_t arrived = atomicAdd(p.counters + b * p.num_kv_heads + kvh, 1u);
    is_last = arrived + 1 == static_cast<uint32_t>(active);
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  merge_splits<HEAD_DIM, GROUP, QT>(p, b, kvh, active, smem);
  if (threadIdx.x == 0) p.counters[b * p.num_kv_heads + kvh] = 0;  // ready for the next launch
}

// Separate merge of the split partials; grid (kv head, batch), 128 threads, dynamic shared
// memory of (kMaxSplits + 2) * GROUP floats.
template <int HEAD_DIM, int GROUP, typename QT>
__global__ void __launch_bounds__(128) decode_combine(const __grid_constant__ DecodeParams p) {
  extern __shared__ __align__(16) float scratch[];
  const int kvh = blockIdx.x, b = blockIdx.y;
  int chunk, active;
  split_range(clamped_length(p, b), p, chunk, active);
  if (active > 1) merge_splits<HEAD_DIM, GROUP, QT>(p, b, kvh, active, scratch);
}

}  // namespace llfd
