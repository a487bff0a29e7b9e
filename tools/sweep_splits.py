#!/usr/bin/env python3
"""The decode planner's split count against every other, over head dims, batches, lengths and
both merges: the data the planner's rules are fitted to (PERF_NOTES v36, v37). Contiguous bnsh,
fp32 token scales, uniform or ragged lengths; L2-honest graph replay, event-timed medians
(benchlib), each plan checked against the oracle first.

    PYTHONPATH=.:tools python3 tools/sweep_splits.py --head-dims 128 --batches 8,32 \
        --lengths 4096 --json /tmp/sweep.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from benchlib.stats import summarize
from benchlib.timing import WorkloadBench
from benchlib.workloads import Workload, layer_count


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def candidates(splits: list[int], max_len: int, few_pairs: bool) -> list[tuple[int, bool]]:
    """(splits, cluster merge) pairs to time: every count with both merges up to 8 splits,
    global merges beyond (the planner's cluster cap), and none shorter than 128 tokens."""
    out = []
    for n in splits:
        if max_len // n < 128 or (n > 8 and not few_pairs):
            continue
        out += [(n, False)] if n == 1 or n > 8 else [(n, True), (n, False)]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--batches", default="1,4,8,16,24,32,64,128")
    parser.add_argument("--lengths", default="1024,4096,16384")
    parser.add_argument("--splits", default="1,2,4,8,16,32")
    parser.add_argument("--heads", default="32,8", help="Hq,Hkv")
    parser.add_argument("--lengths-kind", default="uniform,ragged",
                        help="uniform and/or ragged (uniform in [S/2, S], row 0 at S)")
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--max-gib", type=float, default=1.1,
                        help="skip shapes with more int8 K and V per layer than this")
    parser.add_argument("--json", default="", help="write the rows here")
    args = parser.parse_args(argv)
    from lowlevel_fd.driver import Device, Stream
    device, stream = Device(0), Stream()
    hq, hkv = _ints(args.heads)
    rows: list[dict] = []
    meta = {"tool": "sweep_splits", "argv": sys.argv[1:], "device": device.info.name,
            "sm_count": device.sm_count, "memory_bandwidth": device.memory_bandwidth}
    print(f"# {meta}")
    print(f"{'D':>4} {'B':>4} {'S':>6} {'kind':>7} {'planner':>8} | us per splits (c cluster, "
          f"g global)", flush=True)
    for head_dim in _ints(args.head_dims):
        for kind in args.lengths_kind.split(","):
            for seq_len in _ints(args.lengths):
                for batch in _ints(args.batches):
                    work = Workload(batch, seq_len, num_q_heads=hq, num_kv_heads=hkv,
                                    head_dim=head_dim, ragged=kind == "ragged")
                    if 2 * batch * seq_len * hkv * head_dim > args.max_gib * 2**30:
                        continue
                    bench = WorkloadBench(work, layer_count(work.bytes_per_layer,
                                                            work.footprint_per_layer),
                                          device, stream)
                    try:
                        described = bench.replan()
                        planned = bench.planned_config()
                        few = 2 * batch * hkv <= device.sm_count
                        cells, timed = [], []
                        configs = [None] + candidates(_ints(args.splits), seq_len, few)
                        for config in configs:  # None: the planner's own plan
                            n, cluster = config or (planned.num_splits, planned.cluster)
                            try:
                                bench.replan(None if config is None else dataclasses.replace(
                                    planned, num_splits=n, cluster=cluster, tiles=1,
                                    min_split_tokens=min(planned.min_split_tokens, 128)))
                            except ValueError as exc:
                                print(f"  skip {n}{'c' if cluster else 'g'}: {exc}")
                                continue
                            check = bench.check()
                            if not check.get("ok", True):
                                print(f"check failed: {work.label} {n}: {check}",
                                      file=sys.stderr)
                                return 1
                            stats = summarize(bench.graph_us(warmup=5, iters=args.iters))
                            d = bench.plan.describe()
                            timed.append({"splits": n, "cluster": cluster, "us": stats.median,
                                          "planner": config is None, "tiles": d["tiles"],
                                          "p20": stats.p20, "p80": stats.p80,
                                          "ctas_per_sm": d["ctas_per_sm"],
                                          "max_rel_err": check.get("max_rel_err")})
                            cells.append(f"{'P' if config is None else ''}{n}"
                                         f"{'c' if cluster else 'g'} {stats.median:.2f}")
                        rows.append({"head_dim": head_dim, "batch": batch, "seq_len": seq_len,
                                     "kind": kind, "hq": hq, "hkv": hkv,
                                     "layers": bench.num_layers,
                                     "planner": {"splits": described["num_splits"],
                                                 "cluster": described["cluster"],
                                                 "tiles": described["tiles"]},
                                     "timed": timed})
                        tag = f"{described['num_splits']}{'c' if described['cluster'] else 'g'}"
                        print(f"{head_dim:>4} {batch:>4} {seq_len:>6} {kind:>7} {tag:>8} | "
                              + " | ".join(cells), flush=True)
                    finally:
                        bench.close()
                    if args.json:
                        with open(args.json, "w") as f:
                            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
