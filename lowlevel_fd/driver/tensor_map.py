"""Tensor maps for Hopper's bulk tensor copies (TMA): the opaque 128-byte descriptor a kernel
takes by value, encoded by the driver from a base address, sizes and strides."""
from __future__ import annotations

import ctypes
from typing import Sequence

from cuda.bindings import driver as _driver

from ._api import cu

BOX_LIMIT = 256       # elements per box dimension
STRIDE_ALIGN = 16     # bytes: the base address and every stride
STRIDE_LIMIT = 1 << 40


class TensorMap(ctypes.Structure):
    """CUtensorMap: 64-byte aligned where a kernel parameter block holds it."""

    _fields_ = [("opaque", ctypes.c_uint64 * 16)]


assert ctypes.sizeof(TensorMap) == 128


def encode_tiled(address: int, dims: Sequence[int], strides: Sequence[int],
                 box: Sequence[int], *, swizzle_128b: bool = True) -> TensorMap:
    """A tiled map of bytes (uint8 elements): ``dims`` innermost first, ``strides`` in bytes
    for every dimension after the first, a ``box`` per copy; elements outside ``dims`` arrive
    as zeros. Raises ValueError for what the driver would reject."""
    if address % STRIDE_ALIGN:
        raise ValueError(f"tensor map: the base address must be {STRIDE_ALIGN}-byte aligned, "
                         f"got {address:#x}")
    for stride in strides:
        if stride % STRIDE_ALIGN or not 0 < stride < STRIDE_LIMIT:
            raise ValueError(f"tensor map: strides must be positive multiples of "
                             f"{STRIDE_ALIGN} bytes below 2^40, got {list(strides)}")
    if any(not 0 < n <= BOX_LIMIT for n in box) or any(n < 1 or n >= 1 << 32 for n in dims):
        raise ValueError(f"tensor map: box sizes in 1 .. {BOX_LIMIT} and sizes in 1 .. 2^32 - 1, "
                         f"got box {list(box)}, sizes {list(dims)}")
    d = _driver
    swizzle = (d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B if swizzle_128b
               else d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE)
    encoded = cu.cuTensorMapEncodeTiled(
        d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8, len(dims), address,
        [d.cuuint64_t(int(x)) for x in dims], [d.cuuint64_t(int(x)) for x in strides],
        [d.cuuint32_t(int(x)) for x in box], [d.cuuint32_t(1)] * len(dims),
        d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
        d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    out = TensorMap()
    for i, word in enumerate(encoded.opaque):
        out.opaque[i] = int(word)
    return out
