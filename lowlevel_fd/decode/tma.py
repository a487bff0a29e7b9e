"""Tensor maps of paged hnd pools for the decode kernel's bulk tensor copies (cu/decode_pages.cuh
PagedTiles::issue_tensor): pages of >= 16 tokens at head_dim 128.

SCRATCH (PERF_NOTES v31): the maps go into the parameter block (DecodeParams.tma_maps), encoded
once per (K pool, V pool) and kept on the host. LOWLEVEL_FD_TMA=0 turns the path off."""
from __future__ import annotations

import ctypes
import os
import struct
from typing import Any

from ..core.spec import KVCacheSpec
from ..driver import DeviceArray

_maps: dict[tuple, bytes] = {}


def applies(spec: KVCacheSpec) -> bool:
    return (spec.paged and spec.kv_layout == "hnd" and spec.page_size >= 16
            and spec.head_dim == 128 and os.environ.get("LOWLEVEL_FD_TMA", "1") != "0")


def _encode(pool: DeviceArray) -> bytes:
    from cuda.bindings import driver as d

    from ..driver._api import cu
    pages, heads, page, dim = pool.shape
    s = pool.strides  # bytes: int8
    tensor_map = cu.cuTensorMapEncodeTiled(
        d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8, 4, pool.ptr,
        [d.cuuint64_t(x) for x in (dim, page, heads, pages)],
        [d.cuuint64_t(x) for x in (s[2], s[1], s[0])],
        [d.cuuint32_t(x) for x in (128, 16, 1, 1)], [d.cuuint32_t(1)] * 4,
        d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    return struct.pack("16Q", *[int(word) for word in tensor_map.opaque])


def write_maps(p: Any, spec: KVCacheSpec, k: DeviceArray, v: DeviceArray) -> None:
    """The K and V pools' tensor maps into ``p`` (p.tma 0 where the path does not apply)."""
    if not applies(spec):
        p.tma = 0
        return
    key = (k.ptr, k.shape, k.strides, v.ptr, v.shape, v.strides)
    blob = _maps.get(key)
    if blob is None:
        blob = _maps[key] = _encode(k) + _encode(v)
    ctypes.memmove(p.tma_maps, blob, 256)
    p.tma = 1
