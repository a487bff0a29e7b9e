// The token-major multi-query kernel's pieces (multi_tm.cu): shared-memory layout, the int8 K
// and V fragments converted in registers, the P^T store, and the team barriers.
//
// Both products keep the KV tokens (or the dims) on the MMA's M, whose A operand may come from
// registers, so no widened fp16 copy of a tile is ever written to shared memory (the loader's
// widening bounded the warpgroup kernels, PERF_NOTES m18):
//  * S^T = K Q^T: M = the tile's 64 tokens, N = the 64 query heads, k = dims. A lane's K
//    fragment for k-step kk takes dims 32 c + 4 kk .. + 3 of its two rows (bytes 0, 1 serve
//    mma k = 2c, 2c+1, bytes 2, 3 k = 2c+8, 2c+9): two 16-byte reads per row per tile. Q is
//    stored in shared memory with the same permutation of its dims (S does not depend on it).
//  * O^T += V^T P^T: M = dims (two m64 blocks), N = heads, k = tokens in order. A lane of warp
//    w holds dims 4 (8 w + g) .. + 3 (block b row g: + 2b, row g + 8: + 2b + 1): one 4-byte
//    read per token, transposed by byte permutes. P^T goes through shared memory (stmatrix).
// The stage rows are multi_tiles.cuh's (16-byte chunks XOR-swizzled by row & 7), which makes
// both reads conflict-free: a K read phase's 8 lanes take chunks (2c + x) ^ g, a V read's 32
// lanes banks 4 ((2w + g / 4) ^ (t & 7)) + g % 4 over tokens t = 2c (+1) of distinct t & 7.
#pragma once
#include "multi_wg_tiles.cuh"  // issue_scores, VRef, kLazyMax, swizzle_aligned

namespace llfd {

template <int HEAD_DIM>
struct TmLayout {
  static_assert(HEAD_DIM == 128, "two 64-dim blocks of O^T; 16-byte K reads of 32 dims");
  static constexpr int kHeads = 64;        // N: a KV head's query heads, padded
  static constexpr int kTokens = 64;       // M of S^T: KV tokens per tile
  static constexpr int kTeamThreads = 128;  // a warpgroup: its own tiles, stages, P^T
  static constexpr int kTeams = 2;
  static constexpr int kThreads = kTeams * kTeamThreads;
  static constexpr int kStages = 4;        // int8 tiles per team (3 in flight while one is used)
  using Stage = MultiTile<HEAD_DIM, kTokens, kTeamThreads>;
  static constexpr int kStageBytes = Stage::kBytes;  // 128-byte multiple: the swizzle holds
  static constexpr int kBlockBytes = kHeads * 128;   // 64 rows of 64 fp16 (wgmma.cuh's atoms)
  // Q ([block][head][64] fp16, permuted dims), then each team's P^T ([head][token] fp16),
  // 1024-byte aligned; then the stages, the teams' reduction rows and the row scales.
  static constexpr int kQ = 0;
  static constexpr int kP = kQ + (HEAD_DIM / 64) * kBlockBytes;
  static constexpr int kPBytes = kHeads * kTokens * 2;
  static constexpr int kStage0 = kP + kTeams * kPBytes;
  static constexpr int kRed = kStage0 + kTeams * kStages * kStageBytes;  // [team][warp][head]
  static constexpr int kRedV = kRed + kTeams * 4 * kHeads * 4;           // [team][warp]
  static constexpr int kRowConst = kRedV + kTeams * 4 * 4;               // [head]
  // After the loop, the teams' merge in a region of its own (nothing in the loop touches it):
  // each warp's row sums ([team][warp][head]), the second team's O^T fragments
  // ([element][thread] fp32: conflict-free) and each head's base-2 offset.
  static constexpr int kMergeL = kRowConst + kHeads * 4;
  static constexpr int kMergeO = kMergeL + kTeams * 4 * kHeads * 4;
  static constexpr int kMergeM = kMergeO + kTeamThreads * 64 * 4;
  static constexpr int kBytes = kMergeM + kHeads * 4;

  // Head r's 8-element chunk ch of a [block][64][64] fp16 array (Q, P^T's one block).
  __device__ static __forceinline__ int at(int r, int ch) {
    return (ch >> 3) * kBlockBytes + r * 128 + (((ch & 7) ^ (r & 7)) << 4);
  }
};

// Named barriers 1 and 2: a team's 128 threads (0 is __syncthreads').
__device__ __forceinline__ void team_sync(int team) {
  asm volatile("bar.sync %0, 128;" ::"r"(1 + team) : "memory");
}
// The same barrier, returning whether any of the team's threads passed `pred`.
__device__ __forceinline__ bool team_sync_any(int team, bool pred) {
  uint32_t out;
  asm volatile(
      "{\n.reg .pred p, q;\nsetp.ne.u32 p, %1, 0;\nbar.red.or.pred q, %2, 128, p;\n"
      "selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(out) : "r"(static_cast<uint32_t>(pred)), "r"(1 + team) : "memory");
  return out != 0;
}

// Four 8x8 fp16 matrices from accumulator-layout registers, stored transposed: lane l gives
// the address of row l % 8 of matrix l / 8 (after the transpose: a column of the fragment).
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t address, uint32_t r0, uint32_t r1,
                                                  uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
               ::"r"(address), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}

// Q row r's A-fragment words of load_rows (chunk s: dims 16 s + 4 c, + 1 in `lo`, + 2, + 3 in
// `hi`) into the permuted layout: dim d = 32 c' + 4 kk + e sits at column 16 kk + 2 c' + 8 (e /
// 2) + e % 2 (the K fragments' order).
template <int HEAD_DIM>
__device__ __forceinline__ void store_query_chunk(char* q, int r, int s, int c, uint32_t lo,
                                                  uint32_t hi) {
  using L = TmLayout<HEAD_DIM>;
  const int kk = 4 * (s & 1) + c, byte = 4 * (s >> 1);
  *reinterpret_cast<uint32_t*>(q + L::at(r, 2 * kk) + byte) = lo;
  *reinterpret_cast<uint32_t*>(q + L::at(r, 2 * kk + 1) + byte) = hi;
}

// S^T's A operand: rows t and t + 8 of warp w's 16 tokens (t = 16 w + g), dims 32 c .. + 31.
template <int HEAD_DIM>
__device__ __forceinline__ void load_key_fragments(uint32_t (&kf)[8][4], const char* stage,
                                                   int t, int c) {
  using S = typename TmLayout<HEAD_DIM>::Stage;
  uint4 w[2][2];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int x = 0; x < 2; ++x)
      w[h][x] = *reinterpret_cast<const uint4*>(stage + S::kK + S::offset(t + 8 * h, 2 * c + x));
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint32_t words[8] = {w[h][0].x, w[h][0].y, w[h][0].z, w[h][0].w,
                               w[h][1].x, w[h][1].y, w[h][1].z, w[h][1].w};
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) unpack_word(words[kk] ^ 0x80808080u, kf[kk][h], kf[kk][2 + h]);
  }
}

// O^T's A operand for the tile's 4 k-steps: vf[b][kt] = dims d0 + 2b (rows g) and d0 + 2b + 1
// (rows g + 8), d0 = 4 (8 w + g), at tokens 16 kt + 2c, + 1 (regs 0, 1) and + 8, + 9 (2, 3).
template <int HEAD_DIM>
__device__ __forceinline__ void load_value_fragments(uint32_t (&vf)[2][4][4], const char* stage,
                                                     int w, int g, int c) {
  using S = typename TmLayout<HEAD_DIM>::Stage;
  const int chunk = 2 * w + (g >> 2), byte = 4 * (g & 3);
#pragma unroll
  for (int kt = 0; kt < 4; ++kt) {
    uint32_t word[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int t = 16 * kt + 2 * c + (i & 1) + 8 * (i >> 1);
      word[i] = *reinterpret_cast<const uint32_t*>(stage + S::kV + S::offset(t, chunk) + byte) ^
                0x80808080u;
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // tokens 2c, 2c+1 (regs 0, 1), + 8 (regs 2, 3)
      const uint32_t lo = prmt(word[2 * half], word[2 * half + 1], 0x5140u);
      const uint32_t hi = prmt(word[2 * half], word[2 * half + 1], 0x7362u);
      vf[0][kt][2 * half] = pair_from_interleaved<0>(lo, hi);
      vf[0][kt][2 * half + 1] = pair_from_interleaved<1>(lo, hi);
      vf[1][kt][2 * half] = pair_from_interleaved<2>(lo, hi);
      vf[1][kt][2 * half + 1] = pair_from_interleaved<3>(lo, hi);
    }
  }
}

// P^T (fp16, accumulator layout of S^T: p[4 j + 2 h + e] = token 16 w + g + 8 h, head 8 j + 2c
// + e, packed in pairs pp[2 j + h]) into the [head][token] buffer at `buffer`.
__device__ __forceinline__ void store_probabilities(uint32_t buffer, const uint32_t (&pp)[16],
                                                    int w, int lane) {
  const int matrix = lane >> 3, i = lane & 7;
#pragma unroll
  for (int q = 0; q < 4; ++q) {  // matrices (j, h) = (2q, 0), (2q, 1), (2q + 1, 0), (2q + 1, 1)
    const int j = 2 * q + (matrix >> 1), h = matrix & 1;
    const int head = 8 * j + i, chunk = 2 * w + h;
    stmatrix_x4_trans(buffer + head * 128 + (((chunk ^ (head & 7))) << 4), pp[4 * q],
                      pp[4 * q + 1], pp[4 * q + 2], pp[4 * q + 3]);
  }
}

// O^T += V^T P^T over one tile: two m64 blocks of dims, 4 k-steps of 16 tokens.
__device__ __forceinline__ void issue_values_tm(float (&o)[2][32], const uint32_t (&vf)[2][4][4],
                                                uint32_t buffer) {
  const uint64_t pt = sw128_descriptor(buffer, 16, 1024);
#pragma unroll
  for (int kt = 0; kt < 4; ++kt)
#pragma unroll
    for (int b = 0; b < 2; ++b)
      wgmma_m64n64k16_rs_kmajor<false>(o[b], vf[b][kt], descriptor_plus(pt, 32 * kt));
  wgmma_commit();
}

}  // namespace llfd
