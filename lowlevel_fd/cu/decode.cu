// Split-K GQA decode attention over an INT8 KV cache, on the tensor cores.
//
// Grid (kv head, split, batch). One CTA owns a KV head and its whole query-head group, so every
// K/V byte is read from memory once and used by all GROUP heads. Each warp streams 16-token
// tiles of its split through a shared-memory pipeline (decode_pipeline.cuh) and keeps its own
// online softmax; the CTA merges its warps, and the splits of one (batch, kv head) are merged
// by the last CTA to finish (a device counter), inside a cluster, or by decode_combine
// (decode_combine.cu). The APPEND instantiation also rotates, quantizes and writes each
// sequence's new token and attends it (decode_append.cuh).
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
#include "decode_append.cuh"
#include "decode_fragments.cuh"
#include "decode_merge.cuh"
#include "decode_pages.cuh"

namespace llfd {

// STAGES tiles per warp are in flight in shared memory (decode_pipeline.cuh).
// CLUSTER: the CTAs of one (batch, kv head) form a thread-block cluster (grid.y = cluster size =
// num_splits) and push their partials into the leader's shared memory (DSMEM), with no global
// round trips (decode_merge.cuh); otherwise the last CTA to arrive merges through global memory.
// TILES: 16-token tiles per step of a warp. Two give each warp two independent QK chains and
// one softmax reduction per 32 tokens (more work in flight per warp when warps are few).
// APPEND: the fused append of decode_append.cuh (DecodePlan.append_and_run); seq_lens are then
// the new tokens' positions.
// MASKED: the query group is not GROUP: fewer heads (the rest masked) or more (chunks of CTAs
// per KV head), from DecodeParams' group fields at run time (HeadChunk).
// PAGED: the cache is in pages (cache_pages.cuh): every row's page comes from the block table,
// loaded ahead of the tiles: a tile ahead, or a batch of tiles for small pages (PagedTiles,
// decode_pages.cuh).
template <int HEAD_DIM, int GROUP, int NUM_WARPS, int SCALE_MODE, typename QT, typename ScaleT,
          int STAGES, bool CLUSTER, int TILES, bool APPEND, bool MASKED, bool PAGED>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1)
decode_split(const __grid_constant__ DecodeParams p) {
  using G = Geometry<HEAD_DIM>;
  static_assert(GROUP >= 1 && GROUP <= 16, "1..16 query heads per CTA");
  static_assert(STAGES >= 2, "at least double buffering");
  constexpr int kBlocks = GROUP > 8 ? 2 : 1;  // head blocks of 8 (the mma's N)
  constexpr bool kTokenScales = SCALE_MODE == kScalePerToken;
  using S = Stage<HEAD_DIM, ScaleT, TILES, PAGED>;
  static_assert(TILES == 1 || TILES == 2, "one or two tiles per step");
  // Dynamic shared memory: the warps' pipelines, reused after the loop for the warps'
  // accumulator quads (decode_merge.cuh) and then for the global split merge; a cluster's
  // slots follow at p.cluster_slots_offset. 128-byte aligned: the pipelines' bank swizzles
  // (decode_pipeline.cuh) assume it, and the static shared memory before it could shift it.
  extern __shared__ __align__(128) float smem[];
  __shared__ float warp_max[NUM_WARPS][16], warp_sum[NUM_WARPS][16];
  __shared__ int is_last;

  // blockIdx.x: a KV head and a chunk of at most GROUP of its query heads (HeadChunk).
  const HeadChunk<GROUP, MASKED> hc(p, blockIdx.x);
  const int kvh = hc.kvh, split = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int head0 = hc.first;
  // Programmatic dependent launch: q (and the new token) may come from the previous kernel, so
  // they are read after its completion; the next kernel may launch once this one gets there.
  // With early_reads (fused append only) the lengths, the cache and its scales and the RoPE
  // table are read before it (the caller guarantees the previous kernel writes none of them),
  // so the first tiles stream while the previous kernel finishes. Every global write of this
  // kernel comes after the wait.
  const bool early = APPEND && p.early_reads != 0;
  auto depend = [&]() __attribute__((always_inline)) {
    wait_for_previous_grid();
    allow_next_grid();
  };
  if (!early) depend();
  // Cluster merge, phase 1: a CTA may store into the leader's shared memory only once every
  // CTA of the cluster has started (and the leader has set up the barrier its slots complete);
  // arrive now, wait just before the stores.
  __shared__ __align__(8) uint64_t merge_barrier;
  if constexpr (CLUSTER) {
    if (split == 0 && threadIdx.x == 0) mbarrier_init_for_cluster(&merge_barrier, 1);
    cluster_arrive_relaxed();
  }

  // ---- load: the query group first: its latency overlaps the length read below ----
  // head_dim 256 keeps the Q fragments in shared memory (8 bytes per lane and k-step,
  // conflict-free): in registers they would push the kernel into spills.
  constexpr bool kQueryInShared = HEAD_DIM == 256;
  __shared__ uint2 query_shared[kQueryInShared ? kBlocks * G::kChunks : 1][32];
  uint32_t qb[kBlocks][G::kChunks][2];
  float head_scale[kBlocks];
  auto fetch_query = [&](const uint16_t* group, int64_t head_stride) __attribute__((always_inline)) {
    load_query<HEAD_DIM, GROUP, QT, kBlocks, !APPEND>(qb, head_scale, group, head_stride,
                                                      hc.heads, g, c);
    if constexpr (kQueryInShared) {
      if (warp == 0)
#pragma unroll
        for (int hb = 0; hb < kBlocks; ++hb)
#pragma unroll
          for (int j = 0; j < G::kChunks; ++j)
            query_shared[hb * G::kChunks + j][lane] = make_uint2(qb[hb][j][0], qb[hb][j][1]);
      __syncthreads();
    }
  };
  // The fused append (decode_append.cuh) stages the query group rotated, after the length
  // read; its first rows are loaded here, before that read.
  __shared__ typename NewTokenState<APPEND, HEAD_DIM, GROUP>::type fresh;
  uint4 first_raw = make_uint4(0, 0, 0, 0);
  auto load_first_row = [&]() __attribute__((always_inline)) {
    first_raw = load_new_row<HEAD_DIM, GROUP>(p, b, hc, threadIdx.x / RowLanes<HEAD_DIM>::kLanes,
                                              threadIdx.x % RowLanes<HEAD_DIM>::kLanes);
  };
  if constexpr (APPEND) {
    if (!early) load_first_row();
  } else
    fetch_query(static_cast<const uint16_t*>(p.q) + b * p.q_batch_stride +
                    head0 * p.q_head_stride,
                p.q_head_stride);
  // len: the cached tokens the warps stream. With the fused append the splits cover those and
  // the new token joins the last one (sequence_splits).
  constexpr bool kWindow = PAGED && APPEND;
  __shared__ int id_window[kWindow ? IdWindow<NUM_WARPS * 32>::kEntries : 1];
  IdWindow<NUM_WARPS * 32> window;
  if constexpr (kWindow) window.load(p, b, blockIdx.y, id_window);
  int len, pos = 0, chunk, active, new_page = 0;
  bool appended = false;
  RopeCoefficients<HEAD_DIM, NUM_WARPS * 32> rope_cs;
  if constexpr (APPEND) {
    pos = p.seq_lens[b];
    if (p.rope != kRopeNone) rope_cs.start(p);  // while the position loads
    len = sequence_splits(p, pos, appended, chunk, active);
    if (appended) new_page = page_of(p, b, pos);  // the new token's page, early
    if (p.rope != kRopeNone) rope_cs.load(p, pos, appended);  // lands during the prologue
  } else {
    len = clamped_length(p, b);
    split_range(len, p, chunk, active);
  }

  // After the wait (early_reads): the error flag (nothing written; the host can read why).
  auto flag_position = [&]() __attribute__((always_inline)) {
    if constexpr (APPEND)
      if (!appended) atomicOr(p.error_flags, kErrorOutsideCache);
  };
  if (!early) flag_position();

  if (active == 0 || split >= active) {
    if constexpr (kWindow) window.drain(p);
  }
  if (active == 0) {  // empty sequence: zero output, lse = -inf, never NaN
    if (early) depend(), flag_position();
    if (split == 0)
      for (int idx = threadIdx.x; idx < hc.heads * HEAD_DIM; idx += blockDim.x) {
        const int row = idx / HEAD_DIM, d = idx % HEAD_DIM;
        static_cast<uint16_t*>(p.out)[b * p.out_batch_stride + (head0 + row) * p.out_head_stride +
                                      d] = 0;
        if (p.lse != nullptr && d == 0) p.lse[hc.row(p, b, row)] = kNegInf;
      }
    return;
  }
  // Splits past the sequence's (idle CTAs) have nothing to do; exiting also lets the next
  // kernel launch, and a cluster's leader waits only for the active CTAs' slots.
  if (split >= active) return;
  // The last active split also takes the appended token (in its merge, not its stream).
  const bool has_new = appended && split == active - 1;
  const int start = split * chunk, end = min(len, start + chunk);

  float k_const = p.score_scale_log2, v_const = 1.f;
  if constexpr (SCALE_MODE == kScalePerTensor) {
    k_const *= __ldg(static_cast<const float*>(p.k_scale));
    v_const = __ldg(static_cast<const float*>(p.v_scale));
  } else if constexpr (SCALE_MODE == kScalePerHead) {
    k_const *= __ldg(static_cast<const float*>(p.k_scale) + kvh);
    v_const = __ldg(static_cast<const float*>(p.v_scale) + kvh);
  }
  const int64_t kv_offset = b * p.kv_batch_stride + kvh * p.kv_head_stride;
  const int8_t* k_base = p.k_cache + kv_offset;
  const int8_t* v_base = p.v_cache + kv_offset;
  const int64_t scale_offset = b * p.scale_batch_stride + kvh * p.scale_head_stride;
  const ScaleT* ks_tokens = static_cast<const ScaleT*>(p.k_scale) + scale_offset;
  const ScaleT* vs_tokens = static_cast<const ScaleT*>(p.v_scale) + scale_offset;
  const uint32_t pipe = shared_address(smem) + warp * STAGES * S::kBytes;
  auto pipe_base = [&](int index) __attribute__((always_inline)) {
    return pipe + index * S::kBytes;
  };
  constexpr int kStep = 16 * TILES * NUM_WARPS;
  const int first = start + 16 * TILES * warp;
  using PagerT = typename Pager<PAGED, HEAD_DIM, kTokenScales, ScaleT, TILES, kStep>::type;
  PagerT pager(p, b, kvh, lane);
  if constexpr (kWindow) {
    window.wait(p);  // uniform: every CTA that gets here syncs
    pager.use_window(id_window, window.first, window.count);
  }
  // Issue the warp's next tile (at t) into stage `index`; a paged warp's ring then moves on.
  // `whole` (BoolTag): the page path, fixed per instantiation of the loop below.
  auto issue_as = [&](auto whole, int index, int t) __attribute__((always_inline)) {
    if constexpr (PAGED) {
      constexpr bool kWhole = decltype(whole)::value;
      pager.template issue_as<kWhole>(pipe_base(index), index, t, end, lane);
      if (t + kStep < end) pager.template advance<kWhole>(t + kStep, end, lane);
    } else {
      issue_tile<HEAD_DIM, kTokenScales, ScaleT, TILES>(pipe_base(index), k_base, v_base,
                                                        ks_tokens, vs_tokens, p.kv_token_stride,
                                                        t, end, lane);
    }
  };

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

  // ---- load: STAGES - 1 tiles ahead of the math, per warp (per page path, as the loop) ----
  auto prologue = [&](auto whole) __attribute__((always_inline)) {
    if constexpr (PAGED) {
      if (first < end) pager.template start<decltype(whole)::value>(first, end, lane);
    }
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
      if (first + st * kStep < end) issue_as(whole, st, first + st * kStep);
      cp_async_commit();  // empty groups keep the group count uniform
    }
  };
  if constexpr (PAGED) {
    if (pager.whole)
      prologue(BoolTag<true>{});
    else
      prologue(BoolTag<false>{});
  } else {
    prologue(BoolTag<true>{});
  }
  if constexpr (APPEND) {  // while the first tiles load: rotate, quantize, write the token
    // The RoPE coefficients go to shared memory first: with early_reads this is still before
    // the wait, so the table's latency (or the theta path's sin/cos) is off the chain.
    if (p.rope != kRopeNone && appended) rope_cs.store(p, pos, fresh.cs);
    if (early) {
      depend();
      flag_position();
      load_first_row();
    }
    // Every chunk of the KV head's query heads quantizes the new token; the first writes it.
    stage_new_token<HEAD_DIM, GROUP, SCALE_MODE, QT, ScaleT, NUM_WARPS * 32>(
        p, fresh, first_raw, b, hc, pos, new_page, appended, has_new && hc.chunk == 0);
    fetch_query(&fresh.q[0][0], HEAD_DIM);
  }
  // This lane's accumulator columns are heads 8hb + 2c + i; their bf16 rescale lives in the
  // lanes that loaded those heads (lane 4 * head).
  float col_const[kBlocks][2];
#pragma unroll
  for (int hb = 0; hb < kBlocks; ++hb)
#pragma unroll
    for (int i = 0; i < 2; ++i)
      col_const[hb][i] = k_const * __shfl_sync(0xffffffffu, head_scale[hb], 4 * (2 * c + i));
  // K fragments skip the -1152 of unpack_word (K x Q^T on k + 1152, exact in fp16): each
  // column's score then carries 1152 x the sum of its head's query fragments, taken off by
  // starting the odd k-steps' accumulator at minus that (no instruction per tile).
  constexpr bool kKBias = !kQueryInShared;
  float col_bias[kBlocks][2] = {};
  if constexpr (kKBias) {
#pragma unroll
    for (int hb = 0; hb < kBlocks; ++hb) {
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < G::kChunks; ++j)
#pragma unroll
        for (int w = 0; w < 2; ++w)
          sum += half_to_float(qb[hb][j][w] & 0xffffu) + half_to_float(qb[hb][j][w] >> 16);
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
#pragma unroll
      for (int i = 0; i < 2; ++i)
        col_bias[hb][i] = -1152.f * __shfl_sync(0xffffffffu, sum, 4 * (2 * c + i));
    }
  }
  // The streaming loop, instantiated per page path (paged kernels: whole pages or rows; the
  // choice is per launch), so that neither carries the other's registers and branches.
  auto stream = [&](auto whole) __attribute__((always_inline)) {
    int stage = 0;
  #pragma unroll 1
    for (int t0 = first; t0 < end; t0 += kStep) {
      {
        const int t_issue = t0 + (STAGES - 1) * kStep;
        const int issue_stage = stage == 0 ? STAGES - 1 : stage - 1;
        if (t_issue < end) issue_as(whole, issue_stage, t_issue);
        cp_async_commit();
      }
      cp_async_wait<STAGES - 1>();  // the tiles of t0 have landed (this lane's part)
      __syncwarp();                 // ... and every other lane's part is visible
      Tile<HEAD_DIM> cur[TILES];
      const char* stage_base =
          reinterpret_cast<const char*>(smem) + (warp * STAGES + stage) * S::kBytes;
  #pragma unroll
      for (int sub = 0; sub < TILES; ++sub)
        read_tile<HEAD_DIM, kTokenScales, ScaleT, TILES, PAGED>(cur[sub], stage_base, sub, g, c);
      if constexpr (PAGED && kTokenScales) {  // braces: a pragma inside a lambda must not
                                              // reach past the if
  #pragma unroll
        for (int sub = 0; sub < TILES; ++sub)
  #pragma unroll
          for (int half = 0; half < 2; ++half) {
            cur[sub].k_scale[half] = pager.scale(stage_base, stage, sub, 8 * half + g, false);
            cur[sub].v_scale[half] = pager.scale(stage_base, stage, sub, 8 * half + g, true);
          }
      }

      // ---- score: S^T = K Q^T, rows tokens g and g+8, columns heads 2c, 2c+1 (per block) ----
      // Even and odd k-steps of every sub-tile accumulate separately: 2 x TILES independent mma
      // chains per head block.
      float s[TILES][kBlocks][4], s_odd[TILES][kBlocks][4];
  #pragma unroll
      for (int sub = 0; sub < TILES; ++sub)
  #pragma unroll
        for (int hb = 0; hb < kBlocks; ++hb)
  #pragma unroll
          for (int i = 0; i < 4; ++i) s[sub][hb][i] = 0.f, s_odd[sub][hb][i] = col_bias[hb][i & 1];
  #pragma unroll
      for (int j = 0; j < G::kChunks; ++j) {
  #pragma unroll
        for (int sub = 0; sub < TILES; ++sub) {
          uint32_t a[4];
          if constexpr (kKBias) {
            unpack_word_plus1152(cur[sub].k[0][j] ^ 0x80808080u, a[0], a[2]);
            unpack_word_plus1152(cur[sub].k[1][j] ^ 0x80808080u, a[1], a[3]);
          } else {
            unpack_word(cur[sub].k[0][j] ^ 0x80808080u, a[0], a[2]);  // token g: k 2c.. | 2c+8..
            unpack_word(cur[sub].k[1][j] ^ 0x80808080u, a[1], a[3]);  // token g+8
          }
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
  };
  if constexpr (PAGED) {
    if (pager.whole)
      stream(BoolTag<true>{});
    else
      stream(BoolTag<false>{});
  } else {
    stream(BoolTag<true>{});
  }
  cp_async_wait<0>();
  if constexpr (PAGED)  // after the programmatic wait (every global write comes after it)
    if (pager.bad) atomicOr(p.error_flags, kErrorBadPage);
  __syncthreads();  // the merge below reuses the pipelines' shared memory

  // ---- merge the warps of this CTA, on accumulator quads (decode_merge.cuh) ----
  // Every warp stores its accumulators as its lanes hold them (16-byte stores, no bank
  // conflicts); each thread then merges one quad position over the warps.
  using Q = Quads<HEAD_DIM, GROUP>;
  float4* const warp_quads = reinterpret_cast<float4*>(smem);
#pragma unroll
  for (int hb = 0; hb < kBlocks; ++hb) {
#pragma unroll
    for (int col = 0; col < 2; ++col) {
      const float total = warp_sum_xor_from(col_sum[hb][col], 4, 16);
      const int head = 8 * hb + 2 * c + col;
      if (g == 0 && head < GROUP) { warp_max[warp][head] = col_max[hb][col]; warp_sum[warp][head] = total; }
    }
#pragma unroll
    for (int mb = 0; mb < G::kMBlocks; ++mb)
      warp_quads[warp * Q::kPerWarp + (hb * G::kMBlocks + mb) * 32 + lane] =
          make_float4(acc[hb][mb][0] * v_ref, acc[hb][mb][1] * v_ref, acc[hb][mb][2] * v_ref,
                      acc[hb][mb][3] * v_ref);
  }
  if constexpr (APPEND)
    if (has_new) new_token_scores<HEAD_DIM, GROUP, QT, NUM_WARPS>(p, fresh, warp, lane);
  __syncthreads();

  const bool single = active == 1;
  const int64_t part = (static_cast<int64_t>(b) * hc.slots(p) + hc.slot) * p.num_splits + split;
  // Cluster merge: this CTA's slot in the leader's shared memory and the leader's barrier.
  float* const slots =
      reinterpret_cast<float*>(reinterpret_cast<char*>(smem) + p.cluster_slots_offset);
  uint32_t my_slot = 0, leader_barrier = 0;
  if constexpr (CLUSTER) {
    my_slot = cluster_address(slots + split * Q::kSlotFloats, 0);
    leader_barrier = cluster_address(&merge_barrier, 0);
    cluster_wait();  // phase 1 complete: the leader has started and set up its barrier
  }
  for (int idx = threadIdx.x; idx < Q::kCompact; idx += blockDim.x) {
    const Q quad(idx);
    float best[2], total[2];
    float4 value = make_float4(0.f, 0.f, 0.f, 0.f);
    // Weights of the warps per head of the quad; the appended token is one more partial
    // (sum 1, its score, its V).
#pragma unroll
    for (int col = 0; col < Q::kHeads; ++col) {
      const int head = quad.head0 + col;
      float fresh_score = kNegInf;
      if constexpr (APPEND)
        if (has_new) fresh_score = fresh.score[head];
      best[col] = fresh_score;
#pragma unroll
      for (int w = 0; w < NUM_WARPS; ++w) best[col] = fmaxf(best[col], warp_max[w][head]);
      total[col] = 0.f;
    }
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) {
      float weight[2] = {0.f, 0.f};
#pragma unroll
      for (int col = 0; col < Q::kHeads; ++col) {
        const int head = quad.head0 + col;
        weight[col] = fast_exp2(warp_max[w][head] - best[col]);
        total[col] += warp_sum[w][head] * weight[col];
      }
      const float4 v = warp_quads[w * Q::kPerWarp + quad.stored()];
      value.x += v.x * weight[0]; value.y += v.y * weight[1];
      value.z += v.z * weight[0]; value.w += v.w * weight[1];
    }
    if constexpr (APPEND)
      if (has_new) {
        float weight[2] = {0.f, 0.f};
#pragma unroll
        for (int col = 0; col < Q::kHeads; ++col) {
          weight[col] = fast_exp2(fresh.score[quad.head0 + col] - best[col]);
          total[col] += weight[col];
        }
        const float v0 = fresh.value[quad.d], v1 = fresh.value[quad.d + 1];
        value.x += v0 * weight[0]; value.y += v0 * weight[1];
        value.z += v1 * weight[0]; value.w += v1 * weight[1];
      }
    // Per-tensor and per-head V scales multiply the output once instead of every element.
    float lse2[2] = {kNegInf, kNegInf};
#pragma unroll
    for (int col = 0; col < Q::kHeads; ++col) {
      const float inv = v_const / total[col];
      if (col == 0) value.x *= inv, value.z *= inv;
      else value.y *= inv, value.w *= inv;
      lse2[col] = best[col] + __log2f(total[col]);
    }
    if constexpr (CLUSTER) {
      store_cluster_async(my_slot + 16 * idx, value, leader_barrier);
      if (quad.writes_lse())
#pragma unroll
        for (int col = 0; col < Q::kHeads; ++col)
          store_cluster_async(my_slot + 4 * (Q::kSlotLse + quad.head0 + col), lse2[col],
                              leader_barrier);
    } else if (single) {
      quad.template store_output<QT>(p, b, hc, value);
      if (p.lse != nullptr && quad.writes_lse())
#pragma unroll
        for (int col = 0; col < Q::kHeads; ++col)
          if (hc.has(quad.head0 + col)) p.lse[hc.row(p, b, quad.head0 + col)] = lse2[col] * kLn2;
    } else {
      float* dst = p.partial_out + part * GROUP * HEAD_DIM + quad.d;
      *reinterpret_cast<float2*>(dst + quad.head0 * HEAD_DIM) = make_float2(value.x, value.z);
      if (Q::kHeads == 2)
        *reinterpret_cast<float2*>(dst + (quad.head0 + 1) * HEAD_DIM) =
            make_float2(value.y, value.w);
      if (quad.writes_lse())
#pragma unroll
        for (int col = 0; col < Q::kHeads; ++col)
          p.partial_lse[part * GROUP + quad.head0 + col] = lse2[col];
    }
  }
  if constexpr (CLUSTER) {
    // Only the leader waits: for every active CTA's slot bytes (its own included) to land.
    if (split != 0) return;
    if (threadIdx.x == 0) mbarrier_expect_bytes(&merge_barrier, active * Q::kSlotBytes);
    mbarrier_wait_cluster(&merge_barrier, 0);
    leader_merge<HEAD_DIM, GROUP, QT>(p, b, hc, active, slots);
    return;
  }
  if (single || !p.fused_merge) return;

  // ---- the last CTA of this (batch, kv head) to arrive merges all splits ----
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint32_t arrived = atomicAdd(p.counters + b * hc.slots(p) + hc.slot, 1u);
    is_last = arrived + 1 == static_cast<uint32_t>(active);
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  merge_splits<HEAD_DIM, GROUP, QT>(p, b, hc, active, smem);
  if (threadIdx.x == 0) p.counters[b * hc.slots(p) + hc.slot] = 0;  // ready for the next launch
}

}  // namespace llfd
