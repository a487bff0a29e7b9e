// One head vector ("row") of K, V or Q spread over D/8 lanes, 8 consecutive elements (one
// 16-byte load) per lane: rotary embedding and INT8 quantization, shared by the append kernels
// (append.cu) and the decode kernel's fused append (decode_append.cuh), so that both write
// bit-identical cache rows.
//  * NeoX pairs (i, i + D/2) sit in lanes l and l + kLanes/2 at the same register: one
//    xor-shuffle per element. GPT-J pairs (2i, 2i + 1) sit in one lane.
//  * The per-token absmax is an xor-reduction over the row's lanes.
//  * Every lane of a warp must run every shuffle (lanes whose row is inactive discard the
//    result): the full-mask shuffles never diverge.
// Quantization is bit-exact with lowlevel_fd/quant.py: fp32 products rounded once (__fmul_rn,
// no contraction into an FMA), reciprocals by __fdiv_rn, round-half-even, clamp to +-127 before
// the cast (never wraps).
#pragma once
#include "kv_types.cuh"

namespace llfd {

constexpr uint32_t kFullMask = 0xffffffffu;

template <int HEAD_DIM>
struct RowLanes {
  static_assert(HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256, "head_dim 64/128/256");
  static constexpr int kLanes = HEAD_DIM / 8;  // 8, 16 or 32: a power of two <= 32
};

// ---- rotary coefficients ---------------------------------------------------------------------
// (cos, sin) of an fp32 angle |a| < 2^31, evaluated in double and rounded once to fp32 (within
// one fp32 ulp of the exact values, as the library sincosf). The angle is reduced by pi/2 with a
// two-part constant through fma (error ~1e-17 rad for any such angle), then Taylor polynomials
// on |r| <= pi/4 (truncation < 1e-21). Unlike sincosf there is no Payne-Hanek slow path, whose
// scratch array lands in a stack frame once the surrounding kernel is large.
template <int N>
__device__ __forceinline__ double horner(const double (&c)[N], double x) {
  double p = c[0];
#pragma unroll
  for (int i = 1; i < N; ++i) p = fma(p, x, c[i]);
  return p;
}

__device__ __forceinline__ float2 cos_sin_of(float angle) {
  constexpr double kTwoOverPi = 0.63661977236758134308;
  constexpr double kPio2Hi = 1.5707963267948965580e+00, kPio2Lo = 6.1232339957367660359e-17;
  const double a = angle;
  const double k = rint(a * kTwoOverPi);
  const double r = fma(-k, kPio2Lo, fma(-k, kPio2Hi, a));
  const double r2 = r * r;
  // Taylor coefficients in r^2, highest first: sin r = r - r^3 * S(r^2), cos r = 1 + r^2 C(r^2).
  constexpr double kSin[] = {1.0 / 121645100408832000.0, -1.0 / 355687428096000.0,
                             1.0 / 1307674368000.0, -1.0 / 6227020800.0, 1.0 / 39916800.0,
                             -1.0 / 362880.0, 1.0 / 5040.0, -1.0 / 120.0, 1.0 / 6.0};
  constexpr double kCos[] = {1.0 / 2432902008176640000.0, -1.0 / 6402373705728000.0,
                             1.0 / 20922789888000.0, -1.0 / 87178291200.0, 1.0 / 479001600.0,
                             -1.0 / 3628800.0, 1.0 / 40320.0, -1.0 / 720.0, 1.0 / 24.0, -0.5};
  const double sin_r = r - r * r2 * horner(kSin, r2);
  const double cos_r = fma(horner(kCos, r2), r2, 1.0);
  switch (static_cast<int>(static_cast<long long>(k) & 3)) {
    case 0: return make_float2(static_cast<float>(cos_r), static_cast<float>(sin_r));
    case 1: return make_float2(static_cast<float>(-sin_r), static_cast<float>(cos_r));
    case 2: return make_float2(static_cast<float>(-cos_r), static_cast<float>(-sin_r));
    default: return make_float2(static_cast<float>(sin_r), static_cast<float>(-cos_r));
  }
}

// (cos, sin) of position `pos` and frequency `i`. The table path reads the caller's fp32 table
// [max_pos, D/2, 2] (host-checked to cover every position below the capacity). The theta path
// takes inv_freq in double and rounds it to fp32, rounds the angle pos * inv_freq to fp32, as the
// usual fp32 implementations do, and evaluates it with cos_sin_of. Inline exp2/log2 rather than
// pow: pow is an out-of-line call.
template <int HEAD_DIM>
__device__ __forceinline__ float rope_inv_freq(float theta, int i) {
  return static_cast<float>(exp2(-2.0 * i / HEAD_DIM * log2(static_cast<double>(theta))));
}

template <int HEAD_DIM>
__device__ __forceinline__ float2 rope_table_entry(const float* cos_sin, int pos, int i) {
  return __ldg(reinterpret_cast<const float2*>(cos_sin) +
               static_cast<int64_t>(pos) * (HEAD_DIM / 2) + i);
}

template <int HEAD_DIM>
__device__ __forceinline__ float2 rope_coefficients(const float* cos_sin, float theta, int pos,
                                                    int i) {
  if (cos_sin != nullptr) return rope_table_entry<HEAD_DIM>(cos_sin, pos, i);
  return cos_sin_of(__fmul_rn(static_cast<float>(pos), rope_inv_freq<HEAD_DIM>(theta, i)));
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
    constexpr int kHalf = RowLanes<HEAD_DIM>::kLanes / 2;
    const bool second = (lane & (2 * kHalf - 1)) >= kHalf;  // lane holds the i + D/2 halves
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
      const float2 c = cs[4 * (lane & (RowLanes<HEAD_DIM>::kLanes - 1)) + e];
      const float first = x[2 * e], second = x[2 * e + 1];
      if (apply) {
        x[2 * e] = first * c.x - second * c.y;
        x[2 * e + 1] = first * c.y + second * c.x;
      }
    }
  }
}

// ---- key transform ---------------------------------------------------------------------------
// x <- H x when `apply`, H the normalized Sylvester-Hadamard matrix of order D (H = H^T, H H = I,
// so scores (H q).(H k) = q.k): butterflies over the element index's bits from the lowest (the
// lane's 8 elements, then its row's lanes by xor-shuffle), then one fp32 product by 1/sqrt(D).
// lowlevel_fd/reference.py hadamard_rows runs the same fp32 operations in the same order.
template <int HEAD_DIM>
constexpr float kHadamardNorm = HEAD_DIM == 64 ? 0.125f
                                : HEAD_DIM == 128 ? 0.08838834764831845f : 0.0625f;  // 1/sqrt(D)

template <int HEAD_DIM>
__device__ __forceinline__ void hadamard_row(float (&x)[8], int lane, bool apply) {
  float y[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) y[e] = x[e];
#pragma unroll
  for (int bit = 1; bit < 8; bit <<= 1)
#pragma unroll
    for (int e = 0; e < 8; ++e)
      if (!(e & bit)) {
        const float a = y[e], b = y[e | bit];
        y[e] = a + b;
        y[e | bit] = a - b;
      }
#pragma unroll
  for (int s = 1; s < RowLanes<HEAD_DIM>::kLanes; s <<= 1)
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float partner = __shfl_xor_sync(kFullMask, y[e], s);
      y[e] = (lane & s) ? partner - y[e] : y[e] + partner;
    }
  if (apply)
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = __fmul_rn(y[e], kHadamardNorm<HEAD_DIM>);
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
// Returns the 8 quantized bytes; `dequant` receives the scale a reader of the cache applies
// (the stored per-token scale, after its rounding to ScaleT, or `given_scale`). The absmax
// reduction runs on every lane (see the top of the file).
template <int HEAD_DIM, int SCALE_MODE, typename ScaleT>
__device__ __forceinline__ uint2 quantize_row(const float (&x)[8], bool active, float given_scale,
                                              int8_t* dst, void* scale_dst, int lane,
                                              float& dequant) {
  float inv;
  dequant = given_scale;
  if constexpr (SCALE_MODE == kScalePerToken) {
    float absmax = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) absmax = fmaxf(absmax, fabsf(x[e]));
    absmax = warp_max_xor(absmax, RowLanes<HEAD_DIM>::kLanes / 2);
    inv = absmax > 0.f ? __fdiv_rn(127.f, absmax) : 0.f;
    const float scale = __fdiv_rn(absmax, 127.f);
    if constexpr (sizeof(ScaleT) == 2) {
      const uint16_t half = from_float<f16>(scale);
      dequant = to_float<f16>(half);
      if (active && (lane & (RowLanes<HEAD_DIM>::kLanes - 1)) == 0)
        *static_cast<uint16_t*>(scale_dst) = half;
    } else {
      dequant = scale;
      if (active && (lane & (RowLanes<HEAD_DIM>::kLanes - 1)) == 0)
        *static_cast<float*>(scale_dst) = scale;
    }
  } else {
    inv = given_scale != 0.f ? __fdiv_rn(1.f, given_scale) : 0.f;
  }
  const uint2 bytes = make_uint2(quantize4(x, inv), quantize4(x + 4, inv));
  if (active) *reinterpret_cast<uint2*>(dst) = bytes;
  return bytes;
}

template <int SCALE_MODE>
__device__ __forceinline__ float given_scale(const void* scales, int head) {
  if constexpr (SCALE_MODE == kScalePerTensor) return __ldg(static_cast<const float*>(scales));
  else if constexpr (SCALE_MODE == kScalePerHead)
    return __ldg(static_cast<const float*>(scales) + head);
  else return 0.f;
}

}  // namespace llfd
