#!/usr/bin/env python3
"""The int8 Q K^T multi-query probe kernel (tools/benchlib/mqa_int8.cu) against the shipped
DecodePlan over the same L layers: layer 0 against the float64 oracle (with q rounded as the
kernel rounds it, and as given), then L2-honest graph replay per layer, as % of the read
reference measured in the same run (PERF_NOTES v39, v40).

    PYTHONPATH=.:tools python3 tools/probe_mqa_int8.py --shapes '128,64,1,4096;128,32,1,4096'

Shapes are B,Hq,Hkv,S (contiguous bnsh, fp32 token scales, head_dim 128); --configs lists the
kernel's STAGESxCOPIESxTEAMS[xCONTROL[xSOFTMAX]] variants (CONTROL: timing-only builds whose
outputs are wrong; their check is reported, not counted).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy as np
from benchlib.kernels import measure_read_bandwidth
from benchlib.mqa_int8 import MqaBench, MqaVariant
from benchlib.stats import summarize
from benchlib.timing import WorkloadBench, time_graph
from benchlib.workloads import Workload, layer_count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="128,64,1,4096;128,32,1,4096;32,64,1,4096")
    parser.add_argument("--configs", default="4x4x2x0x0,4x4x2x0x1",
                        help="STAGESxCOPIESxTEAMS[xCONTROL[xSOFTMAX]], comma-separated")
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args(argv)
    from lowlevel_fd import DecodePlan
    from lowlevel_fd.driver import Device, Stream
    device, stream = Device(0), Stream()
    reference = measure_read_bandwidth(device, stream)["gbps"]
    print(f"read reference {reference:.0f} GB/s", flush=True)
    print(f"{'B':>4} {'Hq':>3} {'Hkv':>3} {'S':>6} {'L':>3} {'kernel':>14} {'us':>8} {'%ref':>6} "
          f"{'[p20, p80]':>16} {'err q8':>8} {'err':>8}")
    failed = 0
    for shape in args.shapes.split(";"):
        batch, hq, hkv, seq_len = (int(x) for x in shape.split(","))
        work = Workload(batch, seq_len, num_q_heads=hq, num_kv_heads=hkv)
        layers = layer_count(work.bytes_per_layer, work.footprint_per_layer)
        bench = WorkloadBench(work, layers, device, stream)
        label = f"{batch:>4} {hq:>3} {hkv:>3} {seq_len:>6} {layers:>3}"

        def row(name: str, samples: list[float], err8: str, err: float) -> None:
            s = summarize(samples)
            share = work.bytes_per_layer / 1e3 / s.median / reference * 100
            print(f"{label} {name:>14} {s.median:>8.2f} {share:>6.1f} "
                  f"[{s.p20:>6.2f}, {s.p80:>6.2f}] {err8:>8} {err:>8.1e}", flush=True)

        try:
            described = bench.replan()
            check = bench.check()
            failed += not check["ok"]
            row(f"shipped {described['backend']}", bench.graph_us(warmup=10, iters=args.iters),
                "-", check["max_rel_err"])
            # The shipped int8-q kernel (DecodePlan with allow_int8_q) over the same layers.
            spec = dataclasses.replace(bench.plan.cache, key_transform="hadamard")
            with DecodePlan(spec, hq, max_batch=batch, max_seq_len=seq_len,
                            allow_int8_q=True) as q8:
                q8.plan(bench.layers.host_lengths)
                assert q8.describe()["multi"]["int8_q"]
                samples = time_graph(lambda: [q8.run(*bench.layers.args(i), stream=stream)
                                              for i in range(layers)], stream, warmup=10,
                                     iters=args.iters)
                row("shipped int8 q", [1e3 * ms / layers for ms in samples], "-", float("nan"))
            for config in filter(None, args.configs.split(",")):
                probe = MqaBench(bench, MqaVariant(*(int(x) for x in config.split("x"))))
                check = probe.check()
                failed += not check["ok"] and not probe.variant.control
                samples = time_graph(probe.step, stream, warmup=10, iters=args.iters)
                row(f"int8 {config} r{probe.registers}",
                    [1e3 * ms / layers for ms in samples], f"{check['err_q8']:.1e}",
                    check["err_exact"])
        finally:
            bench.close()
    return 1 if failed else 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
