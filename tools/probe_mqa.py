"""Multi-query decode (Hkv = 1, groups 32 and 64) through DecodePlan and through MultiPlan with
one query token per sequence: which kernel family streams the shared KV head better.

    PYTHONPATH=.:tools python3 tools/probe_mqa.py [--json PATH]

Needs torch and a GPU. L2-honest: L >= 2 layers with distinct caches per graph replay, L x KV
bytes >= 200 MiB; us per layer (median of 30 replays); % of the read reference measured in the
same run. MultiPlan is timed at every kernel (mma.sync with ksplit 1 or split warps; on sm_90
the warpgroup kernels with CTAs of 128 and of 64 rows) x num_splits setting; the best and the
planner's own pick are reported; each MultiPlan output is compared with decode's.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys

D, S = 128, 4096
SHAPES = ((32, 32), (32, 64), (128, 32), (128, 64))  # (B, Hq), Hkv = 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    import torch
    from benchlib.kernels import measure_read_bandwidth
    from benchlib.multi_torch import time_graph
    from lowlevel_fd import DecodePlan, MultiPlan
    from lowlevel_fd.driver import Device, Stream
    from lowlevel_fd.multi.variants import WG_ROWS, ksplits, wgmma_available

    device = Device(0)
    wgmma_ok = wgmma_available(device.arch, D)
    stream = Stream(device)
    gbps = measure_read_bandwidth(device, stream)["gbps"]
    stream.close()
    print(f"read reference {gbps:.0f} GB/s", flush=True)
    rows = []
    for batch, hq in SHAPES:
        kv = batch * S * (2 * D + 8)  # int8 K and V, fp32 scales
        layers = max(2, min(64, -(-200 * 2**20 // kv)))
        g = torch.Generator(device="cuda").manual_seed(0)

        def int8():
            return torch.randint(-127, 128, (batch, 1, S, D), dtype=torch.int8, device="cuda",
                                 generator=g)

        def scales():
            return torch.rand((batch, 1, S), device="cuda", generator=g) * 0.008 + 0.004
        caches = [(int8(), int8(), scales(), scales()) for _ in range(layers)]
        lens = torch.full((batch,), S, dtype=torch.int32, device="cuda")
        q = torch.randn((batch, hq, D), dtype=torch.float16, device="cuda")
        o_dec, o_multi = torch.empty_like(q), torch.empty_like(q)
        current = torch.cuda.current_stream
        decode = DecodePlan.create(hq, 1, D, max_batch=batch, max_seq_len=S).plan([S] * batch)
        t_dec = time_graph(lambda: [decode.run(q, *c, lens, o_dec, stream=current())
                                    for c in caches], iters=30, warmup=5, per=layers)
        indptr_host = list(range(batch + 1))
        indptr = torch.tensor(indptr_host, dtype=torch.int32, device="cuda")
        multi = {}
        kernels = {"ksplit 1": {"ksplit": 1, "wgmma": False},
                   f"ksplit {ksplits(D)[-1]}": {"ksplit": ksplits(D)[-1], "wgmma": False}}
        if wgmma_ok:
            kernels.update({f"wgmma {rows}": {"wg_rows": rows} for rows in WG_ROWS})
        kernels["planner"] = {}
        diff = 0.0
        for (name, options), splits in itertools.product(kernels.items(), (None, 1, 2, 4, 8)):
            if name == "planner" and splits is not None:
                continue
            plan = MultiPlan.create(hq, 1, D, max_batch=batch, max_seq_len=S).plan(
                indptr_host, [S] * batch, causal=False, num_splits=splits, **options)
            o_multi.fill_(float("nan"))
            t = time_graph(lambda: [plan.run(q, *c, lens, indptr, o_multi, stream=current())
                                    for c in caches], iters=30, warmup=5, per=layers)
            if name == "planner":
                name = f"planner ({plan.describe()['kernel'].split('<')[0]})"
            multi[f"{name}, splits {splits or 'planned'}"] = t["median_us"]
            plan.close()
            torch.cuda.synchronize()
            diff = max(diff, float((o_dec.float() - o_multi.float()).abs().max()
                                   / o_dec.float().abs().max()))
        best = min(multi, key=multi.get)
        planned = next(key for key in multi if key.startswith("planner"))
        share = kv / 1e3 / gbps * 100  # % of the reference at 1 us
        row = {"batch": batch, "num_q_heads": hq, "num_kv_heads": 1, "layers": layers,
               "kv_bytes_per_layer": kv, "decode_us": t_dec["median_us"],
               "decode_pct": share / t_dec["median_us"], "multi_best": best,
               "multi_us": multi[best], "multi_pct": share / multi[best],
               "planned": planned, "planned_us": multi[planned],
               "planned_pct": share / multi[planned], "multi_all": multi,
               "max_rel_diff": diff}
        rows.append(row)
        print(f"B={batch} group {hq}: {kv / 2**20:.0f} MiB/layer, L={layers}: decode "
              f"{row['decode_us']:.1f} us ({row['decode_pct']:.1f}%), MultiPlan best {best}: "
              f"{row['multi_us']:.1f} us ({row['multi_pct']:.1f}%), {planned}: "
              f"{row['planned_us']:.1f} us ({row['planned_pct']:.1f}%), outputs within {diff:.1e}",
              flush=True)
        decode.close()
        caches.clear()
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"read_reference_gbps": gbps, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
