// Per-CTA phase timestamps for a scratch build (tools/phase_trace/phases.py; PERF_NOTES v13,
// v28, v43).
// Not part of the library: copy this header into lowlevel_fd/cu/, apply a marks patch
// (multi_wg_marks.patch: the 128-row warpgroup kernel and the split merge kernel, read by
// phases.py; multi_q8_marks.patch: the int8-q kernel and the merge kernel, read by phases.py
// --int8-q; decode_marks.patch: the decode kernel, read by phases_decode.py), run the script
// on the device, then revert both. A record is 8 words: [0] the kind (low byte) and
// blockIdx x / y / z (bits 8, 24, 40), [1..7] %globaltimer stamps (ns), 0 where not written.
#pragma once
extern "C" {
__device__ unsigned long long llfd_trace[1 << 18];  // 32768 records
__device__ unsigned int llfd_trace_n;               // records taken (wraps at 32768)
}

__device__ __forceinline__ unsigned long long trace_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// A fresh record of this kind for the calling thread; the caller stores its stamps in [1..7].
// The slot is an atomic's return: a warp that stores into its record before its phase ends
// waits that round trip there (1-3 us behind a burst of copies), so marks early in a kernel
// lengthen the phase they stamp (PERF_NOTES v43). Take the slot at the end where that matters.
__device__ __forceinline__ unsigned long long* trace_slot(int kind) {
  const unsigned s = atomicAdd(&llfd_trace_n, 1u) & ((1u << 15) - 1);
  unsigned long long* r = llfd_trace + 8 * s;
  r[0] = static_cast<unsigned long long>(kind) |
         (static_cast<unsigned long long>(blockIdx.x) << 8) |
         (static_cast<unsigned long long>(blockIdx.y) << 24) |
         (static_cast<unsigned long long>(blockIdx.z) << 40);
  for (int i = 1; i < 8; ++i) r[i] = 0;
  return r;
}
