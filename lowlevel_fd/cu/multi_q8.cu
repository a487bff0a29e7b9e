// Decode rows (one query token per sequence) of a large group with an int8 Q K^T, on Hopper's
// warpgroup MMA (sm_90a), head_dim 128, a contiguous cache with per-token scales. MultiPlan
// runs it where the caller allowed q in int8 (PERF_NOTES v39-v42; its accuracy: v29).
//
// Why: the warpgroup kernel (multi_wg.cu) widens every K and V tile to fp16 before its wgmmas
// read them, and that widening set the multi-query rows' pace (m18, m19, v28). Here q is
// quantized per row to int8 in registers and S = Q K^T is an s8 x s8 -> s32 wgmma that reads
// K's int8 tile where its bulk tensor copy landed it; only V is widened, for O += P V (P fp16
// from registers).
//
// CTA (64 query rows of one KV head: CtaWork's row tile, split and sequence):
//  * warpgroup 0 widens: its thread 0 keeps a ring of kStages int8 tiles (64 tokens) in flight
//    with bulk tensor copies (Q8Maps, 128-byte swizzle; tokens past the capacity arrive as
//    zeros); all 128 threads copy the per-token scales kStages tiles ahead (ScaleRing) and widen
//    V and the scales into kCopies copies (VWidening);
//  * warpgroups 1 and 2 ("teams") take the tiles in turn (team w: tiles w, w + 2, ...), each
//    with its own online softmax (softmax_h16) over the same 64 rows: S(j + 2) on the tensor
//    cores with P(j) V(j), then the softmax of S(j + 2). At the end the first team's state is
//    merged into the second's through shared memory, and the second stores the rows: the
//    output, or a split's partial (multi_combine or the last split merges them, as for the
//    other kernels of the family).
// Hand-overs are mbarriers, each completed by one side: full (tile landed: thread 0's expected
// bytes), empty (its team's S has read K: 128 arrivals), cfull (copy written: 128), cempty
// (its team's P V has read the copy: 128).
#include "multi_q8_softmax.cuh"

namespace llfd {

template <typename QT, typename ScaleT>
__global__ void __launch_bounds__(Q8Layout::kThreads, 1)
    multi_attend_q8(const __grid_constant__ MultiParams p, const __grid_constant__ Q8Maps maps) {
  using L = Q8Layout;
  using W = WgLayout<128>;
  constexpr int kStages = L::kStages, kCopies = L::kCopies, kTeams = L::kTeams;
  extern __shared__ __align__(128) char smem_raw[];
  __shared__ __align__(8) uint64_t full_bar[kStages], empty_bar[kStages];
  __shared__ __align__(8) uint64_t cfull_bar[kCopies], cempty_bar[kCopies];
  __shared__ int is_last;
  __shared__ __align__(16) uint32_t scale_ring[kStages * 128];  // ScaleRing's slots
  char* const smem = swizzle_aligned(smem_raw);
  const uint32_t base = shared_address(smem);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int wg = __shfl_sync(0xffffffffu, warp / 4, 0);  // warp-uniform for wgmma

  const CtaWork<L::kRows, L::kTokens> work(p);
  if (work.idle) {
    work.template retire<128>(p);
    return;
  }
  const SequenceRows& sr = work.sr;
  const int kvh = work.kvh, b = work.b, row0 = work.row0;
  const int start = work.start, end = work.end, active = work.active;
  const int tiles = work.tiles();
  const uint32_t full = shared_address(full_bar), empty = shared_address(empty_bar);
  const uint32_t cfull = shared_address(cfull_bar), cempty = shared_address(cempty_bar);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) mbar_init(full + 8 * s, 1), mbar_init(empty + 8 * s, 128);
    for (int s = 0; s < kCopies; ++s) mbar_init(cfull + 8 * s, 128), mbar_init(cempty + 8 * s, 128);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  auto copy_of = [&](int j) __attribute__((always_inline)) {
    return smem + L::kCopy0 + slot<kCopies>(j) * L::kCopySpan - W::kCopyV;
  };

  if (wg == 0) {
    set_max_registers<72>();
    const int tid = threadIdx.x, token = tid % 64;
    auto issue = [&](int j) __attribute__((always_inline)) {  // thread 0
      const int s = slot<kStages>(j);
      const uint32_t stage = base + s * L::kStageBytes, bar = full + 8 * s;
      mbar_expect(bar, L::kTx);
      tma_4d(stage + L::kK, &maps.k, 0, start + 64 * j, kvh, b, bar);
      tma_4d(stage + L::kV, &maps.v, 0, start + 64 * j, kvh, b, bar);
    };
    // The first tiles go out before the wait for the previous kernel where they lie before
    // the appended token (CtaWork::primes_early); the scales are read after it.
    const bool prime_early = work.template primes_early<kStages + 1>();
    if (work.early && !prime_early) work.wait_then_flag(p);
    if (tid == 0)
      for (int j = 0; j < min(kStages, tiles); ++j) issue(j);
    if (prime_early) work.wait_then_flag(p);
    ScaleRing<ScaleT, kStages> scales(p, b, kvh, tid, shared_address(scale_ring));
#pragma unroll 1
    for (int j = 0; j < kStages; ++j) scales.fetch(j, start + 64 * j + token, end);
#pragma unroll 1
    for (int j = 0; j < tiles; ++j) {
      // The stage of tile j - 1 (its V widened last step) refills once its S has read K.
      if (tid == 0 && j >= 1 && j - 1 + kStages < tiles) {
        mbar_wait(empty + 8 * slot<kStages>(j - 1), lap<kStages>(j - 1));
        issue(j - 1 + kStages);
      }
      const float tile_scale = scales.take(j);
      scales.fetch(j + kStages, start + 64 * (j + kStages) + token, end);
      const int s = slot<kStages>(j);
      mbar_wait(full + 8 * s, lap<kStages>(j));
      VWidening widened;
      widened.load(smem + s * L::kStageBytes, tile_scale, tid);  // in registers meanwhile
      if (j >= kCopies) mbar_wait(cempty + 8 * slot<kCopies>(j), lap<kCopies>(j) ^ 1u);
      widened.store(copy_of(j), tid);
      fence_proxy_async();
      mbar_arrive(cfull + 8 * slot<kCopies>(j));
      asm volatile("bar.sync 2, 128;" ::: "memory");  // stage s read by all before its refill
    }
    cp_async_wait<0>();
    allow_next_grid();
    return;
  }

  // ---- the teams (cw): rows r_lo and r_lo + 8 of this lane ----
  set_max_registers<216>();
  if (work.early) wait_for_previous_grid();  // before q and any write
  const int cw = wg - 1;
  const int r_lo = row0 + 16 * (warp % 4) + g;
  uint32_t qa[4][4];
  float row_const[2];
  {
    uint32_t qf[8][4];
    float row_scale[2];
    load_rows<128, QT>(qf, row_scale, p, sr, kvh, r_lo, c);
    quantize_query_s8(qa, row_const, qf, row_scale, p.score_scale_log2);
  }
  const int visible[2] = {end, end};  // decode rows: every row sees the split's range
  float o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.f, 0.f}, corr[2] = {1.f, 1.f};
  VRefH vr;
  int si[32];
  float s[32];
  uint32_t a[4][4], a_next[4][4];
  KScales<128, true> ks;
  auto stage_k = [&](int j) __attribute__((always_inline)) {
    return base + slot<kStages>(j) * L::kStageBytes + L::kK;
  };
  auto softmax = [&](int j, uint32_t (&p_out)[4][4]) __attribute__((always_inline)) {
#pragma unroll
    for (int i = 0; i < 32; ++i) s[i] = static_cast<float>(si[i]);
    const int col0 = start + 64 * j;
    softmax_h16(s, p_out, m, l, vr, corr, row_const, ks, copy_of(j), col0 + 64 > end, col0,
                visible, c);
  };
  if (cw < tiles) {
    mbar_wait(full + 8 * slot<kStages>(cw), lap<kStages>(cw));
    wgmma_fence();
    issue_scores_s8(si, qa, stage_k(cw));
    wgmma_wait<0>();
    fence_ints(si);
    mbar_arrive(empty + 8 * slot<kStages>(cw));
    mbar_wait(cfull + 8 * slot<kCopies>(cw), lap<kCopies>(cw));
    ks.load(copy_of(cw), c);
    softmax(cw, a);
  }
  // The team's tile j: S(j + 2) with P(j) V(j) on the tensor cores, then the softmax of
  // S(j + 2). Past the last tile S reads a stale stage (no copy is in flight into it then)
  // and is dropped: the issues and waits stay outside any branch (multi_wg.cu: ptxas
  // serializes a wgmma group across one).
  auto tile_step = [&](int j, uint32_t (&cur)[4][4], uint32_t (&nxt)[4][4])
      __attribute__((always_inline)) {
    const int next = j + kTeams;
    const bool more = next < tiles;
    if (more) mbar_wait(full + 8 * slot<kStages>(next), lap<kStages>(next));
    rescale_rows(o, corr);
    wgmma_fence();
    issue_scores_s8(si, qa, stage_k(next));
    issue_values<128>(o, cur, base + static_cast<uint32_t>(copy_of(j) - smem));
    wgmma_wait<1>();
    fence_ints(si);
    if (more) {
      mbar_arrive(empty + 8 * slot<kStages>(next));
      mbar_wait(cfull + 8 * slot<kCopies>(next), lap<kCopies>(next));
      ks.load(copy_of(next), c);
      softmax(next, nxt);
    }
    wgmma_wait<0>();
    fence_operands(o);
    mbar_arrive(cempty + 8 * slot<kCopies>(j));
  };
#pragma unroll 1
  for (int j = cw; j < tiles; j += 2 * kTeams) {
    tile_step(j, a, a_next);
    if (j + kTeams < tiles) tile_step(j + kTeams, a_next, a);
  }
  allow_next_grid();

  // Team 0 leaves its accumulators and its rows' (offset, lane sum) in shared memory; team 1
  // (the CTA's last 128 threads: MergeTeam<128> in merge_if_last) folds them in with the usual
  // weights, each state being O and l relative to 2^(m + shift). The area is the stages':
  // free once both loops are done (every copy landed and was read).
  float* const merge = reinterpret_cast<float*>(smem + L::kMerge);
  const int t = threadIdx.x % 128;
  float offset[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) offset[hr] = m[hr] == kNegInf ? kNegInf : m[hr] + vr.shift;
  asm volatile("bar.sync 3, 256;" ::: "memory");  // both loops are done
  if (cw == 0) {
#pragma unroll
    for (int i = 0; i < 64; ++i) merge[i * 128 + t] = o[i];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      merge[(64 + hr) * 128 + t] = offset[hr];
      merge[(66 + hr) * 128 + t] = l[hr];
    }
  }
  // Two full barriers, not an arrive and a sync: racecheck reported hazards over the merge
  // with bar.arrive handing it over (PERF_NOTES v40).
  asm volatile("bar.sync 5, 256;" ::: "memory");
  if (cw == 0) return;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const float other = merge[(64 + hr) * 128 + t];
    const float top = fmaxf(offset[hr], other);
    const float w1 = offset[hr] == kNegInf ? 0.f : fast_exp2(offset[hr] - top);
    const float w0 = other == kNegInf ? 0.f : fast_exp2(other - top);
    l[hr] = l[hr] * w1 + merge[(66 + hr) * 128 + t] * w0;
    m[hr] = top;
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int i = 4 * j + 2 * hr + e;
        o[i] = o[i] * w1 + merge[i * 128 + t] * w0;
      }
  }

  // ---- this split's rows: normalised, with their base-2 LSE (m is the merged offset) ----
  const int64_t slot_id = (static_cast<int64_t>(b) * p.num_kv_heads + kvh) * p.max_tiles + work.tile;
  const int64_t part = slot_id * p.num_splits + work.split;
  wg_store_rows<128, L::kRows, QT>(p, sr, o, m, l, 0.f, 1.f, kvh, row0, r_lo, c, part, nullptr,
                                   active);
  if (active == 1 || p.combine) return;  // one split, or multi_combine merges
  merge_if_last<128, L::kRows, QT, 128>(p, sr, kvh, row0, work.tile_rows, slot_id, active,
                                        reinterpret_cast<float*>(smem), is_last);
}

}  // namespace llfd
