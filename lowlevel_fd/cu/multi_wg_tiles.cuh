// The warpgroup-MMA multi-token kernel's tiles (multi_wg.cu): shared-memory layout, the int8 ->
// fp16 widening of a K/V tile into the 128-byte-swizzled form wgmma reads, the online softmax
// of one score tile, and the two MMA issues (S = Q K^T from shared memory, O += P V with P
// from registers).
#pragma once
#include "multi_rows.cuh"
#include "multi_tiles.cuh"
#include "wgmma.cuh"

namespace llfd {

// CTA shapes: 128 query rows (multi_wg.cu: a loading warpgroup and two computing ones, one CTA
// per SM) or 64 (one warpgroup that does both, multi_wg64.cu: two CTAs per SM, so the shared
// memory holds half as much). Warpgroup 0 loads and widens the tiles in both.
template <int HEAD_DIM, int ROWS = 128>
struct WgLayout {
  static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "rows of one or two 64-dim blocks");
  static_assert(ROWS == 64 || ROWS == 128, "one or two computing warpgroups");
  static constexpr int kTokens = 64;      // KV tokens per tile: the score mma's N
  static constexpr int kCtaRows = ROWS;   // query rows: 64 per computing warpgroup
  static constexpr int kThreads = ROWS == 128 ? 384 : 128;
  static constexpr int kLoadThreads = 128;  // the warpgroup that issues copies and widens
  static constexpr int kStages = ROWS == 128 ? 3 : 2;  // int8 KV tiles in flight
  using Stage = MultiTile<HEAD_DIM, kTokens, kLoadThreads>;
  static constexpr int kStageBytes = (Stage::kBytes + 1023) / 1024 * 1024;
  static constexpr int kBlocks = HEAD_DIM / 64;  // 64-dim blocks of an fp16 row
  static constexpr int kBlockBytes = 64 * 128;   // 64 rows of 64 fp16
  // A widened tile ("copy"): K and V as [block][64][64] fp16, then the K and V scales (fp32,
  // each lane's in a row: scale_at), then the largest V scale of each half tile.
  static constexpr int kCopyV = kBlocks * kBlockBytes, kCopyKScale = 2 * kCopyV;
  static constexpr int kScaleRow = 20;  // floats per lane's row: 16 scales, 4 against conflicts
  static constexpr int kCopyVScale = kCopyKScale + 4 * 4 * kScaleRow;
  static constexpr int kCopyVMax = kCopyVScale + 4 * 4 * kScaleRow;
  static constexpr int kCopyBytes = (kCopyVMax + 8 + 1023) / 1024 * 1024;
  static_assert(kTokens == 64, "scale_at: 8 column blocks of 8 tokens");
  // Token t's scale: the score columns 8 j + 2 c + e are lane c's (the accumulator layout),
  // so that lane reads its 16 scales as four 16-byte words.
  __device__ static __forceinline__ int scale_at(int t) {
    return ((t >> 1) & 3) * kScaleRow + (t >> 3) * 2 + (t & 1);
  }
  // Widened tiles. 128 rows: tile j + 2 being written while j + 1 (S = Q K^T) and j (P V)
  // are read (three left named barriers for the ping-pong; four measured no faster,
  // multi_wg.cu). 64 rows: j + 1 written while j is read.
  static constexpr int kCopies = ROWS == 128 ? 3 : 2;
  static constexpr int kCopy0 = kStages * kStageBytes;
  // The warpgroups' fp16 Q ([warpgroup][block][64][64]), read once into registers: one
  // warpgroup stages it in copy 1, written first in the loop's first step.
  static constexpr int kQ16 = ROWS == 128 ? kCopy0 + kCopies * kCopyBytes : kCopy0 + kCopyBytes;
  static constexpr int kBytes =
      ROWS == 128 ? kQ16 + 2 * kBlocks * kBlockBytes : kCopy0 + kCopies * kCopyBytes;
  static_assert(ROWS == 128 || kBlocks * kBlockBytes <= kCopyBytes, "Q fits a copy");
  // Row r's 8-element chunk c (0 .. HEAD_DIM / 8) in a [block][64][64] fp16 array.
  __device__ static __forceinline__ int at(int r, int c) {
    return (c >> 3) * kBlockBytes + r * 128 + (((c & 7) ^ (r & 7)) << 4);
  }
};

// The dynamic shared memory from its first 1024-byte boundary: swizzled operands need
// 1024-byte-aligned atoms (the plan adds 1 KB of slack).
__device__ __forceinline__ char* swizzle_aligned(char* smem_raw) {
  return smem_raw + ((1024u - (shared_address(smem_raw) & 1023u)) & 1023u);
}

// A stage's int8 K and V rows -> a copy in fp16 (each thread of warpgroup 0 its share of
// 16-byte chunks), and per-token scales alongside (the stage is refilled before the tile's
// softmax).
template <int HEAD_DIM, int ROWS, bool TOKEN_SCALES, bool READ_FIRST = false>
__device__ __forceinline__ void widen_tile(const char* stage, char* copy) {
  using L = WgLayout<HEAD_DIM, ROWS>;
  constexpr int kChunks = HEAD_DIM / 16;
  constexpr int kSteps = L::kTokens * kChunks / L::kLoadThreads;
  // READ_FIRST: all of this thread's 16-byte reads first (the conversions then wait on their
  // own read only; 32 more registers: multi_wg.cu's contiguous loaders with fp32 scales).
  uint4 in[kSteps][2];
  auto read = [&](int i, int which) __attribute__((always_inline)) {
    const int idx = static_cast<int>(threadIdx.x) + i * L::kLoadThreads;
    return *reinterpret_cast<const uint4*>(stage + (which ? L::Stage::kV : L::Stage::kK) +
                                           L::Stage::offset(idx % L::kTokens, idx / L::kTokens));
  };
  if constexpr (READ_FIRST) {
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {
      in[i][0] = read(i, 0);
      in[i][1] = read(i, 1);
    }
  }
#pragma unroll
  for (int i = 0; i < kSteps; ++i) {
    // Consecutive threads take consecutive tokens of one chunk column: the eight rows of a
    // 16-byte access phase have distinct swizzled chunks (no bank conflicts), read and write.
    const int idx = static_cast<int>(threadIdx.x) + i * L::kLoadThreads;
    const int t = idx % L::kTokens, ch = idx / L::kTokens;
#pragma unroll
    for (int which = 0; which < 2; ++which) {
      const uint4 w = READ_FIRST ? in[i][which] : read(i, which);
      const uint32_t words[4] = {w.x, w.y, w.z, w.w};
      uint32_t h[8];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint32_t u = words[k] ^ 0x80808080u;
        h[2 * k] = int8_pair<0x4140u>(u);
        h[2 * k + 1] = int8_pair<0x4342u>(u);
      }
      char* dst = copy + (which ? L::kCopyV : 0);
      *reinterpret_cast<uint4*>(dst + L::at(t, 2 * ch)) = make_uint4(h[0], h[1], h[2], h[3]);
      *reinterpret_cast<uint4*>(dst + L::at(t, 2 * ch + 1)) = make_uint4(h[4], h[5], h[6], h[7]);
    }
  }
  if constexpr (TOKEN_SCALES) {
    static_assert(L::kLoadThreads == 2 * L::kTokens, "one scale per loading thread");
    // K scales then V scales: contiguous in both. The V scales' warps also leave their
    // largest (softmax_tile's reference), so that the computing warps need not find it.
    const float scale = reinterpret_cast<const float*>(stage + L::Stage::kKScale)[threadIdx.x];
    const bool v = threadIdx.x >= L::kTokens;  // warp-uniform
    reinterpret_cast<float*>(copy + (v ? L::kCopyVScale : L::kCopyKScale))[L::scale_at(
        threadIdx.x % L::kTokens)] = scale;
    if (v) {
      const float top = warp_max_xor(scale, 16);
      if (threadIdx.x % 32 == 0)
        reinterpret_cast<float*>(copy + L::kCopyVMax)[(threadIdx.x - L::kTokens) / 32] = top;
    }
  }
}

constexpr float kLazyMax = 8.f;  // log2 of the largest P between rescales (softmax_tile)

// The V side of the online softmax with per-token V scales: P carries each token's V scale
// relative to the largest seen (`top`, so that P stays in [0, 1], fp16's range); the division
// by `top` rides in the exponent as `shift` = log2(top), so the running sum l and the
// accumulators are kept in units of 1 / top (rescaled with the maximum's correction when top
// grows). Without token scales both stay 1 and 0.
struct VRef {
  float top = 0.f;    // the largest V scale seen (0: none positive yet)
  float shift = 0.f;  // log2(top), 0 while top is 0
};

// This lane's 16 K or V scales (OFFSET: kCopyKScale or kCopyVScale) of a widened tile, read as
// four 16-byte words of its row (widen_tile's scale_at); pair(j): columns 8 j + 2 c and + 1.
// The K scales are read before the scores' wait so that their latency is hidden.
template <int HEAD_DIM, bool TOKEN_SCALES, int OFFSET>
struct LaneScales {
  float4 w[TOKEN_SCALES ? 4 : 1];
  __device__ __forceinline__ void load(const char* copy, int c) {
    if constexpr (TOKEN_SCALES) {
      const float4* row = reinterpret_cast<const float4*>(copy + OFFSET) +
                          c * WgLayout<HEAD_DIM>::kScaleRow / 4;
#pragma unroll
      for (int i = 0; i < 4; ++i) w[i] = row[i];
    }
  }
  __device__ __forceinline__ float2 pair(int j) const {
    return j & 1 ? make_float2(w[j / 2].z, w[j / 2].w) : make_float2(w[j / 2].x, w[j / 2].y);
  }
};
template <int HEAD_DIM, bool TOKEN_SCALES>
using KScales = LaneScales<HEAD_DIM, TOKEN_SCALES, WgLayout<HEAD_DIM>::kCopyKScale>;

// One tile's scores -> P (fp16 A fragments of O += P V) and the online softmax's state, in
// base 2: per-token K scales (`ks`, this lane's, of the widened tile at `copy`) on the score
// columns, V scales folded into P (VRef); the columns past a row's visible end (`visible`,
// from column col0) masked only where some row stops inside the tile (`masked`: a branch
// around the masking alone, so that the softmax's code exists once in the loop: two inlined
// copies made the loops long enough to miss in the instruction cache, PERF_NOTES m13). m: the
// rows' maxima of the scaled scores; the rows' output is O / l and their LSE
// m + shift + log2(l).
template <int HEAD_DIM, bool TOKEN_SCALES, int kNB = WgLayout<HEAD_DIM>::kTokens / 8>
__device__ __forceinline__ void softmax_tile(float (&s)[4 * kNB], uint32_t (&a)[kNB / 2][4],
                                             float (&m)[2], float (&l)[2], VRef& vr,
                                             float (&corr)[2], const float (&row_const)[2],
                                             const KScales<HEAD_DIM, TOKEN_SCALES>& ks,
                                             const char* copy, bool masked, int col0,
                                             const int (&visible)[2], int c) {
  using L = WgLayout<HEAD_DIM>;
  static_assert(kNB == 8, "LaneScales: 16 scales per lane");
  // Scores stay unscaled until the exponent (row_const > 0 keeps the maximum's position):
  // one FFMA per score applies the row's scale and subtracts its maximum.
  if constexpr (TOKEN_SCALES) {
#pragma unroll
    for (int j = 0; j < kNB; ++j) {
      const float2 k = ks.pair(j);
#pragma unroll
      for (int e = 0; e < 4; ++e) s[4 * j + e] *= (e & 1) ? k.y : k.x;
    }
  }
  if (masked) {
#pragma unroll
    for (int j = 0; j < kNB; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (col0 + 8 * j + 2 * c + (e & 1) >= visible[e >> 1]) s[4 * j + e] = kNegInf;
  }
  float2 vs[kNB];
  const float shift_before = vr.shift;
  if constexpr (TOKEN_SCALES) {
    LaneScales<HEAD_DIM, TOKEN_SCALES, L::kCopyVScale> v;
    v.load(copy, c);
#pragma unroll
    for (int j = 0; j < kNB; ++j) vs[j] = v.pair(j);
    const float2 tile_top = *reinterpret_cast<const float2*>(copy + L::kCopyVMax);
    const float top = fmaxf(vr.top, fmaxf(tile_top.x, tile_top.y));
    if (top != vr.top) {  // uniform over the warp (the tile's largest, from shared memory)
      vr.top = top;
      vr.shift = __log2f(top);
    }
  }
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    // Pairwise trees (not one chain): the two rows' max and sum are short dependency chains.
    float part[kNB];
#pragma unroll
    for (int j = 0; j < kNB; ++j) part[j] = fmaxf(s[4 * j + 2 * hr], s[4 * j + 2 * hr + 1]);
#pragma unroll
    for (int width = kNB / 2; width > 0; width /= 2)
#pragma unroll
      for (int j = 0; j < width; ++j) part[j] = fmaxf(part[j], part[j + width]);
    // The maximum moves only when the tile's exceeds it by more than kLazyMax (FA4's lazy
    // rescale): P <= 2^kLazyMax (fp16 holds it exactly as well), and most tiles then leave
    // every row's maximum, so rescale_rows skips the accumulators.
    const float mx = warp_max_xor(part[0], 2) * row_const[hr];
    const float m_new = mx > m[hr] + kLazyMax ? mx : m[hr];
    const float m_use = m_new == kNegInf ? 0.f : m_new;  // a row with nothing visible yet
    const float offset = m_use + vr.shift;
    corr[hr] = fast_exp2(m[hr] + shift_before - offset);  // 0 while the row saw nothing
    m[hr] = m_new;
#pragma unroll
    for (int j = 0; j < kNB; ++j) {
      s[4 * j + 2 * hr] = fast_exp2(fmaf(s[4 * j + 2 * hr], row_const[hr], -offset));
      s[4 * j + 2 * hr + 1] = fast_exp2(fmaf(s[4 * j + 2 * hr + 1], row_const[hr], -offset));
      part[j] = s[4 * j + 2 * hr] + s[4 * j + 2 * hr + 1];
    }
#pragma unroll
    for (int width = kNB / 2; width > 0; width /= 2)
#pragma unroll
      for (int j = 0; j < width; ++j) part[j] += part[j + width];
    l[hr] = l[hr] * corr[hr] + part[0];
  }
#pragma unroll
  for (int kt = 0; kt < kNB / 2; ++kt) {  // k = tokens 16 kt .. 16 kt + 15
    const float* lo = s + 4 * (2 * kt);
    const float* hi = s + 4 * (2 * kt + 1);
    if constexpr (TOKEN_SCALES) {
      const float2 rl = vs[2 * kt], rh = vs[2 * kt + 1];
      a[kt][0] = pack2<f16>(lo[0] * rl.x, lo[1] * rl.y);
      a[kt][1] = pack2<f16>(lo[2] * rl.x, lo[3] * rl.y);
      a[kt][2] = pack2<f16>(hi[0] * rh.x, hi[1] * rh.y);
      a[kt][3] = pack2<f16>(hi[2] * rh.x, hi[3] * rh.y);
    } else {
      a[kt][0] = pack2<f16>(lo[0], lo[1]);
      a[kt][1] = pack2<f16>(lo[2], lo[3]);
      a[kt][2] = pack2<f16>(hi[0], hi[1]);
      a[kt][3] = pack2<f16>(hi[2], hi[3]);
    }
  }
}

// S = Q K^T for a warpgroup: Q's A fragments in registers (qa[kk]: dims 16 kk .. + 15), K from
// the widened copy.
template <int HEAD_DIM>
__device__ __forceinline__ void issue_scores(float (&s)[32], const uint32_t (&qa)[HEAD_DIM / 16][4],
                                             uint32_t copy) {
  const uint64_t k = sw128_descriptor(copy, 16, 1024);
  wgmma_m64n64k16_rs_kmajor<true>(s, qa[0], k);
#pragma unroll
  for (int kk = 1; kk < HEAD_DIM / 16; ++kk) {
    const uint32_t at = (kk >> 2) * WgLayout<HEAD_DIM>::kBlockBytes + (kk & 3) * 32;
    wgmma_m64n64k16_rs_kmajor<false>(s, qa[kk], descriptor_plus(k, at));
  }
  wgmma_commit();
}

template <int HEAD_DIM>
__device__ __forceinline__ void issue_values(float (&o)[HEAD_DIM / 2], const uint32_t (&a)[4][4],
                                             uint32_t copy) {
  using L = WgLayout<HEAD_DIM>;
  const uint64_t v0 = sw128_descriptor(copy + L::kCopyV, L::kBlockBytes, 1024);
#pragma unroll
  for (int kt = 0; kt < 4; ++kt) {
    const uint64_t v = descriptor_plus(v0, kt * 16 * 128);
    if constexpr (HEAD_DIM == 128)
      wgmma_m64n128k16_rs(o, a[kt], v, 1);
    else
      wgmma_m64n64k16_rs(o, a[kt], v, 1);
  }
  wgmma_commit();
}

}  // namespace llfd
