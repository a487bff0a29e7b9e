"""Device memory mapped through the driver's virtual memory API (cuMemCreate / cuMemMap), with a
chosen alignment of the virtual range and size of each physical chunk: how a KV pool's backing
allocation is made, as a benchmark variable (PERF_NOTES v27: what random page order costs is
address translation). Not part of the library: an engine allocates its own pools.
"""
from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from cuda.bindings import driver as raw

from lowlevel_fd.driver import Device, DeviceArray, cu

MIB = 2**20


def _release(ptr: int, size: int, handles: list[Any], context: Any) -> None:
    try:  # a finalizer: never raise
        cu.cuCtxSetCurrent(context)
        cu.cuMemUnmap(ptr, size)
        for handle in handles:
            cu.cuMemRelease(handle)
        cu.cuMemAddressFree(ptr, size)
    except Exception:
        pass


def granularity(device: Device, recommended: bool = True) -> int:
    """The driver's minimum or recommended physical chunk size, in bytes."""
    flag = (raw.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
            if recommended else
            raw.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)
    return int(cu.cuMemGetAllocationGranularity(_prop(device), flag))


def _prop(device: Device) -> Any:
    prop = raw.CUmemAllocationProp()
    prop.type = raw.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = raw.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device.ordinal
    return prop


class MappedAllocation:
    """``nbytes`` (rounded up to ``chunk``) of device memory at a virtual address aligned to
    ``align``, backed by physical chunks of ``chunk`` bytes each; freed by ``close()``."""

    def __init__(self, nbytes: int, device: Device, *, align: int, chunk: int) -> None:
        device.set_current()
        step = granularity(device, recommended=False)
        if chunk % step or align % step:
            raise ValueError(f"MappedAllocation: chunk and align must be multiples of the "
                             f"granularity {step}, got chunk={chunk} align={align}")
        self.nbytes = -(-max(nbytes, 1) // chunk) * chunk
        self.ptr = int(cu.cuMemAddressReserve(self.nbytes, align, 0, 0))
        handles: list[Any] = []
        self._finalizer = weakref.finalize(self, _release, self.ptr, self.nbytes, handles,
                                           device.context)
        prop = _prop(device)
        for offset in range(0, self.nbytes, chunk):
            handles.append(cu.cuMemCreate(chunk, prop, 0))
            cu.cuMemMap(self.ptr + offset, chunk, 0, handles[-1], 0)
        access = raw.CUmemAccessDesc()
        access.location = prop.location
        access.flags = raw.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        cu.cuMemSetAccess(self.ptr, self.nbytes, [access], 1)

    def close(self) -> None:
        self._finalizer()


def mapped_empty(size: int, dtype: Any, device: Device, *, align: int, chunk: int
                 ) -> tuple[DeviceArray, MappedAllocation]:
    """A 1-D uninitialised DeviceArray of ``size`` elements in a MappedAllocation, and the
    allocation (the array borrows it: ``close()`` the allocation to free it)."""
    dtype = np.dtype(dtype)
    allocation = MappedAllocation(size * dtype.itemsize, device, align=align, chunk=chunk)
    return DeviceArray(allocation.ptr, (size,), dtype, device, owner=allocation), allocation
