// Kernels of the benchmark tools (tools/bench.py, tools/stream_probe.py), not of the library:
//  * read_bandwidth: the device's achievable streaming-read bandwidth, the yardstick every
//    decode result is reported against. It reads exactly like the decode kernel streams the KV
//    cache (16-byte ld.global.cs vectors), so "% of measured bandwidth" compares like with like.
//  * fill_random: fills buffers with pseudo-random bytes on the device. Zero pages can be
//    served faster by some memory systems and make correctness checks vacuous, and uploading
//    tens of GiB of numpy randomness over PCIe would dominate the run time.
#include "common.cuh"  // from lowlevel_fd/cu/: CompileOptions puts it on the include path

namespace llfd {

__device__ __forceinline__ uint32_t xor_words(const uint32_t (&w)[4]) {
  return w[0] ^ w[1] ^ w[2] ^ w[3];
}

// splitmix64: a bijective 64-bit mix, so distinct (seed, index) pairs give distinct streams.
__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace llfd

// Grid-stride read of n_vec 16-byte vectors. Four independent loads per thread per iteration
// keep enough bytes in flight to cover DRAM latency (bandwidth x latency is ~2 MB on an H100,
// ~16 KB per SM). The XOR of every word feeds a store that never happens in practice (the
// accumulator would have to hit one 64-bit value), which keeps each load live without writing
// anything; the loads are also asm volatile, so the compiler cannot drop them.
extern "C" __global__ void read_bandwidth(const uint4* __restrict__ src, unsigned long long n_vec,
                                          unsigned long long* sink) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  uint32_t acc_lo = 0, acc_hi = 0;
  uint32_t w0[4], w1[4], w2[4], w3[4];
  for (; i + 3 * stride < n_vec; i += 4 * stride) {
    llfd::load_stream<16>(w0, src + i);
    llfd::load_stream<16>(w1, src + i + stride);
    llfd::load_stream<16>(w2, src + i + 2 * stride);
    llfd::load_stream<16>(w3, src + i + 3 * stride);
    acc_lo ^= llfd::xor_words(w0) ^ llfd::xor_words(w2);
    acc_hi ^= llfd::xor_words(w1) ^ llfd::xor_words(w3);
  }
  for (; i < n_vec; i += stride) {  // the tail: fewer than 4 strides left
    llfd::load_stream<16>(w0, src + i);
    acc_lo ^= llfd::xor_words(w0);
  }
  const uint64_t acc = (static_cast<uint64_t>(acc_hi) << 32) | acc_lo;
  if (acc == 0x8badf00ddeadbeefull) *sink = acc;
}

// dst[i] = 16 pseudo-random bytes from (seed, i); grid-stride over n_vec vectors.
extern "C" __global__ void fill_random(uint4* __restrict__ dst, unsigned long long n_vec,
                                       unsigned long long seed) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  const uint64_t key = llfd::splitmix64(seed);
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n_vec;
       i += stride) {
    const uint64_t lo = llfd::splitmix64(key ^ (2 * i));
    const uint64_t hi = llfd::splitmix64(key ^ (2 * i + 1));
    dst[i] = make_uint4(static_cast<uint32_t>(lo), static_cast<uint32_t>(lo >> 32),
                        static_cast<uint32_t>(hi), static_cast<uint32_t>(hi >> 32));
  }
}

// dst row r (at r * dst_pitch bytes) = src row r (row_words 4-byte words, rows packed):
// scatters per-page blocks (e.g. the scales of a page slot, benchlib.pages.PageSlot) into a
// larger pitched allocation. Grid-stride over rows x row_words.
extern "C" __global__ void copy_pitched(char* __restrict__ dst, long long dst_pitch,
                                        const uint32_t* __restrict__ src, long long row_words,
                                        long long rows) {
  const long long total = rows * row_words;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long row = i / row_words, word = i % row_words;
    reinterpret_cast<uint32_t*>(dst + row * dst_pitch)[word] = src[i];
  }
}

// The decode kernel's memory access without its math (tools/probe_gather.py): what a layout
// of the KV cache costs the memory system alone. Grid (Hkv, splits, B), 8 warps; each warp
// streams 16-token tiles of one KV head (K and V rows of 128 bytes, and with token scales
// their 4-byte scales) through a 2-stage cp.async pipeline, tile w + 8i of its CTA's split,
// exactly as decode_split (PAGED or not) issues them. Row byte offset of (sequence or page
// `unit`, head h, slot t): unit * batch_stride + h * head_stride + t * token_stride; paged
// (`table` not null): token pos of sequence b is slot pos % 2^page_shift of page
// table[b * pages_per_seq + (pos >> page_shift)]. Scales likewise with their own strides.
struct GatherParams {
  const int8_t* k;
  const int8_t* v;
  const char* k_scale;  // null: no per-token scales
  const char* v_scale;
  const int32_t* table;  // null: contiguous
  long long batch_stride, head_stride, token_stride;  // bytes
  long long scale_batch_stride, scale_head_stride, scale_token_stride;  // bytes
  int seq_len, splits, page_shift, pages_per_seq;
  int sync_every;  // > 0: launched in clusters along x, the CTAs meet every sync_every steps
  unsigned long long* sink;
};

extern "C" __global__ void __launch_bounds__(256) gather_tiles(const GatherParams p) {
  constexpr int kRowBytes = 128, kTile = 16 * kRowBytes, kStage = 2 * kTile + 128;
  extern __shared__ __align__(128) char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int head = blockIdx.x, b = blockIdx.z;
  const int chunk = p.seq_len / p.splits, start = blockIdx.y * chunk, end = start + chunk;
  const uint32_t base = llfd::shared_address(smem) + warp * 2 * kStage;
  auto unit_slot = [&](int pos, long long& unit, int& slot) {
    if (p.table == nullptr) {
      unit = b, slot = pos;
    } else {
      unit = __ldg(p.table + b * p.pages_per_seq + (pos >> p.page_shift));
      slot = pos & ((1 << p.page_shift) - 1);
    }
  };
  auto issue = [&](int stage, int t0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // 16 rows x 8 chunks of 16 bytes, per K and V
      const int index = lane + 32 * i, row = index / 8, c = index % 8;
      long long unit;
      int slot;
      unit_slot(t0 + row, unit, slot);
      const long long at = unit * p.batch_stride + head * p.head_stride +
                           slot * p.token_stride + 16 * c;
      llfd::cp_async_16(base + stage * kStage + 16 * index, p.k + at);
      llfd::cp_async_16(base + stage * kStage + kTile + 16 * index, p.v + at);
    }
    if (p.k_scale != nullptr) {  // lanes 0-15 K, 16-31 V: one token each
      long long unit;
      int slot;
      unit_slot(t0 + lane % 16, unit, slot);
      const long long at = unit * p.scale_batch_stride + head * p.scale_head_stride +
                           slot * p.scale_token_stride;
      llfd::cp_async_4(base + stage * kStage + 2 * kTile + 4 * lane,
                       (lane < 16 ? p.k_scale : p.v_scale) + at, 4);
    }
  };
  uint32_t acc = 0;
  int t0 = start + 16 * warp, stage = 0, step = 0;
  bool arrived = false;  // a cluster barrier phase open: wait before arriving again
  if (t0 < end) issue(0, t0);
  llfd::cp_async_commit();
  for (; t0 < end; t0 += 16 * 8) {
    if (t0 + 16 * 8 < end) issue(stage ^ 1, t0 + 16 * 8);
    llfd::cp_async_commit();
    llfd::cp_async_wait<1>();
    __syncwarp();
    const uint4* words = reinterpret_cast<const uint4*>(smem + (warp * 2 + stage) * kStage);
#pragma unroll
    for (int i = 0; i < 9; ++i) {  // every byte the warp copied (K, V, scales)
      if (i < 8 || lane < 8) {
        const uint4 w = words[lane + 32 * i];
        acc ^= w.x ^ w.y ^ w.z ^ w.w;
      }
    }
    __syncwarp();
    stage ^= 1;
    if (p.sync_every > 0 && ++step % p.sync_every == 0) {  // keep a cluster's heads together
      if (arrived) llfd::cluster_wait();
      llfd::cluster_arrive_relaxed();
      arrived = true;
    }
  }
  if (arrived) llfd::cluster_wait();
  if (acc == 0x8badf00du) *p.sink = acc;
}

// What a kernel could make of a layout's bytes (tools/probe_bulk.py): a CTA's KV heads (all of
// them, or one) of each 16-token tile, every contiguous run of the tile's rows (a head's
// tokens, a whole page, a page's tokens of all heads, a row) fetched by one cp.async.bulk copy
// (the copy engine issues it: no per-row address arithmetic), `stages` tiles in flight on
// mbarriers. One warp per CTA; grid (splits, B, KV heads / heads per CTA): the CTA's first
// head is blockIdx.z x head_step bytes into each unit. It bounds from below what an attention
// kernel with this access pays for the layout, as gather_tiles bounds the decode kernel's.
struct BulkSide {  // one kind of row (K and V rows, or their scales), bytes
  long long unit_stride;  // between sequences (contiguous) or pages
  long long token_stride, seg_stride;  // within a unit: between tokens, between segments
  int seg_bytes, segs;  // a tile's run per unit and segment, and the segments per unit
};

struct BulkParams {
  const char* k;
  const char* v;
  const char* k_scale;  // null: no scales
  const char* v_scale;
  const int32_t* table;  // null: contiguous
  BulkSide rows, scales;
  int seq_len, splits, page_shift, pages_per_seq;
  int tile_units;  // units (pages) per 16-token tile: 16 / page_size below 16, else 1
  int stages, stage_bytes;
  long long row_head_step, scale_head_step;  // bytes from one CTA's first head to the next's
  // warps 1: one warp issues every copy. warps = segs: warp w issues segment w (a head) on its
  // own stages and barriers, as the decode kernel's warps do; lockstep: a CTA barrier per tile.
  int warps, lockstep;
  int interleave;  // with warps > 1: warp w copies every segment of tiles w, w + warps, ...
  // Not null: the rows come by bulk tensor copies (one 128-byte x tokens box per segment) from
  // the K and V tensor maps here (two CUtensorMap in global memory; dims: bytes of a row,
  // tokens of a unit, heads, units), one head per CTA.
  const char* tensor_maps;
  int delay;  // cycles each warp spins per tile after it lands (stands in for the math)
  unsigned long long* sink;
};

namespace llfd {

__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, int bytes, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

__device__ __forceinline__ bool bar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t ok;
  asm volatile(
      "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
      : "=r"(ok) : "r"(bar), "r"(parity) : "memory");
  return ok != 0;
}

}  // namespace llfd

extern "C" __global__ void __launch_bounds__(256) gather_bulk(const BulkParams p) {
  extern __shared__ __align__(128) char smem_all[];
  __shared__ __align__(8) uint64_t bars_all[64];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, b = blockIdx.y;
  // 1024-byte aligned (the host asks for 1 KiB more): a 128-byte swizzle's pattern repeats so.
  char* const aligned = smem_all + ((1024 - llfd::shared_address(smem_all) % 1024) % 1024);
  char* const smem = aligned + warp * p.stages * p.stage_bytes;
  uint64_t* const bars = bars_all + warp * p.stages;
  const int chunk = p.seq_len / p.splits, start = blockIdx.x * chunk, end = start + chunk;
  const int tiles = chunk / 16, unit_tokens = 16 / p.tile_units;
  const uint32_t base = llfd::shared_address(smem), bar0 = llfd::shared_address(bars);
  if (lane == 0) {
    for (int s = 0; s < p.stages; ++s)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar0 + 8 * s));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    if (p.tensor_maps != nullptr)
      for (int kv = 0; kv < 2; ++kv)
        asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;"
                     ::"l"(p.tensor_maps + 128 * kv) : "memory");
  }
  __syncwarp();
  const bool per_head = p.warps > 1 && !p.interleave;  // warp w: segment w of every tile
  const int row_segs = per_head ? 1 : p.rows.segs;
  const int scale_segs = per_head ? 1 : p.scales.segs;
  const int row_copies = p.tile_units * row_segs;
  const int scale_copies = p.k_scale != nullptr ? p.tile_units * scale_segs : 0;
  const int tx = 2 * (row_copies * p.rows.seg_bytes + scale_copies * p.scales.seg_bytes);
  auto issue = [&](int stage, int t0) {
    const uint32_t bar = bar0 + 8 * stage, dst = base + stage * p.stage_bytes;
    if (lane == 0)
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(tx)
                   : "memory");
    __syncwarp();
    // The sequence or page of token `pos`, and its slot there.
    auto unit_slot = [&](int pos, int& unit, int& slot) {
      unit = b, slot = pos;
      if (p.table != nullptr) {
        unit = __ldg(p.table + b * p.pages_per_seq + (pos >> p.page_shift));
        slot = pos & ((1 << p.page_shift) - 1);
      }
    };
    auto source = [&](const BulkSide& side, long long head_step, int i) {
      const int per = per_head ? 1 : side.segs;
      const int u = i / per, seg = per_head ? warp : i % per;
      int unit, slot;
      unit_slot(t0 + u * unit_tokens, unit, slot);
      return static_cast<long long>(unit) * side.unit_stride + slot * side.token_stride +
             seg * side.seg_stride + blockIdx.z * head_step;
    };
    for (int i = lane; i < row_copies; i += 32) {
      const uint32_t to = dst + i * p.rows.seg_bytes;
      if (p.tensor_maps != nullptr) {  // one head per CTA: segment i is unit i's run
        int unit, slot;
        unit_slot(t0 + i * unit_tokens, unit, slot);
#pragma unroll
        for (int kv = 0; kv < 2; ++kv)
          asm volatile(
              "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
              " [%0], [%1, {%2, %3, %4, %5}], [%6];"
              ::"r"(to + kv * row_copies * p.rows.seg_bytes), "l"(p.tensor_maps + 128 * kv),
                "r"(0), "r"(slot), "r"(static_cast<int>(blockIdx.z)), "r"(unit), "r"(bar)
              : "memory");
        continue;
      }
      const long long at = source(p.rows, p.row_head_step, i);
      llfd::bulk_copy(to, p.k + at, p.rows.seg_bytes, bar);
      llfd::bulk_copy(to + row_copies * p.rows.seg_bytes, p.v + at, p.rows.seg_bytes, bar);
    }
    for (int i = lane; i < scale_copies; i += 32) {
      const long long at = source(p.scales, p.scale_head_step, i);
      const uint32_t to = dst + 2 * row_copies * p.rows.seg_bytes + i * p.scales.seg_bytes;
      llfd::bulk_copy(to, p.k_scale + at, p.scales.seg_bytes, bar);
      llfd::bulk_copy(to + scale_copies * p.scales.seg_bytes, p.v_scale + at,
                      p.scales.seg_bytes, bar);
    }
  };
  // This warp's tiles: all of them, or (interleave) every warps-th from its own.
  const int w0 = p.interleave ? warp : 0, wstep = p.interleave ? p.warps : 1;
  const int mine = tiles > w0 ? (tiles - w0 + wstep - 1) / wstep : 0;
  auto tile_start = [&](int j) { return start + 16 * (w0 + wstep * j); };
  for (int j = 0; j < p.stages && j < mine; ++j) issue(j, tile_start(j));
  uint32_t acc = 0;
  for (int j = 0; j < mine; ++j) {
    const int stage = j % p.stages;
    if (p.lockstep) __syncthreads();  // every warp has as many tiles (the host checks)
    while (!llfd::bar_try_wait(bar0 + 8 * stage, (j / p.stages) & 1)) {
    }
    acc ^= reinterpret_cast<const uint32_t*>(smem + stage * p.stage_bytes)[lane];
    if (p.delay > 0) {
      const long long until = clock64() + p.delay;
      while (clock64() < until) {
      }
    }
    // the generic read above before the async proxy's next write of the stage
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncwarp();
    if (j + p.stages < mine) issue(stage, tile_start(j + p.stages));
  }
  if (acc == 0x8badf00du && end > 0) *p.sink = acc;
}
