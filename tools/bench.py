#!/usr/bin/env python3
"""Benchmark of lowlevel_fd's INT8-KV decode attention, L2-honest (issue 5).

In one run: the device's read bandwidth (a streaming kernel over 2 GiB), then per workload
the per-layer time of a CUDA-graph replay of L layers with distinct caches (L x bytes >=
200 MiB), the eager (Python-launched) time, and torch SDPA over a 16-bit cache. Every result
is checked against the float64 oracle first. Prints a table on stdout and progress on stderr;
--json and --plot write the raw numbers and a PNG. Exits 1 if any check or workload failed.

    PYTHONPATH=. python3 tools/bench.py --json bench.json --plot bench.png

The multi-token rows (prefill, chunked prefill, speculative verification; issue: multi-token
attention) are tools/bench_multi.py's: `tools/bench.py --multi [its options]` runs it.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import traceback

# benchlib sits next to this file: on sys.path when run as a script, and through pytest's
# pythonpath setting (pyproject.toml) in the tests.
from benchlib.report import footnotes, format_table, fmt_us, write_json
from benchlib.session import Iterations, iterations, progress, run_metadata
from benchlib.stats import timing_record
from benchlib.workloads import (MIB, GIB, Workload, add_workload_arguments, is_l2_honest,
                                layer_count, parse_config, workloads_from_args)

TOOL = "tools/bench.py"
# After these the context is dead: every later call fails too, so the sweep stops there.
STICKY_ERRORS = ("CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_LAUNCH_FAILED",
                 "CUDA_ERROR_ILLEGAL_INSTRUCTION", "CUDA_ERROR_MISALIGNED_ADDRESS",
                 "CUDA_ERROR_HARDWARE_STACK_ERROR")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench", description=__doc__.split("\n\n")[0],
        epilog="Example: bench --shapes '1,1024;8,4096' --quick --no-baseline")
    add_workload_arguments(parser)
    parser.add_argument("--layers", type=int,
                        help="layers L per step (default: fewest with L x bytes >= 200 MiB, "
                             "2..64, capped at 40 GiB of memory)")
    parser.add_argument("--iters", type=int, help="timed replays per measurement (default 100)")
    parser.add_argument("--warmup", type=int, help="untimed replays first (default 10)")
    parser.add_argument("--quick", action="store_true", help="few iterations: a smoke run")
    parser.add_argument("--config", help="override the plan: 'num_warps,num_splits,"
                                         "min_split_tokens,fused' e.g. '4,16,128,1'")
    parser.add_argument("--no-baseline", action="store_true", help="skip torch SDPA")
    parser.add_argument("--host-overhead", action="store_true",
                        help="also time plan() and eager run() on the host (first workload)")
    parser.add_argument("--bandwidth-gib", type=float, default=2.0,
                        help="buffer size of the read-bandwidth reference (default 2, min 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    parser.add_argument("--json", metavar="PATH", help="write all raw numbers here")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG (needs matplotlib)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the planned sweep and exit (no GPU needed)")
    return parser


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[Workload], Iterations]:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        workloads = workloads_from_args(args)
        iters = iterations(args.quick, args.iters, args.warmup)
        args.tile_config = parse_config(args.config) if args.config else None
        if args.layers is not None and args.layers < 1:
            raise ValueError(f"--layers: expected >= 1, got {args.layers}")
        if args.bandwidth_gib < 2:
            raise ValueError(f"--bandwidth-gib: the reference needs >= 2 GiB, got "
                             f"{args.bandwidth_gib}")
    except ValueError as exc:
        parser.error(str(exc))
    return args, workloads, iters


def planned_layers(workload: Workload, layers: int | None) -> int:
    return layer_count(workload.bytes_per_layer, workload.footprint_per_layer, layers)


def dry_run_text(workloads: list[Workload], args: argparse.Namespace,
                 iters: Iterations) -> str:
    """The sweep as it would run: workloads, bytes, layer counts; no GPU involved."""
    lines = [f"planned sweep: {len(workloads)} workloads; per measurement {iters.warmup} "
             f"warm-up + {iters.iters} timed replays (graph), the same for eager"
             + ("" if args.no_baseline else " and for torch SDPA (if importable)"),
             f"bandwidth reference: read_bandwidth over {args.bandwidth_gib:.2f} GiB, "
             f"{iters.bandwidth_configs} launch shapes, median of {iters.bandwidth_iters} each"]
    if args.tile_config:
        lines.append(f"plan override: {args.tile_config}")
    lines.append(f"{'#':>3}  {'workload':<44} {'KV MiB':>8} {'bytes/layer':>12} {'L':>3} "
                 f"{'step MiB':>9}  {'L2-honest':<9} {'SDPA L':>6}")
    for index, w in enumerate(workloads, 1):
        layers = planned_layers(w, args.layers)
        base_layers = layer_count(w.baseline_bytes_per_layer, override=args.layers)
        lines.append(
            f"{index:>3}  {w.label:<44} {w.kv_bytes / MIB:>8.1f} {w.bytes_per_layer:>12} "
            f"{layers:>3} {layers * w.bytes_per_layer / MIB:>9.1f}  "
            f"{'yes' if is_l2_honest(layers, w.bytes_per_layer) else 'no':<9} "
            f"{'-' if args.no_baseline else base_layers:>6}")
    return "\n".join(lines)


def run_workload(result: dict, workload: Workload, args: argparse.Namespace,
                 iters: Iterations, device, stream, bandwidth_gbps: float,
                 baselines: dict) -> None:
    """Fill ``result`` step by step (so a failure keeps what was measured): plan, check,
    graph timing, eager timing, then the SDPA baseline (cached per shape and dtype)."""
    from benchlib.timing import WorkloadBench
    bench = WorkloadBench(workload, result["layers"], device, stream, seed=args.seed)
    try:
        result["plan"] = bench.replan(args.tile_config)
        result["check"] = bench.check()
        result["graph"] = timing_record(bench.graph_us(warmup=iters.warmup, iters=iters.iters),
                                        workload.bytes_per_layer, bandwidth_gbps)
        result["eager"] = timing_record(bench.eager_us(warmup=iters.warmup, iters=iters.iters),
                                        workload.bytes_per_layer, bandwidth_gbps)
    finally:
        bench.close()
    if args.no_baseline:
        return
    from benchlib.baseline import sdpa_baseline, torch_available
    if not torch_available():
        return
    key = (workload.batch, workload.seq_len, workload.num_q_heads, workload.num_kv_heads,
           workload.head_dim, workload.q_dtype)
    if key not in baselines:
        try:
            raw = sdpa_baseline(workload, warmup=iters.warmup, iters=iters.iters,
                                layers_override=args.layers)
            baselines[key] = {**timing_record(raw.pop("samples_us"), raw["bytes_per_layer"],
                                              bandwidth_gbps), **raw}
        except Exception:  # the baseline failing is reported, not fatal
            baselines[key] = {"error": traceback.format_exc()}
            progress(f"  SDPA baseline failed:\n{baselines[key]['error']}")
    if "error" in baselines[key]:
        result["baseline_error"] = baselines[key]["error"]
        return
    result["baseline"] = baselines[key]
    result["speedup"] = baselines[key]["median_us"] / result["graph"]["median_us"]


def _summary_line(result: dict) -> str:
    if result.get("error"):
        return "  ERROR: " + result["error"].strip().splitlines()[-1]
    graph, check = result.get("graph") or {}, result.get("check") or {}
    plan = result.get("plan") or {}
    text = (f"  plan w{plan.get('num_warps')} s{plan.get('num_splits')}; graph {fmt_us(graph.get('median_us'))} us/layer, {graph.get('gbps', 0):.0f} "
            f"GB/s ({graph.get('pct_of_bw') or 0:.1f}% BW), rel err "
            f"{check.get('max_rel_err', float('nan')):.1e}")
    if result.get("speedup"):
        text += f", SDPA {fmt_us(result['baseline']['median_us'])} us ({result['speedup']:.2f}x)"
    return text


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--multi"]:
        from bench_multi import main as multi_main
        return multi_main(argv[1:])
    args, workloads, iters = parse(argv)
    if args.dry_run:
        print(dry_run_text(workloads, args, iters))
        return 0
    from benchlib.kernels import BANDWIDTH_CONFIGS, measure_read_bandwidth
    from benchlib.session import device_line
    from lowlevel_fd.driver import Device, Stream
    device = Device(0)
    stream = Stream(device)
    progress(device_line(device))
    bandwidth = measure_read_bandwidth(
        device, stream, nbytes=int(args.bandwidth_gib * GIB), iters=iters.bandwidth_iters,
        configs=BANDWIDTH_CONFIGS[:iters.bandwidth_configs])
    bandwidth_gbps = bandwidth["gbps"]
    best = bandwidth["best"]
    progress(f"read bandwidth: {bandwidth_gbps:.0f} GB/s (grid {best['grid']} x "
             f"{best['threads']} threads)")
    host = None
    if args.host_overhead:
        from benchlib.host_overhead import format_host_overhead, measure_host_overhead
        host = measure_host_overhead(workloads[0], device, stream)
        progress(format_host_overhead(host))
    results, baselines = [], {}
    for index, workload in enumerate(workloads, 1):
        layers = planned_layers(workload, args.layers)
        result = {"workload": workload.as_dict(), "layers": layers,
                  "working_set_bytes": layers * workload.bytes_per_layer,
                  "l2_honest": is_l2_honest(layers, workload.bytes_per_layer), "error": None}
        progress(f"[{index}/{len(workloads)}] {workload.label}  L={layers}")
        try:
            run_workload(result, workload, args, iters, device, stream, bandwidth_gbps,
                         baselines)
        except Exception as exc:  # keep sweeping: one broken shape should not hide the others
            result["error"] = traceback.format_exc()
            progress(result["error"])
            if getattr(exc, "name", None) in STICKY_ERRORS:
                results.append(result)
                progress("the CUDA context is unusable after a kernel fault: sweep stopped")
                break
        progress(_summary_line(result))
        results.append(result)

    print(device_line(device))
    print(f"read bandwidth: {bandwidth_gbps:.0f} GB/s (read_bandwidth over "
          f"{bandwidth['bytes'] / GIB:.2f} GiB, grid {best['grid']} x {best['threads']})")
    print(format_table(results))
    print(footnotes(bandwidth_gbps))
    for note in dict.fromkeys(f"SDPA at B={r['workload']['batch']} S={r['workload']['seq_len']}: "
                              f"{r['baseline']['note']}" for r in results
                              if r.get("baseline") and r["baseline"].get("note")):
        print(note)
    if host:
        print(format_host_overhead(host))
    failures = [r["workload"]["label"] for r in results
                if r.get("error") or not (r.get("check") or {}).get("ok", False)]
    if args.json:
        write_json(args.json, {**run_metadata(TOOL, argv, device), "iterations": dataclasses.asdict(iters),
                               "bandwidth": bandwidth, "results": results,
                               "host_overhead": host, "failures": failures})
    if args.plot:
        from benchlib.plot import write_plot
        title = f"lowlevel_fd INT8-KV decode, per layer, {device.info.name}"
        if not write_plot(results, bandwidth_gbps, args.plot, title):
            progress("--plot: matplotlib is not importable; no plot written")
    stream.close()
    if failures:
        print(f"FAILED ({len(failures)}): " + "; ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
