// multi_q8.cu's softmax (PERF_NOTES v40, measured on the probe it grew from): no row maxima in
// front of the exponentials, and P's V scales and row sums in fp16 pairs.
//
// Why: the loop is latency-bound (v39: 0.47 instructions issued per scheduler-cycle,
// no pipe busy), and multi_wg's softmax_tile puts the row maxima (a tree, two shuffles) in
// front of every exponential, then spends one FMUL (the V scale) and one FADD (the sum) per
// score in fp32. P only ever feeds an fp16 MMA, so:
// - Optimistic maxima (FA4's lazy rescale taken further): a tile's exponentials use the rows'
//   current maxima. Only when a lane's half-row sum exceeds kSumCap (or is not finite) does its
//   warp find the maxima (softmax_tile's tree, shuffles and lazy rule) and exponentiate
//   again. Once the running maxima settle that is rare, and the check reads the sums, which
//   are needed anyway.
// - The V scales arrive as fp16 pairs relative to a power of two at or above their half tile's
//   largest (the widener writes them, with that power's log2 and reciprocal: HalfScales): one
//   HMUL2 per pair of packed P applies them, and the exponent carries the half tile's power
//   relative to the running one (VRefH).
// - The row sums add the packed pairs (3 HADD2 per half row), then one FFMA per half into l.
// (ex2.approx.f16x2 was tried first: ptxas splits it into two MUFU.EX2.F16 and a PRMT.)
#pragma once
#include "multi_q8_parts.cuh"

namespace llfd {

// A lane's half-row sums (8 exponentials each) at most 2^12 in the fast path: every P <= 2^12,
// and the sums in fp16 are finite.
constexpr float kSumCap = 4096.f;

// The running reference of the V scales (softmax_tile's VRef, a power of two here, with its
// reciprocal): O and l are kept in units of 2^-shift. V scales must be normal floats or zero.
struct VRefH {
  float top = 0.f;    // the largest |V scale| seen (0: none yet)
  float shift = 0.f;  // log2 of the power of two at or above top (pow2_above), 0 while top is 0
  float inv = 1.f;    // 2^-shift
};

__device__ __forceinline__ uint32_t hadd2(uint32_t a, uint32_t b) {
  uint32_t out;
  asm("add.rn.f16x2 %0, %1, %2;" : "=r"(out) : "r"(a), "r"(b));
  return out;
}
__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  uint32_t out;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(out) : "r"(a), "r"(b));
  return out;
}
__device__ __forceinline__ float2 half2_to_float2(uint32_t h) {
  return make_float2(half_to_float(static_cast<uint16_t>(h & 0xffffu)),
                     half_to_float(static_cast<uint16_t>(h >> 16)));
}

// A row's largest scaled score over this lane's 16 and its row's other three lanes.
__device__ __forceinline__ float row_max(const float (&s)[32], int hr) {
  float p[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) p[j] = fmaxf(s[4 * j + 2 * hr], s[4 * j + 2 * hr + 1]);
  p[0] = fmaxf(p[0], p[4]), p[1] = fmaxf(p[1], p[5]), p[2] = fmaxf(p[2], p[6]);
  p[3] = fmaxf(p[3], p[7]);
  p[0] = fmaxf(p[0], p[2]), p[1] = fmaxf(p[1], p[3]);
  return warp_max_xor(fmaxf(p[0], p[1]), 2);
}

// softmax_tile's contract (per-token K and V scales, head_dim 128), V scales from the copy's
// HalfScales, the state's V reference a VRefH.
__device__ __forceinline__ void softmax_h16(float (&s)[32], uint32_t (&a)[4][4], float (&m)[2],
                                            float (&l)[2], VRefH& vr, float (&corr)[2],
                                            const float (&row_const)[2],
                                            const KScales<128, true>& ks, const char* copy,
                                            bool masked, int col0, const int (&visible)[2],
                                            int c) {
  using H = HalfScales;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float2 k = ks.pair(j);
#pragma unroll
    for (int e = 0; e < 4; ++e) s[4 * j + e] *= (e & 1) ? k.y : k.x;
  }
  if (masked) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (col0 + 8 * j + 2 * c + (e & 1) >= visible[e >> 1]) s[4 * j + e] = kNegInf;
  }
  const float4 top = *reinterpret_cast<const float4*>(copy + H::kVTop);
  const float2 inv_in = *reinterpret_cast<const float2*>(copy + H::kVTop + 16);
  const uint4 vh0 = *reinterpret_cast<const uint4*>(copy + H::kAt + c * H::kRow);
  const uint4 vh1 = *reinterpret_cast<const uint4*>(copy + H::kAt + c * H::kRow + 16);
  const uint32_t vh[8] = {vh0.x, vh0.y, vh0.z, vh0.w, vh1.x, vh1.y, vh1.z, vh1.w};
  // Half tiles of zero V scales carry the running reference: their P is 0, their l counts.
  float lht[2], inv[2], offset[2][2];  // [half]; [row][half]
  auto references = [&]() __attribute__((always_inline)) {
    lht[0] = top.x > 0.f ? top.z : vr.shift, inv[0] = top.x > 0.f ? inv_in.x : vr.inv;
    lht[1] = top.y > 0.f ? top.w : vr.shift, inv[1] = top.y > 0.f ? inv_in.y : vr.inv;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        offset[hr][h] = (m[hr] == kNegInf ? 0.f : m[hr]) + vr.shift - lht[h];
  };
  references();
  corr[0] = corr[1] = 1.f;
  uint32_t e[8][2];  // exp2(x) as fp16 pairs: columns 8 j + 2 c, + 1 of row hr
  float sum[2][2];   // [row][half]
  auto exponentiate = [&]() __attribute__((always_inline)) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const float o = offset[hr][j / 4];
        e[j][hr] = pack2<f16>(fast_exp2(fmaf(s[4 * j + 2 * hr], row_const[hr], -o)),
                              fast_exp2(fmaf(s[4 * j + 2 * hr + 1], row_const[hr], -o)));
      }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t* x = &e[4 * h][0];  // e[4 h + i][hr] = x[2 i + hr]
        const float2 pair = half2_to_float2(
            hadd2(hadd2(x[hr], x[2 + hr]), hadd2(x[4 + hr], x[6 + hr])));
        sum[hr][h] = pair.x + pair.y;
      }
  };
  exponentiate();
  // Half sums within kSumCap bound every P (and stay finite in fp16); a row that saw nothing
  // yet (m = -inf) does not pass. After the update the exponents are at most kLazyMax
  // (softmax_tile's rule).
  const bool ok = m[0] > kNegInf && m[1] > kNegInf && sum[0][0] <= kSumCap &&
                  sum[0][1] <= kSumCap && sum[1][0] <= kSumCap && sum[1][1] <= kSumCap;
  if (!__all_sync(0xffffffffu, ok)) {
    const float shift_before = vr.shift;  // warp-uniform from here: softmax_tile's update
    const float grown = fmaxf(vr.top, fmaxf(top.x, top.y));
    if (grown != vr.top) {
      vr.top = grown;
      pow2_above(grown, vr.shift, vr.inv);  // at or above every tile's reference (lht)
    }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const float mx = row_max(s, hr) * row_const[hr];
      const float m_new = mx > m[hr] + kLazyMax ? mx : m[hr];
      const float m_use = m_new == kNegInf ? 0.f : m_new;
      corr[hr] = fast_exp2(m[hr] + shift_before - (m_use + vr.shift));  // 0 before any
      m[hr] = m_new;
    }
    references();
    exponentiate();
  }
#pragma unroll
  for (int kt = 0; kt < 4; ++kt)  // k = tokens 16 kt .. + 15: columns 8 (2 kt) .., 8 (2 kt + 1) ..
#pragma unroll
    for (int q = 0; q < 4; ++q) a[kt][q] = hmul2(e[2 * kt + q / 2][q % 2], vh[2 * kt + q / 2]);
#pragma unroll
  for (int hr = 0; hr < 2; ++hr)
    l[hr] = fmaf(sum[hr][1], inv[1], fmaf(sum[hr][0], inv[0], l[hr] * corr[hr]));
}

}  // namespace llfd
