// The warpgroup kernels' split merge inside a thread-block cluster (sm_90). When a plan
// launches the KV splits of each row tile as one cluster (grid.y = the cluster's size =
// num_splits, multi/plan.py), every active split leaves its normalised partial rows and their
// base-2 LSEs in its own shared memory (the pipeline's, no longer read); after one cluster
// barrier each active split merges its share of the tile's rows from all of them through
// distributed shared memory, and a second barrier keeps every partial alive until those reads
// are done. It replaces the global partials, the fence, the counter and the last split's
// merge from L2 (multi_rows.cuh merge_if_last), whose round trips were 6-10 us of a 28-38 us
// launch at B=32, multi-query (PERF_NOTES v24). Idle splits exit at once: a cluster barrier
// waits only for threads that have not exited.
#pragma once
#include "multi_rows.cuh"

namespace llfd {

constexpr int kMultiMaxClusterSplits = 8;  // multi/planner.py MAX_CLUSTER_SPLITS (portable)

// A split's partial rows in its shared memory: ROWS rows of HEAD_DIM floats (8 floats of
// padding per row: the accumulators' float2 stores of 8 rows at once fill the 32 banks), then
// ROWS base-2 LSEs.
template <int HEAD_DIM, int ROWS>
struct ClusterPartials {
  static constexpr int kStride = HEAD_DIM + 8;
  static constexpr int kLse = ROWS * kStride;
  static constexpr int kBytes = (kLse + ROWS) * 4;
};

// Merge this split's share of the row tile's rows (rows split evenly over the `active`
// splits) from every active split's partial at `area` (the same offset in each CTA), in a
// fixed order over the splits (reproducible), into out (and lse). All THREADS of the team
// (MergeTeam) of every active CTA of the cluster call it.
template <int HEAD_DIM, int ROWS, typename QT, int THREADS>
__device__ void cluster_merge(const MultiParams& p, const SequenceRows& sr, int kvh, int row0,
                              int tile_rows, int split, int active, const float* area) {
  using C = ClusterPartials<HEAD_DIM, ROWS>;
  using Team = MergeTeam<THREADS>;
  constexpr int kQuads = HEAD_DIM / 4;
  cluster_sync_all();  // every split's partial is in place
  const int share = (tile_rows + active - 1) / active;
  const int first = split * share, rows = max(0, min(tile_rows, first + share) - first);
  for (int idx = Team::tid(); idx < rows * kQuads; idx += Team::size()) {
    const int local = first + idx / kQuads, quad = idx % kQuads;
    // Every split's LSE and quad requested before any is used: the remote loads overlap.
    float lse[kMultiMaxClusterSplits];
    float4 v[kMultiMaxClusterSplits];
    float best = kNegInf;
#pragma unroll
    for (int s = 0; s < kMultiMaxClusterSplits; ++s) {
      if (s >= active) break;
      const uint32_t peer = cluster_address(area, s);
      lse[s] = load_cluster(peer + 4 * (C::kLse + local));
      v[s] = load_cluster4(peer + 4 * (local * C::kStride + 4 * quad));
    }
#pragma unroll
    for (int s = 0; s < kMultiMaxClusterSplits; ++s)
      if (s < active) best = fmaxf(best, lse[s]);
    float sum = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int s = 0; s < kMultiMaxClusterSplits; ++s) {
      if (s >= active) break;
      const float w = best == kNegInf ? 0.f : fast_exp2(lse[s] - best);
      sum += w;
      acc.x += w * v[s].x; acc.y += w * v[s].y; acc.z += w * v[s].z; acc.w += w * v[s].w;
    }
    store_merged_quad<QT>(p, sr, kvh, row0, local, quad, acc, sum, best);
  }
  cluster_sync_all();  // no CTA leaves while another still reads its partial
}

}  // namespace llfd
