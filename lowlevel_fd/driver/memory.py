"""Device memory: allocations, strided DeviceArray views, pinned host buffers, zero-copy interop."""
from __future__ import annotations

import ctypes
import math
import weakref
from typing import Any, Sequence

import numpy as np

from . import dtypes
from ._api import cu
from .device import Device
from .stream import StreamLike, stream_handle


def _free_device(ptr: int, context: Any) -> None:
    try:  # finalizers may run on any thread and at shutdown: never raise
        cu.cuCtxSetCurrent(context)
        cu.cuMemFree(ptr)
    except Exception:
        pass


def _free_host(ptr: int, context: Any) -> None:
    try:
        cu.cuCtxSetCurrent(context)
        cu.cuMemFreeHost(ptr)
    except Exception:
        pass


class Allocation:
    """``nbytes`` of device memory from cuMemAlloc; freed by ``close()`` or garbage collection."""

    def __init__(self, nbytes: int, device: Device) -> None:
        device.set_current()
        self.device = device
        self.nbytes = nbytes
        self.ptr = int(cu.cuMemAlloc(max(nbytes, 1)))
        self._finalizer = weakref.finalize(self, _free_device, self.ptr, device.context)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        self._finalizer()


def pinned_empty(shape: int | Sequence[int], dtype: Any = np.uint8) -> np.ndarray:
    """A numpy array in page-locked host memory (for async copies); freed with the array."""
    dtype = dtypes.as_dtype(dtype)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    device = Device(0)
    ptr = int(cu.cuMemHostAlloc(max(nbytes, 1), 0))
    buffer = (ctypes.c_byte * max(nbytes, 1)).from_address(ptr)
    weakref.finalize(buffer, _free_host, ptr, device.context)
    flat = np.frombuffer(buffer, dtype=np.uint8, count=nbytes)
    return flat.view(dtype).reshape(shape)


def _contiguous_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides, step = [], itemsize
    for extent in reversed(shape):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))


class DeviceArray:
    """A strided view of device memory: ``shape``, numpy ``dtype``, byte ``strides``, ``ptr``.

    It owns its allocation (``DeviceArray.empty``) or borrows another library's memory
    (``as_device_array``), keeping the owner alive. Exposes ``__cuda_array_interface__`` v3.
    """

    __slots__ = ("ptr", "shape", "dtype", "strides", "device", "_owner", "__weakref__")

    def __init__(self, ptr: int, shape: Sequence[int], dtype: Any, device: Device,
                 strides: Sequence[int] | None = None, owner: Any = None) -> None:
        self.ptr = int(ptr)
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtypes.as_dtype(dtype)
        self.strides = (tuple(int(s) for s in strides) if strides is not None
                        else _contiguous_strides(self.shape, self.dtype.itemsize))
        if len(self.strides) != len(self.shape):
            raise ValueError(f"strides: expected {len(self.shape)} entries, got {self.strides}")
        self.device = device
        self._owner = owner

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def _trusted(cls, ptr: int, shape: tuple[int, ...], dtype: np.dtype, device: Device,
                 strides: tuple[int, ...], owner: Any) -> "DeviceArray":
        """The constructor without its conversions and checks, for adapters whose source
        already gives int tuples of equal length and a numpy dtype (the per-call run() path)."""
        self = object.__new__(cls)
        self.ptr, self.shape, self.dtype, self.strides = ptr, shape, dtype, strides
        self.device, self._owner = device, owner
        return self

    @classmethod
    def empty(cls, shape: int | Sequence[int], dtype: Any, device: Device | None = None
              ) -> "DeviceArray":
        """Uninitialised device memory, C-contiguous."""
        device = device or Device(0)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"shape: expected non-negative extents, got {shape}")
        dtype = dtypes.as_dtype(dtype)
        allocation = Allocation(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, device)
        return cls(allocation.ptr, shape, dtype, device, owner=allocation)

    @classmethod
    def from_numpy(cls, host: np.ndarray, device: Device | None = None,
                   stream: StreamLike | None = None) -> "DeviceArray":
        """Copy a host array to a new C-contiguous device array (synchronous unless ``stream``)."""
        host = np.ascontiguousarray(host)
        array = cls.empty(host.shape, host.dtype, device)
        array.copy_from_numpy(host, stream=stream)
        return array

    @classmethod
    def full(cls, shape: int | Sequence[int], value: float, dtype: Any,
             device: Device | None = None) -> "DeviceArray":
        array = cls.empty(shape, dtype, device)
        array.fill(value)
        return array

    # -- properties ---------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    @property
    def is_contiguous(self) -> bool:
        return self.size <= 1 or self.strides == _contiguous_strides(self.shape, self.itemsize)

    @property
    def closed(self) -> bool:
        owner = self._owner
        return owner is None or bool(getattr(owner, "closed", False))

    def close(self) -> None:
        """Free memory this array allocated, or drop the reference to a borrowed owner."""
        owner, self._owner = self._owner, None
        if isinstance(owner, Allocation) and owner.ptr == self.ptr:
            owner.close()

    def __enter__(self) -> "DeviceArray":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else hex(self.ptr)
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype.name}, {state})"

    @property
    def __cuda_array_interface__(self) -> dict:
        return {
            "shape": self.shape,
            "typestr": dtypes.to_typestr(self.dtype),
            "data": (self.ptr, False),
            "strides": None if self.is_contiguous else self.strides,
            "version": 3,
            "stream": None,  # we never hold pending work on the user's behalf
        }

    # -- views --------------------------------------------------------------------------------
    def __getitem__(self, index: Any) -> "DeviceArray":
        """Basic indexing (ints, slices with positive steps); returns a view."""
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > self.ndim:
            raise IndexError(f"too many indices: {len(index)} for {self.ndim} dimensions")
        ptr, shape, strides = self.ptr, [], []
        for axis, extent in enumerate(self.shape):
            item = index[axis] if axis < len(index) else slice(None)
            stride = self.strides[axis]
            if isinstance(item, (int, np.integer)):
                position = int(item) + extent if item < 0 else int(item)
                if not 0 <= position < extent:
                    raise IndexError(f"index {item} out of range for axis {axis} of {extent}")
                ptr += position * stride
            elif isinstance(item, slice):
                start, stop, step = item.indices(extent)
                if step <= 0:
                    raise IndexError("DeviceArray slices need a positive step")
                shape.append(len(range(start, stop, step)))
                strides.append(stride * step)
                ptr += start * stride
            else:
                raise TypeError(f"index: expected ints or slices, got {type(item).__name__}")
        return DeviceArray(ptr, shape, self.dtype, self.device, strides, owner=self._owner)

    def reshape(self, *shape: int) -> "DeviceArray":
        shape = tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], int) else shape
        if shape.count(-1) == 1:  # one inferred extent, as in numpy
            known = int(np.prod([s for s in shape if s != -1], dtype=np.int64))
            shape = tuple(self.size // max(known, 1) if s == -1 else s for s in shape)
        if not self.is_contiguous:
            raise ValueError("reshape: needs a C-contiguous array")
        if int(np.prod(shape, dtype=np.int64)) != self.size:
            raise ValueError(f"reshape: cannot view {self.shape} as {shape}")
        return DeviceArray(self.ptr, shape, self.dtype, self.device, owner=self._owner)

    def view(self, dtype: Any) -> "DeviceArray":
        """Reinterpret a contiguous array's bytes as another dtype of the same size."""
        dtype = dtypes.as_dtype(dtype)
        if dtype.itemsize != self.itemsize:
            raise ValueError(f"view: dtype {dtype.name} has a different itemsize")
        return DeviceArray(self.ptr, self.shape, dtype, self.device, self.strides, self._owner)

    # -- copies -------------------------------------------------------------------------------
    def _span(self) -> tuple[int, int]:
        """Byte offset of the lowest element and the byte length that covers the view."""
        low = sum(s * (n - 1) for s, n in zip(self.strides, self.shape) if s < 0)
        high = sum(s * (n - 1) for s, n in zip(self.strides, self.shape) if s > 0)
        return low, (high - low + self.itemsize) if self.size else 0

    def numpy(self, stream: StreamLike | None = None) -> np.ndarray:
        """Copy to a new host array. Synchronous: waits for ``stream``, or for the whole device
        when no stream is given."""
        self.device.set_current()
        low, length = self._span()
        host = np.empty(length, dtype=np.uint8)
        if length:
            if stream is not None:
                cu.cuStreamSynchronize(stream_handle(stream))
            else:  # work on non-blocking streams is not ordered before the legacy stream
                cu.cuCtxSynchronize()
            cu.cuMemcpyDtoH(host.ctypes.data, self.ptr + low, length)
        strided = np.lib.stride_tricks.as_strided(
            host[-low:].view(self.dtype) if low else host.view(self.dtype),
            self.shape, self.strides)
        return np.array(strided)

    def copy_from_numpy(self, host: np.ndarray, stream: StreamLike | None = None) -> None:
        """Upload ``host`` into this contiguous array; asynchronous on ``stream`` when given
        (then ``host`` must stay alive and unchanged until the stream reaches the copy)."""
        if not self.is_contiguous:
            raise ValueError("copy_from_numpy: the destination must be C-contiguous")
        host = np.ascontiguousarray(host)
        if host.nbytes != self.nbytes:
            raise ValueError(f"host: expected {self.nbytes} bytes, got {host.nbytes}")
        if not self.nbytes:
            return
        self.device.set_current()
        if stream is None:
            cu.cuMemcpyHtoD(self.ptr, host.ctypes.data, self.nbytes)
            cu.cuCtxSynchronize()  # complete before work on non-blocking streams reads it
        else:
            cu.cuMemcpyHtoDAsync(self.ptr, host.ctypes.data, self.nbytes, stream_handle(stream))

    def copy_to_host_async(self, host: np.ndarray, stream: StreamLike) -> None:
        """Download into a contiguous (ideally pinned, see ``pinned_empty``) host array on
        ``stream``; the data is there once the stream is synchronized."""
        if not self.is_contiguous or not host.flags.c_contiguous or host.nbytes != self.nbytes:
            raise ValueError("copy_to_host_async: both sides must be contiguous and equal in size")
        self.device.set_current()
        cu.cuMemcpyDtoHAsync(host.ctypes.data, self.ptr, self.nbytes, stream_handle(stream))

    def copy_from(self, other: "DeviceArray", stream: StreamLike | None = None) -> None:
        """Device-to-device copy between two contiguous arrays of equal size."""
        if not (self.is_contiguous and other.is_contiguous) or self.nbytes != other.nbytes:
            raise ValueError("copy_from: both arrays must be contiguous and equal in size")
        self.device.set_current()
        if stream is None:
            cu.cuMemcpyDtoD(self.ptr, other.ptr, self.nbytes)
            cu.cuCtxSynchronize()
        else:
            cu.cuMemcpyDtoDAsync(self.ptr, other.ptr, self.nbytes, stream_handle(stream))

    def _contiguous_blocks(self) -> list["DeviceArray"]:
        """This view as C-contiguous pieces: iterate the outer axes until the rest is dense."""
        if self.is_contiguous:
            return [self]
        return [piece for i in range(self.shape[0]) for piece in self[i]._contiguous_blocks()]

    def fill(self, value: float, stream: StreamLike | None = None) -> None:
        """Set every element to ``value`` (NaN poisons floats); strided views fill piecewise."""
        if not self.is_contiguous:
            for block in self._contiguous_blocks():
                block.fill(value, stream)
            return
        pattern = np.array([value]).astype(self.dtype).view(f"u{self.itemsize}")[0]
        self.device.set_current()
        setter, count = {1: ("cuMemsetD8", self.nbytes), 2: ("cuMemsetD16", self.nbytes // 2),
                         4: ("cuMemsetD32", self.nbytes // 4)}.get(self.itemsize, (None, 0))
        if setter is None:  # 8-byte pattern: upload it
            self.copy_from_numpy(np.full(self.shape, value, dtype=self.dtype))
            return
        if stream is None:
            getattr(cu, setter)(self.ptr, int(pattern), count)
            cu.cuCtxSynchronize()  # memsets may return early; our streams do not wait for them
        else:
            getattr(cu, setter + "Async")(self.ptr, int(pattern), count, stream_handle(stream))
