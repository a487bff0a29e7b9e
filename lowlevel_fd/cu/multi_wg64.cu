// Multi-token attention on Hopper's warpgroup MMA for row tiles of at most 64 query rows per KV
// head (multi-query decode, where a group's heads are the rows; short chunks and drafts): one
// warpgroup per CTA, two CTAs per SM. multi_wg.cu's CTA of two warpgroups would leave one idle
// on such tiles, and its tiles' widening would serve half the rows it is built for.
//
// Per tile j (64 tokens, the same stages, widening, softmax and MMAs as multi_wg.cu, with two
// int8 stages and two widened copies so that two CTAs fit an SM):
//   O += P(j) V(j) issued | tile j + 1 landed (barrier) | tile j + 2's copies issued | tile
//   j + 1 widened while P V runs (barrier) | S(j + 1) issued, both waited | softmax(j + 1).
// The other CTA on the SM fills this one's waits (the warp schedulers interleave them).
// Splits, their partials and the merge are multi.cu's.
#include "multi_wg_rows.cuh"

namespace llfd {

template <int HEAD_DIM, int SCALE_MODE, typename QT, typename ScaleT, bool PAGED>
__global__ void __launch_bounds__(WgLayout<HEAD_DIM, 64>::kThreads, 2)
    multi_attend_wg64(const __grid_constant__ MultiParams p) {
  using L = WgLayout<HEAD_DIM, 64>;
  constexpr int kChunks = HEAD_DIM / 16, kNB = L::kTokens / 8, kKT = L::kTokens / 16;
  constexpr int kOut = HEAD_DIM / 2;  // accumulators per thread: 64 rows x HEAD_DIM / 128
  constexpr bool kTokenScales = SCALE_MODE == kScalePerToken;
  extern __shared__ __align__(128) char smem_raw[];
  __shared__ int is_last;
  char* const smem = swizzle_aligned(smem_raw);
  const uint32_t base = shared_address(smem);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;

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

  // This lane's rows r_lo and r_lo + 8 (the accumulator layout); tiles before `full` need no
  // mask (the first row sees them, so every later one does; rows past the sequence's are
  // zero and never stored).
  const int full = min(end, sr.limit(p, row0));
  const int r_lo = row0 + 16 * warp + g;
  int visible[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = r_lo + 8 * hr;
    visible[hr] = r < sr.rows ? min(end, sr.limit(p, r)) : 0;
  }

  TileLoader<HEAD_DIM, L::kTokens, kTokenScales, ScaleT, PAGED, L::kThreads, !PAGED> loader(
      b, kvh);
  // The first tiles before the wait when they lie before the chunk, after it otherwise.
  const bool prime_early = work.template primes_early<L::kStages>();
  if (work.early && !prime_early) work.wait_then_flag(p);
  loader.prime<L::kStages>(p, base, L::kStageBytes, start, end);
  if (prime_early) work.wait_then_flag(p);

  uint32_t qa[kChunks][4];
  float row_const[2], v_const;
  wg_load_query<HEAD_DIM, SCALE_MODE, QT>(qa, row_const, v_const, p, sr, kvh, r_lo, warp, lane,
                                          smem + L::kQ16);
  auto stage_of = [&](int j) __attribute__((always_inline)) { return j % L::kStages; };
  auto copy_offset = [&](int j) __attribute__((always_inline)) {  // tile j's widened copy
    return L::kCopy0 + j % L::kCopies * L::kCopyBytes;
  };
  auto copy_address = [&](int j) __attribute__((always_inline)) {
    return base + copy_offset(j);
  };
  // Tile j's int8 rows landed and published; the stage of tile j - 1 (widened before this
  // barrier) refilled with tile j + 1. Every warp has also retired the products that read
  // copy j's slot before (tile j - 2's, waited in the previous step).
  auto land = [&](int j) __attribute__((always_inline)) {
    cp_async_wait<0>();
    loader.widen(smem + stage_of(j) * L::kStageBytes, stage_of(j));
    __syncthreads();
    const int t = start + (j + 1) * L::kTokens;
    if (t < end) {
      loader.issue(p, base + stage_of(j + 1) * L::kStageBytes, stage_of(j + 1), t, end);
      loader.fetch(p, t + L::kTokens, end);
    }
    cp_async_commit();
  };
  // Tile j widened into its copy and published to the tensor cores.
  auto widen = [&](int j) __attribute__((always_inline)) {
    widen_tile<HEAD_DIM, L::kCtaRows, kTokenScales>(
        smem + stage_of(j) * L::kStageBytes, smem + copy_offset(j));
    fence_proxy_async();
    __syncthreads();
  };

  float o[kOut];
#pragma unroll
  for (int i = 0; i < kOut; ++i) o[i] = 0.f;
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.f, 0.f};
  VRef vr;
  float s[4 * kNB];
  uint32_t a[kKT][4];
  float corr[2] = {1.f, 1.f};
  auto softmax = [&](int j) __attribute__((always_inline)) {
    const int col0 = start + j * L::kTokens;
    // Masked where some row of the CTA stops inside the tile.
    KScales<HEAD_DIM, kTokenScales> ks;
    ks.load(smem + copy_offset(j), c);
    softmax_tile<HEAD_DIM, kTokenScales>(s, a, m, l, vr, corr, row_const, ks,
                                         smem + copy_offset(j), col0 + L::kTokens > full, col0,
                                         visible, c);
  };

  if (tiles > 0) {
    land(0);
    widen(0);  // copy 0; Q's staging in copy 1 was read by every warp before land's barrier
    wgmma_fence();
    issue_scores<HEAD_DIM>(s, qa, copy_address(0));
    wgmma_wait<0>();
    fence_operands(s);
    softmax(0);
  }
#pragma unroll 1
  for (int j = 0; j + 1 < tiles; ++j) {
    rescale_rows(o, corr);
    wgmma_fence();
    issue_values<HEAD_DIM>(o, a, copy_address(j));
    land(j + 1);
    widen(j + 1);
    wgmma_fence();
    issue_scores<HEAD_DIM>(s, qa, copy_address(j + 1));
    wgmma_wait<0>();  // P(j) V(j) and S(j + 1)
    fence_operands(o);
    fence_operands(s);
    softmax(j + 1);
  }
  if (tiles > 0) {
    rescale_rows(o, corr);
    wgmma_fence();
    issue_values<HEAD_DIM>(o, a, copy_address(tiles - 1));
    wgmma_wait<0>();
    fence_operands(o);
  }
  cp_async_wait<0>();
  allow_next_grid();  // the next kernel's launch overlaps the stores and merges below
  if constexpr (PAGED)
    if (loader.bad) atomicOr(p.error_flags, kErrorBadPage);

  const int64_t slot = (static_cast<int64_t>(b) * p.num_kv_heads + kvh) * p.max_tiles + tile;
  const int64_t part = slot * p.num_splits + split;
  const bool clustered = active > 1 && cluster_ctas() > 1;  // as multi_wg.cu
  if (clustered) __syncthreads();
  float* const shared = reinterpret_cast<float*>(smem);
  if (clustered) {
    wg_store_rows<HEAD_DIM, L::kCtaRows, QT, true>(p, sr, o, m, l, vr.shift, v_const, kvh,
                                                   row0, r_lo, c, part, shared, active);
    cluster_merge<HEAD_DIM, L::kCtaRows, QT, 0>(p, sr, kvh, row0, tile_rows, split, active,
                                                shared);
    return;
  }
  wg_store_rows<HEAD_DIM, L::kCtaRows, QT>(p, sr, o, m, l, vr.shift, v_const, kvh, row0,
                                          r_lo, c, part, shared, active);
  if (active == 1 || p.combine) return;  // one split, or multi_combine merges

  merge_if_last<HEAD_DIM, L::kCtaRows, QT>(p, sr, kvh, row0, tile_rows, slot, active,
                                          reinterpret_cast<float*>(smem), is_last);
}

}  // namespace llfd
