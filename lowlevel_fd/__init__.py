"""lowlevel_fd: flash-decoding attention over an INT8 KV cache, driven from pure Python."""
from .compiler import CompileError
from .decode import DecodePlan, TileConfig
from .driver import (CudaError, Device, DeviceArray, Event, Graph, Stream, as_device_array,
                     capture, gpu_available)

__version__ = "0.1.0"
__all__ = ["CompileError", "CudaError", "DecodePlan", "Device", "DeviceArray", "Event", "Graph",
           "Stream", "TileConfig", "__version__", "as_device_array", "capture", "gpu_available"]
