"""How much per-SM parallelism a plain 16-byte streaming read needs (development aid).
Reads 64 MiB regions of a 2 GiB random buffer (a different region per launch, so L2 never
serves it) with several grid shapes; prints the median µs and GB/s per launch shape.

    PYTHONPATH=. python3 tools/stream_probe.py
"""
from __future__ import annotations

import argparse

import numpy as np
from benchlib.kernels import bench_kernel, fill_random

from lowlevel_fd.driver import Device, DeviceArray, LaunchConfig, Stream
from lowlevel_fd.timing import time_graph


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    device, stream = Device(0), Stream()
    region = 64 * 2**20
    buffer = DeviceArray.empty(32 * region, np.uint8)
    sink = DeviceArray.full(1, 0, np.uint64)
    fill_random(buffer, 7, stream)
    kernel = bench_kernel(device, "read_bandwidth")
    sms = device.sm_count
    for blocks, threads in ((sms, 128), (sms, 256), (sms, 512), (2 * sms, 128), (4 * sms, 128),
                            (2 * sms, 256), (4 * sms, 256), (8 * sms, 256), (4 * sms, 512)):
        launches = [kernel.prepare(LaunchConfig(blocks, threads),
                                   buffer[i * region:(i + 1) * region], np.uint64(region // 16),
                                   sink) for i in range(32)]
        def step() -> None:  # back to back, as in a decode step: no host gaps
            for launch in launches:
                launch.launch(stream)

        times = [ms * 1e3 / 32 for ms in time_graph(step, stream, warmup=3, iters=20)]
        med = float(np.median(times))
        print(f"grid {blocks:5d} x {threads:4d}: {med:7.2f} us  {region / med / 1e3:6.0f} GB/s "
              f"({threads * blocks // sms // 32} warps/SM)", flush=True)


if __name__ == "__main__":
    main()
