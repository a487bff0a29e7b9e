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
template <int HEAD_DIM, int GROUP, typename QT>
__device__ void merge_splits(const DecodeParams& p, int b, int kvh, int active, float* scratch) {
  const int64_t base = (static_cast<int64_t>(b) * p.num_kv_heads + kvh) * p.num_splits;
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
  for (int idx = threadIdx.x; idx < GROUP * kQuads; idx += blockDim.x) {
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
    const int head = kvh * GROUP + row, d = 4 * (idx % kQuads);
    uint16_t* dst = static_cast<uint16_t*>(p.out) + b * p.out_batch_stride +
                    head * p.out_head_stride + d;
    dst[0] = from_float<QT>(acc.x * inv); dst[1] = from_float<QT>(acc.y * inv);
    dst[2] = from_float<QT>(acc.z * inv); dst[3] = from_float<QT>(acc.w * inv);
    if (p.lse != nullptr && d == 0)
      p.lse[b * p.num_kv_heads * GROUP + head] = (row_best[row] + __log2f(row_total[row])) * kLn2;
  }
}

// The cluster merge of one (batch, kv head), push model: every active CTA of the cluster has
// stored its normalised partial [GROUP][HEAD_DIM] and base-2 LSEs [GROUP] into slot `rank` of
// the leader's (rank 0) `slots` through DSMEM and arrived at the cluster barrier; the leader
// waits for the arrivals and merges the slots from its own shared memory. The other CTAs exit
// right after arriving: only the leader waits, and nobody loads remotely. (A first barrier
// phase, arrived at on entry and waited on before the stores, makes sure the leader has
// started: DSMEM may only be accessed in a CTA that is running.) Fixed order over ranks:
// reproducible.
template <int HEAD_DIM, int GROUP>
struct ClusterSlots {
  // A slot: the partial [GROUP][HEAD_DIM], then the GROUP LSEs padded to 4 floats, so every
  // slot starts 16-byte aligned (the leader reads it as float4).
  static constexpr int kOutputs = GROUP * HEAD_DIM, kFloats = kOutputs + (GROUP + 3) / 4 * 4;
};

constexpr int kMaxClusterSplits = 16;  // planner.MAX_CLUSTER (non-portable sm_90 limit)

// Each thread merges 4 consecutive outputs of one row: the row's LSEs of every slot are loaded
// at once, then the 4-float partials of every slot, so the shared-memory loads overlap instead
// of forming one dependent chain per slot.
template <int HEAD_DIM, int GROUP, typename QT>
__device__ void leader_merge(const DecodeParams& p, int b, int kvh, int active,
                             const float* slots) {
  using C = ClusterSlots<HEAD_DIM, GROUP>;
  constexpr int kQuads = HEAD_DIM / 4;
  for (int idx = threadIdx.x; idx < GROUP * kQuads; idx += blockDim.x) {
    const int row = idx / kQuads, d = 4 * (idx % kQuads);
    float lse[kMaxClusterSplits];
    float best = kNegInf;
#pragma unroll
    for (int r = 0; r < kMaxClusterSplits; ++r) {
      lse[r] = r < active ? slots[r * C::kFloats + C::kOutputs + row] : kNegInf;
      best = fmaxf(best, lse[r]);
    }
    float total = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int r = 0; r < kMaxClusterSplits; ++r) {
      if (r < active) {
        const float w = fast_exp2(lse[r] - best);
        const float4 v = *reinterpret_cast<const float4*>(slots + r * C::kFloats + 4 * idx);
        total += w;
        acc.x += w * v.x; acc.y += w * v.y; acc.z += w * v.z; acc.w += w * v.w;
      }
    }
    const float inv = 1.f / total;
    const int head = kvh * GROUP + row;
    uint16_t* dst = static_cast<uint16_t*>(p.out) + b * p.out_batch_stride +
                    head * p.out_head_stride + d;
    dst[0] = from_float<QT>(acc.x * inv); dst[1] = from_float<QT>(acc.y * inv);
    dst[2] = from_float<QT>(acc.z * inv); dst[3] = from_float<QT>(acc.w * inv);
    if (p.lse != nullptr && d == 0)
      p.lse[b * p.num_kv_heads * GROUP + head] = (best + __log2f(total)) * kLn2;
  }
}

}  // namespace llfd
