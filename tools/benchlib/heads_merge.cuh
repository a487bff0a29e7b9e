// The heads-together probe kernel's split merges (heads.cu): in a thread-block cluster or by
// the last CTA to arrive, over all HK * GROUP query heads of a CTA at once.
#pragma once
#include "decode_merge.cuh"

namespace llfd {

// The cluster merge's slots (CLUSTER): per split, the CTA's compact quads of every head
// (decode_merge.cuh Quads, head of the CTA slowest), then its HK * GROUP base-2 LSEs padded to 4
// floats; kBytes of each are stored.
template <int HEAD_DIM, int GROUP, int HK>
struct HeadsSlots {
  using Q = Quads<HEAD_DIM, GROUP>;
  static constexpr int kQuads = HK * Q::kCompact;
  static constexpr int kLse = 4 * kQuads;
  static constexpr int kFloats = kLse + (HK * GROUP + 3) / 4 * 4;
  static constexpr int kBytes = 4 * (kLse + HK * GROUP);
};

// The leader's merge of the cluster's slots (HeadsSlots): decode_merge.cuh leader_merge over
// the quads of HK heads.
template <int HEAD_DIM, int GROUP, int HK, typename QT>
__device__ void leader_merge_heads(const DecodeParams& p, int b, int x, int active,
                                   const float* slots) {
  using Q = Quads<HEAD_DIM, GROUP>;
  using Slots = HeadsSlots<HEAD_DIM, GROUP, HK>;
  for (int idx = threadIdx.x; idx < Slots::kQuads; idx += blockDim.x) {
    const int head_of_cta = idx / Q::kCompact;
    const Q quad(idx % Q::kCompact);
    const HeadChunk<GROUP, false> hc(p, x * HK + head_of_cta);
    const int lse_at = Slots::kLse + head_of_cta * GROUP + quad.head0;
    float best[2] = {kNegInf, kNegInf}, total[2] = {0.f, 0.f};
    for (int r = 0; r < active; ++r)
#pragma unroll
      for (int col = 0; col < Q::kHeads; ++col)
        best[col] = fmaxf(best[col], slots[r * Slots::kFloats + lse_at + col]);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int r = 0; r < active; ++r) {
      float w[2] = {0.f, 0.f};
#pragma unroll
      for (int col = 0; col < Q::kHeads; ++col) {
        w[col] = fast_exp2(slots[r * Slots::kFloats + lse_at + col] - best[col]);
        total[col] += w[col];
      }
      const float4 v = *reinterpret_cast<const float4*>(slots + r * Slots::kFloats + 4 * idx);
      acc.x += w[0] * v.x; acc.y += w[1] * v.y; acc.z += w[0] * v.z; acc.w += w[1] * v.w;
    }
    float inv[2] = {0.f, 0.f};
#pragma unroll
    for (int col = 0; col < Q::kHeads; ++col) inv[col] = 1.f / total[col];
    quad.template store_output<QT>(
        p, b, hc, make_float4(acc.x * inv[0], acc.y * inv[1], acc.z * inv[0], acc.w * inv[1]));
    if (p.lse != nullptr && quad.writes_lse())
#pragma unroll
      for (int col = 0; col < Q::kHeads; ++col)
        p.lse[hc.row(p, b, quad.head0 + col)] = (best[col] + __log2f(total[col])) * kLn2;
  }
}

// Merge the splits of the HK * GROUP query heads of head group x, all rows at once (decode_merge
// merge_splits per row block would cost its round trips once per KV head, at the kernel's
// tail). `scratch`: kMaxSplits * HK * GROUP + 2 * HK * GROUP floats.
template <int HEAD_DIM, int GROUP, int HK, typename QT>
__device__ void merge_head_splits(const DecodeParams& p, int b, int x, int active,
                                  float* scratch) {
  constexpr int kRows = HK * GROUP, kQuads = HEAD_DIM / 4;
  // Row r (KV head x * HK + r / GROUP, query row r % GROUP), split s: partial part(r, s).
  const int64_t first = (static_cast<int64_t>(b) * p.num_kv_heads + x * HK) * p.num_splits;
  auto part = [&](int r, int s) { return (first + (r / GROUP) * p.num_splits + s) * GROUP + r % GROUP; };
  float* weight = scratch;                          // [active][kRows]
  float* row_total = scratch + kMaxSplits * kRows;  // [kRows]
  float* row_best = row_total + kRows;              // [kRows]
  for (int i = threadIdx.x; i < active * kRows; i += blockDim.x)
    weight[i] = __ldcg(p.partial_lse + part(i % kRows, i / kRows));
  __syncthreads();
  if (threadIdx.x < kRows) {
    const int row = threadIdx.x;
    float best = kNegInf, total = 0.f;
    for (int s = 0; s < active; ++s) best = fmaxf(best, weight[s * kRows + row]);
    for (int s = 0; s < active; ++s) {
      const float w = fast_exp2(weight[s * kRows + row] - best);
      weight[s * kRows + row] = w;
      total += w;
    }
    row_total[row] = total;
    row_best[row] = best;
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < kRows * kQuads; idx += blockDim.x) {
    const int row = idx / kQuads, d = 4 * (idx % kQuads);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = 0; s0 < active; s0 += 8) {
      float4 v[8];
#pragma unroll
      for (int k = 0; k < 8; ++k)
        if (s0 + k < active)
          v[k] = __ldcg(reinterpret_cast<const float4*>(p.partial_out + part(row, s0 + k) * HEAD_DIM + d));
#pragma unroll
      for (int k = 0; k < 8; ++k)
        if (s0 + k < active) {
          const float w = weight[(s0 + k) * kRows + row];
          acc.x += w * v[k].x; acc.y += w * v[k].y; acc.z += w * v[k].z; acc.w += w * v[k].w;
        }
    }
    const float inv = 1.f / row_total[row];
    const int head = x * kRows + row;
    uint16_t* dst = static_cast<uint16_t*>(p.out) + b * p.out_batch_stride +
                    head * p.out_head_stride + d;
    dst[0] = from_float<QT>(acc.x * inv); dst[1] = from_float<QT>(acc.y * inv);
    dst[2] = from_float<QT>(acc.z * inv); dst[3] = from_float<QT>(acc.w * inv);
    if (p.lse != nullptr && d == 0)
      p.lse[b * p.num_kv_heads * GROUP + head] = (row_best[row] + __log2f(row_total[row])) * kLn2;
  }
}

}  // namespace llfd
