// Kernels of the benchmark tools (tools/bench.py, tools/stream_probe.py), not of the library:
//  * read_bandwidth: the device's achievable streaming-read bandwidth, the yardstick every
//    decode result is reported against. It reads exactly like the decode kernel streams the KV
//    cache (16-byte ld.global.cs vectors), so "% of measured bandwidth" compares like with like.
//  * fill_random: fills buffers with pseudo-random bytes on the device. Zero pages can be
//    served faster by some memory systems and make correctness checks vacuous, and uploading
//    tens of GiB of numpy randomness over PCIe would dominate the run time.
#include "common.cuh"  // from lowlevel_fd/cu/: CompileOptions puts it on the include path

namespace llfd {

__device__ __forceinline__ uint32_t xor_words(const uint32_t (&w)[4]) {
  return w[0] ^ w[1] ^ w[2] ^ w[3];
}

// splitmix64: a bijective 64-bit mix, so distinct (seed, index) pairs give distinct streams.
__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace llfd

// Grid-stride read of n_vec 16-byte vectors. Four independent loads per thread per iteration
// keep enough bytes in flight to cover DRAM latency (bandwidth x latency is ~2 MB on an H100,
// ~16 KB per SM). The XOR of every word feeds a store that never happens in practice (the
// accumulator would have to hit one 64-bit value), which keeps each load live without writing
// anything; the loads are also asm volatile, so the compiler cannot drop them.
extern "C" __global__ void read_bandwidth(const uint4* __restrict__ src, unsigned long long n_vec,
                                          unsigned long long* sink) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  uint32_t acc_lo = 0, acc_hi = 0;
  uint32_t w0[4], w1[4], w2[4], w3[4];
  for (; i + 3 * stride < n_vec; i += 4 * stride) {
    llfd::load_stream<16>(w0, src + i);
    llfd::load_stream<16>(w1, src + i + stride);
    llfd::load_stream<16>(w2, src + i + 2 * stride);
    llfd::load_stream<16>(w3, src + i + 3 * stride);
    acc_lo ^= llfd::xor_words(w0) ^ llfd::xor_words(w2);
    acc_hi ^= llfd::xor_words(w1) ^ llfd::xor_words(w3);
  }
  for (; i < n_vec; i += stride) {  // the tail: fewer than 4 strides left
    llfd::load_stream<16>(w0, src + i);
    acc_lo ^= llfd::xor_words(w0);
  }
  const uint64_t acc = (static_cast<uint64_t>(acc_hi) << 32) | acc_lo;
  if (acc == 0x8badf00ddeadbeefull) *sink = acc;
}

// dst[i] = 16 pseudo-random bytes from (seed, i); grid-stride over n_vec vectors.
extern "C" __global__ void fill_random(uint4* __restrict__ dst, unsigned long long n_vec,
                                       unsigned long long seed) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  const uint64_t key = llfd::splitmix64(seed);
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n_vec;
       i += stride) {
    const uint64_t lo = llfd::splitmix64(key ^ (2 * i));
    const uint64_t hi = llfd::splitmix64(key ^ (2 * i + 1));
    dst[i] = make_uint4(static_cast<uint32_t>(lo), static_cast<uint32_t>(lo >> 32),
                        static_cast<uint32_t>(hi), static_cast<uint32_t>(hi >> 32));
  }
}
