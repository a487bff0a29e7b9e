// Multi-query decode with an int8 Q K^T (PERF_NOTES v39, v40; a probe, not routed): one query
// token per sequence, a KV head's whole group (<= 64 heads) as the 64 rows of one warpgroup's
// wgmma.
//
// Why: the shipped warpgroup kernel (lowlevel_fd/cu/multi_wg.cu) widens every K and V tile to
// fp16 in shared memory before its wgmmas read them, and that widening, on its loading
// warpgroup, set the multi-query rows' pace (PERF_NOTES m18, m19). Here K is never widened: q
// is quantized per row to int8 (in registers) and S = Q K^T is an s8 x s8 -> s32 wgmma that
// reads K's int8 tile where its bulk tensor copy landed it (TMA's 128-byte swizzle of 128-byte
// rows is wgmma's K-major layout). Only V is widened, for O += P V (P from registers, fp16).
//
// CTA: warpgroup 0 copies (thread 0: a ring of STAGES int8 tiles of 64 tokens, each tile's
// K, V and scales on one mbarrier) and widens V and the scales into COPIES copies in
// multi_wg's copy layout (WgLayout: only its V and scale regions exist here), reading a tile
// into registers before it waits for the copy's last reader (VWidening); TEAMS computing
// warpgroups (1 or 2) take the tiles in turn (team w: tiles w, w + TEAMS, ...), each with its
// own online softmax over the same 64 rows (SOFTMAX: multi_wg.cu's softmax_tile, or
// softmax_h16), merged at the end in shared memory over the stages. Hand-overs by mbarriers,
// each completed by the tile's team alone: full (tile landed), empty (its S has read K), cfull
// (copy written), cempty (its P V has read it).
// Contiguous bnsh cache, per-token fp32 scales, one split, head_dim 128, a capacity that is a
// multiple of 64 (a tile's scales are one 256-byte copy).
#include "mqa_int8_softmax.cuh"

namespace llfd {

// The softmax's V reference: softmax_tile's VRef, or softmax_h16's VRefH.
template <int SOFTMAX> struct SoftmaxRef { using type = VRef; };
template <> struct SoftmaxRef<1> { using type = VRefH; };

// CONTROL (timing controls, outputs wrong; 0 ships in every test): bit 0 skips V's widening
// (the scales are still copied), bit 1 the softmax (P stays as it was). SOFTMAX: 0 multi_wg's
// softmax_tile, 1 mqa_int8_softmax.cuh's softmax_h16 (its V scales written by the widener).
template <int STAGES, int COPIES, int TEAMS, int CONTROL = 0, int SOFTMAX = 0>
__global__ void __launch_bounds__(128 * (1 + TEAMS), 1)
    mqa_int8(const __grid_constant__ MqaParams p, const __grid_constant__ MqaMaps maps) {
  static_assert(TEAMS == 1 || TEAMS == 2, "one or two computing warpgroups");
  // A team holds the copy of its tile j (P V) while it waits for that of j + TEAMS (softmax):
  // with fewer copies those are one and the same, and it waits for itself.
  static_assert(COPIES >= 2 * TEAMS, "two copies per team");
  static_assert(SOFTMAX == 0 || SOFTMAX == 1, "softmax_tile or softmax_h16");
  using L = MqaLayout<STAGES, COPIES, TEAMS>;
  using W = WgLayout<128>;
  extern __shared__ __align__(128) char smem_raw[];
  __shared__ __align__(8) uint64_t full_bar[STAGES], empty_bar[STAGES];
  __shared__ __align__(8) uint64_t cfull_bar[COPIES], cempty_bar[COPIES];
  char* const smem = swizzle_aligned(smem_raw);
  const uint32_t base = shared_address(smem);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int wg = __shfl_sync(0xffffffffu, warp / 4, 0);
  const int kvh = blockIdx.x, b = blockIdx.z;

  wait_for_previous_grid();
  const int len = min(max(p.seq_lens[b], 0), p.capacity);
  const int tiles = (len + 63) / 64;
  const uint32_t full = shared_address(full_bar), empty = shared_address(empty_bar);
  const uint32_t cfull = shared_address(cfull_bar), cempty = shared_address(cempty_bar);
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) mbar_init(full + 8 * s, 1), mbar_init(empty + 8 * s, 128);
    for (int s = 0; s < COPIES; ++s) mbar_init(cfull + 8 * s, 128), mbar_init(cempty + 8 * s, 128);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  auto copy_of = [&](int j) __attribute__((always_inline)) {
    return smem + L::kCopy0 + slot<COPIES>(j) * L::kCopySpan - W::kCopyV;
  };

  if (wg == 0) {
    if constexpr (TEAMS == 2) set_max_registers<72>();
    const int row = b * p.num_kv_heads + kvh, tid = threadIdx.x;
    auto issue = [&](int t) __attribute__((always_inline)) {  // thread 0
      const int s = slot<STAGES>(t);
      const uint32_t stage = base + s * L::kStageBytes, bar = full + 8 * s;
      mbar_expect(bar, L::kTx);
      tma_3d(stage + L::kK, &maps.k, 0, 64 * t, row, bar);
      tma_3d(stage + L::kV, &maps.v, 0, 64 * t, row, bar);
      const int64_t at = b * p.scale_batch_stride + static_cast<int64_t>(kvh) * p.capacity + 64 * t;
      bulk_copy(stage + L::kKScale, p.k_scale + at, 256, bar);
      bulk_copy(stage + L::kVScale, p.v_scale + at, 256, bar);
    };
    if (tid == 0)
      for (int t = 0; t < min(STAGES, tiles); ++t) issue(t);
#pragma unroll 1
    for (int j = 0; j < tiles; ++j) {
      // The stage of tile j - 1 (its V widened last step) refills once its S has read K.
      if (tid == 0 && j >= 1 && j - 1 + STAGES < tiles) {
        mbar_wait(empty + 8 * slot<STAGES>(j - 1), lap<STAGES>(j - 1));
        issue(j - 1 + STAGES);
      }
      const int s = slot<STAGES>(j);
      mbar_wait(full + 8 * s, lap<STAGES>(j));
      VWidening<STAGES, COPIES, !(CONTROL & 1), SOFTMAX == 1> widened;
      widened.load(smem + s * L::kStageBytes, 64 * j, len, tid);  // in registers meanwhile
      if (j >= COPIES) mbar_wait(cempty + 8 * slot<COPIES>(j), lap<COPIES>(j) ^ 1u);
      widened.store(copy_of(j), tid);
      fence_proxy_async();
      mbar_arrive(cfull + 8 * slot<COPIES>(j));
      asm volatile("bar.sync 2, 128;" ::: "memory");  // stage s read by all before its refill
    }
    allow_next_grid();
    return;
  }

  // ---- the computing warpgroups (team cw): rows r_lo and r_lo + 8 of this lane ----
  if constexpr (TEAMS == 2) set_max_registers<216>();
  const int cw = wg - 1;
  const int r_lo = 16 * (warp % 4) + g;
  uint32_t qa[4][4];
  float row_const[2];
  load_query_s8(qa, row_const, p, b, kvh, r_lo, c);
  const int visible[2] = {len, len};
  float o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.f, 0.f}, corr[2] = {1.f, 1.f};
  typename SoftmaxRef<SOFTMAX>::type vr;
  int si[32];
  float s[32];
  uint32_t a[4][4], a_next[4][4];
  KScales<128, true> ks;
  auto stage_k = [&](int j) __attribute__((always_inline)) {
    return base + slot<STAGES>(j) * L::kStageBytes + L::kK;
  };
  auto softmax = [&](int j, uint32_t (&p_out)[4][4]) __attribute__((always_inline)) {
#pragma unroll
    for (int i = 0; i < 32; ++i) s[i] = static_cast<float>(si[i]);
    const int col0 = 64 * j;
    if constexpr ((CONTROL & 2) != 0) {
      p_out[0][0] ^= static_cast<uint32_t>(si[0]) & 1u;  // keeps S live; P barely changes
      return;
    }
    if constexpr (SOFTMAX == 1)
      softmax_h16(s, p_out, m, l, vr, corr, row_const, ks, copy_of(j), col0 + 64 > len, col0,
                  visible, c);
    else
      softmax_tile<128, true>(s, p_out, m, l, vr, corr, row_const, ks, copy_of(j),
                              col0 + 64 > len, col0, visible, c);
  };
  if (cw < tiles) {
    mbar_wait(full + 8 * slot<STAGES>(cw), lap<STAGES>(cw));
    wgmma_fence();
    issue_scores_s8(si, qa, stage_k(cw));
    wgmma_wait<0>();
    fence_ints(si);
    mbar_arrive(empty + 8 * slot<STAGES>(cw));
    mbar_wait(cfull + 8 * slot<COPIES>(cw), lap<COPIES>(cw));
    ks.load(copy_of(cw), c);
    softmax(cw, a);
  }
  // The team's tile j: S(j + TEAMS) with P(j) V(j) on the tensor cores, then the softmax of
  // S(j + TEAMS). Past the last tile S reads a stale stage (no copy is in flight into it then)
  // and is dropped: the issues and waits stay outside any branch (multi_wg.cu: ptxas
  // serializes a group across one).
  auto tile_step = [&](int j, uint32_t (&cur)[4][4], uint32_t (&nxt)[4][4])
      __attribute__((always_inline)) {
    const int next = j + TEAMS;
    const bool more = next < tiles;
    if (more) mbar_wait(full + 8 * slot<STAGES>(next), lap<STAGES>(next));
    rescale_rows(o, corr);
    wgmma_fence();
    issue_scores_s8(si, qa, stage_k(next));
    issue_values<128>(o, cur, base + (copy_of(j) - smem));
    wgmma_wait<1>();
    fence_ints(si);
    if (more) {
      mbar_arrive(empty + 8 * slot<STAGES>(next));
      mbar_wait(cfull + 8 * slot<COPIES>(next), lap<COPIES>(next));
      ks.load(copy_of(next), c);
      softmax(next, nxt);
    }
    wgmma_wait<0>();
    fence_operands(o);
    mbar_arrive(cempty + 8 * slot<COPIES>(j));
  };
#pragma unroll 1
  for (int j = cw; j < tiles; j += 2 * TEAMS) {
    tile_step(j, a, a_next);
    if (j + TEAMS < tiles) tile_step(j + TEAMS, a_next, a);
  }
  allow_next_grid();

  float sums[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) sums[hr] = warp_sum_xor(l[hr], 2);
  if constexpr (TEAMS == 2) {
    // Team 1 leaves its accumulators and its rows' (offset, sum) in shared memory; team 0
    // folds them in with the usual weights: each state is O and l relative to 2^(m + shift).
    // The area is the stages': free once both loops are done (every tile's copies landed and
    // were read, every widening waited for).
    float* const merge = reinterpret_cast<float*>(smem + L::kMerge);
    const int t = threadIdx.x % 128;
    float offset[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr)
      offset[hr] = m[hr] == kNegInf ? kNegInf : m[hr] + vr.shift;
    asm volatile("bar.sync 3, 256;" ::: "memory");  // both loops are done
    if (cw == 1) {
#pragma unroll
      for (int i = 0; i < 64; ++i) merge[i * 128 + t] = o[i];
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        merge[(64 + hr) * 128 + t] = offset[hr];
        merge[(66 + hr) * 128 + t] = sums[hr];
      }
    }
    // Two full barriers, not an arrive and a sync: racecheck reported 204 hazards over the
    // merge with bar.arrive handing it over (PERF_NOTES v40).
    asm volatile("bar.sync 5, 256;" ::: "memory");
    if (cw == 1) return;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const float other = merge[(64 + hr) * 128 + t];
      const float top = fmaxf(offset[hr], other);
      const float w0 = offset[hr] == kNegInf ? 0.f : fast_exp2(offset[hr] - top);
      const float w1 = other == kNegInf ? 0.f : fast_exp2(other - top);
      sums[hr] = sums[hr] * w0 + merge[(66 + hr) * 128 + t] * w1;
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int i = 4 * j + 2 * hr + e;
          o[i] = o[i] * w0 + merge[i * 128 + t] * w1;
        }
    }
  }

#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = r_lo + 8 * hr;
    const float sum = sums[hr];
    if (r >= p.group) continue;
    const float f = sum > 0.f ? 1.f / sum : 0.f;
    uint32_t* dst = reinterpret_cast<uint32_t*>(p.out + b * p.out_batch_stride +
                                                static_cast<int64_t>(kvh * p.group + r) * 128);
#pragma unroll
    for (int j = 0; j < 16; ++j)  // dims 8 j + 2 c, + 1
      dst[4 * j + c] = pack2<f16>(o[4 * j + 2 * hr] * f, o[4 * j + 2 * hr + 1] * f);
  }
}

}  // namespace llfd
