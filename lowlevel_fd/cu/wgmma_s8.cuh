// Hopper's int8 warpgroup MMA for multi_q8.cu: S = Q K^T with q quantized to int8 in registers
// (the A operand) and K's int8 tile read where its bulk copy landed it (the B operand, K-major:
// TMA's 128-byte swizzle of 128-byte rows is wgmma's K-major layout). The operand lists are
// written out (inline PTX has no loops).
#pragma once
#include "wgmma.cuh"

namespace llfd {

// D[64 x 64] (+)= A[64 x 32] B[64 x 32]^T in int32: A s8 in registers (this lane: row g bytes
// 4c .. 4c + 3 and 16 + 4c .., then row g + 8's), B s8 K-major in shared memory.
template <bool FIRST>
__device__ __forceinline__ void wgmma_m64n64k32_s8(int (&d)[32], const uint32_t (&a)[4],
                                                   uint64_t b) {
  if constexpr (FIRST)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p;\n}\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]), "=r"(d[4]), "=r"(d[5]), "=r"(d[6]), "=r"(d[7]), "=r"(d[8]), "=r"(d[9]), "=r"(d[10]), "=r"(d[11]), "=r"(d[12]), "=r"(d[13]), "=r"(d[14]), "=r"(d[15]), "=r"(d[16]), "=r"(d[17]), "=r"(d[18]), "=r"(d[19]), "=r"(d[20]), "=r"(d[21]), "=r"(d[22]), "=r"(d[23]), "=r"(d[24]), "=r"(d[25]), "=r"(d[26]), "=r"(d[27]), "=r"(d[28]), "=r"(d[29]), "=r"(d[30]), "=r"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(0));
  else
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p;\n}\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

template <int N>
__device__ __forceinline__ void fence_ints(int (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(d[i])::"memory");
}

// S = Q K^T over the 128 dims in four k-steps of 32 bytes, K at `k_tile` (1024-byte aligned).
__device__ __forceinline__ void issue_scores_s8(int (&s)[32], const uint32_t (&qa)[4][4],
                                                uint32_t k_tile) {
  const uint64_t k = sw128_descriptor(k_tile, 16, 1024);
  wgmma_m64n64k32_s8<true>(s, qa[0], k);
#pragma unroll
  for (int kk = 1; kk < 4; ++kk) wgmma_m64n64k32_s8<false>(s, qa[kk], descriptor_plus(k, 32 * kk));
  wgmma_commit();
}

}  // namespace llfd
