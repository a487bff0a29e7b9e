#!/usr/bin/env python3
"""Exhaustive sweep of the decode kernel's tunables, per workload, against the planner.

Every configuration (num_warps x num_splits x min_split_tokens x fused merge) is checked
against the float64 oracle and timed exactly as tools/bench.py times the plan: L layers with
distinct caches, one CUDA graph, median of per-replay event timings. The best configuration
and the planner's automatic choice are then re-timed alternately, so drift and the optimism
of picking a minimum over many noisy medians do not bias their ratio. Issue 5's target:
auto / best <= 1.05 at every sweep shape.

    PYTHONPATH=. python3 tools/tune.py --quick --json tune.json
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import traceback

from benchlib.report import fmt_us, write_json
from benchlib.session import Iterations, iterations, progress, run_metadata
from benchlib.stats import summarize
from benchlib.workloads import (DEFAULT_SHAPES, Workload, add_workload_arguments, layer_count,
                                workloads_from_args)
from lowlevel_fd.core.support import WARP_COUNTS
from lowlevel_fd.decode.planner import MAX_CLUSTER, MAX_SPLITS, TileConfig

TOOL = "tools/tune.py"
# The issue's sweep shapes (the layout x scale-mode variants share B=8, S=4096's schedule).
TUNE_SWEEP = [Workload(b, s) for b, s in DEFAULT_SHAPES] + [Workload(32, 4096, 16, 1)]
MIN_TOKENS_PER_WARP = (16, 32)
CONFIRM_ROUNDS = 3
TARGET_RATIO = 1.05


def split_candidates(auto_splits: int, max_splits: int = MAX_SPLITS) -> list[int]:
    """1, every power of two up to ``max_splits``, the planner's pick and its neighbourhood."""
    near = {auto_splits + step for step in (-2, -1, 1, 2)}
    near |= {round(auto_splits * factor) for factor in (0.5, 0.75, 1.25, 1.5)}
    powers = {2**i for i in range(max_splits.bit_length()) if 2**i <= max_splits}
    return sorted(s for s in {1, auto_splits} | powers | near if 1 <= s <= max_splits)


def candidate_configs(auto: TileConfig, warps: tuple[int, ...] = WARP_COUNTS,
                      stages: tuple[int, ...] | None = None) -> list[TileConfig]:
    """The sweep for one workload, without duplicates, the planner's choice included. With a
    single split, min_split_tokens and the merge have no effect, so one config stands in.
    Splits merge through a cluster (sm_90, at most MAX_CLUSTER) or the last CTA; the separate
    combine kernel is tried once per warp count (it never won a probe). Two-tile steps
    (``tiles=2``) are swept with every split count, at 32 tokens per warp and step, merged the
    way the planner would (cluster on sm_90)."""
    stage_values = stages or (auto.stages,)
    configs = [auto]
    hopper = auto.programmatic  # the planner enables both features together on sm_90
    for num_warps, stage in ((w, s) for w in warps for s in stage_values):
        for splits in split_candidates(auto.num_splits):
            if splits == 1:
                configs.append(TileConfig(num_warps=num_warps, num_splits=1,
                                          min_split_tokens=32 * num_warps, fused_merge=True,
                                          stages=stage, programmatic=hopper))
                continue
            for per_warp in MIN_TOKENS_PER_WARP:
                merges = [dict(fused_merge=True)]
                if hopper and splits <= MAX_CLUSTER:
                    merges.append(dict(fused_merge=True, cluster=True))
                for merge in merges:
                    configs.append(TileConfig(num_warps=num_warps, num_splits=splits,
                                              min_split_tokens=per_warp * num_warps,
                                              stages=stage, programmatic=hopper, **merge))
        configs.append(TileConfig(num_warps=num_warps, num_splits=max(2, auto.num_splits),
                                  min_split_tokens=16 * num_warps, fused_merge=False,
                                  stages=stage, programmatic=hopper))
        for splits in split_candidates(auto.num_splits):
            cluster = hopper and 1 < splits <= MAX_CLUSTER
            configs.append(TileConfig(num_warps=num_warps, num_splits=splits,
                                      min_split_tokens=32 * num_warps, stages=stage,
                                      cluster=cluster, programmatic=hopper, tiles=2))
    return list(dict.fromkeys(configs))


def parse_ints(flag: str, text: str, allowed: tuple[int, ...] | None = None
               ) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{flag}: expected a comma list of integers, got {text!r}") from None
    if allowed and any(v not in allowed for v in values) or any(v < 0 for v in values):
        raise ValueError(f"{flag}: expected values in {allowed or '>= 0'}, got {text!r}")
    return values


def config_label(config: TileConfig) -> str:
    merge = "cluster" if config.cluster else "fused" if config.fused_merge else "combine"
    return (f"w{config.num_warps} s{config.num_splits} m{config.min_split_tokens} {merge} "
            f"st{config.stages} t{config.tiles}{' pdl' if config.programmatic else ''}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tune", description=__doc__.split("\n\n")[0])
    add_workload_arguments(parser)
    parser.add_argument("--quick", action="store_true", help="few iterations: a smoke run")
    parser.add_argument("--iters", type=int, help="timed replays per config (default 50)")
    parser.add_argument("--warmup", type=int, help="untimed replays first (default 10)")
    parser.add_argument("--layers", type=int, help="layers L (default: bench's 200 MiB rule)")
    warps = ",".join(map(str, WARP_COUNTS))
    parser.add_argument("--warps", default=warps, help=f"num_warps values (default {warps})")
    parser.add_argument("--stages", help="stages values to sweep (default: the planner's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="write every config's timings here")
    return parser


def _timed(bench, config: TileConfig, iters: Iterations) -> dict:
    """Plan with ``config``, check it, time it; a failed check is reported and not timed."""
    described = bench.replan(config)
    check = bench.check()
    record = {"config": dataclasses.asdict(config), "label": config_label(config),
              "plan": described, "check": check}
    if check["ok"]:
        summary = summarize(bench.graph_us(warmup=iters.warmup, iters=iters.iters))
        record.update(median_us=summary.median, p20_us=summary.p20, p80_us=summary.p80)
    return record


def tune_workload(workload: Workload, args: argparse.Namespace, iters: Iterations, device,
                  stream) -> dict:
    from benchlib.timing import WorkloadBench
    num_layers = layer_count(workload.bytes_per_layer, workload.footprint_per_layer,
                             args.layers)
    bench = WorkloadBench(workload, num_layers, device, stream, seed=args.seed)
    try:
        bench.replan()
        auto = bench.planned_config()
        configs = candidate_configs(auto, args.warp_values, args.stage_values)
        progress(f"{workload.label}: L={num_layers}, {len(configs)} configs, planner "
                 f"picks {config_label(auto)}")
        records = []
        for config in configs:
            try:
                record = _timed(bench, config, iters)
            except Exception as exc:
                record = {"config": dataclasses.asdict(config), "label": config_label(config)}
                if isinstance(exc, ValueError) and "exceed the device's" in str(exc):
                    record["skipped"] = str(exc)  # its shared memory does not fit: no failure
                else:
                    record["error"] = traceback.format_exc()
            records.append(record)
            status = ("skipped: does not fit" if "skipped" in record else
                      "ERROR " + record["error"].strip().splitlines()[-1]
                      if "error" in record else
                      f"FAIL rel err {record['check']['max_rel_err']:.1e}"
                      if not record["check"]["ok"] else "")
            print(f"  {record['label']:<30} {fmt_us(record.get('median_us')):>9} us/layer"
                  f"  {status}", flush=True)
        timed = [r for r in records if "median_us" in r]
        best = min(timed, key=lambda r: r["median_us"])
        best_config = TileConfig(**best["config"])
        confirm = {"auto": [], "best": []}
        for _ in range(CONFIRM_ROUNDS):  # alternate: both see the same drift
            for name, config in (("auto", auto), ("best", best_config)):
                confirm[name].append(_timed(bench, config, iters).get("median_us"))
        if None in confirm["auto"] + confirm["best"]:
            raise RuntimeError(f"a re-timed config failed its check: {confirm}")
        auto_us = summarize(confirm["auto"]).median
        best_us = summarize(confirm["best"]).median
        return {"workload": workload.as_dict(), "layers": num_layers,
                "auto": config_label(auto), "best": config_label(best_config),
                "auto_us": auto_us, "best_us": best_us, "ratio": auto_us / best_us,
                "confirm": confirm, "configs": records,
                "failures": [r["label"] for r in records
                             if "median_us" not in r and "skipped" not in r]}
    finally:
        bench.close()


def summary_table(results: list[dict]) -> str:
    lines = [f"{'workload':<44} {'planner':<28} {'us':>8}  {'best':<28} {'us':>8}  "
             f"{'auto/best':>9}"]
    for r in results:
        if "error" in r:
            lines.append(f"{r['workload']['label']:<44} ERROR")
            continue
        flag = "" if r["ratio"] <= TARGET_RATIO else "  > 1.05"
        lines.append(f"{r['workload']['label']:<44} {r['auto']:<28} {fmt_us(r['auto_us']):>8}  "
                     f"{r['best']:<28} {fmt_us(r['best_us']):>8}  {r['ratio']:>9.3f}{flag}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        workloads = workloads_from_args(args, default=TUNE_SWEEP)
        default_iters = None if args.quick else 50  # bench's 100 would double the sweep
        iters = iterations(args.quick, args.iters if args.iters is not None else default_iters,
                           args.warmup)
        args.warp_values = parse_ints("--warps", args.warps, allowed=WARP_COUNTS)
        args.stage_values = parse_ints("--stages", args.stages) if args.stages else None
        if args.stage_values and 1 in args.stage_values:  # decode.cu needs two in flight
            raise ValueError(f"--stages: expected 0 (the head_dim's default) or >= 2, got "
                             f"{args.stages!r}")
    except ValueError as exc:
        parser.error(str(exc))
    from benchlib.session import device_line
    from lowlevel_fd.driver import Device, Stream
    device = Device(0)
    stream = Stream(device)
    progress(device_line(device))
    results = []
    for workload in workloads:
        print(f"{workload.label}:", flush=True)
        try:
            results.append(tune_workload(workload, args, iters, device, stream))
        except Exception:
            results.append({"workload": workload.as_dict(), "error": traceback.format_exc()})
            progress(results[-1]["error"])
    print(device_line(device))
    print(summary_table(results))
    if args.json:
        write_json(args.json, {**run_metadata(TOOL, argv, device), "iterations": dataclasses.asdict(iters),
                               "results": results})
    stream.close()
    failed = [r["workload"]["label"] for r in results if "error" in r or r["failures"]]
    if failed:
        print(f"FAILED (errors or wrong results in): {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
