// Fused RoPE + INT8 quantization + cache write: the append of one decode step (append_token)
// and the bulk write of whole prompts (quantize_prompt).
//
// Both kernels work on "rows": one head vector of D elements of K, V or Q. A row is spread over
// kLanes = D/8 lanes, each holding 8 consecutive elements (one 16-byte load), so a row needs no
// shared memory:
//  * NeoX pairs (i, i + D/2) sit in lanes l and l + kLanes/2 at the same register: one
//    xor-shuffle per element. GPT-J pairs (2i, 2i + 1) sit in one lane.
//  * The per-token absmax is an xor-reduction over the row's lanes.
//  * Every lane of a warp runs every shuffle (rows that need none discard the result), so the
//    full-mask shuffles never diverge even when one warp holds K, V and Q rows at once.
// A CTA keeps kRowsInFlight rows per lane group loaded at once: the kernels are latency bound
// (a few KiB per sequence), so independent loads in flight matter more than anything else.
//
// Quantization is bit-exact with lowlevel_fd/quant.py: fp32 products rounded once (__fmul_rn,
// no contraction into an FMA), reciprocals by __fdiv_rn, round-half-even, clamp to +-127 before
// the cast (never wraps). RoPE and the K that it feeds are fp32; the rotated q is rounded once to
// the input dtype.
#include "append_params.cuh"

namespace llfd {

constexpr int kThreads = 512;
constexpr int kRowsInFlight = 2;
constexpr int kPromptTokens = 8;  // tokens per quantize_prompt CTA
constexpr uint32_t kFullMask = 0xffffffffu;

template <int HEAD_DIM>
struct RowShape {
  static_assert(HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256, "head_dim 64/128/256");
  static constexpr int kLanes = HEAD_DIM / 8;          // 8, 16 or 32: a power of two <= 32
  static constexpr int kRowsPerPass = kThreads / kLanes;
  static constexpr int kRowsPerRound = kRowsPerPass * kRowsInFlight;
};

// ---- rotary coefficients ---------------------------------------------------------------------
// (cos, sin) of position `pos` and frequency `i`. The table path reads the caller's fp32 table
// (host-checked to cover every position below the capacity). The theta path takes inv_freq in
// double and rounds it to fp32, rounds the angle pos * inv_freq to fp32, as the usual fp32
// implementations do, and evaluates it with the accurate sincosf (full range reduction: right for
// any angle). Inline exp2/log2 rather than pow: pow is an out-of-line call, and around a call
// sincosf's range-reduction scratch lands in a 32-byte stack frame.
template <int HEAD_DIM>
__device__ __forceinline__ float2 rope_coefficients(const AppendParams& p, int pos, int i) {
  if (p.cos_sin != nullptr)
    return __ldg(reinterpret_cast<const float2*>(p.cos_sin) +
                 static_cast<int64_t>(pos) * (HEAD_DIM / 2) + i);
  const float inv_freq = static_cast<float>(
      exp2(-2.0 * i / HEAD_DIM * log2(static_cast<double>(p.rope_theta))));
  float s, c;
  sincosf(__fmul_rn(static_cast<float>(pos), inv_freq), &s, &c);
  return make_float2(c, s);
}

// ---- row helpers -----------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& raw, float (&x)[8]) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    x[2 * w] = to_float<T>(static_cast<uint16_t>(words[w] & 0xffffu));
    x[2 * w + 1] = to_float<T>(static_cast<uint16_t>(words[w] >> 16));
  }
}

// Rotate this lane's 8 elements when `apply`; `cs` holds (cos, sin) for frequencies 0..D/2-1.
template <int ROPE, int HEAD_DIM>
__device__ __forceinline__ void rotate(float (&x)[8], const float2* cs, int lane, bool apply) {
  if constexpr (ROPE == kRopeNeox) {
    constexpr int kHalf = RowShape<HEAD_DIM>::kLanes / 2;
    const bool second = lane >= kHalf;  // this lane holds the i + D/2 halves
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float partner = __shfl_xor_sync(kFullMask, x[e], kHalf);
      const float2 c = cs[8 * (lane & (kHalf - 1)) + e];
      const float out = second ? partner * c.y + x[e] * c.x : x[e] * c.x - partner * c.y;
      if (apply) x[e] = out;
    }
  } else if constexpr (ROPE == kRopeGptj) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 c = cs[4 * lane + e];
      const float first = x[2 * e], second = x[2 * e + 1];
      if (apply) {
        x[2 * e] = first * c.x - second * c.y;
        x[2 * e + 1] = first * c.y + second * c.x;
      }
    }
  }
}

__device__ __forceinline__ uint32_t quantize4(const float* x, float inv) {
  uint32_t word = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int q = max(-127, min(127, __float2int_rn(__fmul_rn(x[j], inv))));
    word |= (static_cast<uint32_t>(q) & 0xffu) << (8 * j);
  }
  return word;
}

// Quantize one row (this lane's 8 elements) and, when `active`, write its bytes at `dst` and, in
// per-token mode, its scale at `scale_dst`. `given_scale` is the per-tensor/per-head scale.
// The absmax reduction runs on every lane (see the top of the file).
template <int HEAD_DIM, int SCALE_MODE, typename ScaleT>
__device__ __forceinline__ void quantize_row(const float (&x)[8], bool active, float given_scale,
                                             int8_t* dst, void* scale_dst, int lane) {
  float inv;
  if constexpr (SCALE_MODE == kScalePerToken) {
    float absmax = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) absmax = fmaxf(absmax, fabsf(x[e]));
    absmax = warp_max_xor(absmax, RowShape<HEAD_DIM>::kLanes / 2);
    inv = absmax > 0.f ? __fdiv_rn(127.f, absmax) : 0.f;
    if (active && lane == 0) {
      const float scale = __fdiv_rn(absmax, 127.f);
      if constexpr (sizeof(ScaleT) == 2)
        *static_cast<uint16_t*>(scale_dst) = from_float<f16>(scale);
      else
        *static_cast<float*>(scale_dst) = scale;
    }
  } else {
    inv = given_scale != 0.f ? __fdiv_rn(1.f, given_scale) : 0.f;
  }
  const uint32_t lo = quantize4(x, inv), hi = quantize4(x + 4, inv);
  if (active) *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi);
}

template <int SCALE_MODE>
__device__ __forceinline__ float given_scale(const void* scales, int head) {
  if constexpr (SCALE_MODE == kScalePerTensor) return __ldg(static_cast<const float*>(scales));
  else if constexpr (SCALE_MODE == kScalePerHead)
    return __ldg(static_cast<const float*>(scales) + head);
  else return 0.f;
}

// ---- append_token: one new token per sequence ------------------------------------------------
// Grid (B). One CTA owns every head of its sequence: it alone reads seq_lens[b], so it can
// advance the length after a __syncthreads with no cross-CTA ordering. Rows: K heads 0..Hkv-1,
// V heads, then the Hq query heads (RoPE only).
template <int HEAD_DIM, int SCALE_MODE, typename T, typename ScaleT, int ROPE>
__global__ void __launch_bounds__(kThreads) append_token(const __grid_constant__ AppendParams p) {
  using R = RowShape<HEAD_DIM>;
  __shared__ float2 rope_cs[ROPE != kRopeNone ? HEAD_DIM / 2 : 1];
  const int b = blockIdx.x;
  const int lane = threadIdx.x % R::kLanes, slot = threadIdx.x / R::kLanes;
  const int kv_heads = p.num_kv_heads;
  const int q_rows = (ROPE != kRopeNone && p.q != nullptr) ? p.num_q_heads : 0;
  const int rows = 2 * kv_heads + q_rows;

  // ---- load: one round of rows, issued before anything waits on the position ----
  uint4 raw[kRowsInFlight];
  auto load_round = [&](int base) {
#pragma unroll
    for (int s = 0; s < kRowsInFlight; ++s) {
      const int row = base + s * R::kRowsPerPass + slot;
      raw[s] = make_uint4(0, 0, 0, 0);
      if (row < kv_heads)
        raw[s] = __ldg(reinterpret_cast<const uint4*>(
            static_cast<const uint16_t*>(p.k_new) + b * p.k_batch_stride +
            row * p.k_head_stride + 8 * lane));
      else if (row < 2 * kv_heads)
        raw[s] = __ldg(reinterpret_cast<const uint4*>(
            static_cast<const uint16_t*>(p.v_new) + b * p.v_batch_stride +
            (row - kv_heads) * p.v_head_stride + 8 * lane));
      else if (row < rows)  // q may be rewritten in place by this kernel: no read-only path
        raw[s] = *reinterpret_cast<const uint4*>(
            static_cast<const uint16_t*>(p.q) + b * p.q_batch_stride +
            (row - 2 * kv_heads) * p.q_head_stride + 8 * lane);
    }
  };
  load_round(0);
  const int pos = p.seq_lens[b];
  if (pos < 0 || pos >= p.capacity) {  // never write outside the cache; tell the host
    if (threadIdx.x == 0) atomicOr(p.error_flags, kErrorPositionOutsideCache);
    return;
  }
  if constexpr (ROPE != kRopeNone) {
    for (int i = threadIdx.x; i < HEAD_DIM / 2; i += kThreads)
      rope_cs[i] = rope_coefficients<HEAD_DIM>(p, pos, i);
    __syncthreads();
  }
  const int64_t cache_row = b * p.kv_batch_stride + pos * p.kv_token_stride + 8 * lane;

  for (int base = 0; base < rows; base += R::kRowsPerRound) {  // uniform across the CTA
    if (base > 0) load_round(base);
#pragma unroll
    for (int s = 0; s < kRowsInFlight; ++s) {
      const int row = base + s * R::kRowsPerPass + slot;
      const bool is_k = row < kv_heads, is_v = !is_k && row < 2 * kv_heads;
      const bool is_q = !is_k && !is_v && row < rows;
      float x[8];
      unpack8<T>(raw[s], x);
      // ---- rotate: K and Q rows, never V ----
      rotate<ROPE, HEAD_DIM>(x, rope_cs, lane, is_k || is_q);
      if (is_q) {
        const int head = row - 2 * kv_heads;
        *reinterpret_cast<uint4*>(static_cast<uint16_t*>(p.q_out) + b * p.q_out_batch_stride +
                                  head * p.q_out_head_stride + 8 * lane) =
            make_uint4(pack2<T>(x[0], x[1]), pack2<T>(x[2], x[3]), pack2<T>(x[4], x[5]),
                       pack2<T>(x[6], x[7]));
      }
      // ---- quantize and write: K and V rows at position pos ----
      const int head = is_k ? row : row - kv_heads;
      const bool kv = is_k || is_v;
      void* scales = is_k ? p.k_scale : p.v_scale;
      const float scale = kv ? given_scale<SCALE_MODE>(scales, head) : 0.f;
      const int64_t scale_index = b * p.scale_batch_stride + head * p.scale_head_stride + pos;
      quantize_row<HEAD_DIM, SCALE_MODE, ScaleT>(
          x, kv, scale, (is_k ? p.k_cache : p.v_cache) + cache_row + head * p.kv_head_stride,
          static_cast<ScaleT*>(scales) + scale_index, lane);
    }
  }
  // ---- advance: every thread read the position above, so bumping it after the barrier
  // cannot be seen by a reader of this launch ----
  if (p.advance) {
    __syncthreads();
    if (threadIdx.x == 0) p.seq_lens[b] = pos + 1;
  }
}

// ---- quantize_prompt: positions 0..len-1 of every sequence -----------------------------------
// Grid (ceil(S / kPromptTokens), B). Rows: K then V, token-major, head-minor, so neighbouring
// lane groups touch neighbouring memory in the BSNH layouts.
template <int HEAD_DIM, int SCALE_MODE, typename T, typename ScaleT, int ROPE>
__global__ void __launch_bounds__(kThreads)
quantize_prompt(const __grid_constant__ AppendParams p) {
  using R = RowShape<HEAD_DIM>;
  constexpr int kCs = ROPE != kRopeNone ? HEAD_DIM / 2 : 1;
  __shared__ float2 rope_cs[ROPE != kRopeNone ? kPromptTokens : 1][kCs];
  const int b = blockIdx.y, t0 = blockIdx.x * kPromptTokens;
  const int lane = threadIdx.x % R::kLanes, slot = threadIdx.x / R::kLanes;
  const bool reporter = blockIdx.x == 0 && threadIdx.x == 0;  // one report per sequence

  int len = p.seq_lens[b];
  if (len < 0 || len > p.prompt_tokens) {  // never read outside the prompt
    if (reporter) atomicOr(p.error_flags, kErrorPromptLength);
    len = len < 0 ? 0 : p.prompt_tokens;
  }
  if (len > p.capacity) {  // never write outside the cache
    if (reporter) atomicOr(p.error_flags, kErrorPositionOutsideCache);
    len = p.capacity;
  }
  if (reporter && p.seq_lens_out != nullptr) p.seq_lens_out[b] = len;
  const int tokens = min(kPromptTokens, len - t0);
  if (tokens <= 0) return;
  if constexpr (ROPE != kRopeNone) {
    for (int idx = threadIdx.x; idx < tokens * (HEAD_DIM / 2); idx += kThreads)
      rope_cs[idx / (HEAD_DIM / 2)][idx % (HEAD_DIM / 2)] =
          rope_coefficients<HEAD_DIM>(p, t0 + idx / (HEAD_DIM / 2), idx % (HEAD_DIM / 2));
    __syncthreads();
  }
  const int kv_heads = p.num_kv_heads, per_kind = tokens * kv_heads, rows = 2 * per_kind;

  for (int base = 0; base < rows; base += R::kRowsPerRound) {  // uniform across the CTA
    uint4 raw[kRowsInFlight];
#pragma unroll
    for (int s = 0; s < kRowsInFlight; ++s) {
      const int row = base + s * R::kRowsPerPass + slot;
      raw[s] = make_uint4(0, 0, 0, 0);
      if (row < rows) {
        const bool is_k = row < per_kind;
        const int rest = is_k ? row : row - per_kind;
        const int t = t0 + rest / kv_heads, head = rest % kv_heads;
        const uint16_t* src =
            is_k ? static_cast<const uint16_t*>(p.k_new) + b * p.k_batch_stride +
                       head * p.k_head_stride + t * p.k_token_stride
                 : static_cast<const uint16_t*>(p.v_new) + b * p.v_batch_stride +
                       head * p.v_head_stride + t * p.v_token_stride;
        raw[s] = __ldg(reinterpret_cast<const uint4*>(src + 8 * lane));
      }
    }
#pragma unroll
    for (int s = 0; s < kRowsInFlight; ++s) {
      const int row = base + s * R::kRowsPerPass + slot;
      const bool active = row < rows, is_k = row < per_kind;
      const int rest = is_k ? row : row - per_kind;
      const int token = rest / kv_heads, head = rest % kv_heads, t = t0 + token;
      float x[8];
      unpack8<T>(raw[s], x);
      rotate<ROPE, HEAD_DIM>(x, rope_cs[ROPE != kRopeNone && active ? token : 0], lane,
                             is_k && active);
      void* scales = is_k ? p.k_scale : p.v_scale;
      const float scale = active ? given_scale<SCALE_MODE>(scales, head) : 0.f;
      const int64_t offset = b * p.kv_batch_stride + head * p.kv_head_stride +
                             t * p.kv_token_stride + 8 * lane;
      quantize_row<HEAD_DIM, SCALE_MODE, ScaleT>(
          x, active, scale, (is_k ? p.k_cache : p.v_cache) + offset,
          static_cast<ScaleT*>(scales) + b * p.scale_batch_stride + head * p.scale_head_stride + t,
          lane);
    }
  }
}

}  // namespace llfd
