"""Writes lowlevel_fd/cu/wgmma.cuh: the wgmma wrappers whose operand lists are spelled out
(inline PTX has no loops). Run after changing the shapes: python3 tools/gen_wgmma.py"""
from pathlib import Path

TARGET = Path(__file__).resolve().parents[1] / "lowlevel_fd" / "cu" / "wgmma.cuh"


def regs(n, start=0):
    """PTX operand names %start .. %(start + n - 1), comma separated."""
    return ", ".join(f"%{i}" for i in range(start, start + n))


out = []
out.append('''// Hopper warpgroup MMA (wgmma, sm_90a) for the multi-token kernel (multi_wg.cu): shared-memory
// matrix descriptors, the fences, and the few shapes used. A warpgroup (four warps) issues each
// wgmma together; the accumulator fragment of warp w is rows 16 w + g and 16 w + g + 8 (g =
// lane / 4) at columns 8 j + 2 (lane % 4) + {0, 1}: element 4 j + e, e < 2 the first row. The
// operand lists are written out (inline PTX has no loops).
#pragma once
#include "common.cuh"

namespace llfd {

// Descriptor of a 128-byte-swizzled shared-memory operand (atoms of 8 rows x 128 bytes, 1024-byte
// aligned; 16-byte chunk c of row r at r * 128 + 16 * (c ^ (r % 8))). K-major: `stride` bytes
// between 8-row groups (`leading` unused); MN-major (transposed B): `leading` bytes between
// 64-element blocks of N, `stride` between 8-row groups of K.
__device__ __forceinline__ uint64_t sw128_descriptor(uint32_t address, uint32_t leading,
                                                     uint32_t stride) {
  return static_cast<uint64_t>((address & 0x3ffffu) >> 4) |
         (static_cast<uint64_t>(leading >> 4) << 16) |
         (static_cast<uint64_t>(stride >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Generic-proxy writes to shared memory (st.shared, cp.async) made visible to wgmma's reads.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// Keeps the compiler from moving accumulator accesses across the asynchronous MMA.
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
''')
# SS m64n64k16 f16 -> f32
def kmajor_asm(constraint: str, accumulate: int) -> str:
    """The score wgmma's asm statement: "=f" (the first k-step, D only written) or "+f"."""
    return f'''asm volatile(
        "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %37, 0;\\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{{{regs(32)}}}, {{{regs(4, 32)}}}, %36, p, 1, 1, 0;\\n}}\\n"
        : {", ".join(f'"{constraint}"(d[{i}])' for i in range(32))}
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"({accumulate}));'''


out.append(f'''// D[64 x 64] (+)= A[64 x 16] B[16 x 64]^T, A fp16 in registers (mma.sync's A fragment per
// warp), B fp16 K-major in shared memory; `first`: D = A B^T (the registers only written).
template <bool FIRST>
__device__ __forceinline__ void wgmma_m64n64k16_rs_kmajor(float (&d)[32], const uint32_t (&a)[4],
                                                          uint64_t b) {{
  if constexpr (FIRST)
    {kmajor_asm("=f", 0)}
  else
    {kmajor_asm("+f", 1)}
}}
''')
for N in (64, 128):
    nr = N // 2
    out.append(f'''// D[64 x {N}] (+)= A[64 x 16] B[16 x {N}], A fp16 in registers (the accumulator layout of
// columns 16 k .. 16 k + 15, packed in pairs), B fp16 MN-major (transposed) in shared memory.
__device__ __forceinline__ void wgmma_m64n{N}k16_rs(float (&d)[{nr}], const uint32_t (&a)[4],
                                                   uint64_t b, int accumulate) {{
  asm volatile(
      "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{nr + 5}, 0;\\n"
      "wgmma.mma_async.sync.aligned.m64n{N}k16.f32.f16.f16 "
      "{{{regs(nr)}}}, {{{regs(4, nr)}}}, %{nr + 4}, p, 1, 1, 1;\\n}}\\n"
      : {", ".join(f'"+f"(d[{i}])' for i in range(nr))}
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}}
''')
out.append("}  // namespace llfd\n")
TARGET.write_text("\n".join(out))
