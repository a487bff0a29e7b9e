#!/usr/bin/env python3
"""What paging costs, and why: per shape, the contiguous cache against pages of each size and
layout, in random and in physical order, with the planner's plan and with deeper pipelines
(``--stages``). Separates the price of scattered pages (random vs in order), of small pages
(1 vs 16 vs 256) and of latency (stages). L2-honest graph replay of L layers, event-timed
medians (benchlib), every variant checked against the oracle first.

    PYTHONPATH=. python3 tools/probe_pages.py --shapes '8,4096;64,8192' --pages 16,256
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys

from benchlib.stats import summarize
from benchlib.timing import WorkloadBench
from benchlib.workloads import SCALE_MODES, Workload, layer_count, parse_shapes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="8,4096;64,8192", help="'B,S;B,S;...'")
    parser.add_argument("--pages", default="16,256", help="comma list of page sizes")
    parser.add_argument("--layouts", default="nhd,hnd")
    parser.add_argument("--contiguous", default="bnsh,bsnh", help="contiguous layouts to time")
    parser.add_argument("--orders", default="random,ordered")
    parser.add_argument("--storage", default="pools",
                        help="comma list: pools (K, V and scales in four pools) and/or slot "
                             "(one slot per page holding all four: benchlib.pages.PageSlot)")
    parser.add_argument("--stages", default="0", help="pipeline stages (0: the planner's)")
    parser.add_argument("--tiles", default="0", help="16-token tiles per warp step (0: the "
                                                     "planner's)")
    parser.add_argument("--splits", default="0", help="KV splits per sequence (0: the "
                                                      "planner's)")
    parser.add_argument("--cluster", default="planner",
                        help="comma list: planner, on (splits merged in a cluster), off "
                             "(merged through global memory)")
    parser.add_argument("--scales", default="token",
                        help=f"comma list of scale modes: {', '.join(SCALE_MODES)}")
    parser.add_argument("--ragged", action="store_true",
                        help="lengths uniform in [S/2, S], row 0 at S (benchlib.workloads)")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args(argv)
    from lowlevel_fd.driver import Device, Stream
    device, stream = Device(0), Stream()
    stages = [(int(s), int(t), int(n), c) for s in args.stages.split(",")
              for t in args.tiles.split(",") for n in args.splits.split(",")
              for c in args.cluster.split(",")]
    print(f"{'B':>4} {'S':>6} {'layout':>6} {'page':>5} {'order':>8} {'store':>5} "
          f"{'scales':>10} {'st/t':>6} {'splits':>7} {'us':>8} {'ratio':>6}")
    for (batch, seq_len), scales in itertools.product(parse_shapes(args.shapes),
                                                      args.scales.split(",")):
        mode, scale_dtype = SCALE_MODES[scales]
        variants = [Workload(batch, seq_len, kv_layout=layout, scale_mode=mode,
                             scale_dtype=scale_dtype, ragged=args.ragged)
                    for layout in args.contiguous.split(",")] + [
            Workload(batch, seq_len, kv_layout=layout, page_size=int(page), page_order=order,
                     page_slot=storage == "slot", scale_mode=mode, scale_dtype=scale_dtype,
                     ragged=args.ragged)
            for layout in args.layouts.split(",") for page in args.pages.split(",")
            for order in args.orders.split(",") for storage in args.storage.split(",")
            if mode == "token" or storage != "slot"]
        base = None
        for work in variants:
            bench = WorkloadBench(work, layer_count(work.bytes_per_layer,
                                                    work.footprint_per_layer), device, stream)
            try:
                for stage, tiles, splits, cluster in stages:
                    bench.replan()
                    forced = {"stages": stage} if stage else {}
                    forced.update({"tiles": tiles} if tiles else {})
                    forced.update({"num_splits": splits} if splits else {})
                    forced.update({"cluster": cluster == "on"} if cluster != "planner" else {})
                    if forced:
                        try:
                            bench.replan(dataclasses.replace(bench.planned_config(), **forced))
                        except ValueError as exc:  # its shared memory does not fit
                            print(f"  {work.label} {forced}: {exc}", flush=True)
                            continue
                    check = bench.check()
                    if not check.get("ok", True):
                        print(f"check failed: {work.label}: {check}", file=sys.stderr)
                        return 1
                    us = summarize(bench.graph_us(warmup=10, iters=args.iters)).median
                    base = base or us
                    print(f"{batch:>4} {seq_len:>6} {work.kv_layout:>6} {work.page_size:>5} "
                          f"{work.page_order if work.page_size else '-':>8} "
                          f"{'slot' if work.page_slot else ('pools' if work.page_size else '-'):>5} "
                          f"{scales:>10} "
                          f"{bench.plan.describe()['stages']:>3}/t{bench.plan.describe()['tiles']}"
                          f" {bench.plan.describe()['num_splits']:>4}"
                          f"{'c' if bench.plan.describe()['cluster'] else 'g':>3}"
                          f" {us:>8.2f} "
                          f"{us / base:>6.3f}", flush=True)
            finally:
                bench.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
