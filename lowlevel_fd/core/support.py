"""The support matrix: every value a plan accepts, and the ids the kernels' enums use.

The Python checks (``core.validate``, ``KVCacheSpec``, the plans) and the template arguments of
every kernel family (``decode.variants``, ``append.variants``) derive from these tables; the
ids must equal the enums of ``cu/kv_types.cuh`` (a CPU test parses that header).
"""
from __future__ import annotations

HEAD_DIMS = (64, 128, 256)
# Query heads per KV head: any group from 1 to MAX_GROUP (the decode kernels serve a group in
# CTAs of up to 16 heads, decode.variants.head_chunks).
MAX_GROUP = 128
GROUP_SIZES = tuple(range(1, MAX_GROUP + 1))
DTYPES = ("float16", "bfloat16")  # q, out and the new K/V rows
CACHE_DTYPES = ("int8",)
CONTIGUOUS_LAYOUTS = ("bnsh", "bsnh")  # [B, Hkv, S, D] | [B, S, Hkv, D], any 16-byte strides
# Paged pools indexed by a block table: [num_pages, page_size, Hkv, D] | [num_pages, Hkv,
# page_size, D], any 16-byte strides; a page holds PAGE_SIZES tokens.
PAGED_LAYOUTS = ("nhd", "hnd")
KV_LAYOUTS = CONTIGUOUS_LAYOUTS + PAGED_LAYOUTS
PAGE_SIZES = tuple(1 << i for i in range(9))  # 1 .. 256
PROMPT_LAYOUTS = ("bsnh", "bnsh")
SCALE_MODES = ("tensor", "head", "token")
# Per-tensor and per-head scales are fp32; per-token-per-head scales fp32 or fp16.
SCALE_DTYPES = {"tensor": ("float32",), "head": ("float32",), "token": ("float32", "float16")}
ROPE_STYLES = (None, "neox", "gptj")
# How keys are stored: as given (after RoPE), or multiplied by the normalized Hadamard matrix
# (spreads outlier channels over the row: smaller per-token INT8 error, same scores).
KEY_TRANSFORMS = ("none", "hadamard")
WARP_COUNTS = (2, 4, 8)  # warps per decode CTA that TileConfig accepts (all compiled by CI)

# -- ids shared with cu/kv_types.cuh ------------------------------------------------------------
SCALE_MODE_IDS = {"tensor": 0, "head": 1, "token": 2}  # enum ScaleMode
ROPE_IDS = {None: 0, "neox": 1, "gptj": 2}             # enum RopeStyle
KEY_TRANSFORM_IDS = {"none": 0, "hadamard": 1}         # the params' key_transform field
# Bits of a plan's error word (kError* in kv_types.cuh).
ERROR_OUTSIDE_CACHE = 1  # a length or position outside [0, capacity): clamped, nothing written
ERROR_PROMPT_LENGTH = 2  # a prompt length < 0 or > the prompt array's S: clamped
ERROR_BAD_PAGE = 4       # a block-table page id outside [0, num_pages): never dereferenced
ERROR_QUERY_RANGE = 8    # device qo_indptr not monotone / past total_q / beyond the plan, or a
                         # chunk longer than its KV: those rows are zero (lse -inf)

# -- C++ spellings of the template arguments ----------------------------------------------------
CXX_DTYPES = {"float16": "llfd::f16", "bfloat16": "llfd::bf16"}
# Scales are loaded and stored as raw words: fp16 per-token scales as uint16_t.
_SCALE_STORAGE = {"float32": "float", "float16": "uint16_t"}


def scale_storage(scale_mode: str, scale_dtype: str) -> str:
    """The C++ type a kernel loads one scale as (per-tensor and per-head scales are fp32)."""
    return _SCALE_STORAGE[scale_dtype if scale_mode == "token" else "float32"]


def cxx_bool(value: bool) -> str:
    return "true" if value else "false"
