// What every kernel family shares about the cache: the scale modes, the RoPE styles and the bits
// of the error word. The ids are those of lowlevel_fd/core/support.py (a CPU test compares them).
#pragma once
#include "common.cuh"

namespace llfd {

enum ScaleMode : int { kScalePerTensor = 0, kScalePerHead = 1, kScalePerToken = 2 };
enum RopeStyle : int { kRopeNone = 0, kRopeNeox = 1, kRopeGptj = 2 };

// Bits of *error_flags, sticky until the host clears them.
constexpr uint32_t kErrorOutsideCache = 1u;  // a length or position outside [0, capacity)
constexpr uint32_t kErrorPromptLength = 2u;  // a prompt length < 0 or > the prompt's S: clamped
constexpr uint32_t kErrorBadPage = 4u;       // a block-table page id outside [0, num_pages)
constexpr uint32_t kErrorQueryRange = 8u;    // query rows (qo_indptr) not monotone, past total_q,
                                             // longer than the KV or than the plan covers

}  // namespace llfd
