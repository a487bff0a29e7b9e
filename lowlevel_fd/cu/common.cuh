// Shared device helpers: fixed-width types, fp16/bf16 conversions, int8 -> fp16 unpacking,
// tensor-core mma. No CUDA headers: NVRTC from PyPI ships none, so everything is inline PTX.
#pragma once

typedef unsigned char uint8_t;
typedef signed char int8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef int int32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;

namespace llfd {

// Storage tags for 16-bit floats; values travel as raw uint16_t bits.
struct f16 {};
struct bf16 {};

template <typename A, typename B> struct is_same { static constexpr bool value = false; };
template <typename A> struct is_same<A, A> { static constexpr bool value = true; };

__device__ __forceinline__ float half_to_float(uint16_t bits) {
  float out;
  asm("cvt.f32.f16 %0, %1;" : "=f"(out) : "h"(bits));
  return out;
}

__device__ __forceinline__ float bf16_to_float(uint16_t bits) {
  return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}

template <typename T> __device__ __forceinline__ float to_float(uint16_t bits);
template <> __device__ __forceinline__ float to_float<f16>(uint16_t bits) { return half_to_float(bits); }
template <> __device__ __forceinline__ float to_float<bf16>(uint16_t bits) { return bf16_to_float(bits); }

// Two floats to a packed pair (lo in the low half), round to nearest even.
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<f16>(float lo, float hi) {
  uint32_t out;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(hi), "f"(lo));
  return out;
}
template <> __device__ __forceinline__ uint32_t pack2<bf16>(float lo, float hi) {
  uint32_t out;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(hi), "f"(lo));
  return out;
}

template <typename T> __device__ __forceinline__ uint16_t from_float(float x) {
  return static_cast<uint16_t>(pack2<T>(x, 0.f) & 0xffffu);
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t selector) {
  uint32_t out;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(out) : "r"(a), "r"(b), "r"(selector));
  return out;
}

// int8 -> fp16 without I2F: a biased byte u = x + 128 placed under the fp16 exponent of 1024
// (0x64uu) reads as 1024 + u, exact because fp16 has an ulp of 1 on [1024, 2048); subtracting
// 1152 leaves x exactly. `biased` holds four bytes already XORed with 0x80.
__device__ __forceinline__ uint32_t hsub2(uint32_t a, uint32_t b) {
  uint32_t out;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(out) : "r"(a), "r"(b));
  return out;
}
constexpr uint32_t kMagic1152x2 = 0x64806480u;  // fp16 pair (1152, 1152)
constexpr uint32_t kExp1024x4 = 0x64646464u;

// Bytes 0,1 (lo) and 2,3 (hi) of a biased word as two fp16 pairs of x + 1152 (exact): for an
// operand whose product the caller corrects by 1152 x the sum of the other operand.
__device__ __forceinline__ void unpack_word_plus1152(uint32_t biased, uint32_t& lo, uint32_t& hi) {
  lo = prmt(biased, kExp1024x4, 0x4140u);
  hi = prmt(biased, kExp1024x4, 0x4342u);
}

// Bytes 0,1 (lo) and 2,3 (hi) of a biased word as two fp16 pairs.
__device__ __forceinline__ void unpack_word(uint32_t biased, uint32_t& lo, uint32_t& hi) {
  lo = hsub2(prmt(biased, kExp1024x4, 0x4140u), kMagic1152x2);
  hi = hsub2(prmt(biased, kExp1024x4, 0x4342u), kMagic1152x2);
}

// Byte j of word a and byte j of word b as one fp16 pair (a's in the low half).
// `ab_lo` = prmt(a, b, 0x5140) holds a0 b0 a1 b1; `ab_hi` = prmt(a, b, 0x7362) holds a2 b2 a3 b3.
template <int J>
__device__ __forceinline__ uint32_t pair_from_interleaved(uint32_t ab_lo, uint32_t ab_hi) {
  const uint32_t src = (J < 2) ? ab_lo : ab_hi;
  const uint32_t sel = (J % 2 == 0) ? 0x4140u : 0x4342u;
  return hsub2(prmt(src, kExp1024x4, sel), kMagic1152x2);
}

// D(16x8, fp32) += A(16x16, fp16, row) * B(16x8, fp16, col). Fragment ownership for lane l,
// g = l / 4, c = l % 4: A regs {row g k 2c..2c+1, row g+8 k 2c.., row g k 2c+8.., row g+8 k 2c+8..};
// B regs {k 2c..2c+1 col g, k 2c+8.. col g}; D {row g col 2c, 2c+1, row g+8 col 2c, 2c+1}.
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                            uint32_t b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float fast_exp2(float x) {
  float out;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(out) : "f"(x));
  return out;
}

__device__ __forceinline__ float warp_max_xor(float x, int width_mask) {
  for (int offset = 1; offset <= width_mask; offset <<= 1)
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

__device__ __forceinline__ float warp_sum_xor(float x, int width_mask) {
  for (int offset = 1; offset <= width_mask; offset <<= 1)
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// Vector loads of N bytes (N = 8 or 16 or multiples of 16) into 32-bit words, through L2 only:
// the KV cache is streamed once, so keeping it out of L1 leaves L1 to the reused operands.
template <int N>
__device__ __forceinline__ void load_stream(uint32_t* words, const void* ptr) {
  static_assert(N % 8 == 0, "8-byte granules");
  if constexpr (N % 16 == 0) {
#pragma unroll
    for (int i = 0; i < N / 16; ++i) {
      const char* p = static_cast<const char*>(ptr) + 16 * i;
      asm volatile("ld.global.cs.v4.u32 {%0,%1,%2,%3}, [%4];"
                   : "=r"(words[4 * i]), "=r"(words[4 * i + 1]), "=r"(words[4 * i + 2]),
                     "=r"(words[4 * i + 3])
                   : "l"(p));
    }
  } else {
#pragma unroll
    for (int i = 0; i < N / 8; ++i) {
      const char* p = static_cast<const char*>(ptr) + 8 * i;
      asm volatile("ld.global.cs.v2.u32 {%0,%1}, [%2];"
                   : "=r"(words[2 * i]), "=r"(words[2 * i + 1])
                   : "l"(p));
    }
  }
}

}  // namespace llfd

namespace llfd {

// ---- cp.async: global -> shared copies that bypass registers (sm_80+) ----
__device__ __forceinline__ uint32_t shared_address(const void* pointer) {
  uint64_t address;
  asm("cvta.to.shared.u64 %0, %1;" : "=l"(address) : "l"(pointer));
  return static_cast<uint32_t>(address);
}

// 16 bytes, cached in L2 only (.cg): the KV cache is streamed once.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
}

// 16 bytes of which `src_bytes` (16 or 0) are read and the rest zero-filled.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}

// 4 bytes of which `src_bytes` are read and the rest zero-filled (0 reads nothing at all).
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// "memory": the compiler must not move shared-memory reads above the wait.
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
}

}  // namespace llfd

namespace llfd {

// Transpose an 8x8 matrix of 16-bit values held one row-pair per lane (lane l: row l / 4,
// columns 2 (l % 4), +1); afterwards lane l holds row l / 4 of the transpose.
__device__ __forceinline__ uint32_t transpose_8x8(uint32_t x) {
  uint32_t out;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(out) : "r"(x));
  return out;
}

__device__ __forceinline__ float warp_max_xor_from(float x, int first, int last) {
  for (int offset = first; offset <= last; offset <<= 1)
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

__device__ __forceinline__ float warp_sum_xor_from(float x, int first, int last) {
  for (int offset = first; offset <= last; offset <<= 1)
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

}  // namespace llfd

namespace llfd {

// ---- sm_90 thread-block clusters and programmatic dependent launch ----
// The cluster barrier in two halves, for a barrier some CTAs only arrive at: arrive (relaxed:
// no memory ordering) and wait (acquire). A CTA may arrive and exit; wait only waits for
// threads that have not exited.
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
  __trap();
#endif
}

// CTAs in this CTA's cluster (1 without a cluster launch).
__device__ __forceinline__ uint32_t cluster_ctas() {
  uint32_t n = 1;
#if __CUDA_ARCH__ >= 900
  asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
#endif
  return n;
}

// Both halves of the cluster barrier: this CTA's writes before it are visible to every CTA of
// the cluster after it.
__device__ __forceinline__ void cluster_sync_all() {
#if __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n\t"
               "barrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
  __trap();
#endif
}

// A load from a cluster CTA's shared memory (`remote`, from cluster_address).
__device__ __forceinline__ float load_cluster(uint32_t remote) {
  float v = 0.f;
#if __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
#endif
  return v;
}
__device__ __forceinline__ float4 load_cluster4(uint32_t remote) {
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#if __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(remote) : "memory");
#endif
  return v;
}

// The DSMEM address of `local`'s counterpart in CTA `rank`'s shared memory.
__device__ __forceinline__ uint32_t cluster_address(const void* local, uint32_t rank) {
  uint32_t remote = 0;
#if __CUDA_ARCH__ >= 900
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
               : "=r"(remote) : "r"(shared_address(local)), "r"(rank));
#endif
  return remote;
}

// An mbarrier that other CTAs of the cluster complete with st.async: init (then the cluster
// barrier publishes it), the owner's arrival with the bytes to expect, and the wait. The
// stores complete their bytes on the barrier with release semantics at cluster scope, so the
// acquiring wait makes them visible; no fence, no second cluster barrier.
__device__ __forceinline__ void mbarrier_init_for_cluster(uint64_t* barrier, uint32_t arrivals) {
#if __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n\t"
               "fence.mbarrier_init.release.cluster;"
               :: "r"(shared_address(barrier)), "r"(arrivals) : "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void mbarrier_expect_bytes(uint64_t* barrier, uint32_t bytes) {
#if __CUDA_ARCH__ >= 900
  uint64_t state;
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 %0, [%1], %2;"
               : "=l"(state) : "r"(shared_address(barrier)), "r"(bytes) : "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void mbarrier_wait_cluster(uint64_t* barrier, uint32_t parity) {
#if __CUDA_ARCH__ >= 900
  uint32_t done;
  do {
    asm volatile("{\n\t.reg .pred ready;\n\t"
                 "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 ready, [%1], %2;\n\t"
                 "selp.u32 %0, 1, 0, ready;\n\t}"
                 : "=r"(done) : "r"(shared_address(barrier)), "r"(parity) : "memory");
  } while (!done);
#else
  __trap();
#endif
}
// Store into a cluster CTA's shared memory (`remote`, from cluster_address) and complete the
// bytes on its mbarrier `remote_barrier`.
__device__ __forceinline__ void store_cluster_async(uint32_t remote, float4 value,
                                                    uint32_t remote_barrier) {
#if __CUDA_ARCH__ >= 900
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], "
               "{%1, %2, %3, %4}, [%5];"
               :: "r"(remote), "f"(value.x), "f"(value.y), "f"(value.z), "f"(value.w),
                  "r"(remote_barrier) : "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void store_cluster_async(uint32_t remote, float value,
                                                    uint32_t remote_barrier) {
#if __CUDA_ARCH__ >= 900
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];"
               :: "r"(remote), "f"(value), "r"(remote_barrier) : "memory");
#else
  __trap();
#endif
}

// Programmatic dependent launch: wait until the previous kernel on the stream has finished and
// its writes are visible (a no-op when not launched with the attribute), then let the next
// kernel start its own launch early. No-ops before sm_90.
__device__ __forceinline__ void wait_for_previous_grid() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_next_grid() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

}  // namespace llfd
