// Merging the splits of one (batch, kv head): through global memory (the last CTA to arrive,
// or decode_combine) or through distributed shared memory inside a thread-block cluster.
#pragma once
#include "decode_fragments.cuh"

namespace llfd {

constexpr int kMaxSplits = 128;  // planner.MAX_SPLITS

// Merge the splits of one (batch, kv head): partials are normalised per split with base-2 LSE.
// `scratch` is shared memory for (kMaxSplits + 2) * GROUP floats. The split LSEs are read all at
// once, and the outputs accumulate 8 splits per step with their loads in flight together: a
// loop of dependent L2 reads would cost a round trip per split. Fixed order: reproducible.
template <int HEAD_DIM, int GROUP, typename QT, typename Chunk>
__device__ void merge_splits(const DecodeParams& p, int b, const Chunk& hc, int active,
                             float* scratch) {
  const int64_t base = (static_cast<int64_t>(b) * hc.slots(p) + hc.slot) * p.num_splits;
  const float* lse_in = p.partial_lse + base * GROUP;
  const float4* out_in = reinterpret_cast<const float4*>(p.partial_out + base * GROUP * HEAD_DIM);
  float* weight = scratch;                            // [active][GROUP]
  float* row_total = scratch + kMaxSplits * GROUP;    // [GROUP]
  float* row_best = row_total + GROUP;                // [GROUP]
  for (int i = threadIdx.x; i < active * GROUP; i += blockDim.x) weight[i] = __ldcg(lse_in + i);
  __syncthreads();
  if (threadIdx.x < GROUP) {
    const int row = threadIdx.x;
    float best = kNegInf, total = 0.f;
    for (int s = 0; s < active; ++s) best = fmaxf(best, weight[s * GROUP + row]);
    for (int s = 0; s < active; ++s) {
      const float w = fast_exp2(weight[s * GROUP + row] - best);
      weight[s * GROUP + row] = w;
      total += w;
    }
    row_total[row] = total;
    row_best[row] = best;
  }
  __syncthreads();
  constexpr int kQuads = HEAD_DIM / 4, kSplitStride = GROUP * kQuads;
  for (int idx = threadIdx.x; idx < hc.heads * kQuads; idx += blockDim.x) {
    const int row = idx / kQuads;
    const float4* src = out_in + idx;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    int s = 0;
    for (; s + 8 <= active; s += 8) {
      float4 v[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = __ldcg(src + (s + k) * kSplitStride);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float w = weight[(s + k) * GROUP + row];
        acc.x += w * v[k].x; acc.y += w * v[k].y; acc.z += w * v[k].z; acc.w += w * v[k].w;
      }
    }
    for (; s < active; ++s) {
      const float4 v = __ldcg(src + s * kSplitStride);
      const float w = weight[s * GROUP + row];
      acc.x += w * v.x; acc.y += w * v.y; acc.z += w * v.z; acc.w += w * v.w;
    }
    const float inv = 1.f / row_total[row];
    const int head = hc.first + row, d = 4 * (idx % kQuads);
    uint16_t* dst = static_cast<uint16_t*>(p.out) + b * p.out_batch_stride +
                    head * p.out_head_stride + d;
    dst[0] = from_float<QT>(acc.x * inv); dst[1] = from_float<QT>(acc.y * inv);
    dst[2] = from_float<QT>(acc.z * inv); dst[3] = from_float<QT>(acc.w * inv);
    if (p.lse != nullptr && d == 0)
      p.lse[hc.row(p, b, row)] = (row_best[row] + __log2f(row_total[row])) * kLn2;
  }
}

// The CTA and cluster merges work on accumulator quads, as the warps hold them (decode.cu):
// quad (hb, mb, lane 4g + c) is acc[hb][mb] of that lane, i.e. heads 8hb + 2c (x, z) and
// 8hb + 2c + 1 (y, w) at dims d (x, y) and d + 1 (z, w), d = (D/8) g + 4 (mb/2) + 2 (mb%2).
// A warp stores all kPerWarp of its quads; the merges visit the kCompact ones whose heads
// exist (lanes c < kPairs), numbered c fastest, then g, mb, hb.
template <int HEAD_DIM, int GROUP>
struct Quads {
  static constexpr int kBlocks = GROUP > 8 ? 2 : 1, kMBlocks = Geometry<HEAD_DIM>::kMBlocks;
  static constexpr int kPairs = GROUP >= 8 ? 4 : (GROUP + 1) / 2;  // lanes c with a head
  static constexpr int kHeads = GROUP > 1 ? 2 : 1;                  // heads per quad
  static constexpr int kPerWarp = kBlocks * kMBlocks * 32;
  static constexpr int kCompact = kBlocks * kMBlocks * 8 * kPairs;
  // A cluster slot: the compact quads (fp32), then the GROUP LSEs padded to 4 floats, so
  // every slot starts 16-byte aligned; kSlotBytes of it are stored per CTA.
  static constexpr int kSlotLse = 4 * kCompact;
  static constexpr int kSlotFloats = kSlotLse + (GROUP + 3) / 4 * 4;
  static constexpr int kSlotBytes = 4 * (kSlotLse + GROUP);

  int hb, mb, g, c, head0, d;
  __device__ __forceinline__ explicit Quads(int idx)
      : hb(idx / (8 * kPairs * kMBlocks)), mb(idx / (8 * kPairs) % kMBlocks),
        g(idx / kPairs % 8), c(idx % kPairs), head0(8 * hb + 2 * c),
        d(HEAD_DIM / 8 * g + 4 * (mb / 2) + 2 * (mb % 2)) {}
  // This quad's index among a warp's stored quads.
  __device__ __forceinline__ int stored() const { return (hb * kMBlocks + mb) * 32 + 4 * g + c; }
  // The one quad per head pair that writes the pair's LSEs.
  __device__ __forceinline__ bool writes_lse() const { return g == 0 && mb == 0; }

  // out[b, the chunk's heads head0 and head0 + 1, d and d + 1], for those the chunk has.
  template <typename QT, typename Chunk>
  __device__ __forceinline__ void store_output(const DecodeParams& p, int b, const Chunk& hc,
                                               float4 value) const {
    uint16_t* dst = static_cast<uint16_t*>(p.out) + b * p.out_batch_stride +
                    (hc.first + head0) * p.out_head_stride + d;
    if (!hc.has(head0)) return;
    dst[0] = from_float<QT>(value.x);
    dst[1] = from_float<QT>(value.z);
    if (kHeads == 2 && hc.has(head0 + 1)) {
      dst[p.out_head_stride] = from_float<QT>(value.y);
      dst[p.out_head_stride + 1] = from_float<QT>(value.w);
    }
  }
};

constexpr int kMaxClusterSplits = 16;  // planner.MAX_CLUSTER (non-portable sm_90 limit)

// The cluster merge of one (batch, kv head), push model: every active CTA of the cluster has
// stored its normalised partial (compact quads) and base-2 LSEs into slot `rank` of the
// leader's (rank 0) `slots` with st.async, completing bytes on the leader's mbarrier, and the
// leader has waited for all of them. Each thread merges quads: the LSEs of every slot are
// loaded at once, then the quads, so the shared-memory loads overlap. Fixed order over ranks:
// reproducible.
template <int HEAD_DIM, int GROUP, typename QT, typename Chunk>
__device__ void leader_merge(const DecodeParams& p, int b, const Chunk& hc, int active,
                             const float* slots) {
  using Q = Quads<HEAD_DIM, GROUP>;
  for (int idx = threadIdx.x; idx < Q::kCompact; idx += blockDim.x) {
    const Q quad(idx);
    float lse[Q::kHeads][kMaxClusterSplits], best[Q::kHeads], total[Q::kHeads];
#pragma unroll
    for (int col = 0; col < Q::kHeads; ++col) {
      best[col] = kNegInf;
      total[col] = 0.f;
#pragma unroll
      for (int r = 0; r < kMaxClusterSplits; ++r) {
        lse[col][r] = r < active ? slots[r * Q::kSlotFloats + Q::kSlotLse + quad.head0 + col]
                                 : kNegInf;
        best[col] = fmaxf(best[col], lse[col][r]);
      }
    }
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int r = 0; r < kMaxClusterSplits; ++r) {
      if (r < active) {
        float w[2] = {0.f, 0.f};
#pragma unroll
        for (int col = 0; col < Q::kHeads; ++col) {
          w[col] = fast_exp2(lse[col][r] - best[col]);
          total[col] += w[col];
        }
        const float4 v = *reinterpret_cast<const float4*>(slots + r * Q::kSlotFloats + 4 * idx);
        acc.x += w[0] * v.x; acc.y += w[1] * v.y; acc.z += w[0] * v.z; acc.w += w[1] * v.w;
      }
    }
    float inv[2] = {0.f, 0.f};
#pragma unroll
    for (int col = 0; col < Q::kHeads; ++col) inv[col] = 1.f / total[col];
    quad.template store_output<QT>(
        p, b, hc, make_float4(acc.x * inv[0], acc.y * inv[1], acc.z * inv[0], acc.w * inv[1]));
    if (p.lse != nullptr && quad.writes_lse())
#pragma unroll
      for (int col = 0; col < Q::kHeads; ++col)
        if (hc.has(quad.head0 + col))
          p.lse[hc.row(p, b, quad.head0 + col)] = (best[col] + __log2f(total[col])) * kLn2;
  }
}

}  // namespace llfd
