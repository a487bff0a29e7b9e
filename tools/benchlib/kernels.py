"""The benchmark's own kernels (tools/benchlib/bench.cu): device-side random fill and the
read-bandwidth reference every decode result is compared against.

bench.cu is not part of the library (the wheel ships only lowlevel_fd/cu): it is compiled here
through the public compiler API, with lowlevel_fd/cu on the include path for common.cuh."""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from lowlevel_fd.compiler import CompiledProgram, CompileOptions, compile_source
from lowlevel_fd.driver import Device, DeviceArray, Event, Kernel, LaunchConfig, Module, Stream

from .stats import gbps, summarize

GIB = 2**30
SOURCE = Path(__file__).resolve().parent / "bench.cu"
KERNELS = ("read_bandwidth", "fill_random", "gather_tiles", "copy_pitched", "gather_bulk")  # extern "C": their names are their symbols
# (blocks per SM, threads per block): the same 2048 resident threads per SM cut different ways,
# plus an oversubscribed grid; the best one is the reference.
BANDWIDTH_CONFIGS = ((4, 512), (8, 512), (16, 256), (2, 1024), (32, 128))
_modules: dict[int, Module] = {}


@functools.lru_cache(maxsize=None)
def bench_program(arch: str) -> CompiledProgram:
    """bench.cu compiled for ``arch`` (e.g. ``"sm_90"``; no GPU needed), once per process and
    arch. Not in the library's disk cache, which holds only lowlevel_fd/cu sources."""
    return compile_source(SOURCE.read_text(), SOURCE.name, CompileOptions(arch=arch))


def bench_kernel(device: Device, name: str) -> Kernel:
    """``read_bandwidth`` or ``fill_random``, compiled for this device's arch (once per
    process) and loaded on it (once per device)."""
    if device.ordinal not in _modules:
        _modules[device.ordinal] = Module(bench_program(device.arch).cubin, device)
    return _modules[device.ordinal].get_kernel(name)


def fill_random(array: DeviceArray, seed: int, stream: Stream) -> None:
    """Overwrite a contiguous array (size a multiple of 16 bytes) with pseudo-random bytes
    derived from ``seed``; enqueued on ``stream``."""
    if not array.is_contiguous or array.nbytes % 16 or array.ptr % 16:
        raise ValueError(f"fill_random: needs a contiguous, 16-byte aligned array whose size "
                         f"is a multiple of 16 bytes, got {array!r} ({array.nbytes} bytes)")
    vectors = array.nbytes // 16
    kernel = bench_kernel(array.device, "fill_random")
    blocks = max(1, min(-(-vectors // 256), array.device.sm_count * 8))
    kernel.prepare(LaunchConfig(blocks, 256), array, np.uint64(vectors),
                   np.uint64(seed)).launch(stream)


def copy_pitched(dst_ptr: int, dst_pitch: int, src: DeviceArray, stream: Stream) -> None:
    """Scatter the rows of a contiguous 2-D ``src`` (rows of a multiple of 4 bytes) to
    ``dst_ptr + r * dst_pitch`` (4-byte aligned); enqueued on ``stream``."""
    rows, row_bytes = src.shape[0], src.nbytes // max(src.shape[0], 1)
    if not src.is_contiguous or row_bytes % 4 or dst_ptr % 4 or dst_pitch % 4:
        raise ValueError(f"copy_pitched: needs a contiguous source of 4-byte words and a "
                         f"4-byte aligned destination, got {src!r} to {dst_ptr:#x} / {dst_pitch}")
    kernel = bench_kernel(src.device, "copy_pitched")
    blocks = max(1, min(-(-src.nbytes // 4 // 256), src.device.sm_count * 8))
    kernel.prepare(LaunchConfig(blocks, 256), np.uint64(dst_ptr), np.int64(dst_pitch), src,
                   np.int64(row_bytes // 4), np.int64(rows)).launch(stream)


def measure_read_bandwidth(device: Device, stream: Stream, *, nbytes: int = 2 * GIB,
                           iters: int = 30, warmup: int = 3,
                           configs: tuple[tuple[int, int], ...] = BANDWIDTH_CONFIGS) -> dict:
    """Time ``read_bandwidth`` over ``nbytes`` of random data for each launch shape (median of
    ``iters`` event-timed runs after ``warmup``); the best median is the reference GB/s."""
    buffer = DeviceArray.empty(nbytes - nbytes % 16, np.uint8, device)
    sink = DeviceArray.full(1, 0, np.uint64, device)
    try:
        fill_random(buffer, 0x5EED, stream)
        kernel = bench_kernel(device, "read_bandwidth")
        vectors = np.uint64(buffer.nbytes // 16)
        measured = []
        for blocks_per_sm, threads in configs:
            launch = kernel.prepare(LaunchConfig(device.sm_count * blocks_per_sm, threads),
                                    buffer, vectors, sink)
            for _ in range(warmup):
                launch.launch(stream)
            events = [(Event(device), Event(device)) for _ in range(iters)]
            for start, end in events:
                start.record(stream)
                launch.launch(stream)
                end.record(stream)
            stream.synchronize()
            summary = summarize([1e3 * (end - start) for start, end in events])
            measured.append({"blocks_per_sm": blocks_per_sm, "threads": threads,
                             "grid": device.sm_count * blocks_per_sm,
                             "median_us": summary.median, "p20_us": summary.p20,
                             "p80_us": summary.p80,
                             "gbps": gbps(buffer.nbytes, summary.median)})
        best = max(measured, key=lambda m: m["gbps"])
        return {"bytes": buffer.nbytes, "iters": iters, "gbps": best["gbps"], "best": best,
                "configs": measured}
    finally:
        buffer.close()
        sink.close()
