// Multi-token attention over the INT8 cache: prefill, chunked prefill and speculative
// verification, one kernel (FlashAttention-2 style, on the tensor cores).
//
// Grid (64-row tile x KV head, split, sequence). A KV head's query rows are packed token-major
// (row r: token r / group, query head r % group), so every K/V tile a CTA loads serves all the
// heads of its group and all the chunk's tokens in the tile. Each of four warps owns one or two
// 16-row blocks (the mma's M), or shares a row block with the other warps (KSPLIT, below); the
// CTA streams K/V tiles through a cp.async pipeline (multi_tiles.cuh) shared by its warps,
// converts int8 to fp16 in registers, and keeps an online softmax per row:
//  * per-tensor / per-head K scales and sm_scale fold into each row's score scale, per-token K
//    scales multiply the score columns; per-token V scales fold into P relative to the largest
//    V scale seen (P stays in [0, 1]), the output is rescaled when that reference grows;
//  * causal: a tile's KV range ends at its last row's position; rows mask per element; a warp
//    skips tiles past its own last row; a tree mask (speculative trees) hides draft columns
//    per row in the tiles that reach the chunk;
//  * a tile whose KV range is long next to the grid (short chunks over long prefixes) is cut
//    into splits; each writes a normalised partial and the last to finish merges them.
// bf16 queries (and rotated ones) are scaled per row by a power of two into fp16 range.
#include "multi_rows.cuh"
#include "multi_tiles.cuh"

namespace llfd {

constexpr int kMultiStages = 3;      // KV tiles in flight

// A compile-time bool as a value: the tile loop is instantiated with and without the tree mask.
template <bool B>
struct TreeTag { static constexpr bool value = B; };

// Each warp owns kMT m-blocks of 16 rows (two in most variants): the int8 -> fp16 conversion
// of a K/V fragment then serves two mmas.
// KSPLIT: warps per row group, each taking its share of every KV tile (the CTA then owns
// 4 / KSPLIT row groups). Short chunks (speculative drafts: a few tokens x the group) fill
// one or two row groups; with KSPLIT 2 (4 at head_dim 64) the warps of a group convert and
// multiply their half (quarter) of each tile and the CTA merges them at the end, so a row
// group streams its KV two (four) times as fast.
template <int HEAD_DIM, int SCALE_MODE, typename QT, typename ScaleT, bool PAGED, int KSPLIT>
__global__ void __launch_bounds__(128, 2) multi_attend(const __grid_constant__ MultiParams p) {
  static_assert(KSPLIT == 1 || KSPLIT == 2 || KSPLIT == 4, "1, 2 or 4 warps per row group");
  // 16-row m-blocks per warp: two when every warp takes whole tiles below head_dim 256; one
  // otherwise (with split warps a second block's accumulators pushed variants into spills).
  constexpr int kMT = HEAD_DIM != 256 && KSPLIT == 1 ? 2 : 1;
  // KV tokens per tile: 32 where the score accumulators of 64 would not fit in registers next
  // to the output's (head_dim 256; 128 with two m-blocks and the whole tile per warp).
  constexpr int kTileRows = HEAD_DIM == 256 || (HEAD_DIM == 128 && KSPLIT == 1) ? 32 : 64;
  using T = MultiTile<HEAD_DIM, kTileRows>;
  constexpr int kChunks = HEAD_DIM / 16, kNB = T::kRows / 8, kKT = T::kRows / 16;
  constexpr int kGroups = 4 / KSPLIT;                       // row groups of the CTA
  constexpr int kWarpRows = 16 * kMT, kCtaRows = kWarpRows * kGroups;
  constexpr int kNBw = kNB / KSPLIT, kKTw = kKT / KSPLIT;   // a warp's share of a tile
  static_assert(kKTw >= 1, "a warp's share of a KV tile is at least 16 tokens");
  static_assert(kChunks % 2 == 0 && kNBw % 2 == 0, "K is read two chunks x two n-blocks at a time");
  constexpr bool kTokenScales = SCALE_MODE == kScalePerToken;
  extern __shared__ __align__(128) char smem[];
  __shared__ int is_last;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int wr = warp % kGroups, wk = warp / kGroups;  // row group, share of the KV tile

  // Programmatic launch (CtaWork): with p.early_reads a split's first tiles, when they lie
  // before its chunk (the previous kernel, an append, writes the chunk's rows), are issued
  // before the wait, so they stream during that kernel's tail (PERF_NOTES m17).
  const CtaWork<kCtaRows, T::kRows> work(p);
  if (work.idle) {
    work.template retire<HEAD_DIM>(p);
    return;
  }
  const SequenceRows& sr = work.sr;
  const int kvh = work.kvh, tile = work.tile, split = work.split, b = work.b;
  const int row0 = work.row0, tile_rows = work.tile_rows, active = work.active;
  const int start = work.start, end = work.end;

  // This warp's rows: m-block mt holds rows w_row0 + 16 mt + g (+ 8). Contiguous caches compute
  // every block (rows past the sequence's have zero queries and are not stored): a branch per
  // block and mma cuts the unrolled tile into basic blocks the scheduler cannot interleave
  // (12% of prefill, PERF_NOTES m5). Paged variants skip dead blocks: unguarded, the
  // scheduler's extra registers next to the page ids spill.
  const int w_row0 = row0 + kWarpRows * wr;
  const bool warp_active = w_row0 < sr.rows;
  const int blocks = !PAGED || kMT == 1 ? kMT  // one block: live in every active warp
                                        : warp_active ? min(kMT, (sr.rows - w_row0 + 15) / 16) : 0;
  const int warp_limit = warp_active ? sr.limit(p, min(w_row0 + kWarpRows - 1, sr.rows - 1)) : 0;
  int visible[kMT][2];  // tokens [0, visible) of this split each row sees
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = w_row0 + 16 * mt + 8 * hr + g;
      visible[mt][hr] = r < sr.rows ? min(end, sr.limit(p, r)) : 0;
    }

  TileLoader<HEAD_DIM, kTileRows, kTokenScales, ScaleT, PAGED, 128, !PAGED> loader(b, kvh);
  const uint32_t smem_base = shared_address(smem);
  // With early reads the first tiles are issued before the wait when they lie before the
  // chunk, after it otherwise (one copy of the prologue either way).
  const bool prime_early = work.template primes_early<kMultiStages>();
  if (work.early && !prime_early) work.wait_then_flag(p);
  loader.prime<kMultiStages>(p, smem_base, T::kBytes, start, end);
  if (prime_early) work.wait_then_flag(p);

  // Q fragments live in shared memory (16 bytes per lane, m-block and 16-dim chunk, read
  // conflict-free by the lane that wrote them): in registers, next to the accumulators of two
  // m-blocks, they would push the kernel into spills.
  uint4* const q_shared = reinterpret_cast<uint4*>(smem + kMultiStages * T::kBytes) +
                          warp * kMT * kChunks * 32;
  // Per-tensor / per-head scales (rows.cuh); per-token ones are applied per score column.
  float k_const = p.score_scale_log2, v_const = 1.f;
  if constexpr (!kTokenScales) {
    k_const *= given_scale<SCALE_MODE>(p.k_scale, kvh);
    v_const = given_scale<SCALE_MODE>(p.v_scale, kvh);
  }
  float row_const[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
    uint32_t qf[kChunks][4];
    load_rows<HEAD_DIM, QT>(qf, row_const[mt], p, sr, kvh, w_row0 + 16 * mt + g, c);
    row_const[mt][0] *= k_const;
    row_const[mt][1] *= k_const;
#pragma unroll
    for (int s = 0; s < kChunks; ++s)
      q_shared[(mt * kChunks + s) * 32 + lane] = make_uint4(qf[s][0], qf[s][1], qf[s][2], qf[s][3]);
  }

  float oacc[kMT][2 * kChunks][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int n = 0; n < 2 * kChunks; ++n)
      oacc[mt][n][0] = oacc[mt][n][1] = oacc[mt][n][2] = oacc[mt][n][3] = 0.f;
  float m[kMT][2], l[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) m[mt][0] = m[mt][1] = kNegInf, l[mt][0] = l[mt][1] = 0.f;
  float v_ref = kTokenScales ? 0.f : 1.f;

  int stage = 0;
  // One KV tile; `tree` (TreeTag) applies the tree mask, in the tiles that reach the chunk
  // only (a branch on it inside the one loop cost 5% of prefill).
  auto tile_step = [&](auto tree, int t0) __attribute__((always_inline)) {
    cp_async_wait<kMultiStages - 2>();
    loader.widen(smem + stage * T::kBytes, stage);
    __syncthreads();  // the tile is visible; the stage refilled below is free
    {
      const int t_issue = t0 + (kMultiStages - 1) * T::kRows;
      const int issue_stage = stage == 0 ? kMultiStages - 1 : stage - 1;
      if (t_issue < end) {
        loader.issue(p, smem_base + issue_stage * T::kBytes, issue_stage, t_issue, end);
        loader.fetch(p, t_issue + T::kRows, end);
      }
      cp_async_commit();
    }
    if (warp_active && t0 < warp_limit) {
      const uint32_t st_addr = smem_base + stage * T::kBytes;
      const char* st_ptr = smem + stage * T::kBytes;
      // ---- S = Q K^T: rows g, g + 8 of each m-block, columns (tokens) 8 nb + 2c, +1 ----
      float s[kMT][kNBw][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int j = 0; j < kNBw; ++j) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f;
      // Two 16-dim chunks of Q at a time (read once per tile); one ldmatrix brings K for two
      // n-blocks x those two chunks (matrix i: n-block 2 jp + i / 2, chunk 2 s2 + i % 2).
#pragma unroll
      for (int s2 = 0; s2 < kChunks / 2; ++s2) {
        uint32_t qa[kMT][2][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const uint4 v = q_shared[(mt * kChunks + 2 * s2 + i) * 32 + lane];
            qa[mt][i][0] = v.x; qa[mt][i][1] = v.y; qa[mt][i][2] = v.z; qa[mt][i][3] = v.w;
          }
#pragma unroll
        for (int jp = 0; jp < kNBw / 2; ++jp) {
          const int nb = wk * kNBw + 2 * jp;
          uint32_t r[4];
          ldmatrix_x4(r, st_addr + T::kK + T::offset(8 * (nb + (lane >> 4)) + (lane & 7),
                                                     2 * s2 + ((lane >> 3) & 1)));
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const uint32_t u = r[i] ^ 0x80808080u;
            const uint32_t b0 = int8_pair<0x4140u>(u), b1 = int8_pair<0x4342u>(u);
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt)
              if (!PAGED || mt < blocks) mma_16x8x16(s[mt][2 * jp + i / 2], qa[mt][i % 2], b0, b1);
          }
        }
      }
      // ---- scale, mask, online softmax in base 2 ----
      float2 ks[kNBw];
#pragma unroll
      for (int j = 0; j < kNBw; ++j) {
        ks[j] = make_float2(1.f, 1.f);
        if constexpr (kTokenScales)
          ks[j] = *reinterpret_cast<const float2*>(st_ptr + T::kKScale +
                                                   4 * (8 * (wk * kNBw + j) + 2 * c));
      }
      float corr[kMT][2];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int j = 0; j < kNBw; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int col = t0 + 8 * (wk * kNBw + j) + 2 * c + (e & 1), hr = e >> 1;
            const float x = s[mt][j][e] * row_const[mt][hr] * ((e & 1) ? ks[j].y : ks[j].x);
            s[mt][j][e] = col < visible[mt][hr] ? x : kNegInf;
          }
        if constexpr (decltype(tree)::value) {
          tree_mask_scores<kNBw>(s[mt], p, sr, w_row0 + 16 * mt + g, t0 + 8 * wk * kNBw + 2 * c);
        }
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          float mx = kNegInf;
#pragma unroll
          for (int j = 0; j < kNBw; ++j) mx = fmaxf(mx, fmaxf(s[mt][j][2 * hr], s[mt][j][2 * hr + 1]));
          mx = warp_max_xor(mx, 2);
          const float m_new = fmaxf(m[mt][hr], mx);
          const float m_use = m_new == kNegInf ? 0.f : m_new;  // a row with nothing visible yet
          corr[mt][hr] = fast_exp2(m[mt][hr] - m_use);
          m[mt][hr] = m_new;
          float sum = 0.f;
#pragma unroll
          for (int j = 0; j < kNBw; ++j) {
            s[mt][j][2 * hr] = fast_exp2(s[mt][j][2 * hr] - m_use);
            s[mt][j][2 * hr + 1] = fast_exp2(s[mt][j][2 * hr + 1] - m_use);
            sum += s[mt][j][2 * hr] + s[mt][j][2 * hr + 1];
          }
          l[mt][hr] = l[mt][hr] * corr[mt][hr] + sum;
        }
      }
      float ratio[kNBw][2];
#pragma unroll
      for (int j = 0; j < kNBw; ++j) ratio[j][0] = ratio[j][1] = 1.f;
      if constexpr (kTokenScales) {
        float local = 0.f;
#pragma unroll
        for (int j = 0; j < kNBw; ++j) {
          const float2 vs = *reinterpret_cast<const float2*>(
              st_ptr + T::kVScale + 4 * (8 * (wk * kNBw + j) + 2 * c));
          ratio[j][0] = vs.x;
          ratio[j][1] = vs.y;
          local = fmaxf(local, fmaxf(vs.x, vs.y));
        }
        const float new_ref = fmaxf(v_ref, warp_max_xor(local, 2));
        const float inv = new_ref > 0.f ? 1.f / new_ref : 0.f;
        const float change = new_ref > 0.f ? v_ref * inv : 1.f;
#pragma unroll
        for (int j = 0; j < kNBw; ++j) ratio[j][0] *= inv, ratio[j][1] *= inv;
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) corr[mt][0] *= change, corr[mt][1] *= change;
        v_ref = new_ref;
      }
      // Once the row maxima (and the V reference) settle, corr is 1 for the whole warp: skip.
      bool rescale = false;
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) rescale |= corr[mt][0] != 1.f || corr[mt][1] != 1.f;
      if (__any_sync(0xffffffffu, rescale))
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
          for (int n = 0; n < 2 * kChunks; ++n) {
            oacc[mt][n][0] *= corr[mt][0]; oacc[mt][n][1] *= corr[mt][0];
            oacc[mt][n][2] *= corr[mt][1]; oacc[mt][n][3] *= corr[mt][1];
          }
      // ---- O += P V: k = 16 tokens per step, n = the even and odd dims of each chunk ----
#pragma unroll
      for (int jt = 0; jt < kKTw; ++jt) {
        const int kt = wk * kKTw + jt;
        uint32_t a[kMT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          const float* lo = s[mt][2 * jt];
          const float* hi = s[mt][2 * jt + 1];
          a[mt][0] = pack2<f16>(lo[0] * ratio[2 * jt][0], lo[1] * ratio[2 * jt][1]);
          a[mt][1] = pack2<f16>(lo[2] * ratio[2 * jt][0], lo[3] * ratio[2 * jt][1]);
          a[mt][2] = pack2<f16>(hi[0] * ratio[2 * jt + 1][0], hi[1] * ratio[2 * jt + 1][1]);
          a[mt][3] = pack2<f16>(hi[2] * ratio[2 * jt + 1][0], hi[3] * ratio[2 * jt + 1][1]);
        }
#pragma unroll
        for (int dp = 0; dp < kChunks / 2; ++dp) {
          uint32_t r[4];
          ldmatrix_x4_trans(r, st_addr + T::kV +
                                   T::offset(16 * kt + 8 * ((lane >> 3) & 1) + (lane & 7),
                                             2 * dp + (lane >> 4)));
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint32_t u0 = r[2 * h] ^ 0x80808080u, u1 = r[2 * h + 1] ^ 0x80808080u;
            const uint32_t e0 = int8_pair<0x4240u>(u0), e1 = int8_pair<0x4240u>(u1);
            const uint32_t o0 = int8_pair<0x4341u>(u0), o1 = int8_pair<0x4341u>(u1);
            const int n = 2 * (2 * dp + h);
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt)
              if (!PAGED || mt < blocks) {
                mma_16x8x16(oacc[mt][n], a[mt], e0, e1);
                mma_16x8x16(oacc[mt][n + 1], a[mt], o0, o1);
              }
          }
        }
      }
    }
    stage = stage + 1 == kMultiStages ? 0 : stage + 1;
  };
  // Tree masks are for draft chunks: the split-warp variants only (MultiPlan.plan(tree=True)
  // picks them); the whole-tile variants keep one loop (a second copy spilled them).
  int t0 = start;
#pragma unroll 1
  for (; t0 < end && (KSPLIT == 1 || p.tree_mask == nullptr || t0 + T::kRows <= sr.prefix);
       t0 += T::kRows)
    tile_step(TreeTag<false>{}, t0);
  if constexpr (KSPLIT > 1) {
#pragma unroll 1
    for (; t0 < end; t0 += T::kRows) tile_step(TreeTag<true>{}, t0);
  }
  cp_async_wait<0>();
  allow_next_grid();  // the next kernel's launch overlaps the merges below
  if constexpr (PAGED)
    if (loader.bad) atomicOr(p.error_flags, kErrorBadPage);

  float total[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) total[mt][hr] = warp_sum_xor(l[mt][hr], 2);
  // ---- KSPLIT: the warps of a row group merge: each stores its accumulators (scaled by its
  // V reference) and its max and sum per row in shared memory; the group's first warp (wk 0)
  // weighs them per row and reads the weighted sums back as it stores its rows, so no warp
  // holds two sets of accumulators at once ----
  float4* const o_shared = reinterpret_cast<float4*>(smem);  // [warp][mt][2 kChunks][32]
  float weight[kMT][2][KSPLIT];
  if constexpr (KSPLIT > 1) {
    __syncthreads();  // every warp is out of the loop: the pipeline's memory is free
    float* const ml = reinterpret_cast<float*>(o_shared + 4 * kMT * 2 * kChunks * 32);
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int n = 0; n < 2 * kChunks; ++n)
        o_shared[((warp * kMT + mt) * 2 * kChunks + n) * 32 + lane] =
            make_float4(oacc[mt][n][0] * v_ref, oacc[mt][n][1] * v_ref,
                        oacc[mt][n][2] * v_ref, oacc[mt][n][3] * v_ref);
    if (c == 0)  // [warp][m, l][kWarpRows]
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          ml[(warp * 2) * kWarpRows + 16 * mt + 8 * hr + g] = m[mt][hr];
          ml[(warp * 2 + 1) * kWarpRows + 16 * mt + 8 * hr + g] = total[mt][hr];
        }
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int row = 16 * mt + 8 * hr + g;
        float best = kNegInf;
#pragma unroll
        for (int j = 0; j < KSPLIT; ++j)
          best = fmaxf(best, ml[((wr + j * kGroups) * 2) * kWarpRows + row]);
        const float use = best == kNegInf ? 0.f : best;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < KSPLIT; ++j) {
          const int w = wr + j * kGroups;
          weight[mt][hr][j] = fast_exp2(ml[(w * 2) * kWarpRows + row] - use);
          sum += weight[mt][hr][j] * ml[(w * 2 + 1) * kWarpRows + row];
        }
        m[mt][hr] = best;
        total[mt][hr] = sum;
      }
    v_ref = 1.f;
  }
  // The merged accumulators n, n + 1 of m-block mt, row half hr (components 2 hr, 2 hr + 1).
  auto merged = [&](int mt, int hr, int n) __attribute__((always_inline)) {
    if constexpr (KSPLIT > 1) {
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);  // (n: 2hr, 2hr+1, n+1: 2hr, 2hr+1)
#pragma unroll
      for (int j = 0; j < KSPLIT; ++j) {
        const float4* src = o_shared + (((wr + j * kGroups) * kMT + mt) * 2 * kChunks + n) * 32 + lane;
        const float4 a = src[0], b = src[32];
        const float w = weight[mt][hr][j];
        acc.x += w * (hr ? a.z : a.x); acc.y += w * (hr ? a.w : a.y);
        acc.z += w * (hr ? b.z : b.x); acc.w += w * (hr ? b.w : b.y);
      }
      return acc;
    } else {
      return make_float4(oacc[mt][n][2 * hr], oacc[mt][n][2 * hr + 1], oacc[mt][n + 1][2 * hr],
                         oacc[mt][n + 1][2 * hr + 1]);
    }
  };

  // ---- this split's rows: normalised, with their base-2 LSE ----
  const int64_t slot = (static_cast<int64_t>(b) * p.num_kv_heads + kvh) * p.max_tiles + tile;
  const int64_t part = slot * p.num_splits + split;
  if (warp_active && wk == 0)
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int r = w_row0 + 16 * mt + 8 * hr + g, local = r - row0;
        if (r >= sr.rows) continue;
        const float sum = total[mt][hr];
        const float lse2 = sum > 0.f ? m[mt][hr] + __log2f(sum) : kNegInf;
        const float f = sum > 0.f ? v_const * v_ref / sum : 0.f;
        if (active == 1) {
          const int token = r / p.group_size, head = kvh * p.group_size + r - token * p.group_size;
          const int64_t q_row = sr.q0 + token;
          const int64_t at = q_row * p.out_token_stride + head * p.out_head_stride;
#pragma unroll
          for (int sc = 0; sc < kChunks; ++sc) {  // dims 16 sc + 4c + (0, 1, 2, 3)
            const float4 v = merged(mt, hr, 2 * sc);
            store4<QT>(p.out, at + 16 * sc + 4 * c, v.x * f, v.z * f, v.y * f, v.w * f);
          }
          if (p.lse != nullptr && c == 0)
            p.lse[q_row * p.num_kv_heads * p.group_size + head] = lse2 * kMultiLn2;
        } else {
          float* dst = p.partial_out + (part * kCtaRows + local) * HEAD_DIM;
#pragma unroll
          for (int sc = 0; sc < kChunks; ++sc) {
            const float4 v = merged(mt, hr, 2 * sc);
            *reinterpret_cast<float4*>(dst + 16 * sc + 4 * c) =
                make_float4(v.x * f, v.z * f, v.y * f, v.w * f);
          }
          if (c == 0) p.partial_lse[part * kCtaRows + local] = lse2;
        }
      }
  if (active == 1 || p.combine) return;  // one split, or multi_combine merges

  merge_if_last<HEAD_DIM, kCtaRows, QT>(p, sr, kvh, row0, tile_rows, slot, active,
                                  reinterpret_cast<float*>(smem), is_last);
}

}  // namespace llfd
