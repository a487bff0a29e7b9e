"""Host-side cost of the API, measured with a host timer over many calls: ``plan()`` once its
variant is compiled, and the Python side of an eager ``run()`` (with DeviceArray inputs, and
with torch tensors when torch is present)."""
from __future__ import annotations

import time
from typing import Callable

from lowlevel_fd.driver import Device, Stream

from .stats import summarize
from .timing import WorkloadBench
from .workloads import Workload


def per_call_us(call: Callable[[], None], *, calls: int = 2000, block: int = 100,
                sync: Callable[[], None] | None = None) -> dict:
    """Microseconds per call, timed in blocks of ``block`` calls. ``sync`` runs between blocks,
    outside the timed region: it drains the launch queue, which would otherwise fill up and
    make the host wait for the GPU instead of measuring the host."""
    for _ in range(block):  # warm caches, lazy attributes, the allocator
        call()
    if sync:
        sync()
    per_block = []
    for _ in range(max(1, calls // block)):
        start = time.perf_counter_ns()
        for _ in range(block):
            call()
        per_block.append((time.perf_counter_ns() - start) / block / 1e3)
        if sync:
            sync()
    summary = summarize(per_block)
    return {"median_us": summary.median, "p20_us": summary.p20, "p80_us": summary.p80,
            "mean_us": summary.mean, "calls": len(per_block) * block}


def _torch_arguments(bench: WorkloadBench) -> tuple | None:
    """The run() arguments as torch tensors sharing our buffers' memory (zero-copy views),
    so only the adapter path differs; None without torch."""
    try:
        import torch
    except ImportError:
        return None
    # torch.as_tensor reads __cuda_array_interface__; bf16 (typestr <V2) is not expressible
    # there, so bf16 workloads skip this part.
    if bench.workload.q_dtype != "float16":
        return None
    try:
        return tuple(torch.as_tensor(a, device="cuda") for a in bench.layers.args(0))
    except (TypeError, RuntimeError):  # an older torch without the interface: skip, not fail
        return None


def measure_host_overhead(workload: Workload, device: Device, stream: Stream, *,
                          calls: int = 2000) -> dict:
    """plan() and eager run() host time per call on one layer of ``workload``."""
    bench = WorkloadBench(workload, 1, device, stream, seed=7)
    try:
        lengths = bench.layers.host_lengths
        bench.replan()  # compiles and loads the variant: excluded from the measurement
        result = {"workload": workload.as_dict(),
                  "plan": per_call_us(lambda: bench.plan.plan(lengths), calls=calls)}
        args = bench.layers.args(0)
        result["run_device_array"] = per_call_us(
            lambda: bench.plan.run(*args, stream=stream), calls=calls, sync=stream.synchronize)
        torch_args = _torch_arguments(bench)
        if torch_args is not None:
            result["run_torch"] = per_call_us(
                lambda: bench.plan.run(*torch_args, stream=stream), calls=calls,
                sync=stream.synchronize)
        return result
    finally:
        bench.close()


def format_host_overhead(result: dict) -> str:
    lines = [f"host overhead ({result['workload']['label']}), us per call, median [p20-p80]:"]
    for key, name in (("plan", "plan()"), ("run_device_array", "run() DeviceArray"),
                      ("run_torch", "run() torch tensors")):
        if key in result:
            r = result[key]
            lines.append(f"  {name:<22} {r['median_us']:8.2f} [{r['p20_us']:.2f}-"
                         f"{r['p80_us']:.2f}]  over {r['calls']} calls")
    return "\n".join(lines)
