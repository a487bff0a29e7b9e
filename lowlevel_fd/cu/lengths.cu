// The length bump of a fused decode step (DecodePlan.advance_lengths): its own one-kernel
// program, shared by every decode variant.
#include "kv_types.cuh"

namespace llfd {

// A decode step's end, after every layer's append_and_run: seq_lens[b] += 1 where the fused
// append wrote (0 <= pos < capacity and, in paged storage, the token's page id in range).
__global__ void __launch_bounds__(256) advance_lengths(int32_t* seq_lens, int32_t batch,
                                                       int32_t capacity,
                                                       const int32_t* block_table,
                                                       int64_t table_stride, int32_t num_pages,
                                                       int32_t page_shift) {
  wait_for_previous_grid();  // the step's kernels read the positions first
  for (int b = blockIdx.x * blockDim.x + threadIdx.x; b < batch; b += gridDim.x * blockDim.x) {
    const int pos = seq_lens[b];
    if (pos < 0 || pos >= capacity) continue;
    if (block_table != nullptr &&
        static_cast<unsigned>(block_table[b * table_stride + (pos >> page_shift)]) >=
            static_cast<unsigned>(num_pages))
      continue;
    seq_lens[b] = pos + 1;
  }
}

}  // namespace llfd
