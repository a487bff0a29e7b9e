// Split-K GQA decode attention over an INT8 KV cache, on the tensor cores.
//
// Grid (kv head, split, batch). One CTA owns a KV head and its whole query-head group, so every
// K/V byte is read from memory once and used by all GROUP heads. Each warp streams 16-token
// tiles of its split through a shared-memory pipeline (decode_pipeline.cuh) and keeps its own
// online softmax; the CTA merges its warps, and the splits of one (batch, kv head) are merged
// by the last CTA to finish (a device counter) or by decode_combine.
//
// Tokens are the M dimension of both m16n8k16 mmas, so a 16-token tile costs one mma per 16
// dims for S^T = K Q^T and one per 16 dims for O^T += V^T P^T; heads (up to 8 per block) are N:
//  * S is invariant to a common permutation of the head dimension, so each lane reads 16
//    contiguous bytes of a K row and Q is loaded with the same permutation:
//    k-step j, lane quad c, element e  <->  dim 64*(j/4) + 16*c + 4*(j%4) + e.
//  * S^T's accumulator holds (token, head-pair) per lane; one movmatrix per 8 tokens turns the
//    probabilities into the (token-pair, head) B fragment of the PV mma.
//  * For PV the k dimension is tokens: lane (g, c) reads tokens 2c, 2c+1, 2c+8, 2c+9 of the tile
//    at bytes [VB*g, VB*g + VB) (VB = D/8); byte pairs of two tokens become the A fragment.
//    m-block 2w + i covers dims VB*g + 4w + 2i (row g) and VB*g + 4w + 2i + 1 (row g + 8).
#include "decode_params.cuh"
#include "decode_pipeline.cuh"

namespace llfd {

constexpr float kLn2 = 0.6931471805599453f;
#define kNegInf (__int_as_float(0xff800000))

template <int HEAD_DIM>
struct Geometry {
  static_assert(HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256, "head_dim 64/128/256");
  static constexpr int kKVectors = HEAD_DIM / 64;  // 16-byte K vectors per lane per token
  static constexpr int kChunks = HEAD_DIM / 16;    // k-steps of S^T = K Q^T
  static constexpr int kVBytes = HEAD_DIM / 8;     // V bytes per lane per token
  static constexpr int kVWords = kVBytes / 4;
  static constexpr int kMBlocks = HEAD_DIM / 16;   // m-blocks of O^T += V^T P^T
};

// One warp's operands for a 16-token tile, read from its pipeline stage in fragment order.
template <int HEAD_DIM>
struct Tile {
  using G = Geometry<HEAD_DIM>;
  uint32_t k[2][G::kChunks];     // tokens g and g+8
  uint32_t v[4][G::kVWords];     // tokens 2c, 2c+1, 2c+8, 2c+9
  float k_scale[2], v_scale[2];  // per-token mode: tokens g and g+8
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
// Sub-tile `sub` (16 tokens) of a stage that holds TILES of them.
template <int HEAD_DIM, bool TOKEN_SCALES, typename ScaleT, int TILES>
__device__ __forceinline__ void read_tile(Tile<HEAD_DIM>& tile, const char* stage, int sub, int g,
                                          int c) {
  using G = Geometry<HEAD_DIM>;
  using S = Stage<HEAD_DIM, ScaleT, TILES>;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = 16 * sub + 8 * half + g;
#pragma unroll
    for (int u = 0; u < G::kKVectors; ++u) {
      const uint4 w = *reinterpret_cast<const uint4*>(
          stage + S::kK + row * HEAD_DIM + 16 * S::k_chunk(row, 4 * u + c));
      tile.k[half][4 * u] = w.x; tile.k[half][4 * u + 1] = w.y;
      tile.k[half][4 * u + 2] = w.z; tile.k[half][4 * u + 3] = w.w;
    }
    if constexpr (TOKEN_SCALES) {
      tile.k_scale[half] = scale_value<ScaleT>(stage + S::kKScale + row * sizeof(ScaleT));
      tile.v_scale[half] = scale_value<ScaleT>(stage + S::kVScale + row * sizeof(ScaleT));
    }
  }
#pragma unroll
  for (int slot = 0; slot < 4; ++slot) {
    const int row = 16 * sub + 2 * c + (slot & 1) + 8 * (slot >> 1);
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
  }
}

// Query heads g (block 0) and g+8 (block 1) as fp16 B fragments of S^T = K Q^T, in the permuted
// dim order. bf16 queries are rescaled per head by a power of two into fp16 range (exact);
// head_scale undoes it.
template <int HEAD_DIM, int GROUP, typename QT, int BLOCKS>
__device__ __forceinline__ void load_query(uint32_t (&qb)[BLOCKS][Geometry<HEAD_DIM>::kChunks][2],
                                           float (&head_scale)[BLOCKS], const uint16_t* q_group,
                                           int64_t q_head_stride, int g, int c) {
  using G = Geometry<HEAD_DIM>;
#pragma unroll
  for (int hb = 0; hb < BLOCKS; ++hb) {
    const int head = g + 8 * hb;
    uint32_t words[G::kKVectors][8];
#pragma unroll
    for (int u = 0; u < G::kKVectors; ++u) {
#pragma unroll
      for (int i = 0; i < 8; ++i) words[u][i] = 0;
      if (head < GROUP) {
        const uint4* src = reinterpret_cast<const uint4*>(q_group + head * q_head_stride +
                                                          64 * u + 16 * c);
        const uint4 lo = __ldg(src), hi = __ldg(src + 1);
        words[u][0] = lo.x; words[u][1] = lo.y; words[u][2] = lo.z; words[u][3] = lo.w;
        words[u][4] = hi.x; words[u][5] = hi.y; words[u][6] = hi.z; words[u][7] = hi.w;
      }
    }
    head_scale[hb] = 1.f;
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
      head_scale[hb] = 1.f / up;
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
        qb[hb][4 * u + w][0] = words[u][2 * w];      // elements e = 0, 1: k = 2c, 2c+1
        qb[hb][4 * u + w][1] = words[u][2 * w + 1];  // elements e = 2, 3: k = 2c+8, 2c+9
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

constexpr int kMaxCluster = 16;  // non-portable cluster size limit on sm_90

// Merge the splits of one (batch, kv head) inside its cluster: each CTA has left its normalised
// partial [GROUP][HEAD_DIM] and base-2 LSEs [GROUP] at `part` in its shared memory; CTA `rank`
// merges outputs [rank * slice, (rank + 1) * slice) by reading every active CTA's partial
// through DSMEM. Fixed order over ranks: reproducible.
template <int HEAD_DIM, int GROUP, typename QT>
__device__ void cluster_merge(const DecodeParams& p, int b, int kvh, int active,
                              const float* part) {
  cluster_sync();  // every partial is written and visible
  const int rank = static_cast<int>(cluster_rank());
  constexpr int kOutputs = GROUP * HEAD_DIM;
  const int slice = (kOutputs + p.num_splits - 1) / p.num_splits;
  const int stop = min(kOutputs, (rank + 1) * slice);
  for (int idx = rank * slice + threadIdx.x; idx < stop; idx += blockDim.x) {
    const int row = idx / HEAD_DIM, d = idx % HEAD_DIM;
    float lse[kMaxCluster], value[kMaxCluster];
#pragma unroll
    for (int r = 0; r < kMaxCluster; ++r) {  // all loads in flight together
      lse[r] = r < active ? load_cluster_float(part + kOutputs + row, r) : kNegInf;
      value[r] = r < active ? load_cluster_float(part + idx, r) : 0.f;
    }
    float best = kNegInf;
#pragma unroll
    for (int r = 0; r < kMaxCluster; ++r) best = fmaxf(best, lse[r]);
    float total = 0.f, acc = 0.f;
#pragma unroll
    for (int r = 0; r < kMaxCluster; ++r) {
      const float w = r < active ? fast_exp2(lse[r] - best) : 0.f;
      total += w;
      acc += w * value[r];
    }
    const int head = kvh * GROUP + row;
    static_cast<uint16_t*>(p.out)[b * p.out_batch_stride + head * p.out_head_stride + d] =
        from_float<QT>(acc / total);
    if (p.lse != nullptr && d == 0)
      p.lse[b * p.num_kv_heads * GROUP + head] = (best + __log2f(total)) * kLn2;
  }
  cluster_sync();  // no CTA exits while others still read its shared memory
}

// STAGES tiles per warp are in flight in shared memory (decode_pipeline.cuh).
// CLUSTER: the CTAs of one (batch, kv head) form a thread-block cluster (grid.y = cluster size =
// num_splits) and merge their partials through distributed shared memory, with no global
// round trips; otherwise the last CTA to arrive merges through global memory.
// TILES: 16-token tiles per step of a warp. Two give each warp two independent QK chains and
// one softmax reduction per 32 tokens (more work in flight per warp when warps are few).
template <int HEAD_DIM, int GROUP, int NUM_WARPS, int SCALE_MODE, typename QT, typename ScaleT,
          int STAGES, bool CLUSTER, int TILES>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1)
decode_split(const __grid_constant__ DecodeParams p) {
  using G = Geometry<HEAD_DIM>;
  static_assert(GROUP >= 1 && GROUP <= 16, "group size 1..16");
  static_assert(STAGES >= 2, "at least double buffering");
  constexpr int kBlocks = GROUP > 8 ? 2 : 1;  // head blocks of 8 (the mma's N)
  constexpr bool kTokenScales = SCALE_MODE == kScalePerToken;
  using S = Stage<HEAD_DIM, ScaleT, TILES>;
  static_assert(TILES == 1 || TILES == 2, "one or two tiles per step");
  // Dynamic shared memory: the warps' pipelines, reused after the loop for the warps' partial
  // outputs [NUM_WARPS][GROUP][HEAD_DIM] (fp32) and then for the split merge.
  extern __shared__ __align__(16) float smem[];
  __shared__ float warp_max[NUM_WARPS][16], warp_sum[NUM_WARPS][16];
  __shared__ int is_last;

  const int kvh = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int head0 = kvh * GROUP;
  wait_for_previous_grid();  // q, lengths and the cache may come from the previous kernel
  allow_next_grid();

  // ---- load: the query group first: its latency overlaps the length read below ----
  // head_dim 256 keeps the Q fragments in shared memory (8 bytes per lane and k-step,
  // conflict-free): in registers they would push the kernel into spills.
  constexpr bool kQueryInShared = HEAD_DIM == 256;
  __shared__ uint2 query_shared[kQueryInShared ? kBlocks * G::kChunks : 1][32];
  uint32_t qb[kBlocks][G::kChunks][2];
  float head_scale[kBlocks];
  load_query<HEAD_DIM, GROUP, QT, kBlocks>(
      qb, head_scale,
      static_cast<const uint16_t*>(p.q) + b * p.q_batch_stride + head0 * p.q_head_stride,
      p.q_head_stride, g, c);
  if constexpr (kQueryInShared) {
    if (warp == 0)
#pragma unroll
      for (int hb = 0; hb < kBlocks; ++hb)
#pragma unroll
        for (int j = 0; j < G::kChunks; ++j)
          query_shared[hb * G::kChunks + j][lane] = make_uint2(qb[hb][j][0], qb[hb][j][1]);
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
  // A cluster's idle CTAs (split >= active) stay for the cluster barriers with empty ranges.
  const bool idle = split >= active;
  if (!CLUSTER && idle) return;
  const int start = idle ? 0 : split * chunk, end = idle ? 0 : min(len, start + chunk);

  float k_const = p.score_scale_log2, v_const = 1.f;
  if constexpr (SCALE_MODE == kScalePerTensor) {
    k_const *= __ldg(static_cast<const float*>(p.k_scale));
    v_const = __ldg(static_cast<const float*>(p.v_scale));
  } else if constexpr (SCALE_MODE == kScalePerHead) {
    k_const *= __ldg(static_cast<const float*>(p.k_scale) + kvh);
    v_const = __ldg(static_cast<const float*>(p.v_scale) + kvh);
  }
  // This lane's accumulator columns are heads 8hb + 2c + i; their bf16 rescale lives in the
  // lanes that loaded those heads (lane 4 * head).
  float col_const[kBlocks][2];
#pragma unroll
  for (int hb = 0; hb < kBlocks; ++hb)
#pragma unroll
    for (int i = 0; i < 2; ++i)
      col_const[hb][i] = k_const * __shfl_sync(0xffffffffu, head_scale[hb], 4 * (2 * c + i));
  const int64_t kv_offset = b * p.kv_batch_stride + kvh * p.kv_head_stride;
  const int8_t* k_base = p.k_cache + kv_offset;
  const int8_t* v_base = p.v_cache + kv_offset;
  const int64_t scale_offset = b * p.scale_batch_stride + kvh * p.scale_head_stride;
  const ScaleT* ks_tokens = static_cast<const ScaleT*>(p.k_scale) + scale_offset;
  const ScaleT* vs_tokens = static_cast<const ScaleT*>(p.v_scale) + scale_offset;

  float acc[kBlocks][G::kMBlocks][4];
#pragma unroll
  for (int hb = 0; hb < kBlocks; ++hb)
#pragma unroll
    for (int i = 0; i < G::kMBlocks; ++i) acc[hb][i][0] = acc[hb][i][1] = acc[hb][i][2] = acc[hb][i][3] = 0.f;
  float col_max[kBlocks][2], col_sum[kBlocks][2];
#pragma unroll
  for (int hb = 0; hb < kBlocks; ++hb)
    col_max[hb][0] = col_max[hb][1] = kNegInf, col_sum[hb][0] = col_sum[hb][1] = 0.f;
  // Per-token V scales are folded into P relative to the tile's largest scale (P stays in
  // [0, 1], no fp16 underflow); acc holds O / v_ref and is rescaled when v_ref changes.
  float v_ref = 1.f;

  // ---- load: STAGES - 1 tiles ahead of the math, per warp ----
  const uint32_t pipe = shared_address(smem) + warp * STAGES * S::kBytes;
  constexpr int kStep = 16 * TILES * NUM_WARPS;
  const int first = start + 16 * TILES * warp;
#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) {
    if (first + st * kStep < end)
      issue_tile<HEAD_DIM, kTokenScales, ScaleT, TILES>(pipe + st * S::kBytes, k_base, v_base,
                                                        ks_tokens, vs_tokens, p.kv_token_stride,
                                                        first + st * kStep, end, lane);
    cp_async_commit();  // empty groups keep the group count uniform
  }
  int stage = 0;
#pragma unroll 1
  for (int t0 = first; t0 < end; t0 += kStep) {
    {
      const int t_issue = t0 + (STAGES - 1) * kStep;
      const int issue_stage = stage == 0 ? STAGES - 1 : stage - 1;
      if (t_issue < end)
        issue_tile<HEAD_DIM, kTokenScales, ScaleT, TILES>(
            pipe + issue_stage * S::kBytes, k_base, v_base, ks_tokens, vs_tokens,
            p.kv_token_stride, t_issue, end, lane);
      cp_async_commit();
    }
    cp_async_wait<STAGES - 1>();  // the tiles of t0 have landed (this lane's part)
    __syncwarp();                 // ... and every other lane's part is visible
    Tile<HEAD_DIM> cur[TILES];
    const char* stage_base =
        reinterpret_cast<const char*>(smem) + (warp * STAGES + stage) * S::kBytes;
#pragma unroll
    for (int sub = 0; sub < TILES; ++sub)
      read_tile<HEAD_DIM, kTokenScales, ScaleT, TILES>(cur[sub], stage_base, sub, g, c);

    // ---- score: S^T = K Q^T, rows tokens g and g+8, columns heads 2c, 2c+1 (per block) ----
    // Even and odd k-steps of every sub-tile accumulate separately: 2 x TILES independent mma
    // chains per head block.
    float s[TILES][kBlocks][4], s_odd[TILES][kBlocks][4];
#pragma unroll
    for (int sub = 0; sub < TILES; ++sub)
#pragma unroll
      for (int hb = 0; hb < kBlocks; ++hb)
#pragma unroll
        for (int i = 0; i < 4; ++i) s[sub][hb][i] = s_odd[sub][hb][i] = 0.f;
#pragma unroll
    for (int j = 0; j < G::kChunks; ++j) {
#pragma unroll
      for (int sub = 0; sub < TILES; ++sub) {
        uint32_t a[4];
        unpack_word(cur[sub].k[0][j] ^ 0x80808080u, a[0], a[2]);  // token g: k 2c.. | 2c+8..
        unpack_word(cur[sub].k[1][j] ^ 0x80808080u, a[1], a[3]);  // token g+8
#pragma unroll
        for (int hb = 0; hb < kBlocks; ++hb) {
          uint32_t q0, q1;
          if constexpr (kQueryInShared) {
            const uint2 q2 = query_shared[hb * G::kChunks + j][lane];
            q0 = q2.x; q1 = q2.y;
          } else {
            q0 = qb[hb][j][0]; q1 = qb[hb][j][1];
          }
          mma_16x8x16(j % 2 ? s_odd[sub][hb] : s[sub][hb], a, q0, q1);
        }
      }
    }
    // ---- softmax: scale, mask, online max/sum per head in base 2, once per step ----
    float correction[kBlocks][2];
#pragma unroll
    for (int hb = 0; hb < kBlocks; ++hb) {
#pragma unroll
      for (int sub = 0; sub < TILES; ++sub)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int token = i >> 1, col = i & 1;
          const bool valid = t0 + 16 * sub + g + 8 * token < end;
          float scale = col_const[hb][col];
          if constexpr (kTokenScales) scale *= cur[sub].k_scale[token];
          s[sub][hb][i] = valid ? (s[sub][hb][i] + s_odd[sub][hb][i]) * scale : kNegInf;
        }
#pragma unroll
      for (int col = 0; col < 2; ++col) {
        float local = kNegInf;
#pragma unroll
        for (int sub = 0; sub < TILES; ++sub)
          local = fmaxf(local, fmaxf(s[sub][hb][col], s[sub][hb][2 + col]));
        const float new_max = fmaxf(col_max[hb][col], warp_max_xor_from(local, 4, 16));
        correction[hb][col] = fast_exp2(col_max[hb][col] - new_max);  // 0 on the first step
        col_max[hb][col] = new_max;
        float sum = col_sum[hb][col] * correction[hb][col];
#pragma unroll
        for (int sub = 0; sub < TILES; ++sub) {
          s[sub][hb][col] = fast_exp2(s[sub][hb][col] - new_max);
          s[sub][hb][2 + col] = fast_exp2(s[sub][hb][2 + col] - new_max);
          sum += s[sub][hb][col] + s[sub][hb][2 + col];
        }
        col_sum[hb][col] = sum;
      }
    }
    float ratio[TILES][2];
#pragma unroll
    for (int sub = 0; sub < TILES; ++sub) ratio[sub][0] = ratio[sub][1] = 1.f;
    if constexpr (kTokenScales) {
      float local = 0.f;
#pragma unroll
      for (int sub = 0; sub < TILES; ++sub)
        local = fmaxf(local, fmaxf(cur[sub].v_scale[0], cur[sub].v_scale[1]));
      const float step_ref = warp_max_xor_from(local, 4, 16);
      const float new_ref = step_ref > 0.f ? step_ref : v_ref;
      const float inv_ref = 1.f / new_ref;
#pragma unroll
      for (int sub = 0; sub < TILES; ++sub) {
        ratio[sub][0] = cur[sub].v_scale[0] * inv_ref;
        ratio[sub][1] = cur[sub].v_scale[1] * inv_ref;
      }
      const float ref_change = v_ref * inv_ref;
#pragma unroll
      for (int hb = 0; hb < kBlocks; ++hb)
        correction[hb][0] *= ref_change, correction[hb][1] *= ref_change;
      v_ref = new_ref;
    }
    // ---- accumulate: O^T = O^T * correction + sum over sub-tiles of V^T P^T ----
    uint32_t pb[TILES][kBlocks][2];
#pragma unroll
    for (int hb = 0; hb < kBlocks; ++hb) {
#pragma unroll
      for (int sub = 0; sub < TILES; ++sub) {
        pb[sub][hb][0] = transpose_8x8(pack2<f16>(s[sub][hb][0] * ratio[sub][0],
                                                  s[sub][hb][1] * ratio[sub][0]));
        pb[sub][hb][1] = transpose_8x8(pack2<f16>(s[sub][hb][2] * ratio[sub][1],
                                                  s[sub][hb][3] * ratio[sub][1]));
      }
#pragma unroll
      for (int mb = 0; mb < G::kMBlocks; ++mb) {
        acc[hb][mb][0] *= correction[hb][0]; acc[hb][mb][2] *= correction[hb][0];
        acc[hb][mb][1] *= correction[hb][1]; acc[hb][mb][3] *= correction[hb][1];
      }
    }
#pragma unroll
    for (int sub = 0; sub < TILES; ++sub) {
#pragma unroll
      for (int w = 0; w < G::kVWords; ++w) {
        const uint32_t va = cur[sub].v[0][w] ^ 0x80808080u, vb = cur[sub].v[1][w] ^ 0x80808080u;
        const uint32_t vc = cur[sub].v[2][w] ^ 0x80808080u, vd = cur[sub].v[3][w] ^ 0x80808080u;
        const uint32_t ab_lo = prmt(va, vb, 0x5140u), ab_hi = prmt(va, vb, 0x7362u);
        const uint32_t cd_lo = prmt(vc, vd, 0x5140u), cd_hi = prmt(vc, vd, 0x7362u);
#define LLFD_PV_BLOCK(I)                                                                  \
  {                                                                                       \
    const uint32_t a[4] = {pair_from_interleaved<2 * I>(ab_lo, ab_hi),                    \
                           pair_from_interleaved<2 * I + 1>(ab_lo, ab_hi),                \
                           pair_from_interleaved<2 * I>(cd_lo, cd_hi),                    \
                           pair_from_interleaved<2 * I + 1>(cd_lo, cd_hi)};               \
    _Pragma("unroll") for (int hb = 0; hb < kBlocks; ++hb)                                \
        mma_16x8x16(acc[hb][2 * w + I], a, pb[sub][hb][0], pb[sub][hb][1]);               \
  }
        LLFD_PV_BLOCK(0) LLFD_PV_BLOCK(1)
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
  for (int hb = 0; hb < kBlocks; ++hb)
#pragma unroll
    for (int col = 0; col < 2; ++col) {
      const float total = warp_sum_xor_from(col_sum[hb][col], 4, 16);
      const int head = 8 * hb + 2 * c + col;
      if (head >= GROUP) continue;
      if (g == 0) { warp_max[warp][head] = col_max[hb][col]; warp_sum[warp][head] = total; }
      float* dst = smem + (warp * GROUP + head) * HEAD_DIM + G::kVBytes * g;
#pragma unroll
      for (int mb = 0; mb < G::kMBlocks; ++mb) {
        const int d = 4 * (mb / 2) + 2 * (mb % 2);
        dst[d] = acc[hb][mb][col] * v_ref;
        dst[d + 1] = acc[hb][mb][2 + col] * v_ref;
      }
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
    value = idle ? 0.f : value * v_const / total;
    const float lse2 = idle ? kNegInf : best + __log2f(total);
    if (CLUSTER) {
      float* part = smem + NUM_WARPS * GROUP * HEAD_DIM;
      part[idx] = value;
      if (d == 0) part[GROUP * HEAD_DIM + row] = lse2;
    } else if (single) {
      static_cast<uint16_t*>(p.out)[b * p.out_batch_stride + (head0 + row) * p.out_head_stride +
                                    d] = from_float<QT>(value);
      if (p.lse != nullptr && d == 0)
        p.lse[b * p.num_kv_heads * GROUP + head0 + row] = lse2 * kLn2;
    } else {
      p.partial_out[(part * GROUP + row) * HEAD_DIM + d] = value;
      if (d == 0) p.partial_lse[part * GROUP + row] = lse2;
    }
  }
  if constexpr (CLUSTER) {
    cluster_merge<HEAD_DIM, GROUP, QT>(p, b, kvh, active, smem + NUM_WARPS * GROUP * HEAD_DIM);
    return;
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
  wait_for_previous_grid();  // the partials come from decode_split
  const int kvh = blockIdx.x, b = blockIdx.y;
  int chunk, active;
  split_range(clamped_length(p, b), p, chunk, active);
  if (active > 1) merge_splits<HEAD_DIM, GROUP, QT>(p, b, kvh, active, scratch);
}

}  // namespace llfd
