// Multi-query decode rows on Hopper's warpgroup MMA with the KV tokens as the MMA's M (sm_90a,
// head_dim 128, up to 64 query heads per KV head; MultiPlan's decode rows, planner.
// choose_token_major). The warpgroup kernels (multi_wg.cu) put the query rows on M and read K
// and V as B operands, which wgmma takes only from shared memory in fp16, so a loading
// warpgroup widened every int8 tile into an fp16 copy first; that widening set their pace
// (PERF_NOTES m18). Here the int8 tiles are read straight into registers as A fragments
// (multi_tm_tiles.cuh) and only P^T passes through shared memory.
//
// A CTA is two warpgroups ("teams") over one (sequence, KV head, split). Team w takes the
// split's tiles w, w + 2, ...: its own cp.async stages (issued by its own threads), its own
// online softmax, its own O^T; the two merge at the end. Per tile a team:
//   reads K into A fragments, S^T = K Q^T (Q's 64 heads from shared memory);
//   the online softmax per head (a column of S^T, spread over the team's four warps): each
//   thread checks its scores against the running maximum + kLazyMax and its V scales against
//   the largest seen; P^T is written at the current maximum and one barrier (bar.red.or)
//   both publishes it and tells whether any thread saw a larger value. Only then (a team's
//   first tile, rare growth) are the columns' maxima reduced through shared memory, O^T
//   rescaled and P^T written again;
//   reads V into A fragments, O^T += V^T P^T (issued, waited for in the next tile).
#include "multi_tm_tiles.cuh"

namespace llfd {

template <int HEAD_DIM, int SCALE_MODE, typename QT, typename ScaleT, bool PAGED>
__global__ void __launch_bounds__(TmLayout<HEAD_DIM>::kThreads, 1)
    multi_attend_tm(const __grid_constant__ MultiParams p) {
  using L = TmLayout<HEAD_DIM>;
  using Stage = typename L::Stage;
  constexpr bool kTokenScales = SCALE_MODE == kScalePerToken;
  constexpr int kStages = L::kStages, kTokens = L::kTokens;
  extern __shared__ __align__(128) char smem_raw[];
  char* const smem = swizzle_aligned(smem_raw);
  const uint32_t base = shared_address(smem);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int team = __shfl_sync(0xffffffffu, warp / 4, 0);  // warp-uniform: wgmma's branches
  const int w = warp % 4;

  const CtaWork<L::kHeads, kTokens> work(p);
  if (work.idle) {
    work.template retire<HEAD_DIM>(p);
    return;
  }
  const SequenceRows& sr = work.sr;
  const int kvh = work.kvh, b = work.b, start = work.start, end = work.end;
  const int tiles = work.tiles();
  const int my_tiles = tiles > team ? (tiles - team + 1) / 2 : 0;
  auto tile_token = [&](int j) __attribute__((always_inline)) {
    return start + (2 * j + team) * kTokens;
  };
  const uint32_t stages = base + L::kStage0 + team * kStages * L::kStageBytes;
  char* const stage_ptr = smem + L::kStage0 + team * kStages * L::kStageBytes;

  // ---- the first tiles (before the wait where they lie before the chunk), then Q ----
  TileLoader<HEAD_DIM, kTokens, kTokenScales, ScaleT, PAGED, L::kTeamThreads, false, true>
      loader(b, kvh);
  const bool prime_early =
      work.early && min(end, start + (2 * kStages - 1) * kTokens) <= sr.prefix;
  if (work.early && !prime_early) work.wait_then_flag(p);
  loader.fetch(p, tile_token(0), end);
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    const int t = tile_token(st);
    if (t < end) {
      loader.issue(p, stages + st * L::kStageBytes, st, t, end);
      loader.fetch(p, tile_token(st + 1), end);
    }
    cp_async_commit();
  }
  if (prime_early) work.wait_then_flag(p);

  float v_const = 1.f;
  {
    float k_const = p.score_scale_log2;
    if constexpr (!kTokenScales) {
      k_const *= given_scale<SCALE_MODE>(p.k_scale, kvh);
      v_const = given_scale<SCALE_MODE>(p.v_scale, kvh);
    }
    if (team == 0) {  // the 64 heads: rows 16 w + g, + 8 of each warp
      uint32_t qf[HEAD_DIM / 16][4];
      float row_scale[2];
      const int r_lo = 16 * w + g;
      load_rows<HEAD_DIM, QT>(qf, row_scale, p, sr, kvh, r_lo, c);
      // Positive column scales (the softmax scales after the maximum): a negative sm_scale or
      // K scale flips q's sign instead, a zero one acts as the smallest normal one.
      const uint32_t flip = k_const < 0.f ? 0x80008000u : 0u;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int s = 0; s < HEAD_DIM / 16; ++s)
          store_query_chunk<HEAD_DIM>(smem + L::kQ, r_lo + 8 * h, s, c, qf[s][h] ^ flip,
                                      qf[s][2 + h] ^ flip);
        if (c == 0)
          reinterpret_cast<float*>(smem + L::kRowConst)[r_lo + 8 * h] =
              fmaxf(row_scale[h] * fabsf(k_const), 1.17549435e-38f);
      }
      fence_proxy_async();
    }
  }
  __syncthreads();
  // This thread's 16 heads (columns 8 j + 2c + e, index 2 j + e) and their score scales.
  float rc[16];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float2 v = reinterpret_cast<const float2*>(smem + L::kRowConst)[4 * j + c];
    rc[2 * j] = v.x;
    rc[2 * j + 1] = v.y;
  }

  float o[2][32], s[32], m[16], l[16];
#pragma unroll
  for (int i = 0; i < 32; ++i) o[0][i] = o[1][i] = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) m[i] = kNegInf, l[i] = 0.f;
  VRef vr;
  uint32_t kf[8][4], vf[2][4][4], pp[16];
  float* const red = reinterpret_cast<float*>(smem + L::kRed) + team * 4 * L::kHeads;
  float* const red_v = reinterpret_cast<float*>(smem + L::kRedV) + team * 4;
  const int t_lo = 16 * w + g;  // this thread's tokens t_lo, t_lo + 8 of each tile
  // P^T of this team's tile: one buffer (O^T += V^T P^T of a tile has completed before the
  // next tile's P^T is written: the scores' wait covers it).
  const uint32_t buffer = base + L::kP + team * L::kPBytes;

#pragma unroll 1
  for (int j = 0; j < my_tiles; ++j) {
    const int st = j % kStages;
    char* const stage = stage_ptr + st * L::kStageBytes;
    cp_async_wait<kStages - 2>();
    loader.widen(stage, st);
    team_sync(team);  // tile j visible to the team; tile j - 1's stage free
    {
      const int next = j + kStages - 1, t = tile_token(next);
      if (t < end) {
        loader.issue(p, stages + (next % kStages) * L::kStageBytes, next % kStages, t, end);
        loader.fetch(p, tile_token(next + 1), end);
      }
      cp_async_commit();
    }
    load_key_fragments<HEAD_DIM>(kf, stage, t_lo, c);
    fence_operands(kf);
    wgmma_fence();
    issue_scores<HEAD_DIM>(s, kf, base + L::kQ);  // S^T = K Q^T
    const int t0 = tile_token(j);
    const bool in[2] = {t0 + t_lo < end, t0 + t_lo + 8 < end};
    float ks[2] = {1.f, 1.f}, vs[2] = {1.f, 1.f};
    if constexpr (kTokenScales) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        ks[h] = reinterpret_cast<const float*>(stage + Stage::kKScale)[t_lo + 8 * h];
        vs[h] = reinterpret_cast<const float*>(stage + Stage::kVScale)[t_lo + 8 * h];
      }
    }
    wgmma_wait<0>();
    fence_operands(s);
    fence_operands(o[0]);
    fence_operands(o[1]);

    // Scores: per-token K scales on the rows, rows past the range out. A thread's scores stay
    // unscaled by rc (rc > 0 keeps the maxima's positions) until the exponent.
    float top_mine = 0.f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        float& x = s[4 * (i >> 1) + 2 * h + (i & 1)];
        x = in[h] ? (kTokenScales ? x * ks[h] : x) : kNegInf;
      }
      if (in[h]) top_mine = fmaxf(top_mine, vs[h]);
    }
    auto column_max = [&](int i) __attribute__((always_inline)) {  // over this thread's rows
      return fmaxf(s[4 * (i >> 1) + (i & 1)], s[4 * (i >> 1) + 2 + (i & 1)]);
    };
    bool grows = kTokenScales && top_mine > vr.top;
#pragma unroll
    for (int i = 0; i < 16; ++i) grows |= column_max(i) * rc[i] > m[i] + kLazyMax;
    // P^T at the current maxima: P / top = 2^(s rc - m - shift) (VRef), times the token's V
    // scale (<= top) into fp16; l gathers P / top.
    float tile_l[16];
    auto probabilities = [&]() __attribute__((always_inline)) {
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {
        float e[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int i = 2 * jj + (k & 1);
          const float offset = (m[i] == kNegInf ? 0.f : m[i]) + vr.shift;
          e[k] = fast_exp2(fmaf(s[4 * jj + k], rc[i], -offset));
        }
        tile_l[2 * jj] = e[0] + e[2];
        tile_l[2 * jj + 1] = e[1] + e[3];
        pp[2 * jj] = pack2<f16>(e[0] * vs[0], e[1] * vs[0]);
        pp[2 * jj + 1] = pack2<f16>(e[2] * vs[1], e[3] * vs[1]);
      }
      store_probabilities(buffer, pp, w, lane);
      fence_proxy_async();
    };
    probabilities();
    if (team_sync_any(team, grows)) {
      // Rare (a team's first tile, a maximum grown by more than kLazyMax, a larger V scale):
      // the columns' maxima and the tile's largest V scale over the team, then O^T and l
      // rescaled and P^T written again.
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {  // every lane shuffles; the first row's lanes store
        const float2 mx = make_float2(warp_max_xor_from(column_max(2 * jj), 4, 16),
                                      warp_max_xor_from(column_max(2 * jj + 1), 4, 16));
        if (g == 0) reinterpret_cast<float2*>(red + w * L::kHeads)[4 * jj + c] = mx;
      }
      const float top_warp = warp_max_xor(top_mine, 16);
      if (lane == 0) red_v[w] = top_warp;
      team_sync(team);
      const float shift_before = vr.shift;
      if constexpr (kTokenScales) {
        const float top =
            fmaxf(vr.top, fmaxf(fmaxf(red_v[0], red_v[1]), fmaxf(red_v[2], red_v[3])));
        if (top != vr.top) {  // uniform over the team
          vr.top = top;
          vr.shift = __log2f(top);
        }
      }
      float corr[16];
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {
        float2 mx = reinterpret_cast<const float2*>(red)[4 * jj + c];
#pragma unroll
        for (int ww = 1; ww < 4; ++ww) {
          const float2 v = reinterpret_cast<const float2*>(red + ww * L::kHeads)[4 * jj + c];
          mx = make_float2(fmaxf(mx.x, v.x), fmaxf(mx.y, v.y));
        }
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int i = 2 * jj + e;
          const float tile_max = (e ? mx.y : mx.x) * rc[i];
          const float m_new = tile_max > m[i] + kLazyMax ? tile_max : m[i];
          // 0 while the column saw nothing (m = -inf)
          corr[i] = fast_exp2(m[i] + shift_before - ((m_new == kNegInf ? 0.f : m_new) + vr.shift));
          m[i] = m_new;
          l[i] *= corr[i];
        }
      }
#pragma unroll
      for (int b2 = 0; b2 < 2; ++b2)
#pragma unroll
        for (int k = 0; k < 32; ++k) o[b2][k] *= corr[2 * (k >> 2) + (k & 1)];
      probabilities();
      team_sync(team);
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) l[i] += tile_l[i];
    load_value_fragments<HEAD_DIM>(vf, stage, w, g, c);
    fence_operands(vf[0]);
    fence_operands(vf[1]);
    fence_operands(o[0]);
    fence_operands(o[1]);
    wgmma_fence();
    issue_values_tm(o, vf, buffer);
    // Waited for here: K fragments defined while these products run made ptxas serialize
    // every wgmma (C7513). The other team's tile overlaps this one's chain.
    wgmma_wait<0>();
  }
  fence_operands(o[0]);
  fence_operands(o[1]);
  cp_async_wait<0>();
  allow_next_grid();  // the next kernel's launch overlaps the merge and the stores below
  if constexpr (PAGED)
    if (loader.bad) atomicOr(p.error_flags, kErrorBadPage);

  // ---- the teams' merge: team 1's state through the stages, team 0 finishes ----
#pragma unroll
  for (int i = 0; i < 16; ++i) l[i] = warp_sum_xor_from(l[i], 4, 16);
  float* const lsum = reinterpret_cast<float*>(smem + L::kMergeL);  // [team][warp][head]
  if (g == 0)
#pragma unroll
    for (int jj = 0; jj < 8; ++jj)
      reinterpret_cast<float2*>(lsum + (team * 4 + w) * L::kHeads)[4 * jj + c] =
          make_float2(l[2 * jj], l[2 * jj + 1]);
  float* const merge_m = reinterpret_cast<float*>(smem + L::kMergeM);
  float* const merge_o = reinterpret_cast<float*>(smem + L::kMergeO);  // [element][thread]
  const int tid = threadIdx.x % L::kTeamThreads;
  if (team == 1) {
#pragma unroll
    for (int k = 0; k < 32; ++k) {
      merge_o[k * L::kTeamThreads + tid] = o[0][k];
      merge_o[(32 + k) * L::kTeamThreads + tid] = o[1][k];
    }
    if (w == 0 && g == 0)
#pragma unroll
      for (int jj = 0; jj < 8; ++jj)
        reinterpret_cast<float2*>(merge_m)[4 * jj + c] =
            make_float2(m[2 * jj] + vr.shift, m[2 * jj + 1] + vr.shift);
  }
  __syncthreads();
  if (team == 1) return;

  // Each head's two teams weighted by 2^(their offset - the larger), normalised; the output
  // (one split) or the split's partial row for multi_combine (its layout: 64 rows per tile).
  const int64_t slot =
      (static_cast<int64_t>(b) * p.num_kv_heads + kvh) * p.max_tiles + work.tile;
  const int64_t part = slot * p.num_splits + work.split;
  const int d0 = 4 * (8 * w + g);  // dims d0 + r: block r / 2, row half r % 2
#pragma unroll
  for (int jj = 0; jj < 8; ++jj) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int i = 2 * jj + e, head_local = 8 * jj + 2 * c + e;
      if (head_local >= sr.rows) continue;
      const float m0 = m[i] + vr.shift, m1 = merge_m[head_local];
      const float both = fmaxf(m0, m1);
      const float f0 = m0 == kNegInf ? 0.f : fast_exp2(m0 - both);
      const float f1 = m1 == kNegInf ? 0.f : fast_exp2(m1 - both);
      float l0 = 0.f, l1 = 0.f;
#pragma unroll
      for (int ww = 0; ww < 4; ++ww) {
        l0 += lsum[ww * L::kHeads + head_local];
        l1 += lsum[(4 + ww) * L::kHeads + head_local];
      }
      const float sum = f0 * l0 + f1 * l1;
      const float lse2 = sum > 0.f ? both + __log2f(sum) : kNegInf;
      const float f = sum > 0.f ? v_const / sum : 0.f;
      float v[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int k = 4 * jj + 2 * (r & 1) + e;
        const float theirs = merge_o[(32 * (r >> 1) + k) * L::kTeamThreads + tid];
        v[r] = (f0 * o[r >> 1][k] + f1 * theirs) * f;
      }
      if (work.active == 1) {
        const int head = kvh * p.group_size + head_local;
        const int64_t q_row = sr.q0;
        uint16_t* row = static_cast<uint16_t*>(p.out) + q_row * p.out_token_stride +
                        head * p.out_head_stride;
        *reinterpret_cast<uint2*>(row + d0) =
            make_uint2(pack2<QT>(v[0], v[1]), pack2<QT>(v[2], v[3]));
        if (p.lse != nullptr && w == 0 && g == 0)
          p.lse[q_row * p.num_kv_heads * p.group_size + head] = lse2 * kMultiLn2;
      } else {
        *reinterpret_cast<float4*>(p.partial_out + (part * L::kHeads + head_local) * HEAD_DIM +
                                   d0) = make_float4(v[0], v[1], v[2], v[3]);
        if (w == 0 && g == 0) p.partial_lse[part * L::kHeads + head_local] = lse2;
      }
    }
  }
}

}  // namespace llfd
