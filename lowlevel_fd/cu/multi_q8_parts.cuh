// multi_q8.cu's parts: its shared-memory layout, ring indices, q quantized per row into the
// int8 MMA's A fragments, the per-token scales fetched ahead, and the widening of V (K is
// never widened: the int8 MMA reads it as landed).
#pragma once
#include "multi_wg_rows.cuh"  // load_rows, wg_store_rows, WgLayout, issue_values, rescale_rows
#include "tma.cuh"
#include "wgmma_s8.cuh"

namespace llfd {

// The CTA: a widening warpgroup, then kTeams computing warpgroups that take alternate tiles.
// STAGES int8 tiles in flight (K then V, 64 tokens x 128 bytes each, swizzled by the copy as
// MultiTile lays them out) and COPIES widened V tiles (WgLayout<128>'s V and scale regions
// only: a copy's base lies kCopyV before them). Two copies per team: a team holds its tile j's
// copy (P V) while it waits for that of j + kTeams (the softmax).
struct Q8Layout {
  using W = WgLayout<128>;
  static constexpr int kTeams = 2, kStages = 4, kCopies = 4;
  static constexpr int kThreads = 128 * (1 + kTeams);
  static constexpr int kTokens = 64, kRows = 64;  // KV tokens per tile, query rows per CTA
  static constexpr int kK = 0, kV = 64 * 128;
  static constexpr int kStageBytes = 2 * 64 * 128;  // 16 KB: whole swizzle atoms
  static constexpr uint32_t kTx = 2 * 64 * 128;     // both boxes, out-of-range rows included
  static constexpr int kCopySpan = W::kCopyBytes - W::kCopyV;
  static constexpr int kCopy0 = kStages * kStageBytes;
  static constexpr int kBytes = kCopy0 + kCopies * kCopySpan;
  // The first team's accumulators ([64][128 threads]), then its rows' offsets and sums
  // ([2][128] each), over the stages once both teams' loops are done.
  static constexpr int kMerge = 0;
  static_assert(68 * 128 * 4 <= kCopy0, "the teams' merge fits the stages");
  static_assert(kCopySpan % 1024 == 0 && kCopy0 >= W::kCopyV, "aligned copies in the window");
  static_assert(kCopies >= 2 * kTeams, "two copies per team");
};
// K and V as (128 bytes, tokens, KV heads, batch) with the cache's strides, boxes of
// (128, 64, 1, 1), 128-byte swizzle (lowlevel_fd/multi/maps.py).
struct Q8Maps { TensorMap k, v; };

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

static_assert(HalfScales::kEnd - WgLayout<128>::kCopyV <= Q8Layout::kCopySpan,
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

// q's rows (load_rows: RoPE and the Hadamard transform applied, fp16, scaled per row by
// row_scale) quantized per row for the int8 MMA: int8 = rint(x * inv), inv = 127 / the row's
// largest |x| (fp32; one division per row), clamped to +-127. A negative score scale flips the
// integers' signs (exact), so that row_const stays positive (softmax_h16 scales after the
// maximum). qf[s][hr], qf[s][2 + hr] hold dims 16 s + 4 c .. + 3 of row hr, which is the A
// fragment's k = 4 c .. + 3 (s even) and 16 + 4 c .. (s odd) of k-step s / 2. Rows past the
// sequence's are zero (row_const then the smallest normal float).
__device__ __forceinline__ void quantize_query_s8(uint32_t (&qa)[4][4], float (&row_const)[2],
                                                  const uint32_t (&qf)[8][4],
                                                  const float (&row_scale)[2], float k_const) {
  const bool flip = k_const < 0.f;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    float x[8][4];
    float top = 0.f;
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      const uint32_t words[2] = {qf[s][hr], qf[s][2 + hr]};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        x[s][e] = half_to_float(static_cast<uint16_t>(words[e / 2] >> (16 * (e % 2))));
        top = fmaxf(top, fabsf(x[s][e]));
      }
    }
    top = warp_max_xor(top, 2);  // the row's four lanes
    const float inv = top > 0.f ? __fdiv_rn(127.f, top) : 0.f;
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      uint32_t packed = 0;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        int v = min(127, max(-127, __float2int_rn(__fmul_rn(x[s][e], inv))));
        if (flip) v = -v;
        packed |= static_cast<uint32_t>(v & 0xff) << (8 * e);
      }
      qa[s / 2][hr + 2 * (s % 2)] = packed;
    }
    const float step = top > 0.f ? __fdiv_rn(1.f, inv) : 0.f;
    row_const[hr] = fmaxf(fabsf(k_const) * row_scale[hr] * step, 1.17549435e-38f);
  }
}

// One per-token scale per widening thread and tile (threads 0-63 K, 64-127 V: token tid % 64),
// copied into the thread's own slot of a ring in shared memory (cp.async, one commit group
// per tile) RING tiles before its widening, so that it arrives with its tile's K and V. Measured
// at B=128, group 64, S=4096 (PERF_NOTES v42): loads into registers two tiles ahead queued
// behind the bulk copies and stalled the widener (62 us); this ring costs 0.8 us over no scales
// at all (50.3 against 49.5); bulk copies of each tile's scales with its K and V (the probe's
// way) cost 9 us here (59.6). Tokens at or past the split's end arrive as 0 without a read: their P is
// 0, but the pool may hold anything. fp16 scales are copied as their aligned 4-byte word (2
// bytes when the scale is its low half, so never past the array; 4 when the high half: the low
// one lies in the same allocation), the half chosen per slot by a bit.
template <typename ScaleT, int RING>
struct ScaleRing {
  const char* base;     // this thread's scale of token 0 (sequence b, KV head kvh)
  int64_t token_bytes;
  uint32_t ring;        // this thread's slot 0; slot s at ring + 512 s
  uint32_t high = 0;    // fp16: bit s, slot s holds the word's high half

  __device__ __forceinline__ ScaleRing(const MultiParams& p, int b, int kvh, int tid,
                                       uint32_t slots) {
    const char* pool = static_cast<const char*>(tid >= 64 ? p.v_scale : p.k_scale);
    base = pool + (b * p.scale_batch_stride + kvh * p.scale_head_stride) *
                      static_cast<int64_t>(sizeof(ScaleT));
    token_bytes = p.scale_token_stride * static_cast<int64_t>(sizeof(ScaleT));
    ring = slots + 4 * tid;
  }
  // Tile t's scale (of token `token`, read if below `end`) into slot t % RING: one group.
  __device__ __forceinline__ void fetch(int t, int token, int end) {
    const int s = slot<RING>(t);
    const bool in = token < end;
    const char* at = base + (in ? token * token_bytes : 0);
    if constexpr (sizeof(ScaleT) == 2) {
      const uint64_t address = reinterpret_cast<uint64_t>(at);
      const uint32_t h = static_cast<uint32_t>(address >> 1) & 1u;
      high = (high & ~(1u << s)) | (h << s);
      cp_async_4(ring + 512 * s, reinterpret_cast<const void*>(address & ~uint64_t(3)),
                 in ? (h ? 4 : 2) : 0);
    } else {
      cp_async_4(ring + 512 * s, at, in ? 4 : 0);
    }
    cp_async_commit();
  }
  // Tile t's scale, once its group landed (the next RING - 1 tiles' may still be in flight).
  __device__ __forceinline__ float take(int t) const {
    cp_async_wait<RING - 1>();
    const int s = slot<RING>(t);
    uint32_t word;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(word) : "r"(ring + 512 * s) : "memory");
    if constexpr (sizeof(ScaleT) == 2)
      return half_to_float(static_cast<uint16_t>(word >> (16 * ((high >> s) & 1u))));
    else
      return __uint_as_float(word);
  }
};

// A landed tile's V (int8, MultiTile's swizzle) -> fp16 in the copy, and this thread's K or V
// scale into the copy's rows, in two steps: load() reads the stage and converts in registers
// (the stage is then free), store() writes the copy (once its last reader is done). The V
// warps also leave softmax_h16's references: each V scale relative to its half tile's largest
// magnitude (one redux on the magnitudes' bits, which order as unsigned integers), relative in
// fact to the power of two at or above it (pow2_above: exact scaling), with that power's log2
// and reciprocal.
struct VWidening {
  using L = Q8Layout;
  using W = WgLayout<128>;
  using T = MultiTile<128, 64, 128>;
  uint32_t h[4][8];  // chunk i: tokens (tid + 128 i) % 64
  float scale, top, lht, inv;
  uint32_t scale_half;

  __device__ __forceinline__ void load(const char* stage, float tile_scale, int tid) {
    uint4 in[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int idx = tid + 128 * i;
      in[i] = *reinterpret_cast<const uint4*>(stage + L::kV + T::offset(idx % 64, idx / 64));
    }
    scale = tile_scale;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t words[4] = {in[i].x, in[i].y, in[i].z, in[i].w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {  // as multi_wg_tiles.cuh's widen_tile converts a chunk
        const uint32_t u = words[k] ^ 0x80808080u;
        h[i][2 * k] = int8_pair<0x4140u>(u);
        h[i][2 * k + 1] = int8_pair<0x4342u>(u);
      }
    }
    if (tid >= 64) {  // warp-uniform: warps 0-1 K scales, 2-3 V scales
      top = __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(scale) & 0x7fffffffu));
      pow2_above(top, lht, inv);
      scale_half = pack2<f16>(scale * inv, 0.f);  // exact but for fp16's rounding
    }
  }

  __device__ __forceinline__ void store(char* copy, int tid) const {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
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
      *reinterpret_cast<uint16_t*>(copy + HalfScales::kAt + HalfScales::at(token)) =
          static_cast<uint16_t>(scale_half);
      if (tid % 32 == 0) tops[half] = top, tops[2 + half] = lht, tops[4 + half] = inv;
    }
  }
};

}  // namespace llfd
