// Multi-token attention over the INT8 cache: prefill, chunked prefill and speculative
// verification, one kernel (FlashAttention-2 style, on the tensor cores).
//
// Grid (64-row tile x KV head, split, sequence). A KV head's query rows are packed token-major
// (row r: token r / group, query head r % group), so every K/V tile a CTA loads serves all the
// heads of its group and all the chunk's tokens in the tile. Four warps own 16 rows each (the
// mma's M); the CTA streams K/V tiles through a cp.async pipeline (multi_tiles.cuh) shared by
// its warps, converts int8 to fp16 in registers, and keeps an online softmax per row:
//  * per-tensor / per-head K scales and sm_scale fold into each row's score scale, per-token K
//    scales multiply the score columns; per-token V scales fold into P relative to the largest
//    V scale seen (P stays in [0, 1]), the output is rescaled when that reference grows;
//  * causal: a tile's KV range ends at its last row's position; rows mask per element; a warp
//    skips tiles past its own last row;
//  * a tile whose KV range is long next to the grid (short chunks over long prefixes) is cut
//    into splits; each writes a normalised partial and the last to finish merges them.
// bf16 queries (and rotated ones) are scaled per row by a power of two into fp16 range.
#include "multi_rows.cuh"
#include "multi_tiles.cuh"

namespace llfd {

constexpr int kMultiStages = 3;      // KV tiles in flight

// KSPLIT: warps per 16 query rows, each taking its share of every KV tile (the CTA then owns
// 64 / KSPLIT rows). Short chunks (speculative drafts: a few tokens x the group) fill only one
// or two warps' rows; with KSPLIT 4 all four warps convert and multiply a quarter of each tile
// and the CTA merges them at the end, so a CTA streams its KV four times as fast.
template <int HEAD_DIM, int SCALE_MODE, typename QT, typename ScaleT, bool PAGED, int KSPLIT>
__global__ void __launch_bounds__(128, 2) multi_attend(const __grid_constant__ MultiParams p) {
  using T = MultiTile<HEAD_DIM>;
  constexpr int kChunks = HEAD_DIM / 16, kNB = T::kRows / 8, kKT = T::kRows / 16;
  static_assert(KSPLIT == 1 || KSPLIT == 2 || KSPLIT == 4, "1, 2 or 4 warps per row group");
  constexpr int kGroups = 4 / KSPLIT, kCtaRows = 16 * kGroups;  // row groups of 16, rows
  constexpr int kNBw = kNB / KSPLIT, kKTw = kKT / KSPLIT;        // a warp's share of a tile
  static_assert(kKTw >= 1, "a warp's share of a KV tile is at least 16 tokens");
  constexpr bool kTokenScales = SCALE_MODE == kScalePerToken;
  extern __shared__ __align__(128) char smem[];
  __shared__ int is_last;

  const int kvh = blockIdx.x % p.num_kv_heads;
  const int tile = p.max_tiles - 1 - static_cast<int>(blockIdx.x) / p.num_kv_heads;  // long first
  const int split = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int wr = warp % kGroups, wk = warp / kGroups;  // row group, share of the KV tile

  const SequenceRows sr(p, b, tile == 0 && split == 0 && kvh == 0 && threadIdx.x == 0);
  const int row0 = tile * kCtaRows;
  if (row0 >= sr.rows) return;
  const int tile_rows = min(kCtaRows, sr.rows - row0);
  const int kv_end = sr.limit(p, row0 + tile_rows - 1);
  int chunk, active;
  tile_splits<T::kRows>(p, kv_end, chunk, active);
  if (split >= active) return;
  const int start = split * chunk, end = min(kv_end, start + chunk);

  const int r_lo = row0 + 16 * wr + g;
  const bool warp_active = row0 + 16 * wr < sr.rows;
  const int warp_limit = warp_active ? sr.limit(p, min(row0 + 16 * wr + 15, sr.rows - 1)) : 0;
  int visible[2];  // tokens [0, visible) of this split each row sees
#pragma unroll
  for (int hr = 0; hr < 2; ++hr)
    visible[hr] = r_lo + 8 * hr < sr.rows ? min(end, sr.limit(p, r_lo + 8 * hr)) : 0;

  TileLoader<HEAD_DIM, kTokenScales, ScaleT, PAGED> loader(p, b, kvh);
  const uint32_t smem_base = shared_address(smem);
  loader.fetch(start, end);
#pragma unroll
  for (int st = 0; st < kMultiStages - 1; ++st) {
    const int t = start + st * T::kRows;
    if (t < end) {
      loader.issue(smem_base + st * T::kBytes, st, t, end);
      loader.fetch(t + T::kRows, end);
    }
    cp_async_commit();
  }

  // head_dim 256 keeps the Q fragments in shared memory (16 bytes per lane and k-step,
  // conflict-free): in registers they push the kernel into spills.
  constexpr bool kQueryInShared = HEAD_DIM == 256;
  uint4* const q_shared = reinterpret_cast<uint4*>(smem + kMultiStages * T::kBytes) +
                          warp * kChunks * 32;
  uint32_t qf[kChunks][4];
  float row_const[2];
  load_rows<HEAD_DIM, QT>(qf, row_const, p, sr, kvh, r_lo, c);
  if constexpr (kQueryInShared)
#pragma unroll
    for (int s = 0; s < kChunks; ++s)
      q_shared[s * 32 + lane] = make_uint4(qf[s][0], qf[s][1], qf[s][2], qf[s][3]);
  float k_const = p.score_scale_log2, v_const = 1.f;
  if constexpr (SCALE_MODE == kScalePerTensor) {
    k_const *= __ldg(static_cast<const float*>(p.k_scale));
    v_const = __ldg(static_cast<const float*>(p.v_scale));
  } else if constexpr (SCALE_MODE == kScalePerHead) {
    k_const *= __ldg(static_cast<const float*>(p.k_scale) + kvh);
    v_const = __ldg(static_cast<const float*>(p.v_scale) + kvh);
  }
  row_const[0] *= k_const;
  row_const[1] *= k_const;

  float oacc[2 * kChunks][4];
#pragma unroll
  for (int n = 0; n < 2 * kChunks; ++n) oacc[n][0] = oacc[n][1] = oacc[n][2] = oacc[n][3] = 0.f;
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.f, 0.f};
  float v_ref = kTokenScales ? 0.f : 1.f;

  int stage = 0;
#pragma unroll 1
  for (int t0 = start; t0 < end; t0 += T::kRows) {
    cp_async_wait<kMultiStages - 2>();
    loader.widen(smem + stage * T::kBytes, stage);
    __syncthreads();  // the tile is visible; the stage refilled below is free
    {
      const int t_issue = t0 + (kMultiStages - 1) * T::kRows;
      const int issue_stage = stage == 0 ? kMultiStages - 1 : stage - 1;
      if (t_issue < end) {
        loader.issue(smem_base + issue_stage * T::kBytes, issue_stage, t_issue, end);
        loader.fetch(t_issue + T::kRows, end);
      }
      cp_async_commit();
    }
    if (warp_active && t0 < warp_limit) {
      const uint32_t st_addr = smem_base + stage * T::kBytes;
      const char* st_ptr = smem + stage * T::kBytes;
      // ---- S = Q K^T: rows g, g + 8, columns (tokens) 8 nb + 2c, +1 ----
      float s[kNBw][4];
#pragma unroll
      for (int j = 0; j < kNBw; ++j) {
        const int nb = wk * kNBw + j;
        s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
        for (int s4 = 0; s4 < kChunks / 4; ++s4) {
          uint32_t r[4];
          ldmatrix_x4(r, st_addr + T::kK + T::offset(8 * nb + (lane & 7), 4 * s4 + (lane >> 3)));
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const uint32_t u = r[i] ^ 0x80808080u;
            if constexpr (kQueryInShared) {
              const uint4 q4 = q_shared[(4 * s4 + i) * 32 + lane];
              const uint32_t a[4] = {q4.x, q4.y, q4.z, q4.w};
              mma_16x8x16(s[j], a, int8_pair<0x4140u>(u), int8_pair<0x4342u>(u));
            } else {
              mma_16x8x16(s[j], qf[4 * s4 + i], int8_pair<0x4140u>(u), int8_pair<0x4342u>(u));
            }
          }
        }
      }
      // ---- scale, mask, online softmax in base 2 ----
#pragma unroll
      for (int j = 0; j < kNBw; ++j) {
        const int nb = wk * kNBw + j;
        float2 ks = make_float2(1.f, 1.f);
        if constexpr (kTokenScales)
          ks = *reinterpret_cast<const float2*>(st_ptr + T::kKScale + 4 * (8 * nb + 2 * c));
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = t0 + 8 * nb + 2 * c + (e & 1), hr = e >> 1;
          const float x = s[j][e] * row_const[hr] * ((e & 1) ? ks.y : ks.x);
          s[j][e] = col < visible[hr] ? x : kNegInf;
        }
      }
      float corr[2];
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        float mx = kNegInf;
#pragma unroll
        for (int j = 0; j < kNBw; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * hr], s[j][2 * hr + 1]));
        mx = warp_max_xor(mx, 2);
        const float m_new = fmaxf(m[hr], mx);
        const float m_use = m_new == kNegInf ? 0.f : m_new;  // a row with nothing visible yet
        corr[hr] = fast_exp2(m[hr] - m_use);
        m[hr] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < kNBw; ++j) {
          s[j][2 * hr] = fast_exp2(s[j][2 * hr] - m_use);
          s[j][2 * hr + 1] = fast_exp2(s[j][2 * hr + 1] - m_use);
          sum += s[j][2 * hr] + s[j][2 * hr + 1];
        }
        l[hr] = l[hr] * corr[hr] + sum;
      }
      float ratio[kNBw][2];
#pragma unroll
      for (int j = 0; j < kNBw; ++j) ratio[j][0] = ratio[j][1] = 1.f;
      if constexpr (kTokenScales) {
        float local = 0.f;
#pragma unroll
        for (int j = 0; j < kNBw; ++j) {
          const float2 vs = *reinterpret_cast<const float2*>(
              st_ptr + T::kVScale + 4 * (8 * (wk * kNBw + j) + 2 * c));
          ratio[j][0] = vs.x;
          ratio[j][1] = vs.y;
          local = fmaxf(local, fmaxf(vs.x, vs.y));
        }
        const float new_ref = fmaxf(v_ref, warp_max_xor(local, 2));
        const float inv = new_ref > 0.f ? 1.f / new_ref : 0.f;
        const float change = new_ref > 0.f ? v_ref * inv : 1.f;
#pragma unroll
        for (int j = 0; j < kNBw; ++j) ratio[j][0] *= inv, ratio[j][1] *= inv;
        corr[0] *= change;
        corr[1] *= change;
        v_ref = new_ref;
      }
#pragma unroll
      for (int n = 0; n < 2 * kChunks; ++n) {
        oacc[n][0] *= corr[0]; oacc[n][1] *= corr[0];
        oacc[n][2] *= corr[1]; oacc[n][3] *= corr[1];
      }
      // ---- O += P V: k = 16 tokens per step, n = the even and odd dims of each chunk ----
#pragma unroll
      for (int jt = 0; jt < kKTw; ++jt) {
        const int kt = wk * kKTw + jt;
        const float* lo = s[2 * jt];
        const float* hi = s[2 * jt + 1];
        const uint32_t a[4] = {
            pack2<f16>(lo[0] * ratio[2 * jt][0], lo[1] * ratio[2 * jt][1]),
            pack2<f16>(lo[2] * ratio[2 * jt][0], lo[3] * ratio[2 * jt][1]),
            pack2<f16>(hi[0] * ratio[2 * jt + 1][0], hi[1] * ratio[2 * jt + 1][1]),
            pack2<f16>(hi[2] * ratio[2 * jt + 1][0], hi[3] * ratio[2 * jt + 1][1])};
#pragma unroll
        for (int dp = 0; dp < kChunks / 2; ++dp) {
          uint32_t r[4];
          ldmatrix_x4_trans(r, st_addr + T::kV +
                                   T::offset(16 * kt + 8 * ((lane >> 3) & 1) + (lane & 7),
                                             2 * dp + (lane >> 4)));
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint32_t u0 = r[2 * h] ^ 0x80808080u, u1 = r[2 * h + 1] ^ 0x80808080u;
            const int n = 2 * (2 * dp + h);
            mma_16x8x16(oacc[n], a, int8_pair<0x4240u>(u0), int8_pair<0x4240u>(u1));
            mma_16x8x16(oacc[n + 1], a, int8_pair<0x4341u>(u0), int8_pair<0x4341u>(u1));
          }
        }
      }
    }
    stage = stage + 1 == kMultiStages ? 0 : stage + 1;
  }
  cp_async_wait<0>();
  if constexpr (PAGED)
    if (loader.bad) atomicOr(p.error_flags, kErrorBadPage);

  float total[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) total[hr] = warp_sum_xor(l[hr], 2);
  // ---- KSPLIT: the warps of a row group merge into its first (wk == 0) ----
  if constexpr (KSPLIT > 1) {
    __syncthreads();  // every warp is out of the loop: the pipeline's memory is free
    float4* const o_shared = reinterpret_cast<float4*>(smem);  // [warp][2 kChunks][32 lanes]
    float* const ml = reinterpret_cast<float*>(o_shared + 4 * 2 * kChunks * 32);  // [warp][2][16]
#pragma unroll
    for (int n = 0; n < 2 * kChunks; ++n)
      o_shared[(warp * 2 * kChunks + n) * 32 + lane] =
          make_float4(oacc[n][0] * v_ref, oacc[n][1] * v_ref, oacc[n][2] * v_ref,
                      oacc[n][3] * v_ref);
    if (c == 0)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        ml[(warp * 2) * 16 + g + 8 * hr] = m[hr];
        ml[(warp * 2 + 1) * 16 + g + 8 * hr] = total[hr];
      }
    __syncthreads();
    if (wk == 0) {
      float weight[KSPLIT][2];
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        float best = kNegInf;
#pragma unroll
        for (int j = 0; j < KSPLIT; ++j) best = fmaxf(best, ml[((wr + j * kGroups) * 2) * 16 + g + 8 * hr]);
        const float use = best == kNegInf ? 0.f : best;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < KSPLIT; ++j) {
          const int w = wr + j * kGroups;
          weight[j][hr] = fast_exp2(ml[(w * 2) * 16 + g + 8 * hr] - use);
          sum += weight[j][hr] * ml[(w * 2 + 1) * 16 + g + 8 * hr];
        }
        m[hr] = best;
        total[hr] = sum;
      }
#pragma unroll
      for (int n = 0; n < 2 * kChunks; ++n) {
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int j = 0; j < KSPLIT; ++j) {
          const float4 v = o_shared[((wr + j * kGroups) * 2 * kChunks + n) * 32 + lane];
          acc.x += weight[j][0] * v.x; acc.y += weight[j][0] * v.y;
          acc.z += weight[j][1] * v.z; acc.w += weight[j][1] * v.w;
        }
        oacc[n][0] = acc.x; oacc[n][1] = acc.y; oacc[n][2] = acc.z; oacc[n][3] = acc.w;
      }
      v_ref = 1.f;
    }
  }

  // ---- this split's rows: normalised, with their base-2 LSE ----
  float lse2[2], scale[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    lse2[hr] = total[hr] > 0.f ? m[hr] + __log2f(total[hr]) : kNegInf;
    scale[hr] = total[hr] > 0.f ? v_const * v_ref / total[hr] : 0.f;
  }
  const int64_t slot = (static_cast<int64_t>(b) * p.num_kv_heads + kvh) * p.max_tiles + tile;
  const int64_t part = slot * p.num_splits + split;
  if (warp_active && wk == 0)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = r_lo + 8 * hr, local = r - row0;
      if (r >= sr.rows) continue;
      const float f = scale[hr];
      if (active == 1) {
        const int token = r / p.group_size, head = kvh * p.group_size + r - token * p.group_size;
        const int64_t q_row = sr.q0 + token;
        const int64_t at = q_row * p.out_token_stride + head * p.out_head_stride;
#pragma unroll
        for (int sc = 0; sc < kChunks; ++sc)
          store4<QT>(p.out, at + 16 * sc + 4 * c, oacc[2 * sc][2 * hr] * f,
                     oacc[2 * sc + 1][2 * hr] * f, oacc[2 * sc][2 * hr + 1] * f,
                     oacc[2 * sc + 1][2 * hr + 1] * f);
        if (p.lse != nullptr && c == 0)
          p.lse[q_row * p.num_kv_heads * p.group_size + head] = lse2[hr] * kMultiLn2;
      } else {
        float* dst = p.partial_out + (part * kCtaRows + local) * HEAD_DIM;
#pragma unroll
        for (int sc = 0; sc < kChunks; ++sc)
          *reinterpret_cast<float4*>(dst + 16 * sc + 4 * c) =
              make_float4(oacc[2 * sc][2 * hr] * f, oacc[2 * sc + 1][2 * hr] * f,
                          oacc[2 * sc][2 * hr + 1] * f, oacc[2 * sc + 1][2 * hr + 1] * f);
        if (c == 0) p.partial_lse[part * kCtaRows + local] = lse2[hr];
      }
    }
  if (active == 1) return;

  // ---- the last split of this tile to arrive merges all of them ----
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(p.counters + slot, 1u) + 1 == static_cast<uint32_t>(active);
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  merge_tile_splits<HEAD_DIM, kCtaRows, QT>(p, sr, kvh, row0, tile_rows, slot, active,
                                  reinterpret_cast<float*>(smem));
  if (threadIdx.x == 0) p.counters[slot] = 0;  // ready for the next launch
}

}  // namespace llfd
