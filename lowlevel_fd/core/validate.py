"""Argument checks shared by the plans' constructors, ``plan()`` and ``run()``: every problem is
a ValueError/TypeError that names the argument, what was expected and what was given, raised
before anything is compiled, written or launched."""
from __future__ import annotations

import math
import numbers
from typing import Any, Sequence

import numpy as np

from ..driver import Device, DeviceArray, as_device_array, dtypes

_DTYPES = {name: dtypes.as_dtype(name) for name in ("int8", "int32", "float16", "bfloat16",
                                                     "float32", "uint16", "uint32")}


# -- constructor options -----------------------------------------------------------------------
def integer(name: str, value: Any) -> int:
    """``value`` as a Python int; bools, floats (even 8.0), strings and None are TypeErrors."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    return int(value)


def flag(name: str, value: Any) -> bool:
    """``value`` if it is a bool; 0, 1, strings and None are TypeErrors."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")
    return value


def int8_q_option(value: Any, spec: Any) -> bool:
    """A plan's ``allow_int8_q``: a bool, True only over Hadamard-transformed keys (q's
    rounding to int8 measured harmless there, 0.35 points of top-1 without: PERF_NOTES v29)."""
    flag("allow_int8_q", value)
    if value and spec.key_transform != "hadamard":
        raise ValueError(f"allow_int8_q: q in int8 needs key_transform='hadamard' (measured "
                         f"harmless there, not without), got key_transform="
                         f"{spec.key_transform!r}")
    return value


def positive(name: str, value: Any, limit: int = 2**31) -> int:
    """``value`` as an int in [1, limit)."""
    number = integer(name, value)
    if not 1 <= number < limit:
        raise ValueError(f"{name}: expected an int in [1, {limit}), got {number}")
    return number


def real(name: str, value: Any) -> float:
    """``value`` as a finite float; what is not a real number (str, None, bool) is a TypeError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__} {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name}: expected a finite number, got {value!r}")
    return number


def sm_scale(value: Any, head_dim: int) -> float:
    """An attention plan's softmax scale: a finite non-zero real, 1/sqrt(head_dim) when None."""
    if value is None:
        return 1.0 / math.sqrt(head_dim)
    number = real("sm_scale", value)
    if number == 0.0:
        raise ValueError("sm_scale: expected a finite non-zero scale, got 0.0")
    return number


def dtype_option(name: str, value: Any, allowed: Sequence[str]) -> str:
    """A dtype given by name or as a numpy dtype, returned as the plain name that the variant
    tables are keyed by."""
    if not isinstance(value, (str, np.dtype)):
        raise TypeError(f"{name}: expected a dtype name or numpy dtype ({' or '.join(allowed)}), "
                        f"got {type(value).__name__} {value!r}")
    try:
        normalised = dtypes.as_dtype(value).name
    except (TypeError, ValueError, SyntaxError):  # numpy's dtype parser raises all three
        normalised = None
    if normalised not in allowed:
        raise ValueError(f"{name}: expected one of {list(allowed)}, got {value!r}")
    return normalised


def device_option(device: Any) -> Device:
    """The plan's device: a Device, or None for device 0. Like arrays, a device is taken by what
    it offers: an object with an int ``ordinal`` and a ``compute_capability`` (a stand-in
    that never reaches the driver) passes too."""
    if device is None:
        return Device(0)
    if isinstance(device, Device) or (
            isinstance(getattr(device, "ordinal", None), int)
            and hasattr(device, "compute_capability")):
        return device
    raise TypeError(f"device: expected a lowlevel_fd.driver.Device (or None for device 0), "
                    f"got {type(device).__name__} {device!r}")


def choice(name: str, value: Any, allowed: Sequence[Any]) -> None:
    # Compares types too: 128.0 == 128 and True == 1, but neither may become a template argument.
    if not any(type(value) is type(option) and value == option for option in allowed):
        raise ValueError(f"{name}: expected one of {list(allowed)}, got {value!r}")


# -- arrays --------------------------------------------------------------------------------------
def device_array(name: str, obj: Any, device: Device | None, *,
                 elements: bool = True) -> DeviceArray:
    """``obj`` as an open DeviceArray on ``device`` (None: any device) whose pointer and strides
    are multiples of its element size: no kernel can load or store a misaligned element
    (``elements=False`` leaves that check to the caller: ``element_aligned``)."""
    if obj is None:
        raise TypeError(f"{name}: expected a device array, got None")
    try:
        array = as_device_array(obj)
    except TypeError as exc:
        raise TypeError(f"{name}: {exc}") from None
    except ValueError as exc:  # e.g. a foreign array whose pointer is host memory
        raise ValueError(f"{name}: {exc}") from None
    if array.closed:
        raise ValueError(f"{name}: the array is closed (its memory was freed)")
    if device is not None and array.device is not device:
        raise ValueError(f"{name}: expected an array on device {device.ordinal}, "
                         f"got one on device {array.device.ordinal}")
    if elements:
        element_aligned(name, array)
    return array


def element_aligned(name: str, array: DeviceArray) -> None:
    aligned(name, array, array.itemsize, range(array.ndim))


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


def no_internal_overlap(name: str, array: DeviceArray) -> None:
    """A written array needs its own bytes for every element: no broadcast (stride 0) axis and
    no axis that steps inside the span of the axes within it (CTAs would race on those bytes)."""
    span = array.itemsize
    for stride, extent in sorted((abs(s), n) for s, n in zip(array.strides, array.shape)
                                 if n > 1):
        if stride < span:
            raise ValueError(f"{name}: is written, so its elements must not overlap; got shape "
                             f"{array.shape} with byte strides {array.strides}")
        span = stride * extent


def same_or_disjoint(name: str, array: DeviceArray, other_name: str, other: DeviceArray) -> None:
    """``array`` is ``other`` (same memory, same layout: in place) or shares none of its bytes."""
    if (array.ptr, array.shape, array.strides) == (other.ptr, other.shape, other.strides):
        return
    (low, length), (other_low, other_length) = array._span(), other._span()
    start, other_start = array.ptr + low, other.ptr + other_low
    if length and other_length and start < other_start + other_length \
            and other_start < start + length:
        raise ValueError(f"{name}: expected {other_name} itself or memory disjoint from it, got "
                         f"bytes [{start:#x}, {start + length:#x}) overlapping {other_name}'s "
                         f"[{other_start:#x}, {other_start + other_length:#x})")


def int32_count(name: str, count: int, what: str) -> None:
    """The kernels index with int32: a count of 2**31 or more would wrap negative."""
    if count >= 2**31:
        raise ValueError(f"{name}: expected fewer than 2**31 {what}, got {count}")


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
    lengths = host_array(name, seq_lens)
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


def room_for_new_token(name: str, lengths: np.ndarray, max_seq_len: int) -> None:
    """Host lengths of an appending step: every sequence must have a free slot for its token."""
    full = np.flatnonzero(lengths >= max_seq_len)
    if full.size:
        b = int(full[0])
        raise ValueError(f"{name}: sequence {b} has length {int(lengths[b])}, leaving no room "
                         f"for the new token (max_seq_len={max_seq_len})")


def host_array(name: str, values: Any) -> np.ndarray:
    """Host lengths as a numpy array; what numpy cannot read as one (ragged lists) is named."""
    try:
        return np.asarray(values)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: expected a 1-D sequence of integer lengths, got a "
                         f"{type(values).__name__} numpy cannot read as an array ({exc})") from None


def device_lengths(name: str, obj: Any, device: Device | None, batch: int | None) -> DeviceArray:
    """Per-sequence lengths on the device: int32 ``[B]``, contiguous."""
    array = device_array(name, obj, device)
    dtype(name, array, ("int32",))
    shape(name, array, (batch,), "[B]")
    contiguous(name, array)
    return array


def host_within(name: str, values: Any, batch: int, limit: int, what: str) -> None:
    """The capacity check the host can make before a launch: a host copy of device lengths,
    when the caller has one, must lie in [0, limit]; ``what`` says which limit."""
    if values is None:
        return
    host = host_array(name, values)
    if host.shape != (batch,) or not np.issubdtype(host.dtype, np.integer):
        raise ValueError(f"{name}: expected {batch} integer lengths, got {host.dtype} "
                         f"{host.shape}")
    bad = np.flatnonzero((host < 0) | (host > limit))
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"{name}: sequence {b} has length {int(host[b])}, outside [0, {limit}] "
                         f"({what}); nothing was launched")
