"""Devices and their primary contexts."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import cached_property

from ._api import CudaError, cu, raw

_lock = threading.Lock()
_devices: dict[int, "Device"] = {}
_initialized = False


def _init() -> None:
    global _initialized
    if not _initialized:
        try:
            cu.cuInit(0)
        except CudaError:
            raise
        except Exception as exc:  # libcuda.so missing: say it plainly
            raise CudaError("cuInit", raw.CUresult.CUDA_ERROR_NO_DEVICE,
                            f"no NVIDIA driver found ({type(exc).__name__})") from None
        _initialized = True


def device_count() -> int:
    """Number of visible CUDA devices; 0 when there is no driver or no GPU."""
    try:
        _init()
        return int(cu.cuDeviceGetCount())
    except CudaError:
        return 0


def gpu_available() -> bool:
    return device_count() > 0


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    arch: str
    sm_count: int
    l2_bytes: int
    max_shared_per_block_optin: int
    total_memory: int
    # Peak DRAM bandwidth in bytes/s from the memory clock and bus width (double data rate);
    # 0 where the driver reports neither. The decode planner scales its split length by it.
    memory_bandwidth: float = 0.0


class Device:
    """One GPU. ``Device(0)`` returns the same object every time; the first call retains the
    primary context and makes it current on the calling thread (other threads: set_current)."""

    def __new__(cls, ordinal: int = 0) -> "Device":
        known = _devices.get(ordinal)
        if known is not None:  # hot path (every wrapped tensor): no lock, no driver call
            return known
        with _lock:
            if ordinal in _devices:
                return _devices[ordinal]
            _init()
            count = int(cu.cuDeviceGetCount())
            if not 0 <= ordinal < count:
                raise ValueError(f"device: expected an ordinal in [0, {count}), got {ordinal}")
            self = super().__new__(cls)
            self.ordinal = ordinal
            self.handle = cu.cuDeviceGet(ordinal)
            # The primary context lives as long as the process: the driver tears it down at exit,
            # which avoids ordering problems with buffers freed during interpreter shutdown.
            self.context = cu.cuDevicePrimaryCtxRetain(self.handle)
            _devices[ordinal] = self
            self.set_current()
        return self

    def _attribute(self, attr: str) -> int:
        return int(cu.cuDeviceGetAttribute(getattr(raw.CUdevice_attribute, attr), self.handle))

    def set_current(self) -> None:
        """Make this device's primary context current on the calling thread."""
        cu.cuCtxSetCurrent(self.context)

    @cached_property
    def compute_capability(self) -> tuple[int, int]:
        return (self._attribute("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR"),
                self._attribute("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR"))

    @cached_property
    def arch(self) -> str:
        major, minor = self.compute_capability
        return f"sm_{major}{minor}"

    @cached_property
    def info(self) -> DeviceInfo:
        name = cu.cuDeviceGetName(256, self.handle)
        return DeviceInfo(
            name=name.split(b"\0", 1)[0].decode(),
            arch=self.arch,
            sm_count=self._attribute("CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT"),
            l2_bytes=self._attribute("CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE"),
            max_shared_per_block_optin=self._attribute(
                "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"),
            total_memory=int(cu.cuDeviceTotalMem(self.handle)),
            memory_bandwidth=self._memory_bandwidth(),
        )

    def _memory_bandwidth(self) -> float:
        """Peak DRAM bytes/s: memory clock (kHz) x bus width (bits) x 2 (double data rate) / 8;
        0.0 where the driver does not report them (the attributes are marked for removal)."""
        try:
            clock_khz = self._attribute("CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE")
            bus_bits = self._attribute("CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH")
        except (AttributeError, RuntimeError):
            return 0.0
        return 2.0 * 1e3 * clock_khz * bus_bits / 8

    @property
    def sm_count(self) -> int:
        return self.info.sm_count

    @property
    def memory_bandwidth(self) -> float:
        return self.info.memory_bandwidth

    def memory_info(self) -> tuple[int, int]:
        """(free, total) device memory in bytes."""
        self.set_current()
        free, total = cu.cuMemGetInfo()
        return int(free), int(total)

    def synchronize(self) -> None:
        self.set_current()
        cu.cuCtxSynchronize()

    def __repr__(self) -> str:
        return f"Device({self.ordinal}, {self.info.name!r}, {self.arch})"


def driver_version() -> int | None:
    """The driver's CUDA version as 1000*major + 10*minor, or None without a driver."""
    try:
        return int(cu.cuDriverGetVersion())
    except Exception:
        return None
