"""The Python twin of ``AppendParams`` in cu/append_params.cuh: same fields, same order."""
from __future__ import annotations

import ctypes

from ..core.binding import PAGE_FIELDS

_POINTERS = ("k_new", "v_new", "q", "q_out", "k_cache", "v_cache", "k_scale", "v_scale",
             "seq_lens", "seq_lens_out", "cos_sin", "error_flags")
_STRIDES = ("k_batch_stride", "k_head_stride", "k_token_stride",
            "v_batch_stride", "v_head_stride", "v_token_stride",
            "q_batch_stride", "q_head_stride", "q_out_batch_stride", "q_out_head_stride",
            "kv_batch_stride", "kv_head_stride", "kv_token_stride",
            "scale_batch_stride", "scale_head_stride")
_INTS = ("num_kv_heads", "num_q_heads", "capacity", "prompt_tokens", "advance")


class AppendParams(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_uint64) for name in _POINTERS]
                + [(name, ctypes.c_int64) for name in _STRIDES]
                + [("rope_theta", ctypes.c_float)]
                + [(name, ctypes.c_int32) for name in _INTS]
                + PAGE_FIELDS
                + [("starts", ctypes.c_uint64),  # prompt chunks: first positions, or null
                   ("key_transform", ctypes.c_int32)])


assert ctypes.sizeof(AppendParams) == 288, "must match sizeof(llfd::AppendParams)"
