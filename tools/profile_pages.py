#!/usr/bin/env python3
"""Run one paged (or contiguous) decode workload a few times, for ncu or compute-sanitizer:
the oracle check first, then ``--runs`` plain launches of layer 0. Usage:

    PYTHONPATH=.:tools ncu --clock-control none -k regex:decode_split --launch-skip 1 \\
        python3 tools/profile_pages.py 64 8192 --layout hnd --page 1 --order ordered
"""
from __future__ import annotations

import argparse
import sys

from benchlib.timing import WorkloadBench
from benchlib.workloads import SCALE_MODES, Workload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("batch", type=int, metavar="B")
    parser.add_argument("length", type=int, metavar="S")
    parser.add_argument("--layout", default="hnd", help="bnsh/bsnh (contiguous) or nhd/hnd")
    parser.add_argument("--page", type=int, default=16, help="page size (ignored contiguous)")
    parser.add_argument("--order", default="ordered", help="benchlib.pages.PAGE_ORDERS")
    parser.add_argument("--scales", default="token", help=", ".join(SCALE_MODES))
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    from lowlevel_fd.driver import Device, Stream
    device, stream = Device(0), Stream()
    mode, scale_dtype = SCALE_MODES[args.scales]
    paged = args.layout in ("nhd", "hnd")
    work = Workload(args.batch, args.length, kv_layout=args.layout, scale_mode=mode,
                    scale_dtype=scale_dtype, page_size=args.page if paged else 0,
                    page_order=args.order)
    bench = WorkloadBench(work, 1, device, stream)
    try:
        bench.replan()
        check = bench.check()
        if not check.get("ok", True):
            print(f"check failed: {work.label}: {check}", file=sys.stderr)
            return 1
        for _ in range(args.runs):
            bench.step()
        stream.synchronize()
        print(f"{work.label}: {bench.plan.describe()}")
    finally:
        bench.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
