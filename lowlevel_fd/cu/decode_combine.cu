// The separate merge of decode_split's partials (DecodePlan with a global merge and
// fused_merge off): its own small program, one per (head_dim, heads per CTA, query dtype,
// masked or exact group), so the split variants do not each recompile it.
#include "decode_merge.cuh"

namespace llfd {

// Separate merge of the split partials; grid (kv head x head chunk, batch), 128 threads,
// dynamic shared memory of (kMaxSplits + 2) * GROUP floats.
template <int HEAD_DIM, int GROUP, typename QT, bool MASKED>
__global__ void __launch_bounds__(128) decode_combine(const __grid_constant__ DecodeParams p) {
  extern __shared__ __align__(16) float scratch[];
  wait_for_previous_grid();  // the partials come from decode_split
  const HeadChunk<GROUP, MASKED> hc(p, blockIdx.x);
  const int b = blockIdx.y;
  int chunk, active;
  bool appended;
  if (p.append)
    sequence_splits(p, p.seq_lens[b], appended, chunk, active);
  else
    split_range(clamped_length(p, b), p, chunk, active);
  if (active > 1) merge_splits<HEAD_DIM, GROUP, QT>(p, b, hc, active, scratch);
}

}  // namespace llfd
