// Multi-query decode with an int8 Q K^T (PERF_NOTES v39; a probe, not routed): one query token
// per sequence, a KV head's whole group (<= 64 heads) as the 64 rows of one warpgroup's wgmma.
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
// multi_wg's copy layout (WgLayout: only its V and scale regions exist here); TEAMS computing
// warpgroups (1 or 2) take the tiles in turn (team w: tiles w, w + TEAMS, ...), each with its
// own online softmax over the same 64 rows (softmax and products as multi_wg.cu's), merged in
// shared memory at the end. Hand-overs by mbarriers, each completed by the tile's team alone:
// full (tile landed), empty (its S has read K), cfull (copy written), cempty (its P V has read
// it).
// Contiguous bnsh cache, per-token fp32 scales, one split, head_dim 128, a capacity that is a
// multiple of 64 (a tile's scales are one 256-byte copy).
#include "multi_wg_rows.cuh"  // softmax_tile, issue_values, rescale_rows
#include "tma.cuh"

namespace llfd {

struct MqaParams {
  const uint16_t* q;  // [B][Hkv * group][128] fp16
  const float* k_scale;  // [B][Hkv][capacity]
  const float* v_scale;
  const int32_t* seq_lens;
  uint16_t* out;  // like q
  int64_t q_batch_stride, out_batch_stride, scale_batch_stride;  // elements
  float score_scale_log2;
  int group, num_kv_heads, capacity;
};
// K and V as (128 bytes, capacity, B * Hkv), boxes of (128, 64, 1), 128-byte swizzle.
struct MqaMaps { TensorMap k, v; };

template <int STAGES, int COPIES, int TEAMS = 1>
struct MqaLayout {
  using W = WgLayout<128>;
  static constexpr int kTokens = 64;
  static constexpr int kK = 0, kV = 64 * 128, kKScale = 2 * 64 * 128, kVScale = kKScale + 256;
  static constexpr int kStageBytes = (kVScale + 256 + 1023) / 1024 * 1024;  // swizzle atoms
  static constexpr uint32_t kTx = 2 * 64 * 128 + 2 * 256;
  // A copy is WgLayout's V and scale regions; its base lies kCopyV before them.
  static constexpr int kCopySpan = W::kCopyBytes - W::kCopyV;
  static constexpr int kCopy0 = STAGES * kStageBytes;
  // Two teams: the second's accumulators ([64][128 threads]), then its rows' offsets and sums
  // ([2][128] each).
  static constexpr int kMerge = kCopy0 + COPIES * kCopySpan;
  static constexpr int kBytes = kMerge + (TEAMS == 2 ? 68 * 128 * 4 : 0);
  static_assert(kCopySpan % 1024 == 0 && kCopy0 >= W::kCopyV, "aligned copies in the window");
};

// D[64 x 64] (+)= A[64 x 32] B[64 x 32]^T in int32: A s8 in registers (this lane: row g bytes
// 4c .. 4c + 3 and 16 + 4c .., then row g + 8's), B s8 K-major in shared memory.
template <bool FIRST>
__device__ __forceinline__ void wgmma_m64n64k32_s8(int (&d)[32], const uint32_t (&a)[4],
                                                   uint64_t b) {
  if constexpr (FIRST)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p;\n}\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]), "=r"(d[4]), "=r"(d[5]), "=r"(d[6]), "=r"(d[7]), "=r"(d[8]), "=r"(d[9]), "=r"(d[10]), "=r"(d[11]), "=r"(d[12]), "=r"(d[13]), "=r"(d[14]), "=r"(d[15]), "=r"(d[16]), "=r"(d[17]), "=r"(d[18]), "=r"(d[19]), "=r"(d[20]), "=r"(d[21]), "=r"(d[22]), "=r"(d[23]), "=r"(d[24]), "=r"(d[25]), "=r"(d[26]), "=r"(d[27]), "=r"(d[28]), "=r"(d[29]), "=r"(d[30]), "=r"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(0));
  else
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p;\n}\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

template <int N>
__device__ __forceinline__ void fence_ints(int (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(d[i])::"memory");
}

// S = Q K^T over the 128 dims in four k-steps of 32 bytes, K at `k_tile` (1024-byte aligned).
__device__ __forceinline__ void issue_scores_s8(int (&s)[32], const uint32_t (&qa)[4][4],
                                                uint32_t k_tile) {
  const uint64_t k = sw128_descriptor(k_tile, 16, 1024);
  wgmma_m64n64k32_s8<true>(s, qa[0], k);
#pragma unroll
  for (int kk = 1; kk < 4; ++kk) wgmma_m64n64k32_s8<false>(s, qa[kk], descriptor_plus(k, 32 * kk));
  wgmma_commit();
}

// This lane's rows r_lo and r_lo + 8 of the group, quantized per row: int8 = rint(x * inv),
// inv = 127 / the row's largest |x|, the row's scale 1 / inv (in fp32, as
// benchlib/mqa_int8.py's oracle does; one division per row: 64 IEEE divisions per lane were
// a long prologue). Rows past the group are zero. row_const: the score scale in base 2 times
// the row's scale.
__device__ __forceinline__ void load_query_s8(uint32_t (&qa)[4][4], float (&row_const)[2],
                                              const MqaParams& p, int b, int kvh, int r_lo,
                                              int c) {
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = r_lo + 8 * hr;
    const uint16_t* row = p.q + b * p.q_batch_stride + static_cast<int64_t>(kvh * p.group + r) * 128;
    float x[4][2][4];
    float top = 0.f;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint2 w = r < p.group ? *reinterpret_cast<const uint2*>(row + 32 * kk + 16 * h + 4 * c)
                                    : make_uint2(0u, 0u);
        const uint32_t words[2] = {w.x, w.y};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          x[kk][h][e] = half_to_float(static_cast<uint16_t>(words[e / 2] >> (16 * (e % 2))));
          top = fmaxf(top, fabsf(x[kk][h][e]));
        }
      }
    top = warp_max_xor(top, 2);  // the row's four lanes
    const float inv = top > 0.f ? __fdiv_rn(127.f, top) : 0.f;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t packed = 0;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int v = __float2int_rn(__fmul_rn(x[kk][h][e], inv));
          packed |= static_cast<uint32_t>(min(127, max(-127, v)) & 0xff) << (8 * e);
        }
        qa[kk][hr + 2 * h] = packed;
      }
    row_const[hr] = fmaxf(p.score_scale_log2 * (top > 0.f ? __fdiv_rn(1.f, inv) : 0.f),
                          1.17549435e-38f);
  }
}

// A landed tile's V (int8, TMA's swizzle = MultiTile's) -> fp16 in the copy, and its K and V
// scales into the copy's rows (widen_tile's scale half). V scales of tokens at or past `len`
// are zeroed: their P is 0, but the pool may hold anything there.
template <int STAGES, int COPIES, bool CONVERT = true>
__device__ __forceinline__ void widen_v(const char* stage, char* copy, int t0, int len) {
  using L = MqaLayout<STAGES, COPIES>;  // the stage layout does not depend on TEAMS
  using W = WgLayout<128>;
  using T = MultiTile<128, 64, 128>;
  uint4 in[4];
#pragma unroll
  for (int i = 0; i < (CONVERT ? 4 : 0); ++i) {
    const int idx = static_cast<int>(threadIdx.x) + 128 * i;
    in[i] = *reinterpret_cast<const uint4*>(stage + L::kV + T::offset(idx % 64, idx / 64));
  }
#pragma unroll
  for (int i = 0; i < (CONVERT ? 4 : 0); ++i) {
    const int idx = static_cast<int>(threadIdx.x) + 128 * i, t = idx % 64, ch = idx / 64;
    const uint32_t words[4] = {in[i].x, in[i].y, in[i].z, in[i].w};
    uint32_t h[8];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t u = words[k] ^ 0x80808080u;
      h[2 * k] = int8_pair<0x4140u>(u);
      h[2 * k + 1] = int8_pair<0x4342u>(u);
    }
    char* dst = copy + W::kCopyV;
    *reinterpret_cast<uint4*>(dst + W::at(t, 2 * ch)) = make_uint4(h[0], h[1], h[2], h[3]);
    *reinterpret_cast<uint4*>(dst + W::at(t, 2 * ch + 1)) = make_uint4(h[4], h[5], h[6], h[7]);
  }
  const int token = threadIdx.x % 64;
  const bool v = threadIdx.x >= 64;  // warp-uniform: warps 0-1 K scales, 2-3 V scales
  const float raw = reinterpret_cast<const float*>(stage + L::kKScale)[threadIdx.x];
  const float scale = v && t0 + token >= len ? 0.f : raw;
  reinterpret_cast<float*>(copy + (v ? W::kCopyVScale : W::kCopyKScale))[W::scale_at(token)] =
      scale;
  if (v) {
    const float top = warp_max_xor(scale, 16);
    if (threadIdx.x % 32 == 0) reinterpret_cast<float*>(copy + W::kCopyVMax)[threadIdx.x / 32 - 2] = top;
  }
}

// setmaxnreg (two teams: 384 threads start at 168 registers; 72 + 2 x 216 fits the pool).
template <int N>
__device__ __forceinline__ void mqa_max_registers() {
  if constexpr (N < 168)
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
  else
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}

// CONTROL (timing controls, outputs wrong; 0 ships in every test): bit 0 skips V's widening
// (the scales are still copied), bit 1 the softmax (P stays as it was).
template <int STAGES, int COPIES, int TEAMS, int CONTROL = 0>
__global__ void __launch_bounds__(128 * (1 + TEAMS), 1)
    mqa_int8(const __grid_constant__ MqaParams p, const __grid_constant__ MqaMaps maps) {
  static_assert(TEAMS == 1 || TEAMS == 2, "one or two computing warpgroups");
  // A team holds the copy of its tile j (P V) while it waits for that of j + TEAMS (softmax):
  // with fewer copies those are one and the same, and it waits for itself.
  static_assert(COPIES >= 2 * TEAMS, "two copies per team");
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
    return smem + L::kCopy0 + (j % COPIES) * L::kCopySpan - W::kCopyV;
  };

  if (wg == 0) {
    if constexpr (TEAMS == 2) mqa_max_registers<72>();
    const int row = b * p.num_kv_heads + kvh;
    auto issue = [&](int t) __attribute__((always_inline)) {  // thread 0
      const int s = t % STAGES;
      const uint32_t stage = base + s * L::kStageBytes, bar = full + 8 * s;
      mbar_expect(bar, L::kTx);
      tma_3d(stage + L::kK, &maps.k, 0, 64 * t, row, bar);
      tma_3d(stage + L::kV, &maps.v, 0, 64 * t, row, bar);
      const int64_t at = b * p.scale_batch_stride + static_cast<int64_t>(kvh) * p.capacity + 64 * t;
      bulk_copy(stage + L::kKScale, p.k_scale + at, 256, bar);
      bulk_copy(stage + L::kVScale, p.v_scale + at, 256, bar);
    };
    if (threadIdx.x == 0)
      for (int t = 0; t < min(STAGES, tiles); ++t) issue(t);
#pragma unroll 1
    for (int j = 0; j < tiles; ++j) {
      // The stage of tile j - 1 (its V widened last step) refills once its S has read K.
      if (threadIdx.x == 0 && j >= 1 && j - 1 + STAGES < tiles) {
        mbar_wait(empty + 8 * ((j - 1) % STAGES), ((j - 1) / STAGES) & 1);
        issue(j - 1 + STAGES);
      }
      const int s = j % STAGES;
      mbar_wait(full + 8 * s, (j / STAGES) & 1);
      if (j >= COPIES) mbar_wait(cempty + 8 * (j % COPIES), (j / COPIES - 1) & 1);
      widen_v<STAGES, COPIES, !(CONTROL & 1)>(smem + s * L::kStageBytes, copy_of(j), 64 * j, len);
      fence_proxy_async();
      mbar_arrive(cfull + 8 * (j % COPIES));
      asm volatile("bar.sync 2, 128;" ::: "memory");  // stage s read by all before its refill
    }
    allow_next_grid();
    return;
  }

  // ---- the computing warpgroups (team cw): rows r_lo and r_lo + 8 of this lane ----
  if constexpr (TEAMS == 2) mqa_max_registers<216>();
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
  VRef vr;
  int si[32];
  float s[32];
  uint32_t a[4][4], a_next[4][4];
  KScales<128, true> ks;
  auto stage_k = [&](int j) __attribute__((always_inline)) {
    return base + (j % STAGES) * L::kStageBytes + L::kK;
  };
  auto softmax = [&](int j, uint32_t (&p_out)[4][4]) __attribute__((always_inline)) {
#pragma unroll
    for (int i = 0; i < 32; ++i) s[i] = static_cast<float>(si[i]);
    const int col0 = 64 * j;
    if constexpr ((CONTROL & 2) != 0) {
      p_out[0][0] ^= static_cast<uint32_t>(si[0]) & 1u;  // keeps S live; P barely changes
      return;
    }
    softmax_tile<128, true>(s, p_out, m, l, vr, corr, row_const, ks, copy_of(j), col0 + 64 > len,
                            col0, visible, c);
  };
  if (cw < tiles) {
    mbar_wait(full + 8 * (cw % STAGES), (cw / STAGES) & 1);
    wgmma_fence();
    issue_scores_s8(si, qa, stage_k(cw));
    wgmma_wait<0>();
    fence_ints(si);
    mbar_arrive(empty + 8 * (cw % STAGES));
    mbar_wait(cfull + 8 * (cw % COPIES), (cw / COPIES) & 1);
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
    if (more) mbar_wait(full + 8 * (next % STAGES), (next / STAGES) & 1);
    rescale_rows(o, corr);
    wgmma_fence();
    issue_scores_s8(si, qa, stage_k(next));
    issue_values<128>(o, cur, base + (copy_of(j) - smem));
    wgmma_wait<1>();
    fence_ints(si);
    if (more) {
      mbar_arrive(empty + 8 * (next % STAGES));
      mbar_wait(cfull + 8 * (next % COPIES), (next / COPIES) & 1);
      ks.load(copy_of(next), c);
      softmax(next, nxt);
    }
    wgmma_wait<0>();
    fence_operands(o);
    mbar_arrive(cempty + 8 * (j % COPIES));
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
    float* const merge = reinterpret_cast<float*>(smem + L::kMerge);
    const int t = threadIdx.x % 128;
    float offset[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) offset[hr] = m[hr] == kNegInf ? kNegInf : m[hr] + vr.shift;
    if (cw == 1) {
#pragma unroll
      for (int i = 0; i < 64; ++i) merge[i * 128 + t] = o[i];
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        merge[(64 + hr) * 128 + t] = offset[hr];
        merge[(66 + hr) * 128 + t] = sums[hr];
      }
      asm volatile("bar.arrive 3, 256;" ::: "memory");
      return;
    }
    asm volatile("bar.sync 3, 256;" ::: "memory");
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
