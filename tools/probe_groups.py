#!/usr/bin/env python3
"""What a query group costs in a kernel built for more heads per CTA: for each shape and group,
the planner's plan (the group's power of two, or chunks of 16) against the same plan with
``TileConfig.cta_heads`` forced to a larger kernel. Measures whether groups that need the same
number of head blocks could share one kernel (issue: under 1% or not). L2-honest graph replay
of L layers, event-timed medians (benchlib), checked against the oracle first.

    PYTHONPATH=. python3 tools/probe_groups.py --shapes '1,1024;8,4096' --groups 1,2,4 --cta 8
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from benchlib.stats import summarize
from benchlib.timing import WorkloadBench
from benchlib.workloads import Workload, layer_count, parse_shapes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="1,1024;8,4096;32,4096", help="'B,S;B,S;...'")
    parser.add_argument("--groups", default="1,2,4", help="comma list of query groups")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--cta", type=int, default=8, help="the forced heads per CTA")
    parser.add_argument("--iters", type=int, default=100)
    args = parser.parse_args(argv)
    from lowlevel_fd.driver import Device, Stream
    device, stream = Device(0), Stream()
    print(f"{'B':>4} {'S':>6} {'group':>5} {'planner us':>11} {'cta us':>8} {'ratio':>6}")
    for batch, seq_len in parse_shapes(args.shapes):
        for group in (int(g) for g in args.groups.split(",")):
            work = Workload(batch, seq_len, group * args.kv_heads, args.kv_heads)
            bench = WorkloadBench(work, layer_count(work.bytes_per_layer,
                                                    work.footprint_per_layer), device, stream)
            try:
                times = []
                for forced in (False, True):
                    bench.replan()
                    if forced:
                        bench.replan(dataclasses.replace(bench.planned_config(),
                                                         cta_heads=args.cta))
                    check = bench.check()
                    if not check.get("ok", True):
                        print(f"check failed: {check}", file=sys.stderr)
                        return 1
                    samples = bench.graph_us(warmup=10, iters=args.iters)
                    times.append(summarize(samples).median)
            finally:
                bench.close()
            print(f"{batch:>4} {seq_len:>6} {group:>5} {times[0]:>11.2f} {times[1]:>8.2f} "
                  f"{times[1] / times[0]:>6.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
