#!/usr/bin/env python3
"""The heads-together paged decode kernel (tools/benchlib/heads.cu) against the shipped decode
kernel, over the same L layers of paged pools: correctness against the float64 oracle, then
L2-honest graph replay per layer (PERF_NOTES v32).

    PYTHONPATH=.:tools python3 tools/probe_heads.py --shapes '32,4096;64,8192' --layouts hnd

Per shape: contiguous bnsh (the shipped kernel, the ratio's base), then per paged layout and
order the shipped kernel and decode_heads at each --heads (KV heads per CTA), --stages and
--splits. The heads kernel's launches reuse the shipped plan's checked parameter block
(DecodePlan.prepare_run) and its split workspace.
"""
from __future__ import annotations

import argparse
import itertools
import sys

import numpy as np
from benchlib.heads import HeadsVariant, encode_maps
from benchlib.stats import summarize
from benchlib.timing import WorkloadBench, time_graph
from benchlib.workloads import SCALE_MODES, Workload, layer_count, parse_shapes

from lowlevel_fd import TileConfig
from lowlevel_fd.core.loader import load_kernels
from lowlevel_fd.decode.variants import CombineVariant
from lowlevel_fd.driver import LaunchConfig


class HeadsBench:
    """decode_heads over a WorkloadBench's layers."""

    def __init__(self, bench: WorkloadBench, kv_heads: int, warps: int, stages: int,
                 splits: int, merge: str = "last", cluster: bool = False) -> None:
        w = bench.workload
        self.bench = bench
        group = w.num_q_heads // w.num_kv_heads
        self.variant = HeadsVariant(group, kv_heads, warps, dtype=w.q_dtype,
                                    scale_mode=w.scale_mode, scale_dtype=w.scale_dtype,
                                    stages=stages, head_dim=w.head_dim,
                                    cluster=cluster and splits > 1)
        bench.replan(TileConfig(num_splits=splits, cluster=False, fused_merge=True,
                                cta_heads=group))
        # "kernel": the splits store their partials and decode_combine (the shipped plan's
        # separate merge, same partial layout) merges them behind a programmatic launch, so
        # no attention CTA holds its slot for the merge (PERF_NOTES v32's next step).
        self.combine = None
        if merge == "kernel" and splits > 1 and not self.variant.cluster:
            variant = CombineVariant(w.head_dim, group, w.q_dtype)
            self.combine = (load_kernels(variant, bench.plan.device)[0],
                            LaunchConfig((w.num_kv_heads, w.batch), variant.threads,
                                         variant.shared_bytes, programmatic=True))
        kernel = load_kernels(self.variant, bench.plan.device)[0]
        shared = self.variant.shared_bytes(splits)
        kernel.allow_dynamic_shared(shared)
        if self.variant.cluster:
            kernel.allow_large_clusters()
        self.ctas_per_sm = kernel.occupancy(self.variant.threads, shared)
        self.registers = kernel.num_registers
        config = LaunchConfig((w.num_kv_heads // kv_heads, splits, w.batch),
                              self.variant.threads, shared, programmatic=True,
                              cluster=(1, splits, 1) if self.variant.cluster else None)
        layers = bench.layers
        self.launches = []
        for layer in range(bench.num_layers):
            call = bench.plan.prepare_run(*layers.args(layer), **layers.pages)
            # "none": partials only (timing; the output is wrong past one split)
            call._params.fused_merge = int(merge == "last")
            a = layers.layers[layer]
            scales = (a["k_scale"], a["v_scale"]) if w.scale_mode == "token" else (None, None)
            maps = encode_maps(w.kv_layout, kv_heads, a["k"], a["v"], *scales)
            self.launches.append(kernel.prepare(config, call._params, maps))
            if self.combine is not None:
                self.launches.append(self.combine[0].prepare(self.combine[1], call._params))

    def step(self) -> None:
        for launch in self.launches:
            launch.launch(self.bench.stream)

    def check(self) -> dict:
        layers, stream = self.bench.layers, self.bench.stream
        layers.layers[0]["out"].fill(float("nan"), stream=stream)
        for launch in self.launches[:1 + (self.combine is not None)]:
            launch.launch(stream)
        stream.synchronize()
        result = layers.check_output()
        result["flags"] = self.bench.plan.error_flags(stream=stream)
        result["ok"] = result["ok"] and result["flags"] == 0
        return result

    def us(self, iters: int) -> float:
        samples = time_graph(self.step, self.bench.stream, warmup=10, iters=iters)
        return summarize([1e3 * ms / self.bench.num_layers for ms in samples]).median


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="32,4096;64,8192;128,2048")
    parser.add_argument("--layouts", default="hnd,nhd")
    parser.add_argument("--pages", default="16")
    parser.add_argument("--orders", default="random,ordered")
    parser.add_argument("--heads", default="8", help="KV heads per CTA (2, 4, 8)")
    parser.add_argument("--warps", default="8", help="warps per CTA (8, 16)")
    parser.add_argument("--stages", default="4")
    parser.add_argument("--splits", default="1,2,4", help="splits per sequence")
    parser.add_argument("--scales", default="token")
    parser.add_argument("--shipped", type=int, default=1, help="0: skip the shipped paged rows")
    parser.add_argument("--merge", default="last", choices=("last", "kernel", "none"),
                        help="without a cluster: the last split merges (last), decode_combine "
                             "merges behind a programmatic launch (kernel), or the partials "
                             "are written and never merged (none: timing only, the check "
                             "then fails for more than one split)")
    parser.add_argument("--cluster", default="1", help="comma list: 1 merges the splits in a "
                                                         "cluster, 0 through global memory")
    parser.add_argument("--ragged", action="store_true",
                        help="lengths uniform in [S/2, S] (benchlib Workload.ragged)")
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args(argv)
    from lowlevel_fd.driver import Device, Stream
    device, stream = Device(0), Stream()
    print(f"{'B':>4} {'S':>6} {'layout':>6} {'page':>4} {'order':>8} {'kernel':>17} "
          f"{'splits':>6} {'us':>8} {'ratio':>6} {'err':>8}")
    failed = 0
    for (batch, seq_len), scales in itertools.product(parse_shapes(args.shapes),
                                                      args.scales.split(",")):
        mode, scale_dtype = SCALE_MODES[scales]
        base = None
        works = [Workload(batch, seq_len, scale_mode=mode, scale_dtype=scale_dtype,
                          ragged=args.ragged)] + [
            Workload(batch, seq_len, kv_layout=layout, page_size=int(page), page_order=order,
                     scale_mode=mode, scale_dtype=scale_dtype, ragged=args.ragged)
            for layout in args.layouts.split(",") for page in args.pages.split(",")
            for order in args.orders.split(",")]
        for work in works:
            bench = WorkloadBench(work, layer_count(work.bytes_per_layer,
                                                    work.footprint_per_layer), device, stream)
            label = (f"{batch:>4} {seq_len:>6} {work.kv_layout:>6} {work.page_size:>4} "
                     f"{work.page_order if work.page_size else '-':>8}")
            try:
                if not work.page_size or args.shipped:
                    described = bench.replan()
                    check = bench.check()
                    us = summarize(bench.graph_us(warmup=10, iters=args.iters)).median
                    base = base or us
                    print(f"{label} {'shipped':>17} {described['num_splits']:>6} {us:>8.2f} "
                          f"{us / base:>6.3f} {check['max_rel_err']:>8.1e}", flush=True)
                    failed += not check["ok"]
                if not work.page_size:
                    continue
                for heads, warps, stages, splits, cluster in itertools.product(
                        args.heads.split(","), args.warps.split(","), args.stages.split(","),
                        args.splits.split(","), args.cluster.split(",")):
                    if int(stages) % (int(warps) // int(heads)):
                        continue  # a stage serves one phase of warps (benchlib/heads.cu)
                    try:
                        hb = HeadsBench(bench, int(heads), int(warps), int(stages), int(splits),
                                        args.merge, cluster == "1")
                    except Exception as exc:  # shared memory or registers do not fit
                        print(f"{label} h{heads}w{warps}s{stages}: {exc}", flush=True)
                        continue
                    check = hb.check()
                    us = hb.us(args.iters)
                    kind = ("c" if hb.variant.cluster else "k" if hb.combine is not None
                            else "g")
                    name = (f"h{heads}w{warps}s{stages}{kind}"
                            f"r{hb.registers}o{hb.ctas_per_sm}")
                    print(f"{label} {name:>17} {splits:>6} {us:>8.2f} {us / base:>6.3f} "
                          f"{check['max_rel_err']:>8.1e}"
                          f"{'' if check['ok'] else ' FAILED ' + str(check)}", flush=True)
                    failed += not check["ok"] and (args.merge != "none" or splits == "1")
            finally:
                bench.close()
    return 1 if failed else 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
