"""Draft verification and short chunks by kernel: how many query rows per KV head each of
MultiPlan's kernels serves best (the planner's thresholds, planner.WGMMA_MIN_ROWS and
WG64_MIN_ROWS).

    PYTHONPATH=.:tools python3 tools/probe_drafts.py [--json PATH] [--qo 4,8,16,24] [--batch 8,64]

Needs torch and a GPU. Hq=32, Hkv=8 (group 4: q_len x 4 rows per KV head), D=128, S=4096,
causal, INT8 bnsh cache with per-token fp32 scales. L2-honest: L >= 2 layers with distinct
caches per graph replay, L x KV bytes >= 200 MiB; us per layer, median of 30 replays [p20,
p80]; decode (one token per sequence) over the same caches in the same run. Each kernel (the
split-warp mma.sync kernel, the warpgroup kernels with CTAs of 64 and of 128 rows, their splits
merged as planned, by the merge kernel or by the last split) runs at the planner's splits and at
2, 4 and 8; every output is compared with the first one's.
"""
from __future__ import annotations

import argparse
import json
import sys

S = 4096
# Every kernel's splits merge as planned (in a cluster where it fits); the warpgroup kernels'
# also by the merge kernel ("kernel") and by the last split ("last"), and mma.sync's by both.
KERNELS = {"mma": {"wgmma": False}, "mma kernel": {"wgmma": False, "combine": True},
           "mma last": {"wgmma": False, "combine": False},
           "wg64": {"wg_rows": 64}, "wg128": {"wg_rows": 128},
           "wg64 kernel": {"wg_rows": 64, "combine": True},
           "wg128 kernel": {"wg_rows": 128, "combine": True},
           "wg64 last": {"wg_rows": 64, "cluster": False, "combine": False},
           "wg128 last": {"wg_rows": 128, "cluster": False, "combine": False}}


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--qo", type=ints, default=[4, 8, 16, 24])
    parser.add_argument("--batch", type=ints, default=[8, 64])
    args = parser.parse_args(argv)
    import torch
    from benchlib.multi import D, HKV, HQ
    from benchlib.multi_torch import Cache, time_graph
    from lowlevel_fd import DecodePlan, MultiPlan

    current = torch.cuda.current_stream
    rows = []
    for batch in args.batch:
        kv = batch * HKV * S * (2 * D + 8)
        layers = max(2, min(64, -(-200 * 2**20 // kv)))
        caches = [Cache(batch, S, seed=i) for i in range(layers)]
        lens = torch.full((batch,), S, dtype=torch.int32, device="cuda")
        q1 = torch.randn((batch, HQ, D), dtype=torch.float16, device="cuda")
        o1 = torch.empty_like(q1)
        with DecodePlan.create(HQ, HKV, D, max_batch=batch, max_seq_len=S) as decode:
            decode.plan([S] * batch)
            t_dec = time_graph(lambda: [decode.run(q1, c.k, c.v, c.ks, c.vs, lens, o1,
                                                   stream=current()) for c in caches],
                               iters=30, warmup=5, per=layers)
        for qo in args.qo:
            q = torch.randn((batch * qo, HQ, D), dtype=torch.float16, device="cuda")
            out = torch.empty_like(q)
            indptr_host = [i * qo for i in range(batch + 1)]
            indptr = torch.tensor(indptr_host, dtype=torch.int32, device="cuda")
            first, times, diff = None, {}, 0.0
            for name, options in KERNELS.items():
                for splits in (None, 2, 4, 8):
                    with MultiPlan.create(HQ, HKV, D, max_batch=batch, max_seq_len=S) as plan:
                        plan.plan(indptr_host, [S] * batch, num_splits=splits, **options)
                        out.fill_(float("nan"))
                        t = time_graph(lambda: [plan.run(q, c.k, c.v, c.ks, c.vs, lens, indptr,
                                                         out, stream=current())
                                                for c in caches], iters=30, warmup=5, per=layers)
                        described = plan.describe()
                        key = (f"{name}, splits {described['num_splits']}"
                               f"{', ' + described['merge'] if described['merge'] else ''}")
                        times[key + (" (planned)" if splits is None else "")] = t
                    torch.cuda.synchronize()
                    if first is None:
                        first = out.float().clone()
                    diff = max(diff, float((out.float() - first).abs().max()
                                           / first.abs().max()))
            best = min(times, key=lambda k: times[k]["median_us"])
            row = {"batch": batch, "qo_len": qo, "rows_per_kv_head": qo * HQ // HKV,
                   "layers": layers, "kv_bytes_per_layer": kv, "decode": t_dec,
                   "kernels": times, "best": best, "max_rel_diff": diff}
            rows.append(row)
            base = t_dec["median_us"]
            cells = ", ".join(f"{k} {v['median_us']:.1f} ({v['median_us'] / base:.2f}x)"
                              for k, v in times.items() if "planned" in k)
            print(f"B={batch} q_len {qo} ({row['rows_per_kv_head']} rows): decode "
                  f"{t_dec['median_us']:.1f} us; planned splits: {cells}; best {best} "
                  f"{times[best]['median_us']:.1f}; outputs within {diff:.1e}", flush=True)
        caches.clear()
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
