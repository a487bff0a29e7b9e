// The warpgroup-MMA kernels' query rows (multi_wg.cu, multi_wg64.cu): Q into registers as the
// score mma's A fragments, and a warpgroup's finished rows out (the output, or a split's
// partial for multi.cu's merge).
#pragma once
#include "multi_cluster.cuh"
#include "multi_wg_tiles.cuh"

namespace llfd {

// A warpgroup's 64 rows from row `wg_row0` (this lane: r_lo and r_lo + 8, the accumulator
// layout; `wr`: the warp within the warpgroup): fp16 (bf16 and rotated rows scaled per row
// into fp16 range) through `q16` (the warpgroup's [block][64][64] staging, shared memory), then
// back as A fragments. row_const: each row's score scale in base 2 (sm_scale, the given K
// scale, the row's own); v_const: the given V scale (1 with per-token scales).
template <int HEAD_DIM, int SCALE_MODE, typename QT>
__device__ __forceinline__ void wg_load_query(uint32_t (&qa)[HEAD_DIM / 16][4],
                                              float (&row_const)[2], float& v_const,
                                              const MultiParams& p, const SequenceRows& sr,
                                              int kvh, int r_lo, int wr, int lane, char* q16) {
  using L = WgLayout<HEAD_DIM>;
  constexpr int kChunks = HEAD_DIM / 16;
  const int g = lane / 4, c = lane % 4;
  float k_const = p.score_scale_log2;
  v_const = 1.f;
  if constexpr (SCALE_MODE != kScalePerToken) {
    k_const *= given_scale<SCALE_MODE>(p.k_scale, kvh);
    v_const = given_scale<SCALE_MODE>(p.v_scale, kvh);
  }
  {
    uint32_t qf[kChunks][4];
    load_rows<HEAD_DIM, QT>(qf, row_const, p, sr, kvh, r_lo, c);
    // The row scales must be positive (softmax_tile scales after the maximum): a negative
    // sm_scale or K scale flips q's sign instead (exact in fp16), a zero one acts as the
    // smallest normal one (every score ~0, as zero gives).
    const uint32_t flip = k_const < 0.f ? 0x80008000u : 0u;
    row_const[0] = fmaxf(row_const[0] * fabsf(k_const), 1.17549435e-38f);
    row_const[1] = fmaxf(row_const[1] * fabsf(k_const), 1.17549435e-38f);
#pragma unroll
    for (int hr = 0; hr < 2; ++hr)
#pragma unroll
      for (int s = 0; s < kChunks; ++s)  // dims 16 s + 4 c .. + 3
        *reinterpret_cast<uint2*>(q16 + L::at(16 * wr + g + 8 * hr, 2 * s + (c >> 1)) +
                                  8 * (c & 1)) = make_uint2(qf[s][hr] ^ flip, qf[s][2 + hr] ^ flip);
  }
  // ... and back as the warp's own 16 rows' fragments: Q stays in registers.
  __syncwarp();
  const uint32_t q16_address = shared_address(q16);
#pragma unroll
  for (int kk = 0; kk < kChunks; ++kk)
    ldmatrix_x4(qa[kk], q16_address + L::at(16 * wr + (lane & 15), 2 * kk + (lane >> 4)));
}

// A warpgroup's rows after its last tile: normalised, with their base-2 LSE (m + shift +
// log2 l, softmax_tile's state), into the output (one split) or the split's partial rows:
// the global workspace's (`part`: its index; CTA_ROWS rows per partial) for merge_if_last, or
// (SHARED) at `shared`, this CTA's ClusterPartials, for cluster_merge.
template <int HEAD_DIM, int CTA_ROWS, typename QT, bool SHARED = false>
__device__ __forceinline__ void wg_store_rows(const MultiParams& p, const SequenceRows& sr,
                                              const float (&o)[HEAD_DIM / 2],
                                              const float (&m)[2], const float (&l)[2],
                                              float shift, float v_scale, int kvh, int row0,
                                              int r_lo, int c, int64_t part, float* shared,
                                              int active) {
  using C = ClusterPartials<HEAD_DIM, CTA_ROWS>;
  static_assert(C::kBytes <= WgLayout<HEAD_DIM, CTA_ROWS>::kBytes, "over the pipeline's");
  constexpr int kOut = HEAD_DIM / 2;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = r_lo + 8 * hr, local = r - row0;
    const float sum = warp_sum_xor(l[hr], 2);
    if (r >= sr.rows) continue;
    const float lse2 = sum > 0.f ? m[hr] + shift + __log2f(sum) : kNegInf;
    const float f = sum > 0.f ? v_scale / sum : 0.f;
    if (active == 1) {
      const int token = r / p.group_size, head = kvh * p.group_size + r - token * p.group_size;
      const int64_t q_row = sr.q0 + token;
      uint32_t* dst = reinterpret_cast<uint32_t*>(
          static_cast<uint16_t*>(p.out) + q_row * p.out_token_stride + head * p.out_head_stride);
#pragma unroll
      for (int j = 0; j < kOut / 4; ++j)  // dims 8 j + 2 c, + 1
        dst[4 * j + c] = pack2<QT>(o[4 * j + 2 * hr] * f, o[4 * j + 2 * hr + 1] * f);
      if (p.lse != nullptr && c == 0)
        p.lse[q_row * p.num_kv_heads * p.group_size + head] = lse2 * kMultiLn2;
    } else {
      float* dst = SHARED ? shared + local * C::kStride
                          : p.partial_out + (part * CTA_ROWS + local) * HEAD_DIM;
#pragma unroll
      for (int j = 0; j < kOut / 4; ++j)
        *reinterpret_cast<float2*>(dst + 8 * j + 2 * c) =
            make_float2(o[4 * j + 2 * hr] * f, o[4 * j + 2 * hr + 1] * f);
      if (c == 0) (SHARED ? shared + C::kLse : p.partial_lse + part * CTA_ROWS)[local] = lse2;
    }
  }
}

// O *= the softmax's correction of its rows (skipped when no lane's changed).
template <int N>
__device__ __forceinline__ void rescale_rows(float (&o)[N], const float (&corr)[2]) {
  if (__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f))
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      o[4 * i] *= corr[0]; o[4 * i + 1] *= corr[0];
      o[4 * i + 2] *= corr[1]; o[4 * i + 3] *= corr[1];
    }
}

}  // namespace llfd
