// The separate merge of a MultiPlan's KV splits (plans with splits merged through global
// memory and p.combine set): a second, programmatic launch after the attention kernel, its own
// small program per (head_dim, the kernel's rows per CTA and tokens per tile, query dtype).
// Merged by the last split to arrive instead (multi_rows.cuh merge_if_last), each row tile's
// partials were read by one CTA after a fence and an atomic: 6-10 us of a 28-38 us multi-query
// launch (PERF_NOTES v24). Here every row's quads are merged by their own threads across the
// GPU, with the LSEs and all partials of a quad requested before any is used. The weights,
// sums and their order are merge_tile_splits's, so the output is bitwise the same.
#include "multi_rows.cuh"

namespace llfd {

constexpr int kCombineThreads = 128;

// Grid (Hkv x max_tiles, ROWS / rows per CTA, B), kCombineThreads threads: thread t merges
// quad t % (HEAD_DIM / 4) of row t / (HEAD_DIM / 4) of the CTA's rows of a row tile (the
// attention kernel's blockIdx.x order: the longest tile first).
template <int HEAD_DIM, int ROWS, int TOKENS, typename QT>
__global__ void __launch_bounds__(kCombineThreads)
    multi_combine(const __grid_constant__ MultiParams p) {
  constexpr int kQuads = HEAD_DIM / 4, kRows = kCombineThreads / kQuads;
  static_assert(ROWS % kRows == 0, "a CTA's rows lie in one row tile");
  const int kvh = blockIdx.x % p.num_kv_heads;
  const int tile = p.max_tiles - 1 - static_cast<int>(blockIdx.x) / p.num_kv_heads;
  const int b = blockIdx.z;
  // The lengths and query ranges before the wait: they are the attention kernel's inputs,
  // which it waited for before it let this launch start (its CTAs trigger it after their own
  // wait, or exit after it). One dependent round trip fewer after the wait (PERF_NOTES v28).
  const SequenceRows sr(p, b, ROWS, false);  // the attention kernel raised its flags
  const int row0 = tile * ROWS, local = blockIdx.y * kRows + threadIdx.x / kQuads;
  const int quad = threadIdx.x % kQuads;
  const int tile_rows = min(ROWS, sr.rows - row0);
  int chunk, active = 1;
  const bool live = row0 < sr.rows && !sr.empty(p) && local < tile_rows;
  if (live) tile_splits<TOKENS>(p, sr.limit(p, row0 + tile_rows - 1), chunk, active);
  // Every CTA waits, so that this grid completes only after the attention grid: the next
  // kernel's wait covers both.
  wait_for_previous_grid();
  // The next kernel may launch now where the attention kernel holds one CTA per SM (2):
  // its CTAs cannot pile up beside these. Not with two per SM (1): the next grid, placed
  // around these CTAs, put two on some SMs (mma.sync at B=32 group 32: 24.7-31.2 us from run
  // to run; PERF_NOTES v26).
  if (p.combine == 2) allow_next_grid();
  if (!live || active == 1) return;  // nothing here, or the split wrote its rows itself

  const int64_t base = ((static_cast<int64_t>(b) * p.num_kv_heads + kvh) * p.max_tiles + tile) *
                       p.num_splits;
  const float* lses = p.partial_lse + base * ROWS + local;  // split s at s * ROWS
  const float4* parts = reinterpret_cast<const float4*>(p.partial_out) +
                        (base * ROWS + local) * kQuads + quad;  // split s at s * ROWS * kQuads
  // Up to kS splits per round, every load of a round in flight at once (a loop of dependent
  // loads instead took one L2 round trip per split: 5 us more at 32 splits). Up to kS splits:
  // one round, the LSEs' maximum taken from its own loads; more: the maximum first, in rounds
  // of kMaxRound, then the weighted sum in rounds of kS.
  constexpr int kS = 8, kMaxRound = 16;
  float best = kNegInf;
  for (int s0 = 0; active > kS && s0 < active; s0 += kMaxRound) {
    float w[kMaxRound];
#pragma unroll
    for (int a = 0; a < kMaxRound; ++a)
      w[a] = s0 + a < active ? __ldcg(lses + (s0 + a) * ROWS) : kNegInf;
#pragma unroll
    for (int a = 0; a < kMaxRound; ++a) best = fmaxf(best, w[a]);
  }
  float sum = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s0 = 0; s0 < active; s0 += kS) {
    float w[kS];
    float4 v[kS];
#pragma unroll
    for (int a = 0; a < kS; ++a) {
      const bool live = s0 + a < active;
      w[a] = live ? __ldcg(lses + (s0 + a) * ROWS) : kNegInf;
      v[a] = live ? __ldcg(parts + static_cast<int64_t>(s0 + a) * ROWS * kQuads)
                  : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    if (active <= kS)
#pragma unroll
      for (int a = 0; a < kS; ++a) best = fmaxf(best, w[a]);
#pragma unroll
    for (int a = 0; a < kS; ++a) {
      if (s0 + a >= active) continue;
      const float wa = best == kNegInf ? 0.f : fast_exp2(w[a] - best);
      sum += wa;
      acc.x += wa * v[a].x; acc.y += wa * v[a].y;
      acc.z += wa * v[a].z; acc.w += wa * v[a].w;
    }
  }
  store_merged_quad<QT>(p, sr, kvh, row0, local, quad, acc, sum, best);
}

}  // namespace llfd
