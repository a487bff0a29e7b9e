"""The int8-q kernel's tensor maps (cu/multi_q8_parts.cuh Q8Maps): K and V of a contiguous
cache as (128 bytes, tokens, KV heads, sequences) with the cache's own strides, read in boxes of
one 64-token tile of one head, 128-byte swizzled (the layout its int8 MMA reads K in). Tokens
past the capacity arrive as zeros."""
from __future__ import annotations

import ctypes

from ..core.binding import CacheArrays, layout_strides
from ..core.spec import KVCacheSpec
from ..driver.tensor_map import STRIDE_ALIGN, TensorMap, encode_tiled

TILE_TOKENS = 64


class Q8Maps(ctypes.Structure):
    _fields_ = [("k", TensorMap), ("v", TensorMap)]


assert ctypes.sizeof(Q8Maps) == 256


def encode_q8_maps(maps: Q8Maps, spec: KVCacheSpec, cache: CacheArrays) -> None:
    """Write the maps of these (validated, contiguous) cache arrays into ``maps``."""
    assert not spec.paged and spec.head_dim == 128
    for name, array in (("k", cache[0]), ("v", cache[1])):
        tokens, batch_stride, head_stride, token_stride = layout_strides(spec, array)
        batch = array.shape[0]
        sizes = (spec.head_dim, tokens, spec.num_kv_heads, batch)
        # A dimension of one element may carry any stride (frameworks leave 0 or 1 there); the
        # driver takes only multiples of 16 bytes.
        strides = [s if n > 1 else STRIDE_ALIGN
                   for n, s in zip(sizes[1:], (token_stride, head_stride, batch_stride))]
        setattr(maps, name, encode_tiled(array.ptr, sizes, strides,
                                         (spec.head_dim, TILE_TOKENS, 1, 1)))
