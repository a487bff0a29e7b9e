// mqa_int8.cu's computing loop over pairs of tiles (PAIRS): a team takes tiles 2p and 2p + 1
// (p = team, team + TEAMS, ...), computes both scores, runs one online-softmax step over their
// 128 tokens (64 scores per lane: twice the independent work per chain, and one set of row
// reductions per 128 tokens), then both P V products. Nothing overlaps inside a team (S, the
// softmax, P V in turn): the other team's work fills the gaps (FA3's ping-pong).
#pragma once
#include "multi_wg_rows.cuh"

namespace llfd {

// One softmax step over two tiles' scores (s[u]: tile u's 32 of this lane, unscaled), as
// softmax_tile does it for one: K scales on the columns, masks past `len`, the lazy maximum,
// V scales folded into P relative to the largest seen (VRef), P packed as the A fragments of
// the two P V products. copies[u]: tile u's copy (WgLayout), col0: tile 0's first token.
__device__ __forceinline__ void softmax_pair(float (&s)[2][32], uint32_t (&a)[2][4][4],
                                             float (&m)[2], float (&l)[2], VRef& vr,
                                             float (&corr)[2], const float (&row_const)[2],
                                             const char* const (&copies)[2], int col0, int len,
                                             int c) {
  using W = WgLayout<128>;
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    KScales<128, true> ks;
    ks.load(copies[u], c);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float2 k = ks.pair(j);
#pragma unroll
      for (int e = 0; e < 4; ++e) s[u][4 * j + e] *= (e & 1) ? k.y : k.x;
    }
    const int first = col0 + 64 * u;
    if (first + 64 > len)
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (first + 8 * j + 2 * c + (e & 1) >= len) s[u][4 * j + e] = kNegInf;
  }
  const float shift_before = vr.shift;
  {
    const float2 t0 = *reinterpret_cast<const float2*>(copies[0] + W::kCopyVMax);
    const float2 t1 = *reinterpret_cast<const float2*>(copies[1] + W::kCopyVMax);
    const float top = fmaxf(fmaxf(vr.top, fmaxf(t0.x, t0.y)), fmaxf(t1.x, t1.y));
    if (top != vr.top) {  // uniform over the warp
      vr.top = top;
      vr.shift = __log2f(top);
    }
  }
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    float part[16];
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int j = 0; j < 8; ++j)
        part[8 * u + j] = fmaxf(s[u][4 * j + 2 * hr], s[u][4 * j + 2 * hr + 1]);
#pragma unroll
    for (int width = 8; width > 0; width /= 2)
#pragma unroll
      for (int j = 0; j < width; ++j) part[j] = fmaxf(part[j], part[j + width]);
    const float mx = warp_max_xor(part[0], 2) * row_const[hr];
    const float m_new = mx > m[hr] + kLazyMax ? mx : m[hr];
    const float m_use = m_new == kNegInf ? 0.f : m_new;
    const float offset = m_use + vr.shift;
    corr[hr] = fast_exp2(m[hr] + shift_before - offset);
    m[hr] = m_new;
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float* x = s[u] + 4 * j + 2 * hr;
        x[0] = fast_exp2(fmaf(x[0], row_const[hr], -offset));
        x[1] = fast_exp2(fmaf(x[1], row_const[hr], -offset));
        part[8 * u + j] = x[0] + x[1];
      }
#pragma unroll
    for (int width = 8; width > 0; width /= 2)
#pragma unroll
      for (int j = 0; j < width; ++j) part[j] += part[j + width];
    l[hr] = l[hr] * corr[hr] + part[0];
  }
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    LaneScales<128, true, W::kCopyVScale> vs;
    vs.load(copies[u], c);
#pragma unroll
    for (int kt = 0; kt < 4; ++kt) {
      const float* lo = s[u] + 4 * (2 * kt);
      const float* hi = s[u] + 4 * (2 * kt + 1);
      const float2 rl = vs.pair(2 * kt), rh = vs.pair(2 * kt + 1);
      a[u][kt][0] = pack2<f16>(lo[0] * rl.x, lo[1] * rl.y);
      a[u][kt][1] = pack2<f16>(lo[2] * rl.x, lo[3] * rl.y);
      a[u][kt][2] = pack2<f16>(hi[0] * rh.x, hi[1] * rh.y);
      a[u][kt][3] = pack2<f16>(hi[2] * rh.x, hi[3] * rh.y);
    }
  }
}

}  // namespace llfd
