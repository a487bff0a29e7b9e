"""The Python twin of ``DecodeParams`` in cu/decode_params.cuh: same fields, same order."""
from __future__ import annotations

import ctypes

from ..core.binding import PAGE_FIELDS

_POINTERS = ("q", "k_cache", "v_cache", "k_scale", "v_scale", "seq_lens", "out", "lse",
             "partial_out", "partial_lse", "counters", "error_flags")
_STRIDES = ("q_batch_stride", "q_head_stride", "out_batch_stride", "out_head_stride",
            "kv_batch_stride", "kv_head_stride", "kv_token_stride", "scale_batch_stride",
            "scale_head_stride")


class DecodeParams(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_uint64) for name in _POINTERS]
                + [(name, ctypes.c_int64) for name in _STRIDES]
                + [("score_scale_log2", ctypes.c_float), ("num_kv_heads", ctypes.c_int32),
                   ("num_splits", ctypes.c_int32), ("min_split_tokens", ctypes.c_int32),
                   ("capacity", ctypes.c_int32), ("fused_merge", ctypes.c_int32),
                   # the fused append (DecodePlan.append_and_run)
                   ("append", ctypes.c_int32), ("rope", ctypes.c_int32),
                   ("rope_theta", ctypes.c_float), ("cluster_slots_offset", ctypes.c_int32),
                   ("early_reads", ctypes.c_int32), ("key_transform", ctypes.c_int32)]
                + [(name, ctypes.c_uint64) for name in ("k_new", "v_new", "cos_sin")]
                + [(name, ctypes.c_int64) for name in (
                    "k_new_batch_stride", "k_new_head_stride", "v_new_batch_stride",
                    "v_new_head_stride")]
                # the query heads: the group, served in head_chunks CTAs of chunk_heads
                + [(name, ctypes.c_int32) for name in ("group_size", "head_chunks",
                                                       "chunk_heads", "table_window")]
                + PAGE_FIELDS)


assert ctypes.sizeof(DecodeParams) == 320, "must match sizeof(llfd::DecodeParams)"
