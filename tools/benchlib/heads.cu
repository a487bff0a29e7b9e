// Paged split-K decode with the KV heads of a page read together (PERF_NOTES v32).
//
// Grid (head group, split, batch). One CTA owns HK KV heads of a sequence's split: each
// 16-token tile of those heads (K, V and the per-token scales) arrives by one bulk tensor
// copy per pool from the pools' tensor maps (HeadsMaps), issued by one lane into a ring of
// STAGES shared stages that every warp reads. So a page's rows of all HK heads are fetched
// at once, in as few copies as the tile has pools, instead of 16-byte copies per head and
// warp (decode.cu): the access that made pages in random order cost 3-5% more than a
// contiguous cache there (PERF_NOTES v31).
//
// Warp w serves KV head w % HK and every (WARPS / HK)-th tile from w / HK. The math per tile is
// decode.cu's (tokens on M, heads on N, m16n8k16), reading the stage through TMA's 128-byte
// swizzle (chunk c of line L at c ^ (L & 7)). The tile's tokens are permuted on the mma's M
// dimension, row r <-> token sigma8(r % 8) + 8 (r / 8) (heads_copy.cuh), so that both fragment
// reads are conflict-free on that swizzle: a K phase reads rows g, g + 1 (tokens whose lines
// differ in bit 2), a V phase tokens sigma8(2c) or sigma8(2c + 1) for c = 0..3 (lines in four
// different pairs).
// Rows past the sequence's end come from the page as they are and are masked; a bad page id
// becomes a coordinate outside the map, whose box TMA fills with zeros (nothing is read).
#include "heads_copy.cuh"
#include "heads_merge.cuh"

namespace llfd {

template <int HEAD_DIM, int GROUP, int HK, int WARPS, int SCALE_MODE, typename QT,
          typename ScaleT, int STAGES, bool CLUSTER>
__global__ void __launch_bounds__(WARPS * 32, 16 / WARPS)
decode_heads(const __grid_constant__ DecodeParams p, const __grid_constant__ HeadsMaps maps) {
  static_assert(HEAD_DIM == 128, "one 128-byte swizzle line per row");
  // Heads pair up in the merges' quads (Quads), whose second head the exact HeadChunk always
  // writes: an odd group above 1 would write into the next KV head's first query head. The
  // probe's workloads use 4 (32 / 8 heads).
  static_assert(GROUP == 1 || GROUP == 2 || GROUP == 4 || GROUP == 8,
                "1, 2, 4 or 8 query heads per KV head (one head block of the mma's N)");
  static_assert(HK == 2 || HK == 4 || HK == 8, "KV heads per CTA");
  static_assert(WARPS == 8 || WARPS == 16, "warps per CTA");
  constexpr int kWarps = WARPS, kPhases = kWarps / HK;
  // A stage always serves the same phase, so each warp sees every completion of the barriers
  // it waits on (a parity wait cannot tell phase n from n + 2).
  static_assert(STAGES % kPhases == 0, "stages a multiple of the phases");
  constexpr bool kTokenScales = SCALE_MODE == kScalePerToken;
  using G = Geometry<HEAD_DIM>;
  using L = HeadsLayout<HEAD_DIM, HK, ScaleT, kTokenScales, STAGES>;
  using Q = Quads<HEAD_DIM, GROUP>;
  constexpr int kIds = 256;  // page ids of a split held in shared memory; later ones: __ldg

  extern __shared__ __align__(16) char smem_raw[];
  __shared__ __align__(8) uint64_t full_bar[STAGES], empty_bar[STAGES];
  __shared__ float warp_max[kWarps][8], warp_sum[kWarps][8];
  __shared__ int ids[kIds];
  __shared__ int is_last;
  __shared__ __align__(8) uint64_t merge_barrier;
  using Slots = HeadsSlots<HEAD_DIM, GROUP, HK>;

  const uint32_t raw = shared_address(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  char* const smem = smem_raw + (base - raw);
  const int x = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int h = warp % HK, phase = warp / HK, kvh = x * HK + h;

  wait_for_previous_grid();
  allow_next_grid();
  // Cluster merge (the splits of a head group are one cluster, split = rank), phase 1: every
  // CTA arrives once started; the stores into the leader wait for all (decode.cu's protocol).
  if constexpr (CLUSTER) {
    if (split == 0 && threadIdx.x == 0) mbarrier_init_for_cluster(&merge_barrier, 1);
    cluster_arrive_relaxed();
  }
  uint32_t qb[1][G::kChunks][2];
  float head_scale[1];
  load_query<HEAD_DIM, GROUP, QT, 1, true>(
      qb, head_scale,
      static_cast<const uint16_t*>(p.q) + b * p.q_batch_stride + kvh * GROUP * p.q_head_stride,
      p.q_head_stride, GROUP, g, c);
  const int len = clamped_length(p, b);
  int chunk, active;
  split_range(len, p, chunk, active);
  if (active == 0) {  // empty sequence: zero output, lse = -inf
    if (split == 0)
      for (int idx = threadIdx.x; idx < HK * GROUP * HEAD_DIM; idx += blockDim.x) {
        const int row = idx / HEAD_DIM, d = idx % HEAD_DIM, head = x * HK * GROUP + row;
        static_cast<uint16_t*>(p.out)[b * p.out_batch_stride + head * p.out_head_stride + d] = 0;
        if (p.lse != nullptr && d == 0) p.lse[b * p.num_kv_heads * GROUP + head] = kNegInf;
      }
    return;
  }
  if (split >= active) return;
  const int start = split * chunk, end = min(len, start + chunk);
  const int tiles = (end - start + 15) / 16;
  const int shift = p.page_shift, first_page = start >> shift;
  const int32_t* table = p.block_table + b * p.table_stride;
  const int pages = ((end - 1) >> shift) - first_page + 1;
  for (int i = threadIdx.x; i < min(pages, kIds); i += blockDim.x) ids[i] = __ldg(table + first_page + i);
  const uint32_t full = shared_address(full_bar), empty = shared_address(empty_bar);
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) mbar_init(full + 8 * s, 1), mbar_init(empty + 8 * s, HK);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  bool bad = false;
  // One lane copies tile i (all HK heads) into stage i % STAGES.
  auto issue = [&](int i) __attribute__((always_inline)) {
    const int t = start + 16 * i, index = (t >> shift) - first_page;
    const int page = index < kIds ? ids[index] : __ldg(table + (t >> shift));
    const bool ok = static_cast<unsigned>(page) < static_cast<unsigned>(p.num_pages);
    bad |= !ok;
    const int coord = ok ? page : -1, slot = t & ((1 << shift) - 1), s = i % STAGES;
    const uint32_t bar = full + 8 * s, rows = base + s * L::kStageRows;
    mbar_expect(bar, L::kTx);
    tma_4d(rows, &maps.k, 0, slot, x * HK, coord, bar);
    tma_4d(rows + L::kRowBytes, &maps.v, 0, slot, x * HK, coord, bar);
    if constexpr (kTokenScales) {
      const uint32_t scales = base + L::kScales + s * L::kStageScales;
      if (maps.scale_heads_inner) {
        tma_3d(scales, &maps.k_scale, x * HK, slot, coord, bar);
        tma_3d(scales + L::kScaleBytes, &maps.v_scale, x * HK, slot, coord, bar);
      } else {
        tma_3d(scales, &maps.k_scale, slot, x * HK, coord, bar);
        tma_3d(scales + L::kScaleBytes, &maps.v_scale, slot, x * HK, coord, bar);
      }
    }
  };
  if (threadIdx.x == 0)
    for (int i = 0; i < min(STAGES, tiles); ++i) issue(i);

  float k_const = p.score_scale_log2, v_const = 1.f;
  if constexpr (SCALE_MODE == kScalePerTensor) {
    k_const *= __ldg(static_cast<const float*>(p.k_scale));
    v_const = __ldg(static_cast<const float*>(p.v_scale));
  } else if constexpr (SCALE_MODE == kScalePerHead) {
    k_const *= __ldg(static_cast<const float*>(p.k_scale) + kvh);
    v_const = __ldg(static_cast<const float*>(p.v_scale) + kvh);
  }
  float col_const[2];
#pragma unroll
  for (int i = 0; i < 2; ++i)
    col_const[i] = k_const * __shfl_sync(0xffffffffu, head_scale[0], 4 * (2 * c + i));
  // This lane's tokens: S^T rows g and g + 8; V's k-slots 2c, 2c + 1, 2c + 8, 2c + 9.
  const int sg = sigma8(g), sv0 = sigma8(2 * c), sv1 = sigma8(2 * c + 1);
  const int row_token[2] = {sg, 8 + sg};
  const int heads_inner = maps.scale_heads_inner;
  auto scale_at = [&](const char* area, int token) __attribute__((always_inline)) {
    const int index = heads_inner ? token * HK + h : h * 16 + token;
    return scale_value<ScaleT>(area + index * static_cast<int>(sizeof(ScaleT)));
  };

  float acc[G::kMBlocks][4];
#pragma unroll
  for (int i = 0; i < G::kMBlocks; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  float col_max[2] = {kNegInf, kNegInf}, col_sum[2] = {0.f, 0.f};
  float v_ref = 1.f;

#pragma unroll 1
  for (int i = phase; i < tiles; i += kPhases) {
    const int s = i % STAGES;
    const uint32_t parity = (i / STAGES) & 1;
    mbar_wait(full + 8 * s, parity);
    const char* rows = smem + s * L::kStageRows + h * 16 * HEAD_DIM;
    const int t0 = start + 16 * i;
    Tile<HEAD_DIM> cur;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const char* line = rows + row_token[half] * HEAD_DIM;
#pragma unroll
      for (int u = 0; u < G::kKVectors; ++u) {
        const uint4 w = *reinterpret_cast<const uint4*>(line + 16 * ((4 * u + c) ^ sg));
        cur.k[half][4 * u] = w.x; cur.k[half][4 * u + 1] = w.y;
        cur.k[half][4 * u + 2] = w.z; cur.k[half][4 * u + 3] = w.w;
      }
    }
#pragma unroll
    for (int slot = 0; slot < 4; ++slot) {
      const int token = (slot & 1 ? sv1 : sv0) + 8 * (slot >> 1);
      const uint4 w = *reinterpret_cast<const uint4*>(rows + L::kRowBytes + token * HEAD_DIM +
                                                      16 * (g ^ (token & 7)));
      cur.v[slot][0] = w.x; cur.v[slot][1] = w.y; cur.v[slot][2] = w.z; cur.v[slot][3] = w.w;
    }
    bool valid[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) valid[half] = t0 + row_token[half] < end;
    if constexpr (kTokenScales) {
      const char* scales = smem + L::kScales + s * L::kStageScales;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        // Past the end the pool holds anything (NaN too): the V scale must not reach P.
        cur.k_scale[half] = scale_at(scales, row_token[half]);
        cur.v_scale[half] = valid[half] ? scale_at(scales + L::kScaleBytes, row_token[half]) : 0.f;
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(empty + 8 * s);
    // The tile's issuer (the heads of its phase take turns) refills the stage when every
    // warp of the phase has read it.
    if (i + STAGES < tiles && warp == (i / kPhases) % HK + HK * (i % kPhases) && lane == 0) {
      mbar_wait(empty + 8 * s, parity);
      issue(i + STAGES);
    }

    float sc[4] = {0.f, 0.f, 0.f, 0.f}, sc_odd[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < G::kChunks; ++j) {
      uint32_t a[4];
      unpack_word(cur.k[0][j] ^ 0x80808080u, a[0], a[2]);
      unpack_word(cur.k[1][j] ^ 0x80808080u, a[1], a[3]);
      mma_16x8x16(j % 2 ? sc_odd : sc, a, qb[0][j][0], qb[0][j][1]);
    }
    float correction[2];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int half = e >> 1, col = e & 1;
      float scale = col_const[col];
      if constexpr (kTokenScales) scale *= cur.k_scale[half];
      sc[e] = valid[half] ? (sc[e] + sc_odd[e]) * scale : kNegInf;
    }
#pragma unroll
    for (int col = 0; col < 2; ++col) {
      const float local = fmaxf(sc[col], sc[2 + col]);
      const float new_max = fmaxf(col_max[col], warp_max_xor_from(local, 4, 16));
      correction[col] = fast_exp2(col_max[col] - new_max);
      col_max[col] = new_max;
      sc[col] = fast_exp2(sc[col] - new_max);
      sc[2 + col] = fast_exp2(sc[2 + col] - new_max);
      col_sum[col] = col_sum[col] * correction[col] + sc[col] + sc[2 + col];
    }
    float ratio[2] = {1.f, 1.f};
    if constexpr (kTokenScales) {
      const float step_ref = warp_max_xor_from(fmaxf(cur.v_scale[0], cur.v_scale[1]), 4, 16);
      const float new_ref = step_ref > 0.f ? step_ref : v_ref;
      const float inv_ref = 1.f / new_ref;
      ratio[0] = cur.v_scale[0] * inv_ref;
      ratio[1] = cur.v_scale[1] * inv_ref;
      const float ref_change = v_ref * inv_ref;
      correction[0] *= ref_change, correction[1] *= ref_change;
      v_ref = new_ref;
    }
    const uint32_t pb0 = transpose_8x8(pack2<f16>(sc[0] * ratio[0], sc[1] * ratio[0]));
    const uint32_t pb1 = transpose_8x8(pack2<f16>(sc[2] * ratio[1], sc[3] * ratio[1]));
#pragma unroll
    for (int mb = 0; mb < G::kMBlocks; ++mb) {
      acc[mb][0] *= correction[0]; acc[mb][2] *= correction[0];
      acc[mb][1] *= correction[1]; acc[mb][3] *= correction[1];
    }
#pragma unroll
    for (int w = 0; w < G::kVWords; ++w) {
      const uint32_t va = cur.v[0][w] ^ 0x80808080u, vb = cur.v[1][w] ^ 0x80808080u;
      const uint32_t vc = cur.v[2][w] ^ 0x80808080u, vd = cur.v[3][w] ^ 0x80808080u;
      const uint32_t ab_lo = prmt(va, vb, 0x5140u), ab_hi = prmt(va, vb, 0x7362u);
      const uint32_t cd_lo = prmt(vc, vd, 0x5140u), cd_hi = prmt(vc, vd, 0x7362u);
      const uint32_t a0[4] = {pair_from_interleaved<0>(ab_lo, ab_hi),
                              pair_from_interleaved<1>(ab_lo, ab_hi),
                              pair_from_interleaved<0>(cd_lo, cd_hi),
                              pair_from_interleaved<1>(cd_lo, cd_hi)};
      mma_16x8x16(acc[2 * w], a0, pb0, pb1);
      const uint32_t a1[4] = {pair_from_interleaved<2>(ab_lo, ab_hi),
                              pair_from_interleaved<3>(ab_lo, ab_hi),
                              pair_from_interleaved<2>(cd_lo, cd_hi),
                              pair_from_interleaved<3>(cd_lo, cd_hi)};
      mma_16x8x16(acc[2 * w + 1], a1, pb0, pb1);
    }
    __syncwarp();
  }
  if (bad) atomicOr(p.error_flags, kErrorBadPage);
  __syncthreads();  // every stage has been read: the merge reuses them

  // ---- merge the phases of each head (decode.cu's warp merge, over kPhases warps) ----
  float4* const warp_quads = reinterpret_cast<float4*>(smem);
#pragma unroll
  for (int col = 0; col < 2; ++col) {
    const float total = warp_sum_xor_from(col_sum[col], 4, 16);
    const int head = 2 * c + col;
    if (g == 0 && head < GROUP) warp_max[warp][head] = col_max[col], warp_sum[warp][head] = total;
  }
#pragma unroll
  for (int mb = 0; mb < G::kMBlocks; ++mb)
    warp_quads[warp * Q::kPerWarp + mb * 32 + lane] =
        make_float4(acc[mb][0] * v_ref, acc[mb][1] * v_ref, acc[mb][2] * v_ref, acc[mb][3] * v_ref);
  __syncthreads();
  const bool single = active == 1;
  float* const slots = reinterpret_cast<float*>(smem + L::kBytes);
  uint32_t my_slot = 0, leader_barrier = 0;
  if constexpr (CLUSTER) {
    if (!single) {
      my_slot = cluster_address(slots + split * Slots::kFloats, 0);
      leader_barrier = cluster_address(&merge_barrier, 0);
      cluster_wait();
    }
  }
  for (int idx = threadIdx.x; idx < HK * Q::kCompact; idx += blockDim.x) {
    const int head_of_cta = idx / Q::kCompact;
    const Q quad(idx % Q::kCompact);
    const HeadChunk<GROUP, false> hc(p, x * HK + head_of_cta);
    // Per-tensor and per-head V scales multiply the output once (the quad's head, not this
    // thread's warp's).
    float head_v_scale = v_const;
    if constexpr (SCALE_MODE == kScalePerHead)
      head_v_scale = __ldg(static_cast<const float*>(p.v_scale) + hc.kvh);
    float best[2], total[2] = {0.f, 0.f};
    float4 value = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int col = 0; col < Q::kHeads; ++col) {
      best[col] = kNegInf;
#pragma unroll
      for (int ph = 0; ph < kPhases; ++ph)
        best[col] = fmaxf(best[col], warp_max[head_of_cta + HK * ph][quad.head0 + col]);
    }
#pragma unroll
    for (int ph = 0; ph < kPhases; ++ph) {
      const int w = head_of_cta + HK * ph;
      float weight[2] = {0.f, 0.f};
#pragma unroll
      for (int col = 0; col < Q::kHeads; ++col) {
        // A phase that saw no tile has max -inf: weight 0 (never exp2(-inf - -inf)).
        const float m = warp_max[w][quad.head0 + col];
        weight[col] = m == kNegInf ? 0.f : fast_exp2(m - best[col]);
        total[col] += warp_sum[w][quad.head0 + col] * weight[col];
      }
      const float4 v = warp_quads[w * Q::kPerWarp + quad.stored()];
      value.x += v.x * weight[0]; value.y += v.y * weight[1];
      value.z += v.z * weight[0]; value.w += v.w * weight[1];
    }
    float lse2[2] = {kNegInf, kNegInf};
#pragma unroll
    for (int col = 0; col < Q::kHeads; ++col) {
      const float inv = head_v_scale / total[col];
      if (col == 0) value.x *= inv, value.z *= inv;
      else value.y *= inv, value.w *= inv;
      lse2[col] = best[col] + __log2f(total[col]);
    }
    if (CLUSTER && !single) {
      store_cluster_async(my_slot + 16 * idx, value, leader_barrier);
      if (quad.writes_lse())
#pragma unroll
        for (int col = 0; col < Q::kHeads; ++col)
          store_cluster_async(my_slot + 4 * (Slots::kLse + head_of_cta * GROUP + quad.head0 + col),
                              lse2[col], leader_barrier);
    } else if (single) {
      quad.template store_output<QT>(p, b, hc, value);
      if (p.lse != nullptr && quad.writes_lse())
#pragma unroll
        for (int col = 0; col < Q::kHeads; ++col) p.lse[hc.row(p, b, quad.head0 + col)] = lse2[col] * kLn2;
    } else {
      const int64_t part =
          (static_cast<int64_t>(b) * hc.slots(p) + hc.slot) * p.num_splits + split;
      float* dst = p.partial_out + part * GROUP * HEAD_DIM + quad.d;
      *reinterpret_cast<float2*>(dst + quad.head0 * HEAD_DIM) = make_float2(value.x, value.z);
      if (Q::kHeads == 2)
        *reinterpret_cast<float2*>(dst + (quad.head0 + 1) * HEAD_DIM) = make_float2(value.y, value.w);
      if (quad.writes_lse())
#pragma unroll
        for (int col = 0; col < Q::kHeads; ++col)
          p.partial_lse[part * GROUP + quad.head0 + col] = lse2[col];
    }
  }
  if (single) return;
  if constexpr (CLUSTER) {
    if (split != 0) return;
    if (threadIdx.x == 0) mbarrier_expect_bytes(&merge_barrier, active * Slots::kBytes);
    mbarrier_wait_cluster(&merge_barrier, 0);
    leader_merge_heads<HEAD_DIM, GROUP, HK, QT>(p, b, x, active, slots);
    return;
  }
  if (!p.fused_merge) return;

  // ---- the last CTA of this (batch, head group) to arrive merges every split ----
  __threadfence();
  __syncthreads();
  uint32_t* const counter = p.counters + b * p.num_kv_heads + x * HK;
  if (threadIdx.x == 0) is_last = atomicAdd(counter, 1u) + 1 == static_cast<uint32_t>(active);
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  merge_head_splits<HEAD_DIM, GROUP, HK, QT>(p, b, x, active, reinterpret_cast<float*>(smem));
  if (threadIdx.x == 0) *counter = 0;
}

}  // namespace llfd
