"""The driver layer: a thin typed wrapper over ``cuda.bindings.driver`` (no torch, no cupy)."""
from . import dtypes
from ._api import CudaError, cu
from .device import Device, device_count, driver_version, gpu_available
from .graph import Graph, capture, is_capturing
from .interop import as_device_array
from .memory import Allocation, DeviceArray, pinned_empty
from .module import ArgPack, Kernel, LaunchConfig, Module, PreparedLaunch, launch
from .stream import Event, Stream, stream_address, stream_handle

__all__ = [
    "Allocation", "ArgPack", "dtypes", "CudaError", "Device", "DeviceArray", "Event", "Graph", "Kernel",
    "LaunchConfig", "Module", "PreparedLaunch", "Stream", "as_device_array", "capture", "cu",
    "device_count", "driver_version", "gpu_available", "is_capturing", "launch", "pinned_empty",
    "stream_address", "stream_handle",
]
