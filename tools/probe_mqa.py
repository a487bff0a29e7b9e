"""Multi-query decode (Hkv = 1, groups 32 and 64) through DecodePlan (as the planner routes it,
and on the decode kernel itself) and through MultiPlan with one query token per sequence:
which kernel family streams the shared KV head better.

    PYTHONPATH=.:tools python3 tools/probe_mqa.py [--shapes 'B,Hq,Hkv;...'] [--seq S]
        [--planned-only] [--int8-q] [--json PATH]

Needs torch and a GPU. L2-honest: L >= 2 layers with distinct caches per graph replay, L x KV
bytes >= 200 MiB; us per layer (median of 30 replays); % of the read reference measured in the
same run. MultiPlan is timed at every kernel (mma.sync with ksplit 1 or split warps; on sm_90
the warpgroup kernels with CTAs of 128 and of 64 rows, their splits merged as planned, in a
thread-block cluster, by the merge kernel or by the last split) x num_splits setting; the best and the
planner's own pick are reported; each MultiPlan output is compared with decode's. ``--int8-q``
adds the int8-q kernel (plans with allow_int8_q over Hadamard keys) at every split setting and
merge, and DecodePlan's route with it; its outputs differ by q's rounding (reported apart).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys

S = 4096
SHAPES = "32,32,1;32,64,1;128,32,1;128,64,1"  # B, Hq, Hkv


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """'B,Hq,Hkv;...' -> [(B, Hq, Hkv), ...]."""
    shapes = []
    for item in filter(None, text.split(";")):
        batch, hq, hkv = (int(x) for x in item.split(","))
        if hq % hkv:
            raise SystemExit(f"--shapes: Hq {hq} is not a multiple of Hkv {hkv}")
        shapes.append((batch, hq, hkv))
    return shapes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=SHAPES, help="'B,Hq,Hkv;...'")
    parser.add_argument("--seq", type=int, default=S, help="KV tokens per sequence")
    parser.add_argument("--head-dim", type=int, default=128, choices=(64, 128, 256))
    parser.add_argument("--planned-only", action="store_true",
                        help="time MultiPlan's planned kernel only")
    parser.add_argument("--int8-q", action="store_true",
                        help="also time the int8-q kernel (allow_int8_q, Hadamard keys)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    seq, D = args.seq, args.head_dim
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
    for batch, hq, hkv in parse_shapes(args.shapes):
        kv = batch * hkv * seq * (2 * D + 8)  # int8 K and V, fp32 scales
        layers = max(2, min(64, -(-200 * 2**20 // kv)))
        g = torch.Generator(device="cuda").manual_seed(0)

        def int8():
            return torch.randint(-127, 128, (batch, hkv, seq, D), dtype=torch.int8,
                                 device="cuda", generator=g)

        def scales():
            return torch.rand((batch, hkv, seq), device="cuda", generator=g) * 0.008 + 0.004
        caches = [(int8(), int8(), scales(), scales()) for _ in range(layers)]
        lens = torch.full((batch,), seq, dtype=torch.int32, device="cuda")
        q = torch.randn((batch, hq, D), dtype=torch.float16, device="cuda")
        o_dec, o_multi, o_kernel = torch.empty_like(q), torch.empty_like(q), torch.empty_like(q)
        current = torch.cuda.current_stream
        decode = DecodePlan.create(hq, hkv, D, max_batch=batch, max_seq_len=seq).plan(
            [seq] * batch)  # as the planner routes it (rule 8)
        backend = decode.describe()["backend"]
        t_dec = time_graph(lambda: [decode.run(q, *c, lens, o_dec, stream=current())
                                    for c in caches], iters=30, warmup=5, per=layers)
        kernel = DecodePlan.create(hq, hkv, D, max_batch=batch, max_seq_len=seq).plan(
            [seq] * batch, multi=False)  # the decode kernel itself
        t_kernel = time_graph(lambda: [kernel.run(q, *c, lens, o_kernel, stream=current())
                                       for c in caches], iters=30, warmup=5, per=layers)
        kernel.close()
        indptr_host = list(range(batch + 1))
        indptr = torch.tensor(indptr_host, dtype=torch.int32, device="cuda")
        multi = {}
        kernels = {"ksplit 1": {"ksplit": 1, "wgmma": False},
                   f"ksplit {ksplits(D)[-1]}": {"ksplit": ksplits(D)[-1], "wgmma": False}}
        if wgmma_ok:  # the splits merged as the planner chooses, in a cluster, by the merge
            for wg_rows in WG_ROWS:  # kernel, by the last split
                kernels[f"wgmma {wg_rows}"] = {"wg_rows": wg_rows}
                kernels[f"wgmma {wg_rows} cluster"] = {"wg_rows": wg_rows, "cluster": True}
                kernels[f"wgmma {wg_rows} kernel merge"] = {"wg_rows": wg_rows, "combine": True}
                kernels[f"wgmma {wg_rows} last split"] = {"wg_rows": wg_rows, "cluster": False,
                                                          "combine": False}
        if args.planned_only:
            kernels.clear()
        kernels["planner"] = {}
        kernels["planner, last split"] = {"combine": False}
        diff = 0.0
        for (name, options), splits in itertools.product(kernels.items(), (None, 1, 2, 3, 4, 8)):
            if name.startswith("planner") and splits is not None:
                continue
            if (options.get("cluster") and splits in (None, 1)) or (
                    "combine" in options and splits == 1):
                continue  # nothing to merge (a cluster of the planned splits may not exist)
            plan = MultiPlan.create(hq, hkv, D, max_batch=batch, max_seq_len=seq).plan(
                indptr_host, [seq] * batch, causal=False, num_splits=splits, **options)
            o_multi.fill_(float("nan"))
            t = time_graph(lambda: [plan.run(q, *c, lens, indptr, o_multi, stream=current())
                                    for c in caches], iters=30, warmup=5, per=layers)
            if name.startswith("planner"):
                described = plan.describe()
                name = (f"planner ({described['kernel'].split('<')[0]}, "
                        f"{described['merge'] or 'no'} merge)")
            multi[f"{name}, splits {splits or 'planned'}"] = t["median_us"]
            plan.close()
            torch.cuda.synchronize()
            diff = max(diff, float((o_kernel.float() - o_multi.float()).abs().max()
                                   / o_kernel.float().abs().max()))
        diff = max(diff, float((o_kernel.float() - o_dec.float()).abs().max()
                               / o_kernel.float().abs().max()))
        q8 = {}
        if args.int8_q:
            diff8 = 0.0
            q8_options = dict(max_batch=batch, max_seq_len=seq, key_transform="hadamard",
                              allow_int8_q=True)
            routed = DecodePlan.create(hq, hkv, D, **q8_options).plan([seq] * batch)
            t = time_graph(lambda: [routed.run(q, *c, lens, o_multi, stream=current())
                                    for c in caches], iters=30, warmup=5, per=layers)
            q8["DecodePlan"] = t["median_us"]
            row8 = {"decode_int8_q_us": t["median_us"], "decode_int8_q_p20_us": t["p20_us"],
                    "decode_int8_q_p80_us": t["p80_us"],
                    "decode_int8_q_plan": routed.describe()["multi"]}
            routed.close()
            for splits, combine in itertools.product((None, 1, 2, 3, 4, 6, 8), (None, False)):
                if combine is False and splits in (None, 1):
                    continue
                plan = MultiPlan.create(hq, hkv, D, **q8_options).plan(
                    None, [seq] * batch, causal=False, num_splits=splits, combine=combine,
                    int8_q=True)
                o_multi.fill_(float("nan"))
                t = time_graph(lambda: [plan.run(q, *c, lens, None, o_multi, stream=current())
                                        for c in caches], iters=30, warmup=5, per=layers)
                merge = "last split" if combine is False else "merge kernel"
                q8[f"int8 q, splits {splits or 'planned'}, {merge}"] = t["median_us"]
                plan.close()
                torch.cuda.synchronize()
                diff8 = max(diff8, float((o_kernel.float() - o_multi.float()).abs().max()
                                         / o_kernel.float().abs().max()))
        best = min(multi, key=multi.get)
        planned = next(key for key in multi if key.startswith("planner"))
        share = kv / 1e3 / gbps * 100  # % of the reference at 1 us
        row = {"head_dim": D, "batch": batch, "num_q_heads": hq, "num_kv_heads": hkv, "seq_len": seq,
               "layers": layers,
               "kv_bytes_per_layer": kv, "decode_backend": backend,
               "decode_us": t_dec["median_us"], "decode_p20_us": t_dec["p20_us"],
               "decode_p80_us": t_dec["p80_us"], "decode_pct": share / t_dec["median_us"],
               "decode_kernel_us": t_kernel["median_us"],
               "decode_kernel_pct": share / t_kernel["median_us"], "multi_best": best,
               "multi_us": multi[best], "multi_pct": share / multi[best],
               "planned": planned, "planned_us": multi[planned],
               "planned_pct": share / multi[planned], "multi_all": multi,
               "max_rel_diff": diff}
        if q8:
            best8 = min(q8, key=q8.get)
            row.update(row8, int8_q_all=q8, int8_q_best=best8, int8_q_best_us=q8[best8],
                       int8_q_best_pct=share / q8[best8],
                       decode_int8_q_pct=share / q8["DecodePlan"],
                       max_rel_diff_int8_q=diff8)
            print(f"  int8 q: DecodePlan {q8['DecodePlan']:.1f} us "
                  f"({share / q8['DecodePlan']:.1f}%, p20/p80 {row8['decode_int8_q_p20_us']:.1f}/"
                  f"{row8['decode_int8_q_p80_us']:.1f}), best {best8} {q8[best8]:.1f} us "
                  f"({share / q8[best8]:.1f}%); all: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in q8.items())
                  + f"; outputs within {diff8:.1e} of the decode kernel's (q rounded)",
                  flush=True)
        rows.append(row)
        print(f"B={batch} Hq={hq} Hkv={hkv}: {kv / 2**20:.0f} MiB/layer, L={layers}: DecodePlan "
              f"({backend}) {row['decode_us']:.1f} us ({row['decode_pct']:.1f}%, p20/p80 "
              f"{t_dec['p20_us']:.1f}/{t_dec['p80_us']:.1f}), decode kernel "
              f"{row['decode_kernel_us']:.1f} us ({row['decode_kernel_pct']:.1f}%), "
              f"MultiPlan best {best}: "
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
