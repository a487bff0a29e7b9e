// Multi-token attention over the INT8 cache on Hopper's warpgroup MMA (wgmma, sm_90a): the
// kernel for prefill and long chunks at head_dim 64 and 128, more than 64 query rows per KV
// head (multi_wg64.cu takes 33-64, multi.cu the rest).
//
// A CTA is two warpgroups, 64 packed query rows each (the mma's M; rows token-major as in
// multi.cu), over one KV head. K/V tiles of 64 tokens stream through the same cp.async stages
// as multi.cu (multi_tiles.cuh). Each tile is widened once per CTA, by all its threads, into
// fp16 copies in the 128-byte-swizzled layout wgmma reads (wgmma.cuh); then per warpgroup:
//  * S = Q K^T: Q (fp16, staged once in the same layout) and K from shared memory;
//  * scales, masks and the online softmax in registers, as multi.cu (per-token K scales on the
//    score columns, per-token V scales folded into P relative to the largest seen);
//  * O += P V: P from registers (the accumulator layout is the A fragment's), V from shared
//    memory as a transposed (MN-major) operand.
// Pipelined per tile j (one barrier per tile): the lead warpgroup issues S(j + 1) and P(j) V(j)
// right after the barrier, then widens its share of tile j + 2 and runs the softmax of
// S(j + 1) while P(j) V(j) runs; the lag warpgroup widens first, then runs the softmax of S(j)
// (issued in the previous iteration) and issues P(j) V(j) and S(j + 1) half a tile later, so the
// two warpgroups' products take turns on the tensor cores. Widened copies: j + 2 written while
// j + 1 and j are read (the lag's S(j + 1) runs across the next barrier, its P V does not);
// WgLayout keeps four, as measured (three suffice for this order).
// Splits, their partials and the merge are multi.cu's (the same workspace and counters).
#include "multi_wg_rows.cuh"

namespace llfd {

template <int HEAD_DIM, int SCALE_MODE, typename QT, typename ScaleT, bool PAGED>
__global__ void __launch_bounds__(WgLayout<HEAD_DIM>::kThreads, 1)
    multi_attend_wg(const __grid_constant__ MultiParams p) {
  using L = WgLayout<HEAD_DIM>;
  constexpr int kChunks = HEAD_DIM / 16, kNB = L::kTokens / 8, kKT = L::kTokens / 16;
  constexpr int kStages = L::kStages;
  constexpr int kOut = HEAD_DIM / 2;  // accumulators per thread: 64 rows x HEAD_DIM / 128
  constexpr bool kTokenScales = SCALE_MODE == kScalePerToken;
  extern __shared__ __align__(128) char smem_raw[];
  __shared__ int is_last;
  // Swizzled operands need 1024-byte-aligned atoms: the plan adds 1 KB of slack.
  char* const smem = smem_raw + ((1024u - (shared_address(smem_raw) & 1023u)) & 1023u);
  const uint32_t base = shared_address(smem);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int wg = __shfl_sync(0xffffffffu, warp / 4, 0);  // warp-uniform to the compiler:
                                                        // wgmma under no divergent branch

  const CtaWork<L::kCtaRows, L::kTokens> work(p);
  if (work.idle) return;
  const SequenceRows& sr = work.sr;
  const int kvh = work.kvh, tile = work.tile, split = work.split, b = work.b;
  const int row0 = work.row0, tile_rows = work.tile_rows, active = work.active;
  const int start = work.start, end = work.end;
  const int tiles = work.tiles();

  // This warpgroup's rows; this lane's rows r_lo and r_lo + 8 (the accumulator layout). The
  // warpgroup computes tiles before wg_limit; tiles before wg_full need no mask.
  const int wg_row0 = row0 + 64 * wg;
  const bool wg_active = wg_row0 < sr.rows;
  const int wg_limit = wg_active ? min(end, sr.limit(p, min(wg_row0 + 63, sr.rows - 1))) : 0;
  const int wg_full = wg_active && wg_row0 + 63 < sr.rows ? min(end, sr.limit(p, wg_row0)) : 0;
  const int r_lo = wg_row0 + 16 * (warp % 4) + g;
  int visible[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = r_lo + 8 * hr;
    visible[hr] = r < sr.rows ? min(end, sr.limit(p, r)) : 0;
  }

  TileLoader<HEAD_DIM, L::kTokens, kTokenScales, ScaleT, PAGED, L::kThreads, !PAGED> loader(
      b, kvh);
  loader.prime<kStages>(p, base, L::kStageBytes, start, end);

  uint32_t qa[kChunks][4];
  float row_const[2], v_const;
  wg_load_query<HEAD_DIM, SCALE_MODE, QT>(qa, row_const, v_const, p, sr, kvh, r_lo, warp % 4,
                                          lane, smem + L::kQ16 + wg * L::kBlocks * L::kBlockBytes);
  auto copy_offset = [&](int j) __attribute__((always_inline)) {  // tile j's widened copy
    return L::kCopy0 + j % L::kCopies * L::kCopyBytes;
  };

  // Tile jw's int8 rows have landed: publish them (and the copies widened before this
  // barrier), then refill the stage of tile jw - 1 with tile jw + 2.
  auto sync_step = [&](int jw) __attribute__((always_inline)) {
    const int st = jw % kStages;
    cp_async_wait<kStages - 2>();
    loader.widen(smem + st * L::kStageBytes, st);
    // The warpgroups reach this barrier from their own loops (lead and lag): the unaligned
    // form, which allows that (__syncthreads is barrier.sync.aligned: one call site for all).
    asm volatile("barrier.sync 0, %0;" ::"n"(L::kThreads) : "memory");
    const int t_issue = start + (jw + kStages - 1) * L::kTokens;
    const int issue_stage = (jw + kStages - 1) % kStages;
    if (t_issue < end) {
      loader.issue(p, base + issue_stage * L::kStageBytes, issue_stage, t_issue, end);
      loader.fetch(p, t_issue + L::kTokens, end);
    }
    cp_async_commit();
  };
  auto widen_work = [&](int jw) __attribute__((always_inline)) {
    if (jw < tiles) {
      widen_tile<HEAD_DIM, L::kCtaRows, kTokenScales>(smem + (jw % kStages) * L::kStageBytes,
                                                     smem + copy_offset(jw));
      fence_proxy_async();
    }
  };

  float o[kOut];
#pragma unroll
  for (int i = 0; i < kOut; ++i) o[i] = 0.f;
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.f, 0.f};
  float v_ref = kTokenScales ? 0.f : 1.f;
  float s[4 * kNB];
  uint32_t a[kKT][4], a_next[kKT][4];
  float corr[2] = {1.f, 1.f};
  auto softmax = [&](int j, uint32_t (&p_out)[kKT][4]) __attribute__((always_inline)) {
    const int col0 = start + j * L::kTokens;
    // Masked where some row of the warpgroup stops inside the tile.
    softmax_tile<HEAD_DIM, kTokenScales>(s, p_out, m, l, v_ref, corr, row_const,
                                         smem + copy_offset(j), col0 + L::kTokens > wg_full,
                                         col0, visible, c);
  };
  auto computes = [&](int j) __attribute__((always_inline)) {
    return j < tiles && start + j * L::kTokens < wg_limit;  // uniform over the warpgroup
  };
  auto copy_address = [&](int j) __attribute__((always_inline)) {
    return base + copy_offset(j);
  };

  // Tiles 0 and 1 widened, tile 0's scores and P; then per tile j: S(j + 1) and O += P(j) V(j)
  // on the tensor cores while the CTA widens tile j + 2 and the warpgroup's softmax of S(j + 1)
  // follows (its P in a second set of registers: P(j)'s are the operand in flight).
  sync_step(0);
  widen_work(0);
  sync_step(1);  // publishes tile 0's copy
  widen_work(1);
  if (wg == 0) {  // the lead: S(j + 1) and P(j) V(j) issued right after the barrier
    if (computes(0)) {
      wgmma_fence();
      issue_scores<HEAD_DIM>(s, qa, copy_address(0));
      wgmma_wait<0>();
      fence_operands(s);
      softmax(0, a);
    }
    // One tile; P(j) in `cur`, the softmax of S(j + 1) writes `nxt` (P(j)'s registers are the
    // operand in flight). The loop alternates the two sets (a copy between them made ptxas
    // serialize every wgmma).
    auto tile_step = [&](int j, uint32_t (&cur)[kKT][4], uint32_t (&nxt)[kKT][4])
        __attribute__((always_inline)) {
      sync_step(j + 2);  // publishes tile j + 1's copy; tile j - 1's is free
      // Issue and waits stay in one branch per warpgroup (a wgmma group that crosses a branch
      // ptxas cannot pair serializes every wgmma); S(j + 1) of a tile past the warpgroup's
      // rows or the range is computed and dropped (its P is zero).
      if (computes(j)) {
        rescale_rows(o, corr);
        wgmma_fence();
        issue_scores<HEAD_DIM>(s, qa, copy_address(j + 1));
        issue_values<HEAD_DIM>(o, cur, copy_address(j));
        widen_work(j + 2);
        wgmma_wait<1>();
        fence_operands(s);
        if (computes(j + 1)) {
          softmax(j + 1, nxt);
        } else {
  #pragma unroll
          for (int kt = 0; kt < kKT; ++kt) nxt[kt][0] = nxt[kt][1] = nxt[kt][2] = nxt[kt][3] = 0u;
          corr[0] = corr[1] = 1.f;
        }
        wgmma_wait<0>();
        fence_operands(o);
      } else {
        widen_work(j + 2);
      }
    };
  #pragma unroll 1
    for (int j = 0; j < tiles; j += 2) {
      tile_step(j, a, a_next);
      if (j + 1 < tiles) tile_step(j + 1, a_next, a);
    }
  } else {
    // The lag runs half a tile behind: softmax(j) first, then P(j) V(j) and S(j + 1) issued,
    // running while the lead's softmax and the next barrier pass; so the two warpgroups'
    // products alternate on the tensor cores instead of arriving together. One P register
    // set: the wait at the top retires P(j - 1) V(j - 1) before softmax(j) writes P(j).
    wgmma_fence();
    issue_scores<HEAD_DIM>(s, qa, copy_address(0));
#pragma unroll 1
    for (int j = 0; j < tiles; ++j) {
      sync_step(j + 2);
      widen_work(j + 2);
      wgmma_wait<0>();
      fence_operands(s);
      if (computes(j)) {
        softmax(j, a);
      } else {
#pragma unroll
        for (int kt = 0; kt < kKT; ++kt) a[kt][0] = a[kt][1] = a[kt][2] = a[kt][3] = 0u;
        corr[0] = corr[1] = 1.f;
      }
      rescale_rows(o, corr);
      wgmma_fence();
      issue_values<HEAD_DIM>(o, a, copy_address(j));
      issue_scores<HEAD_DIM>(s, qa, copy_address(j + 1));  // past the range: dropped
      // P V retires inside the iteration (an A-register wgmma waited across the loop's back
      // edge made ptxas serialize every wgmma); S(j + 1) runs on into the next one.
      wgmma_wait<1>();
      fence_operands(o);
    }
    wgmma_wait<0>();
  }
  cp_async_wait<0>();
  if constexpr (PAGED)
    if (loader.bad) atomicOr(p.error_flags, kErrorBadPage);

  // ---- this split's rows: normalised, with their base-2 LSE ----
  const int64_t slot = (static_cast<int64_t>(b) * p.num_kv_heads + kvh) * p.max_tiles + tile;
  const int64_t part = slot * p.num_splits + split;
  if (wg_active)
    wg_store_rows<HEAD_DIM, L::kCtaRows, QT>(p, sr, o, m, l, v_const * v_ref, kvh, row0, r_lo, c,
                                            part, active);
  if (active == 1) return;

  merge_if_last<HEAD_DIM, L::kCtaRows, QT>(p, sr, kvh, row0, tile_rows, slot, active,
                                  reinterpret_cast<float*>(smem), is_last);
}

}  // namespace llfd
