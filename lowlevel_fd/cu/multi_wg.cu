// Multi-token attention over the INT8 cache on Hopper's warpgroup MMA (wgmma, sm_90a): the
// kernel for prefill, long chunks and more than 32 query rows per KV head at head_dim 64 and
// 128 (multi_wg64.cu takes 33-64 where the row tiles fill two of its CTAs per SM, multi.cu
// the rest; planner.choose_wg_rows).
//
// A CTA is three warpgroups over one KV head, warp-specialized (FA3's division of labour):
//  * warpgroup 0 loads: K/V tiles of 64 tokens through the same cp.async stages as multi.cu
//    (multi_tiles.cuh), each widened once into an fp16 copy in the 128-byte-swizzled layout
//    wgmma reads (wgmma.cuh); it gives most of its registers to the others (setmaxnreg);
//  * warpgroups 1 and 2 compute, 64 packed query rows each (the mma's M; rows token-major as
//    in multi.cu): S = Q K^T (Q in registers, K from the copy), scales, masks and the online
//    softmax in registers as multi.cu (per-token K scales on the score columns, per-token V
//    scales folded into P relative to the largest seen), O += P V (P from registers, V from
//    the copy as a transposed operand).
// The loader runs up to kCopies tiles ahead; named barriers hand the copies over: FULL(c, w)
// (copy c widened, for computing warpgroup w) and EMPTY(c) (both computing warpgroups done
// with copy c). Each computing warpgroup issues S(j + 1) and P(j) V(j) together and runs the
// softmax of S(j + 1) while P(j) V(j) is on the tensor cores; the two take turns to issue
// (two more named barriers: FA3's ping-pong), so one's softmax overlaps the other's products.
// Splits, their partials and the merge are multi.cu's (the same workspace and counters), or,
// launched in clusters of the splits, multi_cluster.cuh's.
#include "multi_wg_rows.cuh"

namespace llfd {

// Named barriers (0 is __syncthreads'; 1 the computing warpgroups' merge, MergeTeam).
template <int COPIES>
struct WgBarriers {
  static_assert(3 * COPIES + 5 <= 16, "16 named barriers: FULL, EMPTY and the two turns");
  static constexpr int kLoad = 2;  // the loading warpgroup alone
  __device__ static __forceinline__ int full(int copy, int wg) { return 3 + 2 * copy + wg; }
  __device__ static __forceinline__ int empty(int copy) { return 3 + 2 * COPIES + copy; }
  // The computing warpgroups' turns on the tensor cores (3 copies leave room for them).
  __device__ static __forceinline__ int turn(int wg) { return 3 + 3 * COPIES + wg; }
};
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

template <int HEAD_DIM, int SCALE_MODE, typename QT, typename ScaleT, bool PAGED>
__global__ void __launch_bounds__(WgLayout<HEAD_DIM>::kThreads, 1)
    multi_attend_wg(const __grid_constant__ MultiParams p) {
  using L = WgLayout<HEAD_DIM>;
  using B = WgBarriers<L::kCopies>;
  constexpr int kChunks = HEAD_DIM / 16, kNB = L::kTokens / 8, kKT = L::kTokens / 16;
  constexpr int kStages = L::kStages, kCopies = L::kCopies;
  constexpr int kOut = HEAD_DIM / 2;  // accumulators per thread: 64 rows x HEAD_DIM / 128
  constexpr int kCompute = L::kThreads - L::kLoadThreads;
  constexpr bool kTokenScales = SCALE_MODE == kScalePerToken;
  extern __shared__ __align__(128) char smem_raw[];
  __shared__ int is_last;
  char* const smem = swizzle_aligned(smem_raw);
  const uint32_t base = shared_address(smem);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int wg = __shfl_sync(0xffffffffu, warp / 4, 0);  // warp-uniform to the compiler:
                                                        // wgmma under no divergent branch

  // Programmatic launch and early reads as multi.cu's (CtaWork; PERF_NOTES m17, m19).
  const CtaWork<L::kCtaRows, L::kTokens> work(p);
  if (work.idle) {
    work.template retire<HEAD_DIM>(p);
    return;
  }
  const SequenceRows& sr = work.sr;
  const int kvh = work.kvh, tile = work.tile, split = work.split, b = work.b;
  const int row0 = work.row0, tile_rows = work.tile_rows, active = work.active;
  const int start = work.start, end = work.end;
  const int tiles = work.tiles();
  auto copy_offset = [&](int j) __attribute__((always_inline)) {  // tile j's widened copy
    return L::kCopy0 + j % kCopies * L::kCopyBytes;
  };

  if (wg == 0) {
    // ---- loading warpgroup: tile j landed -> tile j + kStages - 1 issued into the stage of
    // tile j - 1 -> copy slot of tile j free (tile j - kCopies retired) -> tile j widened ----
    set_max_registers<72>();
    // The stage's reads batched where the loader's 72 registers hold them (not with page ids
    // or fp16 scales' selectors: those spilled).
    constexpr bool kReadFirst = !PAGED && sizeof(ScaleT) == 4;
    TileLoader<HEAD_DIM, L::kTokens, kTokenScales, ScaleT, PAGED, L::kLoadThreads, !PAGED>
        loader(b, kvh);
    // The first tiles before the wait when they lie before the chunk, after it otherwise (the
    // flagging thread is the loader's first).
    const bool prime_early = work.template primes_early<kStages>();
    if (work.early && !prime_early) work.wait_then_flag(p);
    loader.prime<kStages>(p, base, L::kStageBytes, start, end);
    if (prime_early) work.wait_then_flag(p);
#pragma unroll 1
    for (int j = 0; j < tiles; ++j) {
      const int st = j % kStages;
      cp_async_wait<kStages - 2>();
      loader.widen(smem + st * L::kStageBytes, st);
      named_sync(B::kLoad, L::kLoadThreads);  // tile j visible; tile j - 1's stage read
      const int t_issue = start + (j + kStages - 1) * L::kTokens;
      const int issue_stage = (j + kStages - 1) % kStages;
      if (t_issue < end) {
        loader.issue(p, base + issue_stage * L::kStageBytes, issue_stage, t_issue, end);
        loader.fetch(p, t_issue + L::kTokens, end);
      }
      cp_async_commit();
      if (j >= kCopies) named_sync(B::empty(j % kCopies), L::kThreads);
      widen_tile<HEAD_DIM, L::kCtaRows, kTokenScales, kReadFirst>(smem + st * L::kStageBytes,
                                                                 smem + copy_offset(j));
      fence_proxy_async();
      named_arrive(B::full(j % kCopies, 0), L::kLoadThreads + 128);
      named_arrive(B::full(j % kCopies, 1), L::kLoadThreads + 128);
    }
    cp_async_wait<0>();
    allow_next_grid();  // with the computing warpgroups' below: as multi.cu, after the KV loop
    if constexpr (PAGED)
      if (loader.bad) atomicOr(p.error_flags, kErrorBadPage);
    return;
  }

  // ---- computing warpgroups ----
  set_max_registers<216>();
  if (work.early) wait_for_previous_grid();  // before q and any write
  const int cw = wg - 1;
  // This warpgroup's rows; this lane's rows r_lo and r_lo + 8 (the accumulator layout). The
  // warpgroup computes tiles before wg_limit; tiles before wg_full need no mask.
  const int wg_row0 = row0 + 64 * cw;
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

  uint32_t qa[kChunks][4];
  float row_const[2], v_const;
  wg_load_query<HEAD_DIM, SCALE_MODE, QT>(qa, row_const, v_const, p, sr, kvh, r_lo, warp % 4,
                                          lane, smem + L::kQ16 + cw * L::kBlocks * L::kBlockBytes);
  auto acquire = [&](int j) __attribute__((always_inline)) {  // tile j's copy is widened
    named_sync(B::full(j % kCopies, cw), L::kLoadThreads + 128);
  };
  auto release = [&](int j) __attribute__((always_inline)) {  // this warpgroup is done with it
    if (j + kCopies < tiles) named_arrive(B::empty(j % kCopies), L::kThreads);
  };
  auto copy_address = [&](int j) __attribute__((always_inline)) {
    return base + copy_offset(j);
  };

  float o[kOut];
#pragma unroll
  for (int i = 0; i < kOut; ++i) o[i] = 0.f;
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.f, 0.f};
  VRef vr;
  float s[4 * kNB];
  uint32_t a[kKT][4], a_next[kKT][4];
  float corr[2] = {1.f, 1.f};
  KScales<HEAD_DIM, kTokenScales> ks;
  auto softmax = [&](int j, uint32_t (&p_out)[kKT][4]) __attribute__((always_inline)) {
    const int col0 = start + j * L::kTokens;
    // Masked where some row of the warpgroup stops inside the tile.
    softmax_tile<HEAD_DIM, kTokenScales>(s, p_out, m, l, vr, corr, row_const, ks,
                                         smem + copy_offset(j), col0 + L::kTokens > wg_full,
                                         col0, visible, c);
  };
  auto computes = [&](int j) __attribute__((always_inline)) {
    return j < tiles && start + j * L::kTokens < wg_limit;  // uniform over the warpgroup
  };

  // Ping-pong: the warpgroups take turns to issue their products (turn(w): warpgroup w's),
  // so that one's softmax runs while the other's products do. Every warpgroup takes a turn
  // per step, computing or not; the last hand-over of warpgroup 1 is left out (nobody waits
  // for it).
  auto my_turn = [&]() __attribute__((always_inline)) {
    named_sync(B::turn(cw), 256);
  };
  auto their_turn = [&](bool last) __attribute__((always_inline)) {
    if (!(cw == 1 && last)) named_arrive(B::turn(1 - cw), 256);
  };
  if (tiles > 0) {
    if (cw == 1) their_turn(false);
    acquire(0);
    my_turn();
    if (computes(0)) {
      wgmma_fence();
      issue_scores<HEAD_DIM>(s, qa, copy_address(0));
      their_turn(false);
      ks.load(smem + copy_offset(0), c);
      wgmma_wait<0>();
      fence_operands(s);
      softmax(0, a);
    } else {
      their_turn(false);
    }
  }
  // One tile; P(j) in `cur`, the softmax of S(j + 1) writes `nxt` (P(j)'s registers are the
  // operand in flight). The loop alternates the two sets (a copy between them made ptxas
  // serialize every wgmma).
  auto tile_step = [&](int j, uint32_t (&cur)[kKT][4], uint32_t (&nxt)[kKT][4])
      __attribute__((always_inline)) {
    if (j + 1 < tiles) acquire(j + 1);
    // Issue and waits stay in one branch (a wgmma group that crosses a branch ptxas cannot
    // pair serializes every wgmma); S(j + 1) past the warpgroup's rows or the range is
    // computed from a stale copy and dropped.
    my_turn();
    if (computes(j)) {
      rescale_rows(o, corr);
      wgmma_fence();
      issue_scores<HEAD_DIM>(s, qa, copy_address(j + 1));
      issue_values<HEAD_DIM>(o, cur, copy_address(j));
      their_turn(j + 1 == tiles);
      ks.load(smem + copy_offset(j + 1), c);  // acquired, or a stale copy nobody writes
      wgmma_wait<1>();
      fence_operands(s);
      // computes() only turns false: a tile it skips is never P V's operand, so nxt and corr
      // are left as they are.
      if (computes(j + 1)) softmax(j + 1, nxt);
      wgmma_wait<0>();
      fence_operands(o);
    } else {
      their_turn(j + 1 == tiles);
    }
    release(j);
  };
#pragma unroll 1
  for (int j = 0; j < tiles; j += 2) {
    tile_step(j, a, a_next);
    if (j + 1 < tiles) tile_step(j + 1, a_next, a);
  }
  allow_next_grid();  // the next kernel's launch overlaps the stores and merges below

  // ---- this split's rows: normalised, with their base-2 LSE ----
  const int64_t slot = (static_cast<int64_t>(b) * p.num_kv_heads + kvh) * p.max_tiles + tile;
  const int64_t part = slot * p.num_splits + split;
  // A cluster's splits merge in shared memory (multi_cluster.cuh): both warpgroups' copies
  // must be read out before the partial rows overwrite them.
  const bool clustered = active > 1 && cluster_ctas() > 1;
  if (clustered) MergeTeam<kCompute>::sync();
  float* const shared = reinterpret_cast<float*>(smem);
  if (clustered) {
    if (wg_active)
      wg_store_rows<HEAD_DIM, L::kCtaRows, QT, true>(p, sr, o, m, l, vr.shift, v_const, kvh,
                                                     row0, r_lo, c, part, shared, active);
    cluster_merge<HEAD_DIM, L::kCtaRows, QT, kCompute>(p, sr, kvh, row0, tile_rows, split,
                                                       active, shared);
    return;
  }
  if (wg_active)
    wg_store_rows<HEAD_DIM, L::kCtaRows, QT>(p, sr, o, m, l, vr.shift, v_const, kvh, row0,
                                            r_lo, c, part, shared, active);
  if (active == 1 || p.combine) return;  // one split, or multi_combine merges
  merge_if_last<HEAD_DIM, L::kCtaRows, QT, kCompute>(p, sr, kvh, row0, tile_rows, slot, active,
                                                    reinterpret_cast<float*>(smem), is_last);
}

}  // namespace llfd
