"""Zero-copy wrapping of other libraries' device arrays (torch, cupy, numba) as DeviceArrays."""
from __future__ import annotations

from typing import Any

import numpy as np

from . import dtypes
from ._api import CudaError, cu, raw
from .device import Device
from .memory import DeviceArray


def _device_of_pointer(ptr: int) -> Device:
    ordinal = cu.cuPointerGetAttribute(
        raw.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
    return Device(int(ordinal))


_INTERFACE_KEYS = ("shape", "typestr", "data")  # what _from_interface reads


def _from_interface(obj: Any, interface: dict) -> DeviceArray:
    if not isinstance(interface, dict) or any(key not in interface for key in _INTERFACE_KEYS):
        raise TypeError(f"expected a __cuda_array_interface__ dict with 'shape', 'typestr' and "
                        f"'data', got {type(obj).__name__}'s {interface!r}")
    ptr = int(interface["data"][0])
    shape = tuple(interface["shape"])
    dtype = dtypes.from_typestr(interface["typestr"])
    try:
        device = _device_of_pointer(ptr) if ptr else Device(0)
    except CudaError as exc:
        raise ValueError(f"pointer {ptr:#x} of {type(obj).__name__} is not device memory "
                         f"(cuPointerGetAttribute: {exc.name}); pass a CUDA array") from None
    return DeviceArray(ptr, shape, dtype, device, interface.get("strides"), owner=obj)


_TORCH_DTYPES: dict[Any, np.dtype] = {}


def _from_torch_like(obj: Any) -> DeviceArray:
    """A torch tensor through its own accessors: cheaper than building the array-interface
    dict, and it covers bfloat16, which torch's interface refuses. This is run()'s per-tensor
    path, so it makes the fewest calls into torch (get_device() is the ordinal, -1 on the CPU)
    and skips the DeviceArray constructor's conversions: torch gives int tuples."""
    ordinal = obj.get_device()
    if ordinal < 0:
        raise TypeError(f"expected a CUDA tensor, got a tensor on {obj.device}")
    dtype = _TORCH_DTYPES.get(obj.dtype)
    if dtype is None:
        dtype = _TORCH_DTYPES.setdefault(obj.dtype, dtypes.as_dtype(obj.dtype))
    itemsize = dtype.itemsize
    strides = tuple([s * itemsize for s in obj.stride()])
    return DeviceArray._trusted(obj.data_ptr(), tuple(obj.shape), dtype, Device(ordinal),
                                strides, obj)


def as_device_array(obj: Any) -> DeviceArray:
    """Wrap ``obj`` (DeviceArray, a torch CUDA tensor, or anything with
    ``__cuda_array_interface__``: cupy, numba) as a DeviceArray without copying; the wrapper
    keeps ``obj`` alive."""
    if isinstance(obj, DeviceArray):
        return obj
    if type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr"):
        return _from_torch_like(obj)
    try:
        interface = obj.__cuda_array_interface__
    except AttributeError:
        raise TypeError("expected a DeviceArray or an object with __cuda_array_interface__, "
                        f"got {type(obj).__name__}") from None
    return _from_interface(obj, interface)
