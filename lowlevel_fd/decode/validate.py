"""Argument checks for DecodePlan.run: every problem is a ValueError/TypeError that names the
argument, what was expected and what was given, raised before anything is launched."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..driver import Device, DeviceArray, as_device_array, dtypes

_DTYPES = {name: dtypes.as_dtype(name) for name in ("int8", "int32", "float16", "bfloat16",
                                                     "float32", "uint16")}


def device_array(name: str, obj: Any, device: Device) -> DeviceArray:
    if obj is None:
        raise TypeError(f"{name}: expected a device array, got None")
    try:
        array = as_device_array(obj)
    except TypeError as exc:
        raise TypeError(f"{name}: {exc}") from None
    if array.closed:
        raise ValueError(f"{name}: the array is closed (its memory was freed)")
    if array.device is not device:
        raise ValueError(f"{name}: expected an array on device {device.ordinal}, "
                         f"got one on device {array.device.ordinal}")
    return array


def dtype(name: str, array: DeviceArray, allowed: Sequence[str]) -> None:
    # Compares dtype objects, not names: numpy builds a dtype's name on every access (slow).
    for candidate in allowed:
        if array.dtype == _DTYPES[candidate]:
            return
    raise TypeError(f"{name}: expected dtype {' or '.join(allowed)}, got {array.dtype.name}")


def shape(name: str, array: DeviceArray, expected: Sequence[Any], labels: str) -> None:
    """``expected`` holds ints, or None for "any"; ``labels`` names the axes, e.g. "[B, Hq, D]"."""
    actual = array.shape
    if len(actual) == len(expected):
        for want, got in zip(expected, actual):
            if want is not None and want != got:
                break
        else:
            return
    wanted = tuple("*" if e is None else e for e in expected)
    raise ValueError(f"{name}: expected shape {labels}={wanted}, got {actual}")


def inner_contiguous(name: str, array: DeviceArray) -> None:
    if array.shape and array.shape[-1] > 1 and array.strides[-1] != array.itemsize:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride "
                         f"{array.itemsize} bytes), got stride {array.strides[-1]} bytes")


def contiguous(name: str, array: DeviceArray) -> None:
    if not array.is_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array, got strides {array.strides}")


def aligned(name: str, array: DeviceArray, nbytes: int = 16, axes: Sequence[int] = ()) -> None:
    """The base pointer and the byte strides of ``axes`` must be multiples of ``nbytes``
    (the kernels load 16-byte vectors)."""
    if array.ptr % nbytes:
        raise ValueError(f"{name}: the data pointer must be {nbytes}-byte aligned, "
                         f"got {array.ptr:#x}")
    for axis in axes:
        if array.shape[axis] > 1 and array.strides[axis] % nbytes:
            raise ValueError(f"{name}: the stride of axis {axis} must be a multiple of {nbytes} "
                             f"bytes, got {array.strides[axis]}")


def host_lengths(name: str, seq_lens: Any, max_batch: int, max_seq_len: int) -> np.ndarray:
    """Host copy of planned lengths: 1-D, integer, 1 <= B <= max_batch, 0 <= len <= max."""
    if isinstance(seq_lens, DeviceArray) or hasattr(seq_lens, "__cuda_array_interface__"):
        raise TypeError(f"{name}: plan() needs host lengths (list or numpy), got a device array")
    lengths = np.asarray(seq_lens)
    if lengths.ndim != 1 or lengths.size == 0:
        raise ValueError(f"{name}: expected a non-empty 1-D sequence of lengths, got shape "
                         f"{lengths.shape}")
    if not np.issubdtype(lengths.dtype, np.integer):
        raise TypeError(f"{name}: expected integer lengths, got dtype {lengths.dtype}")
    if lengths.size > max_batch:
        raise ValueError(f"{name}: expected at most max_batch={max_batch} sequences, "
                         f"got {lengths.size}")
    if lengths.min() < 0 or lengths.max() > max_seq_len:
        raise ValueError(f"{name}: expected lengths in [0, max_seq_len={max_seq_len}], got "
                         f"min {lengths.min()} and max {lengths.max()}")
    return lengths.astype(np.int64)


def choice(name: str, value: Any, allowed: Sequence[Any]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}: expected one of {list(allowed)}, got {value!r}")
