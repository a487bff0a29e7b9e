"""Loaded CUBIN modules, kernels, argument packing and launches."""
from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._api import cu, raw
from .device import Device
from .stream import StreamLike, stream_handle

_NUMPY_TO_CTYPES = {
    np.dtype(np.int8): ctypes.c_int8, np.dtype(np.uint8): ctypes.c_uint8,
    np.dtype(np.int16): ctypes.c_int16, np.dtype(np.uint16): ctypes.c_uint16,
    np.dtype(np.int32): ctypes.c_int32, np.dtype(np.uint32): ctypes.c_uint32,
    np.dtype(np.int64): ctypes.c_int64, np.dtype(np.uint64): ctypes.c_uint64,
    np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double,
}


def _as_ctype(value: Any) -> Any:
    """One kernel argument as a ctypes object the parameter block can point at."""
    if isinstance(value, (ctypes._SimpleCData, ctypes.Structure, ctypes.Array)):
        return value
    if isinstance(value, np.generic):
        ctype = _NUMPY_TO_CTYPES.get(value.dtype)
        if ctype is None:
            raise TypeError(f"kernel argument: no C type for numpy {value.dtype}; pass 16-bit "
                            f"floats as their bits, e.g. np.float16(x).view(np.uint16)")
        return ctype(value.item())
    if hasattr(value, "ptr") and hasattr(value, "dtype"):  # DeviceArray
        return ctypes.c_uint64(value.ptr)
    if hasattr(value, "__cuda_array_interface__"):
        return ctypes.c_uint64(value.__cuda_array_interface__["data"][0])
    if value is None:
        return ctypes.c_uint64(0)
    raise TypeError(f"kernel argument: expected a ctypes value, numpy scalar, device array or "
                    f"None, got {type(value).__name__} (wrap Python numbers, e.g. np.int32(3): "
                    f"their width is ambiguous)")


class ArgPack:
    """Kernel arguments packed once into a ``void*[]`` block; ``set`` rewrites one in place."""

    def __init__(self, *args: Any) -> None:
        self.values = [_as_ctype(a) for a in args]
        self._pointers = (ctypes.c_void_p * max(len(self.values), 1))(
            *[ctypes.addressof(v) for v in self.values])
        self.address = ctypes.addressof(self._pointers)

    def set(self, index: int, value: Any) -> None:
        slot = self.values[index]
        if isinstance(slot, ctypes.Structure):
            ctypes.memmove(ctypes.addressof(slot), ctypes.addressof(value), ctypes.sizeof(slot))
        else:
            slot.value = value.ptr if hasattr(value, "ptr") else value


@dataclass(frozen=True)
class LaunchConfig:
    """Grid and block shapes (x, y, z), dynamic shared memory in bytes, and two sm_90 launch
    attributes: ``cluster`` (thread-block cluster shape; the grid must be a multiple of it) and
    ``programmatic`` (programmatic dependent launch: the kernel may start while the previous
    kernel on the stream finishes; it must wait with griddepcontrol.wait before reading that
    kernel's results)."""

    grid: tuple[int, int, int] | int
    block: tuple[int, int, int] | int
    shared_mem: int = 0
    cluster: tuple[int, int, int] | None = None
    programmatic: bool = False

    def dims(self) -> tuple[int, ...]:
        """(gx, gy, gz, bx, by, bz); shorter tuples are padded with 1."""
        grid = tuple(self.grid) if isinstance(self.grid, tuple) else (self.grid,)
        block = tuple(self.block) if isinstance(self.block, tuple) else (self.block,)
        if not (1 <= len(grid) <= 3 and 1 <= len(block) <= 3):
            raise ValueError(f"LaunchConfig: expected 1 to 3 grid and block extents, "
                             f"got grid={self.grid} block={self.block}")
        grid, block = grid + (1,) * (3 - len(grid)), block + (1,) * (3 - len(block))
        if min(grid + block) < 1:
            raise ValueError(f"LaunchConfig: expected positive 3-D grid and block, "
                             f"got grid={self.grid} block={self.block}")
        return (*grid, *block)


class Kernel:
    """A ``__global__`` function of a loaded Module."""

    def __init__(self, module: "Module", name: str) -> None:
        self.module = module
        self.name = name
        self.handle = cu.cuModuleGetFunction(module.handle, name.encode())
        self._dynamic_shared_allowed = 48 * 1024  # the default limit of every kernel
        self._large_clusters = False

    def attribute(self, attr: str) -> int:
        return int(cu.cuFuncGetAttribute(getattr(raw.CUfunction_attribute, attr), self.handle))

    @property
    def num_registers(self) -> int:
        return self.attribute("CU_FUNC_ATTRIBUTE_NUM_REGS")

    @property
    def local_bytes(self) -> int:
        return self.attribute("CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES")

    @property
    def static_shared_bytes(self) -> int:
        return self.attribute("CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES")

    def set_max_dynamic_shared(self, nbytes: int) -> None:
        """Allow ``nbytes`` of dynamic shared memory (needed above 48 KiB)."""
        cu.cuFuncSetAttribute(
            self.handle,
            raw.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)
        self._dynamic_shared_allowed = nbytes

    def allow_dynamic_shared(self, nbytes: int) -> None:
        """Raise the dynamic shared memory limit to at least ``nbytes``, never lower it: launches
        prepared earlier with a larger size stay valid."""
        if nbytes > self._dynamic_shared_allowed:
            self.set_max_dynamic_shared(nbytes)

    def allow_large_clusters(self) -> None:
        """Permit clusters of up to 16 CTAs (8 is the portable limit); once per kernel."""
        if not self._large_clusters:
            cu.cuFuncSetAttribute(
                self.handle,
                raw.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
            self._large_clusters = True

    def occupancy(self, block_threads: int, dynamic_shared: int = 0) -> int:
        """Resident blocks per SM for this block size and dynamic shared memory."""
        return int(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            self.handle, block_threads, dynamic_shared))

    def max_active_clusters(self, config: LaunchConfig) -> int:
        """Clusters of ``config.cluster`` that the device holds at once for this launch shape
        (0 when none fits)."""
        if config.cluster is None:
            raise ValueError("max_active_clusters: the launch config has no cluster shape")
        return int(cu.cuOccupancyMaxActiveClusters(self.handle,
                                                   _extended_config(config, config.dims())))

    def prepare(self, config: LaunchConfig, *args: Any) -> "PreparedLaunch":
        return PreparedLaunch(self, config, ArgPack(*args))

    def __repr__(self) -> str:
        return f"Kernel({self.name!r})"


def _extended_config(config: LaunchConfig, dims: tuple[int, ...]) -> Any:
    """A CUlaunchConfig with the cluster / programmatic attributes, built once per launch."""
    attributes = []
    if config.cluster is not None:
        cluster = raw.CUlaunchAttribute()
        cluster.id = raw.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        cluster.value.clusterDim.x, cluster.value.clusterDim.y, cluster.value.clusterDim.z = (
            config.cluster)
        attributes.append(cluster)
    if config.programmatic:
        pdl = raw.CUlaunchAttribute()
        pdl.id = raw.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        pdl.value.programmaticStreamSerializationAllowed = 1
        attributes.append(pdl)
    extended = raw.CUlaunchConfig()
    (extended.gridDimX, extended.gridDimY, extended.gridDimZ, extended.blockDimX,
     extended.blockDimY, extended.blockDimZ) = dims
    extended.sharedMemBytes = config.shared_mem
    extended.attrs = attributes
    extended.numAttrs = len(attributes)
    return extended


class PreparedLaunch:
    """A kernel, its launch shape and a packed argument block: ``launch(stream)`` is one call."""

    __slots__ = ("kernel", "config", "args", "_dims", "_extended")

    def __init__(self, kernel: Kernel, config: LaunchConfig, args: ArgPack) -> None:
        self.kernel, self.config, self.args = kernel, config, args
        self._dims = config.dims()
        self._extended = (_extended_config(config, self._dims)
                          if config.cluster is not None or config.programmatic else None)

    def launch(self, stream: StreamLike) -> None:
        if self._extended is None:
            cu.cuLaunchKernel(self.kernel.handle, *self._dims, self.config.shared_mem,
                              stream_handle(stream), self.args.address, 0)
        else:
            self._extended.hStream = stream_handle(stream)
            cu.cuLaunchKernelEx(self._extended, self.kernel.handle, self.args.address, 0)


def launch(stream: StreamLike, config: LaunchConfig, kernel: Kernel, *args: Any) -> None:
    """Launch ``kernel`` once (packs the arguments on every call; use ``prepare`` when hot)."""
    kernel.prepare(config, *args).launch(stream)


def _unload(handle: Any, context: Any) -> None:
    try:
        cu.cuCtxSetCurrent(context)
        cu.cuModuleUnload(handle)
    except Exception:
        pass


class Module:
    """A CUBIN loaded into the device's context; ``get_kernel(name)`` looks functions up."""

    def __init__(self, cubin: bytes, device: Device | None = None) -> None:
        self.device = device or Device(0)
        self.device.set_current()
        self._image = cubin  # keep the bytes alive while the driver parses them
        self.handle = cu.cuModuleLoadData(cubin)
        self._finalizer = weakref.finalize(self, _unload, self.handle, self.device.context)
        self._kernels: dict[str, Kernel] = {}

    def get_kernel(self, name: str) -> Kernel:
        if name not in self._kernels:
            self._kernels[name] = Kernel(self, name)
        return self._kernels[name]

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> "Module":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
