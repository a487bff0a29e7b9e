"""Run-time compilation of the kernels in ``lowlevel_fd/cu`` with NVRTC, cached on disk."""
from .cache import cache_dir, cache_key, clear_memory_cache, compile_cached, nvrtc_compiles
from .nvrtc import (KERNEL_DIR, CompiledProgram, CompileError, CompileOptions, KernelResources,
                    NvrtcError, compile_source, nvrtc_version, parse_ptxas_report)

__all__ = [
    "KERNEL_DIR", "CompileError", "CompileOptions", "CompiledProgram", "KernelResources",
    "NvrtcError", "cache_dir", "cache_key", "clear_memory_cache", "compile_cached",
    "compile_source", "nvrtc_compiles", "nvrtc_version", "parse_ptxas_report",
]
