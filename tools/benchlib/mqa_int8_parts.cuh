// mqa_int8.cu's parts: its parameter block and shared-memory layout, the s8 wgmma of
// S = Q K^T, q quantized per row into its A fragments, and the widening of V (PERF_NOTES v39).
#pragma once
#include "multi_wg_rows.cuh"  // softmax_tile, issue_values, rescale_rows
#include "tma.cuh"

namespace llfd {
struct MqaParams {
  const uint16_t* q;  // [B][Hkv * group][128] fp16
  const float* k_scale;  // [B][Hkv][capacity]
  const float* v_scale;
  const int32_t* seq_lens;
  uint16_t* out;  // like q
  int64_t q_batch_stride, out_batch_stride, scale_batch_stride;  // elements
  float score_scale_log2;
  int group, num_kv_heads, capacity;
};
// K and V as (128 bytes, capacity, B * Hkv), boxes of (128, 64, 1), 128-byte swizzle.
struct MqaMaps { TensorMap k, v; };

template <int STAGES, int COPIES, int TEAMS = 1>
struct MqaLayout {
  using W = WgLayout<128>;
  static constexpr int kTokens = 64;
  static constexpr int kK = 0, kV = 64 * 128, kKScale = 2 * 64 * 128, kVScale = kKScale + 256;
  static constexpr int kStageBytes = (kVScale + 256 + 1023) / 1024 * 1024;  // swizzle atoms
  static constexpr uint32_t kTx = 2 * 64 * 128 + 2 * 256;
  // A copy is WgLayout's V and scale regions; its base lies kCopyV before them.
  static constexpr int kCopySpan = W::kCopyBytes - W::kCopyV;
  static constexpr int kCopy0 = STAGES * kStageBytes;
  // Two teams: the second's accumulators ([64][128 threads]), then its rows' offsets and sums
  // ([2][128] each), over the first two stages once both teams' loops are done.
  static constexpr int kMerge = 0;
  static constexpr int kBytes = kCopy0 + COPIES * kCopySpan;
  static_assert(TEAMS == 1 || 68 * 128 * 4 <= STAGES * kStageBytes, "the merge fits the stages");
  static_assert(kCopySpan % 1024 == 0 && kCopy0 >= W::kCopyV, "aligned copies in the window");
};

// Tile j's slot in a ring of N and the parity of its lap around it. Tile indices are never
// negative: unsigned arithmetic spares signed division's fix-ups (four uniform instructions
// per use, on every tile step).
template <int N>
__device__ __forceinline__ int slot(int j) {
  return static_cast<int>(static_cast<unsigned>(j) % N);
}
template <int N>
__device__ __forceinline__ uint32_t lap(int j) {
  return (static_cast<unsigned>(j) / N) & 1u;
}

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

// This lane's rows r_lo and r_lo + 8 of the group, quantized per row: int8 = rint(x * inv),
// inv = 127 / the row's largest |x|, the row's scale 1 / inv (in fp32, as
// benchlib/mqa_int8.py's oracle does; one division per row: 64 IEEE divisions per lane were
// a long prologue). Rows past the group are zero. row_const: the score scale in base 2 times
// the row's scale.
__device__ __forceinline__ void load_query_s8(uint32_t (&qa)[4][4], float (&row_const)[2],
                                              const MqaParams& p, int b, int kvh, int r_lo,
                                              int c) {
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = r_lo + 8 * hr;
    const uint16_t* row = p.q + b * p.q_batch_stride + static_cast<int64_t>(kvh * p.group + r) * 128;
    float x[4][2][4];
    float top = 0.f;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint2 w = r < p.group ? *reinterpret_cast<const uint2*>(row + 32 * kk + 16 * h + 4 * c)
                                    : make_uint2(0u, 0u);
        const uint32_t words[2] = {w.x, w.y};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          x[kk][h][e] = half_to_float(static_cast<uint16_t>(words[e / 2] >> (16 * (e % 2))));
          top = fmaxf(top, fabsf(x[kk][h][e]));
        }
      }
    top = warp_max_xor(top, 2);  // the row's four lanes
    const float inv = top > 0.f ? __fdiv_rn(127.f, top) : 0.f;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t packed = 0;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int v = __float2int_rn(__fmul_rn(x[kk][h][e], inv));
          packed |= static_cast<uint32_t>(min(127, max(-127, v)) & 0xff) << (8 * e);
        }
        qa[kk][hr + 2 * h] = packed;
      }
    row_const[hr] = fmaxf(p.score_scale_log2 * (top > 0.f ? __fdiv_rn(1.f, inv) : 0.f),
                          1.17549435e-38f);
  }
}

// Where the widener leaves a tile's fp16 V scales (relative to the copy's base, like WgLayout's
// offsets): at kCopyVMax the two half tiles' largest |V scale|, then the log2 and reciprocal
// of the power of two at or above each (6 floats); then lane c's 16 scales of columns
// 8 j + 2 c + e at [c][2 j + e], each relative to its half tile's power (j < 4: tokens 0 .. 31),
// rows of 48 bytes (16 scales, 8 bytes against conflicts).
struct HalfScales {
  using W = WgLayout<128>;
  static constexpr int kVTop = W::kCopyVMax;
  static constexpr int kRow = 48;
  static constexpr int kAt = W::kCopyVMax + 32;
  static constexpr int kEnd = kAt + 4 * kRow;
  __device__ static __forceinline__ int at(int t) {  // bytes
    return ((t >> 1) & 3) * kRow + 4 * (t >> 3) + 2 * (t & 1);
  }
};
static_assert(HalfScales::kEnd - WgLayout<128>::kCopyV <= MqaLayout<2, 2>::kCopySpan,
              "the fp16 V scales fit a copy");

// The smallest power of two at or above |x| (a normal float; zero and subnormals give 0): its
// log2 and reciprocal, both exact, by integer steps (no MUFU, no rounding): the V references.
__device__ __forceinline__ void pow2_above(float x, float& log2_out, float& inv_out) {
  const uint32_t bits = __float_as_uint(x) & 0x7fffffffu;
  const int biased = static_cast<int>(bits >> 23);
  const int e = min(biased - 127 + ((bits & 0x7fffffu) != 0u), 126);
  log2_out = biased ? static_cast<float>(e) : 0.f;
  inv_out = biased ? __uint_as_float(static_cast<uint32_t>(127 - e) << 23) : 0.f;
}

// A landed tile's V (int8, TMA's swizzle = MultiTile's) -> fp16 in the copy, and its K and V
// scales into the copy's rows (widen_tile's scale half), in two steps: load() reads the stage
// and converts in registers (the stage is then free), store() writes the copy (once its last
// reader is done). V scales of tokens at or past `len` are zeroed: their P is 0, but the pool
// may hold anything there. tid: the thread within the widening warpgroup. HALF_SCALES adds
// softmax_h16's: each V scale relative to its half tile's largest magnitude (found by one
// redux on the magnitudes' bits, which order as unsigned integers), relative in fact to the
// power of two at or above it (pow2_above: exact scaling), with that power's log2 and
// reciprocal; otherwise the half tiles' largest values, for softmax_tile.
template <int STAGES, int COPIES, bool CONVERT = true, bool HALF_SCALES = false>
struct VWidening {
  using L = MqaLayout<STAGES, COPIES>;  // the stage layout does not depend on TEAMS
  using W = WgLayout<128>;
  using T = MultiTile<128, 64, 128>;
  static constexpr int kChunks = CONVERT ? 4 : 0;  // chunk i: tokens (tid + 128 i) % 64
  uint32_t h[kChunks > 0 ? kChunks : 1][8];
  float scale, top, lht, inv;
  uint32_t scale_half;

  __device__ __forceinline__ void load(const char* stage, int t0, int len, int tid) {
    uint4 in[kChunks > 0 ? kChunks : 1];
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int idx = tid + 128 * i;
      in[i] = *reinterpret_cast<const uint4*>(stage + L::kV + T::offset(idx % 64, idx / 64));
    }
    const int token = tid % 64;
    const bool v = tid >= 64;  // warp-uniform: warps 0-1 K scales, 2-3 V scales
    const float raw = reinterpret_cast<const float*>(stage + L::kKScale)[tid];
    scale = v && t0 + token >= len ? 0.f : raw;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const uint32_t words[4] = {in[i].x, in[i].y, in[i].z, in[i].w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {  // as multi_wg_tiles.cuh's widen_tile converts a chunk
        const uint32_t u = words[k] ^ 0x80808080u;
        h[i][2 * k] = int8_pair<0x4140u>(u);
        h[i][2 * k + 1] = int8_pair<0x4342u>(u);
      }
    }
    if (v) {
      if constexpr (HALF_SCALES) {
        top = __uint_as_float(
            __reduce_max_sync(0xffffffffu, __float_as_uint(scale) & 0x7fffffffu));
        pow2_above(top, lht, inv);
        scale_half = pack2<f16>(scale * inv, 0.f);  // exact but for fp16's rounding
      } else {
        top = warp_max_xor(scale, 16);
      }
    }
  }

  __device__ __forceinline__ void store(char* copy, int tid) const {
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int idx = tid + 128 * i, t = idx % 64, ch = idx / 64;
      char* dst = copy + W::kCopyV;
      *reinterpret_cast<uint4*>(dst + W::at(t, 2 * ch)) =
          make_uint4(h[i][0], h[i][1], h[i][2], h[i][3]);
      *reinterpret_cast<uint4*>(dst + W::at(t, 2 * ch + 1)) =
          make_uint4(h[i][4], h[i][5], h[i][6], h[i][7]);
    }
    const int token = tid % 64;
    const bool v = tid >= 64;
    reinterpret_cast<float*>(copy + (v ? W::kCopyVScale : W::kCopyKScale))[W::scale_at(token)] =
        scale;
    if (v) {
      const int half = tid / 32 - 2;
      float* const tops = reinterpret_cast<float*>(copy + W::kCopyVMax);
      if (tid % 32 == 0) tops[half] = top;
      if constexpr (HALF_SCALES) {
        *reinterpret_cast<uint16_t*>(copy + HalfScales::kAt + HalfScales::at(token)) =
            static_cast<uint16_t>(scale_half);
        if (tid % 32 == 0) tops[2 + half] = lht, tops[4 + half] = inv;
      }
    }
  }
};

}  // namespace llfd
