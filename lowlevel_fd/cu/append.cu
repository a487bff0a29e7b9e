// Fused RoPE + INT8 quantization + cache write: the append of one decode step (append_token)
// and the bulk write of whole prompts (quantize_prompt).
//
// Both kernels work on "rows" (rows.cuh): one head vector of D elements of K, V or Q spread
// over kLanes = D/8 lanes, so a row needs no shared memory. Every lane of a warp runs every
// shuffle (rows that need none discard the result), so the full-mask shuffles never diverge even
// when one warp holds K, V and Q rows at once. A CTA keeps kRowsInFlight rows per lane group
// loaded at once: the kernels are latency bound (a few KiB per sequence), so independent loads
// in flight matter more than anything else. RoPE and the K that it feeds are fp32; the rotated
// q is rounded once to the input dtype.
#include "append_params.cuh"
#include "cache_pages.cuh"
#include "rows.cuh"

namespace llfd {

constexpr int kThreads = 512;
constexpr int kRowsInFlight = 2;
constexpr int kPromptTokens = 8;  // tokens per quantize_prompt CTA

template <int HEAD_DIM>
struct RowShape : RowLanes<HEAD_DIM> {
  static constexpr int kRowsPerPass = kThreads / RowLanes<HEAD_DIM>::kLanes;
  static constexpr int kRowsPerRound = kRowsPerPass * kRowsInFlight;
};

template <int HEAD_DIM>
__device__ __forceinline__ float2 rope_coefficients(const AppendParams& p, int pos, int i) {
  return rope_coefficients<HEAD_DIM>(p.cos_sin, p.rope_theta, pos, i);
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
    if (threadIdx.x == 0) atomicOr(p.error_flags, kErrorOutsideCache);
    return;
  }
  int64_t cache_row, scale_base;  // head 0 of the token (cache_pages.cuh)
  if (!locate_token(p, b, 0, pos, cache_row, scale_base)) {  // a page id out of range
    if (threadIdx.x == 0) atomicOr(p.error_flags, kErrorBadPage);
    return;
  }
  cache_row += 8 * lane;
  if constexpr (ROPE != kRopeNone) {
    for (int i = threadIdx.x; i < HEAD_DIM / 2; i += kThreads)
      rope_cs[i] = rope_coefficients<HEAD_DIM>(p, pos, i);
    __syncthreads();
  }

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
      if (p.key_transform) hadamard_row<HEAD_DIM>(x, lane, is_k || is_q);
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
      const int64_t scale_index = scale_base + head * p.scale_head_stride;
      float dequant;
      quantize_row<HEAD_DIM, SCALE_MODE, ScaleT>(
          x, kv, scale, (is_k ? p.k_cache : p.v_cache) + cache_row + head * p.kv_head_stride,
          static_cast<ScaleT*>(scales) + scale_index, lane, dequant);
    }
  }
  // ---- advance: every thread read the position above, so bumping it after the barrier
  // cannot be seen by a reader of this launch ----
  if (p.advance) {
    __syncthreads();
    if (threadIdx.x == 0) p.seq_lens[b] = pos + 1;
  }
}

// ---- quantize_prompt: positions start..start+len-1 of every sequence --------------------------
// Grid (ceil(S / kPromptTokens), B). Rows: K then V, token-major, head-minor, so neighbouring
// lane groups touch neighbouring memory in the BSNH layouts. Prompt token t goes to position
// start + t (start = p.starts[b], or 0: a chunk after start cached tokens, as in chunked
// prefill), rotated at that position.
template <int HEAD_DIM, int SCALE_MODE, typename T, typename ScaleT, int ROPE>
__global__ void __launch_bounds__(kThreads)
quantize_prompt(const __grid_constant__ AppendParams p) {
  using R = RowShape<HEAD_DIM>;
  constexpr int kCs = ROPE != kRopeNone ? HEAD_DIM / 2 : 1;
  __shared__ float2 rope_cs[ROPE != kRopeNone ? kPromptTokens : 1][kCs];
  const int b = blockIdx.y, t0 = blockIdx.x * kPromptTokens;
  const int lane = threadIdx.x % R::kLanes, slot = threadIdx.x / R::kLanes;
  const bool reporter = blockIdx.x == 0 && threadIdx.x == 0;  // one report per sequence
  // A programmatic successor (MultiPlan.run(early_reads=True)) may launch now and read the
  // cache before each chunk while this kernel writes the chunks; it waits for the rest.
  allow_next_grid();

  int len = p.seq_lens[b];
  if (len < 0 || len > p.prompt_tokens) {  // never read outside the prompt
    if (reporter) atomicOr(p.error_flags, kErrorPromptLength);
    len = len < 0 ? 0 : p.prompt_tokens;
  }
  const int start = p.starts != nullptr ? p.starts[b] : 0;
  if (start < 0 || start > p.capacity) {  // a chunk that starts outside: nothing written
    if (reporter) atomicOr(p.error_flags, kErrorOutsideCache);
    if (reporter && p.seq_lens_out != nullptr) p.seq_lens_out[b] = start;
    return;
  }
  if (len > p.capacity - start) {  // never write outside the cache
    if (reporter) atomicOr(p.error_flags, kErrorOutsideCache);
    len = p.capacity - start;
  }
  if (reporter && p.seq_lens_out != nullptr) p.seq_lens_out[b] = start + len;
  const int tokens = min(kPromptTokens, len - t0);
  if (tokens <= 0) return;
  if constexpr (ROPE != kRopeNone) {
    for (int idx = threadIdx.x; idx < tokens * (HEAD_DIM / 2); idx += kThreads)
      rope_cs[idx / (HEAD_DIM / 2)][idx % (HEAD_DIM / 2)] =
          rope_coefficients<HEAD_DIM>(p, start + t0 + idx / (HEAD_DIM / 2),
                                      idx % (HEAD_DIM / 2));
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
      if (p.key_transform) hadamard_row<HEAD_DIM>(x, lane, is_k && active);
      void* scales = is_k ? p.k_scale : p.v_scale;
      const float scale = active ? given_scale<SCALE_MODE>(scales, head) : 0.f;
      int64_t offset = 0, scale_index = 0;
      bool located = active && locate_token(p, b, head, start + t, offset, scale_index);
      if (active && !located) atomicOr(p.error_flags, kErrorBadPage);
      float dequant;
      quantize_row<HEAD_DIM, SCALE_MODE, ScaleT>(
          x, located, scale, (is_k ? p.k_cache : p.v_cache) + offset + 8 * lane,
          static_cast<ScaleT*>(scales) + scale_index, lane, dequant);
    }
  }
}

}  // namespace llfd
