"""lowlevel_fd: attention over an INT8 KV cache, driven from pure Python on the CUDA driver API.

Describe the cache once (KVCacheSpec); the plans read and write it: DecodePlan (decode
attention, optionally with the fused append of the step's token), MultiPlan (prefill, chunked
prefill, speculative verification), AppendPlan and PromptQuantizer (writes), DecodeStep (a
whole L-layer step as one CUDA graph).
"""
from .append import AppendPlan, PromptQuantizer, quantize_prompt
from .compiler import CompileError
from .core.spec import KVCacheSpec
from .core.support import (ERROR_BAD_PAGE, ERROR_OUTSIDE_CACHE, ERROR_PROMPT_LENGTH,
                           ERROR_QUERY_RANGE)
from .decode import DecodePlan, TileConfig
from .driver import (CudaError, Device, DeviceArray, Event, Graph, Stream, as_device_array,
                     capture, gpu_available)
from .multi import MultiPlan
from .quant import hadamard
from .step import DecodeStep, LayerBuffers

__version__ = "0.2.0"
__all__ = ["AppendPlan", "CompileError", "CudaError", "DecodePlan", "DecodeStep", "Device",
           "DeviceArray", "ERROR_BAD_PAGE", "ERROR_OUTSIDE_CACHE", "ERROR_PROMPT_LENGTH",
           "ERROR_QUERY_RANGE", "MultiPlan",
           "Event", "Graph",
           "KVCacheSpec", "LayerBuffers", "PromptQuantizer", "Stream", "TileConfig",
           "__version__", "as_device_array", "capture", "gpu_available", "hadamard",
           "quantize_prompt"]
