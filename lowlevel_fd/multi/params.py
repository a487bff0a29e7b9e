"""The Python twin of ``MultiParams`` in cu/multi_params.cuh: same fields, same order."""
from __future__ import annotations

import ctypes

from ..core.binding import PAGE_FIELDS

_POINTERS = ("q", "k_cache", "v_cache", "k_scale", "v_scale", "seq_lens", "qo_indptr", "out",
             "lse", "partial_out", "partial_lse", "counters", "error_flags", "cos_sin")
_STRIDES = ("q_token_stride", "q_head_stride", "out_token_stride", "out_head_stride",
            "kv_batch_stride", "kv_head_stride", "kv_token_stride", "scale_batch_stride",
            "scale_head_stride")
_INTS = ("num_kv_heads", "group_size", "num_splits", "min_split_tokens", "capacity",
         "total_q", "max_tiles", "causal", "rope")


class MultiParams(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_uint64) for name in _POINTERS]
                + [(name, ctypes.c_int64) for name in _STRIDES]
                + [("score_scale_log2", ctypes.c_float)]
                + [(name, ctypes.c_int32) for name in _INTS]
                + [("rope_theta", ctypes.c_float), ("key_transform", ctypes.c_int32)]
                + PAGE_FIELDS
                + [("tree_mask", ctypes.c_uint64), ("tree_words", ctypes.c_int32),
                   ("early_reads", ctypes.c_int32), ("decode_rows", ctypes.c_int32),
                   ("combine", ctypes.c_int32)])


assert ctypes.sizeof(MultiParams) == 288, "must match sizeof(llfd::MultiParams)"
